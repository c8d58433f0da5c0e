"""The model's own remat under each engine: the scanned trainer GPT with `--remat none |
matmuls | full`, compiled temporaries per device and step time.

    nice -n 10 python experiments/remat_table.py            # d_model 256, 4 layers
    nice -n 10 python experiments/remat_table.py --quick    # d_model 64, 2 layers
    python experiments/remat_table.py --remat none --remat full

For each remat policy (`GPTConfig.remat`, `nn.remat` around the scanned block) and engine,
compiles one training step (AdamW, bfloat16 compute, global batch 16, sequence 128, `nn.scan`
over the blocks) and reads per device: `compiled.memory_analysis()`'s temporaries, and
the compiled cost analysis's flops (XLA counts a loop's body once, whatever its trip
count: compare rows, not totals). Then runs `--steps` steps and takes the median step
time after the first. Engines: plain one-device training of the per-device batch
(`jax.jit`, nothing sharded), XLA's FSDP (`zeropp_jax.baselines`), our ZeRO-3 and ZeRO++
through `zpp.shard`, on a 2 x 4 mesh of emulated CPU devices; every engine runs the same
policy. No XLA flag other than the device count. Writes `remat_table{,_quick}.{md,csv}`
into `--out` (default `experiments/results`).
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import zeropp_jax as zpp  # noqa: E402
from zeropp_jax import baselines  # noqa: E402
from zeropp_jax.train.model import GPT, REMAT, GPTConfig, loss_fn  # noqa: E402

BATCH = 16
ENGINES = ("one device", "XLA FSDP", "ZeRO-3", "ZeRO++")


def train_step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def measure(engine: str, cfg: GPTConfig, steps: int) -> dict[str, float]:
    """Temporaries (MB per device), flops per device and the median step time (ms) of
    one engine."""
    model = GPT(cfg)
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    rs = np.random.RandomState(0)
    batch = rs.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1)).astype(np.int32)
    tx = optax.adamw(1e-3)
    if engine == "one device":
        bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
        state = train_state.TrainState.create(apply_fn=model.apply, params=bf16, tx=tx)
        batch = batch[: BATCH // 8]
        compiled = jax.jit(train_step, donate_argnums=0).lower(state, batch).compile()
    elif engine == "XLA FSDP":
        mesh = zpp.make_mesh(2, 4)
        state = baselines.xla_fsdp_state(apply_fn=model.apply, params=params, tx=tx, mesh=mesh)
        compiled = baselines.xla_fsdp_step(train_step, state, mesh).lower(state, batch).compile()
    else:
        config = zpp.ZeroPPConfig.zero3() if engine == "ZeRO-3" else zpp.ZeroPPConfig()
        mesh = zpp.make_mesh(2, 4)
        state = zpp.TrainState.create(
            apply_fn=model.apply, params=params, tx=tx, mesh=mesh, config=config
        )
        compiled = zpp.shard(train_step, donate_state=True).lower(state, batch).compile()
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


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="d_model 64, 2 layers")
    p.add_argument("--remat", action="append", choices=REMAT, help="default: all three")
    p.add_argument("--steps", type=int, default=6, help="steps timed per row (first dropped)")
    p.add_argument("--out", default=str(_common.RESULTS))
    args = p.parse_args(argv)
    machine = _common.machine_line()  # before this run writes anything into the tree
    d_model, layers = (64, 2) if args.quick else (256, 4)
    base = GPTConfig(d_model=d_model, n_layers=layers, n_heads=4, seq_len=128, scan=True)
    rows = []
    for remat in args.remat or REMAT:
        cfg = dataclasses.replace(base, remat=remat)
        for engine in ENGINES:
            row = {"remat": remat, "engine": engine, **measure(engine, cfg, args.steps)}
            print(row, flush=True)
            rows.append(row)
    name = "remat_table_quick" if args.quick else "remat_table"
    head = (
        f"# The model's own remat under each engine\n\n{machine}.\n\n"
        f"Trainer's GPT, `nn.scan` over {layers} blocks, d_model {d_model}, global batch "
        f"{BATCH}, sequence 128, AdamW, bfloat16 compute, 2 x 4 mesh of emulated CPU devices "
        "(one device: the per-device batch, unsharded), `--remat` the policy of `nn.remat` "
        "around each block under every engine. `temp_MB`: compiled temporaries per device. "
        "`flops_M`: the compiled cost analysis's flops per device (a loop's body counted "
        f"once). `step_ms`: median of {args.steps - 1} steps after the first. No XLA flags "
        "but the device count.\n\n"
    )
    _common.write_table(pathlib.Path(args.out), name, head, rows)
    return rows


if __name__ == "__main__":
    main()
