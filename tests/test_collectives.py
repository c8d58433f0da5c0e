"""Collectives against unsharded references: exact when unquantized, within the quantizer's
analytic bound (half a step per value and quantization event) when quantized."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import block_steps, per_device, rand
from jax.sharding import PartitionSpec as P

from zeropp_jax import make_mesh
from zeropp_jax.wire import _encoding as wire
from zeropp_jax.wire import _weight_gather as W
from zeropp_jax.wire import collectives as C
from zeropp_jax.wire.quant import qmax

MESHES = [(2, 4), (4, 2), (1, 8), (8, 1)]
ROWS, COLS = 3, 5  # 15 values per shard: not a multiple of any block size used


def partition_order(x):
    """`(Nn, L, rows, ...)` per-device shards -> the global array in partition order."""
    nn, ll = x.shape[:2]
    return np.concatenate([np.asarray(x[n, l]) for l in range(ll) for n in range(nn)])


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unquantized_gathers_equal_lax(shape, dtype):
    mesh = make_mesh(*shape)
    nn, ll = shape
    x = rand((nn, ll, ROWS, COLS), dtype=dtype)
    full = partition_order(x)
    for axis in ("node", "local", ("node", "local")):
        got = per_device(
            mesh,
            lambda s, a=axis: C.all_gather_quantized(s, axis_name=a, bits=None, block_size=8),
            x,
        )
        ref = per_device(mesh, lambda s, a=axis: jax.lax.all_gather(s, a, tiled=True), x)
        np.testing.assert_array_equal(got, ref)
    got = per_device(mesh, lambda s: C.flat_all_gather(s, bits=None, block_size=8), x)
    sec_full = per_device(
        mesh,
        lambda s: jnp.concatenate(
            C.hierarchical_all_gather(s, bits=None, block_size=8, local_bits=None)
        ),
        x,
    )
    for n in range(nn):
        for l in range(ll):
            np.testing.assert_array_equal(got[n, l], full)
            np.testing.assert_array_equal(sec_full[n, l, nn * ROWS :], full)
            lo = l * nn * ROWS
            np.testing.assert_array_equal(sec_full[n, l, : nn * ROWS], full[lo : lo + nn * ROWS])


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("block_size", [8, 64])
def test_quantized_gathers_within_bound(shape, bits, block_size):
    mesh = make_mesh(*shape)
    nn, ll = shape
    x = rand((nn, ll, ROWS, COLS), seed=1, heavy=True)
    full = partition_order(x)
    # A shard of 15 values uses a block of 16 values at most (no padding to a huge block).
    eff = wire.effective_block_size(ROWS * COLS, block_size)
    assert eff == min(block_size, 16)
    steps = np.concatenate([block_steps(x[n, l], bits, eff) for l in range(ll) for n in range(nn)])
    bound = steps / 2 + np.abs(full) * 2.0**-22
    flat = per_device(mesh, lambda s: C.flat_all_gather(s, bits=bits, block_size=block_size), x)
    hier = per_device(
        mesh,
        lambda s: C.hierarchical_all_gather(s, bits=bits, block_size=block_size, local_bits=bits)[
            1
        ],
        x,
    )
    for out in (flat, hier):
        err = np.abs(out - full[None, None])
        assert np.all(err <= bound), float(np.max(err / bound))
    gathered = per_device(
        mesh,
        lambda s: C.all_gather_quantized(s, axis_name="local", bits=bits, block_size=block_size),
        x,
    )
    for n in range(nn):
        ref = np.concatenate([np.asarray(x[n, l]) for l in range(ll)])
        st = np.concatenate([block_steps(x[n, l], bits, eff) for l in range(ll)])
        assert np.all(np.abs(gathered[n, 0] - ref) <= st / 2 + np.abs(ref) * 2.0**-22)


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)])
@pytest.mark.parametrize("hierarchical", [False, True])
def test_gather_weight_gradient_equals_unsharded(shape, hierarchical):
    mesh = make_mesh(*shape)
    n = shape[0] * shape[1]
    spec = W.GatherSpec(
        hierarchical=hierarchical,
        weight_bits=None,
        weight_block_size=8,
        weight_stage2_bits=None,
        grad_bits=None,
        grad_block_size=8,
        grad_hop2_bits=None,
        grad_hop2_block_size=8,
        two_hop=hierarchical,
        dtype=jnp.dtype(jnp.float32),
    )
    w = rand((n * 2, 6), seed=5)
    xs = rand((n * 3, 2 * n), seed=6)

    def island(w_shard, x_shard):
        full = W.gather_weight(w_shard, spec)
        return jnp.sum(jnp.tanh(x_shard @ full) ** 2)[None]

    f = jax.shard_map(
        island,
        mesh=mesh,
        in_specs=(P(("local", "node")), P(("node", "local"))),
        out_specs=P(("node", "local")),
    )
    got = jax.jit(jax.grad(lambda w, x: f(w, x).sum()))(w, xs)
    ref = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))(w, xs)
    # Exact to float32 summation order: both the sharded gradient and the one-device one
    # lie within the forward error bound of their sums around the float64 gradient
    # x^T dy. The sum over the 3n rows of x (one device) or of each shard's rows plus the
    # n partial sums (sharded) has at most 3n + n terms; dy inherits the error of the
    # forward dot products of length 2n. Bound: (3n + n + 2n) eps * (|x|^T |dy|).
    x64, w64 = np.asarray(xs, np.float64), np.asarray(w, np.float64)
    t = np.tanh(x64 @ w64)
    dy = 2 * t * (1 - t**2)
    exact = x64.T @ dy
    bound = 6 * n * np.finfo(np.float32).eps * (np.abs(x64).T @ np.abs(dy))
    for name, grad in (("sharded", got), ("one device", ref)):
        err = np.abs(np.asarray(grad, np.float64) - exact)
        assert np.all(err <= bound), (name, float(np.max(err / bound)))


@pytest.mark.parametrize("bits", [8, 4])
def test_gather_weight_quantized_gradient_within_bound(bits):
    mesh = make_mesh(2, 4)
    spec = functools.partial(
        W.GatherSpec,
        hierarchical=True,
        weight_bits=None,
        weight_block_size=8,
        weight_stage2_bits=None,
        grad_block_size=8,
        grad_hop2_block_size=8,
        two_hop=True,
        dtype=jnp.dtype(jnp.float32),
    )
    w = rand((16, 6), seed=7)
    xs = rand((24, 16), seed=8)

    def grads(s):
        def island(w_shard, x_shard):
            return jnp.sum(x_shard @ W.gather_weight(w_shard, s))[None]

        f = jax.shard_map(
            island,
            mesh=mesh,
            in_specs=(P(("local", "node")), P(("node", "local"))),
            out_specs=P(("node", "local")),
        )
        return np.asarray(jax.jit(jax.grad(lambda w, x: f(w, x).sum()))(w, xs))

    exact = grads(spec(grad_bits=None, grad_hop2_bits=None))
    quant = grads(spec(grad_bits=bits, grad_hop2_bits=bits))
    # d/dw sum(x @ w) is the column sums of x: each device contributes the column sums of
    # its 3 rows. Bound: per hop, half a step per contribution (generously bounded by the
    # largest contribution over the qmax levels) times the 8 contributions and 2 hops.
    contrib = np.abs(np.asarray(xs).reshape(8, 3, 16).sum(1)).max()
    bound = 2 * 8 * (contrib / qmax(bits)) / 2 + 1e-5
    assert np.max(np.abs(quant - exact)) <= bound
    assert not np.array_equal(quant, exact)


def test_small_pieces_get_power_of_two_blocks():
    """A piece smaller than its block uses its size rounded up to a power of two (at least
    8): the compiled Pallas kernels tile blocks in powers of two."""
    sizes = (1, 8, 9, 17, 48, 65, 256, 1000)
    assert [wire.effective_block_size(n, 256) for n in sizes] == [8, 8, 16, 32, 64, 128, 256, 256]
    assert wire.effective_block_size(50, 96) == 64  # never above the configured size
    assert wire.effective_block_size(100, 96) == 96
