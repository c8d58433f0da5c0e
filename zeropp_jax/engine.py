"""The engine: `TrainState`, `shard(train_step)` and `gather_params`.

Global view outside, `shard_map` island inside. `TrainState.create` shards float32 master
parameters (and so the optax state) over all devices; its `apply_fn` is an island that, on
each device, gathers every weight (qwZ / hpZ), runs the model on that device's slice of
the batch, and sends gradients back through the matching reduction (qgZ). The loss,
`jax.value_and_grad` and the optax update stay in the global view, so any optax chain keeps
its single-device meaning.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding

from zeropp_jax import delta as D
from zeropp_jax import partition as part
from zeropp_jax import residuals as R
from zeropp_jax import weight_gather as W
from zeropp_jax.config import ZeroPPConfig
from zeropp_jax.mesh import mesh_shape
from zeropp_jax.quant import XLA_CODEC, Codec, is_float_format

# ----------------------------------------------------------------------------- codecs


def resolve_codec(config: ZeroPPConfig, platform: str | None = None) -> Codec:
    """The block-quantization implementation `config.kernels` asks for.

    "auto" is Pallas on GPU and XLA elsewhere; "pallas_interpret" runs the Pallas kernels
    in interpret mode (for CPU tests).
    """
    platform = platform or jax.default_backend()
    kind = config.kernels
    if kind == "auto":
        kind = "pallas" if platform == "gpu" else "xla"
    if kind == "xla":
        return XLA_CODEC
    formats = (
        config.weight_bits,
        config.weight_stage2_bits,
        config.grad_bits,
        config.grad_hop2_bits,
        config.weight_delta_bits,
    )
    fp8 = [f for f in formats if isinstance(f, str) and is_float_format(f)]
    if fp8:
        raise ValueError(
            f"ZeroPPConfig.kernels={config.kernels!r} resolves to the Pallas kernels, which "
            f"implement the integer formats only, but the config uses {fp8[0]!r}; use "
            "kernels='xla' for fp8 formats."
        )
    import pallas_kernels

    if kind == "pallas" and platform != "gpu":
        raise ValueError(
            f"ZeroPPConfig.kernels='pallas' needs a GPU, but the backend is {platform!r}; "
            "use kernels='xla' (or 'pallas_interpret' to run the kernels interpreted)."
        )
    return pallas_kernels.codec(interpret=kind == "pallas_interpret")


def gather_spec(config: ZeroPPConfig, codec: Codec) -> W.GatherSpec:
    """How every sharded weight is gathered and how its gradient is reduced."""
    return W.GatherSpec(
        hierarchical=config.hierarchical,
        weight_bits=config.weight_bits,
        weight_block_size=config.weight_block_size,
        grad_bits=config.grad_bits,
        grad_block_size=config.grad_block_size,
        two_hop=config.hierarchical
        or config.grad_bits is not None
        or config.grad_hop2_bits is not None,
        dtype=jnp.dtype(config.compute_dtype),
        codec=codec,
        weight_local_bits=config.weight_local_bits,
        grad_node_bits=config.grad_node_bits,
        grad_node_block_size=config.grad_node_block_size,
    )


def rounding_key(config: ZeroPPConfig, step: jax.Array, leaf_index: int) -> jax.Array:
    """The stochastic-rounding key of one parameter leaf at one step (the same on every
    device; the gradient reduction folds in the device and the hop, see
    `collectives.hop_keys`): a pure function of `(config.rounding_seed, step, leaf_index)`."""
    key = jax.random.fold_in(jax.random.key(config.rounding_seed), step)
    return jax.random.fold_in(key, leaf_index)


def remat_policy(config: ZeroPPConfig) -> Callable[..., bool]:
    """Save matmul outputs and (with hpZ) the secondary shard; never a full weight.

    The backward pass therefore re-gathers every weight it needs: from the saved secondary
    shard over `local` only with hpZ, over all devices without.
    """
    cp = jax.checkpoint_policies
    if config.hierarchical:
        return cp.save_from_both_policies(
            cp.dots_saveable, cp.save_only_these_names(W.SECONDARY_NAME)
        )
    return cp.dots_saveable


# ----------------------------------------------------------------------------- island


def _is_batch_leaf(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and x.ndim >= 1


def _is_array(x: Any) -> bool:
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
    codec = resolve_codec(config)
    spec = gather_spec(config, codec)
    policy = remat_policy(config)
    compute = jnp.dtype(config.compute_dtype)
    param_specs = [part.leaf_spec(lo) for lo in leaf_layouts]
    # Pallas calls (interpreted or not) carry no varying-axes types.
    check_vma = codec is XLA_CODEC

    def materialize(
        stored: list[jax.Array],
        refs: list[jax.Array],
        res: tuple[list[jax.Array], list[jax.Array]],
        res_at: tuple[tuple[bool, bool], ...],
        step: jax.Array | None,
    ) -> list[jax.Array]:
        out = []
        ref_iter = iter(refs)
        r1_iter, r2_iter = iter(res[0]), iter(res[1])
        for i, (x, lo) in enumerate(zip(stored, leaf_layouts, strict=True)):
            if lo.sharded:
                key = None if step is None else rounding_key(config, step, i)
                has1, has2 = res_at[i] if res_at else (False, False)
                residuals: W.Residuals = ()
                if has1 or has2:
                    residuals = (
                        next(r1_iter) if has1 else None,
                        next(r2_iter) if has2 else None,
                    )
                if config.weight_delta_bits is None:
                    full = W.gather_weight(x, spec, key, residuals)
                else:
                    full = W.gather_weight_from_reference(x, next(ref_iter), spec, key, residuals)
                out.append(full[: lo.shape[0]])
            elif jnp.issubdtype(x.dtype, jnp.floating):
                out.append(x.astype(compute))
            else:
                out.append(x)
        return out

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
        rep_idx = [i for i, x in enumerate(leaves) if _is_array(x) and i not in batch_idx]
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
            if check_vma:
                # A reference is the same on every node; marked node-invariant, it would
                # make the weight invariant too, and autodiff would psum the weight's
                # cotangent over `node` before the two-hop reduction (a full-size
                # cross-node all-reduce, and gradients counted num_nodes times).
                refs = [jax.lax.pcast(r, "node", to="varying") for r in refs]

            def run(p, refs, res, batch, rep, oth, keys, steps):
                full = materialize(p, refs, res, res_at, steps[0] if steps else None)
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
                v["params"] = jax.tree_util.tree_unflatten(treedef, full)
                return model_apply(v, *a, **kw)

            return jax.checkpoint(run, policy=policy)(p, refs, res, batch, rep, oth, keys, steps)

        island = jax.shard_map(
            body,
            mesh=mesh,
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


# ----------------------------------------------------------------------------- weight delta


def _reference_map(
    body: Callable[..., list[jax.Array]],
    mesh: Mesh,
    leaf_layouts: tuple[part.LeafLayout, ...],
    params: Any,
    refs: tuple[jax.Array | None, ...] | None,
) -> tuple[jax.Array | None, ...]:
    """Runs `body(shards[, refs])` over the sharded leaves in a shard_map island; the
    result has one entry per leaf (None for a leaf that is not sharded)."""
    leaves = jax.tree_util.tree_leaves(params)
    idx = [i for i, lo in enumerate(leaf_layouts) if lo.sharded]
    args: list[Any] = [[leaves[i] for i in idx]]
    in_specs: list[Any] = [[part.PARAM_SPEC] * len(idx)]
    if refs is not None:
        args.append([refs[i] for i in idx])
        in_specs.append([part.REFERENCE_SPEC] * len(idx))
    island = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=[part.REFERENCE_SPEC] * len(idx),
        # A gather over `node` is node-invariant, which the varying-axes check cannot see.
        check_vma=False,
    )
    with jax.named_scope("zeropp_weight_delta"):
        out = jax.jit(island)(*args)
    result: list[jax.Array | None] = [None] * len(leaf_layouts)
    for i, r in zip(idx, out, strict=True):
        result[i] = r
    return tuple(result)


def full_weight_references(
    params: Any, config: ZeroPPConfig, mesh: Mesh, leaf_layouts: tuple[part.LeafLayout, ...]
) -> tuple[jax.Array | None, ...]:
    """The weight-delta references built by one full `config.weight_bits` gather across
    nodes (at `TrainState.create` and after a restore; see `zeropp_jax.delta`)."""
    codec = resolve_codec(config)
    kw = dict(bits=config.weight_bits, block_size=config.weight_block_size, codec=codec)

    def body(shards):
        return [D.full_reference(x, dtype=jnp.dtype(config.compute_dtype), **kw) for x in shards]

    return _reference_map(body, mesh, leaf_layouts, params, None)


def advance_weight_references(
    params: Any,
    refs: tuple[jax.Array | None, ...],
    config: ZeroPPConfig,
    mesh: Mesh,
    leaf_layouts: tuple[part.LeafLayout, ...],
) -> tuple[jax.Array | None, ...]:
    """The references after one delta gather of `params` (the new master parameters)."""
    codec = resolve_codec(config)
    kw = dict(bits=config.weight_delta_bits, block_size=config.weight_block_size, codec=codec)

    def body(shards, old):
        return [D.delta_all_gather(x, r, **kw) for x, r in zip(shards, old, strict=True)]

    return _reference_map(body, mesh, leaf_layouts, params, refs)


# ----------------------------------------------------------------------------- state


def _all_finite(tree: Any) -> jax.Array:
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return jnp.array(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def init_opt_state(
    tx: optax.GradientTransformation,
    master: Any,
    leaf_layouts: tuple[part.LeafLayout, ...],
    mesh: Mesh,
) -> Any:
    """`tx.init(master)` with every leaf shaped like a sharded parameter sharded like one
    (moments, traces) and everything else (counts, schedules' state) replicated."""
    sharded_shapes = {(lo.padded_rows, *lo.shape[1:]) for lo in leaf_layouts if lo.sharded}
    abstract = jax.eval_shape(tx.init, master)

    def sharding(x):
        spec = part.PARAM_SPEC if tuple(x.shape) in sharded_shapes else part.REPLICATED
        return NamedSharding(mesh, spec)

    return jax.jit(tx.init, out_shardings=jax.tree_util.tree_map(sharding, abstract))(master)


class TrainState(train_state.TrainState):
    """A `flax.training.train_state.TrainState` whose parameters and optimizer state are
    sharded ZeRO-3 style over a `('node', 'local')` mesh.

    `params` holds the float32 master parameters in the global view, each float leaf padded
    along axis 0 to a multiple of the device count and sharded over all devices (so are
    the optimizer moments). Use `gather_params(state)` for the original shapes and dtypes.

    Extra fields: `mesh`, `config`, `layouts` (static), `skipped_steps` (updates skipped
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
        **kwargs: Any,
    ) -> TrainState:
        """Shards `params` over `mesh` and initialises `tx` on the shards.

        Args:
          apply_fn: the model's apply function (e.g. `model.apply`); it is wrapped into the
            sharded island.
          params: the model's parameters (e.g. `variables['params']`), unsharded.
          tx: any optax transformation.
          mesh: a mesh from `zeropp_jax.make_mesh`.
          config: a `ZeroPPConfig` (default: ZeRO++).
          **kwargs: other dataclass fields.

        Raises:
          ValueError: for a mesh without `('node', 'local')` axes, a config that is not a
            ZeroPPConfig, or parameters that are not float/int arrays.
        """
        config = ZeroPPConfig() if config is None else config
        if not isinstance(config, ZeroPPConfig):
            raise ValueError(f"config must be a zeropp_jax.ZeroPPConfig, got {type(config)}.")
        mesh_shape(mesh)
        n = mesh.size
        layout_tree = part.param_layouts(params, n)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        leaf_layouts = tuple(jax.tree_util.tree_leaves(layout_tree, is_leaf=part.is_layout))
        shardings = [NamedSharding(mesh, part.leaf_spec(lo)) for lo in leaf_layouts]
        stored = [
            jax.jit(part.to_master, static_argnums=1, out_shardings=s)(x, lo)
            for x, lo, s in zip(leaves, leaf_layouts, shardings, strict=True)
        ]
        master = jax.tree_util.tree_unflatten(treedef, stored)
        opt_state = init_opt_state(tx, master, leaf_layouts, mesh)

        layouts = (treedef, leaf_layouts)
        replicated = NamedSharding(mesh, part.REPLICATED)
        step = jax.device_put(jnp.array(0, jnp.int32), replicated)
        island = make_island_apply(apply_fn, mesh, config, layouts)
        refs = None
        if config.weight_delta_bits is not None:
            refs = full_weight_references(master, config, mesh, leaf_layouts)
        master = R.join(master, R.zeros(leaf_layouts, config, mesh))
        return cls(
            step=step,
            apply_fn=IslandApply(island, step if config.stochastic_rounding else None, refs),
            params=master,
            tx=tx,
            opt_state=opt_state,
            mesh=mesh,
            config=config,
            layouts=layouts,
            skipped_steps=jax.device_put(jnp.array(0, jnp.int32), replicated),
            grads_finite=jax.device_put(jnp.array(True), replicated),
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
        updates, new_opt_state = self.tx.update(grads, self.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        finite = _all_finite(grads)
        skipped = self.skipped_steps
        if new_res is not None:
            new_res = R.advance(new_res, self.step, self.config)
        if self.config is not None and self.config.skip_nonfinite_updates:
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            new_params = jax.tree_util.tree_map(keep, new_params, params)
            new_opt_state = jax.tree_util.tree_map(keep, new_opt_state, self.opt_state)
            if new_res is not None:
                new_res = jax.tree_util.tree_map(keep, new_res, old_res)
            skipped = skipped + jnp.where(finite, 0, 1).astype(jnp.int32)
        if self.weight_ref is not None and "apply_fn" not in kwargs:
            refs = advance_weight_references(
                new_params, self.weight_ref, self.config, self.mesh, self.layouts[1]
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
        if self.config is None or self.config.weight_delta_bits is None:
            return self
        params, _ = R.split(self.params)
        refs = full_weight_references(params, self.config, self.mesh, self.layouts[1])
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
        if not _is_array(x) or len(x.shape) == 0:
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
            f"global batch {size} is not divisible by the {num_devices} devices of the mesh; "
            f"use a multiple of {num_devices} (e.g. {max(1, size // num_devices) * num_devices})."
        )
    return size


def check_state(state: Any, mesh: Mesh, config: ZeroPPConfig) -> None:
    """Raises `ValueError` unless `state` is a zpp.TrainState built for `mesh` and `config`."""
    if not isinstance(state, TrainState):
        raise ValueError(
            f"expected a zeropp_jax.TrainState, got {type(state).__name__}; build it with "
            "zpp.TrainState.create(apply_fn=, params=, tx=, mesh=, config=)."
        )
    if state.mesh != mesh:
        raise ValueError(
            f"the state was built for mesh {dict(state.mesh.shape)} on devices "
            f"{state.mesh.device_ids.tolist()}, but the step for mesh {dict(mesh.shape)} on "
            f"devices {mesh.device_ids.tolist()}; create both with the same mesh (or restore "
            "the checkpoint onto a state for this mesh)."
        )
    if state.config != config:
        diff = {
            f.name: (getattr(state.config, f.name), getattr(config, f.name))
            for f in dataclasses.fields(config)
            if getattr(state.config, f.name) != getattr(config, f.name)
        }
        detail = ", ".join(f"{k}: state {a!r}, step {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"the state was built for another ZeroPPConfig than the step ({detail}); create "
            "both with the same ZeroPPConfig."
        )


class ShardedStep:
    """A train step compiled for one mesh and config (what `zpp.shard` returns).

    Calling it validates the state and batch in Python (before anything compiles), places
    the batch on the mesh (leading dimension over all devices) and runs the jitted step.
    `lower(state, batch)` gives the `jax.stages.Lowered` of the same program.
    """

    def __init__(
        self,
        train_step: Callable[..., Any],
        mesh: Mesh,
        config: ZeroPPConfig,
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
        check_batch(batch, self.mesh.size)
        sharding = NamedSharding(self.mesh, part.BATCH_SPEC)

        def place(x):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return x
            return jax.device_put(x, sharding)

        batch = jax.tree_util.tree_map(place, batch)
        key = (jax.tree_util.tree_structure(state), jax.tree_util.tree_structure(batch))
        if key not in self._cache:
            state_shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)
            replicated = NamedSharding(self.mesh, part.REPLICATED)
            self._cache[key] = jax.jit(
                self._wrapped,
                out_shardings=(state_shardings, replicated),
                donate_argnums=(0,) if self.donate_state else (),
            )
        return self._cache[key], batch

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        fn, batch = self._prepare(state, batch)
        return fn(state, batch)

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        fn, batch = self._prepare(state, batch)
        return fn.lower(state, batch)


def shard(
    train_step: Callable[..., Any],
    *,
    mesh: Mesh,
    config: ZeroPPConfig | None = None,
    donate_state: bool = False,
) -> ShardedStep:
    """Compiles an ordinary Flax `train_step(state, batch) -> (state, metrics)` for `mesh`.

    Args:
      train_step: written for a flax TrainState: `jax.value_and_grad` of a loss calling
        `state.apply_fn({'params': params}, ...)`, then `state.apply_gradients(grads=)`.
      mesh: a mesh from `zeropp_jax.make_mesh`.
      config: the `ZeroPPConfig` the state was created with (default: ZeRO++).
      donate_state: donate the input state's buffers to the output (saves memory; the
        input state must not be used afterwards).

    Returns:
      A callable `(state, batch) -> (state, metrics)` with `.lower(state, batch)`. The
      batch is a pytree of arrays whose leading dimension is the global batch. Dict metrics
      gain `grads_finite` and `skipped_steps`.
    """
    config = ZeroPPConfig() if config is None else config
    if not isinstance(config, ZeroPPConfig):
        raise ValueError(f"config must be a zeropp_jax.ZeroPPConfig, got {type(config)}.")
    mesh_shape(mesh)
    return ShardedStep(train_step, mesh, config, donate_state)
