"""Block dequantization kernel: `zeropp_jax.wire.quant.dequantize_blocks`, bit for bit."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _planes as planes
from pallas_kernels import _tiling
from pallas_kernels._tiling import Tiling


def _dequantize_kernel(v_ref, s_ref, o_ref, *, bits: int, num_blocks: int):
    """One program: packed `v_ref` `(rows, 1, w)`, `s_ref` `(rows,)` -> `o_ref` `(rows, k, w)`."""
    rows, kf, _ = o_ref.shape
    mask = _tiling.row_mask(rows, num_blocks)
    q = planes.unpack_fine_planes(v_ref, bits=bits, kf=kf, mask=mask)
    scale = planes.load(s_ref, mask)
    for f, p in enumerate(q):
        value = (p * planes.rows_to(scale, p.shape)).astype(o_ref.dtype)
        planes.store(o_ref.at[:, planes.index(f), :], value, mask)


@_tiling.shared("bits", "dtype", "tiling", "interpret", "poison_outputs")
def dequantize_blocks(
    values: jax.Array,
    scales: jax.Array,
    *,
    bits: int,
    dtype: jnp.dtype = jnp.float32,
    tiling: Tiling | None = None,
    interpret: bool = False,
    poison_outputs: bool = False,
) -> jax.Array:
    """Dequantizes packed blocks; equal to `zeropp_jax.wire.quant.dequantize_blocks`.

    Args:
      values: int8 `(..., block_size)` for 8 bits, packed uint8 `(..., block_size * bits // 8)`
        for 4 and 2 bits (per shard inside `shard_map`).
      scales: float32 `(...)`.
      bits: 8, 4 or 2.
      dtype: float dtype of the result (`q * scale` in float32, then cast).
      tiling: tile sizes; None picks them from the block size.
      interpret: run the kernel in the Pallas interpreter (CPU).
      poison_outputs: start from a NaN-filled output (testing aid).

    Returns:
      `(..., block_size)` of `dtype`.
    """
    if isinstance(bits, bool) or bits not in _tiling.BITS:
        raise ValueError(f"bits={bits!r} is not supported; expected one of {_tiling.BITS}.")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a float dtype, got {dtype}.")
    lead = scales.ndim
    _tiling.check_packed(values, scales, bits, lead)
    per_byte = 8 // bits
    width = values.shape[-1]
    block_size = width * per_byte
    _tiling.check_bits(bits, block_size, interpret=interpret)
    cfg = tiling or Tiling()
    num_blocks = math.prod(scales.shape)
    if num_blocks == 0:
        return jnp.zeros((*scales.shape, block_size), dtype)
    rows = cfg.rows_for(num_blocks, block_size)
    (out,) = _tiling.call(
        functools.partial(_dequantize_kernel, bits=bits, num_blocks=num_blocks),
        [values.reshape(num_blocks, 1, width), scales.reshape(num_blocks)],
        grid=_tiling.num_programs(num_blocks, rows),
        in_specs=[
            pl.BlockSpec((rows, 1, width), lambda j: (j, 0, 0)),
            planes.program_rows(rows),
        ],
        out_specs=[pl.BlockSpec((rows, per_byte, width), lambda j: (j, 0, 0))],
        out_shapes=[((num_blocks, per_byte, width), jnp.dtype(dtype))],
        tiling=cfg,
        interpret=interpret,
        poison_outputs=poison_outputs,
        name=f"dequantize_blocks_{bits}bit",
    )
    return out.reshape(*scales.shape, block_size)
