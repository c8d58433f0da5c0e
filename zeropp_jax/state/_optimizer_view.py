"""Model-shaped views of the stored parameters, on which the optimizer runs.

`tx.init`, `tx.update` and `optax.apply_updates` see every parameter in its model shape
(the global view, the tree `gather_params` returns, in float32), sharded over the devices
(`view_spec`): a shape-reading transform (Adafactor's factored moments, Muon's
Newton-Schulz, masks by rank) computes what it computes on one device. The optimizer
state mirrors those shapes; a state leaf shaped like a parameter (a moment, a trace) is
kept between steps in the parameter's stored layout (`partition`), padding zero, and every
other leaf (counts, factored statistics) replicated.

Because the stored layout pads whole rows of one axis (`partition.with_devices`) and
keeps a leaf's rank (a stacked leaf is `(layers, *padded row)`), a view is a crop of that
axis, each device's block stays where it is, and where the device count divides the axis
the view is the stored array itself: elementwise transforms (Adam, Lion, SGD) add no
collective and no copy (XLA updates the stored moments in place). A transform that reads
more than a device's rows (Muon's matrix products) makes XLA gather inside the update;
those collectives sit under the named scope `UPDATE_SCOPE`, and the ledger lists them as
the `update` phase.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.state import _partition as part

UPDATE_SCOPE = "zeropp_update"
"""The named scope of the optimizer update (the ledger's `update` phase)."""


def view_spec(layout: part.LeafLayout) -> P:
    """How the model-shaped view of a stored leaf is sharded: the axis its stored layout
    splits (`LeafLayout.padded_axis`; a tensor-parallel leaf's first row axis) over the
    data-parallel axes, a tensor-parallel leaf's `model_dim` over `model` (both on one
    axis, `model` first, when they coincide); a leaf split over two axes as stored
    (`part.leaf_spec`)."""
    if not layout.sharded:
        return part.REPLICATED
    if layout.two_axis:
        return part.leaf_spec(layout)
    dims: list[Any] = [None] * len(layout.shape)
    row = (1 if layout.stacked else 0) if layout.tensor_parallel else layout.padded_axis
    dims[row] = part.DP_AXES
    if layout.tensor_parallel:
        d = layout.model_dim
        dims[d] = (part.MODEL_AXIS, *part.DP_AXES) if d == row else part.MODEL_AXIS
    return P(*dims)


def _crop_rows(x: jax.Array, layout: part.LeafLayout, axis: int) -> jax.Array:
    """`(..., C)` (kept rows flattened, padded), the kept rows starting at `axis` -> the
    rows cropped: `(..., *row_shape)`."""
    rows = layout.row_shape
    x = x.reshape(*x.shape[:axis], layout.padded_rows, *rows[1:])
    return jax.lax.slice_in_dim(x, 0, rows[0], axis=axis)


def _pad_rows(x: jax.Array, layout: part.LeafLayout, axis: int) -> jax.Array:
    """Inverse of `_crop_rows`: zero rows appended at `axis`, then flattened from it."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, layout.padded_rows - x.shape[axis])
    return jnp.pad(x, pad).reshape(*x.shape[:axis], layout.padded)


def to_view(x: jax.Array, layout: part.LeafLayout, mesh: Mesh) -> jax.Array:
    """A stored leaf (global, `layout.stored_shape`) -> its model-shaped view (global,
    `layout.shape`, dtype kept), sharded by `view_spec`. Leaves not sharded: as they are."""
    if not layout.sharded:
        return x
    if not layout.tensor_parallel:
        v = x
        for axis, _ in layout.split_axes:
            v = jax.lax.slice_in_dim(v, 0, layout.shape[axis], axis=axis)
    else:
        lead = 1 if layout.stacked else 0
        v = _crop_rows(x, layout, lead + 1)  # (layers?, K, *row_shape)
        v = jnp.moveaxis(v, lead, layout.model_dim).reshape(layout.shape)
    return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, view_spec(layout)))


def from_view(v: jax.Array, layout: part.LeafLayout, mesh: Mesh) -> jax.Array:
    """Inverse of `to_view`: a model-shaped leaf (global) -> the stored layout, padding
    zero, dtype kept, sharded like the stored parameter."""
    if not layout.sharded:
        return v
    if not layout.tensor_parallel:
        x = part.resize_padding(v, layout)
    else:
        lead = 1 if layout.stacked else 0
        d, k = layout.model_dim, layout.model_size
        shape = layout.shape
        x = v.reshape(*shape[:d], k, shape[d] // k, *shape[d + 1 :])
        x = _pad_rows(jnp.moveaxis(x, d, lead), layout, lead + 1)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, part.leaf_spec(layout)))


def param_paths(treedef: Any, layouts: tuple[part.LeafLayout, ...]) -> list[str]:
    """The key path (`jax.tree_util.keystr`) of every parameter leaf, in leaf order."""
    tree = jax.tree_util.tree_unflatten(treedef, list(layouts))
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=part.is_layout)[0]
    return [jax.tree_util.keystr(p) for p, _ in flat]


def view_shapes(treedef: Any, layouts: tuple[part.LeafLayout, ...]) -> Any:
    """The parameters' model-shaped views as `jax.ShapeDtypeStruct`s (float32 where
    sharded, the stored dtype otherwise): what `tx.init` and `tx.update` see."""
    return jax.tree_util.tree_unflatten(
        treedef,
        [jax.ShapeDtypeStruct(lo.shape, jnp.float32 if lo.sharded else lo.dtype) for lo in layouts],
    )


def mirrors(opt_shapes: Any, paths: list[str], layouts: tuple[part.LeafLayout, ...]) -> tuple:
    """Per leaf of the optimizer state (model-shaped, e.g. `jax.eval_shape(tx.init,
    view_shapes(...))`), the index of the sharded parameter it mirrors, or None.

    A state leaf mirrors a parameter when its key path ends with the parameter's (optax
    states hold trees shaped like the parameters, e.g. `[0].mu['Dense_0']['kernel']`) and
    it has the parameter's shape; the longest such path wins.
    """
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(opt_shapes)[0]:
        key = jax.tree_util.keystr(path)
        match = [
            i
            for i, (p, lo) in enumerate(zip(paths, layouts, strict=True))
            if lo.sharded and key.endswith(p) and tuple(x.shape) == lo.shape
        ]
        out.append(max(match, key=lambda i: len(paths[i]), default=None))
    return tuple(out)


def state_shapes(
    opt_shapes: Any, mirror: tuple, layouts: tuple[part.LeafLayout, ...], mesh: Mesh
) -> Any:
    """The optimizer state as kept between steps, as `jax.ShapeDtypeStruct`s with
    shardings: a leaf that mirrors a parameter in the parameter's stored shape and
    sharding (its own dtype), every other leaf as it is, replicated."""
    leaves, treedef = jax.tree_util.tree_flatten(opt_shapes)
    out = []
    for x, i in zip(leaves, mirror, strict=True):
        if i is None:
            sharding = NamedSharding(mesh, part.REPLICATED)
            out.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding))
        else:
            lo = layouts[i]
            sharding = NamedSharding(mesh, part.leaf_spec(lo))
            out.append(jax.ShapeDtypeStruct(lo.stored_shape, x.dtype, sharding=sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def _map_mirrored(fn, opt_state: Any, mirror: tuple, layouts, mesh: Mesh) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(opt_state)
    if len(leaves) != len(mirror):
        raise ValueError(
            f"the optimizer state has {len(leaves)} leaves but the state was built for "
            f"{len(mirror)}; build the TrainState with the optimizer it runs."
        )
    return jax.tree_util.tree_unflatten(
        treedef,
        [x if i is None else fn(x, layouts[i], mesh) for x, i in zip(leaves, mirror, strict=True)],
    )


def state_to_view(opt_state: Any, mirror: tuple, layouts, mesh: Mesh) -> Any:
    """The kept optimizer state -> model-shaped (each mirrored leaf by `to_view`)."""
    return _map_mirrored(to_view, opt_state, mirror, layouts, mesh)


def state_from_view(opt_state: Any, mirror: tuple, layouts, mesh: Mesh) -> Any:
    """Model-shaped optimizer state -> as kept (each mirrored leaf by `from_view`)."""
    return _map_mirrored(from_view, opt_state, mirror, layouts, mesh)


def init(
    tx: optax.GradientTransformation,
    master: Any,
    layouts: tuple[part.LeafLayout, ...],
    mesh: Mesh,
    *,
    abstract: bool = False,
) -> tuple[Any, tuple]:
    """`tx.init` on the model-shaped views of `master` (the stored parameter tree).

    Returns:
      The optimizer state as kept (see `state_shapes`; with `abstract`, only its
      `jax.ShapeDtypeStruct`s, nothing allocated) and the mirror table (`mirrors`).
    """
    treedef = jax.tree_util.tree_structure(master)
    opt_shapes = jax.eval_shape(tx.init, view_shapes(treedef, layouts))
    mirror = mirrors(opt_shapes, param_paths(treedef, layouts), layouts)
    kept = state_shapes(opt_shapes, mirror, layouts, mesh)
    if abstract:
        return kept, mirror

    def run(master):
        leaves = jax.tree_util.tree_leaves(master)
        views = [to_view(x, lo, mesh) for x, lo in zip(leaves, layouts, strict=True)]
        state = tx.init(jax.tree_util.tree_unflatten(treedef, views))
        return state_from_view(state, mirror, layouts, mesh)

    shardings = jax.tree_util.tree_map(lambda x: x.sharding, kept)
    return jax.jit(run, out_shardings=shardings)(master), mirror


def in_update_scope(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` whose `update` runs under the named scope `UPDATE_SCOPE`, so that a ledger
    counts the collectives XLA inserts there as the `update` phase (what the engine does
    for its own update; `zeropp_jax.baselines.xla_fsdp_state` does it for XLA FSDP's).
    The computation is `tx`'s: a named scope only names ops."""

    def scoped(updates, state, params=None, **extra_args):
        with jax.named_scope(UPDATE_SCOPE):
            return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(tx.init, scoped)


def update(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    layouts: tuple[part.LeafLayout, ...],
    mirror: tuple,
    mesh: Mesh,
) -> tuple[Any, Any]:
    """`tx.update` on model-shaped views (global view), then `optax.apply_updates`,
    elementwise, in the stored layout, under the named scope `UPDATE_SCOPE`. Jitted (inlined
    into the step's jit; called eagerly, it compiles on its own: a view of a leaf whose rows
    do not divide over the devices exists only inside a jit).

    Args:
      tx: the optimizer.
      grads: gradients of the stored parameters (stored layout).
      opt_state: the optimizer state as kept (`init`).
      params: the stored parameters.
      layouts: every parameter leaf's layout, in leaf order.
      mirror: the mirror table `init` returned.
      mesh: the mesh the parameters live on.

    Returns:
      The new stored parameters (padding exactly zero) and the new kept optimizer state.
    """
    return _update(tx, layouts, mirror, mesh, grads, opt_state, params)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _update(
    tx: optax.GradientTransformation,
    layouts: tuple[part.LeafLayout, ...],
    mirror: tuple,
    mesh: Mesh,
    grads: Any,
    opt_state: Any,
    params: Any,
) -> tuple[Any, Any]:
    with jax.named_scope(UPDATE_SCOPE):
        treedef = jax.tree_util.tree_structure(params)

        def views(tree):
            leaves = jax.tree_util.tree_leaves(tree)
            out = [to_view(x, lo, mesh) for x, lo in zip(leaves, layouts, strict=True)]
            return jax.tree_util.tree_unflatten(treedef, out)

        p, g = views(params), views(grads)
        state = state_to_view(opt_state, mirror, layouts, mesh)
        updates, state = tx.update(g, state, p)
        # `optax.apply_updates` is elementwise: it adds the updates in the stored layout
        # (padding: zero plus zero), where the parameters live, so that the addition is
        # compiled alike whatever reads the new parameters next (the weight-delta
        # references' quantizer, XLA's or a Pallas kernel).
        updates = jax.tree_util.tree_leaves(updates)
        stored = [from_view(u, lo, mesh) for u, lo in zip(updates, layouts, strict=True)]
        new = optax.apply_updates(params, jax.tree_util.tree_unflatten(treedef, stored))
        return new, state_from_view(state, mirror, layouts, mesh)
