"""Train a Flax NNX model with ZeRO++ through nnx.split / nnx.merge.

The TrainState holds the NNX parameter state; `apply_fn` merges it back into the module.
Run: python -m examples.nnx_mlp
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zeropp_jax as zpp


class MLP(nnx.Module):
    def __init__(self, din: int, hidden: int, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(din, hidden, rngs=rngs)
        self.norm = nnx.LayerNorm(hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.norm(nnx.relu(self.l1(x))))


def make_apply(graphdef):
    """An `apply_fn(variables, x)` for the TrainState: merge the parameters, call."""

    def apply_fn(variables, x):
        return nnx.merge(graphdef, variables["params"])(x)

    return apply_fn


def train_step(state, batch):
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred[:, 0] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def main(steps: int = 100, num_nodes: int = 2) -> float:
    mesh = zpp.make_mesh(num_nodes=num_nodes)
    config = zpp.ZeroPPConfig()
    rs = np.random.RandomState(0)
    x = rs.randn(64, 16).astype(np.float32)
    batch = {"x": x, "y": np.sin(x.sum(axis=1)).astype(np.float32)}
    graphdef, params = nnx.split(MLP(16, 64, rngs=nnx.Rngs(0)), nnx.Param)
    state = zpp.TrainState.create(
        apply_fn=make_apply(graphdef), params=params, tx=optax.adam(3e-3), mesh=mesh, config=config
    )
    step = zpp.shard(train_step, mesh=mesh, config=config)
    for _ in range(steps):
        state, metrics = step(state, batch)
    print(f"final loss {float(metrics['loss']):.4f}")
    return float(metrics["loss"])


if __name__ == "__main__":
    main()
