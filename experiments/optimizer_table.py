"""Each optimizer under each engine: the update phase's bytes per node link, the whole
step's, and memory per device.

    python experiments/optimizer_table.py              # 15 steps compiled (~6 min)
    python experiments/optimizer_table.py --out /tmp/t --optimizers adamw

The trainer's GPT as `muon_e2e` trains it (scanned, `--d-model 128 --n-layers 2
--n-heads 4`, 0.45M parameters, batch 16 x 128 tokens) on a 2 x 4 emulated CPU mesh, with
`--optimizer` adamw, adafactor, lion and muon, under each engine as `zeropp-train` sets it
up from its flags (`zeropp`: its defaults, which for Muon are the Muon profile and
`zeropp_jax.muon`; `zero3`; `xla-fsdp`: `jax.jit` with sharded state, as MaxText), plus
XLA FSDP with `zeropp_jax.muon` (`--muon-gather bfloat16`). Nothing trains: each step is
compiled from shapes.

Bytes per step in units of M (the model in 16 bits), from the whole step's ledger (every
collective, the optimizer update's included): the engine's compiled program (its
collectives are 16-bit or narrower as XLA:CPU runs them), XLA FSDP's after the SPMD
partitioner (the width a GPU sends; `link M as CPU ran`: as XLA:CPU compiled it, 16-bit
widened to float32). `update link M` is the update phase through the busiest node link
each way. Memory per device is the compiled step's `memory_analysis()` (arguments, the
outputs that do not reuse a donated buffer, temporaries, code).

Writes `optimizer_table.md` and `optimizer_table.csv` into `--out` (default
`experiments/results`).
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence

import _engines
from _common import machine_line, request_cpu_devices, study_dir, write_table

request_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zeropp_jax as zpp  # noqa: E402
from zeropp_jax.train import cli, fit, optimizers  # noqa: E402
from zeropp_jax.train.flags import OPTIMIZERS, gpt_config, parse_args, zeropp_config  # noqa: E402
from zeropp_jax.train.model import GPT, init_fn, param_count  # noqa: E402

MODEL = ("--d-model", "128", "--n-layers", "2", "--n-heads", "4", "--seq-len", "128")
MODEL += ("--batch", "16", "--scan-layers")
ENGINES: dict[str, tuple[str, ...]] = {  # by the trainer's `--engine` values
    "zeropp": (),
    "zero3": ("--engine", "zero3"),
    "xla-fsdp": ("--engine", "xla-fsdp"),
}
EXTRA = {("muon", "xla-fsdp, zpp.muon"): ("--engine", "xla-fsdp", "--muon-gather", "bfloat16")}
"""XLA FSDP with this library's Muon: what an XLA FSDP user gains from `zeropp_jax.muon`."""
PHASES = ("forward", "backward", "update")


def row(optimizer: str, engine: str, flags: Sequence[str]) -> dict:
    """One optimizer under one engine, as the trainer builds it from `flags`."""
    args = parse_args([*MODEL, "--optimizer", optimizer, *flags])
    gpt = gpt_config(args)
    mesh = zpp.make_mesh(2, 4)
    batch = jax.ShapeDtypeStruct((args.batch, gpt.seq_len + 1), np.int32)
    tx = optimizers.make_optimizer(args)
    state, make_step = _engines.build(
        args.engine,
        apply_fn=GPT(gpt).apply,
        params=init_fn(gpt, 0),
        tx=tx,
        mesh=mesh,
        config=None if args.engine == "xla-fsdp" else zeropp_config(args),
        abstract=True,
    )
    step = make_step(cli.train_step)
    lowered = step.lower(state, batch)
    need = fit.need_of(lowered.compile())
    count = param_count(gpt)
    prelowered = cli.Prelowered(lowered)
    compiled = zpp.comm_ledger(prelowered, batch, mesh=mesh, param_count=count, compiled=True)
    wire = compiled
    if args.engine == "xla-fsdp":
        wire = zpp.comm_ledger(prelowered, batch, mesh=mesh, param_count=count, partitioned=True)
    m = wire.in_units_of_M
    link = wire.link_bytes_by("phase")
    return {
        "optimizer": optimizer,
        "engine": engine,
        "muon": (args.muon_gather if optimizer == "muon" else ""),
        "grad_bits": (
            "" if args.engine == "xla-fsdp" else str(zeropp_config(args).grad_bits or "none")
        ),
        "program": wire.program,
        **{f"{p}_link_M": round(m(link.get((p,), 0.0)), 3) for p in PHASES},
        "link_M": round(m(wire.link_bytes), 3),
        "cpu_link_M": round(compiled.in_units_of_M(compiled.link_bytes), 3),
        "memory_MB": round(need.total / 1e6, 2),
        "temp_MB": round(need.temp / 1e6, 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated")
    p.add_argument("--out", type=pathlib.Path, default=study_dir("optimizer_table"))
    args = p.parse_args(argv)
    wanted = args.optimizers.split(",")
    rows = []
    for optimizer in wanted:
        for engine, flags in ENGINES.items():
            rows.append(row(optimizer, engine, flags))
            print(rows[-1], flush=True)
        for (name, engine), flags in EXTRA.items():
            if name == optimizer:
                rows.append(row(optimizer, engine, flags))
                print(rows[-1], flush=True)
    head = (
        "<!-- generated by experiments/optimizer_table.py -->\n\n"
        "# Each optimizer under each engine: update bytes and memory\n\n"
        f"Machine: {machine_line()}.\n\n"
        + __doc__.split("\n\n", 2)[2].split("\n\nWrites")[0]
        + "\n\n"
    )
    write_table(args.out, "optimizer_table", head, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
