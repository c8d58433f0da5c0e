"""Muon end to end: the trainer's GPT under ZeRO++'s Muon profile against XLA's FSDP.

    python experiments/muon_e2e.py                      # every run (~55 min)
    python experiments/muon_e2e.py --variants muon_zeropp,muon_xla_fsdp --seeds 0,1
    python experiments/muon_e2e.py --report-only        # rewrite the tables
    python experiments/muon_e2e.py --quick --out /tmp/m # smoke run

(times on 2 shared CPU cores). Trains the trainer's scanned byte-level GPT (`zeropp-train`,
`--d-model 128 --n-layers 2 --n-heads 4`: 0.45M parameters) on the Python standard
library with `--optimizer muon` (Newton-Schulz on every kernel, one matrix per layer;
AdamW on the rest):

- `muon_zeropp`: what `zeropp-train --optimizer muon` runs: the Muon profile
  (`ZeroPPConfig.muon()`: int8 weights, hpZ, int8 gradients on both hops) and
  `zeropp_jax.muon` (each matrix's momentum gathered once, in bfloat16, across nodes
  first);
- `muon_xla_fsdp`: XLA's FSDP (`--engine xla-fsdp`: `jax.jit` with sharded parameters)
  with `optax.contrib.muon`, what its users run;
- `muon_zeropp_int4`: ZeRO++'s own defaults (int4 gradients) with the same Muon;
- `muon_zeropp_gather_int8`: the profile with Muon's gather in block-quantized int8;
- `muon_zeropp_node_int4`: the profile with int4 on the cross-node gradient hop;
- `adamw_zeropp` / `adamw_xla_fsdp`: the control, with `--optimizer adamw`;

each with the same seed, data order and validation batches, per seed of `--seeds`. Each
run is one `python -m zeropp_jax.train` process (`experiments/_study_runs.py`); a
finished run of the same command by the same code is reused.

Writes `muon_e2e.csv` and `muon_e2e.md` into `--out`, runs under
`<out>/muon_e2e/s<seed>/<variant>`; by default both into `experiments/results/muon_e2e/`
(runs under its `s<seed>/<variant>`). `gap_pct` is a run's final validation loss over XLA
FSDP's with the same optimizer and seed (same commit), minus 1, in percent.
Bytes are per step, in units of M (the model in 16 bits), from the trainer's
`summary.json`: the whole step's ledger (every collective, the optimizer update's
included), ZeRO++ as compiled (its collectives are 16-bit or narrower as XLA:CPU runs
them), XLA FSDP at its partitioner's 16-bit width (what a GPU sends) and as XLA:CPU
compiled it (float32), per phase and in all.
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
    "muon_zeropp_int4": ("muon", "zeropp", ("--optimizer", "muon", "--preset", "zeropp")),
    "muon_zeropp_gather_int8": (
        "muon",
        "zeropp",
        ("--optimizer", "muon", "--muon-gather", "int8"),
    ),
    "muon_zeropp_node_int4": ("muon", "zeropp", ("--optimizer", "muon", "--grad-node-bits", "4")),
    "adamw_zeropp": ("adamw", "zeropp", ("--optimizer", "adamw")),
    "adamw_xla_fsdp": ("adamw", "xla-fsdp", ("--optimizer", "adamw", "--engine", "xla-fsdp")),
}
DEFAULT_VARIANTS = (
    "muon_zeropp",
    "muon_xla_fsdp",
    "muon_zeropp_gather_int8",
    "muon_zeropp_int4",
    "muon_zeropp_node_int4",
)
SCHEDULE = dataclasses.replace(convergence.MAIN, scan=True)
"""The trainer's default (scanned) GPT at width 128 and depth 2 (0.45M parameters), 800
steps, peak lr 3e-3 for both of Muon's parts."""
QUICK = dataclasses.replace(convergence.QUICK, scan=True, ledger=True)
GOAL_GAP_PCT = 1.0
"""The Muon profile's goal: within 1% of XLA FSDP's Muon on every seed."""
GOAL_UPDATE_LINK_M = 1.0
"""The goal for the update phase per node link: one 16-bit gather of every matrix."""
PHASES = ("forward", "backward", "update")
COLUMNS = (
    "variant",
    "seed",
    "optimizer",
    "engine",
    "commit",
    "params",
    "val_loss",
    "xla_fsdp_val_loss",
    "gap_pct",
    "program",
    *(f"{p}_link_M" for p in PHASES),
    "link_M",
    "cpu_link_M",
    "total_device_M",
    "wall_s",
)


def _short(provenance: dict[str, Any]) -> str:
    commit = str(provenance.get("commit") or "unknown")[:7]
    return commit + ("+dirty" if provenance.get("dirty") else "")


def run_path(variant: str, seed: int) -> str:
    return f"s{seed}/{variant}"


def rows_of(runs: Sequence[tuple[_study_runs.Run, int, str]], root: pathlib.Path) -> list[dict]:
    """One row per finished run (`COLUMNS`), bytes from its `summary.json`: ZeRO++'s as
    compiled; XLA FSDP's at the 16-bit wire (`link_M`) and as compiled (`cpu_link_M`)."""
    done = {}
    for run, seed, variant in runs:
        out = root / run.path
        if not (out / "summary.json").exists():
            continue
        summary = json.loads((out / "summary.json").read_text())
        prov = json.loads((out / "run.json").read_text()).get("provenance", {})
        optimizer, engine, _ = VARIANTS[variant]
        ledger = summary.get("ledger", {})
        if engine == "xla-fsdp":
            wire, cpu = ledger.get("XLA FSDP, 16-bit wire", {}), ledger.get("XLA FSDP", {})
        else:
            wire = cpu = ledger.get("ZeRO-3" if engine == "zero3" else "ZeRO++", {})
        done[(variant, seed)] = dict(
            variant=variant,
            seed=seed,
            optimizer=optimizer,
            engine=engine,
            commit=_short(prov),
            params=summary["param_count"],
            val_loss=summary["final_val_loss"],
            program=wire.get("program"),
            **{f"{p}_link_M": wire.get(f"{p}_link_M") for p in PHASES},
            link_M=wire.get("link_M"),
            cpu_link_M=cpu.get("link_M"),
            total_device_M=wire.get("total_M"),
            wall_s=round(summary["wall_s"]),
        )
    rows = []
    for (_variant, seed), row in done.items():
        ref = done.get((f"{row['optimizer']}_xla_fsdp", seed))
        same = ref is not None and ref["commit"] == row["commit"]
        row["xla_fsdp_val_loss"] = ref["val_loss"] if same else None
        row["gap_pct"] = 100 * (row["val_loss"] / ref["val_loss"] - 1) if same else None
        rows.append({c: row.get(c) for c in COLUMNS})
    return sorted(rows, key=lambda r: (r["seed"], list(VARIANTS).index(r["variant"])))


def verdicts(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's three goals for the Muon profile, per seed."""
    out = []
    by = {(r["variant"], r["seed"]): r for r in rows}
    for (variant, seed), row in sorted(by.items(), key=lambda kv: kv[0][1]):
        if variant != "muon_zeropp":
            continue
        ref = by.get(("muon_xla_fsdp", seed))
        if row["gap_pct"] is None or ref is None:
            out.append(f"- seed {seed}: no gap yet (both runs of one commit needed).")
            continue
        gap_ok = abs(row["gap_pct"]) <= GOAL_GAP_PCT
        upd_ok = row["update_link_M"] <= GOAL_UPDATE_LINK_M
        ratio = row["link_M"] / ref["link_M"]
        out.append(
            f"- seed {seed}: loss {row['val_loss']:.4f} against XLA FSDP's "
            f"{row['xla_fsdp_val_loss']:.4f}, gap {row['gap_pct']:+.2f}% "
            f"({'within' if gap_ok else '**not** within'} {GOAL_GAP_PCT}%); update "
            f"{row['update_link_M']:.3f} M per node link ({'at most' if upd_ok else '**over**'} "
            f"{GOAL_UPDATE_LINK_M} M); all of the step {row['link_M']:.3f} M per node link "
            f"against XLA FSDP's {ref['link_M']:.3f} M at a GPU's width: 1/{1 / ratio:.1f} "
            f"({'at most' if ratio <= 0.2 else '**more** than'} a fifth)."
        )
    return out


def markdown(rows, runs, root: pathlib.Path, status: dict[str, str]) -> str:
    """The table, the goals' verdicts and the commands that trained every run."""
    fmt = lambda x, spec: "" if x is None else format(x, spec)  # noqa: E731
    table = _common.markdown_table(
        [
            *("variant", "seed", "engine", "commit", "val loss", "XLA FSDP val loss", "gap"),
            *("fwd link M", "bwd link M", "update link M", "link M", "link M as CPU ran"),
            *("device M", "wall s"),
        ],
        [
            [
                *(r["variant"], r["seed"], r["engine"], r["commit"]),
                fmt(r["val_loss"], ".4f"),
                fmt(r["xla_fsdp_val_loss"], ".4f"),
                "" if r["gap_pct"] is None else f"{r['gap_pct']:+.2f}%",
                *(fmt(r[f"{p}_link_M"], ".3f") for p in PHASES),
                *(fmt(r[c], ".3f") for c in ("link_M", "cpu_link_M", "total_device_M")),
                r["wall_s"],
            ]
            for r in rows
        ],
        "lrllrrrrrrrrrr",
    )
    commands = "\n".join(
        "python " + " ".join(run.command(schedule, root / run.path))
        for run, schedule in ((r, s) for r, _, _, s in runs)
    )
    unfinished = {k: v for k, v in status.items() if v not in ("done", "reused")}
    return (
        "\n\n".join(
            [
                "<!-- generated by experiments/muon_e2e.py -->",
                "# Muon end to end: ZeRO++'s Muon profile against XLA FSDP",
                f"Machine: {_common.machine_line()}.",
                "Schedule (every run, its seed aside): `"
                + " ".join(SCHEDULE.flags())
                + "` (warmup + cosine, bfloat16 compute, 2 x 4 emulated CPU mesh; Muon's "
                "Newton-Schulz and AdamW parts share the peak lr).",
                table,
                "Goals of the Muon profile (`muon_zeropp`: `zeropp-train --optimizer muon`), "
                "per seed:\n\n" + "\n".join(verdicts(rows) or ["- no runs yet."]),
                "Bytes per step in units of M = 2 x params (the model in 16 bits), from each "
                "run's summary.json: the whole step's ledger, per phase and through the "
                "busiest node link each way (`link M`); ZeRO++ as compiled (its collectives "
                "are 16-bit or narrower as XLA:CPU runs them), XLA FSDP at its partitioner's "
                "width (what a GPU sends; `link M as CPU ran`: float32, as XLA:CPU widened "
                "it). `device M`: bytes sent per device, all phases.",
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
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (0,1)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (800)")
    p.add_argument(
        "--budget-min",
        type=float,
        default=60.0,
        help="wall-time bound: a run is started only if the longest finished run would fit",
    )
    p.add_argument("--report-only", action="store_true", help="rewrite the tables only")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)

    schedule = QUICK if args.quick else SCHEDULE
    if args.steps:
        schedule = dataclasses.replace(schedule, steps=args.steps)
    names = _common.chosen_variants(p, args.variants, VARIANTS, DEFAULT_VARIANTS)
    seeds = [int(x) for x in args.seeds.split(",")]
    out, root = _common.study_dirs(args.out, args.quick, "muon_e2e")
    machine = _common.machine_line()
    log = _common.file_logger(root / "log.txt")

    # Every variant and seed is listed (the report shows all finished runs); only the
    # chosen ones train, the required pairs of each seed first.
    runs = [
        (
            _study_runs.Run(
                name=run_path(n, seed),
                label=n,
                path=run_path(n, seed),
                trainer_flags=VARIANTS[n][2],
            ),
            seed,
            n,
            dataclasses.replace(schedule, seed=seed),
        )
        for seed in sorted({*seeds, 0, 1})
        for n in VARIANTS
    ]
    order = [(n, s) for n in names[:2] for s in seeds] + [(n, seeds[0]) for n in names[2:]]
    order.sort(key=lambda ns: (names.index(ns[0]) >= 2, ns[1], names.index(ns[0])))
    status: dict[str, str] = {}

    def write(*_: Any) -> None:
        rows = rows_of([(r, s, n) for r, s, n, _ in runs], root)
        if rows:
            _common.write_csv(out / "muon_e2e.csv", rows)
        (out / "muon_e2e.md").write_text(markdown(rows, runs, root, status))

    log(f"on {machine}")
    start = time.time()
    deadline = start + 60 * args.budget_min
    longest = 0.0  # the longest run so far: a run that would not finish in time is not started
    for name, seed in order:
        run, _, _, sched = next(r for r in runs if r[2] == name and r[1] == seed)
        began = time.time()
        if longest and began + 1.2 * longest > deadline and not args.report_only:
            if not _study_runs.matches(root / run.path, run.command(sched, root / run.path)):
                status[run.name] = "skipped (would not finish within --budget-min)"
                log(f"{run.name}: {status[run.name]}")
                continue
        status.update(
            _study_runs.run_study(
                [run],
                sched,
                root,
                write,
                deadline=deadline,
                in_process=False,
                machine=machine,
                log=log,
                report_only=args.report_only,
            )
        )
        if status[run.name] == "done":
            longest = max(longest, time.time() - began)
    write()
    log(f"done: {status} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
