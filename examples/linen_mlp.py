"""Train a Flax linen model with ZeRO++: the ordinary Flax train_step, wrapped by zpp.shard.

Run: python -m examples.linen_mlp   (uses 8 emulated CPU devices when no accelerator is found)
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zeropp_jax as zpp


class MLP(nn.Module):
    hidden: int = 64

    @nn.compact
    def __call__(self, x, *, train: bool = False):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.Dropout(0.1, deterministic=not train)(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(1)(x)


def train_step(state, batch, rng):
    """Ordinary Flax: value_and_grad of a loss that calls state.apply_fn, then apply_gradients."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"], train=True, rngs={"dropout": rng})
        return jnp.mean((pred[:, 0] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def main(steps: int = 100, num_nodes: int = 2) -> float:
    mesh = zpp.make_mesh(num_nodes=num_nodes)
    config = zpp.ZeroPPConfig()  # ZeRO++: int8 weights, hpZ, int4 gradients
    rs = np.random.RandomState(0)
    x = rs.randn(64, 16).astype(np.float32)
    batch = {"x": x, "y": np.sin(x.sum(axis=1)).astype(np.float32)}
    model = MLP()
    params = model.init(jax.random.key(0), x)["params"]
    state = zpp.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(3e-3), mesh=mesh, config=config
    )
    step = zpp.shard(
        lambda s, b: train_step(s, b, jax.random.fold_in(jax.random.key(1), s.step)),
        mesh=mesh,
        config=config,
    )
    for _ in range(steps):
        state, metrics = step(state, batch)
    print(f"final loss {float(metrics['loss']):.4f}")
    return float(metrics["loss"])


if __name__ == "__main__":
    main()
