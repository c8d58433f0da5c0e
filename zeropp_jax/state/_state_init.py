"""How a `TrainState`'s arrays are made: the stored (float32, padded) master leaves from a
parameter tree (any pytree of arrays: a flax dict, an Equinox module's arrays, a dataclass
or NamedTuple registered as a pytree) or, by sharded init, from a `ShardedInit` that
returns one; and the same as `jax.ShapeDtypeStruct`s (`placed`) for a state built from
shapes alone (the optimizer state: `zeropp_jax.state._optimizer_view`). Shapes are global;
shardings say what each device holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from zeropp_jax.interpreter._island import is_array
from zeropp_jax.state import _partition as part


@dataclasses.dataclass(frozen=True)
class ShardedInit:
    """Asks for sharded init: `fn`, a zero-argument callable returning the parameter tree,
    is run once under `jax.jit` with the stored layout as its output sharding, so that
    neither a device nor the host ever holds the unsharded tree.

    Pass it as `params` (`zpp.TrainState.create(params=zpp.ShardedInit(lambda:
    model.init(key, x)['params']), ...)`). A bare callable is refused there rather than
    guessed at: an Equinox module is a callable that is also a tree of parameters.

    Attributes:
      fn: the zero-argument callable; it returns global shapes (the whole tree).
    """

    fn: Callable[[], Any]

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(
                f"ShardedInit(fn): fn must be a zero-argument callable returning the "
                f"parameter tree, got {type(self.fn).__name__}; pass the tree itself as "
                "params instead."
            )

    def __call__(self) -> Any:
        """The parameter tree, `fn()` (unsharded when called outside `jax.jit`)."""
        return self.fn()


def check_params(params: Any) -> None:
    """Raises `ValueError` for `params` that is a bare callable (a function, not a
    `ShardedInit` and not a pytree with array leaves) or holds a callable leaf.

    An Equinox module is callable too, so callability alone decides nothing: a value is
    taken for an init function only when wrapped in `ShardedInit`. A callable leaf (an
    Equinox module's activation function) is refused by path; other non-array leaves are
    reported later (`partition.leaf_layout`).
    """
    if isinstance(params, ShardedInit):
        return
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if callable(params) and len(leaves) == 1 and leaves[0][1] is params:
        raise ValueError(
            f"params is a {type(params).__name__} (a callable), not a tree of arrays; for "
            "sharded init wrap it: params=zpp.ShardedInit(fn), fn returning the "
            "parameter tree; else pass the tree itself (model.init(...)['params'], or "
            "eqx.partition(model, eqx.is_array)[0] for an Equinox model)."
        )
    for path, x in leaves:
        if callable(x) and not is_array(x):
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} is a {type(x).__name__} (a "
                "callable), not an array; pass only the model's arrays, e.g. "
                "eqx.partition(model, eqx.is_array)[0] for an Equinox model (and "
                "eqx.combine them with the rest inside apply_fn)."
            )


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
    `ShardedInit` (traced, not run).

    Raises:
      ValueError: for a bare callable (see `check_params`).
    """
    check_params(params)
    if isinstance(params, ShardedInit):
        return jax.eval_shape(params.fn)
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if is_array(x) else x, params
    )


def sharded_init(
    params_fn: ShardedInit | Callable[[], Any],
    leaf_layouts: tuple[part.LeafLayout, ...],
    shardings: Sequence[NamedSharding],
) -> Callable[[], list[jax.Array]]:
    """The sharded-init program: `params_fn()` turned into the stored (float32, padded)
    leaves, jitted with `shardings` as `out_shardings`, so that XLA's partitioner computes
    each device's shard where it lives and no device or host holds the unsharded tree.

    Args:
      params_fn: a `ShardedInit` (or the zero-argument callable it wraps) returning the
        parameter tree.
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
    """The stored leaves of `params` (a tree, converted one leaf at a time; or a
    `ShardedInit`, run by `sharded_init`), placed with `shardings`."""
    check_params(params)
    if isinstance(params, ShardedInit):
        return sharded_init(params, leaf_layouts, shardings)()
    leaves = jax.tree_util.tree_leaves(params)
    return [
        jax.jit(part.to_master, static_argnums=1, out_shardings=s)(x, lo)
        for x, lo, s in zip(leaves, leaf_layouts, shardings, strict=True)
    ]
