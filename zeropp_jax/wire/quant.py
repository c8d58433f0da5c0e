"""Block quantization: the reference (plain jnp) quantizer every collective uses.

Symmetric absmax per block of `block_size` consecutive values: `scale = absmax / qmax` with
`qmax = 2**(bits-1) - 1`, rounded up to `SCALE_BITS` significant bits and kept normal (see
`block_scales`), `q = round(x / scale)` in `[-qmax, qmax]`, `x ~= q * scale`. The
round-trip error of a value is at most half a step, `scale / 2`, with round-to-nearest (plus
float32 rounding of the arithmetic). Every product `q * scale` is exact in float32, so
dequantizing, and summing dequantized values, gives the same bits however a compiler fuses
the arithmetic (see `dequantize_sum_blocks`).

Formats. `FORMATS` is the one table of formats: each row (a `FormatSpec`) gives what
`bits` may say, its bits on the wire, its packing, `qmax`, its grid and dtypes. The integer
rows (8, 4, 2) use the grid above; `"e4m3"` (`E4M3`) holds fp8 values
(`jnp.float8_e4m3fn`, 4 significant bits, largest 448) with the same float32 block scales,
`scale = absmax / 448` (rounded up as above), `q = fp8(x / scale)`. Its round-trip error is
at most half an fp8 ulp of `x / scale`, i.e. `max(|x| * 2**-4, scale * 2**-10)` (relative
in the normal fp8 range, absolute below `2**-6`; see `max_error`), with round-to-nearest.

Wire layout (what a collective moves):
  * 8 bits: `values` is int8 of shape `(num_blocks, block_size)`.
  * e4m3: `values` is uint8 of shape `(num_blocks, block_size)`, the bits of the fp8 values.
  * 4 and 2 bits: `values` is uint8 of shape `(num_blocks, block_size * bits // 8)`; each
    value is stored offset-binary (`q + 2**(bits-1)`) and the `8 // bits` values sharing a
    byte are taken from the `8 // bits` equal planes of the block (value `j` of plane `i`
    sits in bits `[bits*i, bits*(i+1))` of byte `j`), so packing and unpacking touch only
    contiguous slices.
  * `scales` is float32 of shape `(num_blocks,)`.

Non-finite input: a block holding NaN or Inf gets a non-finite scale, so every value of
that block dequantizes to NaN (never to a finite number); other blocks are untouched. An
all-zero block has scale 0 and dequantizes to exact zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.blockwise import QuantizedArray  # one type for both implementations

_F32_MAX = float(jnp.finfo(jnp.float32).max)
_F32_TINY = float(jnp.finfo(jnp.float32).tiny)  # 2**-126, the smallest normal float32

FormatKey = int | str
"""A key of `FORMATS`, as configs and `bits` arguments spell a format: an integer width or
the name of an fp8 format."""


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """One row of `FORMATS`: a quantization format's grid and how it travels.

    Attributes:
      key: the format as configs and `bits` arguments spell it.
      bits: bits per value on the wire.
      qmax: largest quantized magnitude (`2**(bits-1) - 1` on an integer grid).
      is_float: True for an fp8 grid (`code_dtype`), False for an integer grid.
      code_dtype: dtype of the unpacked values (`unpack`'s result).
      values_dtype: dtype of the packed values on the wire.
      scale_dtype: dtype of the per-block scales (one per block, on the wire beside the
        values).
      min_scale: smallest nonzero scale (see `min_scale`).
    """

    key: FormatKey
    bits: int
    qmax: int
    is_float: bool
    code_dtype: Any
    values_dtype: Any
    scale_dtype: Any = jnp.float32
    min_scale: float = _F32_TINY

    def __post_init__(self) -> None:
        if self.bits not in (1, 2, 4, 8):
            raise ValueError(
                f"FormatSpec {self.key!r}: bits={self.bits!r}; expected 1, 2, 4 or 8, so that "
                "values pack into whole bytes."
            )

    @property
    def values_per_byte(self) -> int:
        """Values that share one byte on the wire; a block size must be a multiple of it."""
        return 8 // self.bits


def _integer_format(bits: int) -> FormatSpec:
    """The row of an integer width: 8 bits travel as int8, narrower ones packed in uint8."""
    return FormatSpec(
        key=bits,
        bits=bits,
        qmax=2 ** (bits - 1) - 1,
        is_float=False,
        code_dtype=jnp.int8,
        values_dtype=jnp.int8 if bits == 8 else jnp.uint8,
    )


E4M3 = "e4m3"
"""The fp8 format: `jnp.float8_e4m3fn` values with float32 block scales."""
E4M3_MAX = 448.0
_E4M3_MIN_EXP = -6  # the smallest normal e4m3 is 2**-6; below it the spacing is 2**-9
_E4M3_MANTISSA = 3

FORMATS: Mapping[FormatKey, FormatSpec] = types.MappingProxyType(
    {
        8: _integer_format(8),
        4: _integer_format(4),
        2: _integer_format(2),
        E4M3: FormatSpec(
            key=E4M3,
            bits=8,
            qmax=int(E4M3_MAX),
            is_float=True,
            code_dtype=jnp.float8_e4m3fn,
            values_dtype=jnp.uint8,  # the bits of the fp8 values
            # The smallest e4m3 value is 2**-9: a scale of at least 2**-117 keeps it times
            # the scale a normal float32 (XLA on CPU flushes subnormal products to zero).
            min_scale=_F32_TINY * 2.0**9,
        ),
    }
)
"""The one table of quantization formats: every value `bits` may take, and its row."""
BITS = tuple(key for key, spec in FORMATS.items() if not spec.is_float)
"""The integer widths of `FORMATS`."""


def format_of(bits: FormatKey) -> FormatSpec:
    """The row of `FORMATS` for `bits`; raises `ValueError` for anything else."""
    # Not a bool, not a float such as 8.0 that compares (and hashes) equal to a key.
    if isinstance(bits, bool) or not isinstance(bits, int | str) or bits not in FORMATS:
        raise ValueError(
            f"bits={bits!r} is not supported; expected one of {tuple(FORMATS)} (a key of "
            "zeropp_jax.wire.quant.FORMATS)."
        )
    return FORMATS[bits]


def is_float_format(bits: FormatKey) -> bool:
    """True for an fp8 format, False for an integer width (the row's `is_float`)."""
    return format_of(bits).is_float


def values_per_byte(bits: FormatKey) -> int:
    """Values that share one byte on the wire (the row's `values_per_byte`)."""
    return format_of(bits).values_per_byte


def qmax(bits: FormatKey) -> int:
    """Largest quantized magnitude for `bits` (the row's `qmax`)."""
    return format_of(bits).qmax


def check_bits(bits: FormatKey, block_size: int) -> None:
    """Raises `ValueError` unless `bits` and `block_size` can be quantized and packed."""
    per_byte = format_of(bits).values_per_byte
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size <= 0
        or block_size % per_byte
    ):
        raise ValueError(
            f"block_size={block_size!r} is not supported for bits={bits}; expected a positive "
            f"int divisible by {per_byte} (values per byte)."
        )


_BIG_SCALE = 2.0**126  # a scale at least this large has a subnormal reciprocal

SCALE_BITS = 16
"""Significant bits of every finite scale. A packed value is an integer of at most 8 bits
(`|q| <= 2**7`, at any bit width), so `q * scale` has at most `8 + 16 = 24` significant
bits: it is exact in float32, whatever `bits` is."""

_SCALE_LOW = 2 ** (24 - SCALE_BITS) - 1  # the float32 mantissa bits a scale leaves zero


def min_scale(bits: FormatKey) -> float:
    """Smallest nonzero scale (the row's `min_scale`): `2**-126` for integer widths;
    `2**-117` for e4m3, so that its smallest value, `2**-9`, times a scale stays a normal
    float32 (XLA on CPU flushes subnormal products to zero)."""
    return format_of(bits).min_scale


def max_scale(bits: FormatKey) -> float:
    """Largest float32 of `SCALE_BITS` significant bits whose product with `qmax(bits)`
    is finite (a Python float; every scale of `block_scales` is at most this)."""
    m = qmax(bits)
    v = _F32_MAX / m
    ulp = 2.0 ** (math.frexp(v)[1] - SCALE_BITS)  # v = f * 2**e, f in [0.5, 1)
    s = math.floor(v / ulp) * ulp
    while m * s > _F32_MAX:  # float64 products of these are exact
        s -= ulp
    return s


def block_absmax(blocks: jax.Array) -> jax.Array:
    """`max(|blocks|)` over the last axis, float32; NaN if the row holds a NaN.

    Taken as a halving tree of elementwise maxima over contiguous halves of the row (the row
    zero-padded to a power of two), not as a reduce: XLA:CPU's float reduce-max drops NaN
    for some shapes (arrays of a few thousand values and more, openxla/xla#21461), which
    would give a block holding NaN a finite scale and dequantize its NaN to 0, while the
    elementwise maximum propagates NaN; and the tree vectorizes across the row (about 2x
    faster on CPU than a row reduction, issue #12). `|x|` and `max` are exact, so the
    result equals the exact absmax.
    """
    a = jnp.abs(blocks.astype(jnp.float32))
    n = a.shape[-1]
    width = 1 << max(0, n - 1).bit_length()
    if width != n:
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - n)])
    while a.shape[-1] > 1:
        half = a.shape[-1] // 2
        a = jnp.maximum(a[..., :half], a[..., half:])
    return a[..., 0]


def block_scales(absmax: jax.Array, bits: FormatKey) -> jax.Array:
    """Float32 scale of each block from its absmax: `absmax * fl(1 / qmax)`, kept normal,
    rounded up to `SCALE_BITS` significant bits.

    The product with the float32 constant `fl(1 / qmax)` (within 2 float32 roundings of
    `absmax / qmax`) is spelled out because XLA compiles a division by a constant either as
    a true division or as this product depending on the array shape, so the same block would
    get a different scale in a different array. A nonzero scale is at least `2**-126`: XLA on
    CPU flushes subnormal results to zero, and a subnormal scale would turn a block of small
    normal values into zeros.

    The scale is then rounded up (toward larger magnitude, so `|x| * fl(1 / scale)` stays
    within `qmax` up to float32 rounding) to `SCALE_BITS` significant bits, which makes every
    product `q * scale` exact in float32 (see `SCALE_BITS`). This costs at most a factor
    `1 + 2**-15` on the step. `2**-126` has one significant bit, so the minimum stays normal
    (for e4m3 the minimum is `min_scale`, also a power of two).
    Near the float32 maximum the rounded scale is capped at `max_scale(bits)` so that
    `qmax * scale` stays finite: the cap is the largest `SCALE_BITS`-bit float below
    `fl32max / qmax`, so there `|x| / scale <= qmax * (1 + 2**-15) < qmax + 1/2` and
    round-to-nearest (then the clip to `qmax`) still errs by at most half a step. Zero, NaN
    and Inf pass through.
    """
    m = qmax(bits)
    scales = absmax * (np.float32(1) / np.float32(m))
    scales = jnp.where(absmax > 0, jnp.maximum(scales, min_scale(bits)), scales)
    # For a positive finite float32, rounding its bits up to a multiple of 2**(24 -
    # SCALE_BITS) rounds the value up to SCALE_BITS significant bits (a carry out of the
    # mantissa moves to the next power of two; from the largest binade it gives +Inf,
    # which the cap below replaces).
    raw = jax.lax.bitcast_convert_type(scales, jnp.int32)
    up = jax.lax.bitcast_convert_type((raw + _SCALE_LOW) & ~_SCALE_LOW, jnp.float32)
    cap = np.float32(max_scale(bits))
    up = jnp.where(up > cap, cap, up)
    return jnp.where(jnp.isfinite(scales) & (scales > 0), up, scales)


def num_blocks(size: int, block_size: int) -> int:
    """Blocks needed for `size` values."""
    return -(-size // block_size)


def to_blocks(x: jax.Array, block_size: int) -> jax.Array:
    """Flattens `x` and zero-pads it into `(num_blocks, block_size)`."""
    flat = x.reshape(-1)
    pad = num_blocks(flat.size, block_size) * block_size - flat.size
    if pad:
        flat = jnp.pad(flat, (0, pad))
    return flat.reshape(-1, block_size)


def pack(q: jax.Array, bits: FormatKey) -> jax.Array:
    """Packs int8 `q` in `[-qmax, qmax]` (for e4m3: float values on the fp8 grid in
    `[-448, 448]`), shape `(..., block_size)`, into the wire layout."""
    spec = format_of(bits)
    if spec.is_float:
        return jax.lax.bitcast_convert_type(q.astype(spec.code_dtype), spec.values_dtype)
    per_byte = spec.values_per_byte
    if per_byte == 1:
        return q.astype(spec.values_dtype)
    u = (q.astype(jnp.int32) + 2 ** (spec.bits - 1)).astype(spec.values_dtype)
    planes = u.reshape(*u.shape[:-1], per_byte, u.shape[-1] // per_byte)
    # Elementwise, so XLA:CPU fuses the whole quantizer into each peer's slice of an
    # all-to-all and never writes the packed array whole. A reduction over the planes
    # compiles the quantizer once instead of once per peer, but holds that array: +90 MB
    # per device for ZeRO++'s 6.7B step on 16 x 8 (`experiments/memory.py`; issue #48).
    out = planes[..., 0, :]
    for i in range(1, per_byte):
        out = out | (planes[..., i, :] << jnp.uint8(spec.bits * i))
    return out


def unpack(values: jax.Array, bits: FormatKey) -> jax.Array:
    """Inverse of `pack`: the row's `code_dtype` (int8, or float8_e4m3fn for e4m3) of shape
    `(..., block_size)`."""
    spec = format_of(bits)
    if spec.is_float:
        return jax.lax.bitcast_convert_type(values, spec.code_dtype)
    if spec.values_per_byte == 1:
        return values.astype(spec.code_dtype)
    return jnp.concatenate(_planes(values, spec), axis=-1)


def _planes(values: jax.Array, spec: FormatSpec) -> list[jax.Array]:
    """The int8 codes of a sub-byte integer format, one array per bit plane: plane `i`
    holds the codes `pack` put at bits `[i * spec.bits, (i + 1) * spec.bits)` of each byte,
    which are the block's values `[i * bytes, (i + 1) * bytes)`."""
    b = spec.bits
    mask = jnp.uint8(2**b - 1)
    offset = jnp.int8(2 ** (b - 1))
    return [
        ((values >> jnp.uint8(b * i)) & mask).astype(jnp.int8) - offset
        for i in range(spec.values_per_byte)
    ]


def _round_e4m3(y: jax.Array, key: jax.Array | None) -> jax.Array:
    """`y` (float32) rounded onto the e4m3 grid, clipped to `[-448, 448]`; non-finite -> 0.

    To nearest (ties even) by the fp8 conversion, or with `key` stochastically:
    `floor(y / ulp + u) * ulp` with `ulp` the e4m3 spacing at `|y|` (`2**(e - 3)` in the
    binade `[2**e, 2**(e + 1))`, `2**-9` below `2**-6`) and `u ~ U[0, 1)`, which is unbiased.
    Every operation but the add of `u` is exact (powers of two).
    """
    if key is not None:
        _, e = jnp.frexp(jnp.abs(y))  # |y| = m * 2**e, m in [0.5, 1)
        k = jnp.maximum(e - 1, _E4M3_MIN_EXP) - _E4M3_MANTISSA
        u = jax.random.uniform(key, y.shape, jnp.float32)
        y = jnp.ldexp(jnp.floor(jnp.ldexp(y, -k) + u), k)
    y = jnp.clip(y, -E4M3_MAX, E4M3_MAX)
    y = jnp.where(jnp.isfinite(y), y, 0.0)
    return y.astype(jnp.float8_e4m3fn)


@functools.partial(jax.jit, static_argnames=("bits",))
def quantize_blocks(
    blocks: jax.Array, *, bits: FormatKey, key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Quantizes rows of `blocks` `(..., block_size)`; returns packed values and scales.

    Scales have shape `blocks.shape[:-1]`, float32 (see `block_scales`). `x / scale` is
    computed as `x * fl(1 / scale)`, so that every implementation rounds alike. With `key`,
    rounds stochastically (`floor(x / scale + u)`, `u ~ U[0, 1)`), which is unbiased (under
    `jit`, XLA may fuse that product and the add of `u` into one multiply-add); else to
    nearest (ties even). For e4m3 the same holds on the fp8 grid (see `_round_e4m3`).
    """
    x = blocks.astype(jnp.float32)
    m = qmax(bits)
    scales = block_scales(block_absmax(x), bits)
    safe = jnp.where(scales > 0, scales, 1.0)
    if m * _BIG_SCALE <= _F32_MAX:
        # `1 / s` is subnormal (flushed to zero on CPU) once `s >= 2**126`, which only a 2-bit
        # scale reaches: bring such blocks down by an exact power of two first.
        pre = jnp.where(safe >= _BIG_SCALE, 2.0**-63, 1.0)
        x, safe = x * pre[..., None], safe * pre
    # An explicit reciprocal: XLA turns `x / broadcast(s)` into this product in some shapes
    # and not in others.
    y = x * (1.0 / safe)[..., None]
    if is_float_format(bits):
        return pack(_round_e4m3(y, key), bits), scales
    if key is None:
        r = jnp.round(y)
    else:
        r = jnp.floor(y + jax.random.uniform(key, y.shape, jnp.float32))
    r = jnp.clip(r, -m, m)
    r = jnp.where(jnp.isfinite(r), r, 0.0)
    return pack(r.astype(jnp.int8), bits), scales


@functools.partial(jax.jit, static_argnames=("bits", "dtype"))
def dequantize_blocks(
    values: jax.Array, scales: jax.Array, *, bits: FormatKey, dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """Dequantizes packed `values` with `scales` `(...)` into `(..., block_size)` of `dtype`."""
    q = unpack(values, bits).astype(jnp.float32)
    return (q * scales[..., None]).astype(dtype)


def quantize_blockwise(
    x: jax.Array, *, bits: FormatKey, block_size: int, key: jax.Array | None = None
) -> QuantizedArray:
    """Block-quantizes `x` (any shape and size; flattened, last block zero-padded).

    Args:
      x: float array (float32, bfloat16 or float16).
      bits: a format, a key of `FORMATS`.
      block_size: values per block (one float32 scale each), divisible by the format's
        values per byte (`FORMATS[bits].values_per_byte`).
      key: a PRNG key for stochastic rounding; None rounds to nearest.

    Returns:
      A `QuantizedArray` holding `ceil(x.size / block_size)` blocks.
    """
    check_bits(bits, block_size)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize_blockwise expects a float array, got dtype {x.dtype}.")
    values, scales = quantize_blocks(to_blocks(x, block_size), bits=bits, key=key)
    return QuantizedArray(values, scales, bits, block_size, tuple(x.shape))


def dequantize_blockwise(q: QuantizedArray, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Dequantizes `q` back to its original shape in `dtype`."""
    blocks = dequantize_blocks(q.values, q.scales, bits=q.bits, dtype=dtype)
    return blocks.reshape(-1)[: q.size].reshape(q.shape)


def step_size(x: jax.Array, *, bits: FormatKey, block_size: int) -> jax.Array:
    """Quantization step (`scale`) of the block each value of `x` falls in; shape of `x`.
    (For e4m3 the scale is the unit of `q`, not a step; see `max_error`.)"""
    blocks = to_blocks(x.astype(jnp.float32), block_size)
    scales = block_scales(block_absmax(blocks), bits)
    full = jnp.broadcast_to(scales[:, None], blocks.shape)
    return full.reshape(-1)[: x.size].reshape(x.shape)


def max_error(x: jax.Array, scale: jax.Array, bits: FormatKey) -> jax.Array:
    """Round-to-nearest error bound of each value of `x` quantized with `scale` (arrays of
    the same shape), up to float32 rounding: `scale / 2` for integer widths, half an fp8
    ulp, `max(|x| * 2**-4, scale * 2**-10)`, for e4m3."""
    if is_float_format(bits):
        return jnp.maximum(jnp.abs(x) * 2.0**-4, scale * 2.0**-10)
    return scale / 2


@functools.partial(jax.jit, static_argnames=("bits",))
def dequantize_sum_blocks(values: jax.Array, scales: jax.Array, *, bits: FormatKey) -> jax.Array:
    """Dequantizes `G` stacked block sets and sums them in float32.

    Args:
      values: packed values `(G, num_blocks, bytes_per_block)` (e.g. the chunks received
        from an all-to-all, one per source device).
      scales: float32 `(G, num_blocks)`.
      bits: the format of `values`, a key of `FORMATS`.

    Returns:
      float32 `(num_blocks, block_size)`: `sum_g dequantize(values[g], scales[g])`, summed
      left to right over `g` in float32. Under `jit`, XLA may contract a product `q * scale`
      and the add that follows into one fused multiply-add (XLA:CPU does, and which product
      it contracts depends on `G`); that changes nothing here, because every product is
      exact in float32 when the scales come from `block_scales` (at most `SCALE_BITS`
      significant bits): compiled, op by op, or in a Pallas kernel, the result is the same
      to the last bit.
    """
    spec = format_of(bits)
    if spec.is_float or spec.values_per_byte == 1:
        acc = dequantize_blocks(values[0], scales[0], bits=bits)
        for g in range(1, values.shape[0]):
            acc = acc + dequantize_blocks(values[g], scales[g], bits=bits)
        return acc
    # A sub-byte format is summed bit plane by bit plane and the planes joined once: the
    # same sums, but no join per group member, which XLA:CPU compiles into a kernel of its
    # own for each (an all-to-all's members arrive as separate buffers there).
    sums = []
    for i in range(spec.values_per_byte):
        acc = _planes(values[0], spec)[i].astype(jnp.float32) * scales[0][..., None]
        for g in range(1, values.shape[0]):
            acc = acc + _planes(values[g], spec)[i].astype(jnp.float32) * scales[g][..., None]
        sums.append(acc)
    return jnp.concatenate(sums, axis=-1)


@functools.partial(jax.jit, static_argnames=("bits", "out_bits"))
def dequantize_sum_quantize_blocks(
    values: jax.Array,
    scales: jax.Array,
    *,
    bits: FormatKey,
    out_bits: FormatKey,
    key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`dequantize_sum_blocks` followed by `quantize_blocks` at `out_bits`: the middle of the
    two-hop gradient reduction (receive the `local` hop, re-quantize for the `node` hop)."""
    return quantize_blocks(dequantize_sum_blocks(values, scales, bits=bits), bits=out_bits, key=key)


class Codec(NamedTuple):
    """One implementation of the four block operations the collectives need.

    `XLA_CODEC` is the plain-jnp reference in this module; `kernels.pallas_codec` bundles
    the same four functions as Pallas kernels (from `pallas_kernels`). The engine picks one,
    explicitly, from `ZeroPPConfig.kernels`.
    """

    quantize_blocks: Callable[..., tuple[jax.Array, jax.Array]]
    dequantize_blocks: Callable[..., jax.Array]
    dequantize_sum_blocks: Callable[..., jax.Array]
    dequantize_sum_quantize_blocks: Callable[..., tuple[jax.Array, jax.Array]]


XLA_CODEC = Codec(
    quantize_blocks, dequantize_blocks, dequantize_sum_blocks, dequantize_sum_quantize_blocks
)
