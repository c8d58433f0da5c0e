"""Prints the ledger table of docs/concepts.md: bytes per step, in units of M.

    python docs/ledger_table.py                      # the table in docs/concepts.md
    python docs/ledger_table.py --d-model 256 --n-layers 4 --mesh 4x2

For each configuration it builds one training step of the trainer's byte-level GPT on an
emulated `node x local` mesh of CPU devices, reads its ledger (`zpp.comm_ledger`: every
collective of the lowered step, its mesh axes and phase) and sums the bytes each device
sends into: the forward weight gather, the backward weight gather and the gradient
reduction, each split into cross-node and intra-node, plus everything else (the loss and
gradient-norm all-reduces); then the bytes through each node's network link in one
direction (`CommLedger.link_bytes`), the number that meets the network. M is the model in
16-bit bytes (2 bytes per parameter); a collective over G devices sends (G - 1) / G of its
data per device, so plain ZeRO-3 on 8 devices is 3 x 7/8 = 2.625 M, not 3 M. The first
two rows are XLA's own FSDP (`zeropp_jax.baselines`, weights split on the model width,
activations pinned to the batch at each block): first read from the program XLA:CPU
compiled (its collectives exist only after compilation; XLA:CPU widens bfloat16
collectives to float32), then from the program XLA's SPMD partitioner wrote, at the width
it gives each collective (the wire a GPU compilation sends; an all-reduce sliced to a
shard counted as the reduce-scatter a GPU compiler makes of it). The others are read as
lowered. Nothing is trained.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zeropp_jax as zpp  # noqa: E402
from zeropp_jax import baselines  # noqa: E402
from zeropp_jax.train.model import GPT, GPTConfig, init_params, loss_fn  # noqa: E402

XLA_FSDP = "XLA FSDP (`jax.jit`), as XLA:CPU compiled it"
XLA_FSDP_WIRE = "XLA FSDP (`jax.jit`), at the partitioner's width (GPU wire)"

CONFIGS = {
    XLA_FSDP: None,
    XLA_FSDP_WIRE: None,
    "`ZeroPPConfig.zero3()`": zpp.ZeroPPConfig.zero3(),
    "qwZ only: `weight_bits=8, hierarchical=False, grad_bits=None`": zpp.ZeroPPConfig(
        hierarchical=False, grad_bits=None
    ),
    "hpZ only: `weight_bits=None, grad_bits=None`": zpp.ZeroPPConfig(
        weight_bits=None, grad_bits=None
    ),
    "qgZ only: `weight_bits=None, hierarchical=False`": zpp.ZeroPPConfig(
        weight_bits=None, hierarchical=False
    ),
    "ZeRO++: `ZeroPPConfig()`": zpp.ZeroPPConfig(),
    "`ZeroPPConfig(weight_bits=4)`": zpp.ZeroPPConfig(weight_bits=4),
    "`ZeroPPConfig(grad_bits=8)`": zpp.ZeroPPConfig(grad_bits=8),
}
# The paper's volumes reduce each weight's gradient once: "once" pinned ("auto", the
# default, reduces this small model's tied table per use: one more reduction of it).
CONFIGS = {k: v if v is None else v.replace(shared_grad="once") for k, v in CONFIGS.items()}
"""Label -> configuration, one table row each (None: XLA's FSDP)."""

COLUMNS = (
    ("fwd_gather", "cross", "forward gather, cross-node"),
    ("fwd_gather", "intra", "forward gather, intra-node"),
    ("bwd_gather", "cross", "backward gather, cross-node"),
    ("bwd_gather", "intra", "backward gather, intra-node"),
    ("grad_reduce", "cross", "gradients, cross-node"),
    ("grad_reduce", "intra", "gradients, intra-node"),
    ("other", None, "other"),
)


def _train_step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch, train=True))(
        state.params
    )
    return state.apply_gradients(grads=grads), {"loss": loss}


def step_ledger(
    config: zpp.ZeroPPConfig | None,
    d_model: int,
    n_layers: int,
    mesh_shape,
    partitioned: bool = False,
) -> zpp.CommLedger:
    """The ledger of one AdamW step of a GPT (`d_model`, `n_layers`, seq 32) on a mesh;
    `config=None` for XLA's FSDP (`partitioned`: its partitioner's program)."""
    mesh = zpp.make_mesh(*mesh_shape)
    gpt = GPTConfig(seq_len=32, d_model=d_model, n_layers=n_layers, n_heads=4)
    batch = np.zeros((mesh.size, gpt.seq_len + 1), np.int32)
    return baselines.step_ledger(
        _train_step,
        batch,
        apply_fn=GPT(gpt).apply,
        params=init_params(gpt, 0),
        tx=optax.adamw(1e-3),
        mesh=mesh,
        config=config,
        partitioned=partitioned,
    )


def row(ledger: zpp.CommLedger) -> dict[tuple[str, str | None], float]:
    """Bytes per device in units of M, by (part, 'cross' / 'intra' / None)."""
    out = {(p, w): 0.0 for p, w, _ in COLUMNS}
    for r in ledger.records:
        part = r.part
        where = None if part == "other" else ("cross" if r.cross_node else "intra")
        out[(part, where)] += ledger.in_units_of_M(r.bytes_sent)
    return out


def table(d_model: int = 64, n_layers: int = 2, mesh_shape=(2, 4)) -> str:
    """The markdown table (with a caption line naming the model and mesh)."""
    head = ["configuration", *(title for _, _, title in COLUMNS), "total", "**per node link**"]
    lines = [
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    params = None
    for label, config in CONFIGS.items():
        ledger = step_ledger(config, d_model, n_layers, mesh_shape, label == XLA_FSDP_WIRE)
        params = ledger.param_count
        values = row(ledger)
        cells = [f"{values[(p, w)]:.3f}" for p, w, _ in COLUMNS]
        link = ledger.in_units_of_M(ledger.link_bytes)
        total = ledger.in_units_of_M(ledger.total_bytes)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {total:.3f} | **{link:.3f}** |")
    caption = (
        f"Bytes per step in units of M for the trainer's GPT (d_model {d_model}, {n_layers} "
        f"layers, {params:,} parameters) on a {mesh_shape[0]} x {mesh_shape[1]} "
        "`('node', 'local')` mesh, AdamW, block size 256: sent per device by each part of "
        "the step (cross-node: by collectives whose group spans nodes), and through each "
        "node's network link in one direction (gloo's algorithms, what the emulated "
        "cluster's veth counts)."
    )
    return caption + "\n\n" + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--mesh", default="2x4", help="NODESxLOCAL, 8 devices in all (2x4)")
    args = p.parse_args(argv)
    nodes, local = (int(v) for v in args.mesh.lower().split("x"))
    print(table(args.d_model, args.n_layers, (nodes, local)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
