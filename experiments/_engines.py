"""One compiled training step of the trainer's GPT under each engine, for the scripts that
compare engines on the same model (`layer_memory.py`, `remat_table.py`).

Import `_common` and call `_common.request_cpu_devices(8)` before importing this module:
it imports jax.

Engines (`ENGINES`): plain one-device training of the per-device batch (`jax.jit`, nothing
sharded, the parameters in bfloat16), XLA's FSDP (`zeropp_jax.baselines`: the parameters
and optimizer state sharded over all devices, compute in bfloat16), our ZeRO-3 and ZeRO++
(`zpp.ZeroPPConfig.zero3()` and `zpp.ZeroPPConfig()`) through `zpp.shard`, each on a
2 x 4 mesh. Every engine runs the same `GPTConfig` (so the same remat policy), AdamW and
the same global batch, and donates its input state, as the trainer does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import zeropp_jax as zpp
from zeropp_jax import baselines
from zeropp_jax.train.model import GPT, GPTConfig, loss_fn

ENGINES = ("one device", "XLA FSDP", "ZeRO-3", "ZeRO++")
NODES, LOCAL = 2, 4


def train_step(state: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
    """The user's unchanged step: next-token loss of `batch` (tokens, `(B, seq + 1)`)."""
    loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def compiled_step(engine: str, cfg: GPTConfig, batch_size: int) -> tuple[Any, Any, np.ndarray]:
    """`(compiled step, state, batch)` of `engine` for `GPT(cfg)`: `batch_size` is the global
    batch (random tokens, seed 0); under "one device" the batch is one device's share of it
    (`batch_size / 8`) and nothing is sharded. The state's parameters are `GPT(cfg)`'s
    initialisation (seed 0); the step donates the state."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}; expected one of {ENGINES}.")
    model = GPT(cfg)
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    rs = np.random.RandomState(0)
    batch = rs.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1)).astype(np.int32)
    tx = optax.adamw(1e-3)
    if engine == "one device":
        bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
        state = train_state.TrainState.create(apply_fn=model.apply, params=bf16, tx=tx)
        batch = batch[: batch_size // (NODES * LOCAL)]
        compiled = jax.jit(train_step, donate_argnums=0).lower(state, batch).compile()
    elif engine == "XLA FSDP":
        mesh = zpp.make_mesh(NODES, LOCAL)
        state = baselines.xla_fsdp_state(apply_fn=model.apply, params=params, tx=tx, mesh=mesh)
        compiled = baselines.xla_fsdp_step(train_step, state, mesh).lower(state, batch).compile()
    else:
        config = zpp.ZeroPPConfig.zero3() if engine == "ZeRO-3" else zpp.ZeroPPConfig()
        mesh = zpp.make_mesh(NODES, LOCAL)
        state = zpp.TrainState.create(
            apply_fn=model.apply, params=params, tx=tx, mesh=mesh, config=config
        )
        compiled = zpp.shard(train_step, donate_state=True).lower(state, batch).compile()
    return compiled, state, batch
