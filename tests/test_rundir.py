"""The trainer's run directory: finding checkpoints, the metrics file of a resumed run, and
the checks before a run starts (zeropp_jax/train/rundir.py)."""

import argparse
import json
import os

import pytest

from zeropp_jax.train import rundir
from zeropp_jax.train.flag_types import UsageError


def test_latest_checkpoint_is_the_highest_step_and_ignores_other_names(tmp_path):
    assert rundir.latest_checkpoint(str(tmp_path)) is None  # no checkpoints folder
    for name in ("step_2", "step_10", "step_9", "step_4.saving-1", "notes"):
        os.makedirs(rundir.checkpoint_path(str(tmp_path), 0).replace("step_0", name))
    step, path = rundir.latest_checkpoint(str(tmp_path))
    assert step == 10 and path == rundir.checkpoint_path(str(tmp_path), 10)


def test_open_metrics_drops_what_came_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    with rundir.open_metrics(str(path), keep_until=2) as f:
        f.write(json.dumps({"step": 3, "again": True}) + "\n")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"step": 1}, {"step": 2}, {"step": 3, "again": True}]


def test_check_resume_names_the_flag_that_differs(tmp_path):
    args = argparse.Namespace(
        d_model=64, n_layers=2, n_heads=4, seq_len=32, scan_layers=False, batch=8, seed=0,
        max_corpus_mb=2,
    )  # fmt: skip
    with pytest.raises(UsageError, match="run.json not found"):
        rundir.check_resume(str(tmp_path), args)
    (tmp_path / "run.json").write_text(json.dumps(vars(args) | {"d_model": 32}))
    with pytest.raises(UsageError, match="used --d-model 32, got 64; repeat the original"):
        rundir.check_resume(str(tmp_path), args)
    (tmp_path / "run.json").write_text(json.dumps(vars(args) | {"lr": 1.0}))  # not identity
    rundir.check_resume(str(tmp_path), args)


def test_check_writable_creates_the_folder_or_says_why_not(tmp_path):
    rundir.check_writable(str(tmp_path / "a" / "b"))
    assert os.listdir(tmp_path / "a" / "b") == []  # the probe is gone
    with pytest.raises(UsageError, match="--out /proc/zeropp-nope: cannot write there"):
        rundir.check_writable("/proc/zeropp-nope")


def test_default_out_is_the_name_or_a_time_stamp():
    assert rundir.default_out(argparse.Namespace(name="mine")) == os.path.join("runs", "mine")
    stamped = rundir.default_out(argparse.Namespace(name=None))
    assert stamped.startswith("runs" + os.sep) and len(os.path.basename(stamped)) == 15
