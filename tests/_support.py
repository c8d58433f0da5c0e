"""Helpers shared by the test files: a small MLP, its training step and batches, and the
engine built around them (tests/test_beyond.py, tests/test_rotation.py); regression
batches (tests/test_engine_pallas.py, tests/test_optimizer_shapes.py); one ZeRO++ step on
the sum of a model's output, and the quantizers' bounds on what it sees and reduces
(tests/test_layered_scan.py, tests/test_params_pytrees.py); the trainer GPT's abstract
state (tests/test_plan.py, tests/test_memory.py); running a function on each device's
slice, random shards and the quantizer's steps (tests/test_collectives.py,
tests/test_reductions.py, tests/test_reliability.py); one-device gradients in the
stored layout (tests/test_optimizer_shapes.py, tests/test_distributed_muon.py); a model
trained sharded beside one device (tests/test_optimizer_shapes.py,
tests/test_partition.py)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax.state import _partition as part
from zeropp_jax.train.model import GPT, GPTConfig, init_fn, loss_fn
from zeropp_jax.wire.quant import qmax


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


def trained_beside_one_device(
    model: nn.Module, params: Any, tx: Any, mesh: Any, config: Any, batches: list
) -> tuple[Any, Any]:
    """`zpp.shard(train_step)` on `mesh` and `jax.jit(train_step)` on one device, from the
    same `params`, one step per batch, the losses equal to `rtol` 1e-5 at every step;
    returns `(sharded state, one-device state)` for the caller to compare the weights."""
    from flax.training import train_state

    ref = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    state = zpp.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx, mesh=mesh, config=config
    )
    ref_step, step = jax.jit(train_step), zpp.shard(train_step)
    for b in batches:
        ref, want = ref_step(ref, b)
        state, got = step(state, b)
        np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5)
    return state, ref


def regression_batches(n: int, size: int, y_width: int) -> list[dict[str, np.ndarray]]:
    """`n` global batches of `size` rows: 10 standard normal inputs `x` and `y_width`
    standard normal targets `y`, drawn in turn from one stream of seed 0."""
    rs = np.random.RandomState(0)
    return [
        {
            "x": rs.randn(size, 10).astype(np.float32),
            "y": rs.randn(size, y_width).astype(np.float32),
        }
        for _ in range(n)
    ]


def sum_step(state, x):
    """A step on the sum of the model's output (its gradient is 1 at every output); the
    metrics hold the output."""
    out = state.apply_fn({"params": state.params}, x)
    grads = jax.grad(lambda p: jnp.sum(state.apply_fn({"params": p}, x)))(state.params)
    return state.apply_gradients(grads=grads), {"out": out}


def zeropp_sum_step(apply_fn: Callable[..., Any], params: Any, x: np.ndarray):
    """One sharded `sum_step` under ZeRO++'s defaults in float32 compute, SGD at learning
    rate 1, on a 2x4 mesh, with every warning an error (nothing falls back to a whole-leaf
    gather). Returns the new state and the metrics."""
    config = zpp.ZeroPPConfig(compute_dtype=jnp.float32)
    state = zpp.TrainState.create(
        apply_fn=apply_fn, params=params, tx=optax.sgd(1.0), mesh=zpp.make_mesh(2, 4), config=config
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return zpp.shard(sum_step)(state, x)


def int8_gather_bound(w: np.ndarray) -> float:
    """How far an int8-gathered `w` may be from `w`: half a step of the largest block."""
    return np.max(np.abs(w)) / qmax(8) / 2 * (1 + 2.0**-15) + 1e-7


def ones_int4_two_hop_bound() -> float:
    """How far a gradient of 1 per entry, reduced by ZeRO++'s int4 two-hop reduction on a
    2x4 mesh from 2 rows per device (each row contributing 0 or 1), may be from 1 (less
    the 1e-5 of float32 sums the callers add). Hop 1 quantizes each of a node's 4
    contributions (half a step of at most 1 / q each), hop 2 each node's partial sum (at
    most 1 plus its hop-1 error)."""
    q4 = qmax(4) / (1 + 2.0**-15)
    hop1 = 4 * (1.0 / q4) / 2
    hop2 = 2 * ((1.0 + hop1) / q4) / 2
    return hop1 + hop2


_FUSION_EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")
XLA_DEFAULTS = {"xla_backend_optimization_level": 3} | (
    {"xla_cpu_use_fusion_emitters": True} if _FUSION_EMITTERS_OFF else {}
)
"""What conftest's XLA_FLAGS change, back at XLA's defaults, for the compiles whose memory a
test measures (the fusion emitters only where conftest turned them off: jaxlib 0.11.2 and
newer have no such option and always use them)."""


def abstract_gpt_state(gpt: GPTConfig, config: zpp.ZeroPPConfig) -> zpp.TrainState:
    """The abstract `zpp.TrainState` (shapes and shardings only) of the trainer's
    `GPT(gpt)`, AdamW at learning rate 1e-3, under `config` on a 2x4 mesh."""
    return zpp.TrainState.abstract(
        apply_fn=GPT(gpt).apply,
        params=init_fn(gpt, 0),
        tx=optax.adamw(1e-3),
        mesh=zpp.make_mesh(2, 4),
        config=config,
    )


def gpt_step_temp(
    gpt: GPTConfig, config: zpp.ZeroPPConfig, compiler_options: dict | None = None
) -> int:
    """Temporary bytes per device of one training step of the trainer's `GPT(gpt)` (its
    loss, AdamW; 8 sequences) under `config` on a 2x4 mesh, compiled from shapes with
    `compiler_options` (None: the suite's XLA flags)."""

    def step_fn(state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads=grads), loss

    batch = jax.ShapeDtypeStruct((8, gpt.seq_len + 1), jnp.int32)
    lowered = zpp.shard(step_fn, donate_state=True).lower(abstract_gpt_state(gpt, config), batch)
    return lowered.compile(compiler_options=compiler_options).memory_analysis().temp_size_in_bytes


def per_device(mesh, fn, x, *extra):
    """Runs `fn` on each device's slice `x[n, l]` of `x` `(Nn, L, ...)`; returns
    `(Nn, L, ...)` of per-device results."""

    def body(xs, *es):
        out = fn(xs[0, 0], *(e[0, 0] for e in es))
        return out[None, None]

    spec = P("node", "local")
    f = jax.shard_map(
        body, mesh=mesh, in_specs=(spec,) * (1 + len(extra)), out_specs=spec, check_vma=False
    )
    return np.asarray(jax.jit(f)(x, *extra))


def rand(shape, seed=0, dtype=jnp.float32, heavy=False):
    k = jax.random.key(seed)
    x = jax.random.t(k, 2.0, shape) if heavy else jax.random.normal(k, shape)
    return x.astype(dtype)


# The quantizer rounds each scale `absmax / qmax` up to 16 significant bits (so that every
# `q * scale` is exact in float32), which makes a step up to a factor `1 + 2**-15` larger;
# the steps below carry that factor (float32 rounding of the quotient is covered by the
# relative slack of each bound, as it was before the rounding).
SCALE_ROUNDING = 1 + 2.0**-15


def block_steps(shard, bits, block_size):
    """Per-value quantization step (an upper bound: see `SCALE_ROUNDING`) of a shard
    quantized on its own (numpy, float64)."""
    flat = np.asarray(shard, np.float64).reshape(-1)
    pad = (-flat.size) % block_size
    b = np.pad(flat, (0, pad)).reshape(-1, block_size)
    steps = np.abs(b).max(axis=1, keepdims=True) / qmax(bits) * SCALE_ROUNDING
    return np.broadcast_to(steps, b.shape).reshape(-1)[: flat.size].reshape(np.shape(shard))


def stored_grads(grads, state):
    """One-device gradients (model shapes) -> the stored layout the step hands
    `apply_gradients`, sharded like the parameters."""
    leaves = jax.tree_util.tree_leaves(grads)
    return jax.tree_util.tree_unflatten(
        state.layouts[0],
        [
            jax.device_put(part.to_master(g, lo), p.sharding)
            for g, lo, p in zip(
                leaves, state.layouts[1], jax.tree_util.tree_leaves(state.params), strict=True
            )
        ],
    )
