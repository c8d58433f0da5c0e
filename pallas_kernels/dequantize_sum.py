"""Fused dequantize-and-sum kernel: `zeropp_jax.wire.quant.dequantize_sum_blocks`, bit for bit."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _planes as planes
from pallas_kernels import _tiling
from pallas_kernels._tiling import Tiling


def _dequantize_sum_kernel(v_ref, s_ref, o_ref, *, bits: int, num_blocks: int):
    """One program: `v_ref` `(G, rows, 1, w)`, `s_ref` `(G, rows)` -> `o_ref` `(rows, k, w)`."""
    rows, kf, _ = o_ref.shape
    mask = _tiling.row_mask(rows, num_blocks)
    acc = planes.dequantize_sum_fine_planes(v_ref, s_ref, bits=bits, kf=kf, mask=mask)
    for f, a in enumerate(acc):
        planes.store(o_ref.at[:, planes.index(f), :], a, mask)


@_tiling.shared("bits", "tiling", "interpret", "poison_outputs")
def dequantize_sum_blocks(
    values: jax.Array,
    scales: jax.Array,
    *,
    bits: int,
    tiling: Tiling | None = None,
    interpret: bool = False,
    poison_outputs: bool = False,
) -> jax.Array:
    """Dequantizes `G` stacked block sets and sums them left to right in float32; equal to
    `zeropp_jax.wire.quant.dequantize_sum_blocks` (one read of the packed data, one write).

    Args:
      values: packed values `(G, num_blocks, bytes_per_block)` (per shard: e.g. the chunks
        an all-to-all received, one per source device).
      scales: float32 `(G, num_blocks)`.
      bits: 8, 4 or 2.
      tiling: tile sizes; None picks them from the block size.
      interpret: run the kernel in the Pallas interpreter (CPU).
      poison_outputs: start from a NaN-filled output (testing aid).

    Returns:
      float32 `(num_blocks, block_size)`.

    The fold is `acc + q * s`; the compiler may contract it into an FMA differently from
    how XLA compiles the reference (XLA:CPU fuses a G-dependent product into the first add)
    without changing a bit, since each `q * s` is exact for scales of at most 16 significant
    bits, as every scale the quantizers produce (see `_planes.py`).
    """
    if isinstance(bits, bool) or bits not in _tiling.BITS:
        raise ValueError(f"bits={bits!r} is not supported; expected one of {_tiling.BITS}.")
    _tiling.check_packed(values, scales, bits, 2)
    groups, num_blocks, width = values.shape
    if groups == 0:
        raise ValueError("dequantize_sum_blocks needs at least one block set (G >= 1).")
    per_byte = 8 // bits
    block_size = width * per_byte
    _tiling.check_bits(bits, block_size, interpret=interpret)
    cfg = tiling or Tiling()
    if num_blocks == 0:
        return jnp.zeros((0, block_size), jnp.float32)
    rows = cfg.rows_for(num_blocks, block_size)
    (out,) = _tiling.call(
        functools.partial(_dequantize_sum_kernel, bits=bits, num_blocks=num_blocks),
        [values.reshape(groups, num_blocks, 1, width), scales],
        grid=_tiling.num_programs(num_blocks, rows),
        in_specs=[
            pl.BlockSpec((groups, rows, 1, width), lambda j: (0, j, 0, 0)),
            pl.BlockSpec((groups, rows), lambda j: (0, j)),
        ],
        out_specs=[pl.BlockSpec((rows, per_byte, width), lambda j: (j, 0, 0))],
        out_shapes=[((num_blocks, per_byte, width), jnp.float32)],
        tiling=cfg,
        interpret=interpret,
        poison_outputs=poison_outputs,
        name=f"dequantize_sum_blocks_{bits}bit",
    )
    return out.reshape(num_blocks, block_size)
