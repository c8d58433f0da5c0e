"""Training on the user's data (a text file, a .bin token file, resumed) and `zeropp-sample`
(zeropp_jax/train/sample.py) from that 20-step run, with float and int8 weights.

One tiny model (vocabulary 256) throughout: the runs after the first find its programs in
a compilation cache of this module's own."""

import json
import shutil
import sysconfig

import numpy as np
import pytest

from zeropp_jax.train import cli, corpus, sample

FLAGS = ["--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--seq-len", "16"]
FLAGS += ["--batch", "8", "--eval-batches", "1", "--eval-every", "0", "--no-progress"]
FLAGS += ["--no-ledger", "--steps", "20"]


def _steps(out):
    with open(out / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, module_compile_cache):
    """A 20-step run on a text file (textwrap.py), and one on the same bytes as a .bin."""
    root = tmp_path_factory.mktemp("runs")
    text = root / "textwrap.py"
    shutil.copy(f"{sysconfig.get_paths()['stdlib']}/textwrap.py", text)
    tokens = root / "textwrap.bin"
    corpus.write_token_file(str(tokens), np.frombuffer(text.read_bytes(), np.uint8))
    assert (
        cli.main([*FLAGS, "--data", str(text), "--save-every", "0", "--out", str(root / "text")])
        == 0
    )
    argv = [*FLAGS, "--data", str(tokens), "--vocab-size", "256", "--save-every", "10"]
    argv += ["--out", str(root / "bin")]
    assert cli.main(argv) == 0
    return root


def test_a_text_file_and_its_token_file_train_alike_and_resume_exactly(runs):
    text, tokens = _steps(runs / "text"), _steps(runs / "bin")
    assert [r["step"] for r in text] == list(range(1, 21))
    # The same ids in the same order (read from a memory map): the same batches, losses.
    assert [r["data_crc32"] for r in text] == [r["data_crc32"] for r in tokens]
    assert [r["loss"] for r in text] == [r["loss"] for r in tokens]
    assert text[-1]["loss"] < text[0]["loss"]
    summary = json.loads((runs / "text" / "summary.json").read_text())
    assert summary["unit"] == "byte" and summary["val_bits_per_byte"] > 0

    # The token-file run cut after step 10, then resumed: steps 11-20 as before.
    cut = runs / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copy(runs / "bin" / "run.json", cut / "run.json")
    shutil.copytree(runs / "bin" / "checkpoints" / "step_10", cut / "checkpoints" / "step_10")
    argv = [*FLAGS, "--data", str(runs / "textwrap.bin"), "--vocab-size", "256", "--resume"]
    assert cli.main([*argv, "--save-every", "0", "--out", str(cut)]) == 0
    resumed = _steps(cut)
    assert [r["step"] for r in resumed] == list(range(11, 21))
    assert resumed == tokens[10:]  # the same batches and losses, to the bit


def test_sample_from_the_run_with_float_and_int8_weights(runs, capsys):
    run = str(runs / "text")
    argv = ["--out", run, "--prompt", "def wrap(", "--tokens", "24", "--seed", "1"]
    assert sample.main([*argv, "--weights", "int8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines[0]
    assert head.startswith(f"zeropp-sample: {run} step 20; validation loss nats/byte: ")
    losses = [float(part.split()[0]) for part in head.split(": ")[-1].split(", ")]
    float_loss, int8_loss = losses
    # What the run measured for its float weights (bfloat16 compute, the same batches).
    want = json.loads((runs / "text" / "summary.json").read_text())["final_val_loss"]
    assert float_loss == pytest.approx(want, rel=1e-3)
    assert int8_loss != float_loss and abs(int8_loss / float_loss - 1) < 0.01
    assert lines[1].startswith("--- sample 1 (int8 weights (blocks of 256")
    assert "\n".join(lines[2:-1]).startswith("def wrap(")
    assert len("\n".join(lines[2:-1]).encode()) >= len("def wrap(") + 24 - 3  # bytes, U+FFFD
    assert "tokens/s on 8 cpu devices" in lines[-1]
