"""Multi-process training on loopback: 2 processes x 4 CPU devices against 1 process x 8.

The job runs under `zeropp_jax.launch` (gloo collectives over 127.0.0.1); the reference
runs in this pytest process on the same `2 x 4` mesh of 8 emulated devices, with the same
seeds and batches (tests/mp_worker.py holds the code both run).

What is exact and what is not (found by experiment on jax 0.10.2, and explained):
all-gathers and all-to-alls move data, so they are bit-exact; reductions inside a
collective (all-reduce, reduce-scatter) sum in gloo's order in the multi-process job and
in XLA's order in one process, so their results agree to float summation order only.
ZeRO++ reduces gradients by all-to-all + local float32 sums, so without an all-reduce in
the update (no global-norm clipping) its parameters are bit-identical; its loss, a mean
over the batch, goes through an all-reduce. The unquantized "exact" run reduce-scatters
gradients and clips by the global norm, so it agrees to float summation order.
"""

import os
import subprocess
import sys
import time

import jax
import mp_worker
import numpy as np
import pytest

import zeropp_jax as zpp
from zeropp_jax import launch

WORKER = os.path.join(os.path.dirname(__file__), "mp_worker.py")
STEPS = 3
RUNS = ("exact", "zeropp")
# Float summation order: the bound the single-device engine tests use for unquantized
# paths (max |a - b| / max |b| per leaf; measured here: <= 2e-7).
SUMMATION_ORDER = 1e-5


@pytest.fixture(scope="module")
def multiprocess(tmp_path_factory):
    out = tmp_path_factory.mktemp("mp")
    result = launch.launch(
        [
            sys.executable,
            WORKER,
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--configs",
            ",".join(RUNS),
        ],
        nodes=2,
        local=4,
        timeout=240,  # a bound for a loaded machine; about 20 s on an idle one
        heartbeat_timeout=10,
        log_dir=str(out / "logs"),
    )
    assert result.returncode == 0, result.report(40)
    return {
        (name, i): dict(np.load(out / f"{name}_process{i}.npz")) for name in RUNS for i in range(2)
    }


def reference(name):
    params, losses = mp_worker.train(name, STEPS)
    return dict(params, __losses__=losses)


def leaf_rel_err(a, b):
    return {
        k: float(np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-30))
        for k in b
        if k != "__losses__"
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_processes_agree_bitwise(multiprocess, name):
    p0, p1 = multiprocess[(name, 0)], multiprocess[(name, 1)]
    assert p0.keys() == p1.keys()
    for k in p0:
        np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)


@pytest.mark.slow
def test_exact_matches_one_process_to_summation_order(multiprocess):
    got, ref = multiprocess[("exact", 0)], reference("exact")
    assert got.keys() == ref.keys()
    errs = leaf_rel_err(got, ref)
    assert max(errs.values()) <= SUMMATION_ORDER, errs
    np.testing.assert_allclose(got["__losses__"], ref["__losses__"], rtol=SUMMATION_ORDER)


@pytest.mark.slow
def test_zeropp_matches_one_process_bitwise(multiprocess):
    got, ref = multiprocess[("zeropp", 0)], reference("zeropp")
    assert got.keys() == ref.keys()
    for k in ref:
        if k != "__losses__":
            np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    # The loss and the logged gradient norm are all-reduces: summation order.
    np.testing.assert_allclose(got["__losses__"], ref["__losses__"], rtol=SUMMATION_ORDER)


@pytest.mark.slow
def test_dead_peer_ends_the_job(tmp_path):
    """Process 1 exits abruptly after its second step. The launcher is told to let the
    survivor run on (kill_grace) so the test sees the survivor end by itself: JAX's
    heartbeat (5 s here) or a gloo error must stop it, well within the bound. (Seen on
    jax 0.10.2: the survivor's pending collective fails in gloo, and the shutdown barrier
    then aborts it on the heartbeat timeout, about 5 s after the peer died.)"""
    result = launch.launch(
        [
            sys.executable,
            WORKER,
            "--out",
            str(tmp_path),
            "--steps",
            "10000",
            "--configs",
            "exact",
            "--die-process",
            "1",
            "--die-after",
            "1",
            "--save-at",
            "0",
            "--ckpt",
            str(tmp_path / "ckpt"),
        ],
        nodes=2,
        local=4,
        timeout=180,
        heartbeat_timeout=5,
        kill_grace=60,
        log_dir=str(tmp_path / "logs"),
    )
    dead, survivor = result.processes[1], result.processes[0]
    assert result.failed == 1, result.report(40)
    assert result.returncode == 7 and dead.returncode == 7
    assert "process 1 dying at step 1" in dead.tail(5)
    assert "process 1 dying at step 1" in result.report(10)
    assert not survivor.killed, result.report(40)
    assert survivor.returncode != 0
    assert survivor.elapsed_s - dead.elapsed_s < 60, result.report(40)
    # The checkpoint the two processes wrote before the death restores here (8 devices,
    # one process) and matches one step of the single-process run.
    config, tx = mp_worker.runs()["exact"]
    model = mp_worker._model()
    params = model.init(
        jax.random.key(mp_worker.SEED), np.zeros((1, mp_worker.FEATURES), np.float32)
    )["params"]
    mesh = zpp.make_mesh(2, 4)
    target = zpp.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx, mesh=mesh, config=config
    )
    restored = zpp.restore_checkpoint(tmp_path / "ckpt", target)
    assert int(restored.step) == 1
    ref, _ = mp_worker.train("exact", 1, mesh=mesh)
    got = zpp.gather_params(restored)
    for path, x in jax.tree_util.tree_leaves_with_path(got):
        np.testing.assert_allclose(
            np.asarray(x), ref[jax.tree_util.keystr(path)], rtol=SUMMATION_ORDER, atol=1e-7
        )


def test_launcher_timeout_kills_everything(tmp_path):
    code = "import time\nprint('started', flush=True)\ntime.sleep(600)"
    t0 = time.monotonic()
    result = launch.launch(
        [sys.executable, "-c", code], nodes=2, local=1, timeout=3, log_dir=str(tmp_path)
    )
    assert time.monotonic() - t0 < 20
    assert result.timed_out and result.returncode == launch.TIMEOUT_STATUS
    assert all(p.killed and p.returncode == -9 for p in result.processes)
    assert "started" in result.report()


def test_worker_env_and_initialize_from_env():
    env = launch.worker_env(
        process_id=1,
        num_processes=2,
        coordinator="127.0.0.1:1234",
        local_devices=4,
        base={"XLA_FLAGS": "--a=1 --xla_force_host_platform_device_count=8"},
    )
    assert env["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=4"
    assert env[launch.ENV_PROCESS_ID] == "1" and env[launch.ENV_NUM_PROCESSES] == "2"
    assert launch.initialize_from_env({}) is False
    with pytest.raises(ValueError, match="ZEROPP_PROCESS_ID"):
        launch.initialize_from_env(
            {launch.ENV_COORDINATOR: "127.0.0.1:1", launch.ENV_NUM_PROCESSES: "2"}
        )
    with pytest.raises(ValueError, match="nodes=0"):
        launch.launch(["true"], nodes=0, local=1)


def test_cli_reports_failure(tmp_path):
    code = "import os, sys\nprint('last words', flush=True)\nos._exit(3)"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zeropp_jax.launch",
            "--nodes",
            "2",
            "--local",
            "1",
            "--timeout",
            "30",
            "--quiet",
            "--log-dir",
            str(tmp_path),
            "--",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    assert "last words" in proc.stderr and "failed (exit 3)" in proc.stderr
