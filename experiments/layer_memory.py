"""Compiled memory per device of the trainer's GPT, unrolled and scanned: gathering at use.

    python experiments/layer_memory.py                 # d_model 512, 4 and 8 layers (minutes)
    python experiments/layer_memory.py --quick         # d_model 64, 2 and 4 layers
    python experiments/layer_memory.py --remat full    # every engine recomputes each block

For each layout (unrolled blocks, `nn.scan` over stacked blocks) and depth, compiles one
training step (AdamW, bfloat16 compute, global batch 16, sequence 128, the GPT's remat
policy `--remat`, the same under every engine) and reads `compiled.memory_analysis()` per
device under each engine of `_engines.COMPARED`: plain one-device training of the same
per-device batch (`jax.jit`, nothing sharded), XLA's own FSDP (`zeropp_jax.baselines`:
`jax.jit` with the parameters and optimizer state sharded over all devices), our ZeRO-3
and ZeRO++ through `zpp.shard`, on a 2 x 4 mesh. No XLA flag other than the emulated
device count is set: XLA:CPU's default scheduler runs. Reports temp and argument bytes,
the temp added per added layer in units of one layer's full bfloat16 weights, and the
whole model's full bfloat16 weights. Compile only; no step runs. Writes
`layer_memory{,_quick}.{md,csv}` into `--out` (default `experiments/results/layer_memory/`).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.request_cpu_devices(8)

from _engines import COMPARED, compiled_step  # noqa: E402

from zeropp_jax.train.model import REMAT, GPTConfig  # noqa: E402

BATCH = 16


def compiled_memory(engine: str, cfg: GPTConfig) -> dict[str, int]:
    """Per-device temp and argument bytes of one compiled step."""
    analysis = compiled_step(engine, cfg, BATCH)[0].memory_analysis()
    return {
        "temp": int(analysis.temp_size_in_bytes),
        "args": int(analysis.argument_size_in_bytes),
    }


def layer_bytes(cfg: GPTConfig) -> int:
    """One block's full weights in bfloat16."""
    d = cfg.d_model
    per_block = 3 * d * d + 3 * d + d * d + d + 2 * cfg.mlp_ratio * d * d + cfg.mlp_ratio * d
    return 2 * (per_block + d * 5)


def model_bytes(cfg: GPTConfig) -> int:
    d = cfg.d_model
    return cfg.n_layers * layer_bytes(cfg) + 2 * (cfg.vocab_size * d + cfg.seq_len * d + 2 * d)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="d_model 64, 2 and 4 layers")
    p.add_argument(
        "--remat",
        choices=REMAT,
        default="none",
        help="the GPT's remat policy, the same under every engine (none)",
    )
    p.add_argument("--out", default=str(_common.study_dir("layer_memory")))
    args = p.parse_args(argv)
    machine = _common.machine_line()  # before this run writes anything into the tree
    d_model, depths = (64, (2, 4)) if args.quick else (512, (4, 8))
    base = GPTConfig(d_model=d_model, n_heads=8, seq_len=128, remat=args.remat)
    rows = []
    for scan in (False, True):
        measured = {}
        for engine in COMPARED:
            for depth in depths:
                cfg = dataclasses.replace(base, n_layers=depth, scan=scan)
                measured[engine, depth] = compiled_memory(engine, cfg)
                print(engine, "scan" if scan else "unrolled", depth, measured[engine, depth])
        lo, hi = depths
        layer = layer_bytes(base)
        for engine in COMPARED:
            added = (measured[engine, hi]["temp"] - measured[engine, lo]["temp"]) / (hi - lo)
            deep = dataclasses.replace(base, n_layers=hi)
            rows.append(
                {
                    "layout": "nn.scan" if scan else "unrolled",
                    "engine": engine,
                    "remat": args.remat,
                    "layers": hi,
                    "temp_MB": round(measured[engine, hi]["temp"] / 1e6, 2),
                    "args_MB": round(measured[engine, hi]["args"] / 1e6, 2),
                    "temp_per_added_layer_in_layers": round(added / layer, 3),
                    "temp_over_full_model": round(
                        measured[engine, hi]["temp"] / model_bytes(deep), 3
                    ),
                }
            )
    out = pathlib.Path(args.out)
    name = "layer_memory_quick" if args.quick else "layer_memory"
    _common.write_csv(out / f"{name}.csv", rows)
    head = list(rows[0])
    text = (
        f"# Compiled memory per device: gathering at use\n\n{machine}."
        f"\n\nTrainer's GPT, d_model {d_model}, "
        f"{depths[0]} and {depths[1]} layers, global batch {BATCH}, sequence 128, AdamW, "
        "bfloat16 compute, 2 x 4 mesh (one device: the per-device batch, unsharded), "
        f"remat `{args.remat}` (`nn.remat` around each block) under every engine. "
        "`temp_per_added_layer_in_layers`: temp added per added layer over one layer's full "
        "bfloat16 weights. `temp_over_full_model`: temp over the whole model's full "
        "bfloat16 weights. No XLA flags.\n\n"
        + _common.markdown_table(head, [list(r.values()) for r in rows])
    )
    _common.write_text(out / f"{name}.md", text)
    _common.say_written([out / f"{name}.md", out / f"{name}.csv"])
    return rows


if __name__ == "__main__":
    main()
