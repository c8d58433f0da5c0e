"""The model's own remat under each engine: the scanned trainer GPT with `--remat none |
matmuls | full`, compiled temporaries and flops per device, and step time.

    python experiments/remat_table.py            # zeropp-train's default GPT (minutes)
    python experiments/remat_table.py --quick    # d_model 64, 2 layers
    python experiments/remat_table.py --remat none --remat full --engine ZeRO-3

For each remat policy (`GPTConfig.remat`, `nn.remat` around the scanned block) and engine,
compiles one training step of the GPT that `zeropp-train` trains by default
(`PRESETS["tiny"]` with `scan=True`: d_model 128, 4 layers, 4 heads, sequence 128, 256
tokens; global batch 32, AdamW, bfloat16 compute) and reads per device:
`compiled.memory_analysis()`'s temporaries, and the compiled cost analysis's flops (XLA
counts a loop's body once, whatever its trip count: compare rows, not totals). Then runs
`--steps` steps and takes the median step time after the first. Engines
(`_engines.COMPARED`): plain one-device training of the per-device batch (`jax.jit`,
nothing sharded), XLA's FSDP (`zeropp_jax.baselines`), our ZeRO-3 and ZeRO++ through
`zpp.shard`, on a 2 x 4 mesh of emulated CPU devices; every engine runs the same policy.
No XLA flag other than the device count. Writes `remat_table{,_quick}.{md,csv}` into
`--out` (default `experiments/results/remat_table/`), with, per engine, `none`'s flops against
`full`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.request_cpu_devices(8)

import jax  # noqa: E402
from _engines import COMPARED, compiled_step  # noqa: E402

from zeropp_jax.train.model import PRESETS, REMAT, GPTConfig  # noqa: E402

BATCH = 32


def measure(engine: str, cfg: GPTConfig, steps: int) -> dict[str, float]:
    """Temporaries (MB per device), flops per device and the median step time (ms) of
    one engine."""
    compiled, state, batch = compiled_step(engine, cfg, BATCH)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - start)
    return {
        "temp_MB": round(compiled.memory_analysis().temp_size_in_bytes / 1e6, 2),
        "flops_M": round(compiled.cost_analysis()["flops"] / 1e6, 2),
        "step_ms": round(1e3 * statistics.median(times[1:]), 1),
    }


def flops_check(rows: list[dict]) -> str:
    """Per engine measured under both, `none`'s flops against `full`'s (fewer: the backward
    recomputes nothing)."""
    by = {(r["remat"], r["engine"]): r["flops_M"] for r in rows}
    lines = []
    for engine in COMPARED:
        if ("none", engine) in by and ("full", engine) in by:
            none, full = by["none", engine], by["full", engine]
            verdict = "fewer" if none < full else "NOT fewer"
            lines.append(
                f"- {engine}: `none` {none} M flops, `full` {full} M ({verdict}; "
                f"{100 * (full - none) / full:.1f}% of `full`'s saved)\n"
            )
    return "".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="d_model 64, 2 layers")
    p.add_argument("--remat", action="append", choices=REMAT, help="default: all three")
    p.add_argument("--engine", action="append", choices=COMPARED, help="default: all four")
    p.add_argument("--steps", type=int, default=6, help="steps timed per row (first dropped)")
    p.add_argument("--out", default=str(_common.study_dir("remat_table")))
    args = p.parse_args(argv)
    machine = _common.machine_line()  # before this run writes anything into the tree
    base = dataclasses.replace(PRESETS["tiny"], scan=True)
    if args.quick:
        base = dataclasses.replace(base, d_model=64, n_layers=2)
    rows = []
    for remat in args.remat or REMAT:
        cfg = dataclasses.replace(base, remat=remat)
        for engine in args.engine or COMPARED:
            row = {"remat": remat, "engine": engine, **measure(engine, cfg, args.steps)}
            print(row, flush=True)
            rows.append(row)
    name = "remat_table_quick" if args.quick else "remat_table"
    head = (
        f"# The model's own remat under each engine\n\n{machine}.\n\n"
        f"Trainer's GPT, `nn.scan` over {base.n_layers} blocks, d_model {base.d_model}, "
        f"{base.n_heads} heads, vocabulary {base.vocab_size}, global batch {BATCH}, "
        f"sequence {base.seq_len}, AdamW, bfloat16 compute, 2 x 4 mesh of emulated CPU devices "
        "(one device: the per-device batch, unsharded), `--remat` the policy of `nn.remat` "
        "around each block under every engine. `temp_MB`: compiled temporaries per device. "
        "`flops_M`: the compiled cost analysis's flops per device (a loop's body counted "
        f"once). `step_ms`: median of {args.steps - 1} steps after the first. No XLA flags "
        "but the device count.\n\n"
    )
    check = flops_check(rows)
    if check:
        head += f"Under each engine, `none` against `full` (flops per device):\n\n{check}\n"
    _common.write_table(pathlib.Path(args.out), name, head, rows)
    return rows


if __name__ == "__main__":
    main()
