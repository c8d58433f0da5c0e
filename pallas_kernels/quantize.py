"""Block quantization kernel: `zeropp_jax.wire.quant.quantize_blocks`, bit for bit."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _planes as planes
from pallas_kernels import _tiling
from pallas_kernels._tiling import Tiling


def _quantize_kernel(x_ref, u_ref, v_ref, s_ref, *, bits: int, num_blocks: int, exact_asm: bool):
    """One program: `rows` blocks `x_ref` `(rows, k, w)` -> `v_ref` `(rows, 1, w)`, `s_ref`.

    `u_ref` (same layout as `x_ref`, float32) holds the stochastic-rounding noise, or is None.
    """
    rows, kf, _ = x_ref.shape
    mask = _tiling.row_mask(rows, num_blocks)
    xs = [planes.load(x_ref.at[:, planes.index(f), :], mask).astype(jnp.float32) for f in range(kf)]
    noise = None
    if u_ref is not None:
        noise = [planes.load(u_ref.at[:, planes.index(f), :], mask) for f in range(kf)]
    q, scales = planes.quantize_fine_planes(xs, bits=bits, noise=noise, exact_asm=exact_asm)
    planes.pack_fine_planes(v_ref, q, bits=bits, mask=mask)
    planes.store(s_ref, scales, mask)


@_tiling.shared("bits", "tiling", "interpret", "poison_outputs")
def quantize_blocks(
    blocks: jax.Array,
    *,
    bits: int,
    key: jax.Array | None = None,
    tiling: Tiling | None = None,
    interpret: bool = False,
    poison_outputs: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Quantizes rows of `blocks`; equal to `zeropp_jax.wire.quant.quantize_blocks`.

    Args:
      blocks: float `(..., block_size)` (float32, bfloat16 or float16), one quantization block
        per row; per shard when called inside `shard_map`.
      bits: 8, 4 or 2.
      key: PRNG key for stochastic rounding (`floor(x / scale + u)`); the noise `u` is drawn
        outside the kernel with the reference's own `jax.random.uniform(key, blocks.shape)`
        call and read by the kernel (4 more bytes per value), so results are bit-exact.
        None rounds to nearest, ties to even.
      tiling: tile sizes; None picks them from the block size.
      interpret: run the kernel in the Pallas interpreter (CPU).
      poison_outputs: start from NaN/-128/255-filled outputs (testing aid).

    Returns:
      `(values, scales)`: int8 `(..., block_size)` for 8 bits, uint8
      `(..., block_size * bits // 8)` packed planes for 4 and 2 bits; float32 scales `(...)`.
    """
    _tiling.check_float(blocks, "blocks")
    if blocks.ndim < 1:
        raise ValueError(f"blocks must have rank >= 1, got shape {blocks.shape}.")
    *lead, block_size = blocks.shape
    _tiling.check_bits(bits, block_size, interpret=interpret)
    cfg = tiling or Tiling()
    per_byte = 8 // bits
    width = block_size // per_byte
    num_blocks = math.prod(lead)
    vdtype = jnp.int8 if bits == 8 else jnp.uint8
    if num_blocks == 0:
        return jnp.zeros((*lead, width), vdtype), jnp.zeros(lead, jnp.float32)
    rows = cfg.rows_for(num_blocks, block_size)
    x_spec = pl.BlockSpec((rows, per_byte, width), lambda j: (j, 0, 0))
    operands = [blocks.reshape(num_blocks, per_byte, width)]
    in_specs = [x_spec]
    static = dict(bits=bits, num_blocks=num_blocks, exact_asm=not interpret)
    if key is None:

        def body(x_ref, v_ref, s_ref):
            _quantize_kernel(x_ref, None, v_ref, s_ref, **static)

    else:
        noise = jax.random.uniform(key, blocks.shape, jnp.float32)
        operands.append(noise.reshape(num_blocks, per_byte, width))
        in_specs.append(x_spec)
        body = functools.partial(_quantize_kernel, **static)
    values, scales = _tiling.call(
        body,
        operands,
        grid=_tiling.num_programs(num_blocks, rows),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((rows, 1, width), lambda j: (j, 0, 0)),
            planes.program_rows(rows),
        ],
        out_shapes=[((num_blocks, 1, width), vdtype), ((num_blocks,), jnp.float32)],
        tiling=cfg,
        interpret=interpret,
        poison_outputs=poison_outputs,
        name=f"quantize_blocks_{bits}bit",
    )
    return values.reshape(*lead, width), scales.reshape(lead)
