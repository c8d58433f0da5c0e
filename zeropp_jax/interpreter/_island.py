"""The shard_map island: what runs on each device inside `state.apply_fn`.

`make_island_apply` wraps a model's apply into the sharded `apply_fn` of a `TrainState`:
on each device it traces the model once with full-size abstract weights and runs that
program with every sharded weight gathered where it is used
(`zeropp_jax.interpreter._placement`: per use, or per layer inside a scan; qwZ / hpZ,
or from the weight-delta reference), on that
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
from jax.sharding import Mesh

from zeropp_jax._choices import Plan, per_use_leaves, resolve, rounding_key
from zeropp_jax._config import ZeroPPConfig
from zeropp_jax.interpreter import _placement as placement
from zeropp_jax.interpreter._leaf_gathers import (
    LeafGathers,
    LeafState,
    per_leaf,
    residuals_per_leaf,
)
from zeropp_jax.state import _blocks as blocks
from zeropp_jax.state import _partition as part
from zeropp_jax.state import _residuals as R
from zeropp_jax.wire.kernels import shard_map_mesh


def _is_batch_leaf(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and x.ndim >= 1


def is_array(x: Any) -> bool:
    """Whether `x` is an array or array-like (has a shape and a dtype)."""
    return isinstance(x, jax.Array | np.ndarray) or (hasattr(x, "shape") and hasattr(x, "dtype"))


@dataclasses.dataclass(frozen=True)
class _ModelArgs:
    """The model's `(args, kwargs)` split for the island: the global batch is the leading
    dimension of the first array argument; only arrays with that leading dimension are
    split over the devices (`batch`), every other array is replicated (`rep`, e.g. a
    position table), anything else is a static Python value."""

    in_def: Any
    num_leaves: int
    batch_idx: tuple[int, ...]
    rep_idx: tuple[int, ...]
    static: dict[int, Any]

    @classmethod
    def of(cls, args: Any, kwargs: Any) -> tuple[_ModelArgs, list[Any], list[Any]]:
        """The split, and the batch and replicated arrays."""
        leaves, in_def = jax.tree_util.tree_flatten((args, kwargs))
        first = next((x for x in leaves if _is_batch_leaf(x)), None)
        batch = None if first is None else first.shape[0]
        batch_idx = [i for i, x in enumerate(leaves) if _is_batch_leaf(x) and x.shape[0] == batch]
        rep_idx = [i for i, x in enumerate(leaves) if is_array(x) and i not in batch_idx]
        static = {i: x for i, x in enumerate(leaves) if i not in batch_idx and i not in rep_idx}
        split = cls(in_def, len(leaves), tuple(batch_idx), tuple(rep_idx), static)
        return split, [leaves[i] for i in batch_idx], [leaves[i] for i in rep_idx]

    def merge(self, batch: list[Any], rep: list[Any]) -> tuple[Any, Any]:
        """`(args, kwargs)` again, from per-device batch and replicated arrays."""
        merged = dict(self.static)
        merged.update(zip(self.batch_idx, batch, strict=True))
        merged.update(zip(self.rep_idx, rep, strict=True))
        return jax.tree_util.tree_unflatten(
            self.in_def, [merged[i] for i in range(self.num_leaves)]
        )


def _split_residuals(
    res_tree: Any,
) -> tuple[tuple[tuple[bool, bool], ...], list[jax.Array], list[jax.Array]]:
    """Error-feedback residuals as the island takes them: per leaf which hops have one,
    and the present hop-1 and hop-2 residuals in leaf order."""
    if res_tree is None:
        return (), [], []
    res_at = tuple(
        (a is not None, b is not None)
        for a, b in zip(res_tree["hop1"], res_tree["hop2"], strict=True)
    )
    res1 = [r for r in res_tree["hop1"] if r is not None]
    res2 = [r for r in res_tree["hop2"] if r is not None]
    return res_at, res1, res2


def _check_variables(variables: Any, treedef: Any, plan: Plan) -> tuple[Any, Any]:
    """`(params, residuals)` of `variables`, or a ValueError saying what to pass."""
    if "params" not in variables:
        raise ValueError(
            "apply_fn expects variables={'params': state.params, ...}; got keys "
            f"{sorted(variables)}."
        )
    params, res_tree = R.split(variables["params"])
    if plan.error_feedback and res_tree is None:
        raise ValueError(
            "ZeroPPConfig.error_feedback is on, but the parameters given to apply_fn "
            f"have no {R.KEY!r} entry; pass state.params unchanged."
        )
    if jax.tree_util.tree_structure(params) != treedef:
        raise ValueError(
            "apply_fn got parameters whose tree differs from the TrainState's; pass "
            "state.params (the sharded master parameters) unchanged."
        )
    return params, res_tree


def _step_inputs(
    step: jax.Array | None,
    weight_ref: Any,
    plan: Plan,
    leaf_layouts: tuple[part.LeafLayout, ...],
) -> tuple[list[jax.Array], list[jax.Array]]:
    """The step counter (`[step]` with stochastic rounding, else `[]`) and the present
    weight references, or a ValueError saying which `apply_fn` to call."""
    if plan.stochastic_rounding and step is None:
        raise ValueError(
            "ZeroPPConfig.stochastic_rounding=True needs the step counter: call "
            "state.apply_fn (an IslandApply bound to state.step)."
        )
    steps = [] if step is None or not plan.stochastic_rounding else [step]
    refs = [r for r in (weight_ref or ()) if r is not None]
    if plan.weight_delta and len(refs) != sum(lo.sharded for lo in leaf_layouts):
        raise ValueError(
            "ZeroPPConfig.weight_delta_bits needs the weight references of the state: "
            "call state.apply_fn (an IslandApply that carries them)."
        )
    return steps, refs


def _model_weights(p: list[Any], leaf_layouts: tuple[part.LeafLayout, ...], compute: Any) -> list:
    """What the model is traced with: full-size abstract weights in the compute dtype
    for sharded leaves, the (cast) arrays themselves for the others."""
    out: list[Any] = []
    for x, lo in zip(p, leaf_layouts, strict=True):
        if lo.sharded:
            out.append(jax.typeof(x).update(shape=lo.shape, dtype=compute))
        elif jnp.issubdtype(x.dtype, jnp.floating):
            out.append(x.astype(compute))
        else:
            out.append(x)
    return out


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
    plan = resolve(config, mesh)
    island = _Island(model_apply, plan, treedef, leaf_layouts, _leaf_names(treedef, leaf_layouts))

    def apply_fn(
        step: jax.Array | None, weight_ref: Any, variables: Any, *args: Any, **kwargs: Any
    ) -> Any:
        params, res_tree = _check_variables(variables, treedef, plan)
        res_at, res1, res2 = _split_residuals(res_tree)
        others = {k: v for k, v in variables.items() if k != "params"}
        rngs = kwargs.pop("rngs", None)
        split, batch, rep = _ModelArgs.of(args, kwargs)
        other_leaves, other_def = jax.tree_util.tree_flatten(others)
        rng_leaves, rng_def = jax.tree_util.tree_flatten(rngs)
        steps, refs = _step_inputs(step, weight_ref, plan, leaf_layouts)
        body = functools.partial(island.body, split, res_at, other_def, rngs, rng_def)
        per_device = jax.shard_map(
            body,
            mesh=shard_map_mesh(mesh),
            in_specs=(
                [part.manual_spec(lo) for lo in leaf_layouts],
                [part.REFERENCE_SPEC] * len(refs),
                ([R.SPEC] * len(res1), [R.SPEC] * len(res2)),
                [part.BATCH_SPEC] * len(batch),
                [part.REPLICATED] * len(rep),
                [part.REPLICATED] * len(other_leaves),
                [part.REPLICATED] * len(rng_leaves),
                [part.REPLICATED] * len(steps),
            ),
            out_specs=part.BATCH_SPEC,
            axis_names={"node", "local"},
            check_vma=plan.check_vma,
        )
        p_leaves = jax.tree_util.tree_leaves(params)
        return per_device(p_leaves, refs, (res1, res2), batch, rep, other_leaves, rng_leaves, steps)

    return apply_fn


def _leaf_names(treedef: Any, leaf_layouts: tuple[part.LeafLayout, ...]) -> tuple[str, ...]:
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(treedef, list(leaf_layouts)), is_leaf=part.is_layout
    )[0]
    return tuple(jax.tree_util.keystr(path) for path, _ in paths)


@dataclasses.dataclass(frozen=True)
class _Island:
    """What one island runs on each device: the model, the resolved config (`plan`) and
    the parameters' layouts and names."""

    model_apply: Callable[..., Any]
    plan: Plan
    treedef: Any
    leaf_layouts: tuple[part.LeafLayout, ...]
    names: tuple[str, ...]

    def gathers(self, refs: list[jax.Array], res: Any, res_at: Any, step: Any) -> LeafGathers:
        """The step's `LeafGathers`: per leaf, its state (rounding key, reference, residuals)."""
        plan, layouts = self.plan, self.leaf_layouts
        keys = [
            rounding_key(plan.rounding_seed, step, i) if step is not None and lo.sharded else None
            for i, lo in enumerate(layouts)
        ]
        refs = per_leaf(refs, [lo.sharded and plan.weight_delta for lo in layouts])
        res = residuals_per_leaf(res, res_at, layouts)
        return LeafGathers(
            layouts=layouts,
            names=self.names,
            spec=plan.spec,
            num_devices=plan.num_devices,
            check_vma=plan.check_vma,
            barrier_ties=plan.platform == "gpu",
            hold_recomputed=plan.platform == "gpu",
            peel_in_branch=plan.platform == "cpu",
            states=tuple(
                LeafState(k, ref, r, lo, plan.num_devices)
                for k, ref, r, lo in zip(keys, refs, res, layouts, strict=True)
            ),
        )

    def body(
        self, split, res_at, other_def, rngs, rng_def, p, refs, res, batch, rep, oth, keys, steps
    ):
        """The per-device program: the model run with its weights placed (`placement`)."""
        layouts = self.leaf_layouts
        p = [blocks.island_shard(x, lo) for x, lo in zip(p, layouts, strict=True)]
        if self.plan.check_vma:
            # A reference is the same on every node; marked node-invariant, it would
            # make the weight invariant too, and autodiff would psum the weight's
            # cotangent over `node` before the two-hop reduction (a full-size
            # cross-node all-reduce, and gradients counted num_nodes times).
            refs = [jax.lax.pcast(r, "node", to="varying") for r in refs]
        gathers = self.gathers(refs, res, res_at, steps[0] if steps else None)

        def model(weights, batch, rep, oth, keys):
            a, kw = split.merge(batch, rep)
            if rngs is not None:
                idx = jax.lax.axis_index(("node", "local"))
                keys = [jax.random.fold_in(k, idx) for k in keys]
                kw = dict(kw, rngs=jax.tree_util.tree_unflatten(rng_def, keys))
            v = dict(jax.tree_util.tree_unflatten(other_def, oth))
            v["params"] = jax.tree_util.tree_unflatten(self.treedef, weights)
            return self.model_apply(v, *a, **kw)

        return placement.run_placed(
            model,
            _model_weights(p, layouts, self.plan.compute_dtype),
            p,
            (batch, rep, oth, keys),
            gathers,
            self.plan.prefetch,
            per_use=per_use_leaves(self.plan, layouts),
        )


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
