"""experiments/cluster/step_timeline.py: the phase arithmetic on a synthetic trace (the
cluster run itself needs root and minutes; its output is experiments/results/step_timeline/)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(ROOT, "experiments", "cluster")


@pytest.fixture(scope="module")
def st():
    sys.path[:0] = [CLUSTER, os.path.join(ROOT, "experiments")]
    try:
        spec = importlib.util.spec_from_file_location(
            "step_timeline", os.path.join(CLUSTER, "step_timeline.py")
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.path[:2]


def _ms(x: float) -> int:
    return int(x * 1e6)


def test_phases_split_at_the_first_reduction_and_count_same_device_overlap(st):
    # Profiler clock starts at 5 ms; the wall clock (t0, t1, tx) at 1000 ms.
    p0, w0 = _ms(5), _ms(1000)
    spans = [
        ("overlap_probe_step", "step", -1, p0, p0 + _ms(100)),
        # device 0: a gather 0-40 ms with a dot 30-50 ms (10 ms at once), then an
        # all-to-all 60-90 ms beside an elementwise fusion 70-75 ms (5 ms at once).
        ("all_gather.1", "collective", 0, p0, p0 + _ms(40)),
        ("ynn_fusion.3", "compute", 0, p0 + _ms(30), p0 + _ms(50)),
        ("all-to-all.2", "collective", 0, p0 + _ms(60), p0 + _ms(90)),
        ("or_bitcast_fusion.4", "compute", 0, p0 + _ms(70), p0 + _ms(75)),
        # device 2049 (another process's numbering): compute never beside its own
        # collective; a loop thunk (it only runs nested thunks) counts as neither.
        ("all_gather.1", "collective", 2049, p0, p0 + _ms(40)),
        ("ynn_fusion.3", "compute", 2049, p0 + _ms(40), p0 + _ms(60)),
    ]
    # 1.25 MB sent by 50 ms (forward), 0.5 MB more by 100 ms.
    tx = [(w0, 0), (w0 + _ms(50), 1_250_000), (w0 + _ms(100), 1_750_000)]
    record = dict(t0=w0, t1=w0 + _ms(100), spans=spans, tx=tx)
    fwd, bwd, step = st.phases(record, rate_mbit=100.0)
    assert (fwd["phase"], fwd["ms"], bwd["ms"], step["ms"]) == ("forward", 60, 40, 100)
    assert fwd["tx_mb"] == pytest.approx(1.25) and bwd["tx_mb"] == pytest.approx(0.5)
    assert fwd["link_ms"] == pytest.approx(100.0)  # 1.25 MB at 100 Mbit/s
    assert fwd["collective_ms"] == pytest.approx(40.0)
    assert fwd["compute_ms"] == pytest.approx(20.0)  # mean of 20 and 20
    assert fwd["both_ms"] == pytest.approx(5.0)  # device 0's 10 ms, device 1's 0
    assert bwd["both_ms"] == pytest.approx(2.5)
    assert dict(fwd["kinds"]) == pytest.approx({"ynn_fusion (dot)": 20.0})
    assert dict(bwd["kinds"]) == pytest.approx({"or_bitcast_fusion": 5.0})
    assert st.phases(record, rate_mbit=None)[0]["link_ms"] is None


def test_loop_thunks_are_neither_compute_nor_collective_and_ppermute_is_a_collective(st):
    assert st.CONTAINER_THUNK.match("while.3") and st.CONTAINER_THUNK.match("call")
    assert not st.CONTAINER_THUNK.match("while_fusion.2")
    for name in ("ppermute.4", "collective-permute.1", "all-to-all", "all_gather.12"):
        assert st.COLLECTIVE_THUNK.match(name), name
    assert not st.COLLECTIVE_THUNK.match("ynn_fusion.9")


def test_trace_interval_arithmetic(st):
    import _trace  # on the path while `st` is loaded

    a = _trace.union([(5, 8), (0, 3), (2, 4)])
    assert a == [(0, 4), (5, 8)] and _trace.length(a) == 7
    assert _trace.intersection(a, [(3, 6)]) == [(3, 4), (5, 6)]
    hlo = "%all-gather.3 = s8[2,8]{1,0} all-gather(%p), dims={0}\n%psum.1 = f32[] all-reduce(%x)"
    assert _trace.collective_names(hlo) == {"all-gather.3", "psum.1"}
