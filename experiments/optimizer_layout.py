"""Cost of the optimizer's model-shaped view: the stored layout 2 (whole rows) against 1.

    python experiments/optimizer_layout.py            # trainer GPT (compiles 2 steps) + 1.3b
    python experiments/optimizer_layout.py --no-compile --out /tmp/t   # shapes only

Layout 1 padded each stacked leaf's layer (and each tensor-parallel slice) in values to a
multiple of the device count `N` and ran the optimizer on that padded layout; layout 2
pads whole rows, so that the optimizer's model-shaped view is a crop of each device's rows
(`zeropp_jax.state._optimizer_view`). Per model and device count, from the parameter shapes
alone: stored values, their padding, and the float32 master weights plus Adam's two
moments per device under each layout. The ZeRO collectives move each leaf's padded pieces,
so their bytes scale with the stored values: the measured ledger of a ZeRO++ step on
layout 2 (lowered program) is scaled by layout 1's stored values for the "layout 1" row.
For the trainer's GPT (2 x 4 mesh, ZeRO++ defaults) the compiled program's `update` phase
(collectives XLA inserts in the optimizer update, `comm_ledger(..., compiled=True)`) is
measured for AdamW and Muon, against the forward and backward bytes of the same program.

Writes `optimizer_layout.md` and `optimizer_layout.csv` into `--out` (default
`experiments/results`).
"""

from __future__ import annotations

import argparse
import pathlib

import _engines
from _common import machine_line, request_cpu_devices, study_dir, write_table

request_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _library import partition as part  # noqa: E402

import zeropp_jax as zpp  # noqa: E402
from zeropp_jax.train import cli, optimizers  # noqa: E402
from zeropp_jax.train.flags import gpt_config, parse_args  # noqa: E402
from zeropp_jax.train.model import GPT, init_fn, param_count  # noqa: E402

MB = 1e6


def stored_values(shapes, n: int, version: int) -> tuple[int, float]:
    """Stored values of all leaves, and the largest per-device share in float32 bytes of
    master + 2 Adam moments (`3 * 4` bytes per stored value; replicated leaves whole)."""
    total, per_device = 0, 0.0
    for x in jax.tree_util.tree_leaves(shapes):
        lo = part.leaf_layout("p", x, n)
        lo = part.with_devices(lo, n, version=version)
        total += lo.padded_size
        per_device += 12 * (lo.padded_size / n if lo.sharded else lo.size)
    return total, per_device


def step_bytes(flags: list[str], optimizer: str, compiled: bool):
    """The ZeRO++ step's ledger on a 2 x 4 mesh (lowered, or compiled)."""
    args = parse_args([*flags, "--optimizer", optimizer])
    gpt = gpt_config(args)
    state, make_step = _engines.build(
        "ZeRO++",
        apply_fn=GPT(gpt).apply,
        params=init_fn(gpt, 0),
        tx=optimizers.make_optimizer(args),
        mesh=zpp.make_mesh(2, 4),
        abstract=True,
        donate=False,
    )
    batch = jax.ShapeDtypeStruct((args.batch, gpt.seq_len + 1), np.int32)
    return zpp.comm_ledger(make_step(cli.train_step), state, batch, compiled=compiled)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=study_dir("optimizer_layout"))
    p.add_argument("--no-compile", action="store_true", help="skip the compiled ledgers")
    args = p.parse_args(argv)
    models = {"trainer GPT (tiny, scanned)": [], "1.3b": ["--model", "1.3b"]}
    rows = []
    for name, flags in models.items():
        gpt = gpt_config(parse_args(flags))
        shapes = jax.eval_shape(init_fn(gpt, 0))
        shapes = jax.tree_util.tree_map(lambda x: getattr(x, "value", x), shapes)
        count = param_count(gpt)
        ledger = step_bytes(flags, "adamw", compiled=False) if name.startswith("trainer") else None
        for n in (8, 64):
            stored = {v: stored_values(shapes, n, v) for v in (1, 2)}
            for version in (1, 2):
                values, per_device = stored[version]
                row = {
                    "model": name,
                    "params": count,
                    "devices": n,
                    "layout": version,
                    "stored values": values,
                    "padding %": f"{100 * (values / count - 1):.2f}",
                    "master+Adam MB/device": f"{per_device / MB:.3f}",
                    "ZeRO++ MB/step/device": "",
                }
                if ledger is not None and n == 8:
                    total = sum(r.bytes_sent for r in ledger.records)
                    scale = values / stored[2][0]
                    row["ZeRO++ MB/step/device"] = f"{total * scale / MB:.3f}"
                rows.append(row)
    head = (
        "# The optimizer's model-shaped view: stored layout 2 against 1\n\n"
        f"{machine_line()}\n\n"
        "Command: `python experiments/optimizer_layout.py`. Master weights and Adam "
        "moments in float32 per device (the largest share), from shapes; ZeRO++ bytes per "
        "step per device from the lowered ledger of the trainer's GPT on a 2 x 4 mesh "
        "(layout 1: scaled by its stored values).\n\n"
    )
    if not args.no_compile:
        flags = models["trainer GPT (tiny, scanned)"]
        lines = []
        for optimizer in ("adamw", "muon"):
            led = step_bytes(flags, optimizer, compiled=True)
            update = sum(r.bytes_sent for r in led.records if r.phase == "update")
            fwd_bwd = sum(r.bytes_sent for r in led.records if r.phase != "update")
            lines.append(
                f"- {optimizer}: update phase {update / MB:.3f} MB per step per device "
                f"({update / fwd_bwd:.2f} x the forward and backward's {fwd_bwd / MB:.3f} MB), "
                "compiled program, ZeRO++ defaults, 2 x 4 mesh."
            )
            print(lines[-1], flush=True)
        head += "Optimizer update (collectives XLA inserts):\n\n" + "\n".join(lines) + "\n\n"
    write_table(args.out, "optimizer_layout", head, rows)


if __name__ == "__main__":
    main()
