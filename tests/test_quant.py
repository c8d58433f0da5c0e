"""Tests of the reference block quantizer (`zeropp_jax.wire.quant`).

Every round-trip check uses the analytic bound of the quantizer, never a tuned tolerance.
For a value `x` in a block with scale `s` (`quant.step_size`), round to nearest gives

    |x - dequant(quant(x))| <= s / 2 + 4u (|x| + s) + daz(x),        u = 2**-24,

where the terms after `s / 2` are the float32 rounding of the arithmetic itself:

  * `x / s` is computed as `x * fl(1 / s)`: two roundings, so
    `|y - x / s| <= (2u + u**2) |x| / s`; rounding `y` to an integer adds at most 1/2 (the
    `s / 2`); dequantizing `fl(q * s)` adds `u |q s| <= u (|x| + s)`. In total at most
    `s / 2 + (3u + u**2) |x| + u s <= s / 2 + 4u (|x| + s)`.
  * `daz(x) = |x|` for a subnormal `x`, else 0: XLA on CPU treats subnormal inputs as zero
    (denormals-are-zero), so such a value is quantized as 0, which moves it by `|x| < 2**-126`.

Stochastic rounding lands on one of the two grid points around `x / s`: the same terms with
a full step `s` in place of `s / 2` (the add of the uniform draw rounds once more, by at most
`u (|x| / s + 1)` steps, which the `4u` still covers).

Dequantizing to bfloat16 rounds the float32 result once more, by at most half a bfloat16
ulp: `|y - bf16(y)| <= 2**-8 |bf16(y)|`.

Compilation dominates the run time on CPU, so most tests run one jitted function that
covers several bit widths, dtypes or sizes at once.
"""

from __future__ import annotations

import functools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeropp_jax.wire import quant

U = 2.0**-24  # float32 unit roundoff
TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32
BF16_U = 2.0**-8  # bfloat16 unit roundoff (half an ulp, relative)
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)
ALL_BITS = (8, 4, 2)
SIZES = (1, 7, 1000, 4097)
BLOCK_SIZES = (8, 64, 256)
DTYPES = ("float32", "bfloat16")
DISTS = ("normal", "uniform", "student_t", "signed_lognormal", "outliers", "tiny", "huge")
HYPOTHESIS = settings(max_examples=30, deadline=None)


# ---------------------------------------------------------------------------------------
# helpers


def f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), dtype=np.float64)


def fp_terms(x, step) -> np.ndarray:
    """Float32 rounding of the quantizer's arithmetic (see the module docstring)."""
    ax = np.abs(np.asarray(x, np.float64))
    daz = np.where(ax < TINY, ax, 0.0)
    return 4 * U * (ax + step) + daz


def rtn_bound(x, step) -> np.ndarray:
    """Round-to-nearest bound for float32 output: half a step plus rounding."""
    return np.asarray(step, np.float64) / 2 + fp_terms(x, step)


def sr_bound(x, step) -> np.ndarray:
    """Stochastic-rounding bound for float32 output: a full step plus rounding."""
    return np.asarray(step, np.float64) + fp_terms(x, step)


def assert_within(err, bound, what: str) -> None:
    err, bound = np.asarray(err), np.asarray(bound)
    bad = ~(err <= bound)
    if bad.any():
        i = np.flatnonzero(bad.reshape(-1))[0]
        raise AssertionError(
            f"{what}: {bad.sum()} values beyond the bound; first at {i}: "
            f"err={err.reshape(-1)[i]!r} bound={bound.reshape(-1)[i]!r}"
        )


def np_unpack(values, bits: int) -> np.ndarray:
    """Independent decoder of the documented wire layout, in numpy."""
    v = np.asarray(values)
    if bits == 8:
        assert v.dtype == np.int8
        return v.astype(np.int32)
    assert v.dtype == np.uint8
    per_byte = 8 // bits
    mask = 2**bits - 1
    planes = [((v >> (bits * i)) & mask).astype(np.int32) for i in range(per_byte)]
    return np.concatenate(planes, axis=-1) - 2 ** (bits - 1)


def np_pack(q, bits: int) -> np.ndarray:
    """Independent encoder of the documented wire layout: value `j` of plane `i` in bits
    `[bits * i, bits * (i + 1))` of byte `j`, offset binary."""
    q = np.asarray(q, np.int32)
    if bits == 8:
        return q.astype(np.int8)
    per_byte = 8 // bits
    u = q + 2 ** (bits - 1)
    width = q.shape[-1] // per_byte
    out = np.zeros((*q.shape[:-1], width), np.int32)
    for i in range(per_byte):
        out |= u[..., i * width : (i + 1) * width] << (bits * i)
    return out.astype(np.uint8)


def np_dequantize_blocks(values, scales, bits: int) -> np.ndarray:
    """`q * scale` in float32 (IEEE, like XLA), from the numpy decoder."""
    q = np_unpack(values, bits).astype(np.float32)
    return q * np.asarray(scales, np.float32)[..., None]


def representable(bits: int) -> np.ndarray:
    """Every value one packed field can hold: `[-2**(bits-1), 2**(bits-1) - 1]`."""
    return np.arange(-(2 ** (bits - 1)), 2 ** (bits - 1), dtype=np.int32)


def sample(dist: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` float32 values of a named distribution."""
    if dist == "normal":
        x = rng.standard_normal(n)
    elif dist == "uniform":
        x = rng.uniform(-3.0, 3.0, n)
    elif dist == "student_t":  # two degrees of freedom: infinite variance
        x = rng.standard_t(2, n)
    elif dist == "signed_lognormal":
        x = rng.lognormal(0.0, 3.0, n) * rng.choice([-1.0, 1.0], n)
    elif dist == "outliers":
        x = rng.standard_normal(n)
        idx = rng.choice(n, max(1, n // 500), replace=False)
        x[idx] = rng.choice([-1.0, 1.0], idx.size) * 10.0 ** rng.uniform(3, 6, idx.size)
    elif dist == "tiny":  # scales at the bottom of the normal range; some values subnormal
        x = rng.standard_normal(n) * 2.0**-120
    elif dist == "huge":  # 2-bit scales beyond 2**126, where 1 / scale is subnormal
        x = rng.standard_normal(n) * 2.0**124
    else:
        raise AssertionError(dist)
    return x.astype(np.float32)


def _qdq(x, key, bits, block_size, dtype=jnp.float32):
    q = quant.quantize_blockwise(x, bits=bits, block_size=block_size, key=key)
    return q, quant.dequantize_blockwise(q, dtype)


@functools.partial(jax.jit, static_argnames=("bits", "block_size", "dtype"))
def qdq(x, key=None, *, bits, block_size, dtype=jnp.float32):
    """Quantize (to nearest, or stochastically with `key`) and dequantize to `dtype`."""
    return _qdq(x, key, bits, block_size, dtype)


@functools.partial(jax.jit, static_argnames=("block_size", "dtype"))
def qdq_all_bits(x, key=None, *, block_size, dtype=jnp.float32):
    """`{bits: (QuantizedArray, dequantized)}` for 8, 4 and 2 bits in one compilation."""
    return {bits: _qdq(x, key, bits, block_size, dtype) for bits in ALL_BITS}


@functools.partial(jax.jit, static_argnames=("bits",))
def pack_unpack(q, *, bits):
    packed = quant.pack(q, bits)
    return packed, quant.unpack(packed, bits)


# ---------------------------------------------------------------------------------------
# round trip within the analytic bound


# Every (size, block size, bit width) triple; the input dtype alternates over them so that
# each dtype meets every size, block size and bit width (and compilations stay few).
ROUND_TRIP_CASES = [
    (size, block_size, bits, DTYPES[(i + j + k) % 2])
    for i, size in enumerate(SIZES)
    for j, block_size in enumerate(BLOCK_SIZES)
    for k, bits in enumerate(ALL_BITS)
]


@functools.partial(jax.jit, static_argnames=("cases",))
def _round_trips(xs, *, cases):
    """For each array and `(bits, block_size)`: (QuantizedArray, float32 output, output in
    the input dtype, step_size)."""
    out = []
    for x, (bits, block_size) in zip(xs, cases, strict=True):
        q = quant.quantize_blockwise(x, bits=bits, block_size=block_size)
        y32 = quant.dequantize_blockwise(q, jnp.float32)
        y = quant.dequantize_blockwise(q, x.dtype)
        out.append((q, y32, y, quant.step_size(x, bits=bits, block_size=block_size)))
    return out


@pytest.mark.parametrize("bits", ALL_BITS)
def test_round_trip_within_half_step(bits):
    """Sizes 1, 7, 1000, 4097; block sizes 8, 64, 256; float32 and bfloat16; seven
    distributions (normal, uniform, heavy-tailed, outliers, tiny, huge)."""
    cases = [c for c in ROUND_TRIP_CASES if c[2] == bits]
    rng = np.random.default_rng(bits)
    for dist in DISTS:
        xs = [jnp.asarray(sample(dist, size, rng), dt) for size, _, _, dt in cases]
        results = _round_trips(xs, cases=tuple((b, bs) for _, bs, b, _ in cases))
        for (size, block_size, _, dtype), x, (q, y32, y, step) in zip(
            cases, xs, results, strict=True
        ):
            what = f"{dist}, size {size}, block {block_size}, {dtype}, {bits} bits"
            xd, step = f64(x), f64(step)
            assert y32.shape == y.shape == x.shape and y.dtype == x.dtype, what
            bound = rtn_bound(xd, step)
            assert_within(np.abs(xd - f64(y32)), bound, f"{what}, float32 output")
            yd = f64(y)
            if dtype == "bfloat16":
                bound = bound + BF16_U * np.abs(yd)
            assert_within(np.abs(xd - yd), bound, f"{what}, {dtype} output")
            # Payload: bits / 8 bytes per value, one float32 scale per block.
            nb = math.ceil(size / block_size)
            assert q.values.shape == (nb, block_size * bits // 8), what
            assert q.values.dtype == (jnp.int8 if bits == 8 else jnp.uint8), what
            assert q.values.nbytes == nb * block_size * bits // 8, what
            assert q.scales.shape == (nb,) and q.scales.dtype == jnp.float32, what
            assert q.nbytes == q.values.nbytes + 4 * nb, what
            assert (q.bits, q.block_size, q.shape, q.size) == (bits, block_size, (size,), size)


def np_round_up_scale(s) -> np.ndarray:
    """Independent model of the scale rounding: positive float32 `s` rounded up to
    `quant.SCALE_BITS` significant bits, in float64 arithmetic (exact at these sizes)."""
    s = np.asarray(s, np.float64)
    ulp = 2.0 ** (np.floor(np.log2(s)) - (quant.SCALE_BITS - 1))
    return np.ceil(s / ulp) * ulp


def test_scales_are_absmax_over_qmax():
    """In the normal range the wire scale is `absmax / qmax` rounded up to `SCALE_BITS`
    significant bits. Bound derived again for the rounding up (the scale was
    `fl(absmax * fl(1 / qmax))` alone before, within `3u` of `absmax / qmax` either way):
    that product is two roundings, within a factor `(1 +- u)**2` of `absmax / qmax`;
    rounding up to 16 significant bits adds a factor in `[1, 1 + 2**-15)`. So
    `(1 - 3u) e <= scale <= (1 + 2**-15 + 3u) e` with `e = absmax / qmax`; and the scale is
    exactly that product rounded up, with at most 16 significant bits."""
    assert quant.SCALE_BITS == 16
    x = sample("signed_lognormal", 1000, np.random.default_rng(0))
    absmax = np.abs(np.pad(x, (0, 24)).reshape(-1, 64)).max(axis=-1).astype(np.float64)
    for bits, (q, _) in qdq_all_bits(jnp.asarray(x), block_size=64).items():
        expected = absmax / quant.qmax(bits)
        got = f64(q.scales)
        assert_within(expected * (1 - 3 * U) - got, 0.0, f"{bits} bits, below")
        assert_within(got - expected, (2.0**-15 + 3 * U) * expected, f"{bits} bits, above")
        product = absmax.astype(np.float32) * (np.float32(1) / np.float32(quant.qmax(bits)))
        np.testing.assert_array_equal(got, np_round_up_scale(product), err_msg=f"{bits} bits")
        mantissa = np.frexp(got)[0] * 2.0**quant.SCALE_BITS  # an integer: <= 16 bits
        np.testing.assert_array_equal(mantissa, np.round(mantissa))


def test_round_to_nearest_ties_to_even():
    # absmax 127 -> scale exactly 1, so x / scale is exact and only the rounding acts.
    x = jnp.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49], jnp.float32)
    q, _ = qdq(x, bits=8, block_size=8)
    np.testing.assert_array_equal(np.asarray(q.scales), [1.0])
    np.testing.assert_array_equal(np_unpack(q.values, 8)[0], [127, 0, 2, 2, 0, -2, -2, 3])


def test_grid_values_round_trip_exactly():
    # Values on the grid of a power-of-two scale come back exactly, at every bit width.
    for bits in ALL_BITS:
        m = quant.qmax(bits)
        x = np.resize(np.arange(-m, m + 1, dtype=np.float32), 64) * np.float32(0.25)
        x[0] = m * 0.25  # block absmax -> scale 0.25
        _, y = qdq(jnp.asarray(x), bits=bits, block_size=64)
        np.testing.assert_array_equal(np.asarray(y), x, err_msg=f"{bits} bits")


# The small tests below share one layout (37 values: four blocks of 8 and a partial one) so
# that they share compilations.
SMALL = 37


def test_extreme_magnitudes():
    """Values at the ends of the float32 range stay finite and within the bound."""
    big = np.finfo(np.float32).max
    x = np.array(
        [
            *[big, -big, 1.0, big / 3],  # qmax * scale must not overflow to Inf
            *[2.0**127, -(2.0**126), 3.0e37, 1.0],  # a 2-bit scale >= 2**126
            *[2.0**-120, -(2.0**-121), 2.0**-125, 2.0**-126],  # absmax / qmax is subnormal
            *[2.0**-126, 1e-39, -1e-45, 0.0],  # subnormal inputs
            *[1e-30, -3e30, 0.5, 1e-40],
        ],
        np.float32,
    ).reshape(5, 4)
    x = np.pad(x, ((0, 0), (0, 4))).reshape(-1)[:SMALL]  # one case per block of 8
    for bits, (_, y) in qdq_all_bits(jnp.asarray(x), block_size=8).items():
        step = f64(quant.step_size(jnp.asarray(x), bits=bits, block_size=8))
        assert np.isfinite(np.asarray(y)).all(), (bits, y)
        assert_within(np.abs(f64(x) - f64(y)), rtn_bound(f64(x), step), f"{bits} bits")


def test_block_result_independent_of_context():
    """A block quantizes to the same bits alone, inside a larger array, and op by op."""
    x = sample("signed_lognormal", 64 * 8, np.random.default_rng(0))
    full = qdq_all_bits(jnp.asarray(x), block_size=64)
    alone = [qdq_all_bits(jnp.asarray(x[64 * b : 64 * (b + 1)]), block_size=64) for b in range(8)]
    for bits in ALL_BITS:
        q, y = full[bits]
        eager = quant.quantize_blockwise(jnp.asarray(x[64:128]), bits=bits, block_size=64)
        np.testing.assert_array_equal(np.asarray(eager.values[0]), np.asarray(q.values[1]))
        np.testing.assert_array_equal(np.asarray(eager.scales[0]), np.asarray(q.scales[1]))
        for b in range(8):
            q1, y1 = alone[b][bits]
            np.testing.assert_array_equal(np.asarray(q1.values[0]), np.asarray(q.values[b]))
            np.testing.assert_array_equal(np.asarray(q1.scales[0]), np.asarray(q.scales[b]))
            np.testing.assert_array_equal(np.asarray(y1), np.asarray(y)[64 * b : 64 * (b + 1)])


# ---------------------------------------------------------------------------------------
# stochastic rounding

# Each stochastically rounded value lands on one of the two grid points around x / s, so its
# error lies in an interval of width s and has mean zero: it rounds up with probability
# frac(x / s). By Hoeffding, the mean error over K independent keys satisfies
# P(|mean| >= t) <= 2 exp(-2 K t**2 / s**2); at t = 3 s / sqrt(K) (also 6 sigma, since the
# variance of one error is at most s**2 / 4) that is 2 exp(-18) < 3e-8 per value, < 3e-5 for
# the 3 x 256 values checked. Floating point adds a far smaller bias: the uniform draws sit
# on a 2**-23 grid (a bias of at most 2**-23 s) and the arithmetic adds fp_terms.
K_KEYS = 2000


@functools.partial(jax.jit, static_argnames=("block_size",))
def _stochastic_round_trips(x, keys, *, block_size):
    """`{bits: (K, *x.shape)}` dequantized stochastic roundings of `x`, one per key."""
    return {
        bits: jax.vmap(lambda key, bits=bits: _qdq(x, key, bits, block_size)[1])(keys)
        for bits in ALL_BITS
    }


def test_stochastic_rounding_unbiased():
    x = jnp.asarray(np.random.default_rng(1).uniform(-1.0, 1.0, 256).astype(np.float32))
    keys = jax.random.split(jax.random.key(0), K_KEYS)
    xd = f64(x)
    for bits, ys in _stochastic_round_trips(x, keys, block_size=64).items():
        ys = f64(ys)
        step = f64(quant.step_size(x, bits=bits, block_size=64))
        mean_err = (ys - xd).mean(axis=0)
        bound = 3 * step / math.sqrt(K_KEYS) + 2.0**-23 * step + fp_terms(xd, step)
        assert_within(np.abs(mean_err), bound, f"mean stochastic rounding error, {bits} bits")
        # Not round-to-nearest in disguise: values off the grid take both neighbours.
        off_grid = np.abs(xd / step - np.round(xd / step)) > 0.05
        assert off_grid.sum() > 100
        assert (ys.min(axis=0) < ys.max(axis=0))[off_grid].all()


def test_stochastic_rounding_within_one_step():
    dists = ("normal", "signed_lognormal", "outliers", "tiny", "huge")
    rng = np.random.default_rng(2)
    # Each distribution fills whole blocks, so its blocks are quantized as if alone.
    x = jnp.asarray(np.concatenate([sample(d, 1024, rng) for d in dists]))
    keys = jax.random.split(jax.random.key(7), 8)
    xd = f64(x)
    for bits, ys in _stochastic_round_trips(x, keys, block_size=64).items():
        step = f64(quant.step_size(x, bits=bits, block_size=64))
        assert_within(np.abs(f64(ys) - xd), sr_bound(xd, step), f"{bits} bits")


def test_stochastic_rounding_keeps_grid_values_and_depends_on_key():
    x = jnp.asarray(np.arange(-127, 128, dtype=np.float32))  # scale 1: all on the grid
    for k in range(3):
        _, y = qdq(x, jax.random.key(k), bits=8, block_size=256)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    z = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, 512).astype(np.float32))

    def sr(k):
        return np.asarray(qdq(z, jax.random.key(k), bits=4, block_size=64)[0].values)

    np.testing.assert_array_equal(sr(1), sr(1))
    assert (sr(1) != sr(2)).any()


# ---------------------------------------------------------------------------------------
# packing and wire layout


@pytest.mark.parametrize("bits", ALL_BITS)
def test_pack_unpack_exact_for_every_value(bits):
    vals = representable(bits)
    for block_size in (8, 64, 256):
        # Row r, column j holds vals[(r + j) % len]: every value at every position.
        rows = np.arange(len(vals))[:, None] + np.arange(block_size)[None, :]
        q = vals[rows % len(vals)].astype(np.int8)
        packed, out = pack_unpack(jnp.asarray(q), bits=bits)
        assert packed.shape == (len(vals), block_size * bits // 8)
        assert packed.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
        assert packed.nbytes == len(vals) * block_size * bits // 8
        np.testing.assert_array_equal(np.asarray(packed), np_pack(q, bits))  # the layout
        assert out.dtype == jnp.int8
        np.testing.assert_array_equal(np.asarray(out), q)


def test_quantized_array_is_a_pytree():
    x = jnp.linspace(-1.0, 1.0, 30).reshape(5, 6)
    q, y = qdq(x, bits=4, block_size=8)
    leaves, _ = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 2
    q2 = jax.jit(lambda q: q)(q)
    assert (q2.bits, q2.block_size, q2.shape) == (4, 8, (5, 6))
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.dequantize_blockwise)(q2)), y)


# ---------------------------------------------------------------------------------------
# property tests

# Shapes, bit widths and block sizes come in a few combinations, so that compilations are
# shared between examples (the parametrized tests above cover the grid); the values (zeros,
# subnormals, the ends of the range, mixed magnitudes) are free.
LAYOUTS = [  # (shape, bits, block_size, dtype)
    ((), 8, 1, "float32"),
    ((7,), 4, 2, "bfloat16"),
    ((3, 5), 2, 4, "float32"),
    ((2, 3, 4), 8, 16, "bfloat16"),
    ((33,), 4, 32, "float32"),
    ((1,), 2, 64, "bfloat16"),
    ((3, 5), 8, 8, "float32"),
    ((2, 3, 4), 2, 12, "float32"),
]


@st.composite
def quant_inputs(draw):
    shape, bits, block_size, dtype = draw(st.sampled_from(LAYOUTS))
    limit = BF16_MAX if dtype == "bfloat16" else None  # finite after the cast to bfloat16
    elements = st.floats(
        min_value=None if limit is None else -limit,
        max_value=limit,
        width=32,
        allow_nan=False,
        allow_infinity=False,
        allow_subnormal=True,
    )
    x = draw(hnp.arrays(np.float32, shape, elements=elements))
    return jnp.asarray(x, dtype), bits, block_size


@functools.partial(jax.jit, static_argnames=("bits", "block_size"))
def _rtn_and_stochastic(x, key, *, bits, block_size):
    q, y = _qdq(x, None, bits, block_size)
    _, ys = _qdq(x, key, bits, block_size)
    return q, y, ys, quant.step_size(x, bits=bits, block_size=block_size)


@HYPOTHESIS
@given(quant_inputs(), st.integers(0, 2**31 - 1))
def test_property_round_trip(args, seed):
    x, bits, block_size = args
    q, y, ys, step = _rtn_and_stochastic(x, jax.random.key(seed), bits=bits, block_size=block_size)
    assert y.shape == ys.shape == x.shape
    xd, step = f64(x), f64(step)
    assert np.isfinite(f64(y)).all() and np.isfinite(f64(ys)).all()
    assert_within(np.abs(xd - f64(y)), rtn_bound(xd, step), "round to nearest")
    assert_within(np.abs(xd - f64(ys)), sr_bound(xd, step), "stochastic rounding")
    codes = np_unpack(q.values, bits)
    np.testing.assert_array_equal(codes, np.asarray(quant.unpack(q.values, bits)))
    assert np.abs(codes).max() <= quant.qmax(bits)


@HYPOTHESIS
@given(
    st.sampled_from(ALL_BITS),
    st.sampled_from([1, 3]),
    st.sampled_from([1, 2, 5, 16]),
    st.integers(0, 2**32 - 1),
)
def test_property_pack_unpack(bits, rows, width, seed):
    block_size = width * (8 // bits)
    q = np.random.default_rng(seed).choice(representable(bits), (rows, block_size))
    q = q.astype(np.int8)
    packed, out = pack_unpack(jnp.asarray(q), bits=bits)
    assert packed.nbytes == rows * block_size * bits // 8
    np.testing.assert_array_equal(np.asarray(packed), np_pack(q, bits))
    np.testing.assert_array_equal(np.asarray(out), q)


# ---------------------------------------------------------------------------------------
# zeros, NaN and Inf


@pytest.mark.parametrize("stochastic", [False, True])
def test_all_zero_block_is_exact_zero(stochastic):
    x = jnp.concatenate([jnp.zeros(16), -jnp.zeros(8), jnp.arange(1.0, SMALL - 23)])
    key = jax.random.key(0) if stochastic else None
    for dtype in (jnp.float32, jnp.bfloat16):
        for bits, (q, y) in qdq_all_bits(x, key, block_size=8, dtype=dtype).items():
            np.testing.assert_array_equal(np.asarray(q.scales)[:3], 0.0)
            y = f64(y)
            assert not np.isnan(y).any(), (bits, dtype)
            np.testing.assert_array_equal(y[:24], 0.0)
    for _, (q, y) in qdq_all_bits(x.astype(jnp.bfloat16), block_size=8).items():
        np.testing.assert_array_equal(np.asarray(q.scales)[:3], 0.0)
        np.testing.assert_array_equal(f64(y)[:24], 0.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_block_is_contained(bad):
    x = np.random.default_rng(0).standard_normal(SMALL).astype(np.float32)  # 5 blocks
    x[13] = bad  # in block 1
    alone = [qdq_all_bits(jnp.asarray(x[8 * b : 8 * b + 8]), block_size=8) for b in (0, 2, 3, 4)]
    bf16 = qdq_all_bits(jnp.asarray(x), block_size=8, dtype=jnp.bfloat16)
    sr = qdq_all_bits(jnp.asarray(x), jax.random.key(1), block_size=8)
    for bits, (q, y) in qdq_all_bits(jnp.asarray(x), block_size=8).items():
        y = np.asarray(y)
        assert np.isnan(y[8:16]).all(), (bits, y[8:16])
        assert np.isnan(f64(bf16[bits][1])[8:16]).all(), bits
        for i, b in enumerate((0, 2, 3, 4)):  # every other block exactly as if alone
            q1, y1 = alone[i][bits]
            np.testing.assert_array_equal(np.asarray(q.values[b]), np.asarray(q1.values[0]))
            np.testing.assert_array_equal(np.asarray(q.scales[b]), np.asarray(q1.scales[0]))
            np.testing.assert_array_equal(y[8 * b : 8 * b + 8], np.asarray(y1))
        ys = np.asarray(sr[bits][1])  # stochastic rounding contains it too
        assert np.isnan(ys[8:16]).all(), bits
        assert np.isfinite(np.delete(ys, np.s_[8:16])).all(), bits


@pytest.mark.parametrize(("num_blocks", "block_size"), [(16, 256), (33, 128)])
def test_nonfinite_blocks_are_contained_in_large_arrays(num_blocks, block_size):
    """XLA:CPU's float reduce-max drops NaN at these sizes (openxla/xla#21461); the
    quantizer must not: a NaN must never dequantize to a finite value."""
    clean = sample("normal", num_blocks * block_size, np.random.default_rng(num_blocks))
    x = clean.copy()
    bad = {1: np.nan, 5: np.inf, 9: -np.inf, num_blocks - 1: np.nan}
    for b, v in bad.items():
        x[b * block_size + 7] = v
    ref = qdq_all_bits(jnp.asarray(clean), block_size=block_size)
    for bits, (q, y) in qdq_all_bits(jnp.asarray(x), block_size=block_size).items():
        y = np.asarray(y).reshape(num_blocks, block_size)
        good = [b for b in range(num_blocks) if b not in bad]
        assert np.isnan(y[list(bad)]).all(), bits
        np.testing.assert_array_equal(y[good], np.asarray(ref[bits][1]).reshape(y.shape)[good])
        np.testing.assert_array_equal(
            np.asarray(q.values)[good], np.asarray(ref[bits][0].values)[good]
        )
        np.testing.assert_array_equal(
            np.asarray(q.scales)[good], np.asarray(ref[bits][0].scales)[good]
        )
