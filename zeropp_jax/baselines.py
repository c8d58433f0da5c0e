"""XLA's own FSDP: the baseline a JAX user would run instead of this library.

The user's `train_step` under plain `jax.jit`, with the parameters and the optimizer state
sharded over every device of the mesh (MaxText's FSDP), and the collectives left to XLA:
its SPMD partitioner chooses them, combines them and schedules them. Nothing here runs a
collective by hand.

  * The state is a plain `flax.training.train_state.TrainState`, so the same `train_step`
    runs on it unchanged.
  * Every leaf is sharded along one dimension over all devices (`fsdp_spec`): its
    embedding (model-width) dimension where it has one, as MaxText maps its `embed`
    logical axis to the FSDP axis; for a stacked leaf `(layers, ...)` never the layer axis.
  * The model is expected to pin its activations to the batch at each block's entry and
    exit (`zeropp_jax._activation_sharding.constrain_to_batch`, as MaxText's models do);
    the step traces under the mesh, so those constraints apply. Without them XLA's
    partitioner may run a scanned block tensor-parallel and gather the batch's activations
    instead of the weights.
  * On a `('node', 'local', 'model')` mesh (tensor parallelism), a leaf annotated with
    `nn.with_partitioning(..., 'model')` is split over `model` at that dimension and over
    the data-parallel axes along another (FSDP + TP, as MaxText shards), and so is its
    optimizer state; the batch is split over the data-parallel axes only.
  * Compute is in `compute_dtype` (bfloat16 by default), as in the engine: the model sees
    its floating-point weights cast to it; the master weights and the optimizer state stay
    float32.
  * XLA:CPU widens 16-bit collectives to float32, so on CPU this baseline sends about
    twice what a GPU compilation of the same step sends. `xla_fsdp_state(...,
    gpu_wire=True)` is the variant whose collectives cross a CPU link at a GPU's widths
    (`gathered_copies`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax import _tensor_parallel as tensor_parallel
from zeropp_jax._mesh import data_parallel_size
from zeropp_jax.state import _optimizer_view as optimizer_view
from zeropp_jax.state._partition import BATCH_SPEC, MODEL_AXIS
from zeropp_jax.state._state_init import ShardedInit, check_params, shapes_of
from zeropp_jax.wire import _encoding as wire
from zeropp_jax.wire import reductions

ALL_DEVICES = ("node", "local")
"""The mesh axes a leaf is sharded over: all of them, in device order."""


def fsdp_spec(
    shape: tuple[int, ...],
    num_devices: int,
    model_dim: int | None = None,
    embed_size: int | None = None,
) -> P:
    """The `PartitionSpec` that shards a leaf of global `shape` over all (data-parallel)
    devices, and over `model` at `model_dim` when given.

    The data-parallel dimension is chosen among those divisible by `num_devices`, the layer
    axis (axis 0 of a leaf of rank 3 or more) and `model_dim` excluded: the last one of
    size `embed_size` (the model's width: MaxText's `embed` axis; a square `(d, d)`
    projection splits on its outputs), else the largest one. A leaf with no such dimension
    is not split over them (the small vectors of a model whose widths are not multiples of
    the device count).
    """
    dims: list[Any] = [None] * len(shape)
    if model_dim is not None:
        dims[model_dim] = MODEL_AXIS
    candidates = [d for d in range(1 if len(shape) >= 3 else 0, len(shape)) if d != model_dim]
    fits = [d for d in candidates if shape[d] % num_devices == 0 and shape[d] >= num_devices]
    embed = [d for d in fits if shape[d] == embed_size]
    if embed:
        dims[embed[-1]] = ALL_DEVICES
    elif fits:
        dims[max(fits, key=lambda d: (shape[d], -d))] = ALL_DEVICES
    while dims and dims[-1] is None:
        dims.pop()
    return P(*dims)


def embed_size_of(shapes: Any) -> int | None:
    """The model width of a parameter tree (of arrays or shapes): the dimension size that
    the most leaves of rank >= 2 share (the layer axis of a stacked leaf not counted; the
    larger size on a tie), or None for a tree with no such leaf."""
    counts: dict[int, int] = {}
    for x in jax.tree.leaves(shapes):
        shape = tuple(np.shape(x))
        if len(shape) >= 2:
            for size in set(shape[1:] if len(shape) >= 3 else shape):
                counts[size] = counts.get(size, 0) + 1
    return max(counts, key=lambda size: (counts[size], size)) if counts else None


def cast_floats(tree: Any, dtype: jnp.dtype) -> Any:
    """`tree` with its floating-point leaves cast to `dtype` (others unchanged)."""

    def cast(x: Any) -> Any:
        return x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x

    return jax.tree.map(cast, tree)


def _compute_in(apply_fn: Callable, dtype: jnp.dtype) -> Callable:
    def apply(variables: Any, *args: Any, **kwargs: Any) -> Any:
        return apply_fn(cast_floats(variables, dtype), *args, **kwargs)

    apply.__name__ = getattr(apply_fn, "__name__", "apply")
    return apply


def _constrain(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    return lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _split_dim(spec: P) -> int | None:
    """The dimension `spec` (an `fsdp_spec` without `model`) splits over all devices."""
    return next((d for d, axes in enumerate(spec) if axes is not None), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gathered_copies(
    leaves: tuple[jax.Array, ...], mesh: Mesh, specs: tuple[P, ...]
) -> tuple[jax.Array, ...]:
    """One whole copy of each 16-bit leaf per device, gathered as its uint16 bits.

    The forward is XLA FSDP's weight all-gathers at a GPU's width: each leaf's bits, split
    by its spec, constrained whole, so XLA's partitioner gathers them as uint16, which
    XLA:CPU cannot widen. The backward is the gradient reduction a GPU runs in 16 bits
    (XLA's GPU programs of this baseline reduce-scatter the bfloat16 weight gradients,
    `experiments/results/gpu_compile.md`): every device's partial gradients, all leaves in
    one buffer, go through one 16-bit ring reduce-scatter (`reductions.ring_reduce_scatter`,
    the one ZeRO-3 runs: partial sums cross as raw bits, each device adds its own piece in
    float32 and rounds to 16 bits before the next hop, as NCCL's ring does). So each
    device sends `(G-1)/G` of the gradient in 16 bits, the bytes of a 16-bit
    reduce-scatter, and only the ring's node-boundary edges cross the node link. (An
    all-to-all of the 16-bit pieces followed by a float32 sum would send as many bytes
    per device, but every pair of devices on two nodes its pieces across the link: on 2
    nodes of 4 devices, twice the gradient per node against a ring's 7/8 of it.) One ring
    for all leaves, not one per leaf: XLA:CPU may run independent loops of collectives in
    a different order on each device, and gloo then pairs the wrong messages. A leaf that
    its spec leaves whole is all-reduced as a ring does: its zero-padded flat gradient
    joins the ring, then the 16-bit sums of all such leaves are all-gathered as uint16.

    Args:
      leaves: 16-bit floating-point leaves of one dtype, global shapes, each placed as
        its spec says.
      mesh: a `('node', 'local')` mesh of `G` devices.
      specs: each leaf's `fsdp_spec` on `mesh` (split over all devices along one
        dimension, or not split).

    Returns:
      Per leaf `(G, *leaf.shape)`, split over all devices along axis 0: device `i` holds
      copy `i`, all equal to the leaf. Its gradient is the sum over the copies' gradients
      (in the leaf's dtype, placed as its spec).
    """
    n = data_parallel_size(mesh)
    out = []
    for x, spec in zip(leaves, specs, strict=True):
        bits = _constrain(lax.bitcast_convert_type(x, jnp.uint16), mesh, spec)
        whole = _constrain(bits, mesh, P())  # the all-gather, 16 bits per value
        copies = _constrain(jnp.broadcast_to(whole, (n, *x.shape)), mesh, P(ALL_DEVICES))
        out.append(lax.bitcast_convert_type(copies, x.dtype))
    return tuple(out)


def _gathered_copies_fwd(
    leaves: tuple[jax.Array, ...], mesh: Mesh, specs: tuple[P, ...]
) -> tuple[tuple[jax.Array, ...], None]:
    return gathered_copies.fun(leaves, mesh, specs), None


def _ring_reduce_leaves(
    partials: tuple[jax.Array, ...], specs: tuple[P, ...], n: int
) -> tuple[jax.Array, ...]:
    """Inside `shard_map`: one device's partial gradients `(1, *shape)` -> its piece of
    each split leaf's sum (placed as its spec) and every whole leaf's sum."""
    dtype = partials[0].dtype
    dims = [_split_dim(spec) for spec in specs]
    rows = []  # per leaf (G, width): row g is the piece device g sums
    for p, dim in zip(partials, dims, strict=True):
        x = p[0]
        if dim is not None:
            rows.append(jnp.moveaxis(x, dim, 0).reshape(n, -1))
        else:
            rows.append(jnp.pad(x.reshape(-1), (0, -x.size % n)).reshape(n, -1))
    widths = [r.shape[1] for r in rows]
    buffer = jnp.concatenate(rows, axis=1).reshape(-1)
    summed = reductions.ring_reduce_scatter(buffer, axis_name=ALL_DEVICES).astype(dtype)
    pieces = jnp.split(summed, np.cumsum(widths)[:-1])
    whole_at = [i for i, dim in enumerate(dims) if dim is None]
    if whole_at:  # the all-reduced leaves' sums, gathered whole
        gathered = lax.all_gather(
            wire.to_wire(jnp.concatenate([pieces[i] for i in whole_at])), ALL_DEVICES
        )
        columns = jnp.split(
            wire.from_wire(gathered, dtype), np.cumsum([widths[i] for i in whole_at])[:-1], axis=1
        )
    out = []
    for i, (p, dim) in enumerate(zip(partials, dims, strict=True)):
        shape = p.shape[1:]
        if dim is not None:
            moved = (shape[dim] // n, *shape[:dim], *shape[dim + 1 :])
            out.append(jnp.moveaxis(pieces[i].reshape(moved), 0, dim))
        else:
            flat = columns[whole_at.index(i)].reshape(-1)
            out.append(flat[: int(np.prod(shape))].reshape(shape))
    return tuple(out)


def _gathered_copies_bwd(
    mesh: Mesh, specs: tuple[P, ...], _: None, grads: tuple[jax.Array, ...]
) -> tuple[tuple[jax.Array, ...]]:
    n = data_parallel_size(mesh)
    dims = [_split_dim(spec) for spec in specs]
    # A whole leaf's gathered sum is equal on every device, which the varying-axes check
    # cannot infer (`lax.all_gather` is device-varying).
    reduced = jax.shard_map(
        functools.partial(_ring_reduce_leaves, specs=specs, n=n),
        mesh=mesh,
        in_specs=(P(ALL_DEVICES),),
        out_specs=tuple(spec if _split_dim(spec) is not None else P() for spec in specs),
        check_vma=all(dim is not None for dim in dims),
    )
    return (reduced(tuple(grads)),)


gathered_copies.defvjp(_gathered_copies_fwd, _gathered_copies_bwd)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _compute_on_copies(
    apply_fn: Callable, dtype: jnp.dtype, mesh: Mesh, embed_size: int | None
) -> Callable:
    """`apply_fn` run on every device's rows with its own whole copy of the weights
    (`gathered_copies`), so that each collective of the weights is one whose width the
    wrapper fixes. Every array among the call's arguments is split over all devices along
    its first (batch) axis, and so is every output."""
    n = data_parallel_size(mesh)
    spec = P(ALL_DEVICES)

    def apply(variables: Any, *args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree.flatten(variables)
        floats = [i for i, x in enumerate(leaves) if _is_float(x)]
        copies = list(leaves)
        if floats:
            specs = tuple(fsdp_spec(np.shape(leaves[i]), n, embed_size=embed_size) for i in floats)
            cast = tuple(leaves[i].astype(dtype) for i in floats)
            for i, c in zip(floats, gathered_copies(cast, mesh, specs), strict=True):
                copies[i] = c
        copy_specs = [spec if i in floats else P() for i in range(len(leaves))]
        inputs, inputs_tree = jax.tree.flatten((args, kwargs))
        split = [isinstance(x, jax.Array | np.ndarray) for x in inputs]
        for x, s in zip(inputs, split, strict=True):
            if s and (np.ndim(x) == 0 or np.shape(x)[0] % n):
                raise ValueError(
                    f"XLA FSDP with gpu_wire=True splits every array argument of the "
                    f"model over its first axis; got shape {np.shape(x)}, whose first "
                    f"axis does not divide by the {n} devices. Pass batch-first arrays "
                    "whose batch divides by the device count, or use gpu_wire=False."
                )
        arrays = [x for x, s in zip(inputs, split, strict=True) if s]

        def body(copies: list, arrays: list) -> Any:
            local = [c[0] if i in floats else c for i, c in enumerate(copies)]
            rows = iter(arrays)
            merged = [next(rows) if s else x for x, s in zip(inputs, split, strict=True)]
            local_args, local_kwargs = jax.tree.unflatten(inputs_tree, merged)
            return apply_fn(jax.tree.unflatten(tree, local), *local_args, **local_kwargs)

        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(copy_specs, [spec] * len(arrays)),
            out_specs=spec,
        )(copies, arrays)

    apply.__name__ = getattr(apply_fn, "__name__", "apply")
    return apply


class TreeTrainState(train_state.TrainState):
    """flax's `TrainState` for parameters that are not a dict (an Equinox module's arrays,
    a dataclass or NamedTuple): the same `create` and `apply_gradients`, without flax's
    look-up of a key in the parameters (which needs a dict)."""

    @classmethod
    def create(cls, *, apply_fn: Callable, params: Any, tx: Any, **kwargs: Any) -> Any:
        """The state at step 0 with `tx.init(params)`."""
        return cls(
            step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=tx.init(params), **kwargs
        )

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> Any:
        """`tx.update` then `optax.apply_updates`, step + 1."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(
            step=self.step + 1,
            params=optax.apply_updates(self.params, updates),
            opt_state=opt_state,
            **kwargs,
        )


def _check_mesh(mesh: Mesh) -> None:
    if tuple(mesh.axis_names) not in (ALL_DEVICES, (*ALL_DEVICES, MODEL_AXIS)):
        raise ValueError(
            f"XLA FSDP: mesh axes {tuple(mesh.axis_names)}; expected {ALL_DEVICES} or "
            f"{(*ALL_DEVICES, MODEL_AXIS)} (make it with zpp.make_mesh)."
        )


def state_shardings(
    state: Any,
    mesh: Mesh,
    model_dims: dict[str, int] | None = None,
    embed_size: int | None = None,
) -> Any:
    """`NamedSharding`s for every array leaf of `state` (concrete or abstract).

    `model_dims` maps a parameter's path (`jax.tree_util.keystr` within the parameter
    tree) to the dimension it splits over `model`; every leaf of `state` whose path ends
    with that path (the parameter, its optimizer moments) is split there. `embed_size` is
    the model width each leaf is split along where it has it (`fsdp_spec`).
    """
    _check_mesh(mesh)
    n = data_parallel_size(mesh)
    model_dims = model_dims or {}

    def spec(path: Any, x: Any) -> NamedSharding:
        key = jax.tree_util.keystr(path)
        dim = next((d for p, d in model_dims.items() if key.endswith(p) and d < np.ndim(x)), None)
        return NamedSharding(mesh, fsdp_spec(np.shape(x), n, dim, embed_size))

    return jax.tree_util.tree_map_with_path(spec, state)


def xla_fsdp_state(
    *,
    apply_fn: Callable,
    params: Any,
    tx: Any,
    mesh: Mesh,
    compute_dtype: Any = jnp.bfloat16,
    abstract: bool = False,
    rules: tensor_parallel.Rules | None = None,
    embed_size: int | None = None,
    gpu_wire: bool = False,
) -> train_state.TrainState:
    """A flax `TrainState` whose parameters and optimizer state are sharded over all devices.

    Args:
      apply_fn: the model's apply function, e.g. `model.apply`.
      params: the parameter tree (global shapes; float32 master weights; any pytree of
        arrays), or a `zpp.ShardedInit` returning it (run inside the sharded `jax.jit`,
        so the unsharded tree is never built).
      tx: an optax `GradientTransformation`.
      mesh: a `('node', 'local')` mesh (`zpp.make_mesh`).
      compute_dtype: the dtype the model computes in; its floating weights are cast to it
        on every call of `state.apply_fn`.
      abstract: return only the state's `jax.ShapeDtypeStruct`s (shardings set), for
        lowering and compiling a step from shapes; nothing is computed.
      rules: flax logical axis rules for leaves annotated with
        `nn.with_logical_partitioning`, as for `zpp.TrainState.create`.
      embed_size: the model width, the dimension each leaf is split along where it has
        it (`fsdp_spec`); default `embed_size_of(params)`, the size most weight matrices
        share.
      gpu_wire: send what a GPU compilation of the step sends, also on CPU (where XLA
        widens 16-bit collectives to float32): `state.apply_fn` gathers each floating
        leaf as the uint16 bits of its `compute_dtype` cast and reduces the gradients in
        one 16-bit ring reduce-scatter (`gathered_copies`), and runs the model on each
        device's rows under `jax.shard_map`. Every array argument of the model (and every
        output) must be batch-first. The model's parameters, the float32 master weights
        and the optimizer are unchanged. The forward computes what the plain baseline's
        does, bit for bit (a gather of bits is exact); a gradient differs from the plain
        baseline's (a float32 sum of the devices' 16-bit partial gradients, rounded once)
        only by the ring's rounding of its partial sums to 16 bits at each hop, as a GPU's
        ring rounds them: at most `(G + 2) * 2**-8 * sum_i |partial_i|` per value in
        bfloat16 on `G` devices. Needs a 16-bit `compute_dtype` and the two-axis mesh (no
        tensor parallelism).

    Returns:
      The state, each leaf placed with `fsdp_spec` (the optimizer state is created already
      sharded, under `jax.jit`).

    Raises:
      ValueError: for a mesh that is not `zpp.make_mesh`'s, a bare callable as `params`
        (wrap it in `zpp.ShardedInit`), or `gpu_wire` with a `compute_dtype` that is not
        16-bit floating point or with a `model` axis.
    """
    _check_mesh(mesh)
    check_params(params)
    dtype = jnp.dtype(compute_dtype)
    if gpu_wire and not (jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2):
        raise ValueError(
            f"XLA FSDP: gpu_wire=True sends weights as 16-bit bits; compute_dtype is {dtype}. "
            "Use compute_dtype=jnp.bfloat16 (or float16), or gpu_wire=False."
        )
    if gpu_wire and MODEL_AXIS in mesh.axis_names:
        raise ValueError(
            f"XLA FSDP: gpu_wire=True needs the mesh axes {ALL_DEVICES}; got "
            f"{tuple(mesh.axis_names)}. Use zpp.make_mesh() without model_size, or "
            "gpu_wire=False for tensor parallelism."
        )

    # Its update's collectives (those XLA inserts for a non-elementwise optimizer) show
    # in a ledger as the update phase, as the engine's do.
    scoped_tx = optimizer_view.in_update_scope(tx)

    def unboxed() -> Any:
        p = params.fn() if isinstance(params, ShardedInit) else params
        return tensor_parallel.unbox(p, rules)[0]

    if embed_size is None:
        embed_size = embed_size_of(jax.eval_shape(unboxed))
    if gpu_wire:
        compute = _compute_on_copies(apply_fn, dtype, mesh, embed_size)
    else:
        compute = _compute_in(apply_fn, dtype)

    def create() -> train_state.TrainState:
        p = unboxed()
        kind = train_state.TrainState if isinstance(p, Mapping) else TreeTrainState
        return kind.create(apply_fn=compute, params=p, tx=scoped_tx)

    shapes = jax.eval_shape(create)
    shardings = state_shardings(shapes, mesh, model_dims_of(params, mesh, rules), embed_size)
    if abstract:
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
        )
    return jax.jit(create, out_shardings=shardings)()


def model_dims_of(
    params: Any, mesh: Mesh, rules: tensor_parallel.Rules | None = None
) -> dict[str, int]:
    """Per annotated parameter path, the dimension it splits over `model` (see
    `tensor_parallel.model_dims`): `params` is a tree (possibly of shapes) or a
    `ShardedInit` returning one (traced, not run); `rules` resolve logical names (see
    `tensor_parallel.unbox`)."""
    shapes = shapes_of(params)
    unboxed, names = tensor_parallel.unbox(shapes, rules)
    flat = jax.tree_util.tree_flatten_with_path(unboxed)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    dims = tensor_parallel.model_dims(paths, [tuple(np.shape(x)) for _, x in flat], names, mesh)
    return {p: d for p, d in zip(paths, dims, strict=True) if d is not None}


def xla_fsdp_step(
    train_step: Callable,
    state: Any,
    mesh: Mesh,
    *,
    donate_state: bool = True,
) -> Any:
    """`jax.jit(train_step)` with the state sharded as `xla_fsdp_state` places it, the
    batch split over all devices along its first axis, and the metrics replicated.

    Args:
      train_step: `(state, batch) -> (state, metrics)`, the user's unchanged step.
      state: a state from `xla_fsdp_state` (or its abstract shapes): fixes the shardings.
      mesh: the mesh `state` lives on.
      donate_state: donate the input state's buffers to the output state.

    Returns:
      The jitted step, a `jax.jit` wrapper (`.lower` works, so `comm_ledger(...,
      compiled=True)` reads what XLA chose to send).
    """
    _check_mesh(mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state)

    def step(state: Any, batch: Any) -> Any:
        # The trace sees the mesh, so the model's `constrain_to_batch` constraints apply.
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return train_step(state, batch)

    step.__name__ = getattr(train_step, "__name__", "train_step")
    return jax.jit(
        step,
        in_shardings=(shardings, NamedSharding(mesh, BATCH_SPEC)),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=(0,) if donate_state else (),
    )


def step_ledger(
    train_step: Callable,
    batch: Any,
    *,
    apply_fn: Callable,
    params: Any,
    tx: Any,
    mesh: Mesh,
    config: Any,
    partitioned: bool = False,
    compiled: bool = False,
) -> Any:
    """The `CommLedger` of one `train_step` on `batch`, under the engine with `config` (a
    `ZeroPPConfig`), or under XLA's FSDP when `config` is None, for the tables that set
    the engines side by side. Nothing runs and no state is built (the step is lowered from
    shapes): the engine's step is read as lowered (its own collectives), XLA FSDP's as
    compiled (its collectives exist only once XLA chose them); with `partitioned` either
    is read as XLA's SPMD partitioner leaves it, before XLA:CPU widens its 16-bit
    collectives (`comm_ledger(..., partitioned=True)`: the whole step, the wire a GPU
    compilation sends).

    Args:
      train_step: `(state, batch) -> (state, metrics)`.
      batch: a global batch (or its `jax.ShapeDtypeStruct`), split over all devices along
        axis 0.
      apply_fn: the model's apply function.
      params: the parameter tree (global shapes), a tree of `jax.ShapeDtypeStruct`s, or a
        `zpp.ShardedInit` returning it (traced, not run).
      tx: an optax `GradientTransformation`.
      mesh: a `('node', 'local')` mesh.
      config: a `ZeroPPConfig`, or None for XLA's FSDP in bfloat16.
      partitioned: read the partitioner's program (every collective of the step, the
        optimizer update's included) rather than the compiled (XLA FSDP) or lowered
        (engine) one.
      compiled: with a `config`, read the engine's compiled program (every collective of
        the step, as XLA:CPU runs it) rather than the lowered one.

    Returns:
      The ledger of the step, per device (`CommLedger`).
    """
    from zeropp_jax._engine import TrainState, shard
    from zeropp_jax.measure._ledger import comm_ledger

    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            np.shape(x), jnp.result_type(x), sharding=NamedSharding(mesh, BATCH_SPEC)
        ),
        batch,
    )
    if config is None:
        state = xla_fsdp_state(apply_fn=apply_fn, params=params, tx=tx, mesh=mesh, abstract=True)
        count = sum(int(np.size(x)) for x in jax.tree.leaves(state.params))
        step = xla_fsdp_step(train_step, state, mesh)
        return comm_ledger(
            step,
            state,
            batch,
            param_count=count,
            compiled=not partitioned,
            partitioned=partitioned,
        )
    state = TrainState.abstract(apply_fn=apply_fn, params=params, tx=tx, mesh=mesh, config=config)
    return comm_ledger(
        shard(train_step, mesh=mesh, config=config),
        state,
        batch,
        partitioned=partitioned,
        compiled=compiled,
    )
