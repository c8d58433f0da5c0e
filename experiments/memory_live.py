"""The bytes XLA holds live at its peak, beside the heap `memory_analysis()` reports and the
analytic estimate: how much of the gap between `experiments/memory.py`'s totals and the
estimate is XLA's heap packing.

    python experiments/memory_live.py --mesh 16x8 --sizes 125m,350m,1.3b
    python experiments/memory_live.py --quick       # tiny on 2 x 4 (seconds; for tests)

Each row compiles the step `experiments/memory.py` compiles (`memory.measure`, the same
engines and presets) in a worker whose only XLA flags beside the caller's (none from the
command line) dump the compiled module's buffer assignment and live ranges
(`--xla_dump_to`, text; they change nothing that is compiled). From the dump:
`live_peak_GB` is the sum of the buffers XLA's live-range report lists at its peak, each
byte counted once (values that share a buffer, as an in-place update and the loop carry it
updates do, sit at the same offset of the same allocation: the report lists them both);
`memory_analysis()`'s total is the heap XLA lays those buffers out in (its size decides
what a device must hold), plus the arguments.

Writes `memory_live_<mesh>.{md,csv}` into `--out` (default `experiments/results/memory_live/`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

ENGINES = ("ZeRO-3", "ZeRO++")
GB = 1e9


def live_peak_bytes(live_range: str, buffer_assignment: str) -> int:
    """Bytes live at the peak of an XLA `*-live-range.txt` report, each byte once.

    Args:
      live_range: the text of the module's `cpu_after_optimizations-live-range.txt`.
      buffer_assignment: the text of its `cpu_after_optimizations-buffer-assignment.txt`.

    Returns:
      The union, over the values listed at the peak, of the byte ranges their buffers
      occupy (allocation, offset, size), summed over allocations.
    """
    where: dict[str, tuple[int, int, int]] = {}
    alloc = None
    for line in buffer_assignment.splitlines():
        m = re.match(r"allocation (\d+): size (\d+)", line)
        if m:
            alloc = int(m.group(1))
            continue
        m = re.search(r"value: <\d+ (\S+)(?: \(phi\))? @0> \(size=(\d+),offset=(\d+)\)", line)
        if m and alloc is not None:
            where.setdefault(m.group(1), (alloc, int(m.group(3)), int(m.group(2))))
    if "(peak):" not in live_range:
        raise ValueError("no '(peak):' section in the live-range report")
    section = live_range.split("(peak):", 1)[1].split("\n\n", 1)[0]
    spans: dict[int, list[tuple[int, int]]] = {}
    for name, size in re.findall(r"^\s+(\S+): (\d+) bytes", section, re.M):
        # a tuple-shaped value keeps its "{}" in the assignment; an array's is dropped there
        key = name if name in where or not name.endswith("{}") else name[:-2]
        if key not in where:
            raise ValueError(f"value {name} of the live-range report is not in the assignment")
        a, offset, _ = where[key]
        spans.setdefault(a, []).append((offset, offset + int(size)))
    total = 0
    for intervals in spans.values():
        intervals.sort()
        lo, hi = intervals[0]
        for a, b in intervals[1:]:
            if a > hi:
                total += hi - lo
                lo, hi = a, b
            else:
                hi = max(hi, b)
        total += hi - lo
    return total


def _newest_module(dump: pathlib.Path, seen: set[str]) -> tuple[str, str]:
    """(live ranges, buffer assignment) of the largest module dumped since `seen`."""
    new = [p for p in dump.glob("*buffer-assignment.txt") if p.name not in seen]
    seen.update(p.name for p in dump.glob("*"))
    if not new:
        raise RuntimeError(f"no module was dumped into {dump}")
    ba = max(new, key=lambda p: p.stat().st_size)
    lr = ba.with_name(ba.name.replace("-buffer-assignment.txt", "-live-range.txt"))
    return lr.read_text(), ba.read_text()


def worker(argv: list[str]) -> None:
    """`--worker MESH SEQ DUMP ENGINES SIZE...`: one JSON row per size and engine."""
    mesh, seq, dump, engines, *sizes = argv
    flags = os.environ.get("XLA_FLAGS", "")  # the caller's, less the device count
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()
    import memory

    shape = memory._mesh_shape(mesh)
    _common.request_cpu_devices(shape[0] * shape[1])
    import warnings

    warnings.simplefilter("ignore")  # the engine's per-leaf notes; the rows say what ran
    seen: set[str] = set()
    for size in sizes:
        for engine in engines.split(","):
            row = memory.measure(size, engine, shape, int(seq))
            live = live_peak_bytes(*_newest_module(pathlib.Path(dump), seen))
            est = row["estimate_GB"]
            row = {
                **{k: row[k] for k in ("mesh", "model", "engine", "total_GB", "estimate_GB")},
                "live_peak_GB": round(live / GB, 3),
                "xla_over_estimate": row["xla_over_estimate"],
                "live_over_estimate": round(live / GB / est, 3),
                "heap_over_live": round(row["total_GB"] / (live / GB), 3),
            }
            print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = _common.worker_or_parent(argv, worker)
    if argv is None:
        return []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", default="16x8", help="NODESxLOCAL (16x8)")
    p.add_argument("--sizes", default="125m,350m,1.3b", help="presets, comma-separated")
    p.add_argument("--engines", default=",".join(ENGINES), help="engines, comma-separated")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (2048)")
    p.add_argument("--quick", action="store_true", help="tiny on 2 x 4, 128 tokens")
    p.add_argument("--out", default=str(_common.study_dir("memory_live")))
    args = p.parse_args(argv)
    if args.quick:
        args.mesh, args.sizes, args.seq = "2x4", "tiny", 128
    _common.request_cpu_devices(8)
    machine = _common.machine_line()  # before this run writes anything into the tree
    started = time.time()
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, __file__, "--worker", args.mesh, str(args.seq), dump]
        rows = _common.worker_rows([*cmd, args.engines, *args.sizes.split(",")], "the worker")
    name = "memory_live_quick" if args.quick else f"memory_live_{args.mesh}"
    run = f"`python experiments/memory_live.py {' '.join(argv)}`, {time.time() - started:.0f} s."
    head = (
        f"# Live bytes at XLA's peak against its heap\n\n{machine}.\n\n{run} "
        "`total_GB` is `memory.py`'s: arguments + temporaries + outputs not donated + code "
        "by `compiled.memory_analysis()`, the temporaries being the heap XLA lays its "
        "buffers out in; `live_peak_GB` is what XLA's live-range report lists at its peak "
        "(arguments included), each buffer's bytes once; `estimate_GB` is "
        "`zeropp_jax.train.plan.estimate`. Compile only; the worker's XLA flags dump the "
        "compiled module as text and change nothing else.\n\n"
    )
    _common.write_table(pathlib.Path(args.out), name, head, rows)
    return rows


if __name__ == "__main__":
    main()
