"""`kernels.pallas_codec` against the reference `quant.XLA_CODEC`: bit for bit, interpreted.

Tiny inputs (interpret mode compiles every call): the kernels themselves are tested in
`test_pallas_kernels.py`; here, that the codec binds them and takes the call signatures the
collectives use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from zeropp_jax.wire import kernels, quant

# The reference, jitted as the collectives run it (and so that each test compiles it once,
# not op by op).
XLA = quant.Codec(
    jax.jit(quant.quantize_blocks, static_argnames="bits"),
    jax.jit(quant.dequantize_blocks, static_argnames=("bits", "dtype")),
    jax.jit(quant.dequantize_sum_blocks, static_argnames="bits"),
    jax.jit(quant.dequantize_sum_quantize_blocks, static_argnames=("bits", "out_bits")),
)


def _assert_same_bits(got: jax.Array, want: jax.Array) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def _blocks(seed: int, bits: int) -> jax.Array:
    """float32 `(5, 16)`: normal, large, small and all-zero blocks, and exact rounding ties."""
    x = np.array(jax.random.normal(jax.random.key(seed), (5, 16)), np.float32)
    m = quant.qmax(bits)
    x[0] *= 1e4
    x[1] *= 1e-4
    x[2] = 0.0
    x[3] = [float(m)] + [(j % (2 * m)) - m + 0.5 for j in range(15)]  # scale 1: k + 0.5
    return jnp.asarray(x)


def _stack(x: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """Two reference-quantized block sets, of `x` and `-2 x`: values `(2, 5, bytes)`,
    scales `(2, 5)`."""
    v1, s1 = XLA.quantize_blocks(x, bits=bits)
    v2, s2 = XLA.quantize_blocks(-2.0 * x, bits=bits)
    return jnp.stack([v1, v2]), jnp.stack([s1, s2])


def test_pallas_codec_binds_the_kernels():
    for interpret in (False, True):
        codec = kernels.pallas_codec(interpret=interpret)
        assert isinstance(codec, quant.Codec)
        assert codec is kernels.pallas_codec(interpret=interpret)
        assert all(f.keywords == {"interpret": interpret} for f in codec)
    assert [f.func for f in kernels.pallas_codec(interpret=False)] == [
        pallas_kernels.quantize_blocks,
        pallas_kernels.dequantize_blocks,
        pallas_kernels.dequantize_sum_blocks,
        pallas_kernels.dequantize_sum_quantize_blocks,
    ]
    assert kernels.pallas_codec(interpret=True) != kernels.pallas_codec(interpret=False)


@pytest.mark.parametrize("interpret", ["yes", 1, None])
def test_pallas_codec_rejects_a_non_bool(interpret):
    with pytest.raises(ValueError, match=f"interpret={interpret!r} is not supported"):
        kernels.pallas_codec(interpret=interpret)


@pytest.mark.parametrize("bits,out_bits", [(8, 4), (4, 2), (2, 8)])
def test_pallas_codec_equals_xla_codec(bits, out_bits):
    """Quantize, dequantize and the fused requantizing sum at each bit width."""
    pallas, xla = kernels.pallas_codec(interpret=True), XLA
    x = _blocks(bits, bits)
    v, s = pallas.quantize_blocks(x, bits=bits)
    rv, rs = xla.quantize_blocks(x, bits=bits)
    _assert_same_bits(v, rv)
    _assert_same_bits(s, rs)
    _assert_same_bits(
        pallas.dequantize_blocks(rv, rs, bits=bits, dtype=jnp.bfloat16),
        xla.dequantize_blocks(rv, rs, bits=bits, dtype=jnp.bfloat16),
    )
    vs, ss = _stack(x, bits)
    for g, w in zip(
        pallas.dequantize_sum_quantize_blocks(vs, ss, bits=bits, out_bits=out_bits),
        xla.dequantize_sum_quantize_blocks(vs, ss, bits=bits, out_bits=out_bits),
        strict=True,
    ):
        _assert_same_bits(g, w)


def test_pallas_codec_sum_and_stochastic_rounding_equal_xla_codec():
    pallas, xla = kernels.pallas_codec(interpret=True), XLA
    x = _blocks(0, 4)
    vs, ss = _stack(x, 4)
    _assert_same_bits(
        pallas.dequantize_sum_blocks(vs, ss, bits=4), xla.dequantize_sum_blocks(vs, ss, bits=4)
    )
    key = jax.random.key(1)
    for g, w in zip(
        pallas.quantize_blocks(x, bits=2, key=key),
        xla.quantize_blocks(x, bits=2, key=key),
        strict=True,
    ):
        _assert_same_bits(g, w)
