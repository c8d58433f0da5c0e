"""Tensor parallelism on the mesh's `model` axis.

A parameter is split over `model` where the model says so: a flax
`nn.with_partitioning(init, names)` (or `nn.Partitioned` box) whose `names` give `'model'`
for one dimension; or a `nn.with_logical_partitioning(init, names)` box whose logical
names the rules (`rules=`, the box's own, or the active `nn.logical_axis_rules`) map to
mesh axes (`resolve_logical`): a name mapped to `model` is tensor parallelism, one mapped
to the data-parallel axes (`DATA_PARALLEL_AXES`) means "ZeRO-shard it" (as every
parameter is), an unmapped name means not split over `model`. `model_dims` reads those
annotations into the dimension of each leaf
that `zeropp_jax.state._partition` splits, checking them against the mesh; `per_model_rank` runs
a leaf's ZeRO collectives (which see one `model` slice) once per `model` rank, inside the
island, so that each device gathers and reduces only its own slice and XLA partitions the
model's compute over `model` (Megatron-style: it inserts the tensor-parallel collectives).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax.core import meta
from flax.linen import spmd
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.state import _partition as part
from zeropp_jax.state._partition import MODEL_AXIS

ZERO_AXES = ("node", "local")
DATA_PARALLEL_AXES = ("node", "local", "data", "fsdp")
"""Mesh axes that logical rules may map a name to for "ZeRO-shard it": this mesh's
data-parallel axes and MaxText's names for them (every parameter is ZeRO-sharded over
`('node', 'local')` anyway)."""

Rules = Sequence[tuple[str, Any]]
"""Flax's logical axis rules: `(logical name, mesh axis or axes or None)` pairs, in order
of precedence (as `nn.logical_axis_rules` takes them)."""


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def resolve_logical(path: str, names: tuple[Any, ...], rules: Rules | None) -> tuple[Any, ...]:
    """The mesh names of a leaf annotated with logical `names` under `rules`: per
    dimension `'model'` (tensor parallelism) or None (not split over `model`).

    Flax resolves the names (`nn.logical_to_mesh_axes`: each rule in order, a mesh axis
    used once); a dimension whose mesh axes are data-parallel (`DATA_PARALLEL_AXES`) or
    that no rule maps is None here (ZeRO shards it all the same).

    Args:
      path: the leaf's path (for errors).
      names: its logical names, one per dimension (None for an unnamed one).
      rules: the logical rules; None or empty only for a leaf with no names.

    Raises:
      ValueError: (one line) for names with no rules, or names mapped to a mesh axis that
        is neither `model` nor data-parallel.
    """
    if not rules:
        if all(n is None for n in names):
            return tuple(names)
        raise ValueError(
            f"parameter {path} is annotated with logical names {names} but no logical axis "
            "rules are given; pass rules= (e.g. (('mlp', 'model'), ('embed', 'fsdp'))) to "
            "TrainState.create, or create it inside `with nn.logical_axis_rules(rules):`."
        )
    spec = spmd.logical_to_mesh_axes(names, list(rules))
    out: list[Any] = []
    for name, entry in zip(names, spec, strict=True):
        axes = _axes_of(entry)
        other = [a for a in axes if a != MODEL_AXIS and a not in DATA_PARALLEL_AXES]
        if other:
            raise ValueError(
                f"parameter {path}: the logical rules map {name!r} to the mesh axis "
                f"{other[0]!r} ({names} -> {tuple(spec)}); map it to 'model' (tensor "
                f"parallelism), to one of {DATA_PARALLEL_AXES} (ZeRO-shard it) or leave "
                "it out of the rules (not split over 'model')."
            )
        out.append(MODEL_AXIS if MODEL_AXIS in axes else None)
    return tuple(out)


def unbox(params: Any, rules: Rules | None = None) -> tuple[Any, list[tuple[Any, ...] | None]]:
    """`(params without boxes, per leaf its mesh names or None)`.

    Leaves are in the order of `jax.tree_util.tree_leaves` of the unboxed tree. A
    `nn.Partitioned` box gives its names as they are; a `nn.LogicallyPartitioned` one its
    logical names resolved by `resolve_logical` under `rules`, else the box's own rules,
    else the active `nn.logical_axis_rules`. A box other than these (other flax metadata)
    is unboxed with no names.
    """
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]
    names: list[tuple[Any, ...] | None] = []
    for path, x in flat:
        if isinstance(x, spmd.LogicallyPartitioned):
            active = rules if rules is not None else x.rules or spmd.get_logical_axis_rules()
            names.append(resolve_logical(jax.tree_util.keystr(path), tuple(x.names), active))
        elif isinstance(x, meta.Partitioned):
            names.append(tuple(x.names))
        else:
            names.extend([None] * len(jax.tree_util.tree_leaves(x)))

    def value(x: Any) -> Any:
        # Without a sharding constraint: the engine and XLA FSDP place leaves themselves,
        # and `params` may hold shapes.
        if isinstance(x, meta.Partitioned):
            return x.unbox(apply_constraint=False)
        return x.unbox() if _is_box(x) else x

    return jax.tree_util.tree_map(value, params, is_leaf=_is_box), names


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
