"""The shard_map island: what runs on each device inside `state.apply_fn`.

`make_island_apply` wraps a model's apply into the sharded `apply_fn` of a `TrainState`:
on each device it gathers every weight (qwZ / hpZ, or from the weight-delta reference),
runs the model on that device's slice of the batch, and sends gradients back through the
matching reduction (qgZ, with error feedback when configured). `IslandApply` binds it to
the state's step and weight references. Also here: the choice of quantization codec, the
gather spec and remat policy a config implies, and the weight-delta references in the
global view.
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

from zeropp_jax import delta as D
from zeropp_jax import partition as part
from zeropp_jax import residuals as R
from zeropp_jax import weight_gather as W
from zeropp_jax.config import ZeroPPConfig
from zeropp_jax.quant import XLA_CODEC, Codec, is_float_format

# ----------------------------------------------------------------------------- codecs


def resolve_codec(config: ZeroPPConfig, platform: str | None = None) -> Codec:
    """The block-quantization implementation `config.kernels` asks for.

    "auto" is Pallas on GPU and XLA elsewhere; "pallas_interpret" runs the Pallas kernels
    in interpret mode (for CPU tests). `platform` defaults to `jax.default_backend()`.

    Raises:
      ValueError: for Pallas with an fp8 format, compiled Pallas off a GPU, or compiled
        Pallas with a block size that is not a power of two.
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
    if kind == "pallas":
        sizes = {
            "weight_block_size": config.weight_block_size,
            "grad_block_size": config.grad_block_size,
            "grad_node_block_size": config.grad_node_block_size,
        }
        for field, size in sizes.items():
            if size is not None and size & (size - 1):
                raise ValueError(
                    f"ZeroPPConfig.kernels={config.kernels!r} resolves to the compiled Pallas "
                    f"kernels, which tile blocks in powers of two, but {field}={size}; use a "
                    "power of two (64, 128, 256, 512) or kernels='xla'."
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
