"""Muon end to end: the trainer's GPT under ZeRO++ defaults against XLA's FSDP.

    python experiments/muon_e2e.py                      # 4 runs of 800 steps (~25 min)
    python experiments/muon_e2e.py --variants muon_zeropp,muon_xla_fsdp
    python experiments/muon_e2e.py --report-only        # rewrite the tables
    python experiments/muon_e2e.py --quick --out /tmp/m # smoke run

(times on 2 shared CPU cores). Trains the trainer's scanned byte-level GPT (`zeropp-train`,
`--d-model 128 --n-layers 2 --n-heads 4`: 0.45M parameters) on the Python standard
library with `--optimizer muon` (Newton-Schulz on every kernel, one matrix per layer;
AdamW on the rest) under the ZeRO++ engine's defaults (int8 weights, hpZ, int4 two-hop
gradients) and under XLA's FSDP (`--engine xla-fsdp`: `jax.jit` with sharded parameters,
the arrays keep their shapes), with the same seed, data order and validation batches;
and, as the control, the same pair with `--optimizer adamw`. Each run is one
`python -m zeropp_jax.train` process (`experiments/_study_runs.py`); a finished
run of the same command by the same code is reused.

Writes `muon_e2e.csv` and `muon_e2e.md` into `--out` (default `experiments/results/`),
runs under `<out>/muon_e2e/<variant>`. `gap_pct` is a ZeRO++ run's final validation loss
over XLA FSDP's with the same optimizer, minus 1, in percent. Bytes are per step, in
units of M (the model in 16 bits), from the ledgers: `link_M` as the trainer wrote it to
`summary.json` (ZeRO++ lowered, XLA FSDP as XLA:CPU compiled it); the per-phase columns
from the compiled program (`comm_ledger(..., compiled=True)`), where the ZeRO++ engine's
optimizer update is its own `update` phase (the collectives XLA inserts to run Muon's
Newton-Schulz on whole matrices). XLA FSDP's program has no such scope: its update
collectives count under forward / backward, so its `update` column is left empty and its
optimizer's extra bytes show as Muon's total minus AdamW's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import _common

_common.request_cpu_devices(8)

import _study_runs  # noqa: E402
import convergence  # noqa: E402

VARIANTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "muon_zeropp": ("muon", "zeropp", ("--optimizer", "muon")),
    "muon_xla_fsdp": ("muon", "xla-fsdp", ("--optimizer", "muon", "--engine", "xla-fsdp")),
    # The diagnosis of a gap: the engine unquantized (plain ZeRO-3, bfloat16 compute).
    "muon_zero3": ("muon", "zero3", ("--optimizer", "muon", "--engine", "zero3")),
    # Is it the int4 gradients? ZeRO++ with 8-bit gradient hops (weights still int8).
    "muon_zeropp_g8": ("muon", "zeropp", ("--optimizer", "muon", "--grad-bits", "8")),
    # Or int4 gradients with error feedback on the cross-node hop.
    "muon_zeropp_ef": ("muon", "zeropp", ("--optimizer", "muon", "--error-feedback", "node")),
    "muon_zeropp_ef_all": ("muon", "zeropp", ("--optimizer", "muon", "--error-feedback", "all")),
    "adamw_zeropp": ("adamw", "zeropp", ("--optimizer", "adamw")),
    "adamw_xla_fsdp": ("adamw", "xla-fsdp", ("--optimizer", "adamw", "--engine", "xla-fsdp")),
}
SCHEDULE = dataclasses.replace(convergence.MAIN, scan=True)
"""The trainer's default (scanned) GPT at width 128 and depth 2 (0.45M parameters), 800
steps, peak lr 3e-3 for both of Muon's parts."""
QUICK = dataclasses.replace(convergence.QUICK, scan=True, ledger=True)
GOAL_GAP_PCT = 2.0
PHASES = ("forward", "backward", "update")
COLUMNS = (
    "variant",
    "optimizer",
    "engine",
    "commit",
    "params",
    "val_loss",
    "xla_fsdp_val_loss",
    "gap_pct",
    "link_M",
    *(f"{p}_link_M" for p in PHASES),
    "total_device_M",
    "update_device_M",
    "wall_s",
)


def phase_ledger(variant: str, schedule: _study_runs.Schedule) -> dict[str, Any]:
    """Bytes of one compiled step of `variant`, per phase, in units of M: through the
    busiest node link and sent per device."""
    import jax
    import numpy as np

    import zeropp_jax as zpp
    from zeropp_jax.baselines import step_ledger
    from zeropp_jax.train import cli, optimizers
    from zeropp_jax.train.flags import gpt_config, parse_args, zeropp_config
    from zeropp_jax.train.model import GPT, init_fn, param_count

    optimizer, engine, flags = VARIANTS[variant]
    args = parse_args([*schedule.flags(), *flags])
    gpt = gpt_config(args)
    mesh = zpp.make_mesh(2, 4)
    batch = jax.ShapeDtypeStruct((args.batch, gpt.seq_len + 1), np.int32)
    tx = optimizers.make_optimizer(args)
    if engine == "xla-fsdp":
        ledger = step_ledger(
            cli.train_step, batch, apply_fn=GPT(gpt).apply, params=init_fn(gpt, 0), tx=tx,
            mesh=mesh, config=None,
        )  # fmt: skip
    else:
        state = zpp.TrainState.abstract(
            apply_fn=GPT(gpt).apply, params=init_fn(gpt, 0), tx=tx, mesh=mesh,
            config=zeropp_config(args),
        )  # fmt: skip
        ledger = zpp.comm_ledger(
            zpp.shard(cli.train_step), state, batch, compiled=True, param_count=param_count(gpt)
        )
    m = ledger.in_units_of_M
    link = ledger.link_bytes_by("phase")
    sent = ledger.bytes_by("phase")
    out = {f"{p}_link_M": m(link.get((p,), 0.0)) for p in PHASES}
    out["total_device_M"] = m(ledger.total_bytes)
    out["update_device_M"] = m(sent.get(("update",), 0.0))
    if engine == "xla-fsdp":
        out["update_link_M"] = None
        out["update_device_M"] = None
    return out


def _short(provenance: dict[str, Any]) -> str:
    commit = str(provenance.get("commit") or "unknown")[:7]
    return commit + ("+dirty" if provenance.get("dirty") else "")


def rows_of(
    runs: Sequence[_study_runs.Run], root: pathlib.Path, schedule: _study_runs.Schedule
) -> list[dict[str, Any]]:
    """One row per finished run (`COLUMNS`); the phase ledger is computed once per run and
    kept beside it (`phases.json`)."""
    done = {}
    for run in runs:
        out = root / run.path
        if not (out / "summary.json").exists():
            continue
        summary = json.loads((out / "summary.json").read_text())
        prov = json.loads((out / "run.json").read_text()).get("provenance", {})
        optimizer, engine, _ = VARIANTS[run.name]
        ledger = summary.get("ledger", {})
        key = {"xla-fsdp": "XLA FSDP", "zero3": "ZeRO-3"}.get(engine, "ZeRO++")
        phases_path = out / "phases.json"
        if not phases_path.exists():
            phases_path.write_text(json.dumps(phase_ledger(run.name, schedule), indent=1))
        done[run.name] = dict(
            variant=run.name,
            optimizer=optimizer,
            engine=engine,
            commit=_short(prov),
            params=summary["param_count"],
            val_loss=summary["final_val_loss"],
            link_M=ledger.get(key, {}).get("link_M"),
            wall_s=round(summary["wall_s"]),
            **json.loads(phases_path.read_text()),
        )
    rows = []
    for row in done.values():
        ref = done.get(f"{row['optimizer']}_xla_fsdp")
        same = ref is not None and ref["commit"] == row["commit"]
        row["xla_fsdp_val_loss"] = ref["val_loss"] if same else None
        row["gap_pct"] = 100 * (row["val_loss"] / ref["val_loss"] - 1) if same else None
        rows.append({c: row.get(c) for c in COLUMNS})
    return rows


def markdown(
    rows: Sequence[dict[str, Any]],
    runs: Sequence[_study_runs.Run],
    schedule: _study_runs.Schedule,
    root: pathlib.Path,
    status: dict[str, str],
) -> str:
    """The table, the goal's verdict and the commands that trained every run."""
    fmt = lambda x, spec: "" if x is None else format(x, spec)  # noqa: E731
    table = _common.markdown_table(
        [
            *("variant", "optimizer", "engine", "commit", "params", "val loss"),
            *("XLA FSDP val loss", "gap", "link M (trainer)"),
            *("fwd link M", "bwd link M", "update link M", "device M", "update device M"),
            "wall s",
        ],
        [
            [
                *(r["variant"], r["optimizer"], r["engine"], r["commit"], r["params"]),
                fmt(r["val_loss"], ".4f"),
                fmt(r["xla_fsdp_val_loss"], ".4f"),
                "" if r["gap_pct"] is None else f"{r['gap_pct']:+.2f}%",
                *(fmt(r[c], ".3f") for c in ("link_M", "forward_link_M", "backward_link_M")),
                *(fmt(r[c], ".3f") for c in ("update_link_M", "total_device_M")),
                fmt(r["update_device_M"], ".3f"),
                r["wall_s"],
            ]
            for r in rows
        ],
        "llllrrrrrrrrrrr",
    )
    by = {r["variant"]: r for r in rows}
    verdicts = []
    for optimizer in ("muon", "adamw"):
        row = by.get(f"{optimizer}_zeropp")
        if row is None or row["gap_pct"] is None:
            verdicts.append(f"- {optimizer}: no gap yet (both runs of one commit needed).")
            continue
        met = abs(row["gap_pct"]) <= GOAL_GAP_PCT
        verdicts.append(
            f"- {optimizer}: ZeRO++ {row['val_loss']:.4f} against XLA FSDP "
            f"{row['xla_fsdp_val_loss']:.4f}, gap {row['gap_pct']:+.2f}% "
            + ("(within" if met else "(**not** within")
            + f" {GOAL_GAP_PCT}%)."
        )
    mu, ad = by.get("muon_xla_fsdp"), by.get("adamw_xla_fsdp")
    if mu and ad:
        verdicts.append(
            f"- XLA FSDP's Muon sends {mu['total_device_M'] - ad['total_device_M']:.3f} M per "
            f"device per step more than its AdamW ({mu['total_device_M']:.3f} against "
            f"{ad['total_device_M']:.3f} M), through the node link "
            f"{(mu['link_M'] or 0) - (ad['link_M'] or 0):.3f} M more."
        )
    commands = "\n".join(
        "python " + " ".join(run.command(schedule, root / run.path)) for run in runs
    )
    unfinished = {k: v for k, v in status.items() if v not in ("done", "reused")}
    return (
        "\n\n".join(
            [
                "<!-- generated by experiments/muon_e2e.py -->",
                "# Muon end to end: ZeRO++ defaults against XLA FSDP",
                f"Machine: {_common.machine_line()}.",
                "Schedule (every run): `"
                + " ".join(schedule.flags())
                + "` (warmup + cosine, bfloat16 compute, 2 x 4 emulated CPU mesh; Muon's "
                "Newton-Schulz and AdamW parts share the peak lr).",
                table,
                f"Final validation gap, ZeRO++ against XLA FSDP (goal: within {GOAL_GAP_PCT}% "
                "for Muon):\n\n" + "\n".join(verdicts),
                "Bytes per step in units of M = 2 x params (the model in 16 bits). `link M "
                "(trainer)`: the busiest node link as the trainer's summary.json has it "
                "(ZeRO++ from the lowered program, XLA FSDP as XLA:CPU compiled it). The "
                "phase columns: the compiled program's ledger per phase; `update` is the "
                "ZeRO++ engine's optimizer update (XLA's gathers for Newton-Schulz); XLA "
                "FSDP's program has no update scope, so its update bytes count under forward "
                "/ backward. `device M`: bytes sent per device, all phases.",
                *([f"Not finished: {unfinished}"] if unfinished else []),
                "Commands (from the repository root; `python experiments/muon_e2e.py` runs "
                "them all and writes this file):\n\n```\n" + commands + "\n```",
            ]
        )
        + "\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--variants", default=None, help="comma-separated subset, in order")
    p.add_argument("--steps", type=int, default=None, help="steps per run (800)")
    p.add_argument(
        "--budget-min",
        type=float,
        default=25.0,
        help="wall-time bound: a run is started only if the longest finished run would fit",
    )
    p.add_argument("--report-only", action="store_true", help="rewrite the tables only")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)

    schedule = QUICK if args.quick else SCHEDULE
    if args.steps:
        schedule = dataclasses.replace(schedule, steps=args.steps)
    names = _common.chosen_variants(p, args.variants, VARIANTS, VARIANTS)
    out, root = _common.study_dirs(args.out, args.quick, "muon_e2e")
    machine = _common.machine_line()
    log = _common.file_logger(root / "log.txt")

    # Every variant is listed (the report shows all finished runs); only `names` train.
    runs = [
        _study_runs.Run(name=n, label=n, path=n, trainer_flags=VARIANTS[n][2]) for n in VARIANTS
    ]
    status: dict[str, str] = {}

    def write(*_: Any) -> None:
        rows = rows_of(runs, root, schedule)
        if rows:
            _common.write_csv(out / "muon_e2e.csv", rows)
        (out / "muon_e2e.md").write_text(markdown(rows, runs, schedule, root, status))

    log(f"on {machine}")
    start = time.time()
    deadline = start + 60 * args.budget_min
    longest = 0.0  # the longest run so far: a run that would not finish in time is not started
    for name in names:
        run = next(r for r in runs if r.name == name)
        began = time.time()
        if longest and began + 1.2 * longest > deadline and not args.report_only:
            if not _study_runs.matches(root / run.path, run.command(schedule, root / run.path)):
                status[name] = "skipped (would not finish within --budget-min)"
                log(f"{name}: {status[name]}")
                continue
        status.update(
            _study_runs.run_study(
                [run],
                schedule,
                root,
                write,
                deadline=deadline,
                in_process=False,
                machine=machine,
                log=log,
                report_only=args.report_only,
            )
        )
        if status[name] == "done":
            longest = max(longest, time.time() - began)
    write()
    log(f"done: {status} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
