"""Partition layout: how each parameter leaf is padded and sharded over the mesh.

A float leaf is cast to float32 (the master copy) and sharded over all `N` devices with
`('local', 'node')` (see `collectives` for why that order):

- a leaf of rank 1 or 2 is one *row*; a leaf of rank >= 3, `(d0, d1, ...)`, is treated
  as stacked (`(layers, row...)`, as `nn.scan`, `nnx.scan` and MaxText lay out LLM
  blocks): axis 0 is kept whole, never split or padded, and each slice along it is a row.
  A scan over the layer axis finds each layer's slice sharded and padded on its own.
  Unless no axis of a slice fits the device count and an axis of the whole leaf pads
  less (`keeps_layers`): then the whole leaf is one row, as for rank 1 and 2. An
  unscanned `DenseGeneral` kernel `(768, 12, 64)` on 128 devices is split on its axis 0
  (1.0x its share), where keeping axis 0 whole stored each slice's 64 padded to 128
  (2.0x); MaxText's `(4096, 32, 32, 128)` (scanned on axis 1) on 1,024 devices is split
  on its 4096 (1.0x, 8.0x kept). A scan over another axis of such a leaf re-lays it out
  locally (`zeropp_jax.interpreter._relayout`).
- a row is split over the `N` devices on one of its axes, `fit_axis(row_shape, N)`: its
  first axis unless padding that to a multiple of `N` would store more than `RATIO_LIMIT`
  (1.05) times its values; then the axis that pads least (`N` divides it, where one does).
  That axis is zero-padded to `ceil(d / N) * N` and sharded (`leaf_spec`:
  `PartitionSpec(('local', 'node'))` on axis 0 of an unstacked leaf, `PartitionSpec(None,
  ..., ('local', 'node'))` further in). A conv kernel `(3, 3, 64, 64)` on 8 devices is
  split on its axis 2, `(3, 3, 8, 64)` per device, where the first-axis rule stored it
  `(3, 8, 64, 64)`, 2.67x its share.
- so the model-shaped view of the leaf (`zeropp_jax.state._optimizer_view`) is a crop of the
  padded axis, per device, and no reshape at all when `N` divides it: the optimizer
  updates the stored arrays in place. Inside the island a device's shard is flattened per
  layer, `(d0, C / N)` (`C` the padded row's values); a gathered leaf's pieces are put back
  in place along the split axis (`zeropp_jax.state._blocks.join_blocks`).

A stacked leaf's per-layer vectors (biases, norm scales: `(layers, width)`, rank 2) have
the rank-2 layout: they are small, and a scan gathers them whole (see `placement`).

A leaf split for tensor parallelism (`model_dim` set, see `zeropp_jax._tensor_parallel`) is
first cut into `K = model_size` slices along `model_dim`, one per `model` rank; each slice
is zero-padded in rows (its first axis; a stacked leaf's: each layer's) to a multiple of `N`,
flattened to `C` values and sharded like a row above: stored `(K, C)` with
`PartitionSpec('model', ('local', 'node'))`, or, stacked (`model_dim >= 1`, axis 0 the
layers), `(layers, K, C)` with `PartitionSpec(None, 'model', ('local', 'node'))`. Inside
the island (manual over `('node', 'local')`, `model` left to XLA) the `K` axis stays whole:
each `model` rank gathers and reduces only its own slice, and the gathered weight, put
back in its original shape, is split over `model` at `model_dim`.

Each device's shard, flattened, is the *piece* the collectives gather and reduce; a
gathered leaf, every device's piece in partition order, is turned back into the original
shape by `_blocks.unpiece`. Padding stays exactly zero: its gradient
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

DP_AXES = ("local", "node")
"""The data-parallel (ZeRO) axes in partition order: parameters are split over both."""
MODEL_AXIS = "model"
"""The tensor-parallel mesh axis (`make_mesh(..., model_size=K)`); XLA partitions over it."""
PARAM_SPEC = P(("local", "node"))
"""Spec of a sharded parameter of rank 1 or 2 (and of its optimizer state)."""
ROW_PARAM_SPEC = P(None, ("local", "node"))
"""Spec of a stacked parameter (rank >= 3), stored `(d0, padded rows, ...)` (and of its
optimizer state)."""
BATCH_SPEC = P(("node", "local"))
"""Spec of a batch: leading dimension over all devices in node-major order."""
REPLICATED = P()
REFERENCE_SPEC = P("local")
"""Spec of a weight-delta reference (`zeropp_jax.wire._delta`): the padded parameter as pieces,
`(padded_size,)`, each local rank's secondary shard, the same on every node."""

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
LAYOUT_VERSION = 6
"""The stored layout's version (see `with_devices`); checkpoints record it. Version 5
keeps axis 0 of a leaf of rank >= 3 whole only where that pads no more than splitting the
whole leaf (`keeps_layers`); version 4 always kept it whole; both split each kept row on
the axis that fits the device count (`fit_axis`); version 3 always split its first axis,
storing a stacked leaf in its padded model shape, `(d0, padded rows, d2, ...)`; version 2
(the same values) flattened each layer, `(d0, C)`; version 1 also padded the flattened
values rather than rows (`zeropp_jax.state._checkpoint` restores all five)."""
RATIO_LIMIT = 1.05
"""A kept row is split on its first axis unless that pads it above this many times its
values (`fit_axis`); a leaf stored above it is named at `TrainState.create`
(`zeropp_jax.measure._stored_share`)."""


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one parameter leaf is stored.

    Attributes:
      shape: original (global) shape.
      dtype: original dtype name.
      sharded: True for float leaves with at least one dimension (sharded float32 master
        copy); False for replicated leaves.
      padded: rank <= 2, the length of the split axis (`axis`) after padding; rank >= 3,
        `C`, the values per kept row (one layer) after padding (axis 0 is kept whole;
        stored with those values as `padded_row_shape`); tensor-parallel, `C`, the values
        of one `model` slice (one layer's, stacked) after padding; 0 if not sharded.
      model_dim: the axis of `shape` split over the `model` mesh axis (tensor
        parallelism), or None.
      model_size: `K`, the number of `model` slices (1 without tensor parallelism).
      axis: the axis of `row_shape` that padding lengthens and the data-parallel devices
        split (`fit_axis`); 0 for a tensor-parallel leaf.
      keeps_layers: for a leaf of rank >= 3, whether axis 0 is kept whole as a layer
        axis (`stacked`); False where no axis of a slice along it fits the device count
        and an axis of the whole leaf pads less (`with_devices`, version 5): the whole
        leaf is then one row.
      node_axis: None, or, for a kept row split over two of its axes (`fit_grid`, version
        6), the axis of `row_shape` the `node` mesh axis splits; `axis` is then split
        over `local` alone.
      grid: with `node_axis`, `(local size, node count)`: the blocks along `axis` and
        along `node_axis`; None otherwise.
    """

    shape: tuple[int, ...]
    dtype: str
    sharded: bool
    padded: int
    model_dim: int | None = None
    model_size: int = 1
    axis: int = 0
    keeps_layers: bool = True
    node_axis: int | None = None
    grid: tuple[int, int] | None = None

    @property
    def split(self) -> tuple[int, int | None, tuple[int, int] | None]:
        """`(axis, node_axis, grid)`: which axes the devices split and how; two layouts
        of a leaf with the same `split` hold the same blocks in the same order, up to
        padding."""
        return self.axis, self.node_axis, self.grid

    @property
    def two_axis(self) -> bool:
        """Whether each kept row is split over two axes, `local` on `axis` and `node` on
        `node_axis` (`fit_grid`)."""
        return self.node_axis is not None

    @property
    def tensor_parallel(self) -> bool:
        """Whether the leaf is split over the `model` axis (stored with a `K` axis)."""
        return self.sharded and self.model_dim is not None

    @property
    def slice_shape(self) -> tuple[int, ...]:
        """The original shape with `model_dim` divided by `model_size` (one `model`
        rank's slice); `shape` without tensor parallelism."""
        if not self.tensor_parallel:
            return self.shape
        s = list(self.shape)
        s[self.model_dim] //= self.model_size
        return tuple(s)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def stacked(self) -> bool:
        """Whether axis 0 is kept whole (rank >= 3, `keeps_layers`), so that a scan over
        it finds each slice sharded on its own: a stacked matrix `(layers, rows, cols)`."""
        return self.sharded and len(self.shape) >= 3 and self.keeps_layers

    @property
    def lead(self) -> int:
        """Rows kept whole: `shape[0]` for a stacked leaf, 1 otherwise."""
        return self.shape[0] if self.stacked else 1

    @property
    def cols(self) -> int:
        """Values per kept row before padding (stacked: one slice along axis 0;
        tensor-parallel: one `model` slice of it)."""
        shape = self.slice_shape
        return math.prod(shape[1:]) if self.stacked else math.prod(shape)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one kept row (a stacked leaf's layer, a tensor-parallel leaf's
        `model` slice, both for a stacked tensor-parallel leaf; the leaf itself otherwise).
        Its first axis is the one padding lengthens."""
        shape = self.slice_shape
        return shape[1:] if self.stacked else shape

    @property
    def padded_rows(self) -> int:
        """The length of the kept row's split axis (`row_shape[axis]`) after padding, a
        multiple of the device count (rank <= 2 without tensor parallelism: `padded`; split
        over two axes: a multiple of the `local` size)."""
        if self.two_axis:
            return self.padded_row_shape[self.axis]
        if not (self.stacked or self.tensor_parallel):
            return self.padded
        return self.padded // (math.prod(self.row_shape) // self.row_shape[self.axis])

    @property
    def padded_row_shape(self) -> tuple[int, ...]:
        """`row_shape` with its split axis padded (`padded_rows`); split over two axes,
        each padded to a multiple of the mesh axis that splits it."""
        shape = list(self.row_shape)
        if self.two_axis:
            local, nodes = self.grid
            shape[self.axis] = -(-shape[self.axis] // local) * local
            shape[self.node_axis] = -(-shape[self.node_axis] // nodes) * nodes
            return tuple(shape)
        shape[self.axis] = self.padded_rows
        return tuple(shape)

    @property
    def padded_cols(self) -> int:
        """Values per kept row after padding (N times one device's piece of it; tensor
        parallel: of one `model` slice)."""
        if self.stacked or self.tensor_parallel:
            return self.padded
        return math.prod(self.padded_row_shape)

    @property
    def padded_axis(self) -> int:
        """The axis of the stored leaf that padding lengthens and the devices split (-1:
        the last): `axis`, one further for a stacked leaf, the last for a tensor-parallel
        one."""
        if self.tensor_parallel:
            return -1
        return self.axis + (1 if self.stacked else 0)

    @property
    def padded_node_axis(self) -> int | None:
        """Split over two axes: the axis of the stored leaf the `node` mesh axis splits
        (`node_axis`, one further for a stacked leaf); None otherwise."""
        if not self.two_axis:
            return None
        return self.node_axis + (1 if self.stacked else 0)

    @property
    def split_axes(self) -> tuple[tuple[int, int], ...]:
        """`(axis of the stored leaf, its padded length)` for each axis the data-parallel
        devices split: one, or two (`local`'s, then `node`'s)."""
        if not self.two_axis:
            return ((self.padded_axis, self.padded_length),)
        shape = self.stored_shape
        return ((self.padded_axis, shape[self.padded_axis]),) + (
            (self.padded_node_axis, shape[self.padded_node_axis]),
        )

    @property
    def padded_length(self) -> int:
        """The length of `padded_axis` in the stored leaf."""
        if self.stacked and not self.tensor_parallel:
            return self.padded_rows
        return self.padded

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Global shape of the stored (padded) leaf."""
        if not self.sharded:
            return self.shape
        if self.tensor_parallel:
            if self.stacked:
                return (self.lead, self.model_size, self.padded)
            return (self.model_size, self.padded)
        if self.stacked:
            return (self.lead, *self.padded_row_shape)
        return self.padded_row_shape

    @property
    def padded_size(self) -> int:
        """Values of the stored leaf (every device's piece together)."""
        if not self.sharded:
            return self.size
        return self.lead * self.model_size * self.padded_cols

    def block_shape(self, num_devices: int) -> tuple[int, ...]:
        """One device's block of one kept row (not tensor-parallel): `padded_row_shape`
        with the split axis divided by `num_devices` (split over two axes: `axis` by the
        `local` size, `node_axis` by the node count). A device's piece is its block of
        every kept row, flattened in order."""
        shape = list(self.padded_row_shape)
        if self.two_axis:
            local, nodes = self.grid
            shape[self.axis] //= local
            shape[self.node_axis] //= nodes
            return tuple(shape)
        shape[self.axis] //= num_devices
        return tuple(shape)


def leaf_layout(
    path: str, x: Any, num_devices: int, *, local_size: int | None = None
) -> LeafLayout:
    """Layout of one parameter leaf (`local_size`: see `with_devices`); raises `ValueError`
    for non-arrays and bad dtypes."""
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
    return with_devices(
        LeafLayout(shape, dtype.name, sharded, 0), num_devices, local_size=local_size
    )


def fit_axis(row_shape: tuple[int, ...], num_devices: int) -> int:
    """The axis of a kept row (`LeafLayout.row_shape`) to split over `num_devices`
    devices: its first, unless padding that to a multiple of `num_devices` stores more
    than `RATIO_LIMIT` times the row's values; then the axis that pads least (the first of
    equals). A conv kernel's row `(3, 64, 64)` on 8 devices splits axis 1: 1.0x its
    values, where axis 0 would store 2.67x."""

    if pad_ratio(row_shape[0], num_devices) <= RATIO_LIMIT:
        return 0
    return min(range(len(row_shape)), key=lambda i: (pad_ratio(row_shape[i], num_devices), i))


def pad_ratio(length: int, num_devices: int) -> float:
    """An axis of `length` padded to a multiple of `num_devices`, over `length`."""
    return -(-length // num_devices) * num_devices / length


def fit_grid(row_shape: tuple[int, ...], grid: tuple[int, int]) -> tuple[int, int, int]:
    """The split of a kept row over two of its axes on a `(local size, node count)` device
    grid: `(values stored, the axis `local` splits, the axis `node` splits)`, the pair
    that pads least (counted in values, so that equal paddings tie exactly; of equals,
    the first with `node` on the earlier axis); `(0, 0, 0)` for a row of rank 1. A conv
    kernel's row `(3, 512, 512)` on 128 x 8 devices splits its 512s by 8 and by 128: 1.0x
    its values, where one axis over 1,024 devices stores 2.0x."""
    local, nodes = grid
    size = math.prod(row_shape)

    def stored(i: int, j: int) -> int:
        a, b = row_shape[i], row_shape[j]
        return size // a // b * (-(-a // local) * local) * (-(-b // nodes) * nodes)

    pairs = [
        (stored(i, j), i, j) for i in range(len(row_shape)) for j in range(len(row_shape)) if i != j
    ]
    # Of equal paddings, `node` on the earlier axis: a matrix's last axis, along which
    # rows are quantized in blocks (Muon's int8 gather), is then split inside nodes.
    return min(pairs, key=lambda p: (p[0], p[2] > p[1]), default=(0, 0, 0))


def keeps_layers(shape: tuple[int, ...], num_devices: int) -> bool:
    """Whether a leaf of `shape` (rank >= 3, not tensor-parallel) keeps axis 0 whole as a
    layer axis on `num_devices` devices: unless the axis `fit_axis` picks in one slice
    along axis 0 pads above `RATIO_LIMIT` and the one it picks in the whole leaf pads
    strictly less. A layer stack whose slices fit (every trainer GPT to 1,024 devices,
    3x3 convs up to 512 channels on 512) keeps it; `(768, 12, 64)` on 128 devices does not
    (1.0x against 2.0x)."""
    row = pad_ratio(shape[1 + fit_axis(tuple(shape[1:]), num_devices)], num_devices)
    whole = pad_ratio(shape[fit_axis(tuple(shape), num_devices)], num_devices)
    return row <= RATIO_LIMIT or whole >= row


def view_split(
    shape: tuple[int, ...], num_devices: int, local_size: int | None = None
) -> tuple[int, int]:
    """`(axis, devices)`: the axis of a model-shaped leaf of `shape` (not tensor-parallel,
    rank >= 1) that the stored layout splits over the data-parallel devices, counted in
    the leaf's own axes (`LeafLayout.padded_axis`), and over how many: `num_devices`, or,
    for a leaf split over two axes (`local_size` given, `fit_grid`), the axis `local`
    splits and `local_size` (the other axis over the nodes). Whoever reshards a
    model-shaped view (`zeropp_jax._distributed_muon`) reads it here rather than from the
    value's type, which does not carry it under `jax.jit`."""
    layout = with_devices(
        LeafLayout(tuple(shape), "float32", True, 0), num_devices, local_size=local_size
    )
    return layout.padded_axis, (layout.grid[0] if layout.two_axis else num_devices)


def with_devices(
    layout: LeafLayout,
    num_devices: int,
    *,
    version: int = LAYOUT_VERSION,
    local_size: int | None = None,
) -> LeafLayout:
    """The layout of the same leaf padded for `num_devices` data-parallel devices.

    Version 6 (this one) is version 5 plus one rule: where the axis `fit_axis` picks pads
    a kept row above `RATIO_LIMIT`, and `local_size` (the mesh's `local` size; None: not
    known, one axis only) gives a grid of `local_size` x `num_devices / local_size`
    devices on which two axes of the row pad strictly less (`fit_grid`), the row is split
    over those two: `local` on one, `node` on the other (`node_axis`), each padded to a
    multiple of its mesh axis. Not for a tensor-parallel leaf.

    Versions 2 to 5 pad whole rows: a kept row (the leaf; one layer of a stacked leaf; one
    `model` slice of a tensor-parallel one) is padded along one axis to a multiple of
    `num_devices`, so that every device holds a block of whole rows of that axis and the
    model-shaped view is a crop. Version 5 (this one) also decides whether a leaf of rank
    >= 3 keeps axis 0 whole (`keeps_layers`); version 4 always kept it; 5 and 4 pick the
    split axis with `fit_axis`; 3
    and 2 always padded the first (they differ only in how a stacked leaf is stored, see
    `LAYOUT_VERSION`); a tensor-parallel leaf pads the first in every version. Version 1
    (checkpoints written before) padded a stacked or tensor-parallel row's flattened values
    to a multiple of `num_devices`.
    """
    if not layout.sharded:
        return layout
    if version not in range(1, LAYOUT_VERSION + 1):
        raise ValueError(f"layout version must be 1 to {LAYOUT_VERSION}, got {version!r}.")
    keep = (
        version < 5
        or layout.tensor_parallel
        or len(layout.shape) < 3
        or keeps_layers(layout.shape, num_devices)
    )
    layout = dataclasses.replace(layout, keeps_layers=keep)
    structured = layout.stacked or layout.tensor_parallel
    if version == 1 and structured:
        padded = -(-layout.cols // num_devices) * num_devices
        return dataclasses.replace(layout, padded=padded, axis=0)
    fits = version >= 4 and not layout.tensor_parallel
    axis = fit_axis(layout.row_shape, num_devices) if fits else 0
    rows = layout.row_shape[axis]
    padded = -(-rows // num_devices) * num_devices
    layout = dataclasses.replace(layout, axis=axis, node_axis=None, grid=None)
    grid = _grid(num_devices, local_size) if fits and version >= 6 else None
    if grid is not None and padded / rows > RATIO_LIMIT:
        values, local_axis, node_axis = fit_grid(layout.row_shape, grid)
        if 0 < values < padded * (math.prod(layout.row_shape) // rows):
            two = dataclasses.replace(layout, axis=local_axis, node_axis=node_axis, grid=grid)
            shape = two.padded_row_shape
            return dataclasses.replace(
                two, padded=math.prod(shape) if structured else shape[local_axis]
            )
    if structured:
        padded *= math.prod(layout.row_shape) // rows
    return dataclasses.replace(layout, padded=padded)


def _grid(num_devices: int, local_size: int | None) -> tuple[int, int] | None:
    """`(local size, node count)` where both exceed 1, else None (one axis only)."""
    if not local_size or num_devices % local_size or not 1 < local_size < num_devices:
        return None
    return local_size, num_devices // local_size


def with_model_split(
    layout: LeafLayout,
    model_dim: int | None,
    model_size: int,
    num_devices: int,
    *,
    version: int = LAYOUT_VERSION,
    local_size: int | None = None,
) -> LeafLayout:
    """The layout of the same leaf split over `model_size` `model` ranks at `model_dim`
    (None, or `model_size` 1: not split), padded for `num_devices` data-parallel devices
    (`version`, `local_size`: see `with_devices`). The caller has checked that `model_size` divides
    `shape[model_dim]` and that a stacked leaf is not split along its layer axis."""
    if not layout.sharded or model_dim is None or model_size == 1:
        whole = dataclasses.replace(layout, model_dim=None, model_size=1)
        return with_devices(whole, num_devices, version=version, local_size=local_size)
    split = dataclasses.replace(layout, model_dim=model_dim, model_size=model_size)
    return with_devices(split, num_devices, version=version, local_size=local_size)


def param_layouts(params: Any, num_devices: int, *, local_size: int | None = None) -> Any:
    """Pytree of `LeafLayout`s matching `params` (`local_size`: see `with_devices`)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: leaf_layout(jax.tree_util.keystr(p), x, num_devices, local_size=local_size),
        params,
    )


def is_layout(x: Any) -> bool:
    return isinstance(x, LeafLayout)


def _split_model(x: jax.Array, layout: LeafLayout, lead: int) -> jax.Array:
    """`x` in the original shape -> its `K` model slices, each flattened: `(K, slice
    values)`, or, for a stacked leaf (`lead` 1), `(layers, K, one layer's slice values)`."""
    d, k = layout.model_dim, layout.model_size
    shape = x.shape
    x = x.reshape(*shape[:d], k, shape[d] // k, *shape[d + 1 :])
    x = jnp.moveaxis(x, d, lead)
    return x.reshape(*x.shape[: lead + 1], -1)


def join_model(x: jax.Array, layout: LeafLayout, layer: bool) -> jax.Array:
    """Inverse of `_split_model`: `(K, slice values)` (or `(layers, K, ...)` for a whole
    stacked leaf; `layer`: one layer) -> the original (or one layer's) shape."""
    lead = 1 if layout.stacked and not layer else 0
    shape = layout.shape[1:] if layer else layout.shape
    sliced = list(layout.slice_shape[1:] if layer else layout.slice_shape)
    d = layout.model_dim - (1 if layer else 0)
    x = x.reshape(*x.shape[: lead + 1], *sliced[lead:])
    x = jnp.moveaxis(x, lead, d)
    return x.reshape(shape)


def to_master(x: jax.Array, layout: LeafLayout) -> jax.Array:
    """Original leaf -> stored leaf (float32, padded) for sharded leaves; as-is otherwise."""
    if not layout.sharded:
        return jnp.asarray(x)
    x = jnp.asarray(x, jnp.float32)
    if layout.tensor_parallel:
        x = _split_model(x, layout, 1 if layout.stacked else 0)
    return resize_padding(x, layout)


def from_master(x: jax.Array, layout: LeafLayout, dtype: Any = None) -> jax.Array:
    """Stored leaf -> original shape, in `dtype` (default: the original dtype)."""
    if layout.sharded:
        if layout.tensor_parallel:
            x = join_model(x[..., : layout.cols], layout, False)
        else:
            for axis, _ in layout.split_axes:
                x = lax.slice_in_dim(x, 0, layout.shape[axis], axis=axis)
    return x.astype(layout.dtype if dtype is None else dtype)


def resize_padding(x: jax.Array, layout: LeafLayout) -> jax.Array:
    """Crops or zero-pads the padded axis of `x` (a stored leaf, e.g. padded for another
    mesh; both, split over two axes) to `layout`'s padding."""
    for axis, want in layout.split_axes:
        axis %= x.ndim
        have = x.shape[axis]
        if have > want:
            x = lax.slice_in_dim(x, 0, want, axis=axis)
        elif have < want:
            pad = [(0, 0)] * x.ndim
            pad[axis] = (0, want - have)
            x = jnp.pad(x, pad)
    return x


def leaf_spec(layout: LeafLayout) -> P:
    """The `PartitionSpec` of a stored leaf."""
    if not layout.sharded:
        return REPLICATED
    if layout.tensor_parallel:
        return P(None, MODEL_AXIS, DP_AXES) if layout.stacked else P(MODEL_AXIS, DP_AXES)
    if layout.two_axis:
        dims: list[Any] = [None] * len(layout.stored_shape)
        dims[layout.padded_axis], dims[layout.padded_node_axis] = DP_AXES
        return P(*dims)
    return P(*([None] * layout.padded_axis), DP_AXES)


def manual_spec(layout: LeafLayout) -> P:
    """The `PartitionSpec` of a stored leaf over the island's manual axes (`node`,
    `local`) only; the `model` axis is left to XLA."""
    spec = leaf_spec(layout)
    return P(*(None if s == MODEL_AXIS else s for s in spec))


def gathered_spec(layout: LeafLayout, layer: bool = False) -> P | None:
    """How a gathered tensor-parallel weight is split over `model` (in its original shape,
    or one layer's); None for a leaf not split over it."""
    if not layout.tensor_parallel:
        return None
    rank = len(layout.shape) - (1 if layer else 0)
    dims: list[Any] = [None] * rank
    dims[layout.model_dim - (1 if layer else 0)] = MODEL_AXIS
    return P(*dims)


def param_shardings(layouts: Any, mesh: Mesh) -> Any:
    """`NamedSharding` per stored leaf."""
    return jax.tree_util.tree_map(
        lambda lo: NamedSharding(mesh, leaf_spec(lo)), layouts, is_leaf=is_layout
    )


def param_count(layouts: Any) -> int:
    """Number of values in the original parameters (float and non-float)."""
    leaves = jax.tree_util.tree_leaves(layouts, is_leaf=is_layout)
    return sum(lo.size for lo in leaves)
