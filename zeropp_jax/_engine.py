"""The engine: `TrainState`, `shard(train_step)` and `gather_params`.

Global view outside, `shard_map` island inside. `TrainState.create` shards float32 master
parameters (and so the optax state) over all devices; its `apply_fn` is an island that, on
each device, runs the model on that device's slice of the batch with each weight gathered
where it is used (qwZ / hpZ; per layer inside scans, see `zeropp_jax.interpreter._placement`), and
sends gradients back through the matching reduction (qgZ). The loss,
`jax.value_and_grad` and the optax update stay in the global view, and the update sees
every parameter in its model shape (`zeropp_jax.state._optimizer_view`), so any optax chain keeps
its single-device meaning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding

from zeropp_jax import _tensor_parallel as tensor_parallel
from zeropp_jax._choices import Plan, mesh_platform, resolve
from zeropp_jax._config import ZeroPPConfig
from zeropp_jax._mesh import data_parallel_size, mesh_shape, model_axis_size
from zeropp_jax._references import advance_weight_references, full_weight_references
from zeropp_jax.interpreter import _jaxpr_compat as jaxpr_compat
from zeropp_jax.interpreter._island import IslandApply, is_array, make_island_apply
from zeropp_jax.measure import _stored_share as stored_share
from zeropp_jax.state import _finite as finite
from zeropp_jax.state import _optimizer_view as optimizer_view
from zeropp_jax.state import _partition as part
from zeropp_jax.state import _residuals as R
from zeropp_jax.state import _state_init as state_init
from zeropp_jax.wire import kernels

# ----------------------------------------------------------------------------- state


def _leaf_layouts(
    shapes: Any, names: list[Any], mesh: Mesh, plan: Plan
) -> tuple[part.LeafLayout, ...]:
    """Per parameter leaf its layout on `mesh`: ZeRO-sharded over `('node', 'local')`, and
    split over `model` where `names` (the leaf's `nn.Partitioned` names) say so."""
    n_dp = data_parallel_size(mesh)
    local = int(mesh.shape["local"])
    layout_tree = part.param_layouts(shapes, n_dp, local_size=local)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    layouts = jax.tree_util.tree_leaves(layout_tree, is_leaf=part.is_layout)
    dims = tensor_parallel.model_dims(paths, [lo.shape for lo in layouts], names, mesh)
    k = model_axis_size(mesh)
    layouts = [
        part.with_model_split(lo, d, k, n_dp, local_size=local)
        for lo, d in zip(layouts, dims, strict=True)
    ]
    split = [p for p, lo in zip(paths, layouts, strict=True) if lo.tensor_parallel]
    if split and (plan.weight_delta or plan.feedback is not None):
        raise ValueError(
            f"parameters split over 'model' ({split[0]}, ...) cannot yet be combined with "
            f"weight_delta_bits={plan.delta_bits!r} or "
            f"error_feedback={plan.feedback!r}; set both to None for tensor "
            "parallelism."
        )
    return tuple(layouts)


def _warn_above_share(shapes: Any, layouts: Sequence[part.LeafLayout], mesh: Mesh) -> None:
    """Warns (`stored_share.StoredAboveShareWarning`) naming each leaf stored above
    `stored_share.RATIO_LIMIT` times its share, with why; silent when none is."""
    n = data_parallel_size(mesh)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    excess = stored_share.over_share(paths, layouts, n)
    if excess:
        warnings.warn(
            stored_share.warning_text(excess, layouts, n),
            stored_share.StoredAboveShareWarning,
            stacklevel=4,
        )


class TrainState(train_state.TrainState):
    """A `flax.training.train_state.TrainState` whose parameters and optimizer state are
    sharded ZeRO-3 style over a `('node', 'local')` mesh.

    `params` holds the float32 master parameters in the global view, each float leaf padded
    in rows to a multiple of the device count and sharded over all devices (see
    `zeropp_jax.state._partition`). Use `gather_params(state)` for the original shapes and dtypes.
    The optimizer runs on model-shaped views of them (`zeropp_jax.state._optimizer_view`); its
    moments are kept in the parameters' stored layout.

    Extra fields: `mesh`, `config`, `layouts` and `opt_mirror` (static: per optimizer-state
    leaf, the parameter it mirrors), `skipped_steps` (updates skipped
    for non-finite gradients) and `grads_finite` (whether the last step's gradients were
    finite). `apply_fn` is an `IslandApply`, a pytree node: with
    `config.stochastic_rounding` it carries the step (kept equal to `step` whenever a
    state is built, replaced or unflattened); with `config.weight_delta_bits` it carries
    the weight-delta references (`weight_ref`), which `apply_gradients` advances with one
    delta gather and `reset_weight_references` rebuilds with a full gather.
    """

    apply_fn: Callable[..., Any] = struct.field(pytree_node=True)
    mesh: Mesh = struct.field(pytree_node=False, default=None)
    config: ZeroPPConfig = struct.field(pytree_node=False, default=None)
    layouts: Any = struct.field(pytree_node=False, default=None)
    opt_mirror: tuple | None = struct.field(pytree_node=False, default=None)
    skipped_steps: jax.Array | int = 0
    grads_finite: jax.Array | bool = True

    def __post_init__(self) -> None:
        fn = self.apply_fn
        if isinstance(fn, IslandApply) and fn.step is not None and fn.step is not self.step:
            object.__setattr__(self, "apply_fn", dataclasses.replace(fn, step=self.step))

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Callable[..., Any],
        params: Any,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        config: ZeroPPConfig | None = None,
        rules: tensor_parallel.Rules | None = None,
        **kwargs: Any,
    ) -> TrainState:
        """Shards `params` over `mesh` and initialises `tx` on the shards.

        Args:
          apply_fn: the model's apply function (e.g. `model.apply`); it is wrapped into the
            sharded island.
          params: the model's parameters, unsharded: any pytree of arrays (flax's
            `variables['params']`, `eqx.partition(model, eqx.is_array)[0]`, a dataclass
            or NamedTuple registered as a pytree); or a `zpp.ShardedInit` wrapping a
            zero-argument callable that returns them (e.g.
            `zpp.ShardedInit(lambda: model.init(key, x)['params'])`): sharded init, run
            once under `jax.jit` with the stored layout as its output sharding, so that
            neither a device nor the host ever holds the unsharded tree. Both give
            bit-identical states. A bare callable is refused, not guessed at.
          tx: any optax transformation.
          mesh: a mesh from `zeropp_jax.make_mesh`.
          config: a `ZeroPPConfig` (default: ZeRO++).
          rules: flax logical axis rules for leaves annotated with
            `nn.with_logical_partitioning` (default: the box's own, else the active
            `nn.logical_axis_rules`): a name mapped to `'model'` is split over `model`,
            one mapped to `'fsdp'`/`'data'` (or unmapped) only ZeRO-sharded.
          **kwargs: other dataclass fields.

        Raises:
          ValueError: for a mesh without `('node', 'local')` axes, a config that is not a
            ZeroPPConfig, parameters that are not float/int arrays, or a bare callable as
            `params` (wrap it in `zpp.ShardedInit`).
        """
        return cls._build(apply_fn, params, tx, mesh, config, rules, abstract=False, **kwargs)

    @classmethod
    def abstract(
        cls,
        *,
        apply_fn: Callable[..., Any],
        params: Any,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        config: ZeroPPConfig | None = None,
        rules: tensor_parallel.Rules | None = None,
        **kwargs: Any,
    ) -> TrainState:
        """The state `create` would build, as shapes only: every array leaf is a
        `jax.ShapeDtypeStruct` with its global shape, dtype and sharding; nothing is
        computed or allocated.

        Plan from it: `zpp.shard(step).lower(state, batch).compile().memory_analysis()`
        gives the per-device memory of a training step (`batch` may be
        `jax.ShapeDtypeStruct`s too), and `restore_checkpoint(path, state)` restores onto
        it without building a state first.

        Args:
          apply_fn: as for `create`.
          params: as for `create` (a `ShardedInit` is traced with `jax.eval_shape`, not
            run), or a tree of `jax.ShapeDtypeStruct`s.
          tx: as for `create`.
          mesh: as for `create`.
          config: as for `create`.
          rules: as for `create`.
          **kwargs: other dataclass fields.
        """
        return cls._build(apply_fn, params, tx, mesh, config, rules, abstract=True, **kwargs)

    @classmethod
    def _build(
        cls,
        apply_fn: Callable[..., Any],
        params: Any,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        config: ZeroPPConfig | None,
        rules: tensor_parallel.Rules | None,
        *,
        abstract: bool,
        **kwargs: Any,
    ) -> TrainState:
        config = ZeroPPConfig() if config is None else config
        if not isinstance(config, ZeroPPConfig):
            raise ValueError(f"config must be a zeropp_jax.ZeroPPConfig, got {type(config)}.")
        mesh_shape(mesh)
        plan = resolve(config, mesh)
        shapes, names = tensor_parallel.unbox(state_init.shapes_of(params), rules)
        leaf_layouts = _leaf_layouts(shapes, names, mesh, plan)
        if not abstract:
            _warn_above_share(shapes, leaf_layouts, mesh)
        treedef = jax.tree_util.tree_structure(shapes)
        shardings = [NamedSharding(mesh, part.leaf_spec(lo)) for lo in leaf_layouts]
        if abstract:
            stored = [
                jax.ShapeDtypeStruct(
                    lo.stored_shape, jnp.float32 if lo.sharded else lo.dtype, sharding=s
                )
                for lo, s in zip(leaf_layouts, shardings, strict=True)
            ]
        else:
            stored = state_init.master_leaves(params, leaf_layouts, shardings)
        master = jax.tree_util.tree_unflatten(treedef, stored)
        opt_state, opt_mirror = optimizer_view.init(
            tx, master, leaf_layouts, mesh, abstract=abstract
        )

        layouts = (treedef, leaf_layouts)
        replicated = NamedSharding(mesh, part.REPLICATED)

        def scalar(value: Any) -> Any:
            x = jnp.asarray(value)
            if abstract:
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
            return jax.device_put(x, replicated)

        step = scalar(jnp.int32(0))
        island = make_island_apply(apply_fn, mesh, config, layouts)
        refs = None
        if plan.weight_delta:
            build_refs = lambda m: full_weight_references(m, plan, mesh, leaf_layouts)  # noqa: E731
            if abstract:
                spec = NamedSharding(mesh, part.REFERENCE_SPEC)
                refs = state_init.placed(jax.eval_shape(build_refs, master), spec)
            else:
                refs = build_refs(master)
        if abstract:
            zeros = jax.eval_shape(lambda: R.zeros(leaf_layouts, plan, mesh))
            residuals = state_init.placed(zeros, NamedSharding(mesh, R.SPEC))
        else:
            residuals = R.zeros(leaf_layouts, plan, mesh)
        return cls(
            step=step,
            apply_fn=IslandApply(island, step if plan.stochastic_rounding else None, refs),
            params=R.join(master, residuals),
            tx=tx,
            opt_state=opt_state,
            opt_mirror=opt_mirror,
            mesh=mesh,
            config=config,
            layouts=layouts,
            skipped_steps=scalar(jnp.int32(0)),
            grads_finite=scalar(True),
            **kwargs,
        )

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """`tx.update` then `optax.apply_updates`, as in flax; with
        `config.skip_nonfinite_updates`, a step with non-finite gradients keeps parameters
        and optimizer state and counts itself in `skipped_steps`."""
        params, old_res = R.split(self.params)
        grads, new_res = R.split(grads)
        if (old_res is None) != (new_res is None):
            raise ValueError(
                f"apply_gradients: the state's parameters {'have' if old_res else 'lack'} the "
                f"error-feedback entry {R.KEY!r} but the gradients do"
                f"{' not' if old_res else ''}; pass the gradients of state.params unchanged."
            )
        if self.opt_mirror is None:
            raise ValueError(
                "the TrainState has no optimizer mirror table (opt_mirror); build it with "
                "zpp.TrainState.create rather than the dataclass constructor."
            )
        new_params, new_opt_state = optimizer_view.update(
            self.tx, grads, self.opt_state, params, self.layouts[1], self.opt_mirror, self.mesh
        )
        finite = self._grads_finite(grads)
        skipped = self.skipped_steps
        if new_res is not None:
            new_res = R.advance(new_res, self.step, self.plan)
        if self.config is not None and self.plan.skip_nonfinite:
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            new_params = jax.tree_util.tree_map(keep, new_params, params)
            new_opt_state = jax.tree_util.tree_map(keep, new_opt_state, self.opt_state)
            if new_res is not None:
                new_res = jax.tree_util.tree_map(keep, new_res, old_res)
            skipped = skipped + jnp.where(finite, 0, 1).astype(jnp.int32)
        if self.weight_ref is not None:
            if "apply_fn" in kwargs:
                raise ValueError(
                    "apply_gradients(apply_fn=...) with ZeroPPConfig.weight_delta_bits: the "
                    "state's apply_fn carries the weight references this step advances; "
                    "do not replace it."
                )
            refs = advance_weight_references(
                new_params, self.weight_ref, self.plan, self.mesh, self.layouts[1]
            )
            kwargs["apply_fn"] = dataclasses.replace(self.apply_fn, weight_ref=refs)
        return self.replace(
            step=self.step + 1,
            params=R.join(new_params, new_res),
            opt_state=new_opt_state,
            skipped_steps=skipped,
            grads_finite=finite,
            **kwargs,
        )

    def _grads_finite(self, grads: Any) -> jax.Array:
        """`grads_finite` of gradients in the stored layout (`finite.all_finite`: one
        flag per device; on GPUs each device's blocks joined into one reduction)."""
        specs = [part.leaf_spec(lo) for lo in self.layouts[1]]
        gpu = mesh_platform(self.mesh) == "gpu"
        return finite.all_finite(jax.tree_util.tree_leaves(grads), specs, self.mesh, join=gpu)

    @property
    def plan(self) -> Plan:
        """The state's config resolved for its mesh (`choices.resolve`, computed once per
        config and mesh)."""
        return resolve(self.config, self.mesh)

    @property
    def weight_ref(self) -> tuple[jax.Array | None, ...] | None:
        """The weight-delta references (None unless `config.weight_delta_bits`): per
        parameter leaf, the reconstruction every node holds of the padded parameter, in the
        compute dtype, sharded `PartitionSpec('local')` (None for a leaf not sharded)."""
        fn = self.apply_fn
        return fn.weight_ref if isinstance(fn, IslandApply) else None

    def reset_weight_references(self) -> TrainState:
        """The state with its weight-delta references rebuilt from `params` by one full
        `config.weight_bits` gather across nodes (what `restore_checkpoint` does); the
        state itself without `config.weight_delta_bits`."""
        if self.config is None or not self.plan.weight_delta:
            return self
        params, _ = R.split(self.params)
        refs = full_weight_references(params, self.plan, self.mesh, self.layouts[1])
        return self.replace(apply_fn=dataclasses.replace(self.apply_fn, weight_ref=refs))

    @property
    def param_count(self) -> int:
        """Number of values in the original (unpadded) parameters."""
        return sum(lo.size for lo in self.layouts[1])


def gather_params(state: TrainState) -> Any:
    """The full parameters, in their original shapes and dtypes, replicated on every device."""
    treedef, leaf_layouts = state.layouts
    replicated = NamedSharding(state.mesh, part.REPLICATED)

    def unpad(leaves):
        return [part.from_master(x, lo) for x, lo in zip(leaves, leaf_layouts, strict=True)]

    params, _ = R.split(state.params)
    leaves = jax.jit(unpad, out_shardings=replicated)(jax.tree_util.tree_leaves(params))
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ----------------------------------------------------------------------------- shard


def check_batch(batch: Any, num_devices: int) -> int:
    """Validates a batch pytree; returns the global batch size.

    Raises:
      ValueError: for leaves that are not arrays with a leading dimension, leading
        dimensions that disagree, or a global batch not divisible by the device count.
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("the batch is empty; expected a pytree of arrays.")
    sizes = {}
    for path, x in leaves:
        name = jax.tree_util.keystr(path) or "batch"
        if not is_array(x) or len(x.shape) == 0:
            raise ValueError(
                f"batch leaf {name} is {type(x).__name__} with shape "
                f"{getattr(x, 'shape', None)}; every batch leaf must be an array whose "
                "leading dimension is the global batch."
            )
        sizes[name] = int(x.shape[0])
    distinct = set(sizes.values())
    if len(distinct) > 1:
        raise ValueError(
            f"batch leaves disagree on the leading (batch) dimension: {sizes}; every leaf "
            "must have the same global batch size."
        )
    (size,) = distinct
    if size % num_devices:
        raise ValueError(
            f"global batch {size} is not divisible by the {num_devices} data-parallel devices "
            "(node x local) of the mesh; "
            f"use a multiple of {num_devices} (e.g. {max(1, size // num_devices) * num_devices})."
        )
    return size


def check_state(state: Any, mesh: Mesh | None = None, config: ZeroPPConfig | None = None) -> None:
    """Raises `ValueError` unless `state` is a zpp.TrainState, built for `mesh` and `config`.

    Args:
      state: the state a `zpp.shard` step was called with.
      mesh: the mesh the state must carry; None accepts the state's own.
      config: the `ZeroPPConfig` the state must carry; None accepts the state's own.
    """
    if not isinstance(state, TrainState):
        kind = type(state)
        raise ValueError(
            f"expected a zeropp_jax.TrainState, got {kind.__module__}.{kind.__qualname__}; "
            "build it with zpp.TrainState.create(apply_fn=, params=, tx=, mesh=, config=)."
        )
    if not isinstance(state.mesh, Mesh) or not isinstance(state.config, ZeroPPConfig):
        raise ValueError(
            f"the zeropp_jax.TrainState carries mesh {type(state.mesh).__name__} and config "
            f"{type(state.config).__name__}, expected a jax.sharding.Mesh and a ZeroPPConfig; "
            "build the state with zpp.TrainState.create(..., mesh=, config=) rather than "
            "with the dataclass constructor or .replace(mesh=, config=)."
        )
    if mesh is not None and state.mesh != mesh:
        raise ValueError(
            f"the state was built for mesh {dict(state.mesh.shape)} on devices "
            f"{state.mesh.device_ids.tolist()}, but the step for mesh {dict(mesh.shape)} on "
            f"devices {mesh.device_ids.tolist()}; create both with the same mesh, restore "
            "the checkpoint onto a state for this mesh, or leave out zpp.shard's mesh= to "
            "run on the state's mesh."
        )
    if config is not None and state.config != config:
        diff = {
            f.name: (getattr(state.config, f.name), getattr(config, f.name))
            for f in dataclasses.fields(config)
            if getattr(state.config, f.name) != getattr(config, f.name)
        }
        detail = ", ".join(f"{k}: state {a!r}, step {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"the state was built for another ZeroPPConfig than the step ({detail}); create "
            "both with the same ZeroPPConfig, or leave out zpp.shard's config= to run with "
            "the state's config."
        )


class ShardedStep:
    """What `zpp.shard` returns: a train step jitted for each state's mesh and config.

    Calling it validates the state and batch in Python (before anything compiles): the
    state must be a zpp.TrainState, built for `mesh` and `config` where those are set, and
    the global batch must divide over `state.mesh`. It then places the batch on that mesh
    (leading dimension over all devices) and runs the step, jitted once per mesh, config
    and tree structure of state and batch. `lower(state, batch)` gives the
    `jax.stages.Lowered` of the same program.

    Attributes:
      train_step: the user's `train_step(state, batch) -> (state, metrics)`.
      mesh: the mesh every state must be built for, or None for the state's own.
      config: the `ZeroPPConfig` every state must be built with, or None for the state's.
      donate_state: whether the input state's buffers are donated to the output.
    """

    def __init__(
        self,
        train_step: Callable[..., Any],
        mesh: Mesh | None,
        config: ZeroPPConfig | None,
        donate_state: bool,
    ) -> None:
        self.train_step = train_step
        self.mesh = mesh
        self.config = config
        self.donate_state = donate_state
        self._cache: dict[Any, Any] = {}

    def _wrapped(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        new_state, metrics = self.train_step(state, batch)
        if isinstance(metrics, dict) and isinstance(new_state, TrainState):
            metrics = dict(metrics)
            metrics.setdefault("grads_finite", new_state.grads_finite)
            metrics.setdefault("skipped_steps", new_state.skipped_steps)
        return new_state, metrics

    def _prepare(self, state: TrainState, batch: Any) -> tuple[Any, Any]:
        check_state(state, self.mesh, self.config)
        mesh = state.mesh
        check_batch(batch, data_parallel_size(mesh))
        sharding = NamedSharding(mesh, part.BATCH_SPEC)

        def place(x):
            if isinstance(x, jax.ShapeDtypeStruct):  # planning: shapes only
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return x
            return jax.device_put(x, sharding)

        batch = jax.tree_util.tree_map(place, batch)
        key = (
            mesh,
            state.config,
            jax.tree_util.tree_structure(state),
            jax.tree_util.tree_structure(batch),
        )
        if key not in self._cache:
            state_shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)
            replicated = NamedSharding(mesh, part.REPLICATED)
            self._cache[key] = jax.jit(
                self._wrapped,
                out_shardings=(state_shardings, replicated),
                donate_argnums=(0,) if self.donate_state else (),
            )
        return self._cache[key], batch

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        if isinstance(getattr(state, "step", None), jax.ShapeDtypeStruct):
            raise ValueError(
                "the state holds jax.ShapeDtypeStructs (a TrainState.abstract: shapes only), "
                "so there is nothing to train; lower it with step.lower(state, "
                "batch), restore a checkpoint onto it with zpp.restore_checkpoint, or build "
                "the state with zpp.TrainState.create to run the step."
            )
        fn, batch = self._prepare(state, batch)
        return fn(state, batch)

    def lower(
        self, state: TrainState, batch: Any, *, platforms: Sequence[str] | None = None
    ) -> jax.stages.Lowered:
        """The step's `jax.stages.Lowered`, for the devices of `state.mesh` or for `platforms`.

        `platforms=("cuda",)` lowers the same program for NVIDIA GPUs on any machine (the
        compiled Pallas kernels become Triton calls, for an NVIDIA H100 where this machine
        has no GPU: `pallas_kernels.trace_for_gpu`), e.g. to read its collectives with
        `comm_ledger`; the result can be inspected but not compiled or run here.
        """
        fn, batch = self._prepare(state, batch)
        if platforms is None:
            return fn.lower(state, batch)
        target = kernels.trace_for_gpu() if "cuda" in platforms else contextlib.nullcontext()
        with target:
            return fn.trace(state, batch).lower(lowering_platforms=tuple(platforms))


def shard(
    train_step: Callable[..., Any],
    *,
    mesh: Mesh | None = None,
    config: ZeroPPConfig | None = None,
    donate_state: bool = False,
) -> ShardedStep:
    """Jits an ordinary Flax `train_step(state, batch) -> (state, metrics)` for zpp states.

    The step runs on the mesh and with the config of the state it is called with
    (`state.mesh`, `state.config`, set by `TrainState.create`). `mesh` and `config` are
    optional checks: where given, every state must carry exactly them.

    Args:
      train_step: written for a flax TrainState: `jax.value_and_grad` of a loss calling
        `state.apply_fn({'params': params}, ...)`, then `state.apply_gradients(grads=)`.
      mesh: the mesh (from `zeropp_jax.make_mesh`) every state must be built for; None
        (default) takes each state's.
      config: the `ZeroPPConfig` every state must be built with; None (default) takes
        each state's.
      donate_state: donate the input state's buffers to the output (saves memory; the
        input state must not be used afterwards).

    Returns:
      A callable `(state, batch) -> (state, metrics)` with `.lower(state, batch)`. The
      batch is a pytree of arrays whose leading dimension is the global batch. Dict metrics
      gain `grads_finite` and `skipped_steps`.

    Raises:
      ValueError: here, for a `mesh` without `('node', 'local')` axes or a `config` that
        is not a ZeroPPConfig; when the step is called or lowered, for a state that is not
        a zpp.TrainState or was built for another `mesh` or `config` than the given ones,
        and for a batch that does not divide over the state's mesh.
      RuntimeError: here and when the step is traced, where jax is set to write programs
        the engine cannot read (`jaxpr_compat.check_supported`: e.g. `jax_scan3` on).
    """
    jaxpr_compat.check_supported()
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise ValueError(
                f"mesh must be a jax.sharding.Mesh from zeropp_jax.make_mesh, got "
                f"{type(mesh).__name__}; or leave it out to use the state's mesh."
            )
        mesh_shape(mesh)
    if config is not None and not isinstance(config, ZeroPPConfig):
        raise ValueError(
            f"config must be a zeropp_jax.ZeroPPConfig, got {type(config).__name__}; or leave "
            "it out to use the state's config."
        )
    return ShardedStep(train_step, mesh, config, donate_state)
