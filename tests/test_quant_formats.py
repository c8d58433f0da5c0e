"""Tests of the quantizer's formats and arguments (`zeropp_jax.wire.quant`): the format
table every format reads, and the errors for bits, block sizes and dtypes it does not take."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from zeropp_jax import _config as config
from zeropp_jax.wire import quant

# ---------------------------------------------------------------------------------------
# argument validation


@pytest.mark.parametrize("bits", [3, 16, 1, 0, -8, True, 8.0, 4.0, "8", None])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match=re.escape(f"bits={bits!r}")):
        quant.quantize_blockwise(jnp.ones(8), bits=bits, block_size=8)


@pytest.mark.parametrize(
    ("bits", "block_size"),
    [(8, 0), (8, -8), (8, 7.5), (8, True), (8, "64"), (8, None), (4, 7), (2, 6), (2, 2)],
)
def test_bad_block_size(bits, block_size):
    with pytest.raises(ValueError, match=re.escape(f"block_size={block_size!r}")):
        quant.quantize_blockwise(jnp.ones(8), bits=bits, block_size=block_size)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_])
def test_non_float_input(dtype):
    with pytest.raises(ValueError, match=jnp.dtype(dtype).name):
        quant.quantize_blockwise(jnp.ones(8, dtype), bits=8, block_size=8)


def test_check_bits_accepts_every_supported_pair():
    for bits, spec in quant.FORMATS.items():
        for block_size in (spec.values_per_byte, 8, 64, 256):
            quant.check_bits(bits, block_size)


# ---------------------------------------------------------------------------------------
# the format table: `quant.FORMATS` is what every format reads

# What each format must be, written out independently of the table:
# (bits on the wire, values per byte, qmax, fp8 grid, packed dtype, unpacked dtype).
EXPECTED_FORMATS = {
    8: (8, 1, 127, False, jnp.int8, jnp.int8),
    4: (4, 2, 7, False, jnp.uint8, jnp.int8),
    2: (2, 4, 1, False, jnp.uint8, jnp.int8),
    "e4m3": (8, 1, 448, True, jnp.uint8, jnp.float8_e4m3fn),
}
NOT_FORMATS = (3, 16, 1, 0, "e5m2", "fp8", "E4M3", "8", 8.0, True)


def test_format_table_rows():
    assert tuple(quant.FORMATS) == tuple(EXPECTED_FORMATS)
    assert quant.BITS == (8, 4, 2)
    for key, spec in quant.FORMATS.items():
        *numbers, values_dtype, code_dtype = EXPECTED_FORMATS[key]
        assert spec.key == key
        assert [spec.bits, spec.values_per_byte, spec.qmax, spec.is_float] == numbers, key
        assert jnp.dtype(spec.values_dtype) == jnp.dtype(values_dtype), key
        assert jnp.dtype(spec.code_dtype) == jnp.dtype(code_dtype), key
        assert jnp.dtype(spec.scale_dtype) == jnp.float32, key
        # The helpers answer from the row.
        assert quant.format_of(key) is spec
        assert quant.qmax(key) == spec.qmax
        assert quant.values_per_byte(key) == spec.values_per_byte
        assert quant.is_float_format(key) is spec.is_float
        assert quant.min_scale(key) == spec.min_scale


@pytest.mark.parametrize("key", list(EXPECTED_FORMATS))
def test_every_format_travels_as_its_row_says(key):
    """Bytes per value, dtypes and the largest code come from quantizing, not the table."""
    spec = quant.FORMATS[key]
    block_size, nb = 64, 3
    x = jnp.linspace(-1.0, 1.0, nb * block_size, dtype=jnp.float32)
    q = quant.quantize_blockwise(x, bits=key, block_size=block_size)
    assert q.values.dtype == spec.values_dtype
    assert q.values.nbytes * 8 == spec.bits * x.size  # packed bits per value on the wire
    assert q.values.shape == (nb, block_size // spec.values_per_byte)
    assert q.scales.dtype == spec.scale_dtype and q.scales.shape == (nb,)
    codes = quant.unpack(q.values, key)
    assert codes.dtype == spec.code_dtype
    # Each block's absmax (its first or last value) lands on the largest code, `qmax`.
    assert np.abs(np.asarray(codes, np.float32)).max() == spec.qmax
    if spec.is_float:
        assert spec.qmax == float(jnp.finfo(spec.code_dtype).max)
    else:
        assert spec.qmax == 2 ** (spec.bits - 1) - 1
    # A block size must hold whole bytes.
    quant.check_bits(key, spec.values_per_byte)
    if spec.values_per_byte > 1:
        with pytest.raises(ValueError, match="values per byte"):
            quant.check_bits(key, spec.values_per_byte + 1)


@pytest.mark.parametrize("bad", NOT_FORMATS, ids=repr)
def test_format_of_rejects_other_formats_naming_the_table(bad):
    with pytest.raises(ValueError) as info:
        quant.format_of(bad)
    msg = str(info.value)
    assert f"bits={bad!r}" in msg and str(tuple(quant.FORMATS)) in msg, msg
    assert "zeropp_jax.wire.quant.FORMATS" in msg, msg


def test_config_accepts_exactly_the_table_formats():
    assert config.WEIGHT_BITS == config.GRAD_BITS == (None, *quant.FORMATS)
    for key in quant.FORMATS:
        cfg = config.ZeroPPConfig(
            weight_bits=key, grad_bits=key, grad_node_bits=key, weight_delta_bits=key
        )
        assert (cfg.weight_bits, cfg.grad_bits, cfg.grad_hop2_bits) == (key, key, key)
    for field in ("weight_bits", "grad_bits", "grad_node_bits", "weight_delta_bits"):
        for bad in NOT_FORMATS:
            with pytest.raises(ValueError) as info:
                config.ZeroPPConfig(**{field: bad})
            msg = str(info.value)
            assert f"{field}={bad!r}" in msg, msg
            # The allowed values end with the table's keys ("(None, 8, ..." or "('same', ...").
            assert f"None, {repr(tuple(quant.FORMATS))[1:]}" in msg, msg
            assert "zeropp_jax.wire.quant.FORMATS" in msg, msg
