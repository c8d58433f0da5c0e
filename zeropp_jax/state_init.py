"""How a `TrainState`'s arrays are made: the stored (float32, padded) master leaves from a
parameter tree or, by sharded init, from a callable that returns one; the optimizer state
sharded like the parameters; and the same as `jax.ShapeDtypeStruct`s (`placed`) for a state
built from shapes alone. Shapes are global; shardings say what each device holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding

from zeropp_jax import partition as part
from zeropp_jax.island import is_array


def init_opt_state(
    tx: optax.GradientTransformation,
    master: Any,
    leaf_layouts: tuple[part.LeafLayout, ...],
    mesh: Mesh,
    *,
    abstract: bool = False,
) -> Any:
    """`tx.init(master)` with every leaf shaped like a sharded parameter sharded like one
    (moments, traces) and everything else (counts, schedules' state) replicated; with
    `abstract`, only its `jax.ShapeDtypeStruct`s (shardings set), nothing allocated."""
    specs = {lo.stored_shape: part.leaf_spec(lo) for lo in leaf_layouts if lo.sharded}
    shapes = jax.eval_shape(tx.init, master)

    def sharding(x):
        return NamedSharding(mesh, specs.get(tuple(x.shape), part.REPLICATED))

    shardings = jax.tree_util.tree_map(sharding, shapes)
    if abstract:
        return placed(shapes, shardings)
    return jax.jit(tx.init, out_shardings=shardings)(master)


def placed(shapes: Any, shardings: Any) -> Any:
    """`jax.ShapeDtypeStruct`s of `shapes` (a tree of shaped things) with `shardings` (one
    per leaf, or one for all)."""
    if isinstance(shardings, NamedSharding):
        shardings = jax.tree_util.tree_map(lambda _: shardings, shapes)
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def shapes_of(params: Any) -> Any:
    """The `jax.ShapeDtypeStruct` tree of `params`: a tree of arrays (or of shapes), or a
    zero-argument callable returning one (traced, not run)."""
    if callable(params):
        return jax.eval_shape(params)
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if is_array(x) else x, params
    )


def sharded_init(
    params_fn: Callable[[], Any],
    leaf_layouts: tuple[part.LeafLayout, ...],
    shardings: Sequence[NamedSharding],
) -> Callable[[], list[jax.Array]]:
    """The sharded-init program: `params_fn()` turned into the stored (float32, padded)
    leaves, jitted with `shardings` as `out_shardings`, so that XLA's partitioner computes
    each device's shard where it lives and no device or host holds the unsharded tree.

    Args:
      params_fn: a zero-argument callable returning the parameter tree.
      leaf_layouts: the layout of each leaf (`partition.param_layouts`), in leaf order.
      shardings: the `NamedSharding` of each stored leaf.

    Returns:
      The jitted zero-argument program (call it, or `.lower()` it).
    """

    def init() -> list:
        leaves = jax.tree_util.tree_leaves(params_fn())
        return [part.to_master(x, lo) for x, lo in zip(leaves, leaf_layouts, strict=True)]

    return jax.jit(init, out_shardings=list(shardings))


def master_leaves(params: Any, leaf_layouts: tuple[part.LeafLayout, ...], shardings: list) -> list:
    """The stored leaves of `params` (a tree, converted one leaf at a time; or a callable,
    run by `sharded_init`), placed with `shardings`."""
    if callable(params):
        return sharded_init(params, leaf_layouts, shardings)()
    leaves = jax.tree_util.tree_leaves(params)
    return [
        jax.jit(part.to_master, static_argnums=1, out_shardings=s)(x, lo)
        for x, lo, s in zip(leaves, leaf_layouts, shardings, strict=True)
    ]
