"""The runs of a training study (experiments/_study_runs.py): their commands, when a
finished run is reused, and reading back what a run wrote."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import _study_runs as runs  # noqa: E402

SCHEDULE = runs.Schedule(d_model=32, n_layers=1, steps=4, ledger=False)


def test_a_run_s_command_trains_its_flags_into_its_folder(tmp_path):
    run = runs.Run(name="a", label="A", path="a", trainer_flags=("--grad-bits", "8"))
    command = run.command(SCHEDULE, tmp_path / "a")
    assert command[:2] == ["-m", "zeropp_jax.train"]
    assert command[2:] == [
        *SCHEDULE.flags(),
        *("--grad-bits", "8", "--out", str(tmp_path / "a"), "--save-every", "0"),
        "--no-progress",
    ]
    injected = runs.Run(
        name="k2", label="k = 2", path="k2", trainer_flags=(), injection=runs.Injection(k=2)
    )
    command = injected.command(runs.Schedule(), tmp_path / "k2")
    cut = command.index("--")
    assert command[:cut] == ["experiments/convergence.py", "--worker", *injected.injection.flags()]
    assert command[-1] == "--no-ledger"  # the injected step is not the ledger's


def test_a_finished_run_is_reused_only_for_its_command_and_code(tmp_path, monkeypatch):
    # the code of this process as one clean commit (a dirty tree never matches a run)
    monkeypatch.setattr(runs, "CODE", dict(runs.CODE, commit="1" * 40, dirty=False, changed=[]))
    out = tmp_path / "a"
    run = runs.Run(name="a", label="A", path="a", trainer_flags=())
    command = run.command(SCHEDULE, out)
    assert not runs.matches(out, command)
    out.mkdir()
    (out / "command.json").write_text(json.dumps(command))
    (out / "run.json").write_text(json.dumps({"provenance": runs.CODE}))
    assert not runs.matches(out, command)  # not finished: no summary
    (out / "summary.json").write_text("{}")
    assert runs.matches(out, command)
    assert not runs.matches(out, [*command, "--lr", "1"])
    other = dict(runs.CODE, commit="0" * 40, dirty=False, changed=[])
    (out / "run.json").write_text(json.dumps({"provenance": other}))
    assert not runs.matches(out, command)


def test_read_run_gives_the_curves_and_summary(tmp_path):
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "val_loss": 2.5}, {"step": 2, "loss": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert runs.read_run(tmp_path) == {
        "val": [(2, 2.5)],
        "train": [(1, 3.0), (2, 2.0)],
        "summary": {},
        "machine": "",
    }
    (tmp_path / "summary.json").write_text('{"final_val_loss": 2.5}')
    (tmp_path / "machine.txt").write_text("the machine\n")
    got = runs.read_run(tmp_path)
    assert got["summary"] == {"final_val_loss": 2.5} and got["machine"] == "the machine"


def test_a_timed_out_run_is_resumed_from_its_checkpoint_not_trained_again(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "CODE", dict(runs.CODE, commit="1" * 40, dirty=False, changed=[]))
    calls = []

    def fake_subprocess(command, log_path, timeout, *, append=False):
        calls.append((list(command), append))
        out = log_path.parent
        (out / "run.json").write_text(json.dumps({"provenance": runs.CODE}))
        if len(calls) == 1:  # cut short after a checkpoint
            (out / "checkpoints" / "step_2").mkdir(parents=True)
            return "timeout"
        (out / "summary.json").write_text("{}")
        return "done"

    monkeypatch.setattr(runs, "_train_subprocess", fake_subprocess)
    schedule = runs.Schedule(d_model=32, n_layers=1, steps=4, ledger=False, save_every=2)
    run = runs.Run(name="a", label="A", path="a", trainer_flags=())
    out = tmp_path / "a"
    command = run.command(schedule, out)
    assert command[command.index("--save-every") + 1] == "2"
    train = lambda: runs.train(  # noqa: E731
        run, schedule, out, timeout=60, in_process=False, machine="m", log=lambda _: None
    )
    assert train() == "timeout"
    assert runs.resumable(out, command) and not runs.matches(out, command)
    assert not runs.resumable(out, [*command, "--lr", "1"])
    assert train() == "done"
    assert calls == [(command, False), ([*command, "--resume"], True)]
    assert not (out / "checkpoints").exists() and runs.matches(out, command)
    assert (out / "machine.txt").read_text() == "m\nm\n"  # one line per part
    assert train() == "reused" and len(calls) == 2
