"""Tensor parallelism and ZeRO++: does qgZ (and qwZ, hpZ) still pay once TP has shrunk the
data-parallel degree?

    python experiments/tp_study.py                 # measured on 2 x 4, model to 24 x 16
    python experiments/tp_study.py --out /tmp/tp   # elsewhere

Measured (the ledger): the trainer's GPT, scanned and split Megatron-style over a `model`
axis of TP = 1, 2, 4 devices inside each node of an emulated 2 x 4 mesh (so 8, 4, 2
data-parallel ranks), under XLA's FSDP + TP, our ZeRO-3 + TP and ZeRO++ + TP, bfloat16
compute, AdamW. Per engine and TP size, per device and through each node's link (one
direction, gloo's algorithms as on the emulated cluster):

  * the data-parallel (ZeRO) collectives: for our engines from the lowered program (as JAX
    wrote them), for XLA FSDP from the program XLA:CPU compiled (it picks them);
  * the tensor-parallel collectives XLA inserted over `model` (compiled program; XLA:CPU
    widens their bfloat16 to float32, so they count twice what a GPU sends);
  * the data-parallel collectives again on the 16-bit wire (`16-bit wire` columns): for
    XLA FSDP from the program its SPMD partitioner wrote, before XLA:CPU widens the
    16-bit ones to float32 (`comm_ledger(..., partitioned=True)`: what a GPU compilation
    sends); for our engines the same as above (their 16-bit values cross as raw bits).

XLA FSDP + TP is `zeropp_jax.baselines` as MaxText shards: each weight split over `model`
where annotated and over the data-parallel axes on its model-width dimension, the
activations pinned to the batch at each block's entry and exit.

Modelled (`step_bytes`, NCCL rings): the same three engines on 24 nodes x 16 devices with
TP = 1, 2, 4, 8, 16, for GPT-3 1.3B (one 2048-token sequence per data-parallel rank). The
model is checked against the measured 2 x 4 rows (`tests/test_tp_study.py`).

The model, for `n` nodes of `L` devices, TP `K`, `l = L / K` data-parallel ranks per node,
`d = n * l` data-parallel ranks, and `S` the 16-bit bytes of one model rank's slice of the
parameters (`2 * (split / K + replicated)`):

  * ZeRO-3 (and XLA FSDP, the same three collectives): per device `3 S (d-1)/d`; per node
    link, each of the node's `K` rings (one per model rank) crosses it once per direction:
    `3 K S (d-1)/d`.
  * ZeRO++: forward gather over `node` of the int8 secondary shard (`S/(2l)` plus scales)
    then over `local`; backward gather over `local` only; gradients int4, all-to-all over
    `local` then over `node`. Per node link: `K S (1/2 + 1/4) (n-1)/n` plus scales.
  * TP (both): per layer, two all-reduces of the block's activations forward (after the
    attention's and the MLP's row-parallel matrices), two backward (the input gradients
    of the column-parallel ones), and one more where the backward recomputes the layer
    (under `--remat full`; the engine's layered scan keeps what the model's remat keeps,
    so with the default `none` nothing is recomputed); `2 (K-1)/K` of each per
    device, inside the node. The token embedding is split by vocabulary, so the tied
    head's logits are too: the backward pass all-gathers their gradient over `model`
    (`(K-1)/K` of the rank's logits per device), and all-reduces the lookup's output
    forward and the head's input gradient backward (two more activation all-reduces).

So per node link TP changes nothing for the split parameters (every node still takes in
the whole model each step, in K slices), and the ratio ZeRO-3 / ZeRO++ stays about 4. A
parameter left unsplit (here the position embedding, norms and row biases) is gathered by
each of the K model ranks and so crosses the link K times.

Writes `tp_study.md`, `tp_study.csv` and `tp_study.png` into the output folder (default
`experiments/results/tp_study/`).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time
from typing import Any

import _common
import _engines

_common.request_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _library import BATCH_SPEC  # noqa: E402

import zeropp_jax as zpp  # noqa: E402
from zeropp_jax.train.model import GPT, PRESETS, GPTConfig, init_fn, loss_fn  # noqa: E402

ENGINES = ("xla_fsdp", "zero3", "zeropp")
"""The engines compared, by their `_engines` slugs."""
LABELS = {"xla_fsdp": "XLA FSDP + TP", "zero3": "ZeRO-3 + TP", "zeropp": "ZeRO++ + TP"}
MEASURED_GPT = GPTConfig(seq_len=128, d_model=256, n_layers=4, n_heads=8, scan=True)
MEASURED_BATCH = 16


# ----------------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Bytes of one training step: per device (data-parallel and tensor-parallel
    collectives) and through each node's network link, one direction."""

    dp_device: float
    tp_device: float
    link: float


def split_params(gpt: GPTConfig) -> tuple[int, int]:
    """`(split, replicated)` parameters of the GPT under Megatron's split: the blocks'
    matrices, the column layers' biases and the token embedding (by vocabulary) are split
    over `model`; the position embedding, norms and the row layers' biases are not."""
    d, f, layers = gpt.d_model, gpt.mlp_ratio * gpt.d_model, gpt.n_layers
    split = layers * (3 * d * d + 3 * d + d * d + d * f + f + f * d) + gpt.vocab_size * d
    replicated = gpt.seq_len * d + layers * (2 * d + 4 * d) + 2 * d
    return split, replicated


def step_bytes(
    engine: str,
    *,
    split: int,
    replicated: int,
    nodes: int,
    per_node: int,
    k: int,
    layers: int,
    activation_values: int,
    logit_values: int = 0,
    weight_bits: int = 8,
    grad_bits: int = 4,
    block_size: int = 256,
    activation_bytes: int = 2,
    all_reduces_per_layer: int = 4,
) -> StepBytes:
    """The modelled bytes of one step (module docstring), NCCL-style rings.

    Args:
      engine: "xla_fsdp", "zero3" or "zeropp".
      split: parameters split over `model`.
      replicated: parameters every model rank holds whole.
      nodes: `n`.
      per_node: devices per node, `L`.
      k: tensor-parallel size, `K` (divides `L`).
      layers: transformer blocks (two all-reduces each way per block).
      activation_values: values of one block's activations on one data-parallel rank
        (micro-batch x sequence x width).
      logit_values: values of the logits on one data-parallel rank (micro-batch x
        sequence x vocabulary): their gradient, split by vocabulary, is all-gathered over
        `model` once in the backward pass (as XLA partitions the loss), and the
        vocabulary-split embedding adds two all-reduces of one block's activations (the
        lookup's output forward, the tied head's input gradient backward).
      weight_bits: qwZ bits (ZeRO++).
      grad_bits: qgZ bits (ZeRO++).
      block_size: values per quantization block (one float32 scale each).
      activation_bytes: bytes per activation value on the wire.
      all_reduces_per_layer: tensor-parallel all-reduces per block and step (4: two
        forward, two backward; 5 where the backward recomputes the block, as under
        `--remat full`).
    """
    local = per_node // k
    d = nodes * local
    values = split / k + replicated  # one model rank's slice
    s = 2 * values
    per = 2 * activation_values * activation_bytes * (k - 1) / k
    # The vocabulary-split head (when there are logits to count): their gradient's
    # all-gather, and the lookup's and the head's two activation all-reduces.
    embedding = logit_values * activation_bytes * (k - 1) / k + 2 * per if logit_values else 0.0
    tp = 0.0 if k == 1 else all_reduces_per_layer * layers * per + embedding
    if engine in ("xla_fsdp", "zero3"):
        return StepBytes(3 * s * (d - 1) / d, tp, 3 * k * s * (d - 1) / d)
    if engine != "zeropp":
        raise ValueError(f"engine={engine!r}; expected one of {ENGINES}.")
    w = values * (weight_bits / 8 + 4 / block_size)  # quantized full slice, scales included
    g = values * (grad_bits / 8 + 4 / block_size)
    cross = (nodes - 1) / nodes
    within = (local - 1) / local
    device = w / local * cross + w * within + w * within + g * within + g / local * cross
    return StepBytes(device, tp, k * (w + g) * cross)


# ----------------------------------------------------------------------------- measured


def _train_step(state: Any, batch: Any) -> Any:
    loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch, train=True))(
        state.params
    )
    return state.apply_gradients(grads=grads), {"loss": loss}


def measure(engine: str, k: int, gpt: GPTConfig | None = None, batch: int | None = None):
    """The ledgers of one step of `gpt` (default `MEASURED_GPT`, global batch
    `MEASURED_BATCH`) on a 2 x 4 mesh with TP `k`: a dict of bytes (per device:
    data-parallel, tensor-parallel; per node link) and the parameter count."""
    gpt = MEASURED_GPT if gpt is None else gpt
    batch = MEASURED_BATCH if batch is None else batch
    mesh = zpp.make_mesh(2, 4 // k, model_size=k if k > 1 else None)
    gpt = dataclasses.replace(gpt, model_parallel=k > 1)
    params = init_fn(gpt, 0)
    tx = optax.adamw(1e-3)
    count = sum(x.size for x in jax.tree.leaves(jax.eval_shape(params)))
    sharding = jax.sharding.NamedSharding(mesh, BATCH_SPEC)
    tokens = jax.ShapeDtypeStruct((batch, gpt.seq_len + 1), jnp.int32, sharding=sharding)
    state, make_step = _engines.build(
        engine,
        apply_fn=GPT(gpt).apply,
        params=params,
        tx=tx,
        mesh=mesh,
        abstract=True,
        donate=engine == "xla_fsdp",  # as the committed tables measured: ours not donated
    )
    step = make_step(_train_step)
    if engine == "xla_fsdp":
        compiled = zpp.comm_ledger(step, state, tokens, param_count=count, compiled=True)
        # XLA chooses every collective: those over `model` alone are its tensor-parallel
        # ones, the rest (some over all three axes) its data-parallel ones.
        dp = [r for r in compiled.records if r.axes != ("model",)]
        dp_ledger = compiled
        # The same at the width XLA's partitioner gives them, before XLA:CPU widens its
        # 16-bit collectives to float32: the wire a GPU compilation sends.
        wire = zpp.comm_ledger(step, state, tokens, param_count=count, partitioned=True)
        dp_wire = [r for r in wire.records if r.axes != ("model",)]
    else:
        dp_ledger = zpp.comm_ledger(step, state, tokens, param_count=count)
        dp = list(dp_ledger.records)
        compiled = zpp.comm_ledger(step, state, tokens, param_count=count, compiled=True)
        wire, dp_wire = dp_ledger, dp  # the engines' 16-bit values cross as raw bits
    tp = [r for r in compiled.records if r.axes == ("model",)]
    mixed = [r for r in compiled.records if "model" in r.axes and r not in tp]
    if engine != "xla_fsdp" and (mixed or any(r.cross_node for r in tp)):
        raise RuntimeError(f"a collective over `model` leaves the node: {(mixed or tp)[0]}")
    per_node = dp_ledger.node_link_bytes(dp)
    per_node_wire = wire.node_link_bytes(dp_wire)
    return {
        "dp_device": sum(r.bytes_sent for r in dp),
        "tp_device": sum(r.bytes_sent for r in tp),
        "link": float(per_node.max()) if per_node.size else 0.0,
        "dp_device_wire": sum(r.bytes_sent for r in dp_wire),
        "link_wire": float(per_node_wire.max()) if per_node_wire.size else 0.0,
        "params": count,
    }


# ----------------------------------------------------------------------------- report


def measured_rows(ks: tuple[int, ...] = (1, 2, 4)) -> list[dict]:
    gpt = MEASURED_GPT
    split, replicated = split_params(gpt)
    rows = []
    for k in ks:
        for engine in ENGINES:
            t0 = time.time()
            got = measure(engine, k)
            m = 2 * got["params"]
            model = step_bytes(
                engine,
                split=split if k > 1 else 0,
                replicated=replicated + (0 if k > 1 else split),
                nodes=2,
                per_node=4,
                k=k,
                layers=gpt.n_layers,
                activation_values=MEASURED_BATCH // (8 // k) * gpt.seq_len * gpt.d_model,
                logit_values=MEASURED_BATCH // (8 // k) * gpt.seq_len * gpt.vocab_size,
                activation_bytes=4,  # XLA:CPU's TP all-reduces are float32
            )
            rows.append(
                {
                    "mesh": "2x4",
                    "tp": k,
                    "dp_ranks": 8 // k,
                    "engine": engine,
                    "dp_per_device_M": round(got["dp_device"] / m, 4),
                    "tp_per_device_M": round(got["tp_device"] / m, 4),
                    "link_M": round(got["link"] / m, 4),
                    "dp_per_device_16bit_M": round(got["dp_device_wire"] / m, 4),
                    "link_16bit_M": round(got["link_wire"] / m, 4),
                    "model_link_M": round(model.link / m, 4),
                    "model_tp_per_device_M": round(model.tp_device / m, 4),
                    "seconds": round(time.time() - t0, 1),
                }
            )
            print(rows[-1], flush=True)
    return rows


def modelled_rows(ks: tuple[int, ...] = (1, 2, 4, 8, 16)) -> list[dict]:
    gpt = PRESETS["1.3b"]
    split, replicated = split_params(gpt)
    m = 2 * (split + replicated)
    rows = []
    for k in ks:
        for engine in ENGINES:
            b = step_bytes(
                engine,
                split=split,
                replicated=replicated,
                nodes=24,
                per_node=16,
                k=k,
                layers=gpt.n_layers,
                activation_values=gpt.seq_len * gpt.d_model,
                logit_values=gpt.seq_len * gpt.vocab_size,
            )
            rows.append(
                {
                    "mesh": "24x16",
                    "tp": k,
                    "dp_ranks": 24 * 16 // k,
                    "engine": engine,
                    "dp_per_device_M": round(b.dp_device / m, 4),
                    "tp_per_device_M": round(b.tp_device / m, 4),
                    "link_M": round(b.link / m, 4),
                }
            )
    return rows


def _table(rows: list[dict], measured: bool) -> str:
    head = ["TP", "DP ranks", "engine", "DP per device (M)", "TP per device (M)", "per link (M)"]
    if measured:
        head += ["DP per device, 16-bit wire (M)", "per link, 16-bit wire (M)"]
        head += ["per link, model (M)"]
    body = []
    for r in rows:
        cells = [r["tp"], r["dp_ranks"], LABELS[r["engine"]], r["dp_per_device_M"]]
        cells += [r["tp_per_device_M"], r["link_M"]]
        if measured:
            cells += [r["dp_per_device_16bit_M"], r["link_16bit_M"], r["model_link_M"]]
        body.append(cells)
    return _common.markdown_table(head, body, "rrlrrr" + ("rrr" if measured else ""))


def _ratios(rows: list[dict]) -> str:
    by = {(r["tp"], r["engine"]): r for r in rows}
    parts = []
    for k in sorted({r["tp"] for r in rows}):
        z3, zpp_ = by[(k, "zero3")]["link_M"], by[(k, "zeropp")]["link_M"]
        parts.append(f"TP {k}: {z3 / zpp_:.2f}x")
    text = "ZeRO-3 / ZeRO++ per node link: " + ", ".join(parts) + "."
    if "link_16bit_M" in rows[0]:
        parts = []
        for k in sorted({r["tp"] for r in rows}):
            xla, zpp_ = by[(k, "xla_fsdp")], by[(k, "zeropp")]
            parts.append(
                f"TP {k}: {xla['link_16bit_M'] / zpp_['link_16bit_M']:.2f}x "
                f"({xla['link_M'] / zpp_['link_M']:.2f}x as XLA:CPU compiled)"
            )
        text += " XLA FSDP / ZeRO++ per node link, 16-bit wire: " + ", ".join(parts) + "."
    return text


def plot(measured: list[dict], modelled: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, rows, title in (
        (axes[0], measured, "measured, 2 x 4 (gloo, XLA:CPU)"),
        (axes[1], modelled, "model, 24 x 16, GPT-3 1.3B (NCCL rings)"),
    ):
        for engine in ENGINES:
            pts = [(r["tp"], r["link_M"]) for r in rows if r["engine"] == engine]
            ax.plot(*zip(*pts, strict=True), marker="o", label=LABELS[engine])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tensor-parallel size (devices per model group)")
        ax.set_ylabel("bytes per node link per step (M)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(_common.study_dir("tp_study")))
    p.add_argument("--tp", default="1,2,4", help="TP sizes measured on 2 x 4 (1,2,4)")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    t0 = time.time()
    measured = measured_rows(tuple(int(k) for k in args.tp.split(",")))
    modelled = modelled_rows()
    md = [
        "# Tensor parallelism and ZeRO++ (`experiments/tp_study.py`)",
        "",
        _common.machine_line(),
        "",
        f"## Measured: trainer's GPT ({MEASURED_GPT.d_model} wide, {MEASURED_GPT.n_layers} "
        f"scanned layers, {MEASURED_GPT.n_heads} heads, seq {MEASURED_GPT.seq_len}), global "
        f"batch {MEASURED_BATCH}, 2 x 4 mesh; M = 2 bytes x parameters",
        "",
        _table(measured, True),
        _ratios(measured),
        "",
        "## Model: GPT-3 1.3B, 24 nodes x 16 devices, one sequence per data-parallel rank",
        "",
        _table(modelled, False),
        _ratios(modelled),
        "",
        f"Total {time.time() - t0:.0f} s.",
        "",
    ]
    paths = [out / "tp_study.md", out / "tp_study.csv", out / "tp_study.png"]
    _common.write_text(paths[0], "\n".join(md))
    _common.write_csv(paths[1], measured + modelled)
    plot(measured, modelled, paths[2])
    _common.say_written(paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
