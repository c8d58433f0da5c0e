"""Re-laying out a stacked leaf for a scan over an axis other than 0.

A leaf of rank >= 3 is stored with axis 0 whole and each slice along it split on one axis
of its row (see `partition`). A scan over another axis `a` (MaxText's `param_scan_axis=1`:
stored `(D, L, F)`, transposed to `(L, D, F)` before the scan) needs each of its layers
split evenly over the devices. Two cases, both in `layers_to_front`:

- the stored split axis is not `a` (a small stack: `L` does not divide over the devices):
  every device already holds, for each layer along `a`, its block of that axis: moving `a`
  to the front is a local transpose, and nothing is sent.
- the stored split axis is `a` itself (the layers divide over the devices): one
  all-to-all over the data-parallel axes sends every device the rows `[j * R, (j + 1) *
  R)` of axis 0 of every layer (`R = ceil(D / N)`), so that device j then holds, for each
  layer, a contiguous `1 / N` of it. It moves the float32 master shard (each device sends
  `(N - 1) / N` of its shard); its transpose, another all-to-all, returns the reduced
  per-layer gradient pieces unquantized.

A leaf of rank >= 3 stored as one row (`LeafLayout.keeps_layers` False: no axis of a
layer fit the device count) is re-laid out the first way for a scan over any axis,
axis 0 included, other than its split axis: each device's block, transposed. A scan over
its split axis itself is not re-laid out (the interpreter gathers that leaf whole, with a
warning).

Either way the result is a stack the layered scan gathers per layer like any other
(`layout`). With weight deltas, `reference_to_front` re-lays out the kept reference (the
secondary shard) alike: locally, or by one all-to-all over `local`. Runs inside the
shard_map island; shapes are per device.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from zeropp_jax.state import _blocks as blocks
from zeropp_jax.state import _partition as part


def _kept_axis(stored: part.LeafLayout, axis: int) -> int | None:
    """Where the stored split axis lands in a layer `(other axes in order)` of the stack
    moved for a scan over `axis` (`D`, axis 0, first where `axis` is not 0); None where
    the stored split axis is `axis` itself."""
    split = stored.padded_axis  # in the leaf's own axes
    if split == axis:
        return None
    others = [k for k in range(len(stored.shape)) if k != axis]
    return others.index(split)


def can_relayout(stored: part.LeafLayout, axis: int) -> bool:
    """Whether `layers_to_front` re-lays out a leaf stored as `stored` for a scan over
    `axis`: a stacked leaf (not split over `model`) for `axis >= 1`; a leaf of rank >= 3
    stored as one row (`keeps_layers` False) for any axis other than its split axis. Not a
    leaf split over two axes (`LeafLayout.two_axis`): a scan over another axis of it
    gathers it whole."""
    if stored.tensor_parallel or not stored.sharded or len(stored.shape) < 3:
        return False
    if stored.two_axis:
        return False
    if stored.stacked:
        return axis >= 1
    return _kept_axis(stored, axis) is not None


def layout(stored: part.LeafLayout, axis: int, num_devices: int) -> part.LeafLayout:
    """The layout of the stack `layers_to_front` makes of a leaf stored as `stored`: shape
    `(layers, D, other axes)` (`(layers, other axes)` for `axis` 0), each layer split on
    the stored split axis where that is not `axis` (padded as stored), else on `D`, padded
    to `ceil(D / N) * N` rows."""
    shape = stored.shape
    moved = (shape[axis], *(d for k, d in enumerate(shape) if k != axis))
    kept = _kept_axis(stored, axis)
    if kept is not None:
        row = list(moved[1:])
        row[kept] = stored.padded_length
        return dataclasses.replace(
            stored, shape=moved, padded=math.prod(row), axis=kept, keeps_layers=True
        )
    rows = -(-shape[0] // num_devices)
    rest = math.prod(shape[1:]) // shape[axis]
    return dataclasses.replace(stored, shape=moved, padded=rows * num_devices * rest, axis=0)


def _block(x: jax.Array, stored: part.LeafLayout, n: int, lead: tuple[int, ...]) -> jax.Array:
    """`x` (a device's shard, or `lead` of them) shaped as its block of the stored leaf:
    `(*lead, layers, *block_shape)` for a stacked leaf, `(*lead, *block_shape)` else."""
    layers = (stored.shape[0],) if stored.stacked else ()
    return x.reshape(*lead, *layers, *stored.block_shape(n))


def layers_to_front(shard: jax.Array, stored: part.LeafLayout, axis: int) -> jax.Array:
    """A device's stored shard (`(D, C / N)` for a stacked leaf, its block for one stored
    as one row) -> its stack `(layers, values of its piece of one layer)` for a scan over
    `axis` of the leaf, laid out as `layout(stored, axis, N)`: a local transpose, or one
    all-to-all where the stored split axis of a stacked leaf is `axis` (see the module
    docstring).

    Raises:
      ValueError: where `can_relayout(stored, axis)` is False.
    """
    if not can_relayout(stored, axis):
        raise ValueError(
            f"layers_to_front needs a stacked leaf not split over 'model' and an axis >= 1, "
            f"or a leaf of rank >= 3 stored as one row and an axis other than its split "
            f"axis; got shape {stored.shape} (model_dim={stored.model_dim}, stacked="
            f"{stored.stacked}, split axis {stored.padded_axis}), axis {axis}."
        )
    axes = part.DP_AXES
    n = lax.axis_size(axes)
    shape = stored.shape
    if _kept_axis(stored, axis) is not None:
        x = _block(shard, stored, n, ())
        return jnp.moveaxis(x, axis, 0).reshape(shape[axis], -1)
    rows = -(-shape[0] // n)
    x = jnp.pad(shard, ((0, rows * n - shape[0]), (0, 0))).reshape(n, rows, shard.shape[1])
    # Block j of rows goes to device j; device j receives every device's column piece.
    x = lax.all_to_all(x, axes, 0, 0, tiled=True)
    x = blocks.join_blocks(x.reshape(n, rows, *stored.block_shape(n)), stored, 1)
    x = lax.slice_in_dim(x, 0, stored.row_shape[stored.axis], axis=1 + stored.axis)
    x = jnp.moveaxis(x, axis, 0)
    return x.reshape(shape[axis], -1)


def reference_to_front(
    reference: jax.Array,
    stored: part.LeafLayout,
    axis: int,
    *,
    node_axis: str = "node",
    local_axis: str = "local",
) -> jax.Array:
    """A weight-delta reference of a stacked leaf (see `zeropp_jax.wire._delta`) -> the reference
    of the stack `layers_to_front` makes, laid out as `layout(stored, axis, N)`. Where
    the stored split axis is not `axis`, each piece is transposed in place; else:

    Device `(n, l)` holds the secondary shard of local rank `l`: the pieces of devices
    `l * num_nodes + n'` for every node `n'`, each all of the leaf's axis-0 rows, one
    column block. The re-laid-out pieces of the devices of local rank `l2` are blocks of
    rows of every column block, so every local rank sends each other one the row blocks of
    its pieces: one all-to-all over `local` (within a node), in the reference's dtype.

    Args:
      reference: per-device reference `(num_nodes * D * C / N,)`.
      stored: the leaf's layout (stacked, not split over `model`).
      axis: the leaf's axis the scan runs over (>= 1).
      node_axis: name of the inter-node mesh axis.
      local_axis: name of the intra-node mesh axis.

    Returns:
      `(num_nodes * layers * values of a piece of one layer,)`: the secondary shard of the
      re-laid-out pieces, in node order.
    """
    if not can_relayout(stored, axis):
        raise ValueError(
            f"reference_to_front needs a leaf layers_to_front re-lays out (see "
            f"can_relayout); got shape {stored.shape} (model_dim={stored.model_dim}, "
            f"stacked={stored.stacked}, split axis {stored.padded_axis}), axis {axis}."
        )
    nn, ll = lax.axis_size(node_axis), lax.axis_size(local_axis)
    n = nn * ll
    shape = stored.shape
    if _kept_axis(stored, axis) is not None:
        x = _block(reference, stored, n, (nn,))
        return jnp.moveaxis(x, axis + 1, 1).reshape(-1)
    rows = -(-shape[0] // n)
    x = reference.reshape(nn, shape[0], -1)
    x = jnp.pad(x, ((0, 0), (0, rows * n - shape[0]), (0, 0)))
    # (source node, target local, target node, rows, column block)
    x = x.reshape(nn, ll, nn, rows, x.shape[-1])
    # (source node, source local, target node, ...): local rank l2 gets its row blocks.
    x = lax.all_to_all(x, local_axis, 1, 1, tiled=True)
    # Per target node: the rows of its block, column blocks in partition order (l, n').
    x = jnp.transpose(x, (2, 3, 1, 0, 4)).reshape(nn, rows, n, *stored.block_shape(n))
    x = blocks.join_blocks(jnp.moveaxis(x, 2, 0), stored, 2)
    x = lax.slice_in_dim(x, 0, stored.row_shape[stored.axis], axis=2 + stored.axis)
    x = jnp.moveaxis(x, axis + 1, 1)
    return x.reshape(-1)
