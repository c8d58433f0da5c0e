"""How a shard travels: its wire dtype, its quantization blocks and its piece order.

Pure helpers shared by the collectives (`zeropp_jax.wire.collectives`), the weight-delta gather
(`zeropp_jax.wire._delta`) and error feedback (`zeropp_jax.wire._feedback`). Shapes are per device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from zeropp_jax.wire.quant import Codec, FormatKey, num_blocks

AxisName = str | tuple[str, ...]
Format = FormatKey
"""A quantization format: a key of `zeropp_jax.wire.quant.FORMATS`."""


def to_wire(x: jax.Array) -> jax.Array:
    """16-bit floats travel as their uint16 bits (XLA's CPU backend widens bf16 collectives
    to float32); other dtypes travel as they are."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return lax.bitcast_convert_type(x, jnp.uint16)
    return x


def from_wire(w: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Inverse of `to_wire`."""
    if w.dtype == jnp.uint16 and jnp.dtype(dtype) != jnp.uint16:
        return lax.bitcast_convert_type(w, dtype)
    return w


def _group_size(axis_name: AxisName) -> int:
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    return math.prod(lax.axis_size(a) for a in names)


def effective_block_size(piece_size: int, block_size: int) -> int:
    """The block size used for pieces of `piece_size` values: `block_size`, or less for a
    small piece, so that a piece of a few values is not padded to a whole large block on
    the wire. The smaller block is the piece size rounded up to a power of two (at least 8,
    so every bit width packs into whole bytes): the compiled Pallas kernels tile blocks in
    powers of two, and a power-of-two `block_size` then always gives a power-of-two block."""
    return min(block_size, max(8, 1 << max(0, piece_size - 1).bit_length()))


def shard_blocks(x: jax.Array, pieces: int, block_size: int) -> jax.Array:
    """Splits `x` into `pieces` equal contiguous pieces, each zero-padded to whole blocks.

    Args:
      x: array whose size is divisible by `pieces`.
      pieces: number of pieces.
      block_size: values per block; pieces smaller than a block use a smaller block (see
        `effective_block_size`).

    Returns:
      `(pieces, blocks_per_piece, block)`, so no block straddles two pieces.
    """
    flat = x.reshape(pieces, -1)
    n = flat.shape[1]
    block_size = effective_block_size(n, block_size)
    pad = num_blocks(n, block_size) * block_size - n
    if pad:
        flat = jnp.pad(flat, ((0, 0), (0, pad)))
    return flat.reshape(pieces, -1, block_size)


def unblock(blocks: jax.Array, piece_shape: Sequence[int]) -> jax.Array:
    """Inverse of `shard_blocks`: `(pieces, nb, block_size)` -> `(pieces * rows, ...)`."""
    pieces = blocks.shape[0]
    n = math.prod(piece_shape)
    flat = blocks.reshape(pieces, -1)[:, :n]
    return flat.reshape(pieces * piece_shape[0], *piece_shape[1:])


def _quantize(
    blocks: jax.Array, bits: Format, codec: Codec, key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Quantizes `(..., nb, block_size)` blocks; values `(..., nb, bytes)`, scales `(..., nb)`.
    With `key`, rounds stochastically."""
    lead = blocks.shape[:-1]
    flat = blocks.reshape(-1, blocks.shape[-1])
    if key is None:
        values, scales = codec.quantize_blocks(flat, bits=bits)
    else:
        values, scales = codec.quantize_blocks(flat, bits=bits, key=key)
    return values.reshape(*lead, -1), scales.reshape(lead)


def _dequantize(
    values: jax.Array, scales: jax.Array, bits: Format, dtype: jnp.dtype, codec: Codec
) -> jax.Array:
    """Dequantizes `(..., nb, bytes)` values into `(..., nb, block_size)` of `dtype`."""
    flat = codec.dequantize_blocks(
        values.reshape(-1, values.shape[-1]), scales.reshape(-1), bits=bits, dtype=dtype
    )
    return flat.reshape(*scales.shape, -1)


def _piece_order(stacked: jax.Array, num_nodes: int, local_size: int) -> jax.Array:
    """Reorders a node-major stack `(num_nodes * local_size, ...)` (index `n * L + l`) into
    partition order (index `l * num_nodes + n`)."""
    s = stacked.reshape(num_nodes, local_size, *stacked.shape[1:])
    return jnp.swapaxes(s, 0, 1).reshape(stacked.shape)


def _node_major(stacked: jax.Array, num_nodes: int, local_size: int) -> jax.Array:
    """Inverse of `_piece_order`."""
    s = stacked.reshape(local_size, num_nodes, *stacked.shape[1:])
    return jnp.swapaxes(s, 0, 1).reshape(stacked.shape)
