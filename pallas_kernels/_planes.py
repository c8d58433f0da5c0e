"""In-kernel helpers for the packed block layout of `zeropp_jax.wire.quant`.

A block of `block_size` values at `bits` bits is stored as `k = 8 // bits` planes of
`block_size // k` values; value `j` of plane `i` sits in bits `[bits*i, bits*(i+1))` of byte
`j`. Kernels work on *fine planes*: the block cut into `kf` equal column ranges, `kf` a
multiple of `k` (the fused kernel uses the finer of its input and output layouts). Fine plane
`f` covers columns `[f*w, (f+1)*w)` with `w = block_size // kf`; at `bits` it is sub-range
`s = f % r` of plane `i = f // r` (`r = kf // k`), i.e. bytes `[s*w, (s+1)*w)` shifted by
`bits*i`. Refs of packed values are therefore viewed as `(..., rows, r, w)` (a free reshape
of `(..., rows, bytes)` in HBM) and refs of floats as `(rows, kf, w)`, so a kernel only ever
loads and stores whole `(rows, w)` tiles and never slices a value in registers (Triton can't).

The functions compute what the jnp reference computes as XLA compiles it (see
`quantize_fine_planes` and `dequantize_sum_fine_planes` for the two places where that
differs from the source text); see `_tiling.py` for the Triton-specific precautions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels._tiling import qmax

_ABS_MASK = np.int32(0x7FFFFFFF)
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = np.float32(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32
_BIG_SCALE = 2.0**126  # a scale at least this large has a subnormal reciprocal
# Scales are rounded up to `quant.SCALE_BITS` = 16 significant bits (so that `q * scale` is
# exact): their low 8 mantissa bits are zero, and `_max_scale` caps them near the top.
_SCALE_BITS = 16
_SCALE_LOW = 2 ** (24 - _SCALE_BITS) - 1


def _max_scale(m: int) -> float:
    """`zeropp_jax.wire.quant.max_scale`: the largest float32 of `_SCALE_BITS` significant bits
    whose product with `qmax = m` is finite."""
    v = _F32_MAX / m
    ulp = 2.0 ** (math.frexp(v)[1] - _SCALE_BITS)
    s = math.floor(v / ulp) * ulp
    while m * s > _F32_MAX:
        s -= ulp
    return s


def layout(bits: int, block_size: int, kf: int) -> tuple[int, int]:
    """`(r, w)`: sub-ranges per plane and fine-plane width for `kf` fine planes."""
    return kf // (8 // bits), block_size // kf


def rows_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Broadcasts a per-row `(rows,)` array to `shape` `(rows, ...)`."""
    return jax.lax.broadcast_in_dim(x, shape, (0,))


def load(ref, mask: jax.Array | None) -> jax.Array:
    """Loads a tile; rows outside the array (mask False) read as garbage, which is harmless:
    rows never mix, and their results are not stored."""
    if mask is None:
        return ref[...]
    from jax.experimental.pallas import triton as pltriton

    return pltriton.load(ref, mask=rows_to(mask, ref.shape))


def store(ref, value: jax.Array, mask: jax.Array | None) -> None:
    """Stores a tile, skipping rows outside the array (mask False)."""
    if mask is None:
        ref[...] = value
        return
    from jax.experimental.pallas import triton as pltriton

    pltriton.store(ref, value, mask=rows_to(mask, ref.shape))


def index(n: int) -> jax.Array:
    """A static index as a 0-d int32 array: the interpreter's masked load and store reject a
    Python int index, and the Triton lowering takes one indexer per access, so refs are
    indexed once, as `ref.at[index(g), :, index(s), :]`, never as `ref.at[g].at[...]`."""
    return jnp.int32(n)


def unpack_fine_planes(
    v_ref, *, bits: int, kf: int, mask: jax.Array | None, lead: tuple = ()
) -> list[jax.Array]:
    """The `kf` fine planes of quantized values in a packed ref `(*lead, rows, r, w)`
    (`lead`: static indices of the leading axes), as float32 `(rows, w)`."""
    per_byte = 8 // bits
    r = kf // per_byte
    pre = tuple(index(n) for n in lead)
    subs = [load(v_ref.at[(*pre, slice(None), index(s), slice(None))], mask) for s in range(r)]
    if bits == 8:
        return [sub.astype(jnp.float32) for sub in subs]
    subs = [sub.astype(jnp.int32) for sub in subs]
    field, offset = 2**bits - 1, 2 ** (bits - 1)
    planes = []
    for f in range(kf):
        i, s = divmod(f, r)
        u = (subs[s] >> (bits * i)) & field
        planes.append((u - offset).astype(jnp.float32))
    return planes


def pack_fine_planes(
    o_ref, q_planes: list[jax.Array], *, bits: int, mask: jax.Array | None
) -> None:
    """Packs `kf` fine planes of integer-valued float32 `q` into a ref `(rows, r, w)`."""
    kf = len(q_planes)
    per_byte = 8 // bits
    r = kf // per_byte
    if bits == 8:
        for s in range(r):
            store(o_ref.at[:, index(s), :], q_planes[s].astype(jnp.int8), mask)
        return
    offset = 2 ** (bits - 1)
    for t in range(r):
        byte = None
        for i in range(per_byte):
            u = (q_planes[i * r + t].astype(jnp.int32) + offset) << (bits * i)
            byte = u if byte is None else byte | u
        store(o_ref.at[:, index(t), :], byte.astype(jnp.uint8), mask)


def divide(x: jax.Array, y: jax.Array, *, exact_asm: bool) -> jax.Array:
    """`x / y` (same shapes), correctly rounded: `exact_asm` uses PTX `div.rn.f32`, as
    Triton's `/` is the approximate `div.full.f32`; without it, plain `/` (interpret mode)."""
    if not exact_asm:
        return x / y
    from jax.experimental.pallas import triton as pltriton

    [out] = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[x, y],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return out


def round_half_even(x: jax.Array) -> jax.Array:
    """`jnp.round(x)` (ties to even) from `floor`, which Triton has and `round` it has not.

    `x - floor(x)` is exact, so the comparisons with 0.5 are too (adding 0.5 first would
    round 0.49999997 up). The `(x + 1.5 * 2**23) - 1.5 * 2**23` trick is out: XLA:CPU
    simplified it away in interpret mode (jax 0.10). Clipping to `[-qmax, qmax]` before
    rounding equals clipping after it.
    """
    fl = jnp.floor(x)
    frac = x - fl
    half = fl * np.float32(0.5)
    odd = half != jnp.floor(half)
    up = (frac > np.float32(0.5)) | ((frac == np.float32(0.5)) & odd)
    return jnp.where(up, fl + np.float32(1), fl)


def quantize_fine_planes(
    planes: list[jax.Array],
    *,
    bits: int,
    noise: list[jax.Array] | None,
    exact_asm: bool,
) -> tuple[list[jax.Array], jax.Array]:
    """Quantizes the rows spread over float32 fine `planes` `(rows, w)`.

    Returns integer-valued float32 planes in `[-qmax, qmax]` and float32 scales `(rows,)`,
    computed as `zeropp_jax.wire.quant.quantize_blocks` does: absmax over the bits of `|x|`;
    `scale = absmax * fl(1 / qmax)`, at least `2**-126` when absmax > 0, then (if positive
    and finite) rounded up to 16 significant bits and capped where `qmax * scale` would
    overflow; `safe = scale or 1`, pre-scaled by `2**-63` with
    `x` when `safe >= 2**126` (2 bits only); `q = clip(round(x * fl(1 / safe)))` (ties to
    even) or `clip(floor(x * fl(1 / safe) + noise))`, and 0 where that is NaN.
    """
    m = qmax(bits)
    fm = np.float32(m)
    # absmax over the bits of |x|: for non-negative floats the int32 order is the float
    # order, with every NaN above +inf, so a NaN anywhere in the row makes absmax NaN
    # (a float `max` on Triton is `maxnumf`, which drops NaN, and XLA:CPU's reduce-max drops
    # it too for some shapes, openxla/xla#21461).
    amax_bits = None
    for p in planes:
        b = jnp.max(jax.lax.bitcast_convert_type(p, jnp.int32) & _ABS_MASK, axis=1)
        amax_bits = b if amax_bits is None else jnp.maximum(amax_bits, b)
    absmax = jax.lax.bitcast_convert_type(amax_bits, jnp.float32)
    scales = absmax * (np.float32(1) / fm)
    scales = jnp.where(absmax > 0, jnp.maximum(scales, _F32_TINY), scales)
    raw = jax.lax.bitcast_convert_type(scales, jnp.int32)
    up = jax.lax.bitcast_convert_type((raw + _SCALE_LOW) & ~_SCALE_LOW, jnp.float32)
    cap = np.float32(_max_scale(m))
    up = jnp.where(up > cap, cap, up)
    scales = jnp.where(jnp.isfinite(scales) & (scales > np.float32(0)), up, scales)
    safe = jnp.where(scales > 0, scales, np.float32(1))
    pre = None
    if m * _BIG_SCALE <= _F32_MAX:  # only a 2-bit scale can reach 2**126
        pre = jnp.where(safe >= np.float32(_BIG_SCALE), np.float32(2.0**-63), np.float32(1))
        safe = safe * pre
    recip = divide(jnp.full(safe.shape, 1, jnp.float32), safe, exact_asm=exact_asm)
    out = []
    for f, p in enumerate(planes):
        if pre is not None:
            p = p * rows_to(pre, p.shape)
        y = p * rows_to(recip, p.shape)
        if noise is None:
            r = round_half_even(jnp.minimum(jnp.maximum(y, -fm), fm))
        else:
            r = jnp.minimum(jnp.maximum(jnp.floor(y + noise[f]), -fm), fm)
        out.append(jnp.where(jnp.isnan(y), np.float32(0), r))
    return out, scales


def dequantize_sum_fine_planes(
    v_ref, s_ref, *, bits: int, kf: int, mask: jax.Array | None
) -> list[jax.Array]:
    """`sum_g q[g] * scale[g]` over the leading axis of `v_ref` `(G, rows, r, w)` and
    `s_ref` `(G, rows)`, left to right in float32, as `kf` fine planes `(rows, w)`.

    Written as the reference is: `acc = p0; acc = acc + p_g`. Compilers may contract
    `acc + q * s` into an FMA (XLA:CPU does, and on the first add it fuses `p0` or `p1`
    depending on G); that cannot change a bit, since every product is exact: scales have at
    most 16 significant bits and `|q| <= 2**7` at most 8 (see `quantize_fine_planes`)."""
    acc = None
    for g in range(v_ref.shape[0]):
        q = unpack_fine_planes(v_ref, bits=bits, kf=kf, mask=mask, lead=(g,))
        scale = load(s_ref.at[index(g), :], mask)
        terms = [p * rows_to(scale, p.shape) for p in q]
        acc = terms if acc is None else [a + t for a, t in zip(acc, terms, strict=True)]
    return acc


def program_rows(rows: int) -> pl.BlockSpec:
    """BlockSpec of a `(num_blocks,)` array of scales, `rows` per program."""
    return pl.BlockSpec((rows,), lambda j: (j,))
