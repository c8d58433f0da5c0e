"""experiments/overhead.py runs end to end at a tiny size (so it does not rot)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_overhead_quick(tmp_path):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the script asks for its own 8 devices
    r = subprocess.run(
        [sys.executable, "experiments/overhead.py", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    table = (tmp_path / "overhead.md").read_text()
    for variant in ("XLA FSDP", "ZeRO-3", "qwZ only", "hpZ only", "qgZ only", "ZeRO++"):
        assert f"| {variant} |" in table
    assert "hop-1 dequantize-sum-requantize" in table
    assert (tmp_path / "overhead.csv").exists() and (tmp_path / "overhead_stages.csv").exists()
