"""The shard_map island: what runs on each device inside `state.apply_fn`.

`make_island_apply` wraps a model's apply into the sharded `apply_fn` of a `TrainState`:
on each device it traces the model once with full-size abstract weights and runs that
program with every sharded weight gathered where it is used (`zeropp_jax.placement`: per
use, or per layer inside a scan; qwZ / hpZ, or from the weight-delta reference), on that
device's slice of the batch; gradients go back through the matching reduction (qgZ, with
error feedback when configured). `IslandApply` binds it to the state's step and weight
references.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from zeropp_jax import (
    dataflow,
    placement,
    reductions,
    relayout,
    tensor_parallel,
    weight_gather,
)
from zeropp_jax import partition as part
from zeropp_jax import residuals as R
from zeropp_jax.choices import gather_spec, mesh_platform, resolve_codec, rounding_key
from zeropp_jax.config import ZeroPPConfig
from zeropp_jax.kernels import shard_map_mesh
from zeropp_jax.mesh import data_parallel_size
from zeropp_jax.quant import XLA_CODEC


def _is_batch_leaf(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and x.ndim >= 1


def is_array(x: Any) -> bool:
    """Whether `x` is an array or array-like (has a shape and a dtype)."""
    return isinstance(x, jax.Array | np.ndarray) or (hasattr(x, "shape") and hasattr(x, "dtype"))


def make_island_apply(
    model_apply: Callable[..., Any],
    mesh: Mesh,
    config: ZeroPPConfig,
    layouts: tuple[Any, tuple[part.LeafLayout, ...]],
) -> Callable[..., Any]:
    """Wraps `model_apply` (e.g. `model.apply`) into the sharded `apply_fn` of a TrainState.

    The result takes the step counter and the weight references first, `(step,
    weight_ref, variables, *args, **kwargs)`; `IslandApply` binds both (the step keys
    stochastic rounding, None without it; `weight_ref` holds, per parameter leaf, the kept
    secondary shard of the weight-delta gather, None without `config.weight_delta_bits`).

    The returned function takes `({'params': stored_params, ...}, *args, **kwargs)` in the
    global view: the leading dimension of the first array argument is the global batch;
    array arguments with that leading dimension are batch-sharded along axis 0 over all
    devices; other arrays, 0-d arrays and `rngs=` keys are replicated (keys are folded with
    the device index so every device draws its own dropout mask); anything else is passed
    through as a static Python value. Every model output must carry the batch as its
    leading dimension; outputs come back batch-sharded in the global view.
    """
    treedef, leaf_layouts = layouts
    platform = mesh_platform(mesh)
    codec = resolve_codec(config, platform)
    spec = gather_spec(config, codec, platform)
    compute = jnp.dtype(config.compute_dtype)
    param_specs = [part.manual_spec(lo) for lo in leaf_layouts]
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(treedef, list(leaf_layouts)), is_leaf=part.is_layout
    )[0]
    names = tuple(jax.tree_util.keystr(path) for path, _ in paths)
    delta_on = config.weight_delta_bits is not None
    # Pallas calls (interpreted or not) carry no varying-axes types.
    check_vma = codec is XLA_CODEC

    def apply_fn(
        step: jax.Array | None, weight_ref: Any, variables: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if "params" not in variables:
            raise ValueError(
                "apply_fn expects variables={'params': state.params, ...}; got keys "
                f"{sorted(variables)}."
            )
        params, res_tree = R.split(variables["params"])
        if config.error_feedback is not None and res_tree is None:
            raise ValueError(
                "ZeroPPConfig.error_feedback is on, but the parameters given to apply_fn "
                f"have no {R.KEY!r} entry; pass state.params unchanged."
            )
        res_at: tuple[tuple[bool, bool], ...] = ()
        res1: list[jax.Array] = []
        res2: list[jax.Array] = []
        if res_tree is not None:
            res_at = tuple(
                (a is not None, b is not None)
                for a, b in zip(res_tree["hop1"], res_tree["hop2"], strict=True)
            )
            res1 = [r for r in res_tree["hop1"] if r is not None]
            res2 = [r for r in res_tree["hop2"] if r is not None]
        others = {k: v for k, v in variables.items() if k != "params"}
        p_leaves, p_def = jax.tree_util.tree_flatten(params)
        if p_def != treedef:
            raise ValueError(
                "apply_fn got parameters whose tree differs from the TrainState's; pass "
                "state.params (the sharded master parameters) unchanged."
            )
        rngs = kwargs.pop("rngs", None)
        leaves, in_def = jax.tree_util.tree_flatten((args, kwargs))
        # The global batch is the leading dimension of the first array argument; only
        # arrays with that leading dimension are split over the devices, every other
        # array (e.g. a position table) is replicated.
        first = next((x for x in leaves if _is_batch_leaf(x)), None)
        batch = None if first is None else first.shape[0]
        batch_idx = [i for i, x in enumerate(leaves) if _is_batch_leaf(x) and x.shape[0] == batch]
        rep_idx = [i for i, x in enumerate(leaves) if is_array(x) and i not in batch_idx]
        static = {i: x for i, x in enumerate(leaves) if i not in batch_idx and i not in rep_idx}
        other_leaves, other_def = jax.tree_util.tree_flatten(others)
        rng_leaves, rng_def = jax.tree_util.tree_flatten(rngs)
        if config.stochastic_rounding and step is None:
            raise ValueError(
                "ZeroPPConfig.stochastic_rounding=True needs the step counter: call "
                "state.apply_fn (an IslandApply bound to state.step)."
            )
        steps = [] if step is None or not config.stochastic_rounding else [step]
        refs = [r for r in (weight_ref or ()) if r is not None]
        if config.weight_delta_bits is not None and len(refs) != sum(
            lo.sharded for lo in leaf_layouts
        ):
            raise ValueError(
                "ZeroPPConfig.weight_delta_bits needs the weight references of the state: "
                "call state.apply_fn (an IslandApply that carries them)."
            )

        def body(p, refs, res, batch, rep, oth, keys, steps):
            p = [part.island_shard(x, lo) for x, lo in zip(p, leaf_layouts, strict=True)]
            if check_vma:
                # A reference is the same on every node; marked node-invariant, it would
                # make the weight invariant too, and autodiff would psum the weight's
                # cotangent over `node` before the two-hop reduction (a full-size
                # cross-node all-reduce, and gradients counted num_nodes times).
                refs = [jax.lax.pcast(r, "node", to="varying") for r in refs]

            step = steps[0] if steps else None
            gathers = LeafGathers(
                layouts=leaf_layouts,
                names=names,
                spec=spec,
                num_devices=data_parallel_size(mesh),
                check_vma=check_vma,
                keys=tuple(
                    rounding_key(config, step, i) if step is not None and lo.sharded else None
                    for i, lo in enumerate(leaf_layouts)
                ),
                refs=_per_leaf(refs, [lo.sharded and delta_on for lo in leaf_layouts]),
                res=_residuals_per_leaf(res, res_at, leaf_layouts),
            )

            def model(weights, batch, rep, oth, keys):
                merged = dict(static)
                merged.update(zip(batch_idx, batch, strict=True))
                merged.update(zip(rep_idx, rep, strict=True))
                a, kw = jax.tree_util.tree_unflatten(
                    in_def, [merged[i] for i in range(len(leaves))]
                )
                if rngs is not None:
                    idx = jax.lax.axis_index(("node", "local"))
                    keys = [jax.random.fold_in(k, idx) for k in keys]
                    kw = dict(kw, rngs=jax.tree_util.tree_unflatten(rng_def, keys))
                v = dict(jax.tree_util.tree_unflatten(other_def, oth))
                v["params"] = jax.tree_util.tree_unflatten(treedef, weights)
                return model_apply(v, *a, **kw)

            weights_in: list[Any] = []
            for x, lo in zip(p, leaf_layouts, strict=True):
                if lo.sharded:
                    weights_in.append(jax.typeof(x).update(shape=lo.shape, dtype=compute))
                elif jnp.issubdtype(x.dtype, jnp.floating):
                    weights_in.append(x.astype(compute))
                else:
                    weights_in.append(x)
            return placement.run_placed(
                model,
                weights_in,
                p,
                (batch, rep, oth, keys),
                gathers,
                config.prefetch,
                per_use_reduce=config.shared_grad == "per_use",
            )

        island = jax.shard_map(
            body,
            mesh=shard_map_mesh(mesh),
            in_specs=(
                param_specs,
                [part.REFERENCE_SPEC] * len(refs),
                ([R.SPEC] * len(res1), [R.SPEC] * len(res2)),
                [part.BATCH_SPEC] * len(batch_idx),
                [part.REPLICATED] * len(rep_idx),
                [part.REPLICATED] * len(other_leaves),
                [part.REPLICATED] * len(rng_leaves),
                [part.REPLICATED] * len(steps),
            ),
            out_specs=part.BATCH_SPEC,
            axis_names={"node", "local"},
            check_vma=check_vma,
        )
        return island(
            p_leaves,
            refs,
            (res1, res2),
            [leaves[i] for i in batch_idx],
            [leaves[i] for i in rep_idx],
            other_leaves,
            rng_leaves,
            steps,
        )

    return apply_fn


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["step", "weight_ref"], meta_fields=["fn"]
)
@dataclasses.dataclass(frozen=True)
class IslandApply:
    """The `apply_fn` of a zpp.TrainState: the sharded island of `make_island_apply`,
    bound to the state's step counter and weight references.

    Called like the model's apply, `(variables, *args, **kwargs)`. It is a pytree whose
    leaves are `step` (None, no leaf, unless `config.stochastic_rounding`) and `weight_ref`
    (None unless `config.weight_delta_bits`; else a tuple with, per parameter leaf, its
    reference, global shape of the padded parameter, sharded `PartitionSpec('local')`, or
    None for a leaf that is not sharded). That is how they reach the island inside an
    unchanged train_step, which only calls `state.apply_fn`. `TrainState` keeps `step`
    equal to its own step and advances `weight_ref` in `apply_gradients`.
    """

    fn: Callable[..., Any]
    step: jax.Array | None = None
    weight_ref: tuple[jax.Array | None, ...] | None = None

    def __call__(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.step, self.weight_ref, variables, *args, **kwargs)


def _per_leaf(values: list[Any], present: list[bool]) -> tuple[Any, ...]:
    it = iter(values)
    return tuple(next(it) if on else None for on in present)


def _residuals_per_leaf(
    res: tuple[list[jax.Array], list[jax.Array]],
    res_at: tuple[tuple[bool, bool], ...],
    leaf_layouts: tuple[part.LeafLayout, ...],
) -> tuple[weight_gather.Residuals, ...]:
    r1, r2 = iter(res[0]), iter(res[1])
    out: list[weight_gather.Residuals] = []
    for i, lo in enumerate(leaf_layouts):
        has1, has2 = res_at[i] if res_at and lo.sharded else (False, False)
        if has1 or has2:
            out.append((next(r1) if has1 else None, next(r2) if has2 else None))
        else:
            out.append(())
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class LeafGathers:
    """The `placement.Gathers` of one island: how each sharded leaf is gathered and how its
    gradient is reduced. Pieces are per device, flattened (see `partition`).

    Attributes:
      layouts: per parameter leaf.
      names: per parameter leaf, its path (for warnings).
      spec: the gather spec of the config.
      num_devices: data-parallel devices of the mesh (`node` x `local`).
      check_vma: whether the island checks varying axes (tensor-parallel leaves run their
        collectives in a nested shard_map over `model` that checks alike).
      keys: per leaf, its stochastic-rounding key or None (traced).
      refs: per leaf, its weight-delta reference or None (traced).
      res: per leaf, its error-feedback residuals or `()` (traced).
    """

    layouts: tuple[part.LeafLayout, ...]
    names: tuple[str, ...]
    spec: weight_gather.GatherSpec
    num_devices: int
    check_vma: bool
    keys: tuple[Any, ...]
    refs: tuple[Any, ...]
    res: tuple[Any, ...]

    def layout(self, leaf: int) -> part.LeafLayout:
        return self.layouts[leaf]

    def name(self, leaf: int) -> str:
        return self.names[leaf]

    def fixed(self, leaf: int) -> Any:
        return (self.keys[leaf], self.refs[leaf])

    def residuals(self, leaf: int) -> Any:
        return self.res[leaf]

    def layer_fixed(self, leaf: int, fixed: Any, layout: part.LeafLayout, layer: jax.Array) -> Any:
        key, ref = fixed
        if ref is None:
            return fixed
        piece = layout.padded // self.num_devices
        return key, part.layer_of_pieces(ref, layout.lead, piece, layer)

    def relaid_fixed(self, leaf: int, fixed: Any, axis: int) -> Any:
        key, ref = fixed
        if ref is None:
            return fixed
        return key, relayout.reference_to_front(ref, self.layouts[leaf], axis)

    def has_reference(self, leaf: int) -> bool:
        return self.refs[leaf] is not None

    def _per_rank(self, leaf: int, fn: Any, split: tuple, shared: tuple) -> Any:
        """`fn(*split, *shared)`, once per `model` rank for a tensor-parallel leaf (its
        pieces carry the `model` slices on axis 0)."""
        if not self.layouts[leaf].tensor_parallel:
            return fn(*split, *shared)
        return tensor_parallel.per_model_rank(fn, split, shared, self.check_vma)

    def wire(self, leaf: int, piece: jax.Array, fixed: Any) -> tuple[jax.Array, ...]:
        ref = fixed[1]
        if ref is None:
            if not self.layouts[leaf].tensor_parallel:
                return weight_gather.secondary_wire(piece, self.spec)
            # Named outside the nested shard_map: a remat policy then saves or recomputes
            # that shard_map whole (JAX cannot split a nested shard_map for remat).
            fn = lambda p: weight_gather.secondary_wire(p, self.spec, named=False)  # noqa: E731
            wire = self._per_rank(leaf, fn, (piece,), ())
            return tuple(checkpoint_name(w, weight_gather.SECONDARY_NAME) for w in wire)
        # Read once the piece exists (ordered like the gathers that read the shard).
        return weight_gather.reference_wire(piece, dataflow.tie(piece, ref), self.spec)

    def gather(
        self, leaf: int, piece: jax.Array, wire: tuple[jax.Array, ...], fixed: Any, alternate: bool
    ) -> jax.Array:
        def fn(p, w):
            return weight_gather.gather_from(p, w, self.spec, alternate_form=alternate)

        return self._per_rank(leaf, fn, (piece, wire), ())

    def reduce(
        self, leaf: int, g: jax.Array, fixed: Any, residuals: Any, layer: jax.Array | None
    ) -> tuple[jax.Array, Any]:
        key = fixed[0]
        if key is not None and layer is not None:
            key = jax.random.fold_in(key, layer)
        if self.layouts[leaf].tensor_parallel:

            def fn(g, key):
                key = reductions.model_rank_key(key, axis_name=part.MODEL_AXIS)
                return weight_gather.reduce_gradient(g, self.spec, key)[0]

            return self._per_rank(leaf, fn, (g,), (key,)), ()
        return weight_gather.reduce_gradient(g, self.spec, key, residuals or ())

    def full(
        self, leaf: int, piece: jax.Array, wire: tuple[jax.Array, ...], fixed: Any, residuals: Any
    ) -> jax.Array:
        if self.layouts[leaf].tensor_parallel:

            def fn(p, w, key):
                key = reductions.model_rank_key(key, axis_name=part.MODEL_AXIS)
                return weight_gather.gather_from_wire(p, w, self.spec, key)

            return self._per_rank(leaf, fn, (piece, wire), (fixed[0],))
        return weight_gather.gather_from_wire(piece, wire, self.spec, fixed[0], residuals or ())
