"""Block Hadamard rotation: spreads a block's outliers over the block before quantizing.

`rotate_blocks(x, block_size)` multiplies every run of `block_size` consecutive values
along the last axis by the orthonormal Walsh-Hadamard matrix `H / sqrt(block_size)`
(Sylvester's construction, `block_size` a power of two). The matrix is symmetric and
orthonormal, so the rotation is its own inverse and keeps each block's L2 norm: a value
far above the rest of its block becomes `block_size` values of about its size divided by
`sqrt(block_size)`, the block's absmax (hence its quantization step) drops, and a
quantization error `e` made in the rotated basis comes back as `H e / sqrt(block_size)`,
of the same L2 norm.

The gradient hops use it per hop (`ZeroPPConfig.grad_rotation`): each device rotates
what it quantizes, the receivers sum the dequantized rotated values in float32 and rotate
the sum back, which is exact up to float32 rounding because the rotation is linear. Each
value is still quantized once per hop.

The transform runs as `log2(block_size)` butterfly stages of adds and subtracts (the fast
Walsh-Hadamard transform) and one multiply by `1 / sqrt(block_size)`: plain XLA
operations, on every backend and beside either quantization codec.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def is_power_of_two(n: object) -> bool:
    """True for an int (not a bool) that is a positive power of two."""
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and not n & (n - 1)


def check_rotation_block_size(block_size: object) -> None:
    """Raises `ValueError` unless `block_size` is a power of two (1 is the identity)."""
    if not is_power_of_two(block_size):
        raise ValueError(
            f"rotation block_size={block_size!r} is not supported; expected a positive power "
            "of two (e.g. 32, 64, 128, 256): the Hadamard matrix exists for those sizes."
        )


def hadamard_matrix(block_size: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix `H / sqrt(block_size)` (float64, symmetric),
    by Sylvester's construction; the reference `rotate_blocks` is checked against."""
    check_rotation_block_size(block_size)
    h = np.ones((1, 1))
    while h.shape[0] < block_size:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(block_size)


def rotate_blocks(x: jax.Array, block_size: int) -> jax.Array:
    """Rotates every block of `block_size` consecutive values along the last axis.

    Args:
      x: float array whose last dimension is a multiple of `block_size` (any leading
        shape; per device or global alike, the blocks never cross the last axis).
      block_size: values per rotation block, a power of two.

    Returns:
      `x @ hadamard_matrix(block_size)` block by block, in float32, shape of `x`.
      Applying it twice gives `x` back up to float32 rounding.

    Raises:
      ValueError: for a block size that is not a power of two or does not divide the
        last dimension.
    """
    check_rotation_block_size(block_size)
    if x.ndim == 0 or x.shape[-1] % block_size:
        raise ValueError(
            f"rotate_blocks: the last dimension of shape {tuple(x.shape)} is not a multiple "
            f"of the rotation block size {block_size}; pad the blocks or pick a block size "
            "that divides it."
        )
    y = x.astype(jnp.float32)
    lead, n = y.shape[:-1], y.shape[-1]
    h = 1
    while h < block_size:
        # Pairs (j, j + h) inside every run of 2h values: (a, b) -> (a + b, a - b).
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2)
        h *= 2
    return y.reshape(*lead, n) * np.float32(1 / math.sqrt(block_size))


def effective_rotation_block(rotation_block_size: int | None, quant_block: int) -> int | None:
    """The rotation block used inside quantization blocks of `quant_block` values:
    `rotation_block_size`, or `quant_block` when that is smaller (a small piece's blocks
    shrink to a power of two, see `wire.effective_block_size`); None stays None (no
    rotation).

    Raises:
      ValueError: when the rotation block does not divide the quantization block.
    """
    if rotation_block_size is None:
        return None
    check_rotation_block_size(rotation_block_size)
    rb = min(rotation_block_size, quant_block)
    if quant_block % rb:
        raise ValueError(
            f"rotation block size {rotation_block_size} does not divide the quantization "
            f"block of {quant_block} values; use a quantization block size that is a "
            "multiple of the rotation block size (or a smaller rotation block)."
        )
    return rb
