"""GPU programs without a GPU: compiles every training step for H200s (or H100s) on this
machine and reads what the GPU would run.

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python experiments/gpu_compile.py          # all rows
    ... python experiments/gpu_compile.py --models gpt --meshes 2x4 --out /tmp/g  # fewer
    ... python experiments/gpu_compile.py --flags-study                         # the flags
    ... python experiments/gpu_compile.py --rows "ZeRO++/gpt/2x8/docs" --no-kernels --merge
                                             # one row, added to the table's other rows

Needs the CUDA plugin of the installed jaxlib (`pip install
"jax-cuda12-plugin[with-cuda]==<jaxlib's version>" "jax-cuda12-pjrt==<the same>"`: 0.12.0.1
on Python >= 3.12, the `gpu-compile` extra, about 5 GB installed; 0.10.2 on Python 3.11)
but no GPU and no driver: XLA's GPU compiler
builds the program for a target described in `experiments/gpu_targets/<gpu>.txtpb` (a
`GpuTargetConfigProto` in text form) on a topology of `nodes x 1 x GPUs per node`
(deviceless ahead-of-time compilation: `jax.experimental.topologies`).

For each engine (the engine's ZeRO-3, ZeRO++ and ZeRO++ with int4 weight deltas, and XLA's
own FSDP, the GPT pinning its activations to the batch at every block boundary, as
MaxText does), each model (the trainer's default GPT, scanned; the 1.3B preset, scanned, `--remat
full`, one sequence of 2048 tokens per GPU) and each mesh, it compiles one training step
from shapes alone, without XLA flags and with the flags `docs/gpu_cluster.md` checked
(`DOC_FLAGS`, passed as compiler options), and reads the compiled, scheduled HLO
(`gpu_program.py`):

  * every collective, whether asynchronous (a `-start` / `-done` pair XLA did not mark
    `is_sync`), and the dtypes it sends (`wire_dtypes`; 8- and 4-bit payloads travel as
    bytes, so the bits per value are read off the payload's shape: bytes per block of the
    config's block size);
  * each all-gather (the weight gathers), whether at least one compute instruction (a
    fusion, a library call such as a GEMM, a loop) is scheduled between its start and its
    done, and how many of those are matrix multiplications: the overlap the schedule
    allows, per loop (forward and backward) and outside them;
  * `compiled.memory_analysis()` per GPU beside `plan.estimate(..., platform="gpu")`
    (a block's internals and the lookup gradient's sum in the compute dtype);
  * the bytes through each node's link, from the ledger of the lowered step (what the
    engine asked for) and from the compiled GPU program (what XLA's GPU compiler kept;
    NCCL's ring order).

Plus the Pallas kernels alone, each compiled for one GPU of the target (Triton for the
target's compute capability).

What this is, and what it is not: a compiled schedule shows what the GPU would be allowed
to overlap, which collectives it runs and in which width, and how much memory XLA plans
per GPU. It does not say how long anything takes; nothing here is turned into a time.

Writes `gpu_compile.{csv,md}` (and with `--flags-study` `gpu_flags.{csv,md}`) into
`--out` (default `experiments/results/gpu_compile/`). Each row names the jax and plugin
that compiled it (`jax` column); `--merge` keeps the rows of other jax versions beside this run's.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import re
import sys
import time
from typing import Any

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver on this machine
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host runs JAX; the GPU is a target

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
from _gpu_target import (  # noqa: E402
    Step,
    build_step,
    compile_for,
    compiler_options,
    gpu_mesh,
    jax_text,
)
from gpu_program import (  # noqa: E402
    ENGINES,
    FLAG_SETS,
    HEAD,
    KEY,
    MESHES,
    MODELS,
    SLUGS,
    Precompiled,
    goals,
    merged,
    minimal_hlo,
    read_program,
    read_rows,
    same_bytes,
    with_in_flight,
)

GB = 1e9


def measure(
    step: Step, mesh: Any, flags: str, save_hlo: pathlib.Path | None = None, name: str = ""
) -> dict[str, Any]:
    """Compiles `step` for the mesh's GPUs with the flag set and reads it; with
    `save_hlo`, writes `minimal_hlo` of the program there as `<name>.hlo.gz`."""
    import gzip

    import zeropp_jax as zpp
    from zeropp_jax.train import fit

    t = time.perf_counter()
    lowered = step.fn.lower(step.state, step.batch)
    compiled, _ = compile_for(lowered, compiler_options(flags, step.layer_bytes))
    seconds = time.perf_counter() - t
    if save_hlo is not None:
        save_hlo.mkdir(parents=True, exist_ok=True)
        data = minimal_hlo(compiled.as_text()).encode()
        (save_hlo / f"{name}.hlo.gz").write_bytes(gzip.compress(data, mtime=0))
    program = read_program(compiled, mesh)
    need = fit.need_of(compiled)
    gpu_ledger = zpp.comm_ledger(
        Precompiled(compiled),
        step.state,
        step.batch,
        mesh=mesh,
        param_count=step.param_count,
        compiled=True,
        links="nccl",
    )
    if step.config is not None:
        asked = zpp.comm_ledger(
            step.fn, step.state, step.batch, param_count=step.param_count, links="nccl"
        )
        ledger_link, as_ledger = round(asked.link_bytes / 1e6, 3), same_bytes(gpu_ledger, asked)
    else:  # XLA's collectives exist only in the compiled program
        ledger_link, as_ledger = "-", "-"
    return {
        **{k: program[k] for k in ("collectives", "async_collectives", "gathers")},
        "max_in_flight": program["max_in_flight"],
        "overlapped_gathers": program["overlapped_gathers"],
        "wire_dtypes": program["wire_dtypes"],
        "temp_gb": round(need.temp / GB, 3),
        "estimate_gb": round(step.estimate.total / GB, 3),
        "total_gb": round(need.total / GB, 3),
        "total_over_estimate": round(need.total / step.estimate.total, 3),
        "estimate_cpu_gb": round(step.estimate_cpu.total / GB, 3),
        "matmul_overlapped_gathers": program["matmul_overlapped_gathers"],
        "gathers_by_place": program["gathers_by_place"],
        "link_mb_ledger": ledger_link,
        "link_mb_gpu": round(gpu_ledger.link_bytes / 1e6, 3),
        "bytes_as_ledger": as_ledger,
        "gather_mb": program["gather_mb"],
        "compile_s": round(seconds, 1),
        "not_overlapped": " ".join(program["not_overlapped"]),
    }


# ------------------------------------------------------------------------ the kernels


def kernel_rows(gpu: str) -> list[dict[str, Any]]:
    """Each Pallas kernel compiled for one GPU of the target: its custom calls."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import pallas_kernels as pk

    mesh = gpu_mesh(gpu, 1, 1)
    one = NamedSharding(mesh, P())
    blocks, n = 4096, 256

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=one)

    def packed(bits, lead=(blocks,)):
        dtype = jnp.int8 if bits == 8 else jnp.uint8
        return spec((*lead, n * bits // 8), dtype), spec(lead, jnp.float32)

    cases = {
        "quantize_blocks 8-bit": (
            lambda x: pk.quantize_blocks(x, bits=8),
            (spec((blocks, n), jnp.bfloat16),),
        ),
        "quantize_blocks 4-bit": (
            lambda x: pk.quantize_blocks(x, bits=4),
            (spec((blocks, n), jnp.float32),),
        ),
        "dequantize_blocks 8-bit": (
            lambda v, s: pk.dequantize_blocks(v, s, bits=8, dtype=jnp.bfloat16),
            packed(8),
        ),
        "dequantize_sum_blocks 4-bit": (
            lambda v, s: pk.dequantize_sum_blocks(v, s, bits=4),
            packed(4, (4, blocks)),
        ),
        "dequantize_sum_quantize_blocks 4-to-4-bit": (
            lambda v, s: pk.dequantize_sum_quantize_blocks(v, s, bits=4, out_bits=4),
            packed(4, (4, blocks)),
        ),
    }
    rows = []
    for name, (fn, args) in cases.items():
        t = time.perf_counter()
        # Pallas' Triton lowering reads the target GPU off the abstract mesh where there is
        # no GPU device (jax 0.12; 0.10.2 read it off the arguments' devices)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            compiled = jax.jit(fn).lower(*args).compile()
        text = compiled.as_text()
        calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
        rows.append(
            {
                "kernel": name,
                "gpu": gpu,
                "jax": jax_text(),
                "custom_calls": " ".join(calls),
                "temp_mb": round(compiled.memory_analysis().temp_size_in_bytes / 1e6, 3),
                "compile_s": round(time.perf_counter() - t, 1),
            }
        )
        print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------------- the flags


def flags_study(gpu: str) -> list[dict[str, Any]]:
    """Each recommended flag alone on the trainer GPT's ZeRO++ step (2 x 4): does this
    jaxlib accept it, and does the schedule change (the sequence of instructions of every
    computation, compared with no flags)?"""
    mesh = gpu_mesh(gpu, 2, 4)
    step = build_step("ZeRO++", "gpt", mesh)
    lowered = step.fn.lower(step.state, step.batch)

    def signature(compiled) -> tuple:
        from _library import hlo_text

        module = hlo_text.parse_hlo_module(compiled.as_text())
        return tuple(
            (len(ins), tuple(i.opcode for i in ins)) for ins in module.computations.values()
        )

    def overlap(compiled) -> str:
        program = read_program(compiled, mesh)
        return (
            f"{program['overlapped_gathers']}/{program['gathers']} gathers overlapped "
            f"({program['gathers_by_place']})"
        )

    base = lowered.compile()
    base_sig = signature(base)
    rows = [{"flag": "(none)", "accepted": True, "schedule_changed": "-", "gathers": overlap(base)}]
    print(rows[-1], flush=True)
    options = compiler_options("docs", step.layer_bytes)
    for flag in [*options, "(all of them)"]:
        opts = options if flag == "(all of them)" else {flag: options[flag]}
        try:
            compiled, opts = compile_for(lowered, opts)
        except Exception as e:
            rows.append(
                {
                    "flag": flag,
                    "accepted": f"no: {str(e)[:120]}",
                    "schedule_changed": "-",
                    "gathers": "-",
                }  # fmt: skip
            )
        else:
            name, value = (flag, opts) if flag == "(all of them)" else next(iter(opts.items()))
            rows.append(
                {
                    "flag": name if flag == "(all of them)" else f"{name}={value}",
                    "accepted": True,
                    "schedule_changed": signature(compiled) != base_sig,
                    "gathers": overlap(compiled),
                }
            )
        print(rows[-1], flush=True)
        gc.collect()
    return rows


# ------------------------------------------------------------------------ the table

OLD_JAX = "0.10.2, plugin 0.10.2"
"""The `jax` of the rows written before the column existed (all compiled on jax 0.10.2
with jax-cuda12-plugin 0.10.2, Python 3.11)."""


def with_jax(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with a `jax` column after `gpu` (`OLD_JAX` where it has none)."""
    if row.get("jax"):
        return row
    out: dict[str, Any] = {}
    for k, v in row.items():
        if k != "jax":
            out[k] = v
        if k == "gpu":
            out["jax"] = OLD_JAX
    out.setdefault("jax", OLD_JAX)
    return out


def merged_by_jax(old: list[dict], new: list[dict]) -> list[dict]:
    """`gpu_program.merged` within each jax version (a row replaces the row of its key
    and jax), the versions side by side: each key's rows together, oldest jax first."""
    old, new = [with_jax(r) for r in old], [with_jax(r) for r in new]
    versions = list(dict.fromkeys(r["jax"] for r in old + new))
    rows = [
        with_jax(r)
        for v in versions
        for r in merged([r for r in old if r["jax"] == v], [r for r in new if r["jax"] == v])
    ]
    keys = {tuple(str(r[k]) for k in KEY): i for i, r in enumerate(merged(rows, []))}
    rows.sort(key=lambda r: (keys[tuple(str(r[k]) for k in KEY)], versions.index(r["jax"])))
    columns = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k, "") for k in columns} for r in rows]


def write_kernels(path: pathlib.Path, new: list[dict[str, Any]]) -> None:
    """The kernel rows of `path` for the other GPUs and jax versions, then `new`."""
    new = [with_jax(r) for r in new]
    mine = {(r["gpu"], r["jax"]) for r in new}
    old = [with_jax(r) for r in read_rows(path)] if path.exists() else []
    rows = [r for r in old if (r["gpu"], r["jax"]) not in mine] + new
    _common.write_csv(path, sorted(rows, key=lambda r: (r["gpu"] != "h200", r["gpu"])))


def report(head: str, rows: list[dict], kernels: list[dict]) -> str:
    """The markdown: the table (without the long columns), the kernels, the goals per jax
    version, then each gather that has no compute between its start and its done."""
    where = [*KEY, "jax"]
    short = [k for k in rows[0] if k not in ("not_overlapped", "gather_mb")]
    text = head + _common.markdown_table(short, [[r[k] for k in short] for r in rows])
    text += "\nGather operand bytes per GPU by dtype (MB, each instruction once):\n\n"
    text += _common.markdown_table(
        [*where, "gather_mb"], [[*(r[k] for k in where), r["gather_mb"]] for r in rows]
    )
    if kernels:
        kernels = [with_jax(k) for k in kernels]
        text += "\n## The Pallas kernels alone, compiled for one GPU\n\n"
        text += _common.markdown_table(list(kernels[0]), [list(r.values()) for r in kernels])
    text += "\n## The goals, read off the rows above\n"
    for v in dict.fromkeys(r["jax"] for r in rows):
        text += f"\nRows compiled with jax {v}:\n\n" + goals([r for r in rows if r["jax"] == v])
    text += "\n## Gathers with no compute between their start and their done\n\n"
    text += (
        "What holds each back (a leaf outside the scanned blocks, gathered at its use; one\n"
        "collective in flight at a time, `max_in_flight`): `experiments/RESULTS.md`, section\n"
        '"GPU programs compiled without a GPU". jaxlib 0.12 writes a synchronous gather as\n'
        "one `all-gather` instruction, 0.10.2 as an `all-gather-start` marked `is_sync`.\n\n"
    )
    for r in rows:
        if r["not_overlapped"]:
            text += f"- {', '.join(str(r[k]) for k in where)}: {r['not_overlapped']}\n"
    return text


JAX_NOTE = """The `jax` column names the jax and CUDA plugin that compiled each row; rows of
several versions stand side by side (`--merge` replaces a row of the same key and jax
only). The rows of jax 0.10.2 were compiled before stored layout 3 (their `code`);
those of jax 0.12.0.1 at the commit their `code` names, on Python 3.13. On jaxlib
0.12.0.1 the `docs` flag set passes the three `xla_gpu_enable_pipelined_*` options,
which it no longer has, as `xla_gpu_pipeline_*=COLLECTIVE_PIPELINING_MODE_ON`
(`RENAMED`); the other four under their names.

"""


# ----------------------------------------------------------------------------- main

FLAGS_HEAD = """# The XLA flags of docs/gpu_cluster.md, one at a time

`python experiments/gpu_compile.py --flags-study`: the trainer GPT's ZeRO++ step compiled
for 2 x 4 H200s without a GPU, with no flag, with each recommended flag alone (as a
compiler option; the combine thresholds at one layer's bytes) and with all of them.
`accepted`: the compiler took the option; `schedule_changed`: the compiled program's
instructions, computation by computation, differ from the one without flags; `gathers`:
overlapped / all gathers (per place: asynchronous / overlapped / gathers). A schedule,
not a time.

{machine}

"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", default="h200", help="target config in experiments/gpu_targets")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--meshes", default=",".join(MESHES))
    p.add_argument("--flags", default=",".join(FLAG_SETS))
    p.add_argument(
        "--rows",
        default=None,
        help="only these rows, 'engine/model/mesh/flags' separated by commas (e.g. "
        "'ZeRO++/gpt/2x8/docs,XLA FSDP/gpt/2x8/docs'), instead of the product of "
        "--engines, --models, --meshes and --flags",
    )
    p.add_argument("--no-kernels", action="store_true", help="skip the Pallas kernels")
    p.add_argument("--kernels-only", action="store_true", help="only the Pallas kernels")
    p.add_argument("--flags-study", action="store_true", help="only the per-flag study")
    p.add_argument("--out", type=pathlib.Path, default=_common.study_dir("gpu_compile"))
    p.add_argument("--name", default="gpu_compile")
    p.add_argument(
        "--save-hlo",
        type=pathlib.Path,
        default=None,
        help="folder for the programs, cut to what is read (minimal_hlo), as <row>.hlo.gz",
    )
    p.add_argument("--merge", action="store_true", help="keep the other rows of the CSV")
    p.add_argument(
        "--hlo-from",
        type=pathlib.Path,
        default=None,
        help="with --rows-from: the --save-hlo folder of those runs, to read max_in_flight "
        "off the saved programs for rows printed before it was a column",
    )
    p.add_argument(
        "--rows-from",
        type=pathlib.Path,
        nargs="*",
        default=None,
        help="logs of earlier runs: merge the rows they printed, compile nothing",
    )
    args = p.parse_args(argv)
    import warnings

    import jax

    warnings.simplefilter("ignore")  # the engine's per-leaf notes; the rows say what ran
    from importlib.metadata import version

    head = (
        HEAD.format(
            plugin=f"{version('jax-cuda12-plugin')} for this run's rows, see `jax`",
            machine=_common.machine_line(),
        )
        + JAX_NOTE
    )
    if args.flags_study:
        rows = flags_study(args.gpu)
        head = FLAGS_HEAD.format(machine=_common.machine_line())
        _common.write_table(args.out, "gpu_flags", head, rows)
        return
    csv_path = args.out / f"{args.name}.csv"
    kernels_path = args.out / f"{args.name}_kernels.csv"
    old = read_rows(csv_path) if args.merge and csv_path.exists() else []

    def write(rows: list[dict]) -> None:
        rows = merged_by_jax(old, rows)
        _common.write_csv(csv_path, rows)
        kernels = read_rows(kernels_path) if kernels_path.exists() else []
        _common.write_text(args.out / f"{args.name}.md", report(head, rows, kernels))

    if args.kernels_only:
        write_kernels(kernels_path, kernel_rows(args.gpu))
        write([])
        _common.say_written([args.out / f"{args.name}.md", kernels_path])
        return
    if args.rows_from is not None:  # rows printed by earlier runs: no compiling
        import ast

        lines = [line for log in args.rows_from for line in log.read_text().splitlines()]
        rows = [ast.literal_eval(line) for line in lines if line.startswith("{'engine'")]
        kernels = [ast.literal_eval(line) for line in lines if line.startswith("{'kernel'")]
        for gpu in dict.fromkeys(k["gpu"] for k in kernels):
            write_kernels(kernels_path, [k for k in kernels if k["gpu"] == gpu])
        if args.hlo_from is not None:  # rows of runs before max_in_flight was a column
            rows = [with_in_flight(args.hlo_from, row) for row in rows]
        for row in rows:  # rows of runs before the CPU form was a column
            if "estimate_cpu_gb" not in row:
                nodes, local = (int(v) for v in row["mesh"].split("x"))
                step = build_step(row["engine"], row["model"], gpu_mesh(args.gpu, nodes, local))
                row["estimate_cpu_gb"] = round(step.estimate_cpu.total / GB, 3)
        write(rows)
        _common.say_written([args.out / f"{args.name}.md", csv_path])
        return
    code = _common.source_version()
    rows = []
    for mesh_text, model, engine, flag_sets in selected(args):
        nodes, local = (int(v) for v in mesh_text.split("x"))
        mesh = gpu_mesh(args.gpu, nodes, local)
        step = build_step(engine, model, mesh)
        for flags in flag_sets:
            row = {"engine": engine, "model": model, "mesh": mesh_text, "flags": flags}
            row["gpu"] = args.gpu
            row["jax"] = jax_text()
            name = "_".join((SLUGS[engine], model, mesh_text, flags, args.gpu))
            row.update(measure(step, mesh, flags, args.save_hlo, name))
            row["code"] = code
            rows.append(row)
            print(row, flush=True)
            write(rows)  # after every row: a long run keeps what it has
            gc.collect()
        del step, mesh
        jax.clear_caches()
    if not args.no_kernels:
        write_kernels(kernels_path, kernel_rows(args.gpu))
        write(rows)
    _common.say_written([args.out / f"{args.name}.md", csv_path])


def selected(args: argparse.Namespace) -> list[tuple[str, str, str, list[str]]]:
    """(mesh, model, engine, flag sets) to compile: `--rows`, or the product of
    `--meshes`, `--models`, `--engines` and `--flags`."""
    if args.rows is None:
        return [
            (mesh, model, engine, args.flags.split(","))
            for mesh in args.meshes.split(",")
            for model in args.models.split(",")
            for engine in args.engines.split(",")
        ]
    out: list[tuple[str, str, str, list[str]]] = []
    for spec in args.rows.split(","):
        parts = spec.split("/")
        if len(parts) != 4 or parts[0] not in ENGINES or parts[3].split("+")[0] not in FLAG_SETS:
            raise SystemExit(
                f"gpu_compile: --rows entry {spec!r} is not engine/model/mesh/flags with "
                f"engine in {ENGINES} and flags in {FLAG_SETS} (+name=value options after)."
            )
        engine, model, mesh, flags = parts
        if out and out[-1][:3] == (mesh, model, engine):
            out[-1][3].append(flags)
        else:
            out.append((mesh, model, engine, [flags]))
    return out


if __name__ == "__main__":
    main()
