"""Communication volume of one training step, from the ledger, in units of M.

    python experiments/volume_table.py                       # GPT sizes x meshes x variants
    python experiments/volume_table.py --sizes 64x2 --meshes 2x4 --out /tmp/vt

For a small GPT of a few sizes on an emulated `node x local` mesh (8 CPU devices), builds
each variant's training step, reads its ledger (`zpp.comm_ledger`: lowered HLO, bytes sent
per device) and splits the bytes into

  * forward weight gather, backward weight gather, gradient reduction (and `other`:
    all-reduces such as the loss), each cross-node and intra-node;
  * the float32 scale overhead: a float32 record is a scale when a record of the same
    (phase, op, mesh axes) carries an int8/uint8 payload (scales travel in their own
    collective beside the payload);
  * the paper's count, forward + cross-node backward + gradient (what the paper calls 3M
    for ZeRO-3 and 0.75M for ZeRO++), and ZeRO-3's paper count divided by the variant's;
  * the bytes through each node's network link in one direction (`CommLedger.link_bytes`,
    gloo's algorithms) and ZeRO-3's divided by the variant's.

The first two variants are XLA's own FSDP, read from the program XLA:CPU compiled and
from the program its SPMD partitioner wrote, at the 16-bit width a GPU keeps (see
`VARIANTS`); the others from the lowered program.

M is the model in 16-bit bytes (2 bytes per parameter). A flat collective over N devices
sends (N-1)/N of its data per device, so ZeRO-3 is 3 * 7/8 M here, not 3M.

Writes `volume_table.md`, `volume_table.csv` and `volume_table.png` into the output
folder (default `experiments/results/volume_table/`). `volume_rows(...)` returns the rows
as dicts for other code (tests, docs, `projection.py`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import pathlib
import time
from collections.abc import Iterable, Sequence
from typing import Any

import _common
import _engines

_common.request_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _library import PARTS  # noqa: E402

import zeropp_jax as zpp  # noqa: E402
from zeropp_jax import baselines  # noqa: E402
from zeropp_jax.train.model import GPT, GPTConfig, init_params, loss_fn  # noqa: E402

QUANTIZED_DTYPES = ("int8", "uint8")
PART_TITLES = {
    "fwd_gather": "forward gather",
    "bwd_gather": "backward gather",
    "grad_reduce": "gradient reduction",
    "other": "other",
}

XLA_FSDP = "XLA FSDP (CPU-compiled)"
XLA_FSDP_WIRE = "XLA FSDP (16-bit wire)"
_config = _engines.config_of

VARIANTS: dict[str, zpp.ZeroPPConfig | None] = {
    XLA_FSDP: None,
    XLA_FSDP_WIRE: None,
    "ZeRO-3": _config("ZeRO-3"),
    "+qwZ": _config("ZeRO++", weight_bits=8, hierarchical=False, grad_bits=None),
    "+hpZ": _config("ZeRO++", weight_bits=None, hierarchical=True, grad_bits=None),
    "+qgZ": _config("ZeRO++", weight_bits=None, hierarchical=False, grad_bits=4),
    "ZeRO++": _config("ZeRO++"),
    "ZeRO++ int4 weights": _config("ZeRO++", weight_bits=4),
    "ZeRO++ int2 gradients": _config("ZeRO++", grad_bits=2),
    "ZeRO++ int4 weight deltas": _config("int4-delta"),
    "ZeRO++ int4 deltas + int8/int2 grads": _config("int4-delta", grad_bits=8, grad_node_bits=2),
}
# The paper's volumes reduce each weight's gradient once: "auto" would reduce the small
# model's tied table per use (one more reduction of it).
VARIANTS = {k: v if v is None else v.replace(shared_grad="once") for k, v in VARIANTS.items()}
"""The variants of the table: XLA's own FSDP (None: `zeropp_jax.baselines`), read from the
program XLA:CPU compiled (where its collectives first exist; XLA:CPU widens its bfloat16
collectives to float32) and from the program XLA's SPMD partitioner wrote, before that
widening (`comm_ledger(..., partitioned=True)`: the 16-bit wire a GPU sends), ZeRO-3, each technique
alone, full ZeRO++ (int8 weights, hpZ, int4 gradients), two lower-bit variants of it, and
two with weight deltas (each device keeps its hpZ secondary shard across steps and the
step sends int4 deltas across nodes; the delta gather runs in `apply_gradients`, so it
counts as a forward gather), the second with int8 gradients inside the node and int2
across nodes."""


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """A GPT shape of the table (`d_model` x `n_layers`, 4 heads, byte vocabulary)."""

    d_model: int
    n_layers: int
    seq_len: int = 32

    @property
    def config(self) -> GPTConfig:
        return GPTConfig(
            seq_len=self.seq_len, d_model=self.d_model, n_layers=self.n_layers, n_heads=4
        )

    @property
    def label(self) -> str:
        return f"d{self.d_model} L{self.n_layers}"


DEFAULT_RUNS = (
    (ModelSize(64, 2), (2, 4)),
    (ModelSize(128, 3), (2, 4)),
    (ModelSize(256, 4), (2, 4)),
    (ModelSize(128, 3), (4, 2)),
)
"""(model size, (num_nodes, local_size)) pairs of the default table."""


# ------------------------------------------------------------------------- the ledger


def _train_step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch, train=True))(
        state.params
    )
    return state.apply_gradients(grads=grads), {"loss": loss}


def step_ledger(
    size: ModelSize,
    config: zpp.ZeroPPConfig | None,
    mesh_shape: tuple[int, int],
    partitioned: bool = False,
):
    """The `CommLedger` of one training step (adam) of a GPT of `size` on a mesh
    (`config=None`: XLA's FSDP, compiled, or with `partitioned` as its partitioner wrote
    it)."""
    mesh = zpp.make_mesh(*mesh_shape)
    cfg = size.config
    batch = np.zeros((mesh.devices.size, cfg.seq_len + 1), np.int32)
    return baselines.step_ledger(
        _train_step,
        batch,
        apply_fn=GPT(cfg).apply,
        params=init_params(cfg, 0),
        tx=optax.adam(1e-3),
        mesh=mesh,
        config=config,
        partitioned=partitioned,
    )


def scale_keys(records: Iterable[Any]) -> set[tuple[str, str, tuple[str, ...]]]:
    """(phase, op, axes) of the collectives that carry a quantized (int8/uint8) payload."""
    return {(r.phase, r.op, r.axes) for r in records if r.dtype in QUANTIZED_DTYPES}


def is_scale(record, quantized: set[tuple[str, str, tuple[str, ...]]]) -> bool:
    """A float32 record beside a quantized payload of the same (phase, op, axes)."""
    return record.dtype == "float32" and (record.phase, record.op, record.axes) in quantized


def ledger_terms(ledger) -> list[dict[str, Any]]:
    """Aggregates a ledger by (part, op, axes, group size, cross-node, payload or scale).

    Returns dicts with those keys plus `M` (bytes per device in units of M) and `count`
    (collectives per step, loop trips included); `projection.py` times each term.
    """
    quantized = scale_keys(ledger.records)
    terms: dict[tuple, dict[str, Any]] = {}
    for r in ledger.records:
        kind = "scale" if is_scale(r, quantized) else "payload"
        key = (r.part, r.op, r.axes, r.group_size, r.cross_node, kind)
        t = terms.setdefault(
            key,
            dict(
                part=key[0],
                op=r.op,
                axes=r.axes,
                group_size=r.group_size,
                cross_node=r.cross_node,
                kind=kind,
                dtypes=set(),
                M=0.0,
                count=0,
            ),
        )
        t["M"] += ledger.in_units_of_M(r.bytes_sent)
        t["count"] += r.trip_count
        t["dtypes"].add(r.dtype)
    out = []
    for t in terms.values():
        t["dtypes"] = "+".join(sorted(t["dtypes"]))
        out.append(t)
    return out


def volume_row(ledger) -> dict[str, float]:
    """Volumes of one step in units of M: per part cross/intra, totals, scales, paper count."""
    row: dict[str, float] = collections.defaultdict(float)
    quantized = scale_keys(ledger.records)
    for r in ledger.records:
        m = ledger.in_units_of_M(r.bytes_sent)
        where = "cross" if r.cross_node else "intra"
        row[f"{r.part}_{where}"] += m
        row[f"total_{where}"] += m
        row["total"] += m
        if is_scale(r, quantized):
            row["scales"] += m
    out = {
        f"{p}_{w}": row[f"{p}_{w}"] for p in PARTS for w in ("cross", "intra")
    }  # fixed key order
    out.update(
        total_cross=row["total_cross"],
        total_intra=row["total_intra"],
        total=row["total"],
        scales=row["scales"],
        link=ledger.in_units_of_M(ledger.link_bytes),
    )
    out["paper_count"] = (
        out["fwd_gather_cross"]
        + out["fwd_gather_intra"]
        + out["bwd_gather_cross"]
        + out["grad_reduce_cross"]
        + out["grad_reduce_intra"]
    )
    return out


def volume_rows(
    runs: Sequence[tuple[ModelSize, tuple[int, int]]] = DEFAULT_RUNS,
    variants: Sequence[str] = tuple(VARIANTS),
    *,
    with_terms: bool = False,
    verbose: bool = False,
) -> list[dict[str, Any]]:
    """One row per (size, mesh, variant): `volume_row` plus identification columns.

    Args:
      runs: `(ModelSize, (num_nodes, local_size))` pairs; the mesh must use all devices.
      variants: keys of `VARIANTS`; "ZeRO-3" is added first when missing (the ratio column
        needs it).
      with_terms: also attach `ledger_terms` under the key `terms` (not a CSV column).
      verbose: print a line per ledger.

    Returns:
      Dicts with `model`, `params`, `mesh`, `variant`, the `volume_row` keys in units of
      M, and `reduction`: ZeRO-3's paper count over this variant's (same model and mesh).
    """
    names = ["ZeRO-3", *(v for v in variants if v != "ZeRO-3")]
    rows = []
    for size, mesh_shape in runs:
        base = None
        for name in names:
            start = time.perf_counter()
            ledger = step_ledger(size, VARIANTS[name], mesh_shape, name == XLA_FSDP_WIRE)
            row = dict(
                model=size.label,
                params=ledger.param_count,
                mesh=f"{mesh_shape[0]}x{mesh_shape[1]}",
                variant=name,
                **volume_row(ledger),
            )
            if name == "ZeRO-3":
                base, base_link = row["paper_count"], row["link"]
            row["reduction"] = base / row["paper_count"]
            row["link_reduction"] = base_link / row["link"]
            if with_terms:
                row["terms"] = ledger_terms(ledger)
            if verbose:
                print(
                    f"  {size.label} {row['mesh']} {name:<37} total {row['total']:.4f} M, "
                    f"paper count {row['paper_count']:.4f} M "
                    f"({time.perf_counter() - start:.1f} s)",
                    flush=True,
                )
            if name in variants:
                rows.append(row)
    return rows


# --------------------------------------------------------------------------- outputs


def to_markdown(rows: Sequence[dict[str, Any]]) -> str:
    head = ["model (params)", "mesh", "variant"]
    head += [f"{PART_TITLES[p]} {w}" for p in PARTS for w in ("cross", "intra")]
    head += ["total cross", "total intra", "total", "of which scales", "paper count"]
    head += ["ZeRO-3 / this", "per node link", "ZeRO-3 / this (link)"]
    body = []
    for r in rows:
        cells = [f"{r['model']} ({r['params']:,})", r["mesh"], r["variant"]]
        cells += [f"{r[f'{p}_{w}']:.4f}" for p in PARTS for w in ("cross", "intra")]
        cells += [f"{r[k]:.4f}" for k in ("total_cross", "total_intra", "total", "scales")]
        cells += [f"{r['paper_count']:.4f}", f"{r['reduction']:.2f}x"]
        cells += [f"{r['link']:.4f}", f"{r['link_reduction']:.2f}x"]
        body.append(cells)
    return _common.markdown_table(head, body, "lll" + "r" * (len(head) - 3))


def plot(rows: Sequence[dict[str, Any]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    largest = max(rows, key=lambda r: r["params"])
    sel = [r for r in rows if r["model"] == largest["model"] and r["mesh"] == largest["mesh"]]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=[3, 2])
    colors = {"fwd_gather": "tab:blue", "bwd_gather": "tab:orange", "grad_reduce": "tab:green"}
    x = np.arange(len(sel))
    bottom = np.zeros(len(sel))
    for part, color in colors.items():
        for where, hatch, alpha in (("cross", None, 1.0), ("intra", "//", 0.45)):
            vals = np.array([r[f"{part}_{where}"] for r in sel])
            ax.bar(
                x,
                vals,
                bottom=bottom,
                color=color,
                alpha=alpha,
                hatch=hatch,
                edgecolor="white" if hatch else None,
                label=f"{PART_TITLES[part]}, {where}-node",
            )
            bottom += vals
    ax.scatter(x, [r["paper_count"] for r in sel], marker="_", s=600, c="k", label="paper count")
    ax.set_xticks(x, [r["variant"] for r in sel], rotation=25, ha="right")
    ax.set_ylim(0, 1.5 * max(bottom.max(), 1e-9))
    ax.set_ylabel("bytes sent per device per step (units of M)")
    ax.set_title(f"{largest['model']} ({largest['params']:,} params), mesh {largest['mesh']}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    for (model, mesh), group in _groups(rows).items():
        ax2.plot(
            [r["variant"] for r in group],
            [r["reduction"] for r in group],
            marker="o",
            label=f"{model}, {mesh}",
        )
    ax2.axhline(4.0, color="k", ls=":", lw=1, label="paper: 3M / 0.75M = 4x")
    ax2.set_ylabel("ZeRO-3 paper count / variant paper count")
    ax2.tick_params(axis="x", rotation=25)
    for label in ax2.get_xticklabels():
        label.set_horizontalalignment("right")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _groups(rows):
    out: dict[tuple[str, str], list] = collections.defaultdict(list)
    for r in rows:
        out[(r["model"], r["mesh"])].append(r)
    return out


def write_outputs(rows: Sequence[dict[str, Any]], out_dir: pathlib.Path, machine: str) -> list:
    """Writes the markdown table, the CSV and the figure; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path, png = (out_dir / f"volume_table.{e}" for e in ("md", "csv", "png"))
    _common.write_text(
        md,
        f"<!-- generated by experiments/volume_table.py on {machine} -->\n\n"
        "Bytes per training step, in units of M (model size in 16-bit bytes): sent per "
        "device by each part of the step, and through each node's network link in one "
        "direction (`per node link`).\n\n" + to_markdown(rows),
    )
    _common.write_csv(csv_path, [{k: v for k, v in r.items() if k != "terms"} for r in rows])
    plot(rows, png)
    return [md, csv_path, png]


def parse_size(text: str) -> ModelSize:
    d, layers = text.lower().split("x")
    return ModelSize(int(d), int(layers))


def parse_mesh(text: str) -> tuple[int, int]:
    n, l_ = text.lower().split("x")
    return int(n), int(l_)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--runs",
        default=",".join(f"{s.d_model}x{s.n_layers}@{m[0]}x{m[1]}" for s, m in DEFAULT_RUNS),
        help="comma list of DMODELxLAYERS@NODESxLOCAL (GPT size on mesh)",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of variants")
    p.add_argument("--out", type=pathlib.Path, default=_common.study_dir("volume_table"))
    args = p.parse_args(argv)
    runs = []
    for item in args.runs.split(","):
        size, _, mesh = item.partition("@")
        runs.append((parse_size(size), parse_mesh(mesh or "2x4")))
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; expected some of {list(VARIANTS)}")
    machine = _common.machine_line()
    print(f"volume_table: {machine}")
    start = time.perf_counter()
    rows = volume_rows(runs, variants, verbose=True)
    print()
    print(to_markdown(rows))
    _common.say_written(write_outputs(rows, args.out, machine))
    print(f"volume_table: {time.perf_counter() - start:.0f} s")
    return rows


if __name__ == "__main__":
    main()
