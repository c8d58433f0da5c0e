"""The gradient reductions against unsharded references: exact when unquantized, within
the quantizer's analytic bound (half a step per value and quantization event) when
quantized."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import SCALE_ROUNDING, block_steps, per_device, rand
from jax.sharding import PartitionSpec as P

from zeropp_jax import make_mesh
from zeropp_jax.measure._hlo_text import parse_hlo_module
from zeropp_jax.wire import _encoding as wire
from zeropp_jax.wire import reductions
from zeropp_jax.wire.quant import qmax

MESHES = [(2, 4), (4, 2), (1, 8), (8, 1)]
ROWS, COLS = 3, 5  # 15 values per shard: not a multiple of any block size used


@pytest.mark.parametrize("shape", MESHES)
def test_unquantized_reductions_equal_psum_scatter(shape):
    mesh = make_mesh(*shape)
    nn, ll = shape
    n = nn * ll
    x = rand((nn, ll, n * ROWS, COLS), seed=2)
    for axis in ("node", "local", ("node", "local")):
        got = per_device(
            mesh,
            lambda s, a=axis: reductions.reduce_scatter_quantized(
                s[: wire._group_size(a) * ROWS], axis_name=a, bits=None, block_size=8
            ),
            x,
        )
        ref = per_device(
            mesh,
            lambda s, a=axis: jax.lax.psum_scatter(s[: wire._group_size(a) * ROWS], a, tiled=True),
            x,
        )
        np.testing.assert_array_equal(got, ref)
    ref = per_device(mesh, lambda s: jax.lax.psum_scatter(s, ("local", "node"), tiled=True), x)
    two_hop = functools.partial(
        reductions.two_hop_reduce_scatter, node_bits=None, node_block_size=8
    )
    for fn in (two_hop, reductions.flat_reduce_scatter):
        got = per_device(mesh, lambda s, f=fn: f(s, bits=None, block_size=8), x)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    # 16-bit input travels as uint16 bits and is summed in float32.
    xb = x.astype(jnp.bfloat16)
    got = per_device(
        mesh,
        lambda s: reductions.reduce_scatter_quantized(
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
    got = per_device(mesh, lambda s: reductions.flat_reduce_scatter(s, bits=bits, block_size=bs), x)
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
    got = per_device(mesh, lambda s: reductions.two_hop_reduce_scatter(s, **kw), x)
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


@pytest.mark.parametrize("shape", MESHES)
def test_flat_16bit_reduce_scatter_is_a_ring_within_bf16_rounding(shape):
    """ZeRO-3's bf16 gradient reduce-scatter runs as a ring (partial sums rounded to bf16
    between hops, as NCCL's does): each of the G-1 roundings errs by at most half a bf16
    ulp, 2**-9 relative, of a partial sum bounded by the sum of |contributions|."""
    mesh = make_mesh(*shape)
    nn, ll = shape
    n = nn * ll
    x = rand((nn, ll, n * ROWS, COLS), seed=12).astype(jnp.bfloat16)
    got = per_device(mesh, lambda s: reductions.flat_reduce_scatter(s, bits=None, block_size=8), x)
    exact = _exact_sums(np.asarray(x, np.float32), lambda a, b: b * nn + a)
    mag = _exact_sums(np.abs(np.asarray(x, np.float32)), lambda a, b: b * nn + a)
    err = np.abs(got.reshape(exact.shape) - exact)
    assert np.all(err <= (n - 1) * 2.0**-9 * mag + 1e-6 * mag)
    hlo = (
        jax.jit(
            jax.shard_map(
                lambda s: reductions.flat_reduce_scatter(s[0, 0], bits=None, block_size=8)[
                    None, None
                ],
                mesh=mesh,
                in_specs=P("node", "local"),
                out_specs=P("node", "local"),
            )
        )
        .lower(x)
        .as_text()
    )
    assert ("collective_permute" in hlo) == (n > 1) and "all_to_all" not in hlo


def test_model_ranks_draw_different_rounding_noise():
    # The engine's key is the same on every device; each `model` rank reduces its own
    # slice of a parameter, so folding in the rank gives each slice its own noise (the
    # data-parallel devices of one rank fold in their own index later, in `hop_keys`).
    mesh = make_mesh(2, 2, model_size=2)

    def draw(key):
        noise = jax.random.uniform(reductions.model_rank_key(key[0], axis_name="model"), (4,))
        return noise[None]

    f = jax.shard_map(
        draw, mesh=mesh, in_specs=P(), out_specs=P(("node", "local", "model")), check_vma=False
    )
    rows = np.asarray(jax.jit(f)(jax.random.key(0)[None]))  # one row per device
    model_rank = np.arange(8) % 2
    assert not np.allclose(rows[model_rank == 0][0], rows[model_rank == 1][0])
    for r in (0, 1):
        np.testing.assert_array_equal(rows[model_rank == r], rows[model_rank == r][:1].repeat(4, 0))
    assert reductions.model_rank_key(None, axis_name="model") is None


def test_two_hop_takes_a_spec_or_its_fields_not_both():
    from zeropp_jax.wire.reductions import TwoHop

    spec = TwoHop(bits=4, block_size=64, node_bits=4, node_block_size=64)
    assert (
        TwoHop.of(None, dict(bits=4, block_size=64, node_bits=4, node_block_size=64), "f") == spec
    )
    assert TwoHop.of(spec, {}, "f") is spec
    with pytest.raises(TypeError, match="f: pass a TwoHop or its fields"):
        TwoHop.of(spec, {"bits": 8}, "f")
    with pytest.raises(TypeError):
        TwoHop.of(None, {"bitz": 8}, "f")  # a misspelt field is not silently dropped


def test_two_hop_sums_join_int4_planes_once_per_hop_not_per_peer():
    """XLA:CPU splits an all-to-all into one piece per peer, each a buffer of its own: a sum
    that dequantized each piece joined that piece's two int4 bit planes with a
    concatenate, a kernel per peer (issue #48's compile time). The sum now adds plane by
    plane and joins once per hop."""
    mesh = make_mesh(2, 4)
    x = rand((8, 8 * 4 * 512), seed=3)

    def island(x):
        return reductions.two_hop_reduce_scatter(
            x[0], bits=4, block_size=256, node_bits=4, node_block_size=256
        )

    f = jax.jit(
        jax.shard_map(
            island, mesh=mesh, in_specs=P(("node", "local")), out_specs=P(("local", "node"))
        )
    )
    module = parse_hlo_module(f.lower(x).compile().as_text())
    ops = collections.Counter(i.opcode for comp in module.computations.values() for i in comp)
    assert ops["all-to-all"] == 4  # values and scales, on each hop
    assert ops["concatenate"] == 2  # one join of the planes' sums per hop (one per peer before: 6)
