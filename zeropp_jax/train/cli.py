"""`zeropp-train`: train a GPT with ZeRO++ on your own text or on the Python standard
library.

With no arguments it runs an embedded default: on a machine without an accelerator, 8
emulated CPU devices as a 2 x 4 `('node', 'local')` mesh, the full ZeRO++ configuration,
and a model and step count that finish in a few minutes on a small CPU while the loss falls
well below the unigram entropy of the corpus. At the end it prints the final losses, the
throughput and the communication ledger of one step against plain ZeRO-3.

Run `zeropp-train --help` for the flags. Under `jax.distributed` (`--coordinator`,
`--num-processes`, `--process-id`; `--distributed` to auto-detect a cluster; or started by
`python -m zeropp_jax.launch`) each host is one node of the mesh (under the loopback
launcher, each process) and each process feeds only its own rows of every batch.

`--data PATH` trains on your own corpus (text files, directories, globs, nanoGPT `.bin`
token files; `zeropp_jax.train.corpus`), tokenized by `--tokenizer` (bytes or a Hugging
Face `tokenizer.json`); the model's vocabulary follows the tokenizer.

Outputs under `--out`: `run.json` (the flags), `metrics.jsonl` (one line per step and per
evaluation), `summary.json`, and `checkpoints/step_<n>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import zlib
from collections.abc import Sequence
from typing import Any

from zeropp_jax.measure._provenance import provenance
from zeropp_jax.train.flag_types import UsageError
from zeropp_jax.train.flags import PROG, gpt_config, parse_args, zeropp_config
from zeropp_jax.train.platform import (
    check_batch,
    configure_host_devices,
    initialize_distributed,
    make_mesh,
)
from zeropp_jax.train.presets import muon_note, preset_note
from zeropp_jax.train.report import Prelowered, config_text, ledger_table, plan_report
from zeropp_jax.train.rundir import (
    check_resume,
    check_writable,
    checkpoint_dir,
    checkpoint_path,
    default_out,
    latest_checkpoint,
    open_metrics,
)

EXIT_STOPPED = 3
"""Exit status after a stop signal: the current step finished and was checkpointed."""


def make_optimizer(args: argparse.Namespace):
    """The `--optimizer` chain (`zeropp_jax.train.optimizers.make_optimizer`; imported
    here, after the platform is configured, because it imports jax)."""
    from zeropp_jax.train import optimizers

    return optimizers.make_optimizer(args)


def train_step(state, batch):
    """One optimizer step: ordinary Flax code written for a flax TrainState."""
    import jax

    from zeropp_jax.train.model import loss_fn

    value, grads = jax.value_and_grad(
        lambda params: loss_fn(state.apply_fn, params, batch, train=True)
    )(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def eval_loss(state, batch):
    """Validation loss of one batch (no update)."""
    from zeropp_jax.train.model import loss_fn

    return loss_fn(state.apply_fn, state.params, batch)


def _fingerprint(starts) -> int:
    """CRC-32 of where a global batch's windows start: a cheap record of the data position,
    the same in every process."""
    import numpy as np

    return zlib.crc32(np.ascontiguousarray(starts, dtype=np.int64).tobytes())


# --------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `zeropp-train` (and `python -m zeropp_jax.train`).

    Returns 0 after a completed run, and `EXIT_STOPPED` (3) after a SIGTERM or SIGINT
    during training: the step it was on finished, a checkpoint of it was written, and
    `--resume` continues from there. Bad flags raise `SystemExit(2)` after one line on
    stderr (`zeropp-train: error: ...`); a checkpoint that cannot be written raises
    `SystemExit(1)` after one line.
    """
    t0 = time.time()
    try:
        args = parse_args(argv)
        configure_host_devices(args)
        initialize_distributed(args)
        if args.plan:
            print(plan_report(args, train_step=train_step, tx=make_optimizer(args)))
            return 0
        run = _setup(args, t0)
    except (UsageError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return _train(run)


@dataclasses.dataclass
class _Run:
    args: argparse.Namespace
    out: str
    mesh: Any
    config: Any
    corpus: Any
    entropy: float
    state: Any
    compiled_step: Any
    compiled_eval: Any
    eval_set: list
    start: int
    param_count: int
    model: Any
    init_params: Any
    lowered_step: Any
    t0: float
    main: bool


def _setup(args: argparse.Namespace, t0: float) -> _Run:
    """Builds the mesh, the corpus and the state, and compiles the steps; writes run.json."""
    import jax

    import zeropp_jax as zpp
    from zeropp_jax._mesh import data_parallel_size
    from zeropp_jax.train import corpus as user_corpus
    from zeropp_jax.train import data
    from zeropp_jax.train.model import param_count as param_count_of

    mesh = make_mesh(args)
    check_batch(args, data_parallel_size(mesh))
    config = zeropp_config(args)
    is_main = jax.process_index() == 0
    out = _prepare_out(args, is_main)
    corpus = user_corpus.from_flags(args)  # bad data is reported before anything compiles
    entropy = data.unigram_entropy(corpus.train, args.vocab_size)
    gpt = gpt_config(args)
    model, params, state, step_fn = _make_state(args, gpt, mesh, config)
    if args.engine == "xla-fsdp":
        config = None
    param_count = param_count_of(gpt)
    start = 0
    if args.resume:
        latest = latest_checkpoint(out)
        if latest is None:
            raise UsageError(f"--resume: no checkpoint under {checkpoint_dir(out)}")
        state = zpp.restore_checkpoint(os.path.abspath(latest[1]), state)
        start = int(jax.device_get(state.step))
    if start >= args.steps:
        raise UsageError(f"--resume: the run in {out} is at step {start}, --steps is {args.steps}")
    eval_set = data.eval_set(
        corpus.val,
        mesh,
        seed=args.seed,
        num_batches=args.eval_batches,
        batch_size=args.batch,
        seq_len=args.seq_len,
    )
    # Compile ahead of time here, so that a config the engine rejects at trace time is
    # reported like any other bad flag.
    lowered_step = step_fn.lower(state, eval_set[0])
    compiled_step = lowered_step.compile()
    compiled_eval = jax.jit(eval_loss).lower(state, eval_set[0]).compile()
    if not args.no_memory_check:
        _check_memory({"training step": compiled_step, "evaluation step": compiled_eval}, mesh)
    if is_main:
        _write_run_record(args, out, mesh, param_count)
    return _Run(
        args=args,
        out=out,
        mesh=mesh,
        config=config,
        corpus=corpus,
        entropy=entropy,
        state=state,
        compiled_step=compiled_step,
        compiled_eval=compiled_eval,
        eval_set=eval_set,
        start=start,
        param_count=param_count,
        model=model,
        init_params=params,
        lowered_step=lowered_step,
        t0=t0,
        main=is_main,
    )


def _prepare_out(args: argparse.Namespace, is_main: bool) -> str:
    """The run directory, checked (and, for `--train-tokenizer`, its tokenizer learned)."""
    import jax

    out = args.out or default_out(args)
    if args.train_tokenizer is not None:
        if jax.process_count() > 1:
            raise UsageError(
                "--train-tokenizer learns on one process; for a multi-process job run "
                "zeropp-tokenize --data ... --vocab-size N --out DIR first and train on its files"
            )
        args.tokenizer = os.path.join(out, "tokenizer.json")  # learned below, or resumed
    if args.resume:
        check_resume(out, args)
    elif latest_checkpoint(out) is not None:
        raise UsageError(
            f"{out} already holds checkpoints; pass --resume to continue that run or choose "
            "another --out"
        )
    if is_main:
        check_writable(out)
    if args.train_tokenizer is not None and not args.resume:
        from zeropp_jax.train.tokenize_corpus import learn_for_run

        learn_for_run(args, out)
    return out


def _make_state(args: argparse.Namespace, gpt, mesh, config):
    """The model, its parameters, the `--engine`'s train state and its step function."""
    import zeropp_jax as zpp
    from zeropp_jax.train.model import GPT, init_fn

    model = GPT(gpt)
    # Sharded init: the parameters are made shard by shard where they live (the unsharded
    # tree is never built); a resumed run restores onto the state's shapes without
    # initialising at all.
    params = init_fn(gpt, args.seed)
    if args.engine == "xla-fsdp":
        from zeropp_jax.baselines import xla_fsdp_state, xla_fsdp_step

        state = xla_fsdp_state(
            apply_fn=model.apply,
            params=params,
            tx=make_optimizer(args),
            mesh=mesh,
            compute_dtype=args.compute_dtype,
        )
        return model, params, state, xla_fsdp_step(train_step, state, mesh)
    build = zpp.TrainState.abstract if args.resume else zpp.TrainState.create
    state = build(
        apply_fn=model.apply, params=params, tx=make_optimizer(args), mesh=mesh, config=config
    )
    return model, params, state, zpp.shard(train_step, mesh=mesh, config=config, donate_state=True)


def _write_run_record(args: argparse.Namespace, out: str, mesh, param_count: int) -> None:
    """Writes `run.json`: the flags, the model's size, the mesh and the code's provenance."""
    os.makedirs(out, exist_ok=True)
    record = {k: v for k, v in vars(args).items()}
    record.update(param_count=param_count, devices=mesh.size, mesh=dict(mesh.shape))
    # The code of this process; a resumed run keeps the code of its earlier parts.
    record["provenance"] = provenance()
    if args.resume:
        with open(os.path.join(out, "run.json")) as f:
            saved = json.load(f)
        earlier = saved.get("earlier_provenance", [])
        record["earlier_provenance"] = earlier + [saved.get("provenance")]
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(record, f, indent=1)


def _check_memory(compiled: dict[str, Any], mesh) -> None:
    """Raises `UsageError` when a compiled program needs more memory than a device has;
    says so on stderr when the devices do not tell their memory."""
    import jax

    from zeropp_jax.train import fit

    device = mesh.devices.flat[0]
    local = sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index())
    capacity = fit.device_capacity(device, local)
    if capacity is None:
        print(
            f"{PROG}: note: no memory check ({device.device_kind} reports no memory limit)",
            file=sys.stderr,
        )
        return
    problem = fit.fit_error({k: fit.need_of(c) for k, c in compiled.items()}, capacity)
    if problem:
        raise UsageError(problem)


class _Loop:
    """The training loop's own state: the train state, metrics log, checkpoints and timing."""

    def __init__(self, run: _Run):
        from zeropp_jax.train import data

        self.run, self.state = run, run.state
        run.state = None  # the loop owns the state from here (the step may donate it)
        self.sharding = data.batch_sharding(run.mesh)
        self.own_rows = data.process_rows(self.sharding, run.args.batch)
        self.log = None
        if run.main:
            self.log = open_metrics(os.path.join(run.out, "metrics.jsonl"), keep_until=run.start)
        self.saved: list[int] = []
        self.train_loss = float("nan")
        self.timed_steps, self.timed_seconds = 0, 0.0
        self.stopped = self.signal_received = None

    def emit(self, record: dict) -> None:
        """Appends one line to `metrics.jsonl` (main process only)."""
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

    def evaluate(self) -> float:
        """Mean validation loss of the current state over the evaluation set."""
        import numpy as np

        run = self.run
        return float(np.mean([float(run.compiled_eval(self.state, b)) for b in run.eval_set]))

    def save(self, step: int) -> None:
        """Checkpoints the state as `step` (every process takes part); exits 1 on failure."""
        import zeropp_jax as zpp

        run = self.run
        if step in self.saved or run.args.engine == "xla-fsdp":
            return
        path = os.path.abspath(checkpoint_path(run.out, step))
        try:
            zpp.save_checkpoint(path, self.state)
        except Exception as e:  # a full disk, a directory gone read-only, ...
            before = latest_checkpoint(run.out)
            kept = f"the previous checkpoint {before[1]} is intact" if before else "none kept"
            reason = " ".join(str(e).split())[:300]
            print(
                f"{PROG}: error: cannot write checkpoint {path}: {reason}; {kept}", file=sys.stderr
            )
            raise SystemExit(1) from None
        self.saved.append(step)

    def tokens_per_s(self, untimed: float) -> float:
        """Throughput over the timed steps (the first step excluded), else `untimed`."""
        args, seconds = self.run.args, self.timed_seconds
        return self.timed_steps * args.batch * args.seq_len / seconds if seconds else untimed


def _train(run: _Run) -> int:
    """Trains to `--steps` and reports: 0, or `EXIT_STOPPED` after a stop signal."""
    import jax
    from tqdm.auto import tqdm

    from zeropp_jax.train import data

    loop = _Loop(run)
    bar = tqdm(
        total=run.args.steps,
        initial=run.start,
        desc=PROG,
        unit="step",
        disable=not run.main or run.args.no_progress,
        dynamic_ncols=True,
    )
    say = bar.write if run.main else (lambda _msg: None)
    shape = " x ".join(str(n) for n in run.mesh.shape.values())
    unit = run.corpus.unit
    for note in (preset_note(run.args), muon_note(run.args)):
        if note:
            say(note)
    say(
        f"{run.param_count / 1e6:.2f}M parameters on a {shape} {tuple(run.mesh.axis_names)} "
        f"mesh of {jax.default_backend()} devices; "
        f"config {config_text(run.config, getattr(run.state, 'plan', None) and run.state)}; "
        f"corpus {len(run.corpus.train) / 1e6:.1f}M train "
        f"/ {len(run.corpus.val) / 1e6:.2f}M val {unit}s ({run.corpus.description}), "
        f"unigram entropy {run.entropy:.3f} nats ({data.bits(run.entropy):.2f} bits) per "
        f"{unit}; out {run.out}"
    )
    _run_steps(loop, bar, say)
    bar.close()
    if loop.stopped is not None:
        _report_stop(loop)
    else:
        _finish(loop)
    if loop.log is not None:
        loop.log.close()
    return 0 if loop.stopped is None else EXIT_STOPPED


def _run_steps(loop: _Loop, bar, say) -> None:
    """Steps, with periodic evaluations and checkpoints, to the last step or a stop signal."""
    from zeropp_jax.state._preemption import StopGuard
    from zeropp_jax.train import data

    run, args = loop.run, loop.run.args

    def make_batch(step: int):
        # Every process draws the window starts of the whole global batch (cheap) and reads
        # only its own rows; the fingerprint is of the starts, so it is the same for any
        # process count.
        starts = data.batch_starts(
            len(run.corpus.train),
            seed=args.seed,
            step=step,
            batch_size=args.batch,
            seq_len=args.seq_len,
        )
        local = data.windows(run.corpus.train, starts[loop.own_rows], args.seq_len + 1)
        return _fingerprint(starts), data.make_global_batch(local, loop.sharding, args.batch)

    guard = StopGuard()
    with guard, data.Prefetcher(make_batch, run.start, args.steps) as batches:
        for step, (digest, batch) in batches:
            t = time.perf_counter()
            loop.state, metrics = run.compiled_step(loop.state, batch)
            loop.train_loss = train_loss = float(metrics["loss"])
            dt = time.perf_counter() - t
            done = step + 1
            if done > run.start + 1:  # the first step of a run warms up
                loop.timed_steps += 1
                loop.timed_seconds += dt
            bar.update(1)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{loop.tokens_per_s(0.0):,.0f}")
            loop.emit({"step": done, "loss": train_loss, "data_crc32": digest})
            if args.eval_every and done % args.eval_every == 0 and done < args.steps:
                val_loss = loop.evaluate()
                say(f"step {done}: train loss {train_loss:.4f}, val loss {val_loss:.4f}")
                loop.emit({"step": done, "val_loss": val_loss})
            if args.save_every and done % args.save_every == 0:
                loop.save(done)
            if done < args.steps and guard.should_stop(done):
                loop.save(done)
                loop.stopped = done
                break
    loop.signal_received = guard.signal_received


def _report_stop(loop: _Loop) -> None:
    """Says, on the main process, what stopped the run and how to continue it."""
    import signal

    run, received = loop.run, loop.signal_received
    name = signal.Signals(received).name if received else "a peer"
    if run.main:
        where = (
            "no checkpoint (--engine xla-fsdp)"
            if run.args.engine == "xla-fsdp"
            else f"checkpoint {checkpoint_path(run.out, loop.stopped)}"
        )
        print(
            f"{PROG}: stopped by {name} after step {loop.stopped}; {where}; continue with "
            f"--resume --out {run.out}",
            flush=True,
        )


def _finish(loop: _Loop) -> None:
    """The final evaluation and checkpoint, then summary.json and the closing report."""
    from zeropp_jax.train import data

    run, args = loop.run, loop.run.args
    val_loss = loop.evaluate()
    loop.emit({"step": args.steps, "val_loss": val_loss})
    loop.save(args.steps)
    rate = loop.tokens_per_s(float("nan"))

    ledger_text, ledger_m = "", {}
    if not args.no_ledger:
        ledgers = _ledgers(run, run.eval_set[0])
        ledger_text = ledger_table(ledgers)
        ledger_m = ledger_summary(ledgers)
    wall = time.time() - run.t0
    unit, per_byte = run.corpus.unit, run.corpus.bytes_per_token
    bpb = data.bits(val_loss) / per_byte if per_byte else None
    summary = {
        "steps": args.steps,
        "final_train_loss": loop.train_loss,
        "final_val_loss": val_loss,
        "val_bits_per_byte": bpb,
        "unit": unit,
        "unigram_entropy_nats": run.entropy,
        "tokens_per_s": rate,
        "wall_s": wall,
        "param_count": run.param_count,
        "ledger": ledger_m,
    }
    if not run.main:
        return
    with open(os.path.join(run.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    lines = [
        "",
        f"final train loss {loop.train_loss:.4f}, val loss {val_loss:.4f} nats/{unit} "
        f"({data.bits(val_loss):.3f} bits"
        + (f"; {bpb:.3f} bits per byte of text" if bpb and unit != "byte" else "")
        + f"); unigram entropy {run.entropy:.4f} nats "
        f"({data.bits(run.entropy):.3f} bits)",
        f"{rate:,.0f} tokens/s (first step excluded), wall time {wall:.1f} s, "
        + (
            "no checkpoint (--engine xla-fsdp)"
            if args.engine == "xla-fsdp"
            else f"checkpoint {checkpoint_path(run.out, args.steps)}"
        ),
    ]
    if ledger_text:
        lines += [
            f"communication ledger, M = {2 * run.param_count / 1e6:.2f} MB "
            f"(parameters in 16 bits):",
            ledger_text,
        ]
    print("\n".join(lines))


XLA_FSDP = "XLA FSDP"
"""The ledger of XLA's FSDP as XLA:CPU compiled it (`summary.json`'s `ledger` key)."""
XLA_FSDP_WIRE = "XLA FSDP, 16-bit wire"
"""The ledger of XLA's FSDP at its partitioner's width (`comm_ledger(partitioned=True)`)."""


def _ledgers(run: _Run, batch) -> dict[str, Any]:
    """Ledgers of one step of this config and of plain ZeRO-3 (not run), each of the whole
    step, the optimizer update's collectives included: read from the compiled program
    (`CommLedger.program`; the engine's own is the one this run compiled), and XLA FSDP's
    also at its partitioner's width."""
    import zeropp_jax as zpp
    from zeropp_jax.baselines import step_ledger

    if run.config is None:
        # As XLA:CPU compiled it (bfloat16 collectives widened to float32), and at the width
        # XLA's partitioner gives each collective (what a GPU compilation sends).
        return {
            name: zpp.comm_ledger(
                Prelowered(run.lowered_step),
                batch,
                mesh=run.mesh,
                param_count=run.param_count,
                compiled=not partitioned,
                partitioned=partitioned,
            )
            for name, partitioned in ((XLA_FSDP, False), (XLA_FSDP_WIRE, True))
        }
    name = "ZeRO-3" if run.config.is_zero3 else "ZeRO++"
    ledgers = {
        name: zpp.comm_ledger(
            Prelowered(run.lowered_step),
            batch,
            mesh=run.mesh,
            param_count=run.param_count,
            compiled=True,
        )
    }
    if not run.config.is_zero3:
        ledgers["ZeRO-3"] = step_ledger(
            train_step,
            batch,
            apply_fn=run.model.apply,
            params=run.init_params,
            tx=make_optimizer(run.args),
            mesh=run.mesh,
            config=zpp.ZeroPPConfig.zero3(
                compute_dtype=run.config.compute_dtype, shared_grad=run.config.shared_grad
            ),
            compiled=True,
        )
    return ledgers


def ledger_summary(ledgers: dict[str, Any]) -> dict[str, Any]:
    """`summary.json`'s `ledger`: per ledger, bytes per step in units of M, per device and
    through the busiest node link, in all and per phase, and the program they were read
    from."""
    from zeropp_jax.measure._ledger import PHASES

    out = {}
    for name, lg in ledgers.items():
        link = lg.link_bytes_by("phase")
        sent = lg.bytes_by("phase")
        out[name] = {
            "total_M": lg.in_units_of_M(lg.total_bytes),
            "link_M": lg.in_units_of_M(lg.link_bytes),
            "program": lg.program,
            **{f"{p}_link_M": lg.in_units_of_M(link.get((p,), 0.0)) for p in PHASES},
            **{f"{p}_total_M": lg.in_units_of_M(sent.get((p,), 0.0)) for p in PHASES},
        }
    return out
