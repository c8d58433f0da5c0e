"""Error feedback for the two-hop gradient reduction (LoCo-style), as pure functions.

Each device keeps what its first quantization event lost of its own contribution and adds
it to the next step's contribution, so over many steps the reduced sums miss only the last
residual instead of the accumulated rounding errors. Not yet wired into the engine (the
residual must leave the custom-VJP backward without changing the user's train_step).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeropp_jax import collectives as C
from zeropp_jax.collectives import Format
from zeropp_jax.quant import XLA_CODEC, Codec, check_bits


def first_event_residual(
    x: jax.Array,
    *,
    bits: Format | None,
    block_size: int,
    node_bits: Format | None | str = "same",
    node_block_size: int | None = None,
    node_axis: str = "node",
    local_axis: str = "local",
    codec: Codec = XLA_CODEC,
    key: jax.Array | None = None,
) -> jax.Array:
    """`x` minus what `C.two_hop_reduce_scatter(x, ...)` (same arguments) makes of it at this
    device's first quantization event (hop 1, or hop 2 on a 1-device-per-node mesh): the
    quantization residual of this device's own contribution, float32, shape of `x`.

    The quantization is recomputed with the same blocks and the same stochastic-rounding
    key, so it is the same to the bit (and XLA's CSE may merge it with the reduction's).

    Raises:
      ValueError: when that first event is unquantized (nothing to feed back).
    """
    nn, ll = lax.axis_size(node_axis), lax.axis_size(local_axis)
    hop2_bits = bits if node_bits == "same" else node_bits
    hop2_block = block_size if node_block_size is None else node_block_size
    k1, k2 = C.hop_keys(key, node_axis=node_axis, local_axis=local_axis)
    first_bits = bits if ll > 1 else hop2_bits
    if first_bits is None:
        raise ValueError(
            "first_event_residual: the first quantization event of this mesh "
            f"(hop {1 if ll > 1 else 2}) is unquantized; give it a format."
        )
    if ll == 1:
        pieces, fmt, bs, k = nn, hop2_bits, hop2_block, k2
    elif hop2_bits is None:  # reduce_scatter_quantized's blocks: one chunk per local rank
        pieces, fmt, bs, k = ll, bits, block_size, k1
    else:
        pieces, fmt, bs, k = nn * ll, bits, block_size, k1
    check_bits(fmt, bs)
    blocks = C.shard_blocks(x, pieces, bs)
    if ll > 1 and hop2_bits is not None:  # the shape hop 1 quantizes (same noise)
        blocks = blocks.reshape(ll, -1, blocks.shape[-1])
    sent = C._dequantize(*C._quantize(blocks, fmt, codec, k), fmt, jnp.float32, codec)
    sent = sent.reshape(pieces, -1)[:, : x.size // pieces].reshape(x.shape)
    return x.astype(jnp.float32) - sent


def two_hop_reduce_scatter_with_feedback(
    x: jax.Array, residual: jax.Array, *, decay: float = 1.0, **kw: Any
) -> tuple[jax.Array, jax.Array]:
    """`two_hop_reduce_scatter` with error feedback on this device's contribution
    (LoCo-style): sends `c = x + residual` and returns `(sum, decay * residual_of(c))`, the
    new residual being what the first quantization event lost of `c` (see
    `first_event_residual`). Over steps, what the sums miss of the contributions is only
    the last residual instead of the accumulated rounding errors.

    Args:
      x: per-device gradient `(N * rows, ...)` in partition order.
      residual: float32, shape of `x` (zeros at the start).
      decay: factor on the carried residual (1 is plain error feedback).
      **kw: the keyword arguments of `two_hop_reduce_scatter`.

    Returns:
      `(float32 (rows, ...), float32 residual of x's shape)`.
    """
    c = x.astype(jnp.float32) + residual
    return C.two_hop_reduce_scatter(c, **kw), decay * first_event_residual(c, **kw)


# --------------------------------------------------------------------------- differentiable
