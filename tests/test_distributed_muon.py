"""`zeropp_jax._distributed_muon`: optax's Muon with each matrix gathered once for Newton-Schulz.

Every format against the same `muon` on one device (the format's rounding is part of the
optimizer, so a sharded update equals it to float summation order), float32 against
`optax.contrib.muon` exactly, and the compiled update's collectives: each matrix gathered
once, in the format's dtype, across nodes first."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _support import regression_batches, stored_grads
from flax.training import train_state
from optax.contrib import MuonDimensionNumbers

import zeropp_jax as zpp
from zeropp_jax import _distributed_muon as muon_lib
from zeropp_jax.state._partition import view_split
from zeropp_jax.wire.quant import qmax

EXACT = dict(weight_bits=None, grad_bits=None, compute_dtype=jnp.float32)


class Net(nn.Module):
    """Dense(60) and two `nn.scan` blocks of Dense(60) (stacked kernels), Dense(10): no
    axis of any kernel fits 8 devices, so each is stored split over two axes on 2 x 4 (a 60
    over the 4 local devices, the other axis over the 2 nodes; the stacked ones per
    layer)."""

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(60)(x))

        class Block(nn.Module):
            @nn.compact
            def __call__(self, h, _):
                return jnp.tanh(nn.Dense(60)(h)), None

        h, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()(
            h, None
        )
        return nn.Dense(10)(h)


def dims(params):
    """Newton-Schulz on each kernel (a stacked one per layer), AdamW on the biases."""
    by_rank = {2: MuonDimensionNumbers(0, 1), 3: MuonDimensionNumbers(1, 2)}
    return jax.tree_util.tree_map_with_path(
        lambda path, p: by_rank[p.ndim] if path[-1].key == "kernel" else None, params
    )


def loss_fn(params, apply_fn, batch):
    return jnp.mean((apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def setup():
    data = regression_batches(3, 64, 10)
    params = Net().init(jax.random.key(1), data[0]["x"])["params"]
    grad_fn = jax.jit(jax.grad(loss_fn), static_argnums=1)
    return data, params, grad_fn


def one_device(tx, params, data, grad_fn):
    state = train_state.TrainState.create(apply_fn=Net().apply, params=params, tx=tx)
    step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    grads = []
    for b in data:
        grads.append(grad_fn(state.params, Net().apply, b))
        state = step(state, grads[-1])
    return state, grads


def test_float32_is_optax_muon_exactly(setup):
    data, params, grad_fn = setup
    kw = dict(weight_decay=0.1, muon_weight_dimension_numbers=dims, adam_b2=0.95)
    ours, _ = one_device(zpp.muon(1e-2, gather_format="float32", **kw), params, data, grad_fn)
    theirs, _ = one_device(optax.contrib.muon(1e-2, **kw), params, data, grad_fn)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("fmt", muon_lib.GATHER_FORMATS)
def test_sharded_update_matches_one_device(setup, fmt):
    """Three updates from the same one-device gradients, on 2 x 4: the engine's update
    (model-shaped views, each matrix gathered once) against the same `muon` on one
    device."""
    data, params, grad_fn = setup
    tx = zpp.muon(1e-2, muon_weight_dimension_numbers=dims, gather_format=fmt)
    ref, grads = one_device(tx, params, data, grad_fn)
    state = zpp.TrainState.create(
        apply_fn=Net().apply,
        params=params,
        tx=tx,
        mesh=zpp.make_mesh(2, 4),
        config=zpp.ZeroPPConfig(**EXACT),
    )
    step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    for g in grads:
        state = step(state, stored_grads(g, state))
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(zpp.gather_params(state)),
        jax.tree.leaves(ref.params),
        strict=True,
    ):
        err = float(jnp.max(jnp.abs(got - want))) / float(jnp.max(jnp.abs(want)))
        assert err <= 1e-6, f"{fmt} {jax.tree_util.keystr(path)}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_gather_rounds_as_the_format_says(fmt):
    x = jax.random.normal(jax.random.key(0), (3, 37, 300), jnp.float32)
    got = muon_lib.gather_whole(x, fmt)
    assert got.shape == x.shape and got.dtype == jnp.float32
    if fmt == "bfloat16":
        np.testing.assert_array_equal(
            np.asarray(got), np.asarray(x.astype(jnp.bfloat16), np.float32)
        )
        return
    # Round to nearest: at most half a step per value, a step being its block's absmax / 127
    # (blocks of INT8_BLOCK values along the last axis; the last one is shorter).
    b = muon_lib.INT8_BLOCK
    xs = np.asarray(x)
    for lo in range(0, xs.shape[-1], b):
        part = xs[..., lo : lo + b]
        step = np.abs(part).max(axis=-1, keepdims=True) / qmax(8)
        err = np.abs(np.asarray(got)[..., lo : lo + b] - part)
        assert np.all(err <= 0.5 * step * (1 + 2**-7)), float((err / step).max())


def test_each_matrix_gathered_once_across_nodes_first(setup):
    """The compiled update on 2 x 4: optax's Muon gathers at every Newton-Schulz product;
    ours gathers each matrix once in the format's dtype (bfloat16 as uint16 bits; int8
    values and their float32 scales), across nodes first and then inside each node, so
    that each node link carries half of the matrix (the other node's half), once."""
    data, params, grad_fn = setup
    mesh = zpp.make_mesh(2, 4)
    kernels = [
        p for path, p in jax.tree_util.tree_leaves_with_path(params) if path[-1].key == "kernel"
    ]
    update, link = {}, {}
    for name, tx in {
        "optax": optax.contrib.muon(1e-2, muon_weight_dimension_numbers=dims),
        "bfloat16": zpp.muon(1e-2, muon_weight_dimension_numbers=dims),
        "int8": zpp.muon(1e-2, muon_weight_dimension_numbers=dims, gather_format="int8"),
    }.items():
        state = zpp.TrainState.create(
            apply_fn=Net().apply, params=params, tx=tx, mesh=mesh, config=zpp.ZeroPPConfig(**EXACT)
        )
        grads = jax.tree.map(jnp.zeros_like, state.params)
        step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
        led = zpp.comm_ledger(step, state, grads, compiled=True)
        update[name] = [r for r in led.records if r.phase == "update" and r.out_bytes > 64]
        link[name] = led.link_bytes_by("phase")[("update",)]
    bf16 = update["bfloat16"]
    assert all(r.op == "all-gather" and r.dtype == "uint16" for r in bf16), bf16
    # One gather per matrix and stage: over `node`, then over `local`.
    assert sorted(r.axes for r in bf16) == [("local",)] * len(kernels) + [("node",)] * len(kernels)
    # XLA gathers the view padded to a multiple of the devices that split the axis the
    # engine's view splits over `local` (`partition.view_split`: every kernel here is split
    # over two axes, a 60 over the 4 local devices and the other axis over the 2 nodes): the
    # inner stage ends with every (padded) matrix whole.
    splits = [view_split(k.shape, 8, 4) for k in kernels]
    assert splits == [(1, 4), (0, 4), (2, 4)], splits  # Dense_0 (10, 60), Dense_1, scanned
    padded = [
        k.size // k.shape[a] * -(-k.shape[a] // n) * n
        for k, (a, n) in zip(kernels, splits, strict=True)
    ]
    assert sum(r.out_bytes for r in bf16 if r.axes == ("local",)) == 2 * sum(padded)
    # Each node link carries the other node's half of every matrix, once, in 16 bits.
    assert link["bfloat16"] == sum(padded)
    int8 = [r for r in update["int8"] if r.op == "all-gather"]
    assert {r.dtype for r in int8} == {"int8", "float32"}
    assert sum(r.out_bytes for r in int8 if r.dtype == "int8" and r.axes == ("local",)) == sum(
        padded_int8(k) for k in kernels
    )
    assert link["int8"] < link["bfloat16"] < link["optax"] / 5, link


def padded_int8(kernel) -> int:
    """int8 bytes of a kernel's gather on 2 x 4, each row's values padded to a whole
    `INT8_BLOCK`: quantized where they are held and gathered as the view splits them where
    the engine stores the kernel over two axes (`partition.view_split` gives 4 devices),
    else gathered along its next-to-last axis, its rows padded to a multiple of 8."""
    shards = 1 if view_split(kernel.shape, 8, 4)[1] == 4 else 8
    rows = kernel.shape[kernel.ndim - 2]
    lead = kernel.size // (rows * kernel.shape[-1])
    block = min(muon_lib.INT8_BLOCK, kernel.shape[-1])
    cols = -(-kernel.shape[-1] // block) * block
    return lead * -(-rows // shards) * shards * cols


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="gather_format='fp16'.*expected one of"):
        zpp.muon(1e-3, gather_format="fp16")
