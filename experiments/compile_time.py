"""Where ZeRO++'s compile time goes: trace + lower and XLA compile, timed apart, for XLA
FSDP, ZeRO-3, ZeRO++ and ZeRO++ with one technique switched off (or ZeRO-3 with one on).

    python experiments/compile_time.py                      # 125m on 16 x 8, 2 compiles each
    python experiments/compile_time.py --repeats 1 --mesh 4x8 --variants "ZeRO-3,ZeRO++"
    python experiments/compile_time.py --quick              # tiny on 2 x 4 (seconds)

The step is `experiments/memory.py`'s. Each variant runs in a worker with `nodes * local`
emulated CPU devices; each repeat clears jax's caches, builds a fresh step and times
`step.lower(state, batch)` and `.compile()` apart. The worker runs with
`TF_CPP_VMODULE=hlo_pass_pipeline=1,cpu_compiler=2` and reads XLA's timers from its log: the
HLO passes (`hlo_passes_s`, and per pass) and the CPU backend (`backend_s`: `emit_s`, HLO to
LLVM IR, one module per kernel, `kernel_modules` of them; `llvm_s`, LLVM to machine code).
Writes `compile_time.{md,csv}` into `--out` (default `experiments/results/compile_time/`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import re
import shlex
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import _engines  # noqa: E402
import memory  # noqa: E402

VARIANTS = {  # name: (engine of `_engines`, ZeroPPConfig overrides)
    "XLA FSDP": ("xla_fsdp", {}),
    "ZeRO-3": ("zero3", {}),
    "ZeRO++": ("zeropp", {}),
    "ZeRO++ weight_bits=None": ("zeropp", {"weight_bits": None}),
    "ZeRO++ hierarchical=False": ("zeropp", {"hierarchical": False}),
    "ZeRO++ grad_bits=None": ("zeropp", {"grad_bits": None}),
    "ZeRO-3 + weight_bits=8": ("zero3", {"weight_bits": 8}),
    "ZeRO-3 + hierarchical": ("zero3", {"hierarchical": True}),
    "ZeRO-3 + grad_bits=4": ("zero3", {"grad_bits": 4}),
    "ZeRO++ float32": ("zeropp", {"compute_dtype": "float32"}),
}
DEFAULT = tuple(v for v in VARIANTS if v != "ZeRO++ float32")  # both engines compute in bf16
VMODULE = "hlo_pass_pipeline=1,cpu_compiler=2"
DETAIL = ("passes", "ops", "sources")

_PIPELINE = re.compile(r"Running HLO pass pipeline on module \S+: (.+)$", re.M)
_PASS = re.compile(r"\] HLO pass: (.+?) time: .*?\((\d+) us\)")
_HLO_PASSES = re.compile(r"Running HLO passes on \[.*?\] for CPU time: .*?\((\d+) us\)")
_BACKEND = re.compile(r"Compiling \[.*?\] for CPU using JIT time: .*?\((\d+) us\)")
_STAMP = r"^I\d{4} (\d\d):(\d\d):([\d.]+) .*?"
_EMIT_START = re.compile(_STAMP + r"Compiling: ", re.M)
_LLVM_START = re.compile(_STAMP + r"Compile LLVM module with", re.M)
_LLVM_END = re.compile(_STAMP + r"Compilation finished", re.M)
_MLIR_OP = re.compile(r"^\s*(?:%[^=]*= )?\"?([a-z_]+\.[a-z_.]+)", re.M)


def _build(variant: str, size: str, mesh_shape: tuple[int, int], seq: int):
    """`(make_step, state, batch)` for one variant, as `memory.measure` builds its rows;
    `make_step()` returns a fresh, untraced step."""
    import jax
    import jax.numpy as jnp
    from _library import BATCH_SPEC
    from jax.sharding import NamedSharding

    import zeropp_jax as zpp
    from zeropp_jax.train.cli import make_optimizer, train_step
    from zeropp_jax.train.flags import gpt_config, parse_args
    from zeropp_jax.train.model import GPT, init_fn

    nodes, local = mesh_shape
    n = nodes * local
    args = parse_args(
        ["--model", size, "--remat", "full", "--seq-len", str(seq), "--batch", str(n)]
    )
    gpt, tx = gpt_config(args), make_optimizer(args)
    model, params = GPT(gpt), init_fn(gpt, 0)
    mesh = zpp.make_mesh(nodes, local, devices=jax.devices()[:n])
    batch = jax.ShapeDtypeStruct((n, seq + 1), jnp.int32, sharding=NamedSharding(mesh, BATCH_SPEC))
    engine, overrides = VARIANTS[variant]
    state, make_step = _engines.build(
        engine,
        apply_fn=model.apply,
        params=params,
        tx=tx,
        mesh=mesh,
        overrides=overrides,
        abstract=True,
    )
    return (lambda: make_step(train_step)), state, batch


@contextlib.contextmanager
def _stderr_into(log: list[str]):
    """Sends file descriptor 2 (XLA's C++ log) into a temporary file; appends its text."""
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            log.append(f.read().decode(errors="replace"))


def _stamp(pattern: re.Pattern, log: str) -> float:
    """Seconds of the day of the last log line `pattern` matches."""
    h, m, s = pattern.findall(log)[-1]
    return int(h) * 3600 + int(m) * 60 + float(s)


def xla_timers(log: str) -> dict:
    """XLA's timers in one compile's log (see the module docstring); per pass, the leaf
    passes only (a nested pipeline is also logged as a pass)."""
    pipelines = set(_PIPELINE.findall(log))
    per_pass: dict[str, float] = collections.defaultdict(float)
    for name, us in _PASS.findall(log):
        if name not in pipelines:
            per_pass[name] += int(us) / 1e6
    return {
        "hlo_passes_s": sum(int(us) for us in _HLO_PASSES.findall(log)) / 1e6,
        "backend_s": sum(int(us) for us in _BACKEND.findall(log)) / 1e6,
        "emit_s": _stamp(_LLVM_START, log) - _stamp(_EMIT_START, log),
        "llvm_s": _stamp(_LLVM_END, log) - _stamp(_LLVM_START, log),
        "kernel_modules": log.count("Running LLVM verifier"),
        "passes": dict(per_pass),
    }


def hlo_sizes(lowered_text: str, compiled_text: str) -> tuple[dict, dict, dict]:
    """Sizes of the lowered StableHLO and the compiled HLO; and the compiled instructions
    counted by opcode and by the file and function of their innermost stack frame."""
    from _library import hlo_text

    module = hlo_text.parse_hlo_module(compiled_text)
    instructions = [i for comp in module.computations.values() for i in comp]
    ops = collections.Counter(i.opcode for i in instructions)
    where = {f: f"{loc[0].rsplit('/', 1)[-1]}:{loc[1]}" for f, loc in module.locations.items()}
    sources = collections.Counter(where.get(i.frame, "?") for i in instructions)
    mlir_ops = _MLIR_OP.findall(lowered_text)
    sizes = {
        "stablehlo_kchars": round(len(lowered_text) / 1e3),
        "stablehlo_ops": len(mlir_ops),
        "stablehlo_funcs": mlir_ops.count("func.func"),
        "hlo_lines": compiled_text.count("\n"),
        "hlo_instructions": len(instructions),
        "fusions": ops["fusion"],
        "whiles": ops["while"],
        "computations": len(module.computations),
    }
    return sizes, dict(ops), dict(sources)


def worker(argv: list[str]) -> None:
    """`--worker VARIANT SIZE MESH SEQ REPEATS`: prints one JSON row."""
    variant, size, mesh, seq, repeats = argv
    nodes, local = (int(v) for v in mesh.split("x"))
    os.environ["TF_CPP_VMODULE"] = VMODULE
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    _common.request_cpu_devices(nodes * local)
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    warnings.simplefilter("ignore")  # the engine's per-leaf notes
    make_step, state, batch = _build(variant, size, (nodes, local), int(seq))
    lower_s, compile_s, cpu_s, timers = [], [], [], []
    for _ in range(int(repeats)):
        jax.clear_caches()
        step = make_step()
        t = time.perf_counter()
        lowered = step.lower(state, batch)
        lower_s.append(time.perf_counter() - t)
        t, cpu = time.perf_counter(), time.process_time()
        with _stderr_into(log := []):
            compiled = lowered.compile()
        compile_s.append(time.perf_counter() - t)
        cpu_s.append(time.process_time() - cpu)
        timers.append(xla_timers(log[0]))
    sizes, ops, sources = hlo_sizes(lowered.as_text(), compiled.as_text())

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 2)

    keys = ("hlo_passes_s", "backend_s", "emit_s", "llvm_s")
    timer = {k: median([t[k] for t in timers]) for k in keys}
    passes = {p: median([t["passes"].get(p, 0.0) for t in timers]) for p in timers[0]["passes"]}
    row = {
        "variant": variant,
        "lower_s": median(lower_s),
        "compile_s": median(compile_s),
        "compile_cpu_s": median(cpu_s),
        **timer,
        "other_s": round(median(compile_s) - timer["hlo_passes_s"] - timer["backend_s"], 2),
        "kernel_modules": timers[-1]["kernel_modules"],
        **sizes,
        "load_1min": round(os.getloadavg()[0], 1),
        "lower_runs_s": " ".join(f"{s:.1f}" for s in lower_s),
        "compile_runs_s": " ".join(f"{s:.1f}" for s in compile_s),
    }
    print(json.dumps({**row, "passes": passes, "ops": ops, "sources": sources}), flush=True)


def _delta_table(rows: dict, key: str, a: str, b: str, top: int, digits: int) -> str:
    """The `top` entries of `rows[v][key]` that differ most between variants `a` and `b`."""
    names = set(rows[a][key]) | set(rows[b][key])
    diff = {k: rows[b][key].get(k, 0) - rows[a][key].get(k, 0) for k in names}
    shown = sorted(names, key=lambda k: -abs(diff[k]))[:top]
    got = [[k, *(round(rows[v][key].get(k, 0), digits) for v in (a, b))] for k in shown]
    body = [[*r, f"{diff[r[0]]:+.{digits}f}"] for r in got]
    return _common.markdown_table([key, a, b, "difference"], body, "lrrr")


def where_it_goes(rows: dict, a: str = "ZeRO-3", b: str = "ZeRO++") -> str:
    """The gap between variants `a` and `b`, split into lowering, XLA's passes and backend."""
    if a not in rows or b not in rows:
        return ""
    ra, rb = rows[a], rows[b]
    gap = rb["compile_s"] - ra["compile_s"]
    parts = ", ".join(
        f"{k.removesuffix('_s').replace('_', ' ')} {rb[k] - ra[k]:+.1f} s"
        for k in ("hlo_passes_s", "emit_s", "llvm_s", "other_s")
    )
    text = (
        f"## Where it goes\n\n{b} against {a}: compile {rb['compile_s']:.1f} s against "
        f"{ra['compile_s']:.1f} s ({rb['compile_s'] / ra['compile_s']:.2f}x, {gap:+.1f} s: "
        f"{parts}); trace + lower {rb['lower_s']:.1f} s against {ra['lower_s']:.1f} s. The "
        f"compiled program has {rb['hlo_instructions']} instructions against "
        f"{ra['hlo_instructions']} ({rb['hlo_instructions'] / ra['hlo_instructions']:.2f}x), "
        f"{rb['fusions']} fusions against {ra['fusions']}, {rb['kernel_modules']} kernel "
        f"modules emitted against {ra['kernel_modules']}.\n\n"
    )
    for key, what, digits in (
        ("passes", "Seconds per XLA pass (leaf passes, median)", 2),
        ("ops", "Compiled instructions by opcode", 0),
        ("sources", "Compiled instructions by the file and function of their innermost frame", 0),
    ):
        text += f"{what}, largest differences:\n\n{_delta_table(rows, key, a, b, 15, digits)}\n"
    return text


def main(argv: list[str] | None = None) -> list[dict]:
    argv = _common.worker_or_parent(argv, worker)
    if argv is None:
        return []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="125m", help="GPT preset (125m)")
    p.add_argument("--mesh", default="16x8", help="NODESxLOCAL (16x8)")
    p.add_argument("--seq", type=int, default=memory.SEQ)
    p.add_argument("--repeats", type=int, default=2, help="compiles per variant (median)")
    p.add_argument("--variants", default="", help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--quick", action="store_true", help="tiny on 2 x 4, 128 tokens")
    p.add_argument("--out", default=str(_common.study_dir("compile_time")))
    p.add_argument("--detail", help="a JSON file for each row's counts per pass, op, source")
    args = p.parse_args(argv)
    variants = _common.chosen_variants(p, args.variants, VARIANTS, DEFAULT)
    if args.quick:
        args.size, args.mesh, args.seq = "tiny", "2x4", 128
    _common.request_cpu_devices(8)
    machine = _common.machine_line()
    started = time.time()
    full: dict[str, dict] = {}
    for v in variants:
        cmd = [sys.executable, __file__, "--worker", v, args.size, args.mesh, str(args.seq)]
        (full[v],) = _common.worker_rows(cmd + [str(args.repeats)], f"compile_time.py: {v}")
    rows = [{k: x for k, x in r.items() if k not in DETAIL} for r in full.values()]
    out, name = pathlib.Path(args.out), "compile_time_quick" if args.quick else "compile_time"
    _common.write_csv(out / f"{name}.csv", rows)
    run = f"`python experiments/compile_time.py {shlex.join(argv)}`, {time.time() - started:.0f} s"
    text = (
        f"# Compile time by variant\n\n{machine}.\n\n{run}. GPT `{args.size}` preset as "
        f"`experiments/memory.py` builds it, {args.mesh} mesh ({args.seq} tokens per device), "
        f"median of {args.repeats} compile(s) per variant, each in a fresh trace; XLA's "
        f"timers from its log (`TF_CPP_VMODULE={VMODULE}`). `other_s`: compile_s less "
        "hlo_passes_s and backend_s; `compile_cpu_s`: CPU seconds of the compiling process (all "
        "threads). Sizes: lowered StableHLO (thousand characters, ops, functions) and compiled "
        "HLO. `load_1min`: the machine's load average after the variant's last compile (other "
        "users' work shares its 2 cores).\n\n"
        + _common.markdown_table(list(rows[0]), [list(r.values()) for r in rows])
        + "\n"
        + where_it_goes(full)
    )
    _common.write_text(out / f"{name}.md", text)
    _common.say_written([out / f"{name}.md", out / f"{name}.csv"])
    if args.detail:
        _common.write_text(pathlib.Path(args.detail), json.dumps(full, indent=1))
    return rows


if __name__ == "__main__":
    main()
