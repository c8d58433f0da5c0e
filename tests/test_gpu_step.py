"""experiments/gpu_step.py runs end to end at a tiny size on the CPU devices (so it does
not rot before the next GPU): the engine's row, its ledger read off the step (XLA FSDP's
step is `baselines.xla_fsdp_step`, tested in tests/test_baselines.py)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import gpu_step  # noqa: E402


def test_gpu_step_tiny(tmp_path):
    gpu_step.main(
        ["--model", "tiny", "--seq-len", "32", "--batch", "8", "--steps", "1"]
        + ["--engines", "ZeRO++", "--out", str(tmp_path)]
    )
    text = (tmp_path / "gpu_step.md").read_text()
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| engine")
    }
    assert set(rows) == {"ZeRO++"}
    assert "cpu x 8" in text  # a 1 x 8 mesh of the test's devices
    *_, device_mb, link_mb = rows["ZeRO++"]
    assert float(device_mb) > 0  # the weight gathers and gradient hops inside the node
    assert float(link_mb) == 0  # one node: nothing crosses a node link
