"""Partition layout: how each parameter leaf is padded and sharded over the mesh.

A float leaf of shape `(d0, ...)` is cast to float32 (the master copy), padded with zero
rows to `ceil(d0 / N) * N` and sharded along axis 0 with `PartitionSpec(('local', 'node'))`
(see `collectives` for why that order). Padding rows stay exactly zero: their gradient is
zero, and so is every optimizer update of a zero parameter with a zero gradient. Float
scalars and non-float leaves (counters, int tables) are replicated and never quantized.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PARAM_SPEC = P(("local", "node"))
"""Spec of a sharded parameter (and of its optimizer state)."""
BATCH_SPEC = P(("node", "local"))
"""Spec of a batch: leading dimension over all devices in node-major order."""
REPLICATED = P()
REFERENCE_SPEC = P("local")
"""Spec of a weight-delta reference (`zeropp_jax.delta`): padded parameter shape, each
local rank's secondary shard, the same on every node."""

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one parameter leaf is stored.

    Attributes:
      shape: original (global) shape.
      dtype: original dtype name.
      sharded: True for float leaves with at least one dimension (sharded float32 master
        copy); False for replicated leaves.
      padded_rows: leading dimension after padding (equal to `shape[0]` if not sharded).
    """

    shape: tuple[int, ...]
    dtype: str
    sharded: bool
    padded_rows: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)


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
    rows = shape[0] if shape else 0
    padded = -(-rows // num_devices) * num_devices if sharded else rows
    return LeafLayout(shape, dtype.name, sharded, padded)


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
    pad = layout.padded_rows - layout.shape[0]
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x


def from_master(x: jax.Array, layout: LeafLayout, dtype: Any = None) -> jax.Array:
    """Stored (or gathered full, padded) leaf -> original shape, in `dtype` (default: the
    original dtype)."""
    if layout.sharded:
        x = x[: layout.shape[0]]
    return x.astype(layout.dtype if dtype is None else dtype)


def leaf_spec(layout: LeafLayout) -> P:
    return PARAM_SPEC if layout.sharded else REPLICATED


def param_shardings(layouts: Any, mesh: Mesh) -> Any:
    """`NamedSharding` per stored leaf."""
    return jax.tree_util.tree_map(
        lambda lo: NamedSharding(mesh, leaf_spec(lo)), layouts, is_leaf=is_layout
    )


def param_count(layouts: Any) -> int:
    """Number of values in the original parameters (float and non-float)."""
    leaves = jax.tree_util.tree_leaves(layouts, is_leaf=is_layout)
    return sum(lo.size for lo in leaves)
