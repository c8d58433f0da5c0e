"""Reading a GPU program compiled without a GPU, and the table of what each one runs
(for `experiments/gpu_compile.py`, which compiles them).

`read_program` takes a compiled, scheduled step (`jax.stages.Compiled`) and says what the
GPU would run: every collective, whether XLA left it asynchronous (a `-start` / `-done`
pair not marked `is_sync`), the dtypes it sends per mesh axis, and for each all-gather
whether at least one compute instruction (a fusion, a library call such as a GEMM, a
loop) is scheduled between its start and its done, per place (forward and backward, in
the scanned layers' loops or outside them). `minimal_hlo` cuts a program to what these
readers need, for the test fixtures in `tests/data`. `merged` and `report` keep the
results table: one row per (engine, model, mesh, flags, gpu).

A schedule, not a time: an overlapped gather is one the GPU is allowed to run beside
compute; nothing here says how long either takes.
"""

from __future__ import annotations

import collections
import pathlib
import re
from typing import Any

import _common
import _engines

ENGINES = ("ZeRO-3", "ZeRO++", "int4-delta", "XLA FSDP")
MODELS = ("gpt", "1.3b")
MESHES = ("2x4", "2x8")
FLAG_SETS = ("none", "docs")
"""The rows' vocabulary, in the table's order."""
SLUGS = {engine: _engines.lookup(engine).slug for engine in ENGINES}
"""Each engine's name in the names of the saved programs (`--save-hlo`): its `_engines`
slug."""


_KEPT_OPS = ("while", "call", "conditional", "async-start", "async-done")
"""Instructions whose metadata and backend config `minimal_hlo` keeps (and collectives)."""
_LOCATION_RE = re.compile(
    r" (?:stack_frame_id|source_line|source_end_line|source_column"
    r"|source_end_column)=\S+| source_file=\"[^\"]*\""
)


def minimal_hlo(text: str) -> str:
    """Compiled HLO text cut to what `scheduled_collectives`, `loop_bodies` and the ledger
    read, for small test fixtures: the source-location tables, the bodies of fused
    computations and reducers, and the metadata and backend configs of every instruction
    but collectives, loops and calls are dropped; the schedule order is kept."""
    from _library import hlo_text

    drop = set(re.findall(r" fusion\(.*?calls=%([\w.\-]+)", text))
    drop |= set(re.findall(r"to_apply=%([\w.\-]+)", text))
    out, skipping, table = [], False, False
    for line in text.splitlines():
        if skipping:
            skipping = line != "}"
            continue
        if line.strip() in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = True
        if table:
            table = bool(line.strip())
            continue
        head = re.match(r"^%([\w.\-]+) \(.*\{$", line)
        if head and head.group(1) in drop:
            skipping = True
            continue
        ins = hlo_text.parse_instruction(re.sub(r"/\*.*?\*/", "", line))
        opcode = ins.opcode.removesuffix("-start").removesuffix("-done") if ins else ""
        if opcode in hlo_text.COLLECTIVE_OPS or (ins and ins.opcode in _KEPT_OPS):
            line = _LOCATION_RE.sub("", line)
        else:
            line = re.sub(r", metadata=\{[^}]*\}", "", line)
            line = re.sub(r", backend_config=(?:\{.*\}|\"[^\"]*\")$", "", line)
        out.append(line)
    return "\n".join(out) + "\n"


class Precompiled:
    """Hands `comm_ledger(..., compiled=True)` a program compiled already."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled

    def lower(self, *args: Any, **kwargs: Any) -> Precompiled:
        return self

    def compile(self) -> Any:
        return self.compiled


def axes_of(collective: Any, mesh: Any) -> str:
    """`node`, `local`, `node+local` (or `-` when no data moves) for a collective."""
    from _library import group_axes, parse_replica_groups

    if collective.op == "collective-permute":
        pairs = parse_replica_groups(collective.replica_groups or "{}", 0)
        groups = [p for p in pairs if len(set(p)) > 1]
    else:
        groups = parse_replica_groups(collective.replica_groups or "{}", mesh.devices.size)
    return "+".join(group_axes(mesh, groups)) or "-"


def wire_text(collectives: list, mesh: Any) -> str:
    """`op/axes: dtypes` for each distinct kind, e.g. `all-gather/node: float32,int8`."""
    kinds: dict[str, set[str]] = collections.defaultdict(set)
    for c in collectives:
        kinds[f"{c.op}/{axes_of(c, mesh)}"].update(c.dtypes)
    return "; ".join(f"{k}: {','.join(sorted(v))}" for k, v in sorted(kinds.items()))


def gather_bytes(gathers: list) -> str:
    """Operand bytes per device of the gathers by dtype, in MB (each instruction once)."""
    from _library import array_shapes

    by: dict[str, int] = collections.defaultdict(int)
    for g in gathers:
        for shape in g.shapes:
            for dtype, nbytes in array_shapes(shape):
                by[dtype] += nbytes
    return "; ".join(f"{d} {b / 1e6:.3f}" for d, b in sorted(by.items()))


def same_bytes(gpu: Any, asked: Any) -> bool:
    """Whether the GPU program sends per (op, mesh axes, dtype) what the ledger says,
    through the node links and in total (to 0.1%)."""
    a, b = gpu.bytes_by("op", "axes", "dtype"), asked.bytes_by("op", "axes", "dtype")
    keys = {k for k in set(a) | set(b) if max(a.get(k, 0), b.get(k, 0)) > 1024}
    close = all(
        abs(a.get(k, 0) - b.get(k, 0)) <= 1e-3 * max(a.get(k, 0), b.get(k, 0)) for k in keys
    )
    return close and abs(gpu.link_bytes - asked.link_bytes) <= 1e-3 * max(asked.link_bytes, 1)


def most_in_flight(module: Any, collectives: list) -> int:
    """The most asynchronous collectives in flight at once at any point of the schedule
    (started, not yet done), in any computation: XLA's GPU scheduler runs them on one
    stream, so 1 means it never overlaps two collectives."""
    starts = {(c.computation, c.name) for c in collectives if c.asynchronous}
    best = 0
    for comp, instructions in module.computations.items():
        open_: dict[str, str] = {}  # the start, or an async-update of it -> the start
        for ins in instructions:
            if (comp, ins.name) in starts:
                open_[ins.name] = ins.name
            elif ins.operands and ins.operands[0] in open_:
                if ins.opcode == "async-update":
                    open_[ins.name] = open_.pop(ins.operands[0])
                elif ins.opcode.endswith("-done"):
                    open_.pop(ins.operands[0])
            best = max(best, len(set(open_.values())))
    return best


def read_program(compiled: Any, mesh: Any) -> dict[str, Any]:
    """What the compiled step runs: collectives, their overlap, per loop."""
    from _library import hlo_text, phase_of

    module = hlo_text.parse_hlo_module(compiled.as_text())
    collectives = hlo_text.scheduled_collectives(module)
    bodies = hlo_text.loop_bodies(module)
    paths = hlo_text.call_paths(module)

    def where(c) -> str:
        chain = paths.get(c.computation) or [()]
        names = [call.op_name for call, _ in chain[0]] + [c.op_name]
        phase = "bwd" if phase_of(names) == "backward" else "fwd"
        return f"{phase} loop" if c.computation in bodies else phase

    gathers = [c for c in collectives if c.op == "all-gather"]
    per_place: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for g in gathers:
        counts = per_place[where(g)]
        counts[0] += 1
        counts[1] += g.asynchronous
        counts[2] += g.overlapped
    places = "; ".join(
        f"{k} {a}/{o}/{n}" for k, (n, a, o) in sorted(per_place.items()) if n
    )  # async / overlapped / gathers
    tight = [
        f"{g.name} ({where(g)}, {','.join(g.dtypes)}, {'async' if g.asynchronous else 'sync'})"
        for g in gathers
        if not g.overlapped
    ]
    return {
        "collectives": len(collectives),
        "async_collectives": sum(c.asynchronous for c in collectives),
        "max_in_flight": most_in_flight(module, collectives),
        "gathers": len(gathers),
        "overlapped_gathers": sum(g.overlapped for g in gathers),
        "matmul_overlapped_gathers": sum(g.overlapped and g.matmuls > 0 for g in gathers),
        "gathers_by_place": places,
        "wire_dtypes": wire_text(collectives, mesh),
        "gather_mb": gather_bytes(gathers),
        "not_overlapped": tight,
        "loops": {b: n for b, (_, n) in bodies.items()},
    }


# ------------------------------------------------------------------------ the table

HEAD = """# GPU programs compiled without a GPU

`python experiments/gpu_compile.py` (deviceless compilation for topologies of
`nodes x 1 x GPUs per node` of the GPU in the `gpu` column, jax-cuda12-plugin {plugin}).

The run that last wrote this file: {machine}. The rows come from several runs (`--rows`,
`--merge`, `--rows-from`): each row's `code` column names the code that compiled it.

Each row is one training step compiled by XLA's GPU compiler for that mesh of GPUs, read
from the compiled, scheduled program. **These are schedules, not times:** an overlapped
gather is one with at least one compute instruction (a fusion, a GEMM, a Triton call, a
loop) scheduled between its start and its done, which the GPU is allowed to run while the
gather is in flight; whether that hides the transfer depends on the real durations, which
nothing here measures.

Columns: `collectives` (instructions in the program; each loop body counted once),
`async_collectives` (left asynchronous by XLA), `max_in_flight` (the most asynchronous
collectives started and not yet done at any point of the schedule), `gathers` /
`overlapped_gathers` (all-gathers, the weight gathers), `matmul_overlapped_gathers` (of
those, with a matrix multiplication in between), `gathers_by_place` (per place:
asynchronous / overlapped / gathers, `fwd loop` and `bwd loop` the scanned layers),
`wire_dtypes` (op/mesh axes: dtypes sent; 4-bit values travel packed two per `uint8`),
`bytes_as_ledger` (the compiled program sends per op, mesh axes and dtype, and through the
node links, what the lowered step's ledger counts, to 0.1%), `temp_gb` (XLA's temporaries
per GPU), `total_gb` (arguments + temporaries + outputs not aliased, per GPU) against
`estimate_gb` (`plan.estimate(..., platform="gpu")`; `estimate_cpu_gb` its CPU form, with
float32 internals), `link_mb_ledger` / `link_mb_gpu` (MB per step through one node's link,
each way: the lowered step's ledger, and the compiled GPU program read the same way with
NCCL's ring order), `code` (the commit that compiled the row).

"""


def saved_in_flight(folder: pathlib.Path, row: dict[str, Any]) -> int:
    """`most_in_flight` of a row's program saved by `--save-hlo`."""
    import gzip

    from _library import hlo_text

    slug = "_".join((SLUGS[row["engine"]], row["model"], row["mesh"], row["flags"], row["gpu"]))
    path = folder / f"{slug}.hlo.gz"
    if not path.exists():
        raise SystemExit(
            f"gpu_compile: no saved program {path} for {slug}; expected the "
            "--save-hlo folder of the run that printed the row."
        )
    module = hlo_text.parse_hlo_module(gzip.decompress(path.read_bytes()).decode())
    return most_in_flight(module, hlo_text.scheduled_collectives(module))


def with_in_flight(folder: pathlib.Path, row: dict[str, Any]) -> dict[str, Any]:
    """`row` with `max_in_flight` after `async_collectives`, read off its saved program
    unless the row has it."""
    if "max_in_flight" in row:
        return row
    out = {}
    for key, value in row.items():
        out[key] = value
        if key == "async_collectives":
            out["max_in_flight"] = saved_in_flight(folder, row)
    return out


KEY = ("engine", "model", "mesh", "flags", "gpu")


def write_kernels(path: pathlib.Path, new: list[dict[str, Any]]) -> None:
    """The kernel rows of `path` for the other GPUs, then `new` (one GPU's)."""
    gpus = {r["gpu"] for r in new}
    old = [r for r in read_rows(path) if r["gpu"] not in gpus] if path.exists() else []
    _common.write_csv(path, sorted(old + new, key=lambda r: r["gpu"] != "h200"))


def read_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """`old` with the rows of `new` replacing those of the same key, new keys appended,
    in the order engines x models x meshes x flags."""

    def key(r: dict) -> tuple[str, ...]:
        return tuple(str(r.get(k) or "h200") if k == "gpu" else str(r[k]) for k in KEY)

    by = {key(r): r for r in old}
    by.update({key(r): r for r in new})

    def order(key):
        engine, model, mesh, flags, gpu = key
        rank = {v: i for group in (ENGINES, MODELS, MESHES, FLAG_SETS) for i, v in enumerate(group)}
        return (
            gpu != "h200",
            gpu,
            rank.get(mesh, 9),
            rank.get(model, 9),
            rank.get(engine, 9),
            rank.get(flags.split("+")[0], 9),
            flags,
        )

    rows = [{**by[k], "gpu": k[-1]} for k in sorted(by, key=order)]
    columns = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k, "") for k in columns} for r in rows]


def report(head: str, rows: list[dict], kernels: list[dict]) -> str:
    """The markdown: the table (without the long columns), the kernels, then each gather
    that has no compute between its start and its done."""
    short = [k for k in rows[0] if k not in ("not_overlapped", "gather_mb")]
    text = head + _common.markdown_table(short, [[r[k] for k in short] for r in rows])
    text += "\nGather operand bytes per GPU by dtype (MB, each instruction once):\n\n"
    text += _common.markdown_table(
        [*KEY, "gather_mb"], [[*(r[k] for k in KEY), r["gather_mb"]] for r in rows]
    )
    if kernels:
        text += "\n## The Pallas kernels alone, compiled for one GPU\n\n"
        text += _common.markdown_table(list(kernels[0]), [list(r.values()) for r in kernels])
    text += "\n## The goals, read off the rows above\n\n" + goals(rows)
    text += "\n## Gathers with no compute between their start and their done\n\n"
    text += (
        "What holds each back (a leaf outside the scanned blocks, gathered at its use; one\n"
        "collective in flight at a time, `max_in_flight`): `experiments/RESULTS.md`, section\n"
        '"GPU programs compiled without a GPU".\n\n'
    )
    for r in rows:
        if r["not_overlapped"]:
            text += f"- {', '.join(str(r[k]) for k in KEY)}: {r['not_overlapped']}\n"
    return text


def places(text: str) -> dict[str, tuple[int, int, int]]:
    """`gathers_by_place` parsed: `{place: (asynchronous, overlapped, gathers)}`."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        place, counts = part.rsplit(" ", 1)
        a, o, n = (int(v) for v in counts.split("/"))
        out[place] = (a, o, n)
    return out


def goals(rows: list[dict]) -> str:
    """One line per row a goal of issue #36 is about, met or not, with its numbers:
    ZeRO++ on the trainer GPT with the docs' flags (every gather in the forward and the
    backward loop asynchronous, at least 80% overlapped), XLA FSDP's gathers in 16 bits
    (float32 under 1% of the floating-point bytes gathered; integers, the token ids,
    aside), the 1.3B ZeRO++ step's memory per GPU within 10% of the GPU estimate."""
    lines = []
    for r in rows:
        where = f"{r['engine']}, {r['model']}, {r['mesh']}, {r['flags']}, {r['gpu']}"
        if r["engine"] == "ZeRO++" and r["model"] == "gpt" and r["flags"] == "docs":
            at = places(r["gathers_by_place"])
            parts, met = [], True
            for loop in ("fwd loop", "bwd loop"):
                a, o, n = at.get(loop, (0, 0, 0))
                met &= n > 0 and a == n and o >= 0.8 * n
                parts.append(f"{loop}: {a} of {n} asynchronous, {o} overlapped")
            out = [v for k, v in at.items() if "loop" not in k]
            parts.append(
                f"outside the loops (not part of the goal): {sum(v[1] for v in out)} of "
                f"{sum(v[2] for v in out)} overlapped"
            )
            verdict = "met" if met else "NOT met"
            lines.append(
                f"- Loop gathers asynchronous and >= 80% overlapped ({where}): "
                f"{verdict}; {'; '.join(parts)}"
            )
        if r["engine"] == "XLA FSDP":
            by = {d: float(mb) for d, mb in (x.split() for x in r["gather_mb"].split(";"))}
            wide = by.get("float32", 0.0)
            narrow = by.get("bfloat16", 0.0) + by.get("uint16", 0.0)
            other = "".join(f", {mb:.3f} MB {d}" for d, mb in by.items() if d.startswith("int"))
            met = wide < 0.01 * (wide + narrow)
            lines.append(
                f"- XLA FSDP gathers in 16 bits ({where}): {'met' if met else 'NOT met'}; "
                f"{narrow:.3f} MB in 16 bits, {wide:.3f} MB float32{other} per GPU"
            )
        if r["engine"] == "ZeRO++" and r["model"] == "1.3b":
            ratio = float(r["total_over_estimate"])
            met = abs(ratio - 1) <= 0.1
            lines.append(
                f"- 1.3B ZeRO++ memory within 10% of the GPU estimate ({where}): "
                f"{'met' if met else 'NOT met'}; {r['total_gb']} GB per GPU against "
                f"{r['estimate_gb']} GB ({(ratio - 1) * 100:+.1f}%)"
            )
    return "\n".join(lines) + "\n"
