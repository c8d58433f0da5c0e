"""The gradient reductions: quantized reduce-scatters in one hop, or in two (qgZ), each
hop optionally in a block Hadamard rotation (`zeropp_jax.wire._rotation`); pure functions meant
to run inside `jax.shard_map`.

Shapes: `x` is always the per-device array. A reduce-scatter over a group of `G` devices
turns a contribution of shape `(G * rows, ...)` into `(rows, ...)`: the float32 sum (not the
mean) of the group's contributions to this device's rows. The two-hop reduction is the
transpose of the hierarchical gather (`zeropp_jax.wire.collectives`): hop 1 over `local`, hop 2
over `node`, and each device ends with the sum of its own piece.

None of these functions looks up a mesh, a device count or a config: group sizes come from
`lax.axis_size` of the axis names they are given.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeropp_jax.wire._encoding import (
    AxisName,
    Format,
    _dequantize,
    _group_size,
    _node_major,
    _quantize,
    effective_block_size,
    from_wire,
    shard_blocks,
    to_wire,
    unblock,
)
from zeropp_jax.wire._rotation import effective_rotation_block, rotate_blocks
from zeropp_jax.wire.quant import XLA_CODEC, Codec, check_bits


def _fold_sum(stacked: jax.Array) -> jax.Array:
    """float32 sum over axis 0, left to right."""
    acc = stacked[0].astype(jnp.float32)
    for g in range(1, stacked.shape[0]):
        acc = acc + stacked[g].astype(jnp.float32)
    return acc


def exchange_blocks(
    values: jax.Array, scales: jax.Array, axis_name: AxisName
) -> tuple[jax.Array, jax.Array]:
    """All-to-all of quantized blocks: `values[g]` `(G, nb, bytes)` and `scales[g]`
    `(G, nb)` float32 go to the device of index `g` on `axis_name`; returns what came, in
    the same shapes (index `g`: from device `g`).

    Two collectives, one per array. One, with each block's scale as 4 bytes after its
    values, halves XLA:CPU's per-peer slice kernels, but joining them copies the values:
    +59 MB per device at 1.3B on 16 x 8, the tied embedding's int4 gradient (RESULTS,
    "ZeRO++'s compile time"; issue #48)."""
    return lax.all_to_all(values, axis_name, 0, 0), lax.all_to_all(scales, axis_name, 0, 0)


def reduce_scatter_quantized(
    x: jax.Array,
    *,
    axis_name: AxisName,
    bits: Format | None,
    block_size: int,
    codec: Codec = XLA_CODEC,
    key: jax.Array | None = None,
) -> jax.Array:
    """Quantized reduce-scatter: quantize once, all-to-all, dequantize and sum in float32.

    Args:
      x: per-device contribution `(G * rows, ...)`; chunk `g` (along axis 0) goes to the
        device of index `g` on `axis_name`.
      axis_name: mesh axis or tuple of axes (first one major).
      bits: a format of `quant.FORMATS`, or None. None: float32 input goes through
        `lax.psum_scatter`; 16-bit input travels as uint16 bits through an all-to-all and
        is summed in float32.
      block_size: values per quantization block (blocks never straddle two chunks).
      codec: block quantization implementation.
      key: a PRNG key for stochastic rounding, used as given (the caller makes it differ
        per device); None rounds to nearest.

    Returns:
      float32 `(rows, ...)`: the sum over the group of this device's chunk.
    """
    g = _group_size(axis_name)
    if x.shape[0] % g:
        raise ValueError(
            f"reduce_scatter_quantized: leading dimension {x.shape[0]} is not divisible by "
            f"the group size {g} of axis {axis_name!r}; pad it to a multiple of {g}."
        )
    rows_shape = (x.shape[0] // g, *x.shape[1:])
    if bits is None:
        if x.dtype.itemsize == 2:
            chunks = to_wire(x).reshape(g, -1)
            received = lax.all_to_all(chunks, axis_name, 0, 0)
            return _fold_sum(from_wire(received, x.dtype)).reshape(rows_shape)
        return lax.psum_scatter(x.astype(jnp.float32), axis_name, tiled=True)
    check_bits(bits, block_size)
    values, scales = _quantize(shard_blocks(x, g, block_size), bits, codec, key)
    summed = codec.dequantize_sum_blocks(*exchange_blocks(values, scales, axis_name), bits=bits)
    return unblock(summed[None], rows_shape)


def flat_reduce_scatter(
    x: jax.Array,
    *,
    bits: Format | None,
    block_size: int,
    node_axis: str = "node",
    local_axis: str = "local",
    codec: Codec = XLA_CODEC,
    ring: bool = True,
) -> jax.Array:
    """ZeRO-3's gradient reduce-scatter: one collective over both axes in node-major order.

    Args:
      x: per-device gradient `(N * rows, ...)` in partition order.
      bits: a format of `quant.FORMATS`, or None.
      block_size: values per quantization block.
      node_axis: name of the inter-node mesh axis.
      local_axis: name of the intra-node mesh axis.
      codec: block quantization implementation.
      ring: with `bits=None` and a 16-bit `x`: run `ring_reduce_scatter` (True) or one
        `lax.psum_scatter` in `x.dtype` (False, what NCCL runs).

    Returns:
      float32 `(rows, ...)`: the sum over all devices of this device's piece.
    """
    nn, ll = lax.axis_size(node_axis), lax.axis_size(local_axis)
    chunks = _node_major(x.reshape(nn * ll, -1), nn, ll).reshape(x.shape)
    if bits is None and x.dtype.itemsize == 2:
        if ring:
            return ring_reduce_scatter(chunks, axis_name=(node_axis, local_axis))
        summed = lax.psum_scatter(chunks, (node_axis, local_axis), tiled=True)
        return summed.astype(jnp.float32)
    return reduce_scatter_quantized(
        chunks, axis_name=(node_axis, local_axis), bits=bits, block_size=block_size, codec=codec
    )


def ring_reduce_scatter(x: jax.Array, *, axis_name: AxisName) -> jax.Array:
    """A 16-bit ring reduce-scatter, as NCCL and gloo run ZeRO-3's (the honest baseline).

    `G - 1` steps; at each, every device sends one chunk's partial sum (rounded to
    `x.dtype`, moved as its raw bits) to the next device in axis-index order, which adds
    its own chunk in float32. Each device therefore sends `(G - 1) / G` of `x`, as a
    reduce-scatter does, and only the ring's edges between nodes cross a node boundary
    (an all-to-all would send every node pair's chunks across).

    Args:
      x: per-device contribution `(G * rows, ...)`, 16-bit float; chunk `g` goes to the
        device of index `g` on `axis_name`.
      axis_name: mesh axis or tuple of axes (the first one major).

    Returns:
      float32 `(rows, ...)`: the sum over the group of this device's chunk (partial sums
      rounded to `x.dtype` between hops, as a 16-bit ring does).
    """
    g = _group_size(axis_name)
    rows_shape = (x.shape[0] // g, *x.shape[1:])
    if g == 1:
        return x.astype(jnp.float32).reshape(rows_shape)
    # The loop slices the chunks' raw bits: XLA's CPU compiler would move the float32
    # convert of a sliced 16-bit chunk onto the whole loop-invariant `x`, a float32 copy of
    # the gradient (twice its size) held through the ring; a convert cannot move through a
    # bitcast.
    chunks = to_wire(x).reshape(g, -1)
    idx = lax.axis_index(axis_name)
    perm = [(i, (i + 1) % g) for i in range(g)]

    def chunk(step):
        piece = lax.dynamic_index_in_dim(chunks, (idx - 1 - step) % g, keepdims=False)
        return from_wire(piece, x.dtype)

    def hop(step, acc):
        sent = lax.ppermute(to_wire(acc.astype(x.dtype)), axis_name, perm)
        return from_wire(sent, x.dtype).astype(jnp.float32) + chunk(step).astype(jnp.float32)

    acc = lax.fori_loop(1, g, hop, chunk(0).astype(jnp.float32))
    return acc.reshape(rows_shape)


def hop_keys(
    key: jax.Array | None, *, node_axis: str = "node", local_axis: str = "local"
) -> tuple[jax.Array | None, jax.Array | None]:
    """Stochastic-rounding keys of this device for hop 1 and hop 2.

    `key` is the same on every device (in the engine: from the base seed, the step and the
    parameter leaf); it is folded with the device index on `(node_axis, local_axis)` and
    then with the hop number (1 or 2), so every device and hop draws its own noise and the
    same inputs give the same bits. None gives `(None, None)` (round to nearest).
    """
    if key is None:
        return None, None
    dev = jax.random.fold_in(key, lax.axis_index((node_axis, local_axis)))
    return jax.random.fold_in(dev, 1), jax.random.fold_in(dev, 2)


def model_rank_key(key: jax.Array | None, *, axis_name: str) -> jax.Array | None:
    """`key` folded with this device's rank on the tensor-parallel axis `axis_name` (inside
    a `shard_map` manual over it), so that the `model` ranks, which reduce different slices
    of a parameter, draw different stochastic-rounding noise. None stays None."""
    if key is None:
        return None
    return jax.random.fold_in(key, lax.axis_index(axis_name))


@dataclasses.dataclass(frozen=True)
class TwoHop:
    """What the two-hop gradient reduction (qgZ) sends on each hop: hop 1 over
    `local_axis`, hop 2 over `node_axis`.

    Attributes:
      bits: format on hop 1 (a format of `quant.FORMATS`) or None for an unquantized hop.
      block_size: values per quantization block on hop 1.
      node_bits: format on hop 2 (a format of `quant.FORMATS`) or None for an unquantized
        hop.
      node_block_size: values per quantization block on hop 2.
      codec: block quantization implementation.
      rotation_block_size: Hadamard rotation block on hop 1 (a power of two dividing
        `block_size`; smaller blocks of a small piece cap it), or None for no rotation.
      node_rotation_block_size: the same for hop 2 (dividing `node_block_size`).
      node_axis: name of the inter-node mesh axis.
      local_axis: name of the intra-node mesh axis.
    """

    bits: Format | None
    block_size: int
    node_bits: Format | None
    node_block_size: int
    codec: Codec = XLA_CODEC
    rotation_block_size: int | None = None
    node_rotation_block_size: int | None = None
    node_axis: str = "node"
    local_axis: str = "local"

    @classmethod
    def of(cls, spec: TwoHop | None, fields: dict[str, Any], where: str) -> TwoHop:
        """`spec`, or one built from `fields` (the attributes as keywords); not both."""
        if spec is not None and fields:
            raise TypeError(
                f"{where}: pass a TwoHop or its fields as keywords, not both (got "
                f"{sorted(fields)} beside a TwoHop)."
            )
        return spec if spec is not None else cls(**fields)


def two_hop_reduce_scatter(
    x: jax.Array, spec: TwoHop | None = None, *, key: jax.Array | None = None, **fields: Any
) -> jax.Array:
    """qgZ: hierarchical gradient reduction, hop 1 over `local`, hop 2 over `node`.

    Each value is quantized once per hop: hop 1 quantizes this device's whole gradient
    (every piece in its own blocks), all-to-alls it inside the node, dequantizes and sums
    in float32; hop 2 re-quantizes that partial sum (in its own format and blocks, which
    never straddle two pieces either), all-to-alls it across nodes, dequantizes and sums.
    A hop over an axis of size 1 is skipped (no collective, no quantization event), so a
    1-node mesh does exactly one quantized intra-node hop.

    A hop given a rotation block size rotates what it quantizes with the block Hadamard
    rotation (`zeropp_jax.wire._rotation`, inside each quantization block) and rotates the
    float32 sum back after it; the rotation is linear, so the sum is that of the
    unrotated values up to float32 rounding, and each value is still quantized once per
    hop. When both hops rotate alike in the same blocks, the partial sums stay rotated
    between the hops (hop 2 quantizes hop 1's rotated sums directly).

    Args:
      x: per-device gradient `(N * rows, ...)` in partition order.
      spec: what each hop sends (`TwoHop`); or give its attributes as keywords.
      key: a PRNG key, the same on every device, for stochastic rounding on both hops
        (see `hop_keys`); None rounds to nearest.
      **fields: `TwoHop`'s attributes, when `spec` is not given.

    Returns:
      float32 `(rows, ...)`: the sum over all devices of this device's piece.

    Raises:
      ValueError: for a rotation on an unquantized hop, or a rotation block that is not a
        power of two dividing its hop's quantization block.
    """
    spec = TwoHop.of(spec, fields, "two_hop_reduce_scatter")
    return two_hop_with_residuals(x, None, None, spec, key)[0]


def two_hop_with_residuals(
    x: jax.Array,
    hop1_residual: jax.Array | None,
    hop2_residual: jax.Array | None,
    spec: TwoHop,
    key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """`two_hop_reduce_scatter` with error feedback: the residuals in, the new ones out.

    It adds `hop1_residual` to what hop 1 quantizes and
    `hop2_residual` to what hop 2 quantizes, and returns `(sum, new_hop1_residual,
    new_hop2_residual)`: what each quantization lost (in the unrotated basis), None for a
    hop given None. With two Nones it is the plain reduction;
    `feedback.two_hop_reduce_scatter_feedback` checks the residuals before calling it."""
    bits, block_size, codec = spec.bits, spec.block_size, spec.codec
    node_bits, node_block_size = spec.node_bits, spec.node_block_size
    node_axis, local_axis = spec.node_axis, spec.local_axis
    rotation_block_size = spec.rotation_block_size
    node_rotation_block_size = spec.node_rotation_block_size
    nn, ll = lax.axis_size(node_axis), lax.axis_size(local_axis)
    n = nn * ll
    if x.shape[0] % n:
        raise ValueError(
            f"two_hop_reduce_scatter: leading dimension {x.shape[0]} is not divisible by "
            f"the {n} devices of the mesh; pad it to a multiple of {n}."
        )
    k1, k2 = hop_keys(key, node_axis=node_axis, local_axis=local_axis)
    rows_shape = (x.shape[0] // n, *x.shape[1:])
    rows2_shape = (nn * rows_shape[0], *rows_shape[1:])  # this device's secondary pieces
    piece = math.prod(rows_shape)
    if bits is None and rotation_block_size is not None and ll > 1:
        raise ValueError(
            "two_hop_reduce_scatter: a rotation on hop 1, which is unquantized; pass "
            "rotation_block_size=None or give hop 1 a format."
        )
    if node_bits is None and node_rotation_block_size is not None and nn > 1:
        raise ValueError(
            "two_hop_reduce_scatter: a rotation on hop 2, which is unquantized; pass "
            "node_rotation_block_size=None or give hop 2 a format."
        )
    new1 = new2 = None
    received = None  # hop 1's quantized partial sums, as they arrive
    rb1 = None  # hop 1's rotation block, None without rotation
    partial = x
    if ll > 1 and bits is None:
        partial = reduce_scatter_quantized(
            x, axis_name=local_axis, bits=None, block_size=block_size, codec=codec
        )
    elif ll > 1:
        check_bits(bits, block_size)
        c1 = x if hop1_residual is None else x.astype(jnp.float32) + hop1_residual
        blocks = shard_blocks(c1, n, block_size)  # (N, nbp, bs): every piece in its own blocks
        nbp, bs = blocks.shape[1:]
        rb1 = effective_rotation_block(rotation_block_size, bs)
        if rb1 is not None:
            blocks = rotate_blocks(blocks, rb1)
        values, scales = _quantize(blocks.reshape(ll, nn * nbp, bs), bits, codec, k1)
        if hop1_residual is not None:
            sent = _dequantize(values, scales, bits, jnp.float32, codec).reshape(n, nbp, bs)
            if rb1 is not None:
                sent = rotate_blocks(sent, rb1)
            new1 = c1 - unblock(sent, rows_shape)
        received = exchange_blocks(values, scales, local_axis)

    def summed() -> jax.Array:  # hop 1's float32 partial sums, (num_nodes * rows, ...)
        total = codec.dequantize_sum_blocks(*received, bits=bits)
        if rb1 is not None:
            total = rotate_blocks(total, rb1)
        return total.reshape(nn, -1)[:, :piece].reshape(rows2_shape)

    node_bs = effective_block_size(piece, node_block_size)
    rb2 = effective_rotation_block(node_rotation_block_size, node_bs) if nn > 1 else None
    fuse = (
        received is not None
        and nn > 1
        and node_bits is not None
        and hop2_residual is None
        and node_bs == bs
        and rb1 == rb2
    )
    if received is not None and not fuse:
        partial = summed()
    if nn == 1:
        return partial.astype(jnp.float32).reshape(rows_shape), new1, None
    if node_bits is None:  # 16-bit values on the wire, summed in float32
        out = reduce_scatter_quantized(
            partial.astype(x.dtype).reshape(rows2_shape),
            axis_name=node_axis,
            bits=None,
            block_size=node_block_size,
            codec=codec,
        )
        return out.reshape(rows_shape), new1, None
    check_bits(node_bits, node_block_size)
    if fuse:  # dequantize, sum and re-quantize in one pass, hop 1's blocks (and basis) kept
        kw = {} if k2 is None else {"key": k2}
        v2, s2 = codec.dequantize_sum_quantize_blocks(
            *received, bits=bits, out_bits=node_bits, **kw
        )
        v2, s2 = v2.reshape(nn, nbp, -1), s2.reshape(nn, nbp)
    else:  # re-block the partial sums for hop 2, piece by piece
        c2 = partial if hop2_residual is None else partial.astype(jnp.float32) + hop2_residual
        blocks2 = shard_blocks(c2, nn, node_block_size)
        if rb2 is not None:
            blocks2 = rotate_blocks(blocks2, rb2)
        v2, s2 = _quantize(blocks2, node_bits, codec, k2)
        if hop2_residual is not None:
            sent = _dequantize(v2, s2, node_bits, jnp.float32, codec)
            if rb2 is not None:
                sent = rotate_blocks(sent, rb2)
            new2 = c2 - unblock(sent, rows_shape)
    total = codec.dequantize_sum_blocks(*exchange_blocks(v2, s2, node_axis), bits=node_bits)
    if rb2 is not None:
        total = rotate_blocks(total, rb2)
    return unblock(total[None], rows_shape), new1, new2
