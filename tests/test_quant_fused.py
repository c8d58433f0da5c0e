"""Tests of the fused references of the gradient reduction (`zeropp_jax.wire.quant`):
`dequantize_sum_blocks`, `dequantize_sum_quantize_blocks` and the scale cap they rely on.

Bounds are the analytic ones of tests/test_quant.py (its docstring derives them) plus the
float32 summation bound of `sum_error_bound`; no tuned tolerance.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quant import (
    ALL_BITS,
    U,
    assert_within,
    f64,
    np_dequantize_blocks,
    np_unpack,
    rtn_bound,
    sr_bound,
)

from zeropp_jax.wire import quant

dequantize_sum_blocks = jax.jit(quant.dequantize_sum_blocks, static_argnames=("bits",))
dequantize_sum_quantize_blocks = jax.jit(
    quant.dequantize_sum_quantize_blocks, static_argnames=("bits", "out_bits")
)
dequantize_blocks = jax.jit(quant.dequantize_blocks, static_argnames=("bits",))
quantize_blocks = jax.jit(quant.quantize_blocks, static_argnames=("bits",))


def stacked_sets(g, bits, seed, nb=6, block_size=64):
    """`g` quantized block sets of mixed magnitudes (so that the sums cancel in places)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((g, nb, block_size)).astype(np.float32)
    x *= 10.0 ** rng.uniform(-3, 3, (g, nb, 1)).astype(np.float32)
    return quantize_blocks(jnp.asarray(x), bits=bits)


def sum_error_bound(values, scales, bits):
    """Exact sum (float64) of the dequantized sets, and the error bound of a float32 sum.

    The products `P_g = q_g * s_g` are exact in float64. Summing left to right in float32
    errs by at most `u * (sum_g |P_g| + sum_{g>=1} |S_g|)` to first order (one rounding per
    product, one per partial sum `S_g`), whether or not a product is fused into its add; the
    factor 2 covers the second-order terms (`G u << 1`).
    """
    p = np_unpack(values, bits).astype(np.float64) * f64(scales)[..., None]
    partial = np.cumsum(p, axis=0)
    bound = 2 * U * (np.abs(p).sum(axis=0) + np.abs(partial[1:]).sum(axis=0))
    return partial[-1], bound


def test_fused_references_op_by_op_are_exact():
    """Run op by op (no fusion), the fused references are exactly their definitions."""
    values, scales = stacked_sets(3, 4, seed=0)
    # float32, left to right over g, from the independent numpy decoder.
    expected = functools.reduce(np.add, list(np_dequantize_blocks(values, scales, 4)))
    total = quant.dequantize_sum_blocks(values, scales, bits=4)
    assert total.dtype == jnp.float32 and total.shape == (6, 64)
    np.testing.assert_array_equal(np.asarray(total), expected)
    v, s = quant.dequantize_sum_quantize_blocks(values, scales, bits=4, out_bits=8)
    ev, es = quant.quantize_blocks(total, bits=8)
    np.testing.assert_array_equal(np.asarray(v), np.asarray(ev))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(es))


@pytest.mark.parametrize(("g", "bits"), [(1, 8), (2, 8), (3, 4), (8, 2)])
def test_dequantize_sum_blocks(g, bits):
    values, scales = stacked_sets(g, bits, seed=g * 10 + bits)
    assert values.shape == (g, 6, 64 * bits // 8) and scales.shape == (g, 6)
    # Compiled, XLA may fuse each product into its add (see the docstring): within the
    # float32 summation bound of the exact sum, as the plain float32 sum is.
    got = np.asarray(dequantize_sum_blocks(values, scales, bits=bits))
    assert got.dtype == np.float32 and got.shape == (6, 64)
    exact, bound = sum_error_bound(values, scales, bits)
    assert_within(np.abs(f64(got) - exact), bound, "compiled sum")
    expected = functools.reduce(np.add, list(np_dequantize_blocks(values, scales, bits)))
    assert_within(np.abs(f64(expected) - exact), bound, "numpy sum")
    if g == 1:  # nothing to add: exactly dequantize_blocks
        one = dequantize_blocks(values[0], scales[0], bits=bits)
        np.testing.assert_array_equal(got, np.asarray(one))


@pytest.mark.parametrize(("g", "bits"), [(2, 8), (3, 4), (4, 2), (5, 8), (8, 4)])
def test_dequantize_sum_blocks_compiled_is_bit_exact(g, bits):
    """Scales have at most 16 significant bits, so every `q * scale` is exact and an FMA
    contraction of `acc + q * scale` (XLA:CPU's, which depends on G) changes no bit: the
    compiled sum is the op-by-op sum is the numpy float32 sum, left to right, to the bit.
    The sets are of mixed magnitudes, so that the sums cancel in places."""
    values, scales = stacked_sets(g, bits, seed=100 + g)
    mantissa = np.frexp(f64(scales))[0] * 2.0**quant.SCALE_BITS
    np.testing.assert_array_equal(mantissa, np.round(mantissa))
    compiled = np.asarray(dequantize_sum_blocks(values, scales, bits=bits))
    eager = np.asarray(quant.dequantize_sum_blocks(values, scales, bits=bits))
    expected = functools.reduce(np.add, list(np_dequantize_blocks(values, scales, bits)))
    np.testing.assert_array_equal(eager, expected)
    np.testing.assert_array_equal(compiled, expected)


def test_max_scale_keeps_qmax_times_scale_finite():
    """The cap is a 16-bit float whose product with qmax is finite, and the next 16-bit
    float up is not; a block at the float32 maximum gets it as its scale."""
    top = np.float32(np.finfo(np.float32).max)
    for bits in ALL_BITS:
        m, cap = quant.qmax(bits), quant.max_scale(bits)
        mantissa, exponent = np.frexp(cap)
        assert mantissa * 2.0**quant.SCALE_BITS == round(mantissa * 2.0**quant.SCALE_BITS)
        assert np.isfinite(np.float32(m) * np.float32(cap))
        assert m * (cap + 2.0 ** (exponent - quant.SCALE_BITS)) > float(top)
        got = quant.block_scales(jnp.asarray([top, np.nextafter(top, 0)], jnp.float32), bits)
        np.testing.assert_array_equal(np.asarray(got), np.float32(cap))


@pytest.mark.parametrize(
    ("bits", "out_bits", "stochastic"),
    [(8, 8, False), (4, 4, True), (8, 4, False), (4, 8, True), (2, 8, False)],
)
def test_dequantize_sum_quantize_blocks(bits, out_bits, stochastic):
    values, scales = stacked_sets(4, bits, seed=bits + out_bits)
    key = jax.random.key(3) if stochastic else None
    v, s = dequantize_sum_quantize_blocks(values, scales, bits=bits, out_bits=out_bits, key=key)
    assert v.shape == (6, 64 * out_bits // 8) and s.shape == (6,)
    # One more quantization event, on a float32 sum within the summation bound of the exact
    # sum: within half a step (a full step, stochastic) of that float32 sum.
    exact, sum_bound = sum_error_bound(values, scales, bits)
    step = f64(s)[:, None] * np.ones((1, 64))
    near = np.abs(exact) + sum_bound
    bound = (sr_bound if stochastic else rtn_bound)(near, step) + sum_bound
    y = f64(dequantize_blocks(v, s, bits=out_bits))
    assert_within(np.abs(y - exact), bound, "re-quantized sum")
