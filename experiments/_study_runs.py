"""The runs of a training study: its schedule, each run's trainer command, training the runs
one process each (or in this one) and reading back what they wrote.

A run whose folder already holds a finished run of the same command, run by the same code
(`zeropp_jax.measure._provenance.same_code`), is reused, not trained again. The convergence study
(`convergence.py`), `muon_e2e.py` and `beyond_bytes.py` run their variants through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import _common
from _library import describe, provenance, same_code

CODE = provenance()
"""The code of this process: a finished run is reused only if it ran the same."""

WORKER_SCRIPT = pathlib.Path("experiments", "convergence.py")
"""The script (from the repository root) whose `--worker` trains a run with injected
quantization events."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """Model, data and optimizer settings shared by every run of a study."""

    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 128
    batch: int = 16
    steps: int = 800
    eval_every: int = 50
    eval_batches: int = 8
    lr: float = 3e-3
    seed: int = 0
    max_corpus_mb: int = 16
    ledger: bool = True  # the communication ledger of one step in summary.json
    # Steps between checkpoints; 0: none. With checkpoints an interrupted run (a timeout, a
    # stopped session) is resumed by the next call, bit for bit, instead of trained again.
    save_every: int = 0
    # The studies' recorded runs trained the unrolled blocks (the trainer's default until
    # the scan became it); kept so that a rerun trains the same model.
    scan: bool = False

    def flags(self) -> list[str]:
        return [
            *([] if self.ledger else ["--no-ledger"]),
            *([] if self.scan else ["--no-scan-layers"]),
            *("--d-model", str(self.d_model), "--n-layers", str(self.n_layers)),
            *("--n-heads", str(self.n_heads), "--seq-len", str(self.seq_len)),
            *("--batch", str(self.batch), "--steps", str(self.steps)),
            *("--eval-every", str(self.eval_every), "--eval-batches", str(self.eval_batches)),
            *("--lr", str(self.lr), "--seed", str(self.seed)),
            *("--max-corpus-mb", str(self.max_corpus_mb)),
        ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Injection:
    """k extra quantization events on the gradient (see `inject_quantization_events`)."""

    k: int
    bits: int = 4
    block_size: int = 256
    mode: str = "ring"
    seed: int = 0
    rotation: int | None = None  # Hadamard rotation block of every event, None: plain

    def flags(self) -> list[str]:
        return [
            *("--inject-k", str(self.k), "--inject-bits", str(self.bits)),
            *("--inject-block-size", str(self.block_size), "--inject-mode", self.mode),
            *("--inject-seed", str(self.seed)),
            *([] if self.rotation is None else ["--inject-rotation", str(self.rotation)]),
        ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One training run of a study, trained into `<root>/<path>` (`root`: the study's runs
    folder, `_common.study_dirs`)."""

    name: str
    label: str
    path: str
    trainer_flags: tuple[str, ...]
    injection: Injection | None = None

    def command(self, schedule: Schedule, out: pathlib.Path) -> list[str]:
        """The command line (without the interpreter) that trains this run into `out`, to
        run from the repository root (`out` is shown relative to it when inside it)."""
        out = _relative(out)
        tail = [
            *schedule.flags(),
            *self.trainer_flags,
            *("--out", str(out), "--save-every", str(schedule.save_every), "--no-progress"),
        ]
        if self.injection is None:
            return ["-m", "zeropp_jax.train", *tail]
        tail += [] if "--no-ledger" in tail else ["--no-ledger"]
        return [str(WORKER_SCRIPT), "--worker", *self.injection.flags(), "--", *tail]


def _relative(path: pathlib.Path) -> pathlib.Path:
    try:
        return path.resolve().relative_to(_common.ROOT)
    except ValueError:
        return path


def injected_train_step(injection: Injection):
    """`zeropp_jax.train.cli.train_step` with `injection.k` quantization events applied to
    the gradient (global view, after the engine's reduction) before `apply_gradients`.
    The noise key is `fold_in(key(injection.seed), step)`: a fresh draw every step."""
    import error_compounding
    import jax

    from zeropp_jax.train.model import cross_entropy

    def train_step(state, batch):
        def loss(params):
            logits = state.apply_fn({"params": params}, batch[:, :-1], train=True)
            return cross_entropy(logits, batch[:, 1:])

        value, grads = jax.value_and_grad(loss)(state.params)
        grads = error_compounding.inject_quantization_events(
            grads,
            injection.k,
            bits=injection.bits,
            block_size=injection.block_size,
            key=jax.random.fold_in(jax.random.key(injection.seed), state.step),
            mode=injection.mode,
            rotation_block_size=injection.rotation,
        )
        return state.apply_gradients(grads=grads), {"loss": value}

    return train_step


@contextlib.contextmanager
def trainer_step(injection: Injection | None) -> Iterator[None]:
    """Makes the trainer compile `injected_train_step(injection)` inside the block."""
    from zeropp_jax.train import cli

    original = cli.train_step
    if injection is not None:
        cli.train_step = injected_train_step(injection)
    try:
        yield
    finally:
        cli.train_step = original


def matches(out: pathlib.Path, command: Sequence[str]) -> bool:
    """Whether `out` holds a finished run of exactly `command` by the code running now."""
    return (out / "summary.json").exists() and _same_command_and_code(out, command)


def resumable(out: pathlib.Path, command: Sequence[str]) -> bool:
    """Whether `out` holds an unfinished run of exactly `command`, by the code running now,
    with a checkpoint to continue from (`--resume`)."""
    checkpoints = out / "checkpoints"
    return (
        checkpoints.is_dir()
        and any(checkpoints.glob("step_*"))
        and not (out / "summary.json").exists()
        and _same_command_and_code(out, command)
    )


def _same_command_and_code(out: pathlib.Path, command: Sequence[str]) -> bool:
    try:
        recorded = json.loads((out / "run.json").read_text()).get("provenance", {})
        return json.loads((out / "command.json").read_text()) == list(command) and same_code(
            recorded, CODE
        )
    except (OSError, ValueError):
        return False


def train(
    run: Run,
    schedule: Schedule,
    out: pathlib.Path,
    *,
    timeout: float,
    in_process: bool,
    machine: str,
    log,
) -> str:
    """Trains `run` into `out` unless `out` already holds it. Returns "done", "reused",
    "timeout" or "failed (rc N)". An unfinished run of the same command and code with a
    checkpoint (`Schedule.save_every`) is resumed from it; a timed-out run keeps its
    checkpoints for that, a finished or failed one loses them. `machine` (date and
    platform) goes to `out/machine.txt`."""
    command = run.command(schedule, out)
    if matches(out, command):
        log(f"{run.name}: reusing the finished run in {out}")
        return "reused"
    start = time.time()
    if not in_process and resumable(out, command):
        log(f"{run.name}: resuming the unfinished run in {out}")
        with open(out / "machine.txt", "a") as f:
            f.write(machine + "\n")
        status = _train_subprocess([*command, "--resume"], out / "train.log", timeout, append=True)
    else:
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        (out / "command.json").write_text(json.dumps(command))
        (out / "machine.txt").write_text(machine + "\n")
        log(f"{run.name}: python {' '.join(command)}")
        if in_process:
            status = _train_in_process(run, command)
        else:
            status = _train_subprocess(command, out / "train.log", timeout)
    if status == "done" and not (out / "summary.json").exists():
        status = "failed (no summary)"
    if status != "timeout" or in_process:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    if status not in ("done", "timeout"):
        (out / "command.json").unlink(missing_ok=True)
    log(f"{run.name}: {status} after {time.time() - start:.0f} s")
    return status


def _train_in_process(run: Run, command: Sequence[str]) -> str:
    from zeropp_jax.train import cli

    argv = list(command[2:]) if command[0] == "-m" else list(command[command.index("--") + 1 :])
    with trainer_step(run.injection):
        cli.main(argv)
    return "done"


def _train_subprocess(
    command: Sequence[str], log_path: pathlib.Path, timeout: float, *, append: bool = False
) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_common.ROOT), env.get("PYTHONPATH", "")) if p
    )
    with open(log_path, "a" if append else "w") as f:
        proc = subprocess.Popen(
            [sys.executable, *command],
            cwd=_common.ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return "timeout"
    return "done" if rc == 0 else f"failed (rc {rc})"


def read_run(out: pathlib.Path) -> dict[str, Any]:
    """Curves and summary of a run directory (partial when the run did not finish)."""
    val, train_loss = [], []
    path = out / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "val_loss" in rec:
                val.append((rec["step"], rec["val_loss"]))
            elif "loss" in rec:
                train_loss.append((rec["step"], rec["loss"]))
    summary = {}
    if (out / "summary.json").exists():
        summary = json.loads((out / "summary.json").read_text())
    machine = (out / "machine.txt").read_text().strip() if (out / "machine.txt").exists() else ""
    return {"val": val, "train": train_loss, "summary": summary, "machine": machine}


def run_study(
    runs: Sequence[Run],
    schedule: Schedule,
    root: pathlib.Path,
    write,
    *,
    deadline: float,
    in_process: bool,
    machine: str,
    log,
    report_only: bool = False,
) -> dict[str, str]:
    """Trains `runs` in order into `root/<run.path>`, calling `write(data, status)` after
    each. Finished runs are reused whatever the deadline; past it, the others are skipped
    (a partial curve left by an earlier attempt is still plotted). With `report_only`,
    nothing trains: the tables are rewritten once from the finished runs, by whatever code
    ran them; the log says so if they ran different code."""
    data, status = {}, {}
    if report_only:
        codes = {}
        for run in runs:
            out = root / run.path
            if (out / "summary.json").exists():
                data[run.name], status[run.name] = read_run(out), "reported"
                codes[run.name] = json.loads((out / "run.json").read_text()).get("provenance", {})
            else:
                status[run.name] = "not finished"
        first = next(iter(codes.values()), {})
        if not all(same_code(first, code) for code in codes.values()):
            shown = {name: describe(code) for name, code in codes.items()}
            log(f"warning: these runs ran different code: {shown}")
        write(data, status)
        return status
    for run in runs:
        out = root / run.path
        left = deadline - time.time()
        if left < 60 and not matches(out, run.command(schedule, out)):
            status[run.name] = "skipped (study time budget spent)"
            log(f"{run.name}: {status[run.name]}")
            if out.exists():
                data[run.name] = read_run(out)
            continue
        status[run.name] = train(
            run,
            schedule,
            root / run.path,
            timeout=left,
            in_process=in_process,
            machine=machine,
            log=log,
        )
        data[run.name] = read_run(root / run.path)
        write(data, status)
    return status
