"""The emulated two-node cluster (experiments/cluster): namespaces up, one tiny training
step across the veth pair, namespaces down; and down again when the run fails.

Needs root and working `ip netns`; skipped with the reason otherwise.
"""

import csv
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "cluster", "run_cluster.py")


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root for `ip netns` and `tc`"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"zppprobe{os.getpid()}"
    add = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    if add.returncode:
        return f"`ip netns add` fails here: {add.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return None


_REASON = _netns_unavailable()
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"cluster: {_REASON}"),
    pytest.mark.slow,
]


def run_cluster(*args, timeout):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    names = re.search(r"namespaces \('(\w+)', '(\w+)'\)", proc.stdout)
    assert names, proc.stdout + proc.stderr
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    for ns in names.groups():
        assert ns not in left.stdout, f"namespace {ns} left behind"
    return proc


def test_one_step_across_the_shaped_link(tmp_path):
    proc = run_cluster(
        "--configs", "zero3,zeropp,xla_fsdp_gpu_wire", "--rates", "200", "--steps", "1",
        "--warmup", "0", "--width", "1024", "--out-dir", str(tmp_path), "--name", "smoke",
        "--timeout", "200",
        timeout=220,  # bounds for a loaded machine; about 25 s on an idle one
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "smoke.csv") as f:
        rows = {row["config"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"zero3", "zeropp", "xla_fsdp_gpu_wire"}
    assert {r["rate"] for r in rows.values()} == {"200"}
    assert "model_parallel" not in rows["zero3"]  # no TP column unless asked for
    assert all(float(r["step_s"]) > 0 for r in rows.values())
    for row in rows.values():
        # The veth carries what the ledger says crosses each node's link, plus protocol
        # overhead (TCP/IP headers, gloo's framing, heartbeats): at most 10% at this size.
        for direction in ("node0_to_node1", "node1_to_node0"):
            measured, ledger = float(row[f"mb_{direction}"]), float(row[f"ledger_mb_{direction}"])
            assert ledger <= measured <= 1.10 * ledger, (row["config"], direction, measured, ledger)
    # ZeRO-3's rings cross each link once per direction (its three 7/8-M collectives);
    # ZeRO++ sends int8 weights and int4 gradients across and gathers backward weights
    # inside the node: over 5 times fewer bytes on the wire (6.3x at width 1536).
    zero3, zeropp = (float(rows[c]["link_mb_per_step"]) for c in ("zero3", "zeropp"))
    assert zero3 / zeropp > 5, (zero3, zeropp)
    # XLA FSDP at a GPU's widths: a 16-bit gather and a 16-bit ring reduce-scatter per
    # weight, about 7/8 M each, where ZeRO-3 gathers again in the backward pass.
    gpu_wire = float(rows["xla_fsdp_gpu_wire"]["link_mb_per_step"])
    assert gpu_wire < zero3, (gpu_wire, zero3)
    assert (tmp_path / "smoke.md").exists()


def test_tensor_parallel_sizes_each_cross_the_link_as_the_ledger_says(tmp_path):
    proc = run_cluster(
        "--configs", "xla_fsdp,zeropp", "--rates", "inf", "--model-parallel", "1,2",
        "--steps", "1", "--warmup", "0", "--width", "1024", "--out-dir", str(tmp_path),
        "--name", "tp", "--timeout", "300",
        timeout=320,  # bounds for a loaded machine; about 35 s on an idle one
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "tp.csv") as f:
        rows = {(row["model_parallel"], row["config"]): row for row in csv.DictReader(f)}
    assert set(rows) == {(k, c) for k in ("1", "2") for c in ("xla_fsdp", "zeropp")}
    for key, row in rows.items():
        # XLA's tensor-parallel all-reduces stay inside a node: the link carries what the
        # ledger says, plus protocol overhead.
        for direction in ("node0_to_node1", "node1_to_node0"):
            measured, ledger = float(row[f"mb_{direction}"]), float(row[f"ledger_mb_{direction}"])
            assert ledger <= measured <= 1.10 * ledger, (key, direction, measured, ledger)
    assert "| TP | link rate |" in (tmp_path / "tp.md").read_text()


def test_namespaces_removed_when_the_run_fails(tmp_path):
    proc = run_cluster("--out-dir", str(tmp_path), "--timeout", "2", timeout=60)
    assert proc.returncode == 124, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "time limit passed" in proc.stderr


def _run_cluster_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_cluster", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_cluster"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_equal_wire_step_is_the_link_model_arithmetic():
    """The projection behind the README's equal-wire ratios (a cross-check, not a
    measurement): the median less the time the shaped link takes to carry the bytes the
    16-bit wire would not send, at the measured protocol overhead. It knows no compute
    floor: at 1000 Mbit/s it projected XLA FSDP below its own step with no link limit
    (issue #50), one reason it is never quoted as a measurement."""
    step = _run_cluster_module().equal_wire_step
    ledger, wire = [124.4e6, 124.0e6], [61.9e6, 61.0e6]
    measured = [127.0e6, 126.5e6]
    # 62.5 MB fewer on the busier direction, 2.09% protocol overhead, 100 Mbit/s.
    want = 6.0 - 62.5e6 * (127.0 / 124.4) * 8 / 100e6
    assert step(6.0, "100", measured, ledger, wire) == pytest.approx(want)
    assert step(6.0, "200", measured, ledger, wire) == pytest.approx(6.0 - (6.0 - want) / 2)
    # Nothing to take away: the config's own step; no rate limit: no link model.
    assert step(6.0, "100", measured, ledger, ledger) == 6.0
    assert step(6.0, "inf", measured, ledger, wire) is None
