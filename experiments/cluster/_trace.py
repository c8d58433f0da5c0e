"""Reading a step's timeline on the emulated cluster: profiler thunk spans, the veth's tx
counter, and interval arithmetic over them. Shared by `overlap_probe.py` and
`step_timeline.py`; times are nanoseconds (the profiler's clock, `time.time_ns`)."""

from __future__ import annotations

import os
import re
import threading
import time

STEP_ANNOTATION = "overlap_probe_step"
"""The `jax.profiler.TraceAnnotation` around the step whose thunks are read."""
COLLECTIVE = re.compile(r"^(all[-_]gather|all[-_]reduce|reduce[-_]scatter|all[-_]to[-_]all)")


class TxSampler(threading.Thread):
    """Samples `/sys/class/net/<iface>/statistics/tx_bytes` every `period_s` (wall clock
    in ns, the profiler's clock), for at most `limit_s`."""

    def __init__(self, iface: str, period_s: float = 0.001, limit_s: float = 60.0):
        super().__init__(daemon=True)
        self.path = f"/sys/class/net/{iface}/statistics/tx_bytes"
        self.period_s, self.limit_s = period_s, limit_s
        self.samples: list[tuple[int, int]] = []
        self.stop = threading.Event()

    def read(self) -> int:
        with open(self.path) as f:
            return int(f.read())

    def run(self) -> None:
        end = time.monotonic() + self.limit_s
        while not self.stop.is_set() and time.monotonic() < end:
            self.samples.append((time.time_ns(), self.read()))
            time.sleep(self.period_s)


def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals) -> int:
    return sum(e - s for s, e in intervals)


def intersection(a, b) -> list[tuple[int, int]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def collective_names(hlo_text: str) -> set[str]:
    """Names of the collective instructions of a compiled module (a psum's all-reduce is
    named after the primitive, e.g. `psum.1`)."""
    pattern = r"%?([\w.\-]+) = [^=]*? (?:all-gather|all-reduce|reduce-scatter|all-to-all)\S*\("
    return set(re.findall(pattern, hlo_text))


def thunk_events(trace_dir: str) -> list[tuple[str, int | None, int, int]]:
    """`(name, device, start_ns, end_ns)` from a `jax.profiler.trace` directory: the step's
    `STEP_ANNOTATION` (device None) and every thunk. XLA:CPU's thunk executor names each
    span after its thunk (`all_gather.3`, `ynn_fusion.15`, `wrapped_tanh`) and tags it with
    the device ordinal; framework spans (with `::`, spaces, brackets) are skipped."""
    import glob

    from jax._src.lib import _profile_data

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        return []
    plane = _profile_data.ProfileData.from_file(files[-1]).find_plane_with_name("/host:CPU")
    out = []
    for line in plane.lines:
        for ev in line.events:
            if ev.name == STEP_ANNOTATION:
                out.append((ev.name, None, int(ev.start_ns), int(ev.end_ns)))
                continue
            stats = dict(ev.stats)
            if "device_ordinal" in stats and not re.search(r"[:\s()\[\]$]", ev.name):
                out.append((ev.name, int(stats["device_ordinal"]), ev.start_ns, ev.end_ns))
    return out
