"""Preemption: `StopGuard` and the trainer's stop-and-checkpoint on SIGTERM, resumed bit for
bit, on one process and on two."""

import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from zeropp_jax.state import _preemption as preemption
from zeropp_jax.state._preemption import MARGIN, StopGuard

TINY = [
    "--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--seq-len", "16",
    "--batch", "8", "--max-corpus-mb", "2", "--eval-batches", "1", "--eval-every", "0",
    "--no-progress", "--no-ledger", "--save-every", "0",
]  # fmt: skip


# ------------------------------------------------------------------------ the guard


def test_alone_stops_at_the_step_after_the_signal_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with StopGuard() as guard:
        assert signal.getsignal(signal.SIGTERM) == guard._handle
        assert not guard.should_stop(1)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal is recorded, not fatal
        assert guard.should_stop(2)
        assert guard.should_stop(3)  # still stopping
        assert (guard.signal_received, guard.signals_received, guard.stop_step) == (
            signal.SIGTERM,
            2,
            2,
        )
    assert signal.getsignal(signal.SIGTERM) == before


def test_install_outside_the_main_thread_raises():
    errors = []

    def body():
        try:
            StopGuard().install()
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert errors and "main thread" in errors[0]


class FakeStore:
    """The coordination service's key-value store, as the jax client answers."""

    def __init__(self):
        self.values = {}

    def key_value_try_get(self, key):
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]

    def key_value_set(self, key, value):
        if key in self.values:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        return self.values[key]


@pytest.mark.parametrize("signalled", [[0], [1], [0, 1]])
def test_processes_agree_on_the_stop_step(monkeypatch, signalled):
    # Two processes in lock step; the ones in `signalled` get SIGTERM after step 5 (process
    # 0 checks first each step, as it could in a real job). All stop after step 5 + MARGIN.
    store = FakeStore()
    monkeypatch.setattr(preemption, "_client", lambda: store)
    guards = [StopGuard(), StopGuard()]
    stops = {0: [], 1: []}
    for step in range(1, 12):
        for p, guard in enumerate(guards):
            if step == 5 and p in signalled:
                guard._handle(signal.SIGTERM, None)
            if guard.should_stop(step):
                stops[p].append(step)
        if stops[0] or stops[1]:
            break
    assert stops == {0: [5 + MARGIN], 1: [5 + MARGIN]}
    assert store.values == {preemption.KEY: str(5 + MARGIN)}


def test_a_process_past_the_agreed_step_raises(monkeypatch):
    store = FakeStore()
    store.values[preemption.KEY] = "4"
    monkeypatch.setattr(preemption, "_client", lambda: store)
    with pytest.raises(RuntimeError, match="agreed to stop after step 4"):
        StopGuard().should_stop(6)


# ---------------------------------------------------------------------- the trainer


def _losses(out):
    with open(out / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def _signal_at(path, step, target_pid, sig=signal.SIGTERM, timeout=120.0, times=1):
    """A thread that sends `sig` to `target_pid` once `path` (metrics.jsonl) shows `step`
    (`times` signals, 20 ms apart)."""

    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(path) as f:
                    done = [json.loads(line)["step"] for line in f if '"loss"' in line]
            except (OSError, ValueError):
                done = []
            if done and max(done) >= step:
                for i in range(times):
                    if i:
                        time.sleep(0.02)
                    os.kill(target_pid, sig)
                return
            time.sleep(0.005)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_sigterm_checkpoints_the_step_and_resume_continues_bit_for_bit(
    tmp_path, capsys, compile_cache
):
    """With int4 weight deltas: the resumed run sends its deltas against the references
    saved with the checkpoint, as the uninterrupted run does."""
    from zeropp_jax.train import cli

    args = [*TINY, "--weight-delta-bits", "4"]
    steps = 24
    k = random.Random(os.getpid()).randint(3, 8)  # a random step, printed on failure
    run = tmp_path / "run"
    # Two signals: the second lands during the step or the save, and changes nothing. A
    # signal that came after the trainer's guard had gone would reach this handler (and
    # fail the test below) instead of ending the test process.
    late = []
    previous = signal.signal(signal.SIGTERM, lambda *_: late.append(True))
    try:
        watcher = _signal_at(run / "metrics.jsonl", k, os.getpid(), timeout=600.0, times=2)
        code = cli.main([*args, "--steps", str(steps), "--out", str(run)])
        watcher.join(5)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not late, "a SIGTERM arrived after training had ended"
    printed = capsys.readouterr().out
    cut = _losses(run)
    stopped = max(cut)
    assert code == cli.EXIT_STOPPED, (k, printed)
    assert k <= stopped < steps, (k, stopped)
    line = f"stopped by SIGTERM after step {stopped}; checkpoint "
    assert line in printed and f"step_{stopped}" in printed and "--resume" in printed
    assert os.listdir(run / "checkpoints") == [f"step_{stopped}"]

    assert cli.main([*args, "--steps", str(steps), "--out", str(run), "--resume"]) == 0
    full = tmp_path / "full"
    assert cli.main([*args, "--steps", str(steps), "--out", str(full)]) == 0
    resumed, reference = _losses(run), _losses(full)
    assert sorted(resumed) == list(range(1, steps + 1))
    for step in range(stopped + 1, steps + 1):
        assert resumed[step] == reference[step], (k, stopped, step)  # bit for bit


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"),
    reason="needs root and unshare to mount a small tmpfs (CI runs as root)",
)
def test_a_full_disk_at_save_time_is_one_line_and_keeps_the_last(tmp_path):
    # A real full disk: --out on a tmpfs in a private mount namespace. A first run saves
    # step_2; the tmpfs then shrinks to what is used plus 128 KB, less than one checkpoint
    # of the tiny model (about 360 KB), and the resumed run's save of step_4 runs out of
    # space. (Sizing the disk from the checkpoint itself keeps the test independent of how
    # many bytes orbax writes on a given machine.)
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "run"
    argv = [*TINY, "--out", str(out)]
    argv[argv.index("--save-every") + 1] = "2"
    trainer = shlex.join([sys.executable, "-m", "zeropp_jax.train", *argv])
    # After the second run, inside the same namespace: is step_2 still complete?
    check = (
        "import os, sys; from zeropp_jax.state._checkpoint import read_metadata; "
        "read_metadata(sys.argv[1] + '/step_2'); print('LEFT', sorted(os.listdir(sys.argv[1])))"
    )
    q = {"disk": shlex.quote(str(disk)), "ckpts": shlex.quote(str(out / "checkpoints"))}
    script = f"""
        mount -t tmpfs -o size=8m zpptest {q["disk"]} || exit 90
        {trainer} --steps 2 > /dev/null || exit 91
        used=$(df -k --output=used {q["disk"]} | tail -1)
        mount -o remount,size=$((used + 128))k {q["disk"]} || exit 92
        {trainer} --steps 4 --resume; rc=$?
        {shlex.quote(sys.executable)} -c {shlex.quote(check)} {q["ckpts"]}
        exit $rc
    """
    cache = tmp_path / "jax-cache"  # the resumed run compiles what the first one did
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(
            os.environ,
            JAX_COMPILATION_CACHE_DIR=str(cache),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        ),
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    # orbax's own threads print their tracebacks on stderr too, and may leave a line
    # unfinished where ours begins: ours is from its prefix on.
    mine = [
        "zeropp-train:" + line.split("zeropp-train:", 1)[1]
        for line in err
        if "zeropp-train:" in line
    ]
    assert len(mine) == 1, proc.stderr[-3000:]
    assert mine[0].startswith("zeropp-train: error: cannot write checkpoint"), mine[0]
    assert "step_4" in mine[0] and "step_2 is intact" in mine[0], mine[0]
    print(mine[0])  # the reason is what orbax or the OS said
    # step_2 reads back complete; no step_4 exists (orbax's threads, still writing when
    # the save failed, may leave its '.saving-*' folder, which is never read).
    left = proc.stdout.split("LEFT ", 1)[1].splitlines()[0]
    names = [n.strip(" '") for n in left.strip("[]").split(",")]
    assert "step_2" in names and "step_4" not in names, left
    assert all(n == "step_2" or n.startswith("step_4.saving-") for n in names), left


def test_an_out_that_cannot_be_written_fails_before_compiling(capsys):
    from zeropp_jax.train import cli

    with pytest.raises(SystemExit) as exc:
        cli.main([*TINY, "--steps", "2", "--out", "/proc/zeropp-nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out /proc/zeropp-nope: cannot write there" in err


def test_two_processes_stop_at_the_same_step(tmp_path):
    # SIGTERM reaches only process 1; process 0 learns of it through the coordination
    # service, and both save the same step.
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "zeropp_jax.launch", "--nodes", "2", "--local", "4"]
    cmd += ["--kill-grace", "60", "--timeout", "400", "--"]
    cmd += [sys.executable, "-m", "zeropp_jax.train", *TINY, "--steps", "400", "--out", str(run)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        workers = []
        while time.monotonic() < deadline and len(workers) < 2:
            workers = _children(launcher.pid)
            time.sleep(0.2)
        assert len(workers) == 2, workers
        process_1 = next(p for p in workers if _env(p).get("ZEROPP_PROCESS_ID") == "1")
        _signal_at(run / "metrics.jsonl", 5, process_1, timeout=300).join(300)
        output, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    stopped = max(_losses(run))
    assert f"stopped by a peer after step {stopped}" in output, output[-3000:]
    assert os.listdir(run / "checkpoints") == [f"step_{stopped}"]
    assert launcher.returncode == 3, output[-3000:]


def _children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=10)
    return [int(p) for p in out.stdout.split()]


def _env(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)
