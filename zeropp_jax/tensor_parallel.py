"""Tensor parallelism on the mesh's `model` axis.

A parameter is split over `model` where the model says so: a flax
`nn.with_partitioning(init, names)` (or `nn.Partitioned` box) whose `names` give `'model'`
for one dimension. `model_dims` reads those annotations into the dimension of each leaf
that `zeropp_jax.partition` splits, checking them against the mesh; `per_model_rank` runs
a leaf's ZeRO collectives (which see one `model` slice) once per `model` rank, inside the
island, so that each device gathers and reduces only its own slice and XLA partitions the
model's compute over `model` (Megatron-style: it inserts the tensor-parallel collectives).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax.core import meta
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax import partition as part

ZERO_AXES = ("node", "local")


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def unbox(params: Any) -> tuple[Any, list[tuple[Any, ...] | None]]:
    """`(params without boxes, per leaf its partitioning names or None)`.

    Leaves are in the order of `jax.tree_util.tree_leaves` of the unboxed tree. A box
    other than `nn.Partitioned` (other flax metadata) is unboxed with no names.
    """
    flat = jax.tree_util.tree_leaves(params, is_leaf=_is_box)
    names: list[tuple[Any, ...] | None] = []
    for x in flat:
        if isinstance(x, meta.Partitioned):
            names.append(tuple(x.names))
        else:
            names.extend([None] * len(jax.tree_util.tree_leaves(x)))
    return meta.unbox(params), names


def _axes_of(name: Any) -> tuple[str, ...]:
    if name is None:
        return ()
    if isinstance(name, str):
        return (name,)
    return tuple(name)


def model_dims(
    paths: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    names: Sequence[tuple[Any, ...] | None],
    mesh: Mesh,
) -> list[int | None]:
    """Per leaf, the dimension split over `model`, or None (not annotated, or a `model`
    axis of size 1).

    Args:
      paths: per leaf, its path (for errors).
      shapes: per leaf, its global shape.
      names: per leaf, its `nn.Partitioned` names, or None.
      mesh: the mesh the state is built for.

    Raises:
      ValueError: (one line) for names that do not match the leaf's rank, name an axis the
        mesh does not have or a ZeRO axis, name `model` twice, split a dimension that
        `model_size` does not divide, or split the layer axis of a stacked leaf.
    """
    axes = tuple(mesh.axis_names)
    k = int(mesh.shape["model"]) if "model" in axes else 1
    out: list[int | None] = []
    for path, shape, leaf_names in zip(paths, shapes, names, strict=True):
        if leaf_names is None:
            out.append(None)
            continue
        if len(leaf_names) != len(shape):
            raise ValueError(
                f"parameter {path} of shape {shape} is annotated with {len(leaf_names)} names "
                f"{leaf_names}; expected one name (or None) per dimension."
            )
        dims = []
        for d, name in enumerate(leaf_names):
            for axis in _axes_of(name):
                if axis in ZERO_AXES:
                    raise ValueError(
                        f"parameter {path} names the ZeRO axis {axis!r} in {leaf_names}; "
                        "the engine shards every parameter over ('node', 'local') itself: "
                        "annotate only the tensor-parallel axis 'model'."
                    )
                if axis not in axes:
                    fix = (
                        "build the mesh with zpp.make_mesh(..., model_size=K)"
                        if axis == "model"
                        else "annotate with 'model' (the tensor-parallel axis) or None"
                    )
                    raise ValueError(
                        f"parameter {path} names the mesh axis {axis!r} in {leaf_names}, but "
                        f"the mesh has axes {axes}; {fix}."
                    )
                dims.append(d)
        if len(dims) > 1:
            raise ValueError(
                f"parameter {path} names 'model' for dimensions {dims} in {leaf_names}; "
                "split one dimension over the tensor-parallel axis."
            )
        if not dims or k == 1:
            out.append(None)
            continue
        d = dims[0]
        if shape[d] % k:
            raise ValueError(
                f"parameter {path} of shape {shape} splits dimension {d} ({shape[d]}) over "
                f"model_size={k}, which does not divide it; pick a model_size that divides "
                f"{shape[d]} or pad the dimension."
            )
        if len(shape) >= 3 and d == 0:
            raise ValueError(
                f"parameter {path} of shape {shape} splits dimension 0 over 'model', but a "
                "leaf of rank >= 3 is stored as stacked layers with axis 0 whole; split "
                "another dimension."
            )
        out.append(d)
    return out


def per_model_rank(
    fn: Callable[..., Any], split: tuple[Any, ...], shared: tuple[Any, ...], check_vma: bool
) -> Any:
    """`fn(*split_slices, *shared)` run once per `model` rank, inside the island.

    Each array of `split` carries the `model` slices on its axis 0, `(K, ...)`; `fn` sees
    one slice (axis 0 dropped) and the `shared` values (the same on every `model` rank:
    keys, residuals), and its outputs come back with axis 0 of size `K` again. Runs as a
    `shard_map` over `model` nested in the island's, so a collective of `fn` over `node`
    and `local` moves one slice per device, never the `K` slices together.
    """
    mesh = jax.sharding.get_abstract_mesh()

    def body(split, shared):
        out = fn(*jax.tree_util.tree_map(lambda a: a[0], split), *shared)
        return jax.tree_util.tree_map(lambda a: a[None], out)

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(part.MODEL_AXIS), P()),
        out_specs=P(part.MODEL_AXIS),
        axis_names={part.MODEL_AXIS},
        check_vma=check_vma,
    )(split, shared)


def place_gathered(w: jax.Array, layout: part.LeafLayout, layer: bool = False) -> jax.Array:
    """A gathered weight (or one layer of it) constrained to its `model` split (inside the
    island); the weight as it is for a leaf not split over `model`."""
    spec = part.gathered_spec(layout, layer)
    if spec is None:
        return w
    return lax.with_sharding_constraint(w, NamedSharding(jax.sharding.get_abstract_mesh(), spec))
