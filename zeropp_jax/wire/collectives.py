"""The ZeRO++ weight gathers: pure functions meant to run inside `jax.shard_map`.

Shapes: `x` is always the per-device array. A gather over a group of `G` devices turns a
shard of shape `(rows, ...)` into `(G * rows, ...)`; the gradient reductions, which do the
reverse, are in `zeropp_jax.wire.reductions`.

Partition layout. A parameter's leading dimension is split into `N = num_nodes * local_size`
pieces with `PartitionSpec(('local', 'node'))`: device `(n, l)` holds piece `l * num_nodes +
n`. Gathering over `node` then yields local rank `l`'s contiguous *secondary shard* (pieces
`l * num_nodes ... l * num_nodes + num_nodes - 1`, the same on every node), and gathering
that over `local` yields the full array in order.

None of these functions looks up a mesh, a device count or a config: group sizes come from
`lax.axis_size` of the axis names they are given.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from zeropp_jax.wire._encoding import (
    AxisName,
    Format,
    _dequantize,
    _group_size,
    _piece_order,
    _quantize,
    from_wire,
    shard_blocks,
    to_wire,
    unblock,
)
from zeropp_jax.wire.quant import XLA_CODEC, Codec, check_bits

# --------------------------------------------------------------------------- gathers


def _all_gather(x: jax.Array, axis_name: AxisName, *, tiled: bool, alternate: bool) -> jax.Array:
    """`lax.all_gather(x, axis_name, tiled=tiled)`, or with `alternate` the same collective
    (same bytes on the wire, same result) emitted the other way: a stacked gather plus a
    reshape for a tiled one, a tiled gather plus a reshape for a stacked one. The two forms
    lower to different HLO, so XLA's CSE cannot merge a remat re-gather (one form) with the
    forward gather (the other form); see `gather_weight`."""
    if not alternate:
        return lax.all_gather(x, axis_name, tiled=tiled)
    if tiled:
        return lax.all_gather(x, axis_name).reshape(-1, *x.shape[1:])
    return lax.all_gather(x, axis_name, tiled=True).reshape(_group_size(axis_name), *x.shape)


def all_gather_quantized(
    x: jax.Array,
    *,
    axis_name: AxisName,
    bits: Format | None,
    block_size: int,
    codec: Codec = XLA_CODEC,
) -> jax.Array:
    """qwZ: block-quantized all-gather of the per-device shard `x` along axis 0.

    Quantizes the local shard once, gathers values and scales (packed bytes for 4 and 2
    bits), dequantizes. `bits=None` gathers unquantized (16-bit floats as uint16 bits).

    Args:
      x: per-device shard `(rows, ...)`, a float array.
      axis_name: mesh axis or tuple of axes (the first one major) to gather over.
      bits: a format of `quant.FORMATS`, or None (unquantized).
      block_size: values per quantization block (blocks never straddle two shards).
      codec: block quantization implementation.

    Returns:
      `(G * rows, ...)` in `x.dtype`, shards in axis-index order.
    """
    if bits is None:
        return from_wire(lax.all_gather(to_wire(x), axis_name, tiled=True), x.dtype)
    check_bits(bits, block_size)
    values, scales = _quantize(shard_blocks(x, 1, block_size)[0], bits, codec)
    gv = lax.all_gather(values, axis_name)
    gs = lax.all_gather(scales, axis_name)
    return unblock(_dequantize(gv, gs, bits, x.dtype, codec), x.shape)


def hierarchical_all_gather(
    x: jax.Array,
    *,
    bits: Format | None,
    block_size: int,
    local_bits: Format | None,
    node_axis: str = "node",
    local_axis: str = "local",
    codec: Codec = XLA_CODEC,
) -> tuple[jax.Array, jax.Array]:
    """hpZ + qwZ: two-stage gather, over `node` (the secondary shard) then over `local`.

    The shard is quantized once; the quantized secondary shard is what the second stage
    gathers, so there is a single quantization event. With a `local_bits` other than
    `bits`, the secondary shard is re-quantized for the second stage (see
    `requantize_secondary`): a second quantization event on every value of the full array.

    Args:
      x: per-device shard `(rows, ...)` in the `('local', 'node')` partition layout.
      bits: format of stage 1 (over `node`): a format of `quant.FORMATS`, or None (unquantized;
        16-bit floats as uint16 bits).
      block_size: values per quantization block.
      local_bits: format of stage 2 (over `local`); `bits` gathers the stage-1 secondary
        shard as it is.
      node_axis: name of the inter-node mesh axis.
      local_axis: name of the intra-node mesh axis.
      codec: block quantization implementation.

    Returns:
      `(secondary, full)`: `(num_nodes * rows, ...)` and `(N * rows, ...)` in `x.dtype`;
      `secondary` is the stage-1 result.
    """
    wire = secondary_gather(x, bits=bits, block_size=block_size, node_axis=node_axis, codec=codec)
    stage2 = requantize_secondary(
        wire, x.shape, x.dtype, bits=bits, local_bits=local_bits, block_size=block_size, codec=codec
    )
    full = gather_from_secondary(
        stage2, x.shape, x.dtype, bits=local_bits, local_axis=local_axis, codec=codec
    )
    if bits is None:
        secondary = from_wire(wire[0], x.dtype)
    else:
        secondary = unblock(_dequantize(*wire, bits, x.dtype, codec), x.shape)
    return secondary, full


def secondary_gather(
    x: jax.Array,
    *,
    bits: Format | None,
    block_size: int,
    node_axis: str = "node",
    codec: Codec = XLA_CODEC,
) -> tuple[jax.Array, ...]:
    """Stage 1 of the hierarchical gather, in wire form (what hpZ keeps).

    Returns:
      For `bits=None`, `(raw,)`: the secondary shard `(num_nodes * rows, ...)` as wire
      bits. Else `(values, scales)`: `(num_nodes, nb, bytes)` and `(num_nodes, nb)`.
    """
    if bits is None:
        return (lax.all_gather(to_wire(x), node_axis, tiled=True),)
    check_bits(bits, block_size)
    values, scales = _quantize(shard_blocks(x, 1, block_size)[0], bits, codec)
    return lax.all_gather(values, node_axis), lax.all_gather(scales, node_axis)


def requantize_secondary(
    wire: tuple[jax.Array, ...],
    shard_shape: Sequence[int],
    dtype: jnp.dtype,
    *,
    bits: Format | None,
    local_bits: Format | None,
    block_size: int,
    codec: Codec = XLA_CODEC,
) -> tuple[jax.Array, ...]:
    """The secondary shard in the wire form of stage 2 (per-hop weight precision).

    `local_bits` equal to `bits` returns `wire` as it is: stage 2 gathers the
    quantized secondary shard, one quantization event in all. Any other format dequantizes
    the secondary shard to `dtype` and quantizes it again (each of its `num_nodes` pieces
    in its own blocks), so every weight value goes through a second quantization event
    (round-trip errors add: stage 1's plus stage 2's, the latter on the dequantized value).
    No communication.

    Args:
      wire: output of `secondary_gather` with `bits`.
      shard_shape: per-device shard shape `(rows, ...)`.
      dtype: compute dtype of the weights.
      bits: format of `wire`.
      local_bits: format of stage 2.
      block_size: values per quantization block for stage 2.
      codec: block quantization implementation.

    Returns:
      The secondary shard as `secondary_gather` would give it for `local_bits`.
    """
    if local_bits == bits:
        return wire
    if bits is None:
        secondary = from_wire(wire[0], dtype)
    else:
        secondary = unblock(_dequantize(*wire, bits, dtype, codec), shard_shape)
    if local_bits is None:
        return (to_wire(secondary),)
    check_bits(local_bits, block_size)
    nn = secondary.shape[0] // shard_shape[0]
    return _quantize(shard_blocks(secondary, nn, block_size), local_bits, codec)


def gather_from_secondary(
    wire: tuple[jax.Array, ...],
    shard_shape: Sequence[int],
    dtype: jnp.dtype,
    *,
    bits: Format | None,
    local_axis: str = "local",
    codec: Codec = XLA_CODEC,
    alternate_form: bool = False,
) -> jax.Array:
    """Stage 2 of the hierarchical gather: the full array from the secondary shard.

    Args:
      wire: output of `secondary_gather`.
      shard_shape: per-device shard shape `(rows, ...)`.
      dtype: dtype of the result.
      bits: as given to `secondary_gather`.
      local_axis: name of the intra-node mesh axis.
      codec: block quantization implementation.
      alternate_form: emit the gathers in their alternate form (see `_all_gather`).

    Returns:
      `(N * rows, ...)` in `dtype`, in partition order.
    """
    gather = functools.partial(
        _all_gather, axis_name=local_axis, tiled=True, alternate=alternate_form
    )
    if bits is None:
        return from_wire(gather(wire[0]), dtype)
    values, scales = wire
    gv = gather(values)
    gs = gather(scales)
    return unblock(_dequantize(gv, gs, bits, dtype, codec), shard_shape)


def flat_all_gather(
    x: jax.Array,
    *,
    bits: Format | None,
    block_size: int,
    node_axis: str = "node",
    local_axis: str = "local",
    codec: Codec = XLA_CODEC,
    alternate_form: bool = False,
) -> jax.Array:
    """ZeRO-3's gather: one collective over both axes in node-major device order (the
    order of DeepSpeed's ranks), then a local reorder into partition order.

    Args:
      x: per-device shard `(rows, ...)` in the `('local', 'node')` partition layout.
      bits: a format of `quant.FORMATS` (qwZ), or None.
      block_size: values per quantization block.
      node_axis: name of the inter-node mesh axis.
      local_axis: name of the intra-node mesh axis.
      codec: block quantization implementation.
      alternate_form: emit the gathers in their alternate form (see `_all_gather`).

    Returns:
      `(N * rows, ...)` in `x.dtype`, in partition order.
    """
    nn, ll = lax.axis_size(node_axis), lax.axis_size(local_axis)
    axes = (node_axis, local_axis)
    gather = functools.partial(_all_gather, axis_name=axes, tiled=False, alternate=alternate_form)
    if bits is None:
        stacked = gather(to_wire(x))
        return from_wire(_piece_order(stacked, nn, ll), x.dtype).reshape(-1, *x.shape[1:])
    check_bits(bits, block_size)
    values, scales = _quantize(shard_blocks(x, 1, block_size)[0], bits, codec)
    gv = _piece_order(gather(values), nn, ll)
    gs = _piece_order(gather(scales), nn, ll)
    return unblock(_dequantize(gv, gs, bits, x.dtype, codec), x.shape)
