"""A stored leaf's per-device blocks and pieces (`zeropp_jax.state._partition` says how
each leaf is laid out).

Each device's shard of a stored leaf is a *block* of each kept row (`LeafLayout.block_shape`);
flattened, it is the *piece* its collectives gather and reduce, and every device's pieces
in partition order (`local` first) are what a gather returns. These functions move between
the stored leaf, its blocks, its pieces and the leaf's original shape (global arrays, or
per device inside shard_map where said).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeropp_jax.state import _partition as part
from zeropp_jax.state._partition import LeafLayout


def join_blocks(x: jax.Array, layout: LeafLayout, lead: int) -> jax.Array:
    """Every device's block, `(N, *lead dims, *block_shape)` (`lead` leading axes kept
    whole, e.g. a stacked leaf's layers), -> the padded rows they are blocks of, `(*lead
    dims, *padded_row_shape)`. Not tensor-parallel. Split over two axes, the `N` blocks
    are `(local, node)` in partition order (`local` first): each goes in front of the axis
    it splits."""
    if layout.two_axis:
        return _join_grid(x, layout, lead)
    at = lead + layout.axis
    x = jnp.moveaxis(x, 0, at)
    return x.reshape(*x.shape[:at], x.shape[at] * x.shape[at + 1], *x.shape[at + 2 :])


def _join_grid(x: jax.Array, layout: LeafLayout, lead: int) -> jax.Array:
    """`join_blocks` for a row split over two axes."""
    local, nodes = layout.grid
    x = x.reshape(local, nodes, *x.shape[1:])
    at = {lead + layout.axis: 0, lead + layout.node_axis: 1}
    perm: list[int] = []
    for d in range(x.ndim - 2):
        perm += [at[d], d + 2] if d in at else [d + 2]
    shape = [
        n * (local if at.get(d) == 0 else nodes if d in at else 1)
        for d, n in enumerate(x.shape[2:])
    ]
    return jnp.transpose(x, perm).reshape(shape)


def split_blocks(x: jax.Array, layout: LeafLayout, lead: int, num_devices: int) -> jax.Array:
    """Inverse of `join_blocks`: `(*lead dims, *padded_row_shape)` -> `(N, *lead dims,
    *block_shape)`."""
    if layout.two_axis:
        return _split_grid(x, layout, lead)
    at = lead + layout.axis
    x = x.reshape(*x.shape[:at], num_devices, x.shape[at] // num_devices, *x.shape[at + 1 :])
    return jnp.moveaxis(x, at, 0)


def _split_grid(x: jax.Array, layout: LeafLayout, lead: int) -> jax.Array:
    """`split_blocks` for a row split over two axes."""
    grid = dict(zip((lead + layout.axis, lead + layout.node_axis), layout.grid, strict=True))
    shape: list[int] = []
    front: list[int] = []
    for d, n in enumerate(x.shape):
        if d in grid:
            front.append(len(shape))
            shape += [grid[d], n // grid[d]]
        else:
            shape.append(n)
    x = x.reshape(shape)
    local_first = front if layout.axis <= layout.node_axis else front[::-1]
    rest = [d for d in range(len(shape)) if d not in front]
    x = jnp.transpose(x, [*local_first, *rest])
    return x.reshape(-1, *x.shape[2:])


def unpiece(
    full: jax.Array, layout: LeafLayout, num_devices: int, layer: bool = False
) -> jax.Array:
    """A gathered leaf in piece order -> its original shape (per device, inside shard_map).

    Args:
      full: `(num_devices * piece,)`, every device's piece in partition order (what the
        collectives return for a flattened shard).
      layout: the leaf's layout.
      num_devices: devices the leaf is sharded over.
      layer: `full` is one slice along axis 0 of a stacked leaf (a scan's layer) rather
        than the whole leaf.

    Returns:
      The leaf in its original shape (`layout.shape[1:]` for a layer). A tensor-parallel
      leaf's `full` is `(K, num_devices * piece)`, one row per `model` slice.
    """
    if layout.tensor_parallel:
        k = layout.model_size
        if layout.stacked and not layer:
            x = full.reshape(k, num_devices, layout.lead, layout.padded // num_devices)
            x = jnp.swapaxes(x, 1, 2).reshape(k, layout.lead, layout.padded)
            return part.join_model(jnp.swapaxes(x[..., : layout.cols], 0, 1), layout, False)
        return part.join_model(full[:, : layout.cols], layout, layer)
    lead = (layout.lead,) if layout.stacked and not layer else ()
    x = join_blocks(
        full.reshape(num_devices, *lead, *layout.block_shape(num_devices)), layout, len(lead)
    )
    for axis in (layout.axis, layout.node_axis) if layout.two_axis else (layout.axis,):
        x = lax.slice_in_dim(x, 0, layout.row_shape[axis], axis=len(lead) + axis)
    return x.reshape(layout.shape[1:] if layer else layout.shape)


def piece(shard: jax.Array, layout: LeafLayout) -> jax.Array:
    """A device's stored shard -> the piece its collectives gather (per device, inside
    shard_map): flattened, or, tensor-parallel, `(K, values)` with the `model` axis kept
    first (a stacked leaf's layers moved behind it)."""
    if not layout.tensor_parallel:
        return shard.reshape(-1)
    if shard.ndim == 3:
        shard = jnp.swapaxes(shard, 0, 1)
    return shard.reshape(shard.shape[0], -1)


def pieces_to_stored(x: jax.Array, layout: LeafLayout, num_devices: int) -> jax.Array:
    """`(padded_size,)` in piece order (a reference, a missing mass) -> the stored shape.
    A tensor-parallel leaf's pieces are `(K, values)`: reshaped as they are."""
    if layout.tensor_parallel:
        return x.reshape(layout.stored_shape)
    lead = (layout.lead,) if layout.stacked else ()
    blocks = x.reshape(num_devices, *lead, *layout.block_shape(num_devices))
    return join_blocks(blocks, layout, len(lead))


def island_shard(shard: jax.Array, layout: LeafLayout) -> jax.Array:
    """A device's stored shard as the island works on it (per device, inside shard_map): a
    stacked leaf's `(layers, padded rows / N, ...)` flattened per layer, `(layers, C / N)`
    (a bitcast); every other shard as it is."""
    if layout.stacked and not layout.tensor_parallel:
        return shard.reshape(shard.shape[0], -1)
    return shard


def stored_to_pieces(x: jax.Array, layout: LeafLayout, num_devices: int) -> jax.Array:
    """Inverse of `pieces_to_stored`."""
    if layout.tensor_parallel:
        return x.reshape(-1)
    lead = 1 if layout.stacked else 0
    return split_blocks(x, layout, lead, num_devices).reshape(-1)


def layer_of_pieces(x: jax.Array, layers: int, piece: int, layer: Any) -> jax.Array:
    """One layer's values of per-device pieces of a stacked leaf laid end to end.

    A stacked leaf's piece holds its `layers` per-layer pieces of `piece` values one after
    another (`(layers, piece)` flattened); `x` is `k` such pieces, `(k * layers * piece,)`
    (a gathered leaf, a gradient residual). Returns that layer's `(k * piece,)`: its piece
    of each of the `k`, in order, what the same values of the one layer would be. Per
    device, inside shard_map; `layer` may be traced.
    """
    per = x.reshape(-1, layers, piece)
    return lax.dynamic_index_in_dim(per, layer, axis=1, keepdims=False).reshape(-1)


def pieces_of_layers(stack: jax.Array, piece: int) -> jax.Array:
    """Inverse of `layer_of_pieces` over all layers: `(layers, k * piece)`, each layer's
    values in order, -> `(k * layers * piece,)`."""
    return jnp.swapaxes(stack.reshape(stack.shape[0], -1, piece), 0, 1).reshape(-1)
