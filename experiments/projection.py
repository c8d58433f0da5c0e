"""Projection: an alpha-beta model of one XLA FSDP, ZeRO-3 and ZeRO++ step on 384 GPUs.

    python experiments/projection.py                              # defaults below
    python experiments/projection.py --quant-gbps 700             # measured kernel GB/s
    python experiments/projection.py --gpt 32x1 --no-rescale-check --out /tmp/pj

What is measured and what is assumed:

  * Measured: the bytes each collective sends per device, in units of M, from the ledger
    of a small GPT's training step on an emulated 2 x 4 mesh (`volume_table.ledger_terms`);
    for XLA's FSDP, from the program XLA:CPU compiled (float32 gathers, gradients as an
    all-reduce: what a GPU compile sends may differ).
    They are carried to the target mesh by one rule per collective: the share `(G-1)/G`
    follows the group size G, and a collective over `node` alone moves a slice that is
    1/L of the model (hpZ's secondary shard, qgZ's partial sum after the intra-node hop),
    so it scales with 1/L. The rule is checked by predicting the 4 x 2 ledger from the
    2 x 4 one (`--no-rescale-check` skips that).
  * Cluster (the paper's): 384 GPUs = 24 nodes x 16 (V100, DGX-2), 100/200/400/800 Gbps
    of inter-node bandwidth per node. ASSUMED: 100 GB/s per GPU inside a node (NVSwitch;
    about 2/3 of V100's 150 GB/s NVLink per direction); latency 5 us per message across
    nodes, 2 us inside; links at full rate (efficiency 1.0; see calibration below).
  * Time of a collective: bytes / bandwidth + alpha * messages. A collective over `node`
    alone: the node's L GPUs all send their V bytes through the node's NICs, L * V /
    B_inter. A flat collective over all GPUs in node-major order (a ring): every ring
    carries V across each node boundary, max(V / B_inter, V / B_intra). ZeRO-3's
    gradient reduction is a ring reduce-scatter (in the CPU ledger a ring of
    collective-permutes carrying 16-bit values as uint16 bits), timed as a ring, as
    DeepSpeed's NCCL runs it (`Cluster.flat_as_ring=False` would time a flat all-to-all
    with its cross-node share of L * V through the NICs). Over `local`: V / B_intra.
    Messages:
    one coalesced collective per transformer layer per collective kind (scales ride with
    their payload), G - 1 messages each.
  * ASSUMED compute: 50 TFLOPs per GPU sustained (40% of V100's 125 TFLOPs fp16 peak),
    compute time = 6 * params * tokens / flops, at 1k and 2k tokens per GPU per step (the
    two batch sizes DeepSpeed's ZeRO++ blog reports).
  * Quantization cost: bytes read + written by the quantize / dequantize kernels (weights
    dequantized into 16 bits once per gather, gradients quantized from 16 bits, summed
    into float32) at `--quant-gbps` GB/s. ASSUMED default 500 GB/s (about 55% of V100's
    900 GB/s HBM2); pass the GB/s that `experiments/gpu_kernels.py` measures.
  * Overlap: none (compute + quantization + communication), and a best case with
    communication fully hidden behind compute (max of the two).
  * Models: 10B, 18B, 50B, 100B and 138B parameters. DeepSpeed's ZeRO++ blog names 18B and
    138B; the others are ASSUMED intermediate sizes. Layer counts (which only set the
    message count) are ASSUMED GPT shapes with 12 * layers * hidden^2 ~ params.

Calibration: `calibrate_link(csv)` fits the emulated two-node cluster's measured step
times (`experiments/results/cluster/cluster.csv`, written by `experiments/cluster/run_cluster.py`)
to `step_s = fixed[config] + link_bytes * 8 / (efficiency * rate)`; the output shows the
fit, and one more speedup column with the inter-node links at that efficiency (the main
columns keep 1.0). `link_check` compares the bytes the model puts on the cluster's link
with the bytes measured there. Without the CSV the output says so.

The cost model (cluster, step times, speedup rows) is in `_projection_model.py`; this
script measures the volumes, rescales and calibrates them and writes the outputs.

Writes `projection.{md,csv,png}` into the output folder (default `experiments/results/projection/`).
"""

from __future__ import annotations

import argparse
import csv
import math
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import _common
import _engines
import numpy as np  # noqa: E402
import volume_table as vt  # sets up the emulated CPU devices before jax starts
from _projection_model import (
    GBPS,
    MODELS,
    TOKENS,
    Cluster,
    node_crossing_M,
    project_step,
    projection_rows,
)

DEFAULT_CSV = _common.RESULTS / "cluster" / "cluster.csv"


# ------------------------------------------------------------------ measured volumes


def measure_terms(
    variants: Sequence[str],
    size: vt.ModelSize,
    mesh_shape: tuple[int, int],
) -> dict[str, list[dict[str, Any]]]:
    """`{variant: ledger_terms}` of one training step of a GPT of `size` on a mesh."""
    return {v: vt.ledger_terms(vt.step_ledger(size, vt.VARIANTS[v], mesh_shape)) for v in variants}


def _group_size(axes: tuple[str, ...], num_nodes: int, local_size: int) -> int:
    return math.prod({"node": num_nodes, "local": local_size}[a] for a in axes)


def rescale_terms(
    terms: Sequence[Mapping[str, Any]],
    measured: tuple[int, int],
    target: tuple[int, int],
) -> list[dict[str, Any]]:
    """Carries `ledger_terms` from a `measured` (nodes, local) mesh to a `target` one.

    Each term's volume is multiplied by the ratio of the `(G - 1) / G` shares and, for a
    collective over `node` alone, by `L_measured / L_target` (it moves a 1/L slice).
    """
    (nm, lm), (nt, lt) = measured, target
    out = []
    for t in terms:
        t = dict(t)
        axes = tuple(t["axes"])
        if axes:
            g_m = _group_size(axes, nm, lm)
            g_t = _group_size(axes, nt, lt)
            factor = ((g_t - 1) / g_t) / ((g_m - 1) / g_m)
            if axes == ("node",):
                factor *= lm / lt
            t["M"] *= factor
            t["group_size"] = g_t
            t["cross_node"] = "node" in axes and nt > 1
        out.append(t)
    return out


def _summary(terms: Sequence[Mapping[str, Any]]) -> dict[tuple, float]:
    out: dict[tuple, float] = {}
    for t in terms:
        key = (t["part"], tuple(t["axes"]), t["kind"])
        out[key] = out.get(key, 0.0) + t["M"]
    return out


def rescale_check(
    variants: Sequence[str],
    size: vt.ModelSize,
    measured: Mapping[str, list[dict[str, Any]]],
    from_mesh: tuple[int, int],
    to_mesh: tuple[int, int],
) -> list[dict[str, Any]]:
    """Predicts the `to_mesh` ledger from `measured` (on `from_mesh`) and measures it.

    Returns one row per (variant, part, axes, kind) with `predicted` and `measured` M.
    """
    actual = measure_terms(variants, size, to_mesh)
    rows = []
    for v in variants:
        want = _summary(actual[v])
        got = _summary(rescale_terms(measured[v], from_mesh, to_mesh))
        for key in sorted(set(want) | set(got)):
            rows.append(
                dict(
                    variant=v,
                    part=key[0],
                    axes="+".join(key[1]) or "-",
                    kind=key[2],
                    predicted=got.get(key, 0.0),
                    measured=want.get(key, 0.0),
                )
            )
    return rows


# ---------------------------------------------------------------------- calibration


def _link_bytes(row: Mapping[str, str]) -> float:
    """Bytes per step through the busier direction of the link (each direction of the
    veth pair has its own rate limit), from whichever columns the CSV has."""
    if "mb_node0_to_node1" in row and "mb_node1_to_node0" in row:
        return 1e6 * max(float(row["mb_node0_to_node1"]), float(row["mb_node1_to_node0"]))
    if "link_mb_per_step" in row:  # both directions together
        return 1e6 * float(row["link_mb_per_step"]) / 2
    return float(row["link_bytes"])


def calibrate_link(path: pathlib.Path) -> dict[str, Any] | None:
    """Fits `step_s = fixed[config] + link_bytes * 8 / (efficiency * rate)`.

    Args:
      path: the emulated cluster's CSV (`experiments/cluster/run_cluster.py` writes
        `experiments/results/cluster/cluster.csv`): one row per measured (config, rate) with
        `config`, `rate` (Mbit/s per direction, or `inf` for an unshaped link), `step_s`,
        and the bytes per step on the link (`mb_node0_to_node1` and `mb_node1_to_node0`,
        or `link_mb_per_step`, or `link_bytes`).

    Returns:
      None when the file is missing or has too few usable rows, else `efficiency` (the
      share of the shaped rate the collectives achieve), `fixed_s` per config (compute,
      quantization and latency on the cluster), `rms_s` of the residuals, `rows`, and
      `fit`: measured against fitted step time per row.
    """
    if not path.exists():
        return None
    with open(path, newline="") as f:
        raw = list(csv.DictReader(f))
    data, rates = [], []
    for r in raw:
        try:
            config = r.get("config") or r["variant"]
            rate = float(r.get("rate") or r["rate_mbit"])
            step = float(r["step_s"])
            nbytes = _link_bytes(r)
        except (KeyError, ValueError):
            continue
        if rate > 0 and step > 0:
            data.append((config, nbytes * 8 / (rate * 1e6), step))
            rates.append(rate)
    configs = sorted({d[0] for d in data})
    shaped = [d for d in data if d[1] > 0]
    if not configs or len(shaped) < 2 or len(data) < len(configs) + 1:
        return None
    a = np.zeros((len(data), len(configs) + 1))
    y = np.zeros(len(data))
    for i, (config, ideal_s, step) in enumerate(data):
        a[i, configs.index(config)] = 1.0
        a[i, -1] = ideal_s
        y[i] = step
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    if coef[-1] <= 0:
        return None
    fitted = a @ coef
    resid = y - fitted
    return dict(
        efficiency=float(1 / coef[-1]),
        fixed_s={c: round(float(v), 4) for c, v in zip(configs, coef[:-1], strict=True)},
        rms_s=float(np.sqrt(np.mean(resid**2))),
        rows=len(data),
        fit=[
            dict(config=d[0], rate_mbit=rate, step_s=d[2], fitted_s=float(f))
            for d, rate, f in zip(data, rates, fitted, strict=True)
        ],
    )


# Not XLA FSDP: its bytes in units of M depend on the model XLA compiled (which leaves it
# combines, replicates or all-reduces), and the cluster trains another model than the GPT
# measured here; cluster.md checks its ledger against the link directly.
CLUSTER_CONFIGS = {slug: _engines.lookup(slug).name for slug in ("zero3", "zeropp")}
"""The cluster's config names (`_engines` slugs) against the variants of the volume table."""


def link_check(
    terms_2x4: Mapping[str, Sequence[Mapping[str, Any]]], path: pathlib.Path
) -> list[dict[str, Any]] | None:
    """Bytes per step through the emulated cluster's link: the bandwidth model against the
    cluster's measurement, both in units of M per direction.

    The model counts `node_crossing_M` of the 2 x 4 ledger terms (flat collectives as
    rings, which is what the engine runs: ZeRO-3's gradient reduction is a ring). The
    measurement is the busier direction of the veth pair over `2 * params` bytes, averaged
    over the CSV's rates. None without a usable CSV.
    """
    if not path.exists():
        return None
    with open(path, newline="") as f:
        raw = list(csv.DictReader(f))
    measured: dict[str, list[float]] = {}
    for r in raw:
        try:
            value = _link_bytes(r) / (2 * float(r["params"]))
        except (KeyError, ValueError):
            continue
        measured.setdefault(r.get("config", ""), []).append(value)
    rows = []
    for config, variant in CLUSTER_CONFIGS.items():
        if config not in measured or variant not in terms_2x4:
            continue
        rows.append(
            dict(
                variant=variant,
                model=node_crossing_M(terms_2x4[variant], Cluster(num_nodes=2, local_size=4)),
                measured=float(np.mean(measured[config])),
            )
        )
    return rows or None


# --------------------------------------------------------------------------- outputs


def to_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    head = [
        "model",
        "tokens/GPU",
        "Gbps",
        "compute s",
        "ZeRO-3 comm s",
        "ZeRO++ comm s",
        "ZeRO++ quant s",
        "ZeRO-3 step s",
        "ZeRO++ step s",
        "speedup (no overlap)",
        "speedup (full overlap)",
    ]
    calibrated = all("speedup_calibrated" in r for r in rows)
    fsdp = all("fsdp_step_s" in r for r in rows)
    head += ["speedup (calibrated link)"] if calibrated else []
    head += ["XLA FSDP step s", "ZeRO++ vs XLA FSDP"] if fsdp else []
    head += ["reported"]
    body = []
    for r in rows:
        body.append(
            [r["model"], r["tokens_per_gpu"], r["gbps"]]
            + [
                f"{r[k]:.3f}"
                for k in (
                    "compute_s",
                    "zero3_comm_s",
                    "zeropp_comm_s",
                    "zeropp_quant_s",
                    "zero3_step_s",
                    "zeropp_step_s",
                )
            ]
            + [f"{r['speedup']:.2f}x", f"{r['speedup_full_overlap']:.2f}x"]
            + ([f"{r['speedup_calibrated']:.2f}x"] if calibrated else [])
            + ([f"{r['fsdp_step_s']:.3f}", f"{r['speedup_vs_fsdp']:.2f}x"] if fsdp else [])
            + [r["reported"]]
        )
    return _common.markdown_table(head, body, "lrr" + "r" * (len(head) - 4) + "l")


def plot(rows: Sequence[Mapping[str, Any]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens_list = sorted({r["tokens_per_gpu"] for r in rows})
    fig, axes = plt.subplots(1, len(tokens_list), figsize=(6 * len(tokens_list), 4.4))
    axes = np.atleast_1d(axes)
    for ax, tokens in zip(axes, tokens_list, strict=True):
        for i, name in enumerate(dict.fromkeys(r["model"] for r in rows)):
            sel = [r for r in rows if r["model"] == name and r["tokens_per_gpu"] == tokens]
            color = f"C{i}"
            gbps = [r["gbps"] for r in sel]
            ax.plot(gbps, [r["speedup"] for r in sel], "o-", c=color, label=name)
            ax.plot(
                [r["gbps"] for r in sel],
                [r["speedup_full_overlap"] for r in sel],
                "o--",
                c=color,
                alpha=0.5,
            )
        ax.errorbar([100], [2.0], yerr=[[0.0], [0.16]], fmt="ks", capsize=4, label="reported")
        lo, hi = (1.28, 1.36) if tokens <= 1024 else (1.24, 1.29)
        ax.errorbar([400], [(lo + hi) / 2], yerr=[[(hi - lo) / 2]], fmt="ks", capsize=4)
        ax.set_xscale("log", base=2)
        ax.set_xticks(GBPS, [str(g) for g in GBPS])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel("inter-node bandwidth per node (Gbps)")
        ax.set_ylabel("ZeRO++ / ZeRO-3 throughput")
        ax.plot([], [], "k-", label="no overlap")
        ax.plot([], [], "k--", alpha=0.5, label="full overlap")
        ax.set_title(f"384 GPUs (24 x 16), {tokens} tokens/GPU")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpt", default="128x3", help="GPT measured for the ledger: DMODELxLAYERS")
    p.add_argument("--quant-gbps", type=float, default=Cluster.quant_gbps)
    p.add_argument("--tflops", type=float, default=Cluster.tflops)
    p.add_argument("--intra-gbytes", type=float, default=Cluster.intra_gbytes)
    p.add_argument("--alpha-inter-us", type=float, default=Cluster.alpha_inter_us)
    p.add_argument("--alpha-intra-us", type=float, default=Cluster.alpha_intra_us)
    p.add_argument("--cluster-csv", type=pathlib.Path, default=DEFAULT_CSV)
    p.add_argument("--no-rescale-check", action="store_true")
    p.add_argument("--out", type=pathlib.Path, default=_common.study_dir("projection"))
    args = p.parse_args(argv)
    machine = _common.machine_line()
    print(f"projection: {machine}")
    start = time.perf_counter()
    size = vt.parse_size(args.gpt)
    measured_mesh, check_mesh = (2, 4), (4, 2)
    variants = (vt.XLA_FSDP, "ZeRO-3", "ZeRO++")
    measured = measure_terms(variants, size, measured_mesh)
    lines = [f"Ledger measured on GPT {size.label}, mesh 2x4 ({machine})."]
    if not args.no_rescale_check:
        check = rescale_check(variants, size, measured, measured_mesh, check_mesh)
        worst = {
            v: max(abs(r["predicted"] - r["measured"]) for r in check if r["variant"] == v)
            for v in variants
        }
        lines.append(
            "Rescale rule check, 2x4 -> 4x2 ledger: largest |predicted - measured| per "
            "(part, axes, kind) term: "
            + "; ".join(f"{v} {w:.4f} M" for v, w in worst.items())
            + ". (XLA's partitioner chooses its collectives for each mesh anew, so its "
            "ledger does not follow the rule; the engine's collectives do.)"
        )
        lines.append(
            _common.markdown_table(
                ["variant", "part", "axes", "kind", "predicted M", "measured M"],
                [
                    [r["variant"], r["part"], r["axes"], r["kind"]]
                    + [f"{r['predicted']:.4f}", f"{r['measured']:.4f}"]
                    for r in check
                ],
                "llllrr",
            )
        )
    calibration = calibrate_link(args.cluster_csv)
    if calibration is None:
        lines.append(
            f"Calibration: no usable emulated-cluster CSV at {_common.shown(args.cluster_csv)} "
            "(written by "
            "experiments/cluster/run_cluster.py); link efficiency 1.0 (default)."
        )
        calibrated = None
    else:
        calibrated = calibration["efficiency"]
        lines.append(
            f"Calibration from {_common.shown(args.cluster_csv)} ({calibration['rows']} rows): "
            f"step_s = fixed[config] + link bytes * 8 / (efficiency * rate) gives link "
            f"efficiency {calibrated:.3f}, fixed seconds per config {calibration['fixed_s']}, "
            f"residual RMS {calibration['rms_s']:.4f} s. The table's main columns keep the "
            "links at efficiency 1.0 (InfiniBand with NCCL is not gloo over a shaped veth on 2 "
            "shared CPU cores); 'speedup (calibrated link)' repeats the no-overlap speedup "
            f"with the links at {calibrated:.3f}.\n\n"
            + _common.markdown_table(
                ["config", "rate (Mbit/s)", "measured step s", "fitted step s"],
                [
                    [f["config"], f"{f['rate_mbit']:g}", f"{f['step_s']:.3f}"]
                    + [f"{f['fitted_s']:.3f}"]
                    for f in calibration["fit"]
                ],
                "lrrr",
            )
        )
    checked = link_check(measured, args.cluster_csv)
    if checked:
        lines.append(
            "Emulated cluster (2 x 4), bytes per step through the link per direction, units "
            "of M: the bandwidth model on this ledger vs the cluster's measurement.\n\n"
            + _common.markdown_table(
                ["variant", "model", "measured"],
                [[r["variant"]] + [f"{r[k]:.3f}" for k in ("model", "measured")] for r in checked],
                "lrr",
            )
        )
    cluster = Cluster(
        intra_gbytes=args.intra_gbytes,
        alpha_inter_us=args.alpha_inter_us,
        alpha_intra_us=args.alpha_intra_us,
        tflops=args.tflops,
        quant_gbps=args.quant_gbps,
    )
    target = (cluster.num_nodes, cluster.local_size)
    terms = {v: rescale_terms(measured[v], measured_mesh, target) for v in variants}
    for v in variants:
        cross = sum(t["M"] for t in terms[v] if t["cross_node"])
        total = sum(t["M"] for t in terms[v])
        lines.append(
            f"{v} at 24x16: {total:.4f} M sent per GPU per step, {cross:.4f} M of it by "
            f"cross-node collectives; {node_crossing_M(terms[v], cluster):.4f} M through each "
            "node's NICs (the bandwidth model)."
        )
    lines.append(
        f"{vt.XLA_FSDP}: the collectives of the program XLA:CPU compiled for the same step "
        "(its gathers in float32, its gradients as an all-reduce), timed by the same model; "
        "a GPU compile chooses its own (bfloat16, and possibly a reduce-scatter), so its "
        "columns are this CPU program's cost on the cluster, not a GPU measurement."
    )
    lines.append(f"Assumptions: {cluster}.")
    m18 = next(m for m in MODELS if m.name == "18B")
    ring = project_step(terms["ZeRO-3"], vt.VARIANTS["ZeRO-3"], m18, 1024, 100, cluster)
    lines.append(
        "ZeRO-3's flat collectives are timed as rings (DeepSpeed's NCCL ring all-gather and "
        f"reduce-scatter): 18B, 1k tokens/GPU, 100 Gbps: ZeRO-3 step {ring['step_s']:.2f} s."
    )
    rows = projection_rows(terms, cluster, calibrated_efficiency=calibrated)
    by_key = {(r["model"], r["tokens_per_gpu"], r["gbps"]): r for r in rows}
    for name in ("18B", "138B"):
        for tokens in TOKENS:
            zp200 = by_key[(name, tokens, 200)]["zeropp_step_s"]
            z3800 = by_key[(name, tokens, 800)]["zero3_step_s"]
            lines.append(
                f"{name}, {tokens} tokens/GPU: ZeRO++ at 200 Gbps {zp200:.3f} s per step vs "
                f"ZeRO-3 at 800 Gbps {z3800:.3f} s (reported: about equal throughput)."
            )
    table = to_markdown(rows)
    text = "\n\n".join(lines) + "\n\n" + table
    print(text)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "projection.md", out / "projection.csv", out / "projection.png"]
    _common.write_text(
        paths[0], f"<!-- generated by experiments/projection.py on {machine} -->\n\n{text}"
    )
    _common.write_csv(paths[1], rows)
    plot(rows, paths[2])
    _common.say_written(paths)
    print(f"projection: {time.perf_counter() - start:.0f} s")
    return rows


if __name__ == "__main__":
    main()
