"""Helpers shared by the test files: a small MLP, its training step and batches, and the
engine built around them (tests/test_beyond.py, tests/test_rotation.py)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zeropp_jax as zpp


class Net(nn.Module):
    """11 -> 37 (tanh) -> 3: two kernels whose sizes fill no quantization block evenly."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jnp.tanh(nn.Dense(37)(x)))


def train_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def batch(seed: int) -> dict[str, np.ndarray]:
    """A global batch of 16 rows (2 per device on 8 devices), fixed by `seed`."""
    rs = np.random.RandomState(seed)
    x = rs.randn(16, 11).astype(np.float32)
    return {"x": x, "y": np.tanh(x[:, :3])}


def engine(config: zpp.ZeroPPConfig, mesh_shape: tuple[int, int] = (2, 4)):
    """`Net`'s `zpp.TrainState` (SGD, learning rate 0.1) under `config` on a
    `mesh_shape` ('node', 'local') mesh, and its sharded `train_step`."""
    mesh = zpp.make_mesh(*mesh_shape)
    params = Net().init(jax.random.key(0), batch(0)["x"])["params"]
    state = zpp.TrainState.create(
        apply_fn=Net().apply, params=params, tx=optax.sgd(0.1), mesh=mesh, config=config
    )
    return state, zpp.shard(train_step, mesh=mesh, config=config)
