"""How long XLA's GPU compiler takes over each engine's training step: trace + lower and
compile, timed apart, for XLA FSDP, ZeRO-3 and ZeRO++, compiled for H200s without a GPU.

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python experiments/gpu_compile_time.py   # 125m, 16 x 8
    ... python experiments/gpu_compile_time.py --mesh 2x4 --repeats 1
    ... python experiments/gpu_compile_time.py --quick      # the trainer's GPT on 2 x 4

The GPU counterpart of `experiments/compile_time.py` (XLA:CPU). The step is
`experiments/_gpu_target.py`'s (`build_step`: the trainer's `train_step` and AdamW chain;
the `125m` preset takes the flags `compile_time.py` gives it, `--remat full`, 2048 tokens
and one sequence per device), on a `nodes x 1 x local` topology of the `--gpu` target
(deviceless ahead-of-time compilation, `_gpu_target.gpu_mesh`). Each engine runs in a
worker process; the worker first compiles one small sharded program for the mesh (the
compiler's one-time start, not timed), then each repeat clears jax's caches, builds a
fresh step and times `step.lower(state, batch)` and the compile apart. The compile takes
no XLA options (`_gpu_target.compiler_options`' flag set `none`, or `--flags`) and the worker no
`XLA_FLAGS` but the caller's; jax's persistent compilation cache is off. The sizes of the
last compiled program are `compile_time.hlo_sizes`'.

Needs the CUDA plugin of the installed jaxlib (see `_gpu_target.py`). Writes
`gpu_compile_time.{md,csv}` (`--quick`: `gpu_compile_time_quick.{md,csv}`) into `--out`
(default `experiments/results/gpu_compile_time/`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import shlex
import statistics
import sys
import time
import warnings

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver on this machine
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host runs JAX; the GPU is a target

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import _gpu_target  # noqa: E402
import compile_time  # noqa: E402

ENGINES = ("XLA FSDP", "ZeRO-3", "ZeRO++")
"""The engines timed, in the table's order (`gpu_program.ENGINES`' names)."""
CPU_STUDIES = ("compile_time", "compile_time_before")
"""The XLA:CPU results (`compile_time.py`'s, in `experiments/results/compile_time`) the reading
quotes."""
DETAIL = ("ops", "options")
"""A worker's keys that stay out of the table."""


def _warm_up(mesh) -> None:
    """Compiles one small sharded program for `mesh`: the GPU compiler's one-time start
    (its LLVM target, the PTX assembler) stays out of the first timed compile."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    spec = NamedSharding(mesh, PartitionSpec(("node", "local")))
    x = jax.ShapeDtypeStruct((mesh.size * 8, 128), jnp.float32, sharding=spec)
    jax.jit(lambda x: jnp.tanh(x) @ jnp.ones((128, 128)) + x.sum()).lower(x).compile()


def worker(argv: list[str]) -> None:
    """`--worker ENGINE MODEL MESH GPU FLAGS REPEATS`: prints one JSON row."""
    engine, model, mesh_text, gpu, flags, repeats = argv
    nodes, local = (int(v) for v in mesh_text.split("x"))
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    warnings.simplefilter("ignore")  # the engine's per-leaf notes
    mesh = _gpu_target.gpu_mesh(gpu, nodes, local)
    _warm_up(mesh)
    lower_s, compile_s, cpu_s = [], [], []
    for _ in range(int(repeats)):
        jax.clear_caches()
        step = _gpu_target.build_step(engine, model, mesh)
        options = _gpu_target.compiler_options(flags, step.layer_bytes)
        t = time.perf_counter()
        lowered = step.fn.lower(step.state, step.batch)
        lower_s.append(time.perf_counter() - t)
        t, cpu = time.perf_counter(), time.process_time()
        compiled, options = _gpu_target.compile_for(lowered, options)
        compile_s.append(time.perf_counter() - t)
        cpu_s.append(time.process_time() - cpu)
    sizes, ops, _ = compile_time.hlo_sizes(lowered.as_text(), compiled.as_text())

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 2)

    row = {
        "engine": engine,
        "model": model,
        "mesh": mesh_text,
        "gpu": gpu,
        "flags": flags,
        "lower_s": median(lower_s),
        "compile_s": median(compile_s),
        "compile_cpu_s": median(cpu_s),
        **{k: sizes[k] for k in ("hlo_instructions", "fusions", "whiles", "computations")},
        "stablehlo_ops": sizes["stablehlo_ops"],
        "load_1min": round(os.getloadavg()[0], 1),
        "lower_runs_s": " ".join(f"{s:.1f}" for s in lower_s),
        "compile_runs_s": " ".join(f"{s:.1f}" for s in compile_s),
        "jax": _gpu_target.jax_text(),
    }
    print(json.dumps({**row, "ops": ops, "options": options}), flush=True)


def cpu_figures(out: pathlib.Path, name: str) -> dict | None:
    """`{"where": ..., "compile_s": {engine: s}}` of `compile_time.py`'s results `name`
    in `out` (its md names the commit, jax and mesh), or None where they are missing."""
    md, csv_path = out / f"{name}.md", out / f"{name}.csv"
    if not md.exists() or not csv_path.exists():
        return None
    from gpu_program import read_rows

    seconds = {r["variant"]: float(r["compile_s"]) for r in read_rows(csv_path)}
    if any(e not in seconds for e in ENGINES):
        return None
    head = md.read_text()
    found = [re.search(p, head) for p in (r"commit (\w+)", r"jax ([\d.]+)", r"(\d+x\d+) mesh")]
    commit, jax_version, mesh = (m.group(1) if m else "?" for m in found)
    where = f"`{name}.md` (commit {commit}, jax {jax_version}, {mesh})"
    return {"where": where, "compile_s": {e: seconds[e] for e in ENGINES}}


def ratios(seconds: dict[str, float]) -> str:
    """ZeRO++'s seconds over ZeRO-3's and over XLA FSDP's, as text."""
    zpp, z3, fsdp = (seconds[e] for e in ("ZeRO++", "ZeRO-3", "XLA FSDP"))
    return (
        f"ZeRO++ {zpp:.1f} s, ZeRO-3 {z3:.1f} s, XLA FSDP {fsdp:.1f} s: "
        f"{zpp / z3:.2f}x ZeRO-3's, {zpp / fsdp:.2f}x XLA FSDP's"
    )


def reading(rows: dict[str, dict]) -> str:
    """The paragraph: ZeRO++'s compile seconds over ZeRO-3's and XLA FSDP's on the GPU,
    beside the XLA:CPU figures of `CPU_STUDIES`."""
    if any(e not in rows for e in ENGINES):
        return ""
    mesh = rows["ZeRO++"]["mesh"]
    gpu = {e: rows[e]["compile_s"] for e in ENGINES}
    total = {e: rows[e]["lower_s"] + rows[e]["compile_s"] for e in ENGINES}
    jax_text = rows["ZeRO++"]["jax"]
    text = (
        f"## Reading\n\nXLA's GPU compiler ({mesh}, jax {jax_text}): {ratios(gpu)}; "
        f"with trace + lower, {ratios(total)}."
    )
    z3, zpp = rows["ZeRO-3"], rows["ZeRO++"]
    text += (
        f" The compiled GPU program of ZeRO++ has {zpp['hlo_instructions']} instructions "
        f"against ZeRO-3's {z3['hlo_instructions']} "
        f"({zpp['hlo_instructions'] / z3['hlo_instructions']:.2f}x), {zpp['fusions']} "
        f"fusions against {z3['fusions']}."
    )
    for name in CPU_STUDIES:
        cpu = cpu_figures(_common.RESULTS / "compile_time", name)
        if cpu is not None:
            text += f" XLA:CPU, {cpu['where']}: {ratios(cpu['compile_s'])}."
    return text + "\n"


def ops_table(full: dict[str, dict], a: str = "ZeRO-3", b: str = "ZeRO++", top: int = 12) -> str:
    """The `top` opcodes whose counts differ most between engines `a` and `b`."""
    if a not in full or b not in full:
        return ""
    oa, ob = collections.Counter(full[a]["ops"]), collections.Counter(full[b]["ops"])
    shown = sorted(set(oa) | set(ob), key=lambda k: -abs(ob[k] - oa[k]))[:top]
    body = [[k, oa[k], ob[k], f"{ob[k] - oa[k]:+d}"] for k in shown]
    head = f"\nCompiled GPU instructions by opcode, largest differences ({a} to {b}):\n\n"
    return head + _common.markdown_table(["opcode", a, b, "difference"], body, "lrrr")


def main(argv: list[str] | None = None) -> list[dict]:
    argv = _common.worker_or_parent(argv, worker)
    if argv is None:
        return []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="125m", help="GPT preset, or 'gpt' (the trainer's)")
    p.add_argument("--mesh", default="16x8", help="NODESxLOCAL GPUs (16x8)")
    p.add_argument("--gpu", default="h200", help="target config in experiments/gpu_targets")
    p.add_argument("--flags", default="none", help="gpu_compile's flag set (none)")
    p.add_argument("--repeats", type=int, default=2, help="compiles per engine (median)")
    p.add_argument("--engines", default="", help=f"comma-separated, of {list(ENGINES)}")
    p.add_argument("--quick", action="store_true", help="the trainer's GPT ('gpt') on 2 x 4")
    p.add_argument("--out", type=pathlib.Path, default=_common.study_dir("gpu_compile_time"))
    args = p.parse_args(argv)
    engines = _common.chosen_variants(p, args.engines, ENGINES, ENGINES)
    if args.quick:
        args.model, args.mesh = "gpt", "2x4"
    machine = _common.machine_line()
    started = time.time()
    full: dict[str, dict] = {}
    for engine in engines:
        cmd = [sys.executable, __file__, "--worker", engine, args.model, args.mesh]
        cmd += [args.gpu, args.flags, str(args.repeats)]
        (full[engine],) = _common.worker_rows(cmd, f"gpu_compile_time.py: {engine}")
    rows = [{k: v for k, v in r.items() if k not in DETAIL} for r in full.values()]
    name = "gpu_compile_time_quick" if args.quick else "gpu_compile_time"
    _common.write_csv(args.out / f"{name}.csv", rows)
    command = " ".join(["python experiments/gpu_compile_time.py", shlex.join(argv)]).strip()
    run = f"`{command}`, {time.time() - started:.0f} s"
    _common.write_text(args.out / f"{name}.md", report(full, args, machine, run))
    _common.say_written([args.out / f"{name}.md", args.out / f"{name}.csv"])
    return rows


def report(full: dict[str, dict], args: argparse.Namespace, machine: str, run: str) -> str:
    """The markdown: what ran, the table, the opcodes ZeRO++ adds, the reading."""
    rows = [{k: v for k, v in r.items() if k not in DETAIL} for r in full.values()]
    model = (
        "The trainer's default GPT (`gpt`: scanned, no remat, batch 32)"
        if args.model == "gpt"
        else f"GPT `{args.model}` preset as `experiments/compile_time.py` builds it "
        "(`--remat full`, 2048 tokens and one sequence per device)"
    )
    options = next(iter(full.values()))["options"] or "no options"
    xla_flags = os.environ.get("XLA_FLAGS", "").strip() or "none"
    return (
        f"# GPU compile time by engine\n\n{machine}; compiled by jax {rows[0]['jax']}.\n\n"
        f"{run}. {model}, compiled by XLA's GPU compiler for {args.mesh} {args.gpu.upper()}s "
        f"without a GPU (`_gpu_target.gpu_mesh`, `build_step`), compiler options: flag "
        f"set `{args.flags}` of `_gpu_target.compiler_options` ({options}); `XLA_FLAGS`: "
        f"{xla_flags}. Median of {args.repeats} compile(s) per engine, each in a fresh trace "
        "with jax's caches cleared, after one untimed warm-up compile per worker. "
        "`compile_cpu_s`: CPU seconds of the compiling process (all threads). Sizes: the "
        "lowered StableHLO's ops and the compiled HLO (`compile_time.hlo_sizes`). "
        "`load_1min`: the machine's load average after the engine's last compile (other "
        "users' work shares its cores).\n\n"
        + _common.markdown_table(list(rows[0]), [list(r.values()) for r in rows])
        + ops_table(full)
        + "\n"
        + reading(full)
    )


if __name__ == "__main__":
    main()
