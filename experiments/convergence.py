"""Convergence: ZeRO++ trains like ZeRO-3; and how many gradient quantization events it
takes before the loss moves.

    python experiments/convergence.py                  # six variants, 800 steps (~40 min)
    python experiments/convergence.py --study events   # k = 0..32 extra 4-bit events (~75 min)
    python experiments/convergence.py --report-only    # rewrite the tables from finished runs
    python experiments/convergence.py --quick --study all --out /tmp/cv   # smoke run
    python experiments/convergence.py --d-model 256 --n-layers 6 --n-heads 8 --steps 2000 \
        --variants zero3,xla_fsdp,zeropp,zeropp_delta4 --out experiments/results/large
                                                       # 4.8M parameters (hours per run)

(times on 2 shared CPU cores). `--seed`, `--variants`, `--ks`, `--events-bits` and
`--steps` change the study; a run whose folder already holds a finished run of the same
command, run by the same code (one clean commit and the same package versions, from the
run's `run.json`; see `zeropp_jax.provenance.same_code`), is reused, not trained again.

`--study main` trains the trainer's byte-level GPT (`zeropp-train`) on the Python standard
library once per variant, all with the same seed, data order and validation batches:
ZeRO-3 (the reference), qwZ int8 only, qwZ int4 only, qgZ int4 only, full ZeRO++ (int8
weights, hpZ, int4 two-hop gradients) and full ZeRO++ with int2 gradients. Each variant is
one `python -m zeropp_jax.train` process with its own `--out` under `<out>/convergence/`;
the validation-loss curves, final values and the gap to ZeRO-3 are rewritten after every
variant, so an interrupted study keeps what it finished.

`--study events` answers the paper's open question (how many quantization events can a
gradient survive?): ZeRO-3 runs whose global gradient passes through k extra 4-bit
quantization events before the optimizer sees it, k = 0, 1, 2, 4, ..., using
`error_compounding.inject_quantization_events` in `mode="ring"` (the partial sum of a ring
of k + 1 workers is dequantized, added to and re-quantized at every hop, so each event
quantizes a different, growing sum). It reports the final validation loss per k and the
first k whose final loss is more than 1% above k = 0.

Writes `convergence.{md,csv,png}` and `convergence_events.{md,csv,png}` into `--out`
(default `experiments/results/`); runs, their `metrics.jsonl` and logs under
`<out>/convergence/` (checkpoints are deleted after each run).
"""

from __future__ import annotations

import argparse
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

_common.request_cpu_devices(8)

import error_compounding  # noqa: E402
from _convergence_report import (  # noqa: E402
    events_stem,
    write_events,
    write_main,
)

from zeropp_jax.provenance import describe, provenance, same_code  # noqa: E402

CODE = provenance()
"""The code of this process: a finished run is reused only if it ran the same."""

VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "zero3": ("ZeRO-3 (reference)", ("--zero3",)),
    "xla_fsdp": ("XLA FSDP (jax.jit, XLA's collectives)", ("--engine", "xla-fsdp")),
    "qwz8": ("qwZ int8 only", ("--weight-bits", "8", "--grad-bits", "none", "--no-hierarchical")),
    "qwz4": ("qwZ int4 only", ("--weight-bits", "4", "--grad-bits", "none", "--no-hierarchical")),
    "qgz4": ("qgZ int4 only", ("--weight-bits", "none", "--grad-bits", "4", "--no-hierarchical")),
    "zeropp": ("ZeRO++ (int8 weights, hpZ, int4 grads)", ()),
    "zeropp_g2": ("ZeRO++ with int2 grads", ("--grad-bits", "2")),
    # Beyond ZeRO++ (issue #10).
    "zeropp_delta4": ("ZeRO++ with int4 weight deltas", ("--weight-delta-bits", "4")),
    "zeropp_delta2": ("ZeRO++ with int2 weight deltas", ("--weight-delta-bits", "2")),
    "zeropp_delta4_n2": (
        "ZeRO++, int4 weight deltas, int8/int2 grad hops",
        ("--weight-delta-bits", "4", "--grad-bits", "8", "--grad-node-bits", "2"),
    ),
    "zeropp_delta4_local16": (
        "ZeRO++, int4 weight deltas, 16-bit intra-node stage",
        ("--weight-delta-bits", "4", "--weight-local-bits", "none"),
    ),
    "zeropp_ef": ("ZeRO++ with error feedback", ("--error-feedback", "all")),
    "zeropp_g2_ef": (
        "ZeRO++ with int2 grads and error feedback",
        ("--grad-bits", "2", "--error-feedback", "all"),
    ),
    "zeropp_g2_efnode": (
        "ZeRO++ with int2 grads, error feedback on the node hop",
        ("--grad-bits", "2", "--error-feedback", "node"),
    ),
    "zeropp_g2_b64": (
        "ZeRO++ with int2 grads, blocks of 64",
        ("--grad-bits", "2", "--grad-block-size", "64"),
    ),
    "zeropp_g2_b64_ef": (
        "ZeRO++ with int2 grads, blocks of 64, error feedback",
        ("--grad-bits", "2", "--grad-block-size", "64", "--error-feedback", "all"),
    ),
    "zeropp_g2_ef_lr2": (
        "ZeRO++ with int2 grads and error feedback, peak lr x2 (diagnostic)",
        ("--grad-bits", "2", "--error-feedback", "all", "--lr", "0.006"),
    ),
    "zeropp_delta4_n2_ef": (
        "ZeRO++, int4 weight deltas, int8/int2 grad hops, error feedback on the node hop",
        (
            *("--weight-delta-bits", "4", "--grad-bits", "8", "--grad-node-bits", "2"),
            *("--error-feedback", "node"),
        ),
    ),
}
EVENT_BASE = ("--zero3",)  # k = 0 is plain ZeRO-3: the injected events are the only ones


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


MAIN = Schedule()
EVENTS = dataclasses.replace(MAIN, steps=400)
QUICK = Schedule(
    d_model=32,
    n_layers=1,
    n_heads=2,
    seq_len=32,
    batch=8,
    steps=4,
    eval_every=2,
    eval_batches=1,
    max_corpus_mb=1,
    ledger=False,
)
QUICK_VARIANTS = ("zero3", "zeropp")
QUICK_KS = (0, 2)


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
    """One training run of a study, trained into `<out>/convergence/<path>`."""

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
            *("--out", str(out), "--save-every", "0", "--no-progress"),
        ]
        if self.injection is None:
            return ["-m", "zeropp_jax.train", *tail]
        script = pathlib.Path(__file__).resolve().relative_to(_common.ROOT)
        tail += [] if "--no-ledger" in tail else ["--no-ledger"]
        return [str(script), "--worker", *self.injection.flags(), "--", *tail]


def _relative(path: pathlib.Path) -> pathlib.Path:
    try:
        return path.resolve().relative_to(_common.ROOT)
    except ValueError:
        return path


# ------------------------------------------------------------------ injected train step


def event_runs(ks: Sequence[int], bits: int, seed: int, rotation: int | None = None) -> list[Run]:
    """The runs of the events study; k = 0 (no event, whatever the bits and rotation) is
    shared."""
    return [
        Run(
            name=f"k{k}",
            label=f"k = {k}",
            path=f"events/k{k}" if k == 0 else f"{events_stem(bits, rotation)}/k{k}",
            trainer_flags=EVENT_BASE,
            injection=Injection(
                k=k, bits=bits if k else 4, seed=seed, rotation=rotation if k else None
            ),
        )
        for k in ks
    ]


def injected_train_step(injection: Injection):
    """`zeropp_jax.train.cli.train_step` with `injection.k` quantization events applied to
    the gradient (global view, after the engine's reduction) before `apply_gradients`.
    The noise key is `fold_in(key(injection.seed), step)`: a fresh draw every step."""
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


def worker(argv: Sequence[str]) -> int:
    """`convergence.py --worker [--inject-*] -- TRAINER FLAGS`: one injected run."""
    from zeropp_jax.train import cli

    if "--" not in argv:
        raise SystemExit("--worker needs '--' before the trainer flags")
    cut = list(argv).index("--")
    p = argparse.ArgumentParser(prog="convergence.py --worker")
    p.add_argument("--inject-k", type=int, required=True)
    p.add_argument("--inject-bits", type=int, default=4)
    p.add_argument("--inject-block-size", type=int, default=256)
    p.add_argument("--inject-mode", default="ring")
    p.add_argument("--inject-seed", type=int, default=0)
    p.add_argument("--inject-rotation", type=int, default=None)
    a = p.parse_args(argv[:cut])
    injection = Injection(
        k=a.inject_k,
        bits=a.inject_bits,
        block_size=a.inject_block_size,
        mode=a.inject_mode,
        seed=a.inject_seed,
        rotation=a.inject_rotation,
    )
    with trainer_step(injection):
        return cli.main(argv[cut + 1 :])


# ---------------------------------------------------------------------------- running


def _matches(out: pathlib.Path, command: Sequence[str]) -> bool:
    """Whether `out` holds a finished run of exactly `command` by the code running now."""
    try:
        recorded = json.loads((out / "run.json").read_text()).get("provenance", {})
        return (
            json.loads((out / "command.json").read_text()) == list(command)
            and (out / "summary.json").exists()
            and same_code(recorded, CODE)
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
    "timeout" or "failed (rc N)"; checkpoints are deleted afterwards. `machine` (date and
    platform) goes to `out/machine.txt`."""
    command = run.command(schedule, out)
    if _matches(out, command):
        log(f"{run.name}: reusing the finished run in {out}")
        return "reused"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "command.json").write_text(json.dumps(command))
    (out / "machine.txt").write_text(machine + "\n")
    log(f"{run.name}: python {' '.join(command)}")
    start = time.time()
    if in_process:
        status = _train_in_process(run, command)
    else:
        status = _train_subprocess(command, out / "train.log", timeout)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    if status == "done" and not (out / "summary.json").exists():
        status = "failed (no summary)"
    if status != "done":
        (out / "command.json").unlink(missing_ok=True)
    log(f"{run.name}: {status} after {time.time() - start:.0f} s")
    return status


def _train_in_process(run: Run, command: Sequence[str]) -> str:
    from zeropp_jax.train import cli

    argv = list(command[2:]) if command[0] == "-m" else list(command[command.index("--") + 1 :])
    with trainer_step(run.injection):
        cli.main(argv)
    return "done"


def _train_subprocess(command: Sequence[str], log_path: pathlib.Path, timeout: float) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_common.ROOT), env.get("PYTHONPATH", "")) if p
    )
    with open(log_path, "w") as f:
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


# ------------------------------------------------------------------------------- main


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
        if left < 60 and not _matches(out, run.command(schedule, out)):
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--worker":
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", choices=("main", "events", "all"), default="main")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (2 variants, 2 k)")
    p.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    p.add_argument("--ks", default="0,1,2,4,8,16,32", help="k values of the events study")
    p.add_argument("--steps", type=int, default=None, help="override the steps of the study")
    p.add_argument("--seed", type=int, default=None, help="override the seed (default 0)")
    p.add_argument("--d-model", type=int, default=None, help="override the model width")
    p.add_argument("--n-layers", type=int, default=None, help="override the model depth")
    p.add_argument("--n-heads", type=int, default=None, help="override the attention heads")
    p.add_argument("--events-steps", type=int, default=None, help="steps of the events study")
    p.add_argument("--events-bits", type=int, choices=(2, 4, 8), default=4)
    p.add_argument(
        "--events-rotation",
        type=int,
        default=None,
        help="rotate every event's blocks with a block Hadamard of this many values",
    )
    p.add_argument("--budget-min", type=float, default=80.0, help="wall-time bound per study")
    p.add_argument("--in-process", action="store_true", help="train in this process")
    p.add_argument(
        "--report-only", action="store_true", help="rewrite the tables from finished runs"
    )
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)

    schedule = QUICK if args.quick else MAIN
    if args.steps:
        schedule = dataclasses.replace(schedule, steps=args.steps)
    events_schedule = QUICK if args.quick else EVENTS
    if args.events_steps:
        events_schedule = dataclasses.replace(events_schedule, steps=args.events_steps)
    if args.seed is not None:
        schedule = dataclasses.replace(schedule, seed=args.seed)
        events_schedule = dataclasses.replace(events_schedule, seed=args.seed)
    shape = {
        k: v
        for k, v in (
            ("d_model", args.d_model),
            ("n_layers", args.n_layers),
            ("n_heads", args.n_heads),
        )
        if v is not None
    }
    schedule = dataclasses.replace(schedule, **shape)
    events_schedule = dataclasses.replace(events_schedule, **shape)
    names = _common.chosen_variants(
        p, args.variants, VARIANTS, QUICK_VARIANTS if args.quick else VARIANTS
    )
    ks = QUICK_KS if args.quick else tuple(int(k) for k in args.ks.split(","))
    if 0 not in ks:
        p.error(f"--ks {args.ks} must include 0 (the reference)")

    machine = _common.machine_line()
    out, root = _common.study_dirs(args.out, args.quick, "convergence")

    if args.study in ("main", "all"):
        log = _common.file_logger(root / "log.txt")
        log(f"main study on {machine}")
        runs = [
            Run(name=n, label=VARIANTS[n][0], path=n, trainer_flags=VARIANTS[n][1]) for n in names
        ]
        start = time.time()
        status = run_study(
            runs,
            schedule,
            root,
            lambda data, status: write_main(out, runs, data, status, schedule, argv),
            deadline=start + 60 * args.budget_min,
            in_process=args.in_process,
            machine=machine,
            log=log,
            report_only=args.report_only,
        )
        log(f"main study: {status} in {time.time() - start:.0f} s")
    if args.study in ("events", "all"):
        stem = events_stem(args.events_bits, args.events_rotation)
        (root / stem).mkdir(parents=True, exist_ok=True)
        log = _common.file_logger(root / stem / "log.txt")
        log(f"events study ({stem}) on {machine}")
        runs = event_runs(ks, args.events_bits, events_schedule.seed, args.events_rotation)
        start = time.time()
        status = run_study(
            runs,
            events_schedule,
            root,
            lambda data, status: write_events(
                out,
                runs,
                data,
                status,
                events_schedule,
                argv,
                args.events_bits,
                args.events_rotation,
            ),
            deadline=start + 60 * args.budget_min,
            in_process=args.in_process,
            machine=machine,
            log=log,
            report_only=args.report_only,
        )
        log(f"events study: {status} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
