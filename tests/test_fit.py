"""Whether a compiled step fits its devices (zeropp_jax/train/fit.py), and the trainer's
check before the first step."""

import os

import jax
import numpy as np
import pytest

from zeropp_jax.train import fit

GiB = 2**30


def test_need_of_counts_arguments_temp_and_outputs_not_donated():
    x = np.ones((1024, 256), np.float32)  # 1 MiB
    kept = fit.need_of(jax.jit(lambda a: a @ a.T).lower(x).compile())
    assert kept.arguments == x.nbytes and kept.outputs == 1024 * 1024 * 4  # the product
    donated = fit.need_of(jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile())
    assert donated.arguments == x.nbytes and donated.outputs == 0  # reuses the argument
    assert donated.total == donated.arguments + donated.temp + donated.code


def test_a_cpu_device_has_its_share_of_the_host_memory():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share, where = fit.device_capacity(jax.devices()[0], 8)
    assert share == total // 8 and "shared by 8 CPU devices" in where


def test_fit_error_names_the_program_both_sizes_and_the_flags():
    small = fit.Need(arguments=GiB, outputs=0, temp=GiB, code=0)
    big = fit.Need(arguments=GiB, outputs=0, temp=9 * GiB, code=0)
    capacity = (4 * GiB, "a test's 4 GiB")
    assert fit.fit_error({"training step": small}, capacity) is None
    line = fit.fit_error({"training step": small, "evaluation step": big}, capacity)
    assert line.startswith("the evaluation step needs 10.74 GB per device")
    assert "temporaries 9.66 GB" in line and "a device has 4.29 GB (a test's 4 GiB)" in line
    for flag in ("--batch", "--seq-len", "--nodes", "--no-memory-check"):
        assert flag in line


def _trainer_argv(out, seq_len):
    return [
        "--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--seq-len", str(seq_len),
        "--batch", "8", "--eval-batches", "1", "--eval-every", "0", "--no-progress",
        "--no-ledger", "--steps", "1", "--out", str(out),
    ]  # fmt: skip


def test_the_trainer_stops_before_a_step_that_cannot_fit(tmp_path, capsys):
    # The case: attention over 100,000 tokens needs hundreds of GB per device.
    from zeropp_jax.train import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(_trainer_argv(tmp_path / "run", 100_000))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zeropp-train: error: the training step needs")
    assert "GB per device" in err and "of host memory shared by 8 CPU devices" in err
    assert not (tmp_path / "run" / "run.json").exists()  # before the run started


def test_no_memory_check_skips_it(tmp_path, monkeypatch, compile_cache):
    from zeropp_jax.train import cli

    # The second set-up compiles the programs of the first: it finds them in `compile_cache`.

    monkeypatch.setattr(fit, "device_capacity", lambda device, local: (1, "pretend"))
    monkeypatch.setattr(cli, "_train", lambda run: 0)  # set up, then stop
    with pytest.raises(SystemExit):
        cli.main(_trainer_argv(tmp_path / "a", 16))  # 1 byte per device: cannot fit
    assert cli.main([*_trainer_argv(tmp_path / "b", 16), "--no-memory-check"]) == 0


def test_a_device_that_reports_no_limit_has_no_capacity():
    class Device:
        platform, device_kind = "gpu", "Some GPU"

        def memory_stats(self):
            return None

    assert fit.device_capacity(Device(), 1) is None
