"""Convergence: ZeRO++ trains like ZeRO-3; and how many gradient quantization events it
takes before the loss moves.

    python experiments/convergence.py                  # six variants, 800 steps (~40 min)
    python experiments/convergence.py --study events   # k = 0..32 extra 4-bit events (~75 min)
    python experiments/convergence.py --report-only    # rewrite the tables from finished runs
    python experiments/convergence.py --quick --study all --out /tmp/cv   # smoke run
    python experiments/convergence.py --d-model 256 --n-layers 6 --n-heads 8 --steps 2000 \
        --variants zero3,xla_fsdp,zeropp,zeropp_delta4 --out experiments/results/convergence/large
                                                       # 4.8M parameters (hours per run)

(times on 2 shared CPU cores). `--seed`, `--variants`, `--ks`, `--events-bits` and
`--steps` change the study; a run whose folder already holds a finished run of the same
command, run by the same code (one clean commit and the same package versions, from the
run's `run.json`; see `zeropp_jax.measure._provenance.same_code`), is reused, not trained again.

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
(default `experiments/results/convergence/`); runs, their `metrics.jsonl` and logs under
`<out>/convergence/`, or in `experiments/results/convergence/` itself by default
(checkpoints are deleted after each run).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time
from collections.abc import Sequence

import _common

_common.request_cpu_devices(8)

from _convergence_report import (  # noqa: E402
    events_stem,
    write_events,
    write_main,
)
from _study_runs import Injection, Run, Schedule, run_study, trainer_step  # noqa: E402

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


# ------------------------------------------------------------------- the events study


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
            lambda data, status: write_main(out, root, runs, data, status, schedule, argv),
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
                root,
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
