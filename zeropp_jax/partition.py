"""Partition layout: how each parameter leaf is padded and sharded over the mesh.

A float leaf is cast to float32 (the master copy) and sharded over all `N` devices with
`('local', 'node')` (see `collectives` for why that order):

- a leaf of rank 1 or 2, `(d0, ...)`, is zero-padded to `ceil(d0 / N) * N` rows and
  sharded along axis 0 (`PartitionSpec(('local', 'node'))`): each device holds whole rows.
- a leaf of rank >= 3, `(d0, d1, ...)`, is treated as stacked (`(layers, rows, cols)`, as
  `nn.scan`, `nnx.scan` and MaxText lay out LLM blocks): axis 0 is kept whole and the leaf
  is stored as `(d0, C)`, each slice along axis 0 flattened (`d1 * d2 * ...` values) and
  zero-padded to `C = ceil(d1 * ... / N) * N`, sharded along axis 1
  (`PartitionSpec(None, ('local', 'node'))`). A scan over the layer axis finds each
  layer's slice sharded and padded on its own; the layer axis is never split or padded.
  Within a layer each device holds whole rows of the slice (contiguous values), as the
  quantization blocks want.

A stacked leaf's per-layer vectors (biases, norm scales: `(layers, width)`, rank 2) have
the rank-2 layout: they are small, and a scan gathers them whole (see `placement`).

Each device's shard, flattened, is the *piece* the collectives gather and reduce; a
gathered leaf, every device's piece in partition order, is turned back into the original
shape by `unpiece`. Padding stays exactly zero: its gradient
is zero, and so is every optimizer update of a zero parameter with a zero gradient. Float
scalars and non-float leaves (counters, int tables) are replicated and never quantized.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PARAM_SPEC = P(("local", "node"))
"""Spec of a sharded parameter of rank 1 or 2 (and of its optimizer state)."""
ROW_PARAM_SPEC = P(None, ("local", "node"))
"""Spec of a stacked parameter (rank >= 3), stored `(d0, C)` (and of its optimizer state)."""
BATCH_SPEC = P(("node", "local"))
"""Spec of a batch: leading dimension over all devices in node-major order."""
REPLICATED = P()
REFERENCE_SPEC = P("local")
"""Spec of a weight-delta reference (`zeropp_jax.delta`): the padded parameter as pieces,
`(padded_size,)`, each local rank's secondary shard, the same on every node."""

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one parameter leaf is stored.

    Attributes:
      shape: original (global) shape.
      dtype: original dtype name.
      sharded: True for float leaves with at least one dimension (sharded float32 master
        copy); False for replicated leaves.
      padded: rank <= 2, the rows after padding (axis 0 is sharded); rank >= 3, `C`, the
        values per row after padding (axis 0 is kept whole); 0 if not sharded.
    """

    shape: tuple[int, ...]
    dtype: str
    sharded: bool
    padded: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def stacked(self) -> bool:
        """Whether axis 0 is kept whole (rank >= 3), so that a scan over it finds each
        slice sharded on its own: a stacked matrix `(layers, rows, cols)`."""
        return self.sharded and len(self.shape) >= 3

    @property
    def lead(self) -> int:
        """Rows kept whole: `shape[0]` for a stacked leaf, 1 otherwise."""
        return self.shape[0] if self.stacked else 1

    @property
    def cols(self) -> int:
        """Values per kept row before padding (stacked: one slice along axis 0)."""
        return math.prod(self.shape[1:]) if self.stacked else self.size

    @property
    def padded_cols(self) -> int:
        """Values per kept row after padding (N times one device's piece of it)."""
        if self.stacked:
            return self.padded
        return self.padded * math.prod(self.shape[1:])

    @property
    def padded_axis(self) -> int:
        """The axis of the stored leaf that padding lengthens (-1: the last)."""
        return -1 if self.stacked else 0

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Global shape of the stored (padded) leaf."""
        if not self.sharded:
            return self.shape
        if self.stacked:
            return (self.lead, self.padded)
        return (self.padded, *self.shape[1:])

    @property
    def padded_size(self) -> int:
        """Values of the stored leaf (every device's piece together)."""
        return self.lead * self.padded_cols if self.sharded else self.size


def leaf_layout(path: str, x: Any, num_devices: int) -> LeafLayout:
    """Layout of one parameter leaf; raises `ValueError` for non-arrays and bad dtypes."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(
            f"parameter {path} is a {type(x).__name__}, not an array; parameters must be "
            "jax or numpy arrays (initialise the model with model.init and pass "
            "variables['params'])."
        )
    dtype = np.dtype(x.dtype)
    is_float = jnp.issubdtype(dtype, jnp.floating)
    if is_float and dtype.name not in FLOAT_DTYPES:
        raise ValueError(
            f"parameter {path} has dtype {dtype.name}; float parameters must be one of "
            f"{FLOAT_DTYPES}. Cast it (e.g. to float32) before TrainState.create."
        )
    if not is_float and not (jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_):
        raise ValueError(
            f"parameter {path} has dtype {dtype.name}; expected a float, int or bool array."
        )
    shape = tuple(int(d) for d in x.shape)
    sharded = bool(is_float and len(shape) >= 1 and math.prod(shape) > 0)
    return with_devices(LeafLayout(shape, dtype.name, sharded, 0), num_devices)


def with_devices(layout: LeafLayout, num_devices: int) -> LeafLayout:
    """The layout of the same leaf padded for `num_devices` devices."""
    if not layout.sharded:
        return layout
    n = layout.cols if layout.stacked else layout.shape[0]
    return dataclasses.replace(layout, padded=-(-n // num_devices) * num_devices)


def param_layouts(params: Any, num_devices: int) -> Any:
    """Pytree of `LeafLayout`s matching `params`."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: leaf_layout(jax.tree_util.keystr(p), x, num_devices), params
    )


def is_layout(x: Any) -> bool:
    return isinstance(x, LeafLayout)


def to_master(x: jax.Array, layout: LeafLayout) -> jax.Array:
    """Original leaf -> stored leaf (float32, padded) for sharded leaves; as-is otherwise."""
    if not layout.sharded:
        return jnp.asarray(x)
    x = jnp.asarray(x, jnp.float32)
    if layout.stacked:
        x = x.reshape(layout.lead, layout.cols)
    return resize_padding(x, layout)


def from_master(x: jax.Array, layout: LeafLayout, dtype: Any = None) -> jax.Array:
    """Stored leaf -> original shape, in `dtype` (default: the original dtype)."""
    if layout.sharded:
        if layout.stacked:
            x = x[:, : layout.cols].reshape(layout.shape)
        else:
            x = x[: layout.shape[0]]
    return x.astype(layout.dtype if dtype is None else dtype)


def resize_padding(x: jax.Array, layout: LeafLayout) -> jax.Array:
    """Crops or zero-pads the padded axis of `x` (a stored leaf, e.g. padded for another
    mesh) to `layout`'s padding."""
    axis = x.ndim - 1 if layout.stacked else 0
    want, have = layout.padded, x.shape[axis]
    if have >= want:
        return lax.slice_in_dim(x, 0, want, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, want - have)
    return jnp.pad(x, pad)


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
      The leaf in its original shape (`layout.shape[1:]` for a layer).
    """
    if not layout.stacked:
        return full.reshape(layout.stored_shape)[: layout.shape[0]]
    lead = 1 if layer else layout.lead
    x = full.reshape(num_devices, lead, layout.padded // num_devices)
    x = jnp.swapaxes(x, 0, 1).reshape(lead, layout.padded)[:, : layout.cols]
    return x.reshape(layout.shape[1:] if layer else layout.shape)


def pieces_to_stored(x: jax.Array, layout: LeafLayout, num_devices: int) -> jax.Array:
    """`(padded_size,)` in piece order (a reference, a missing mass) -> the stored shape."""
    if not layout.stacked:
        return x.reshape(layout.stored_shape)
    x = x.reshape(num_devices, layout.lead, layout.padded // num_devices)
    return jnp.swapaxes(x, 0, 1).reshape(layout.stored_shape)


def stored_to_pieces(x: jax.Array, layout: LeafLayout, num_devices: int) -> jax.Array:
    """Inverse of `pieces_to_stored`."""
    if not layout.stacked:
        return x.reshape(-1)
    x = x.reshape(layout.lead, num_devices, layout.padded // num_devices)
    return jnp.swapaxes(x, 0, 1).reshape(-1)


def leaf_spec(layout: LeafLayout) -> P:
    """The `PartitionSpec` of a stored leaf."""
    if not layout.sharded:
        return REPLICATED
    return ROW_PARAM_SPEC if layout.stacked else PARAM_SPEC


def param_shardings(layouts: Any, mesh: Mesh) -> Any:
    """`NamedSharding` per stored leaf."""
    return jax.tree_util.tree_map(
        lambda lo: NamedSharding(mesh, leaf_spec(lo)), layouts, is_leaf=is_layout
    )


def param_count(layouts: Any) -> int:
    """Number of values in the original parameters (float and non-float)."""
    leaves = jax.tree_util.tree_leaves(layouts, is_leaf=is_layout)
    return sum(lo.size for lo in leaves)
