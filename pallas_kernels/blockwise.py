"""Whole-array block quantization on the kernels: `quantize_blockwise`, `dequantize_blockwise`.

The same signatures and results as `zeropp_jax.wire.quant`'s functions of those names, for the
integer formats (8, 4 and 2 bits): the array is flattened and its last block zero-padded in
plain jnp (`to_blocks`), the blocks go through the `quantize_blocks` / `dequantize_blocks`
kernels. `QuantizedArray` is defined here and re-exported by `zeropp_jax.wire.quant` (the
leaf package owns the type), so either package's `dequantize_blockwise` reads either's
result.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import _tiling
from pallas_kernels._tiling import Tiling
from pallas_kernels.dequantize import dequantize_blocks
from pallas_kernels.quantize import quantize_blocks


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["values", "scales"],
    meta_fields=["bits", "block_size", "shape"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """Block-quantized array.

    Attributes:
      values: int8 `(num_blocks, block_size)` for 8 bits, packed uint8
        `(num_blocks, block_size * bits // 8)` for 4 and 2 bits.
      scales: float32 `(num_blocks,)`.
      bits: 8, 4 or 2.
      block_size: values per block.
      shape: shape of the original array (the last block is zero-padded internally).
    """

    values: jax.Array
    scales: jax.Array
    bits: int
    block_size: int
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of original values."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of payload plus scales."""
        return self.values.size * self.values.dtype.itemsize + self.scales.size * 4


def to_blocks(x: jax.Array, block_size: int) -> jax.Array:
    """Flattens `x` and zero-pads it into `(ceil(x.size / block_size), block_size)`."""
    flat = x.reshape(-1)
    pad = -flat.size % block_size
    if pad:
        flat = jnp.pad(flat, (0, pad))
    return flat.reshape(-1, block_size)


def quantize_blockwise(
    x: jax.Array,
    *,
    bits: int,
    block_size: int,
    key: jax.Array | None = None,
    tiling: Tiling | None = None,
    interpret: bool = False,
) -> QuantizedArray:
    """Block-quantizes `x` (any shape and size; flattened, last block zero-padded).

    Args:
      x: float array (float32, bfloat16 or float16); per shard when called inside
        `shard_map`.
      bits: 8, 4 or 2 (fp8 formats are the jnp reference's only).
      block_size: values per block (one float32 scale each), a multiple of the values per
        byte (`8 // bits`); a power of two unless `interpret`.
      key: a PRNG key for stochastic rounding; None rounds to nearest (ties to even).
      tiling: tile sizes; None picks them from the block size.
      interpret: run the kernel in the Pallas interpreter (CPU).

    Returns:
      A `QuantizedArray` holding `ceil(x.size / block_size)` blocks.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(f"block_size={block_size!r} is not supported; expected a positive int.")
    _tiling.check_bits(bits, block_size, interpret=interpret)
    _tiling.check_float(x, "x")
    values, scales = quantize_blocks(
        to_blocks(x, block_size), bits=bits, key=key, tiling=tiling, interpret=interpret
    )
    return QuantizedArray(values, scales, bits, block_size, tuple(x.shape))


def dequantize_blockwise(
    q: QuantizedArray,
    dtype: jnp.dtype = jnp.float32,
    *,
    tiling: Tiling | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Dequantizes `q` back to its original shape in `dtype`.

    Args:
      q: a `QuantizedArray` of this package or of `zeropp_jax.wire.quant` (integer formats).
      dtype: float dtype of the result (`q * scale` in float32, then cast).
      tiling: tile sizes; None picks them from the block size.
      interpret: run the kernel in the Pallas interpreter (CPU).

    Returns:
      `q.shape` of `dtype`.
    """
    blocks = dequantize_blocks(
        q.values, q.scales, bits=q.bits, dtype=dtype, tiling=tiling, interpret=interpret
    )
    return blocks.reshape(-1)[: math.prod(q.shape)].reshape(q.shape)
