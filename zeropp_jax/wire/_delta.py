"""Weight-delta all-gather through a kept secondary shard (beyond ZeRO++), as pure functions.

With hpZ every device holds a *secondary shard*: the `num_nodes` pieces of its local rank
(see `zeropp_jax.wire.collectives`). Plain ZeRO++ rebuilds it every step with an int8 all-gather
across nodes. Here each device keeps it across steps as a *reference* (its receivers' last
reconstruction of those pieces, in the compute dtype), and each step sends across nodes only
the block-quantized difference between the new master piece and the reference's copy of it.
Sender and receivers add the same dequantized delta to the same reference, so they never
drift apart (closed loop): the reference's error is at most half a quantization step of the
last delta, it does not accumulate.

Shapes are per device (inside `jax.shard_map`): a master shard `x` is `(rows, ...)`, a
reference is `(num_nodes * rows, ...)`. In the global view a reference is an array of the
padded parameter's shape sharded `PartitionSpec('local')` (identical on every node).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from zeropp_jax.wire import collectives as C
from zeropp_jax.wire._encoding import (
    Format,
    _dequantize,
    _quantize,
    from_wire,
    shard_blocks,
    unblock,
)
from zeropp_jax.wire.quant import XLA_CODEC, Codec, check_bits


def full_reference(
    x: jax.Array,
    *,
    bits: Format | None,
    block_size: int,
    dtype: jnp.dtype,
    node_axis: str = "node",
    codec: Codec = XLA_CODEC,
) -> jax.Array:
    """The first reference: the secondary shard of a full (not delta) gather across nodes.

    What hpZ's stage 1 gathers every step, done once: at `TrainState.create` and after a
    checkpoint restore.

    Args:
      x: per-device float32 master shard `(rows, ...)`.
      bits: format of the gather (`weight_bits`, a format of `quant.FORMATS`), or None for raw
        16-bit values.
      block_size: values per quantization block.
      dtype: dtype of the reference (the compute dtype).
      node_axis: name of the inter-node mesh axis.
      codec: block quantization implementation.

    Returns:
      `(num_nodes * rows, ...)` in `dtype`.
    """
    xc = x.astype(dtype)
    wire = C.secondary_gather(
        xc, bits=bits, block_size=block_size, node_axis=node_axis, codec=codec
    )
    if bits is None:
        return from_wire(wire[0], dtype)
    return unblock(_dequantize(*wire, bits, dtype, codec), x.shape)


def own_piece(reference: jax.Array, rows: int, *, node_axis: str = "node") -> jax.Array:
    """This device's piece of its reference: the receivers' copy of its own master shard.

    Gathering over `node` puts node `n`'s piece at rows `n * rows ... (n + 1) * rows - 1`.
    """
    return lax.dynamic_slice_in_dim(reference, lax.axis_index(node_axis) * rows, rows)


def delta_all_gather(
    x: jax.Array,
    reference: jax.Array,
    *,
    bits: Format,
    block_size: int,
    node_axis: str = "node",
    codec: Codec = XLA_CODEC,
) -> jax.Array:
    """Sends the quantized change of this device's shard across nodes; returns the new
    reference.

    Each device quantizes `x - own_piece(reference)` (float32, blocks of `block_size`),
    all-gathers values and scales over `node_axis`, and adds every node's dequantized delta
    to its reference in float32 before rounding to the reference's dtype. Devices of one
    local rank hold the same reference before and after, to the bit.

    Args:
      x: per-device float32 master shard `(rows, ...)`.
      reference: per-device reference `(num_nodes * rows, ...)` (compute dtype).
      bits: format of the delta, a format of `quant.FORMATS`.
      block_size: values per quantization block.
      node_axis: name of the inter-node mesh axis.
      codec: block quantization implementation.

    Returns:
      The new reference, shape and dtype of `reference`. Its piece of node `n` is within
      half a quantization step (per block) of node `n`'s `x`, plus the rounding to the
      reference's dtype.
    """
    check_bits(bits, block_size)
    rows = x.shape[0]
    if reference.shape[0] != rows * lax.axis_size(node_axis) or reference.shape[1:] != x.shape[1:]:
        raise ValueError(
            f"delta_all_gather: reference of shape {reference.shape} does not match a shard of "
            f"shape {x.shape} on {lax.axis_size(node_axis)} nodes; expected "
            f"{(rows * lax.axis_size(node_axis), *x.shape[1:])}."
        )
    delta = x.astype(jnp.float32) - own_piece(reference, rows, node_axis=node_axis).astype(
        jnp.float32
    )
    values, scales = _quantize(shard_blocks(delta, 1, block_size)[0], bits, codec)
    gv = lax.all_gather(values, node_axis)
    gs = lax.all_gather(scales, node_axis)
    received = unblock(_dequantize(gv, gs, bits, jnp.float32, codec), x.shape)
    return (reference.astype(jnp.float32) + received).astype(reference.dtype)
