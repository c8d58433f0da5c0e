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
`vocab x d_model` elements: the gathered table, its gradient, as bits or values) and the
largest slots. Issue #48 asks why ZeRO-3 needs more memory than XLA FSDP at 125M and 350M;
this is the measurement that answers it.

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


def total_bytes(report: str) -> int:
    """The `Total bytes:` a memory-usage report states (its memory space's allocation)."""
    m = re.search(r"Total bytes: (\d+)", report)
    if m is None:
        raise ValueError("not an XLA memory-usage report: no 'Total bytes:' line")
    return int(m.group(1))


def _report(folder: pathlib.Path) -> str:
    """The largest module's memory-usage report in an XLA dump folder (the step's)."""
    reports = sorted(folder.glob("*memory-usage-report.txt"), key=lambda p: p.stat().st_size)
    if not reports:
        raise SystemExit(f"memory_peak.py: XLA wrote no memory-usage report into {folder}")
    return reports[-1].read_text()


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
    report = _report(pathlib.Path(dump))
    folder.cleanup()
    found = slots(report)
    table = holding(found, gpt.vocab_size * gpt.d_model)
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
                "largest_slots": "; ".join(
                    f"{s.size / MIB:.2f} MiB: {', '.join(largest_first(s.shapes)[:4])}"
                    for s in found[: int(top)]
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
    p.add_argument("--top", type=int, default=4, help="largest slots listed per row (4)")
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
        "gathered table or its gradient, as values or bits) and the largest slots with "
        "the types of the values that share each (at most four listed, most elements "
        "first).\n\n"
    )
    _common.write_table(pathlib.Path(args.out), "memory_peak", head, rows)
    return rows


if __name__ == "__main__":
    main()
