"""Collectives against unsharded references: exact when unquantized, within the quantizer's
analytic bound (half a step per value and quantization event) when quantized."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from zeropp_jax import collectives as C
from zeropp_jax import make_mesh
from zeropp_jax import weight_gather as W
from zeropp_jax.quant import qmax

MESHES = [(2, 4), (4, 2), (1, 8), (8, 1)]
ROWS, COLS = 3, 5  # 15 values per shard: not a multiple of any block size used


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


def partition_order(x):
    """`(Nn, L, rows, ...)` per-device shards -> the global array in partition order."""
    nn, ll = x.shape[:2]
    return np.concatenate([np.asarray(x[n, l]) for l in range(ll) for n in range(nn)])


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
    eff = C.effective_block_size(ROWS * COLS, block_size)
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


@pytest.mark.parametrize("shape", MESHES)
def test_unquantized_reductions_equal_psum_scatter(shape):
    mesh = make_mesh(*shape)
    nn, ll = shape
    n = nn * ll
    x = rand((nn, ll, n * ROWS, COLS), seed=2)
    for axis in ("node", "local", ("node", "local")):
        got = per_device(
            mesh,
            lambda s, a=axis: C.reduce_scatter_quantized(
                s[: C._group_size(a) * ROWS], axis_name=a, bits=None, block_size=8
            ),
            x,
        )
        ref = per_device(
            mesh,
            lambda s, a=axis: jax.lax.psum_scatter(s[: C._group_size(a) * ROWS], a, tiled=True),
            x,
        )
        np.testing.assert_array_equal(got, ref)
    ref = per_device(mesh, lambda s: jax.lax.psum_scatter(s, ("local", "node"), tiled=True), x)
    two_hop = functools.partial(C.two_hop_reduce_scatter, node_bits=None, node_block_size=8)
    for fn in (two_hop, C.flat_reduce_scatter):
        got = per_device(mesh, lambda s, f=fn: f(s, bits=None, block_size=8), x)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    # 16-bit input travels as uint16 bits and is summed in float32.
    xb = x.astype(jnp.bfloat16)
    got = per_device(
        mesh,
        lambda s: C.reduce_scatter_quantized(
            s, axis_name=("node", "local"), bits=None, block_size=8
        ),
        xb,
    )
    ref = per_device(
        mesh,
        lambda s: jax.lax.psum_scatter(s.astype(jnp.float32), ("node", "local"), tiled=True),
        xb,
    )
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def _exact_sums(x, order):
    """Sum over all devices of each device's piece; `order` maps (n, l) -> piece index."""
    nn, ll = x.shape[:2]
    total = np.asarray(x, np.float64).sum(axis=(0, 1)).reshape(nn * ll, -1)
    out = np.empty((nn, ll, total.shape[1]))
    for n in range(nn):
        for l in range(ll):
            out[n, l] = total[order(n, l)]
    return out


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantized_flat_reduce_scatter_within_bound(shape, bits):
    mesh = make_mesh(*shape)
    nn, ll = shape
    n, bs = nn * ll, 8
    x = rand((nn, ll, n * ROWS, COLS), seed=3, heavy=True)
    got = per_device(mesh, lambda s: C.flat_reduce_scatter(s, bits=bits, block_size=bs), x)
    exact = _exact_sums(x, lambda a, b: b * nn + a)
    # One quantization event per contribution: sum of the contributors' half steps.
    pieces = lambda s: np.asarray(s, np.float64).reshape(n, -1)  # noqa: E731
    bound = np.zeros_like(exact)
    for a in range(nn):
        for b in range(ll):
            p = pieces(x[a, b])
            st = np.stack([block_steps(p[i], bits, bs) for i in range(n)])
            for dn in range(nn):
                for dl in range(ll):
                    bound[dn, dl] += st[dl * nn + dn] / 2
    bound += np.abs(exact) * 2.0**-20
    err = np.abs(got.reshape(exact.shape) - exact)
    assert np.all(err <= bound), float(np.max(err / bound))


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantized_two_hop_within_bound(shape, bits):
    mesh = make_mesh(*shape)
    nn, ll = shape
    n, bs = nn * ll, 8
    x = rand((nn, ll, n * ROWS, COLS), seed=4, heavy=True)
    kw = dict(bits=bits, block_size=bs, node_bits=bits, node_block_size=bs)
    got = per_device(mesh, lambda s: C.two_hop_reduce_scatter(s, **kw), x)
    got = got.reshape(nn, ll, -1)
    exact = _exact_sums(x, lambda a, b: b * nn + a)
    m = qmax(bits)
    for dn in range(nn):
        for dl in range(ll):
            piece = dl * nn + dn
            hop1 = np.zeros(ROWS * COLS)
            hop2 = np.zeros(ROWS * COLS)
            for a in range(nn):
                # Hop 1 (skipped when ll == 1): each contributor quantized once.
                partial = np.zeros(ROWS * COLS)
                err1 = np.zeros(ROWS * COLS)
                for b in range(ll):
                    p = np.asarray(x[a, b], np.float64).reshape(n, -1)[piece]
                    partial += p
                    if ll > 1:
                        err1 += block_steps(p, bits, bs) / 2
                hop1 += err1
                if nn > 1:
                    # Hop 2 re-quantizes the received partial sum: its block absmax is at
                    # most the exact one plus the hop-1 error.
                    padded = np.pad(partial, (0, (-partial.size) % bs)).reshape(-1, bs)
                    perr = np.pad(err1, (0, (-err1.size) % bs)).reshape(-1, bs)
                    st = (np.abs(padded).max(1) + perr.max(1)) / m * SCALE_ROUNDING
                    hop2 += np.repeat(st, bs)[: partial.size] / 2
            bound = hop1 + hop2 + np.abs(exact[dn, dl]) * 2.0**-20 + 1e-30
            err = np.abs(got[dn, dl] - exact[dn, dl])
            assert np.all(err <= bound), float(np.max(err / bound))


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


@pytest.mark.parametrize("shape", MESHES)
def test_flat_16bit_reduce_scatter_is_a_ring_within_bf16_rounding(shape):
    """ZeRO-3's bf16 gradient reduce-scatter runs as a ring (partial sums rounded to bf16
    between hops, as NCCL's does): each of the G-1 roundings errs by at most half a bf16
    ulp, 2**-9 relative, of a partial sum bounded by the sum of |contributions|."""
    mesh = make_mesh(*shape)
    nn, ll = shape
    n = nn * ll
    x = rand((nn, ll, n * ROWS, COLS), seed=12).astype(jnp.bfloat16)
    got = per_device(mesh, lambda s: C.flat_reduce_scatter(s, bits=None, block_size=8), x)
    exact = _exact_sums(np.asarray(x, np.float32), lambda a, b: b * nn + a)
    mag = _exact_sums(np.abs(np.asarray(x, np.float32)), lambda a, b: b * nn + a)
    err = np.abs(got.reshape(exact.shape) - exact)
    assert np.all(err <= (n - 1) * 2.0**-9 * mag + 1e-6 * mag)
    hlo = (
        jax.jit(
            jax.shard_map(
                lambda s: C.flat_reduce_scatter(s[0, 0], bits=None, block_size=8)[None, None],
                mesh=mesh,
                in_specs=P("node", "local"),
                out_specs=P("node", "local"),
            )
        )
        .lower(x)
        .as_text()
    )
    assert ("collective_permute" in hlo) == (n > 1) and "all_to_all" not in hlo


def test_small_pieces_get_power_of_two_blocks():
    """A piece smaller than its block uses its size rounded up to a power of two (at least
    8): the compiled Pallas kernels tile blocks in powers of two."""
    sizes = (1, 8, 9, 17, 48, 65, 256, 1000)
    assert [C.effective_block_size(n, 256) for n in sizes] == [8, 8, 16, 32, 64, 128, 256, 256]
    assert C.effective_block_size(50, 96) == 64  # never above the configured size
    assert C.effective_block_size(100, 96) == 96


def test_model_ranks_draw_different_rounding_noise():
    # The engine's key is the same on every device; each `model` rank reduces its own
    # slice of a parameter, so folding in the rank gives each slice its own noise (the
    # data-parallel devices of one rank fold in their own index later, in `hop_keys`).
    mesh = make_mesh(2, 2, model_size=2)

    def draw(key):
        noise = jax.random.uniform(C.model_rank_key(key[0], axis_name="model"), (4,))
        return noise[None]

    f = jax.shard_map(
        draw, mesh=mesh, in_specs=P(), out_specs=P(("node", "local", "model")), check_vma=False
    )
    rows = np.asarray(jax.jit(f)(jax.random.key(0)[None]))  # one row per device
    model_rank = np.arange(8) % 2
    assert not np.allclose(rows[model_rank == 0][0], rows[model_rank == 1][0])
    for r in (0, 1):
        np.testing.assert_array_equal(rows[model_rank == r], rows[model_rank == r][:1].repeat(4, 0))
    assert C.model_rank_key(None, axis_name="model") is None
