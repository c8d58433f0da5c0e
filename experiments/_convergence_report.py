"""Tables, figures and report files of the convergence study (`convergence.py`)."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import _common

if TYPE_CHECKING:
    from _study_runs import Run, Schedule

GAP_THRESHOLD_PCT = 1.0
REFERENCE = "zero3"


def events_stem(bits: int, rotation: int | None = None) -> str:
    """Name of the events study at `bits`, with its events rotated by a block Hadamard of
    `rotation` values or not (None): its folder and file stem."""
    stem = "events" if bits == 4 else f"events_b{bits}"
    return stem if rotation is None else f"{stem}_rot{rotation}"


def _gap_pct(value: float, reference: float | None) -> float | None:
    if reference is None:
        return None
    return 100.0 * (value - reference) / reference


def _mean_gap_pct(val: Sequence[tuple[int, float]], ref: Sequence[tuple[int, float]]):
    """Mean over the common evaluation steps of the gap of `val` to `ref`, in percent."""
    ref = dict(ref)
    gaps = [100.0 * (v - ref[s]) / ref[s] for s, v in val if s in ref]
    return sum(gaps) / len(gaps) if gaps else None


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


# The trainer's summary names each run's own ledger after its engine.
_LEDGER_NAMES = {REFERENCE: "ZeRO-3", "xla_fsdp": "XLA FSDP"}


def main_rows(runs: Sequence[Run], data: dict[str, dict]) -> list[dict[str, Any]]:
    """One row per finished run of the main study, with the gap to ZeRO-3."""
    ref = data.get(REFERENCE, {}).get("summary", {}).get("final_val_loss")
    ref_val = data.get(REFERENCE, {}).get("val", [])
    rows = []
    for run in runs:
        d = data.get(run.name)
        if not d or not d["summary"]:
            continue
        s = d["summary"]
        ledger = s.get("ledger", {}).get(_LEDGER_NAMES.get(run.name, "ZeRO++"), {})
        rows.append(
            dict(
                variant=run.name,
                label=run.label,
                flags=" ".join(run.trainer_flags) or "(defaults)",
                final_val_loss=s["final_val_loss"],
                gap_pct=_gap_pct(s["final_val_loss"], ref),
                mean_gap_pct=_mean_gap_pct(d["val"], ref_val),
                final_train_loss=s["final_train_loss"],
                tokens_per_s=s["tokens_per_s"],
                wall_s=s["wall_s"],
                ledger_total_M=ledger.get("total_M"),
                ledger_link_M=ledger.get("link_M"),
            )
        )
    return rows


def main_markdown(rows: Sequence[dict[str, Any]]) -> str:
    head = [
        "variant",
        "trainer flags",
        "final val loss (nats/byte)",
        "gap to ZeRO-3",
        "mean gap over evals",
        "final train loss",
        "tokens/s",
        "wall (s)",
        "ledger per device / per node link (M)",
    ]
    body = [
        [
            r["label"],
            f"`{r['flags']}`",
            f"{r['final_val_loss']:.4f}",
            _pct(r["gap_pct"]),
            _pct(r["mean_gap_pct"]),
            f"{r['final_train_loss']:.4f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['wall_s']:.0f}",
            f"{_fmt(r['ledger_total_M'], '.3f')} / {_fmt(r['ledger_link_M'], '.3f')}",
        ]
        for r in rows
    ]
    return _common.markdown_table(head, body, "llrrrrrrr")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}%"


def event_rows(runs: Sequence[Run], data: dict[str, dict]) -> list[dict[str, Any]]:
    """One row per finished k of the events study, with the gap to k = 0."""
    ref = data.get("k0", {}).get("summary", {}).get("final_val_loss")
    ref_val = data.get("k0", {}).get("val", [])
    rows = []
    for run in runs:
        d = data.get(run.name)
        if not d or not d["summary"]:
            continue
        s = d["summary"]
        rows.append(
            dict(
                k=run.injection.k,
                bits=run.injection.bits,
                block_size=run.injection.block_size,
                mode=run.injection.mode,
                final_val_loss=s["final_val_loss"],
                gap_pct=_gap_pct(s["final_val_loss"], ref),
                mean_gap_pct=_mean_gap_pct(d["val"], ref_val),
                final_train_loss=s["final_train_loss"],
                tokens_per_s=s["tokens_per_s"],
                wall_s=s["wall_s"],
            )
        )
    return rows


def first_break(rows: Sequence[dict[str, Any]], threshold: float = GAP_THRESHOLD_PCT):
    """The smallest k whose final validation loss is more than `threshold` % above k = 0."""
    for r in sorted(rows, key=lambda r: r["k"]):
        if r["gap_pct"] is not None and r["gap_pct"] > threshold:
            return r["k"]
    return None


def events_markdown(rows: Sequence[dict[str, Any]]) -> str:
    head = [
        "k extra events",
        "final val loss (nats/byte)",
        "gap to k = 0",
        "mean gap over evals",
        "final train loss",
        "tokens/s",
        "wall (s)",
    ]
    body = [
        [
            r["k"],
            f"{r['final_val_loss']:.4f}",
            _pct(r["gap_pct"]),
            _pct(r["mean_gap_pct"]),
            f"{r['final_train_loss']:.4f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['wall_s']:.0f}",
        ]
        for r in sorted(rows, key=lambda r: r["k"])
    ]
    return _common.markdown_table(head, body, "rrrrrrr")


def plot_curves(
    runs: Sequence[Run],
    data: dict[str, dict],
    reference: str,
    path: pathlib.Path,
    title: str,
) -> None:
    """Validation loss per run (left) and its gap to `reference` in percent (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gx) = plt.subplots(1, 2, figsize=(12, 4.6))
    ref = dict(data.get(reference, {}).get("val", []))
    largest_gap = 0.0
    for run in runs:
        val = data.get(run.name, {}).get("val", [])
        if not val:
            continue
        steps, losses = zip(*val, strict=True)
        done = bool(data[run.name]["summary"])
        label = run.label + ("" if done else " (incomplete)")
        (line,) = ax.plot(steps, losses, marker="o", ms=2.5, lw=1.2, label=label)
        common = [(s, v) for s, v in val if s in ref]
        if common and run.name != reference:
            gaps = [100 * (v - ref[s]) / ref[s] for s, v in common]
            largest_gap = max(largest_gap, *map(abs, gaps))
            gx.plot(
                [s for s, _ in common],
                gaps,
                marker="o",
                ms=2.5,
                lw=1.2,
                color=line.get_color(),
            )
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    lo = [v for d in data.values() for _, v in d.get("val", [])[1:]]
    if lo:
        ax.set_ylim(min(lo) - 0.05, max(lo) + 0.05)
    gx.axhline(0, color="k", lw=0.8)
    for t in (GAP_THRESHOLD_PCT, -GAP_THRESHOLD_PCT):
        gx.axhline(t, color="gray", ls="--", lw=0.8)
    gx.set_xlabel("step")
    if largest_gap > 5:  # keep the 1% band readable next to a run that breaks
        gx.set_yscale("symlog", linthresh=2.0)
        ticks = [t for t in (-2, -1, 0, 1, 2, 5, 10, 20, 50, 100) if t <= 2 * largest_gap]
        gx.set_yticks(ticks, [f"{t:g}" for t in ticks])
    gx.set_ylabel(f"gap to {reference} (%)")
    gx.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _header(data: dict[str, dict], schedule: Schedule, argv: Sequence[str]) -> str:
    machines = [d["machine"] for d in data.values() if d.get("machine")]
    machine = machines[0] if machines else "-"
    if len(machines) > 1:
        machine += f" (last run started {machines[-1].split(';')[0]})"
    return (
        f"<!-- generated by experiments/convergence.py {' '.join(argv)} -->\n\n"
        f"Machine: {machine}.\n\nSchedule (every run): `{' '.join(schedule.flags())}` "
        "(AdamW, warmup + cosine, bfloat16 compute, 2 x 4 emulated CPU mesh).\n\n"
    )


def _write(paths, text, missing, rows, runs, data, schedule, root, reference, title) -> None:
    """The common end of a study's report: unfinished runs, the commands (runs under
    `root`), then the markdown, CSV and figure at `paths`."""
    if missing:
        text += "\nNot finished: " + "; ".join(missing) + ".\n"
    text += "\nCommands (from the repository root):\n\n```\n"
    text += "\n".join(f"python {' '.join(r.command(schedule, root / r.path))}" for r in runs)
    text += "\n```\n"
    _common.write_text(paths[0], text)
    if rows:
        _common.write_csv(paths[1], rows)
    plot_curves(runs, data, reference, paths[2], title)


def write_main(
    out: pathlib.Path, root: pathlib.Path, runs, data, status, schedule, argv
) -> list[pathlib.Path]:
    rows = main_rows(runs, data)
    paths = [out / "convergence.md", out / "convergence.csv", out / "convergence.png"]
    text = _header(data, schedule, argv) + main_markdown(rows)
    zpp = next((r for r in rows if r["variant"] == "zeropp"), None)
    if zpp is not None and zpp["gap_pct"] is not None:
        ok = abs(zpp["gap_pct"]) <= GAP_THRESHOLD_PCT
        text += (
            f"\nFull ZeRO++ ends {zpp['gap_pct']:+.2f}% from ZeRO-3: "
            f"{'within' if ok else 'outside'} the {GAP_THRESHOLD_PCT:g}% goal.\n"
        )
    missing = [
        f"{r.name}: {status.get(r.name, 'not run')}"
        for r in runs
        if r.name not in {row["variant"] for row in rows}
    ]
    title = "ZeRO++ variants vs ZeRO-3: same seed, data, val batches"
    _write(paths, text, missing, rows, runs, data, schedule, root, REFERENCE, title)
    return paths


def write_events(
    out: pathlib.Path,
    root: pathlib.Path,
    runs,
    data,
    status,
    schedule,
    argv,
    bits: int,
    rotation: int | None = None,
) -> list[pathlib.Path]:
    rows = event_rows(runs, data)
    stem = events_stem(bits, rotation)
    paths = [out / f"convergence_{stem}.md", out / f"convergence_{stem}.csv"]
    paths.append(out / f"convergence_{stem}.png")
    inj = dataclasses.replace(runs[-1].injection, bits=bits)
    text = _header(data, schedule, argv)
    text += (
        f"ZeRO-3 (`--zero3`) with k extra {inj.bits}-bit quantization events (blocks of "
        f"{inj.block_size}, mode `{inj.mode}`) applied to the global gradient before the "
        "optimizer; k = 0 is plain ZeRO-3."
        + (
            ""
            if rotation is None
            else f" Every event rotates its blocks with a block Hadamard rotation of {rotation} "
            "values before quantizing and back after (`--events-rotation`)."
        )
        + "\n\n"
        + events_markdown(rows)
    )
    if rows and any(r["k"] == 0 for r in rows):
        k = first_break(rows)
        tested = max(r["k"] for r in rows)
        text += f"\nFirst k more than {GAP_THRESHOLD_PCT:g}% above k = 0: " + (
            f"**k = {k}**.\n" if k is not None else f"none up to k = {tested}.\n"
        )
    missing = [
        f"k={r.injection.k}: {status.get(r.name, 'not run')}"
        for r in runs
        if r.injection.k not in {row["k"] for row in rows}
    ]
    title = f"k extra {bits}-bit gradient events (ZeRO-3)"
    _write(paths, text, missing, rows, runs, data, schedule, root, "k0", title)
    return paths
