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
        "--configs", "zeropp", "--rates", "200", "--steps", "1", "--warmup", "0",
        "--width", "64", "--out-dir", str(tmp_path), "--name", "smoke", "--timeout", "150",
        timeout=170,  # bounds for a loaded machine; about 30 s on an idle one
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "smoke.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["rate"], row["config"]) == ("200", "zeropp")
    assert float(row["step_s"]) > 0
    assert float(row["link_mb_per_step"]) > 0  # the collectives crossed the veth pair
    assert (tmp_path / "smoke.md").exists()


def test_namespaces_removed_when_the_run_fails(tmp_path):
    proc = run_cluster("--out-dir", str(tmp_path), "--timeout", "2", timeout=60)
    assert proc.returncode == 124, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "time limit passed" in proc.stderr
