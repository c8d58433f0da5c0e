"""What the peak of a compiled training step holds, per device: XLA's own buffer report.

    python experiments/memory_peak.py                    # 125m, 350m on 2x4 and 16x8
    python experiments/memory_peak.py --meshes 2x4 --sizes 125m --top 5

For each mesh, preset and engine (XLA FSDP and ZeRO-3 by default, set up as
`experiments/memory.py` sets them up: the trainer's GPT, scanned, `--remat full`, bfloat16
compute, one 2048-token sequence per device), compiles one training step from shapes in a
process of its own that asks XLA to write its buffer assignment (`--xla_dump_to`, for that
process only), and reads the step's `memory-usage-report`: the allocation slots XLA packed
the step's temporaries into, largest first, each with the shapes of the values that share
it over the step. A slot is a range of bytes that values whose lives do not overlap take in turn.

Each row names the slots that hold a whole copy of the tied embedding table (any value with
`vocab x d_model` elements: the gathered table, its gradient, as bits or values) at some
point of the step, and then, from XLA's live-range report (`--xla_dump_to` writes it beside
the memory-usage report), what is live at the step's peak: the bytes, the instruction
there, the whole tables among them and the largest buffers. A slot's values may live at
other times than the peak; the live set is what the peak is made of. Issue #48 asks why
ZeRO-3 needs more memory than XLA FSDP at 125M and 350M; this is the measurement that
answers it.

Writes `memory_peak.{md,csv}` into `--out` (default `experiments/results/memory_peak/`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import shlex
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

MIB = 2**20
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_SLOT = re.compile(r"^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)(B|KiB|MiB|GiB);\s*\d+;\s*\d+;\s*(.*)$")
_SHAPE = re.compile(r"(?:(\d+)×)?([a-z]+\d*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Slot:
    """One allocation slot of a memory-usage report.

    Attributes:
      size: bytes (as XLA prints them, to its two decimals).
      shapes: each value's type that shares the slot, e.g. `u16[50304,768]`, repeated as
        often as the report counts it.
    """

    size: float
    shapes: tuple[str, ...]


def slots(report: str) -> list[Slot]:
    """The allocation slots of an XLA `*memory-usage-report.txt`, in its order (largest
    first)."""
    out = []
    for line in report.splitlines():
        m = _SLOT.match(line)
        if m is None:
            continue
        shapes = []
        for count, dtype, dims in _SHAPE.findall(m.group(3)):
            shapes += [f"{dtype}[{dims}]"] * int(count or 1)
        out.append(Slot(float(m.group(1)) * UNITS[m.group(2)], tuple(shapes)))
    return out


def elements(shape: str) -> int:
    """Values of a type such as `u16[50304,768]` (1 for a scalar, `f32[]`)."""
    dims = shape[shape.index("[") + 1 : -1]
    return math.prod(int(d) for d in dims.split(",") if d)


def largest_first(shapes: tuple[str, ...]) -> list[str]:
    """The distinct types of `shapes`, most elements first (then by name)."""
    return sorted(set(shapes), key=lambda x: (-elements(x), x))


def holding(found: list[Slot], count: int) -> list[Slot]:
    """The slots among `found` that hold a value of `count` elements."""
    return [s for s in found if any(elements(x) == count for x in s.shapes)]


@dataclasses.dataclass(frozen=True)
class Live:
    """One buffer live at the peak of a compiled step (XLA's live-range report).

    Attributes:
      name: the instruction that defines it, e.g. `copy.608`.
      size: bytes.
      type: its type in the optimized HLO, e.g. `u16[50304,768]` ('' for a tuple).
    """

    name: str
    size: int
    type: str


_LIVE = re.compile(r"^\s+(\S+?)\{[\d,]*\}: (\d+) bytes", re.M)
_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = ([a-z]+\d*\[[\d,]*\])", re.M)


def peak(live_range: str, hlo: str) -> tuple[str, list[Live]]:
    """Where the peak of a step is and what is live there, from XLA's
    `*-live-range.txt` and the step's optimized HLO text: the `op_name` of the
    instruction at the peak (its name where it has none) and the buffers live at it,
    largest first."""
    head = re.search(r"Live ranges at (\d+) \(peak\):", live_range)
    if head is None:
        raise ValueError("not an XLA live-range report: no 'Live ranges at ... (peak)' line")
    at = re.search(rf"^\s+{head.group(1)}:(\S+)$", live_range, re.M)
    name = at.group(1) if at else "?"
    line = re.search(rf"^\s*(?:ROOT )?%?{re.escape(name)} = .*$", hlo, re.M)
    op = re.search(r'op_name="([^"]*)"', line.group(0)) if line else None
    types = dict(_DEF.findall(hlo))
    found = [Live(n, int(b), types.get(n, "")) for n, b in _LIVE.findall(live_range[head.end() :])]
    return (op.group(1) if op else name), sorted(found, key=lambda v: (-v.size, v.name))


def total_bytes(report: str) -> int:
    """The `Total bytes:` a memory-usage report states (its memory space's allocation)."""
    m = re.search(r"Total bytes: (\d+)", report)
    if m is None:
        raise ValueError("not an XLA memory-usage report: no 'Total bytes:' line")
    return int(m.group(1))


def _report(folder: pathlib.Path) -> tuple[str, str, str]:
    """The largest module's memory-usage report in an XLA dump folder (the step's), with
    its live-range report and its optimized HLO text."""
    reports = sorted(folder.glob("*memory-usage-report.txt"), key=lambda p: p.stat().st_size)
    if not reports:
        raise SystemExit(f"memory_peak.py: XLA wrote no memory-usage report into {folder}")
    stem = reports[-1].name.removesuffix("-memory-usage-report.txt")
    live = folder / f"{stem}-live-range.txt"
    hlo = folder / f"{stem}.txt"
    return reports[-1].read_text(), live.read_text(), hlo.read_text()


def worker(argv: list[str]) -> None:
    """`--worker MESH SEQ TOP SIZE ENGINE`: one compile with XLA's dump; prints one JSON row."""
    mesh, seq, top, size, engine = argv
    nodes, local = (int(v) for v in mesh.split("x"))
    import os

    folder = tempfile.TemporaryDirectory(prefix="memory_peak_")  # removed at exit
    dump = folder.name
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()
    _common.request_cpu_devices(nodes * local)
    import warnings

    warnings.simplefilter("ignore")  # the engine's per-leaf notes
    import memory

    from zeropp_jax.train.flags import gpt_config, parse_args

    row = memory.measure(size, engine, (nodes, local), int(seq))
    gpt = gpt_config(parse_args(["--model", size]))
    report, live_range, hlo = _report(pathlib.Path(dump))
    folder.cleanup()
    found = slots(report)
    table = holding(found, gpt.vocab_size * gpt.d_model)
    where, live = peak(live_range, hlo)
    tables = [v for v in live if v.type and elements(v.type) == gpt.vocab_size * gpt.d_model]
    print(
        json.dumps(
            {
                "mesh": mesh,
                "model": size,
                "engine": engine,
                "temp_GB": row["temp_GB"],
                "total_GB": row["total_GB"],
                "report_total_MiB": round(total_bytes(report) / MIB, 2),
                "whole_table_slots": len(table),
                "whole_table_MiB": round(sum(s.size for s in table) / MIB, 2),
                "peak_live_MiB": round(sum(v.size for v in live) / MIB, 2),
                "peak_at": "/".join(where.split("/")[-3:]),
                "peak_whole_tables": len(tables),
                "peak_largest": "; ".join(
                    f"{v.size / MIB:.2f} MiB {v.type or v.name}" for v in live[: int(top)]
                ),
            }
        ),
        flush=True,
    )


def main(argv: list[str] | None = None) -> list[dict]:
    argv = _common.worker_or_parent(argv, worker)
    if argv is None:
        return []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--meshes", default="2x4,16x8", help="meshes, NODESxLOCAL, comma-separated")
    p.add_argument("--sizes", default="125m,350m", help="presets, comma-separated")
    p.add_argument("--engines", default="XLA FSDP,ZeRO-3", help="engines, comma-separated")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (2048)")
    p.add_argument("--top", type=int, default=6, help="largest live buffers listed (6)")
    p.add_argument("--out", default=str(_common.study_dir("memory_peak")))
    args = p.parse_args(argv)
    _common.request_cpu_devices(8)
    machine = _common.machine_line()
    started = time.time()
    rows: list[dict] = []
    for mesh in args.meshes.split(","):
        for size in args.sizes.split(","):
            for engine in args.engines.split(","):
                cmd = [sys.executable, __file__, "--worker", mesh, str(args.seq), str(args.top)]
                rows += _common.worker_rows([*cmd, size, engine], f"memory_peak.py {mesh}")
    head = (
        f"# What the peak of a compiled step holds, per device\n\n{machine}.\n\n"
        f"`python experiments/memory_peak.py {shlex.join(argv)}`, "
        f"{time.time() - started:.0f} s. Per row: XLA's memory analysis (`temp_GB`, "
        "`total_GB`, as `memory.py` reads it), the total the step's memory-usage report "
        "states (MiB; arguments, outputs and temporaries), the slots that hold a value "
        "with as many elements as the tied embedding table (`vocab x d_model`: the "
        "gathered table or its gradient, as values or bits) over the whole step; then, "
        "from XLA's live-range report, the bytes live at the step's peak "
        "(`peak_live_MiB`, each buffer once), the last three parts of the `op_name` of "
        "the instruction at the peak, how many values live there are a whole table, and "
        f"the {args.top} largest buffers live there with their types.\n\n"
    )
    _common.write_table(pathlib.Path(args.out), "memory_peak", head, rows)
    return rows


if __name__ == "__main__":
    main()
