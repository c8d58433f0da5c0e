"""Topology-aware `make_mesh`: node rows follow hosts, whatever the processes per host.

The layout rules run on stand-in devices (`device_grid` is pure); the exchange of host
names and a few training steps run as a real job of 4 processes with one CPU device each
on 2 fake hosts, two processes per host (tests/topology_worker.py, started by
`zeropp_jax.launch`), compared with the single-process run of the same model, seeds and
batches on 4 devices of a 2 x 2 mesh.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings

import jax
import mp_worker
import numpy as np
import pytest

import zeropp_jax as zpp
from zeropp_jax import launch
from zeropp_jax._mesh import TopologyWarning, device_grid, make_mesh, process_hosts

WORKER = os.path.join(os.path.dirname(__file__), "topology_worker.py")
PROCESSES = 4  # two per fake host: enough to group processes into a host's row
HOSTS = 2
STEPS = 2
# Float summation order, as in tests/test_multiprocess.py (losses go through an all-reduce).
SUMMATION_ORDER = 1e-5


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def devices(per_process: list[int]) -> list[FakeDevice]:
    """Stand-in devices: `per_process[p]` devices for process p, ids counting up."""
    out, next_id = [], 0
    for p, count in enumerate(per_process):
        for _ in range(count):
            out.append(FakeDevice(next_id, p))
            next_id += 1
    return out


def procs(grid: np.ndarray) -> list[list[int]]:
    return [[d.process_index for d in row] for row in grid]


def ids(grid: np.ndarray) -> list[list[int]]:
    return [[d.id for d in row] for row in grid]


def quiet(*args, **kwargs) -> np.ndarray:
    """`device_grid` with TopologyWarning turned into an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", TopologyWarning)
        return device_grid(*args, **kwargs)


# ------------------------------------------------------------------- layout rules


def test_one_process_per_device_groups_processes_by_host():
    # 8 processes of one device each; hosts by block placement (0-3, 4-7).
    grid = quiet(devices([1] * 8), [0, 0, 0, 0, 1, 1, 1, 1])
    assert procs(grid) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_cyclic_placement_keeps_hosts_on_rows():
    # srun --distribution=cyclic: process p on host p % 2.
    grid = quiet(devices([1] * 8), [0, 1, 0, 1, 0, 1, 0, 1])
    assert procs(grid) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_one_process_per_host_is_one_node_per_process():
    grid = quiet(devices([4, 4]), [0, 1])
    assert ids(grid) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_several_processes_of_several_devices_per_host():
    # 2 hosts x 2 processes x 2 devices.
    grid = quiet(devices([2, 2, 2, 2]), [0, 0, 1, 1])
    assert procs(grid) == [[0, 0, 1, 1], [2, 2, 3, 3]]


def test_single_host_is_one_row_and_emulated_shapes_do_not_warn():
    assert ids(quiet(devices([8]), [0])) == [list(range(8))]
    assert ids(quiet(devices([4, 4]), [0, 0])) == [list(range(8))]
    # Emulated nodes on one machine (as the tests and the loopback launcher do).
    assert ids(quiet(devices([8]), [0], 2, 4)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ids(quiet(devices([4, 4]), [0, 0], num_nodes=2)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_explicit_shape_that_follows_the_hosts_does_not_warn():
    grid = quiet(devices([1] * 8), [0, 1] * 4, num_nodes=2, local_size=4)
    assert procs(grid) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert procs(quiet(devices([1] * 8), [0, 1] * 4, local_size=4)) == procs(grid)


def test_explicit_shape_that_splits_a_host_warns():
    with pytest.warns(TopologyWarning, match=r"splits hosts across node rows \(host 0: rows"):
        grid = device_grid(devices([1] * 8), [0] * 4 + [1] * 4, num_nodes=4)
    assert procs(grid) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_explicit_shape_that_merges_hosts_warns():
    with pytest.warns(TopologyWarning, match=r"several hosts on one node row \(row 0: hosts"):
        device_grid(devices([4, 4]), [0, 1], num_nodes=1)


def test_uneven_hosts_raise():
    with pytest.raises(ValueError, match="different numbers of devices") as info:
        device_grid(devices([1] * 6), [0, 0, 0, 0, 1, 1])
    assert "host 0 (processes [0, 1, 2, 3]): 4 devices" in str(info.value)
    assert "host 1 (processes [4, 5]): 2 devices" in str(info.value)
    # An explicit shape is allowed, with a warning.
    with pytest.warns(TopologyWarning):
        grid = device_grid(devices([1] * 6), [0, 0, 0, 0, 1, 1], num_nodes=3)
    assert procs(grid) == [[0, 1], [2, 3], [4, 5]]


def test_process_split_across_rows_still_raises():
    with pytest.raises(ValueError, match="splits the devices of process 0"):
        device_grid(devices([4, 4]), [0, 1], num_nodes=4)


def test_device_subset_from_each_host():
    # Uneven hosts, evened out by the devices= subset.
    subset = [d for d in devices([4, 2]) if d.id not in (2, 3)]
    assert ids(quiet(subset, [0, 1])) == [[0, 1], [4, 5]]


def test_single_process_host_name_changes_nothing():
    assert process_hosts() == (0,)
    assert process_hosts("anything") == (0,)
    mesh = make_mesh(host_name="fakehost")
    assert mesh.devices.shape == (1, 8)
    assert make_mesh(2, 4, host_name="fakehost").devices.shape == (2, 4)


@pytest.mark.parametrize("bad", ["", 3, b"host"])
def test_bad_host_name_raises(bad):
    with pytest.raises(ValueError, match="host_name="):
        make_mesh(host_name=bad)


# ------------------------------------------------------------ one process per device


@pytest.fixture(scope="module")
def per_device_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("topology")
    t0 = time.monotonic()
    result = launch.launch(
        [sys.executable, WORKER, "--out", str(out), "--hosts", str(HOSTS), "--steps", str(STEPS)],
        nodes=PROCESSES,
        local=1,
        timeout=540,
        heartbeat_timeout=30,
        log_dir=str(out / "logs"),
    )
    assert result.returncode == 0, result.report(40)
    print(f"{PROCESSES}-process job: {time.monotonic() - t0:.0f} s")
    runs = []
    for i in range(PROCESSES):
        data = dict(np.load(out / f"topology_process{i}.npz"))
        report = json.loads(str(data.pop("__report__")))
        runs.append((report, data))
    return runs


@pytest.mark.slow
def test_per_device_mesh_follows_fake_hosts(per_device_job):
    for p, (report, _) in enumerate(per_device_job):
        assert report["local_devices"] == 1
        assert report["host_name"] == f"fakehost{p % HOSTS}"
        assert report["hosts"] == [p % HOSTS for p in range(PROCESSES)]
        # Node rows are the fake hosts: cyclic placement, rows by host.
        assert report["derived"] == [[0, 2], [1, 3]]
        assert report["derived_warnings"] == []
        assert report["explicit_2"] == report["derived"]
        # With the real host name every process is on this one machine: one node.
        assert report["hosts_real_names"] == [0] * PROCESSES
        assert report["real_names"] == [list(range(PROCESSES))]
        # Overrides that do not follow the hosts warn; uneven hosts raise.
        assert len(report["split_warnings"]) == 1
        assert "splits hosts across node rows" in report["split_warnings"][0]
        assert len(report["merge_warnings"]) == 1
        assert "several hosts on one node row" in report["merge_warnings"][0]
        assert "different numbers of devices" in report["uneven_error"]
        assert "(processes [0, 1, 2]): 3 devices" in report["uneven_error"]


@pytest.mark.slow
def test_per_device_training_matches_one_process(per_device_job):
    """ZeRO++ trains through gathers and all-to-alls (data movement) plus local sums, so the
    parameters are bit-identical to the single-process 2 x 2 run; losses are all-reduces."""
    mesh = zpp.make_mesh(HOSTS, PROCESSES // HOSTS, devices=jax.devices()[:PROCESSES])
    params, losses = mp_worker.train("zeropp", STEPS, mesh=mesh)
    for p, (_, got) in enumerate(per_device_job):
        assert set(got) == set(params) | {"__losses__"}, p
        for k in params:
            np.testing.assert_array_equal(got[k], params[k], err_msg=f"process {p}: {k}")
        np.testing.assert_allclose(got["__losses__"], losses, rtol=SUMMATION_ORDER)
