"""Memory per device of the trainer's GPT presets, compiled from shapes, against the
analytic estimate of `zeropp_jax.train.plan`.

    python experiments/memory.py                    # 125m..6.7b on 2 x 4 and 16 x 8 meshes
    python experiments/memory.py --meshes 2x4       # the 8-device mesh only
    python experiments/memory.py --quick            # tiny, 2 x 4 (seconds; for tests)
    python experiments/memory.py --meshes 2x4 --reestimate   # new estimate, same totals
    python experiments/memory.py --meshes 16x8 --sizes 125m,350m --merge   # in pieces
    python experiments/memory.py --meshes 2x4 --engines "XLA FSDP" --merge  # some rows

For each preset (`zeropp-train --model`: scanned layers, `--remat full`, bfloat16 compute,
the trainer's AdamW chain, one sequence of 2048 tokens per device) and each mesh, compiles
one training step from shapes alone (`TrainState.abstract`; nothing is initialised or
allocated) and reads `compiled.memory_analysis()` per device for six engines: plain data
parallelism (`jax.jit`, state replicated, batch split), XLA's own FSDP
(`zeropp_jax.baselines`: `jax.jit` with parameters and optimizer state sharded over all
devices), our ZeRO-3 and ZeRO++ (`zpp.shard`, state donated) as configured by default
(`shared_grad="auto"`: column `tied_grad` says whether it reduced the tied embedding's
gradient once or per use there), each of the two also with `shared_grad="per_use"`
("ZeRO-3 per-use", "ZeRO++ per-use": the tied embedding's gradient reduced at each of its
two uses, not held through the backward). Each row sits against the
estimate (the module docstring of `zeropp_jax/train/plan.py` writes out every term; XLA's
FSDP is set against the ZeRO-3 formula, which it would meet if it gathered one layer at a
time). The four rows of our engines also carry their ledger (`zpp.comm_ledger` of the
same step, lowered): M per device and per node link in one direction (M = the model in
16-bit bytes), so that the per-use rows' extra reduction shows beside the memory it saves.
Each mesh runs in its own process with that many emulated CPU devices. No XLA flag
other than the device count is set. Compile only.

Writes `memory.{md,csv,png}` into `--out` (default `experiments/results/memory/`); with other
`--meshes`, `memory_<meshes>.{md,csv,png}`. With `--merge` the rows of the meshes, sizes
and engines measured replace those already in that file and the others are kept (a long
table measured in pieces, e.g. one submission per size); the header lists each piece's
run, so a row's commit is that of the piece that measured it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import _engines  # noqa: E402

SIZES = ("125m", "350m", "1.3b", "6.7b")
ENGINES = ("data parallel", "XLA FSDP", "ZeRO-3", "ZeRO-3 per-use", "ZeRO++", "ZeRO++ per-use")
SEQ = 2048
PER_USE = " per-use"
"""An engine name ending in this (e.g. "ZeRO-3 per-use") runs `shared_grad="per_use"`."""
GB = 1e9


def _mesh_shape(text: str) -> tuple[int, int]:
    nodes, local = (int(v) for v in text.lower().split("x"))
    return nodes, local


def measure(
    size: str, engine: str, mesh_shape: tuple[int, int], seq: int, *, compile: bool = True
) -> dict:
    """One row: the compiled step's per-device memory and the estimate (in this process,
    which must hold `nodes * local` devices). `compile=False`: the estimate alone (the
    row's `estimate_GB`, nothing compiled)."""
    import jax
    import jax.numpy as jnp
    from _library import BATCH_SPEC, choices
    from jax.sharding import NamedSharding

    import zeropp_jax as zpp
    from zeropp_jax.train import fit, plan
    from zeropp_jax.train.cli import make_optimizer, train_step
    from zeropp_jax.train.flags import gpt_config, parse_args
    from zeropp_jax.train.model import GPT, init_fn, param_count

    nodes, local = mesh_shape
    n = nodes * local
    args = parse_args(
        ["--model", size, "--remat", "full", "--seq-len", str(seq), "--batch", str(n)]
    )
    gpt = gpt_config(args)
    model, tx = GPT(gpt), make_optimizer(args)
    mesh = zpp.make_mesh(nodes, local, devices=jax.devices()[:n])
    batch_sharding = NamedSharding(mesh, BATCH_SPEC)
    batch = jax.ShapeDtypeStruct((n, seq + 1), jnp.int32, sharding=batch_sharding)
    kw = dict(
        batch=1,
        seq=seq,
        mesh_shape=mesh_shape,
        internal_bytes=plan.internal_bytes_for(jax.default_backend(), 2),
    )
    t = time.perf_counter()
    base = engine.removesuffix(PER_USE)
    state, make_step = _engines.build(
        base,
        apply_fn=model.apply,
        params=init_fn(gpt, 0),
        tx=tx,
        mesh=mesh,
        overrides={"shared_grad": "per_use"} if engine.endswith(PER_USE) else None,
        abstract=True,
    )
    step = make_step(train_step)
    if base in ("data parallel", "XLA FSDP"):
        replicated = base == "data parallel"
        est = plan.estimate(gpt, state=state, layouts=None, replicated=replicated, **kw)
    else:
        layouts = state.layouts[1]
        est = plan.estimate(gpt, state=state, layouts=layouts, config=state.config, **kw)
    if not compile:
        return {"mesh": f"{nodes}x{local}", "model": size, "engine": engine,
                "estimate_GB": round(est.total / GB, 3)}  # fmt: skip
    need = fit.need_of(step.lower(state, batch).compile())
    seconds = time.perf_counter() - t
    sent = link = tied = ""  # the baselines' collectives exist only once XLA compiled them
    if engine not in ("data parallel", "XLA FSDP"):
        tied = "per use" if choices.largest_per_use(state.plan, state.layouts[1]) else "once"
        ledger = zpp.comm_ledger(step, state, batch, param_count=param_count(gpt))
        sent = round(ledger.in_units_of_M(ledger.total_bytes), 4)
        link = round(ledger.in_units_of_M(ledger.link_bytes), 4)
    return {
        "mesh": f"{nodes}x{local}",
        "model": size,
        "params_M": round(param_count(gpt) / 1e6, 1),
        "engine": engine,
        "arguments_GB": round(need.arguments / GB, 3),
        "temp_GB": round(need.temp / GB, 3),
        "total_GB": round(need.total / GB, 3),
        "estimate_GB": round(est.total / GB, 3),
        "xla_over_estimate": round(need.total / est.total, 3),
        "ledger_M": sent,
        "link_M": link,
        "tied_grad": tied,
        "compile_s": round(seconds, 1),
    }


def worker(argv: list[str]) -> None:
    """`--worker MESH SEQ ENGINES [--estimate-only] SIZE...`: prints one JSON row per size
    and engine (`ENGINES`: comma-separated)."""
    mesh, seq, engines, *sizes = argv
    compile = "--estimate-only" not in sizes
    sizes = [s for s in sizes if s != "--estimate-only"]
    shape = _mesh_shape(mesh)
    _common.request_cpu_devices(shape[0] * shape[1])
    import warnings

    warnings.simplefilter("ignore")  # the engine's per-leaf notes; the rows say what ran
    for size in sizes:
        for engine in engines.split(","):
            row = measure(size, engine, shape, int(seq), compile=compile)
            print(json.dumps(row), flush=True)


def _figure(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meshes = list(dict.fromkeys(r["mesh"] for r in rows))
    fig, axes = plt.subplots(1, len(meshes), figsize=(6 * len(meshes), 4.2), squeeze=False)
    for ax, mesh in zip(axes[0], meshes, strict=True):
        sizes = list(dict.fromkeys(r["model"] for r in rows if r["mesh"] == mesh))
        engines = [e for e in ENGINES if any(r["engine"] == e for r in rows if r["mesh"] == mesh)]
        width = 0.8 / len(engines)
        for k, engine in enumerate(engines):  # only the engines measured; a gap where missing
            got = {r["model"]: r for r in rows if r["mesh"] == mesh and r["engine"] == engine}
            xs = [i + (k - (len(engines) - 1) / 2) * width for i in range(len(sizes))]
            here = [(x, got[s]) for x, s in zip(xs, sizes, strict=True) if s in got]
            ax.bar([x for x, _ in here], [r["total_GB"] for _, r in here], width, label=engine)
            ax.scatter(
                [x for x, _ in here],
                [r["estimate_GB"] for _, r in here],
                marker="_",
                color="k",
                s=80,
            )
        ax.set_yscale("log")
        ax.set_xticks(range(len(sizes)), sizes)
        ax.set_ylabel("GB per device (XLA memory analysis)")
        ax.set_title(f"{mesh} mesh; black dashes: estimate")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _read_rows(path: pathlib.Path) -> list[dict]:
    """The rows of a results CSV this script wrote, numbers as numbers."""
    import csv

    def value(text: str):
        try:
            return float(text) if "." in text else int(text)
        except ValueError:
            return text

    with open(path, newline="") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _reestimated(measured: list[dict], estimates: list[dict]) -> list[dict]:
    """The measured rows with `estimate_GB` and `xla_over_estimate` from `estimates`
    (rows of `measure(..., compile=False)`, matched by mesh, model and engine)."""
    new = {(e["mesh"], e["model"], e["engine"]): e["estimate_GB"] for e in estimates}
    rows = []
    for r in measured:
        est = new[(r["mesh"], r["model"], r["engine"])]
        total = float(r["total_GB"])
        rows.append({**r, "estimate_GB": est, "xla_over_estimate": round(total / est, 3)})
    return rows


RUN = "- measured "
"""The start of each line of a merged file's header that names one piece's run."""


def _merged(rows: list[dict], path: pathlib.Path, run: str) -> tuple[list[dict], list[str]]:
    """`rows` merged into the table at `path` (`name.md` beside it): the rows already there
    whose mesh, model and engine `rows` do not measure, then `rows`, in mesh, size and
    engine order; and the header's run lines (`RUN meshes | sizes | engines: ...`), `run`
    for this piece and those of the older pieces that still have rows. A file written
    without `--merge` is one piece."""
    if not path.exists():
        return rows, [run]
    old = _read_rows(path)

    def key(r: dict) -> tuple[str, str, str]:
        return r["mesh"], r["model"], r["engine"]

    new = {key(r) for r in rows}
    kept = [r for r in old if key(r) not in new]
    head = path.with_suffix(".md").read_text().split("\n\n")[1]
    lines = [line for line in head.splitlines() if line.startswith(RUN)]
    if not lines:  # one run wrote it all: name what it measured

        def names(field: str) -> str:
            return ",".join(dict.fromkeys(str(r[field]) for r in old))

        lines = [f"{RUN}{names('mesh')} | {names('model')} | {names('engine')}: {head}"]
    left = {key(r) for r in kept}
    runs = []
    for line in lines:
        meshes, sizes, engines = line.removeprefix(RUN).split(":")[0].split(" | ")
        pieces = [
            (m, s, e)
            for m in meshes.split(",")
            for s in sizes.split(",")
            for e in engines.split(",")
        ]
        if any(piece in left for piece in pieces):
            runs.append(line)
    meshes = list(dict.fromkeys(r["mesh"] for r in [*kept, *rows]))

    def order(r: dict) -> tuple:
        size = SIZES.index(r["model"]) if r["model"] in SIZES else len(SIZES)
        return meshes.index(r["mesh"]), size, r["model"], ENGINES.index(r["engine"])

    # rows of an older file may lack a column added since: left empty
    columns = list(dict.fromkeys(k for r in [*rows, *kept] for k in r))
    merged = [{k: r.get(k, "") for k in columns} for r in [*kept, *rows]]
    return sorted(merged, key=order), [*runs, run]


def row_commits(md: pathlib.Path) -> dict[tuple[str, str, str], str]:
    """Per (mesh, model, engine), the commit of the run that measured the row, from the run
    lines of a merged results file (the last line naming a row measured it)."""
    import re

    head = md.read_text().split("\n\n")[1]
    lines = [line for line in head.splitlines() if line.startswith(RUN)]
    if not lines:  # one run wrote the whole file: its machine line names the commit
        commit = re.search(r"commit ([0-9a-f]{7,})", head)
        rows = _read_rows(md.with_suffix(".csv"))
        return {
            (r["mesh"], r["model"], r["engine"]): commit.group(1) if commit else "?" for r in rows
        }
    out = {}
    for line in lines:
        meshes, sizes, engines = line.removeprefix(RUN).split(":")[0].split(" | ")
        commit = re.search(r"commit ([0-9a-f]{7,})", line.split(". Estimate: ")[0])
        for m in meshes.split(","):
            for size in sizes.split(","):
                for e in engines.split(","):
                    out[(m, size, e)] = commit.group(1) if commit else "?"
    return out


def summary(paths: list[pathlib.Path]) -> str:
    """The table RESULTS.md shows: per mesh and size, each engine's total GB per device
    (in parentheses XLA's total over the estimate for our engines), data parallelism's over
    ZeRO-3's and ZeRO++'s (per-use in parentheses), and XLA FSDP's over ZeRO-3's; then the
    commit each row was measured at (`row_commits`)."""
    head = ["mesh", "model", "data parallel", "XLA FSDP", "ZeRO-3", "ZeRO-3 per-use"]
    head += ["ZeRO++", "ZeRO++ per-use", "DP / ZeRO-3 (per-use)", "DP / ZeRO++ (per-use)"]
    head += ["XLA FSDP / ZeRO-3 (per-use)"]
    body, commits = [], {}
    for path in paths:
        rows = _read_rows(path)
        for (m, size, e), c in row_commits(path.with_suffix(".md")).items():
            commits.setdefault(c, set()).add((m, size, e))
        for mesh in dict.fromkeys(r["mesh"] for r in rows):
            for size in dict.fromkeys(r["model"] for r in rows if r["mesh"] == mesh):
                got = {r["engine"]: r for r in rows if (r["mesh"], r["model"]) == (mesh, size)}

                def gb(e: str, got: dict = got) -> float:
                    return float(got[e]["total_GB"])

                def cell(e: str, got: dict = got) -> str:
                    return f"{gb(e):.3f} ({float(got[e]['xla_over_estimate']):.3f})"

                dp, xla = gb("data parallel"), gb("XLA FSDP")
                z3, z3u, zp, zpu = (gb(e) for e in ENGINES[2:])
                body.append(
                    [mesh, size, f"{dp:.3f}", f"{xla:.3f}", *(cell(e) for e in ENGINES[2:])]
                    + [f"{dp / z3:.2f}x ({dp / z3u:.2f}x)", f"{dp / zp:.2f}x ({dp / zpu:.2f}x)"]
                    + [f"{xla / z3:.2f}x ({xla / z3u:.2f}x)"]
                )
    table = _common.markdown_table(head, body, "llrrrrrrrrr")
    final = {}
    for path in paths:
        final.update(row_commits(path.with_suffix(".md")))
    engines_of: dict[tuple[str, str, str], set[str]] = {}
    for (m, size, e), c in final.items():
        engines_of.setdefault((c, m, size), set()).add(e)
    groups: dict[tuple[str, str, str], list[str]] = {}
    for (c, m, size), engines in engines_of.items():
        if set(ENGINES) == engines:
            which = "all engines"
        elif len(engines) > len(ENGINES) / 2:
            which = "all but " + ", ".join(e for e in ENGINES if e not in engines)
        else:
            which = ", ".join(e for e in ENGINES if e in engines)
        groups.setdefault((c, m, which), []).append(size)
    notes = "; ".join(
        f"commit {c}: {m} {', '.join(sizes)} ({which})" for (c, m, which), sizes in groups.items()
    )
    return table + "\nRows measured at: " + notes + ".\n"


def main(argv: list[str] | None = None) -> list[dict]:
    argv = _common.worker_or_parent(argv, worker)
    if argv is None:
        return []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--meshes", default="2x4,16x8", help="meshes, NODESxLOCAL, comma-separated")
    p.add_argument("--sizes", default=",".join(SIZES), help="presets, comma-separated")
    p.add_argument(
        "--engines", default=",".join(ENGINES), help="rows of these engines, comma-separated"
    )
    p.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence (2048)")
    p.add_argument("--quick", action="store_true", help="tiny on 2 x 4, 128 tokens")
    p.add_argument("--out", default=str(_common.study_dir("memory")))
    p.add_argument(
        "--reestimate",
        action="store_true",
        help="keep the measured columns of the results files already in --out and "
        "recompute only the estimate with this commit's plan.estimate (nothing compiled)",
    )
    p.add_argument(
        "--summary",
        action="store_true",
        help="print the RESULTS.md table from the memory_2x4, memory_16x8 and memory_64x8 "
        "files in --out "
        "(nothing compiled)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="replace only the rows of these sizes and meshes in the results file of "
        "--meshes and keep its others (a table measured in pieces)",
    )
    args = p.parse_args(argv)
    if args.summary:
        out = pathlib.Path(args.out)
        meshes = ("2x4", "16x8", "64x8")
        print(
            summary([out / f"memory_{m}.csv" for m in meshes if (out / f"memory_{m}.csv").exists()])
        )
        return []
    if args.quick:
        args.meshes, args.sizes, args.seq = "2x4", "tiny", 128
    if args.merge and args.reestimate:
        p.error("--merge and --reestimate: re-estimate the whole file, without --merge")
    unknown = [e for e in args.engines.split(",") if e not in ENGINES]
    if unknown:
        p.error(f"--engines: {unknown} unknown; expected some of {','.join(ENGINES)}")
    if args.reestimate and args.engines != ",".join(ENGINES):
        p.error("--reestimate re-estimates every row: leave --engines at its default")
    _common.request_cpu_devices(8)
    machine = _common.machine_line()  # before this run writes anything into the tree
    rows: list[dict] = []
    started = time.time()
    out = pathlib.Path(args.out)
    name = "memory_quick" if args.quick else "memory"
    if not args.quick and args.meshes != "2x4,16x8":
        name += "_" + args.meshes.replace(",", "_")
    if args.reestimate:
        measured = _read_rows(out / f"{name}.csv")
        measured_on = (out / f"{name}.md").read_text().split("\n\n")[1]
        # a file re-estimated before: keep only what it says of the measurement
        measured_on = measured_on.removeprefix("Measured: ").split(". Estimate: ")[0]
    for mesh in args.meshes.split(","):
        cmd = [sys.executable, __file__, "--worker", mesh, str(args.seq), args.engines]
        cmd += args.sizes.split(",")
        if args.reestimate:
            cmd.append("--estimate-only")
        rows += _common.worker_rows(cmd, f"memory.py: the {mesh} worker")
    run = f"`python experiments/memory.py {shlex.join(argv)}`, {time.time() - started:.0f} s. "
    if args.reestimate:
        rows = _reestimated(measured, rows)
        machine = f"Measured: {measured_on.removesuffix('.')}. Estimate: {machine}"
    if args.merge:
        piece = f"{RUN}{args.meshes} | {args.sizes} | {args.engines}: {machine}; {run.strip()}"
        rows, runs = _merged(rows, out / f"{name}.csv", piece)
        machine, run = "\n".join(runs).removesuffix("."), ""
    _common.write_csv(out / f"{name}.csv", rows)
    head = list(rows[0])
    text = (
        f"# Memory per device, compiled from shapes\n\n{machine}.\n\n{run}"
        f"Trainer's GPT presets, scanned, `--remat full`, bfloat16 compute, AdamW, one "
        f"sequence of {args.seq} tokens per device; `total_GB` is arguments + temporaries + "
        "outputs not donated + code, per device, by `compiled.memory_analysis()`; "
        "`estimate_GB` is `zeropp_jax.train.plan.estimate` (XLA FSDP against the ZeRO-3 "
        'formula); ZeRO-3 and ZeRO++ run their default `shared_grad="auto"` (`tied_grad`: '
        'what it picked for the tied embedding), the per-use rows `shared_grad="per_use"`; '
        "`ledger_M` "
        "and `link_M` are our engines' bytes per step (`zpp.comm_ledger`, lowered) per "
        "device and through one node link in one direction, in M (the model in 16-bit "
        "bytes). XLA FSDP is `zeropp_jax.baselines` (weights split on the model width, "
        "activations pinned to the batch at each block, as MaxText runs it). Compile "
        "only; no XLA flags beyond the device count.\n\n"
        + _common.markdown_table(head, [list(r.values()) for r in rows])
    )
    _common.write_text(out / f"{name}.md", text)
    written = [out / f"{name}.md", out / f"{name}.csv"]
    if not args.quick:
        _figure(rows, out / f"{name}.png")
        written.append(out / f"{name}.png")
    _common.say_written(written)
    return rows


if __name__ == "__main__":
    main()
