"""Gathering each sharded weight where the model reads it: trace the model, then place.

Inside the shard_map island, the model's apply is traced once with full-size abstract
weights into a jaxpr, which `evaluate` then runs with each sharded weight as a `Lazy`
value (its per-device shard, not yet gathered):

- an equation that reads a lazy weight runs inside `_at_use`, a custom VJP that gathers the
  weight just before the equation and drops it after; its backward re-gathers it (hpZ: from
  the saved secondary shard, over `local` only), takes the equation's VJP and reduces the
  weight's gradient (qgZ). Only the equation's other inputs are saved, never the weight;
- a `scan` whose `xs` hold a stacked weight (`nn.scan`, `nnx.scan`, `lax.scan`, `lax.map`
  over a `(layers, ...)` leaf, also after a transpose, reshape, slice or reversal that
  keeps the layer axis whole, see `layer_view`) runs as a `layered_scan.Loop`: each
  iteration gathers its own layer (layer i+1 is gathered while layer i computes), and the
  backward loop, owned by a custom VJP, keeps what the model's own remat keeps of each
  layer except its weights, re-gathers layer i and reduces its gradient inside the
  iteration. A leaf scanned over another axis than its axis 0 is re-laid out first by
  one all-to-all (`relayout`);
- layout-only equations (`reshape`, `transpose`, `convert_element_type`, `slice`, ...) of
  a lazy weight stay lazy; calls in `INLINED_CALLS` (`jit`) are inlined; a user's
  `jax.checkpoint` block is evaluated under `jax.checkpoint` with the same policy (plus
  the secondary shard saved);
- a weight read more than once (a tied embedding) is gathered once, at its first use, and
  held until its last; each use's backward re-gathers it. Its cotangent leaves through one
  gradient reduction of the uses' sum (the first use's full-size gradient waits for the
  last one), or, for a leaf in `per_use`, each use reduces its own gradient as it is made
  (one more reduction of the leaf per extra use, nothing full-size held);
- a weight read inside a `cond` or `while`, or by a scan this module does not rebuild (a
  weight among its constants or carry, a chain that merges or broadcasts the layer axis,
  a tensor-parallel or error-feedback leaf scanned over an axis other than 0, an
  error-feedback leaf whose scan does not read every layer once), is gathered whole at
  that point, with a warning naming the leaf.

Order comes from data dependencies, not from the scheduler: `_barrier` ties each gather's
input shard to an activation (the previous weight use's input, so the gather
runs one use ahead; in the backward, the cotangent reaching that use).

Shapes: a `Lazy` holds the per-device stored shard (see `partition`); the collectives see
it flattened as the device's piece.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from zeropp_jax import _tensor_parallel as tensor_parallel
from zeropp_jax.interpreter import _dataflow as dataflow
from zeropp_jax.interpreter import _indexed_scan as indexed_scan
from zeropp_jax.interpreter import _jaxpr_compat as jaxpr_compat
from zeropp_jax.interpreter import _layer_view as layer_view
from zeropp_jax.interpreter import _layered_scan as layered_scan
from zeropp_jax.interpreter import _lazy as lazy
from zeropp_jax.interpreter import _relayout as relayout
from zeropp_jax.interpreter import _use_vjp as use_vjp
from zeropp_jax.interpreter._jaxpr_reads import CHAIN_PRIMITIVES, count_uses
from zeropp_jax.interpreter._lazy import Lazy
from zeropp_jax.state import _blocks as blocks
from zeropp_jax.wire._weight_gather import SECONDARY_NAME

WHOLE_SCOPE = "zeropp_whole_gather"
"""Named scope of every gather of a whole leaf that the engine could not place per use."""
GATHERED_NAME = "zeropp_gathered"
"""`checkpoint_name` of a use's gathered weights inside a remat block: the recompute's
gather, held for the use's backward; no remat policy saves it from the forward pass."""


@dataclasses.dataclass
class Context:
    """Interpreter state shared across one evaluation."""

    gathers: dataflow.Gathers
    prefetch: bool
    uses: dict[int, int]
    per_use: frozenset[int] = frozenset()
    shared: dict[int, tuple[Any, Any, Any]] = dataclasses.field(default_factory=dict)
    reductions: dict[int, int] = dataclasses.field(default_factory=dict)
    tie: Any = None
    warned: set[tuple[int, str]] = dataclasses.field(default_factory=set)
    in_remat: bool = False


# ----------------------------------------------------------------------------- helpers


def _full_weight(g: dataflow.Gathers, lz: Lazy, flat: jax.Array) -> jax.Array:
    layout = g.layout(lz.leaf)
    full = tensor_parallel.place_gathered(blocks.unpiece(flat, layout, g.num_devices), layout)
    return dataflow.apply_chain(full, lz.chain)


def _warn(ctx: Context, leaf: int, where: str) -> None:
    if (leaf, where) in ctx.warned:
        return
    ctx.warned.add((leaf, where))
    warnings.warn(
        f"zeropp_jax: parameter {ctx.gathers.name(leaf)} is read {where}, where the engine "
        "cannot gather it per use or per layer; it is gathered whole at that point (its "
        f"full copy is held there; the ledger shows the gather under {WHOLE_SCOPE!r}).",
        stacklevel=2,
    )


def _shard_bytes(lazies: Sequence[Lazy]) -> int:
    """Per-device stored bytes of the weights `lazies` stand for."""
    return sum(lz.shard.size * lz.shard.dtype.itemsize for lz in lazies)


def _runner(eqn: Any, act_idx: Sequence[int], lazy_idx: Sequence[int]) -> use_vjp.Run:
    """`eqn` as a function of its activations and its (gathered) weights, which fill its
    inputs at `act_idx` and `lazy_idx`."""

    def run_eqn(acts: Sequence[Any], weights: Sequence[jax.Array]) -> list[Any]:
        merged: list[Any] = [None] * (len(act_idx) + len(lazy_idx))
        for i, a in zip(act_idx, acts, strict=True):
            merged[i] = a
        for i, w in zip(lazy_idx, weights, strict=True):
            merged[i] = w
        return jaxpr_compat.bind(eqn, merged)

    return run_eqn


def _pull(
    run_eqn: use_vjp.Run,
    full: Callable[[list[jax.Array]], list[jax.Array]],
    vjp: Any,
    acts: Sequence[Any],
    flat: list[jax.Array],
    cts: Any,
) -> tuple[list[Any], list[jax.Array]]:
    """Cotangents of one use's activations and gathered weights (`flat`, re-gathered in
    the backward): from the forward's `vjp` (`use_vjp.forward`), or, where the forward
    kept none (None), by running the equation again."""
    if vjp is None:
        _, pull = jax.vjp(lambda a, f: run_eqn(a, full(f)), acts, flat)
        d_acts, d_flat = pull(cts)
        return list(d_acts), list(d_flat)
    weights, pull_full = jax.vjp(full, flat)
    d_acts, d_weights = use_vjp.pull(vjp, acts, weights, cts)
    (d_flat,) = pull_full(list(d_weights))
    return d_acts, list(d_flat)


# ----------------------------------------------------------------------------- evaluation


def evaluate(
    jaxpr: jaxpr_compat.Jaxpr, consts: Sequence[Any], args: Sequence[Any], ctx: Context
) -> list:
    """Runs `jaxpr` on `args`, some of which are `Lazy` weights; returns its outputs."""
    env: dict[jaxpr_compat.Var, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jaxpr_compat.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = _eval_eqn(eqn, invals, ctx)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    outs = [read(v) for v in jaxpr.outvars]
    return _materialized(
        ctx, outs, [i for i, x in enumerate(outs) if isinstance(x, Lazy)], "as a model output"
    )


def _eval_eqn(eqn: jaxpr_compat.JaxprEqn, invals: list[Any], ctx: Context) -> list[Any]:
    lazy_idx = [i for i, x in enumerate(invals) if isinstance(x, Lazy)]
    if not lazy_idx:
        return jaxpr_compat.bind(eqn, invals)
    prim = eqn.primitive
    if prim.name in CHAIN_PRIMITIVES and len(lazy_idx) == 1 and len(eqn.outvars) == 1:
        lz = invals[lazy_idx[0]]
        others = [x for i, x in enumerate(invals) if i != lazy_idx[0]]
        if not others:
            params = jaxpr_compat.bind_params(eqn)
            return [
                dataclasses.replace(lz, aval=eqn.outvars[0].aval, chain=(*lz.chain, (prim, params)))
            ]
    inner = jaxpr_compat.inlined_call(eqn)
    if inner is not None:
        return evaluate(inner.jaxpr, inner.consts, invals, ctx)
    remat = jaxpr_compat.remat_of(eqn)
    if remat is not None:
        return _checkpointed(remat, invals, ctx)
    scan = jaxpr_compat.scan_of(eqn)
    if scan is not None:
        out = _place_scan(eqn, scan, invals, ctx)
        if out is not None:
            return out
        where = "by a lax.scan the engine does not rebuild per layer"
        return jaxpr_compat.bind(eqn, _materialized(ctx, invals, lazy_idx, where))
    if prim in (jaxpr_compat.cond_p, jaxpr_compat.while_p):
        where = f"inside a `{prim.name}`"
        return jaxpr_compat.bind(eqn, _materialized(ctx, invals, lazy_idx, where))
    if any(ctx.uses.get(invals[i].leaf, 1) > 1 for i in lazy_idx):
        return _at_shared_use(eqn, invals, lazy_idx, ctx)
    return _at_use(eqn, invals, lazy_idx, ctx)


def _materialized(ctx: Context, vals: list[Any], at: Sequence[int], where: str | None) -> list[Any]:
    """`vals` with the lazy weights at `at` replaced by their whole gathered weights,
    gathered together (see `_shared`), once per leaf; warns unless `where` is None."""
    lazies = [vals[i] for i in at]
    if where is not None:
        for lz in lazies:
            _warn(ctx, lz.leaf, where)
    got = _shared(ctx, lazies, scope=WHOLE_SCOPE)
    out = list(vals)
    for i, lz, (flat, _, _) in zip(at, lazies, got, strict=True):
        out[i] = _full_weight(ctx.gathers, lz, flat)
    return out


def _checkpointed(remat: jaxpr_compat.Remat, invals: list[Any], ctx: Context) -> list[Any]:
    """A user's `jax.checkpoint` block, evaluated under `jax.checkpoint` with its policy
    plus the secondary shards saved (so its recompute never crosses nodes)."""
    lazy_idx = [i for i, x in enumerate(invals) if isinstance(x, Lazy)]
    shards = [invals[i].shard for i in lazy_idx]
    others = [x for i, x in enumerate(invals) if i not in lazy_idx]
    names = jax.checkpoint_policies.save_only_these_names(SECONDARY_NAME)
    user = remat.policy
    saved = names if user is None else jax.checkpoint_policies.save_from_both_policies(user, names)

    def policy(prim: Any, *args: Any, **params: Any) -> bool:
        # A use's gathered weight, held from the recompute to its backward, is never saved
        # from the forward pass (whatever the user's policy saves).
        return params.get("name") != GATHERED_NAME and saved(prim, *args, **params)

    def block(shards, others):
        it_s, it_o = iter(shards), iter(others)
        args = [
            dataclasses.replace(x, shard=next(it_s)) if isinstance(x, Lazy) else next(it_o)
            for x in invals
        ]
        sub = Context(
            ctx.gathers,
            ctx.prefetch,
            ctx.uses,
            ctx.per_use,
            reductions=ctx.reductions,
            warned=ctx.warned,
            in_remat=True,
        )
        return evaluate(remat.jaxpr, remat.consts, args, sub)

    return jax.checkpoint(block, policy=policy, prevent_cse=remat.prevent_cse)(shards, others)


# ----------------------------------------------------------------------------- one use


def _at_use(
    eqn: jaxpr_compat.JaxprEqn, invals: list[Any], lazy_idx: list[int], ctx: Context
) -> list:
    """Runs one equation that reads lazy weights, gathering them for it alone."""
    g = ctx.gathers
    lazies = [invals[i] for i in lazy_idx]
    act_idx = [i for i in range(len(invals)) if i not in lazy_idx]
    acts = [invals[i] for i in act_idx]
    leaves = [lz.leaf for lz in lazies]
    own_tie = dataflow.first_array(acts)
    tie = ctx.tie if (ctx.prefetch and ctx.tie is not None) else own_tie
    ctx.tie = own_tie if own_tie is not None else ctx.tie

    run_eqn = _runner(eqn, act_idx, lazy_idx)

    def flats(pieces, wires, states, alternate):
        return [
            g.gather(leaf, p, w, s, alternate)
            for leaf, p, w, s in zip(leaves, pieces, wires, states, strict=True)
        ]

    def full(flat):
        return [_full_weight(g, lz, f) for lz, f in zip(lazies, flat, strict=True)]

    def run_flat(acts, flat):
        return run_eqn(acts, full(flat))

    keep = use_vjp.keeps_residuals(run_eqn, acts, [lz.aval for lz in lazies], _shard_bytes(lazies))

    def forward(pieces, acts, states, tie):
        pieces = dataflow.tie(tie, pieces, barrier=g.barrier_ties)
        wires = [g.wire(leaf, p, s) for leaf, p, s in zip(leaves, pieces, states, strict=True)]
        return flats(pieces, wires, states, False), (pieces, wires)

    @jax.custom_vjp
    def use(pieces, acts, states, tie):
        return run_flat(acts, forward(pieces, acts, states, tie)[0])

    def use_fwd(pieces, acts, states, tie):
        flat, (pieces, wires) = forward(pieces, acts, states, tie)
        # Inside a remat block this runs again in the backward (the recompute), before
        # `use_bwd`: its gathered weights can be held for it rather than gathered a third
        # time (`Gathers.hold_recomputed`).
        hold = ctx.in_remat and g.hold_recomputed
        held = [checkpoint_name(f, GATHERED_NAME) for f in flat] if hold else None
        if not keep:
            return run_flat(acts, flat), (pieces, wires, acts, states, tie, None, held)
        out, vjp = use_vjp.forward(run_eqn, acts, full(flat))
        return out, (pieces, wires, acts, states, tie, vjp, held)

    def use_bwd(saved, cts):
        pieces, wires, acts, states, tie, vjp, held = saved
        if held is None:
            pieces, wires = dataflow.tie_after((acts, cts), (pieces, wires), barrier=g.barrier_ties)
            held = flats(pieces, wires, states, True)
        d_acts, d_flat = _pull(run_eqn, full, vjp, acts, held, cts)
        d_pieces, d_states = [], []
        for s, (dp, new_residuals) in zip(
            states, g.reduce(leaves, d_flat, states, None), strict=True
        ):
            d_pieces.append(dp)
            d_states.append(s.cotangent(new_residuals))
        d_tie = None if tie is None else dataflow.zero_cotangent(tie)
        return d_pieces, list(d_acts), d_states, d_tie

    use.defvjp(use_fwd, use_bwd)
    pieces = [blocks.piece(lz.shard, g.layout(lz.leaf)) for lz in lazies]
    return use(pieces, acts, [g.state(leaf) for leaf in leaves], tie)


# ----------------------------------------------------------------------------- shared use


def _shared(
    ctx: Context, lazies: Sequence[Lazy], scope: str | None = None
) -> list[tuple[jax.Array, tuple[jax.Array, ...], jax.Array]]:
    """Weights gathered whole once, at their first read (a tied embedding read by several
    equations, or a read the engine cannot place): per lazy, `(flat, wire, piece)`. Those
    not gathered yet are gathered together (`Gathers.full`: their gradients may share a
    reduction). Each `flat`'s cotangent, summed over its reads, leaves through one gradient
    reduction. `scope` names the gathers' ops (the ledger shows them under it)."""
    g = ctx.gathers
    new = list(dict.fromkeys(lz.leaf for lz in lazies if lz.leaf not in ctx.shared))
    if new:
        shard = {lz.leaf: lz.shard for lz in lazies}
        states = [g.state(leaf) for leaf in new]
        with jax.named_scope(scope) if scope else contextlib.nullcontext():
            pieces = [
                dataflow.tie(
                    ctx.tie, blocks.piece(shard[leaf], g.layout(leaf)), barrier=g.barrier_ties
                )
                for leaf in new
            ]
            wires = [g.wire(leaf, p, s) for leaf, p, s in zip(new, pieces, states, strict=True)]
            flats = g.full(new, pieces, wires, states)
        for leaf, flat, wire, piece in zip(new, flats, wires, pieces, strict=True):
            ctx.shared[leaf] = (flat, wire, lax.stop_gradient(piece))
    return [ctx.shared[lz.leaf] for lz in lazies]


def _at_shared_use(
    eqn: jaxpr_compat.JaxprEqn, invals: list[Any], lazy_idx: list[int], ctx: Context
):
    """One use of weights gathered once for several uses: the forward reads the shared
    full weight; the backward re-gathers it (from the secondary shard with hpZ) rather
    than keeping it, and returns the weight's cotangent to the shared gather. For a leaf
    in `ctx.per_use` the backward reduces that cotangent itself and returns it to the
    stored shard's piece (`own`); the shared gather then gets none and reduces nothing."""
    g = ctx.gathers
    lazies = [invals[i] for i in lazy_idx]
    leaves = [lz.leaf for lz in lazies]
    act_idx = [i for i in range(len(invals)) if i not in lazy_idx]
    acts = [invals[i] for i in act_idx]
    got = _shared(ctx, lazies)
    flats = [f for f, _, _ in got]
    wires = [lax.stop_gradient(w) for _, w, _ in got]
    pieces = [p for _, _, p in got]
    # The shared gather reduces with the leaf's residuals; a use (reduced per use) without.
    states = [dataclasses.replace(g.state(leaf), residuals=()) for leaf in leaves]
    per_use = [leaf in ctx.per_use for leaf in leaves]
    flats = [lax.stop_gradient(f) if u else f for f, u in zip(flats, per_use, strict=True)]
    own = [
        blocks.piece(lz.shard, g.layout(lz.leaf)) if u else None
        for lz, u in zip(lazies, per_use, strict=True)
    ]
    # Each reduction of a leaf reduced per use draws its own stochastic-rounding noise.
    nth = [ctx.reductions.get(leaf, 0) for leaf in leaves]
    ctx.reductions.update(
        {leaf: n + 1 for leaf, n, u in zip(leaves, nth, per_use, strict=True) if u}
    )

    run_eqn = _runner(eqn, act_idx, lazy_idx)

    def full(flat):
        return [_full_weight(g, lz, f) for lz, f in zip(lazies, flat, strict=True)]

    keep = use_vjp.keeps_residuals(run_eqn, acts, [lz.aval for lz in lazies], _shard_bytes(lazies))

    @jax.custom_vjp
    def use(own, flats, acts, wires, pieces, states):
        return run_eqn(acts, full(flats))

    def use_fwd(own, flats, acts, wires, pieces, states):
        if not keep:
            return run_eqn(acts, full(flats)), (acts, wires, pieces, states, None)
        out, vjp = use_vjp.forward(run_eqn, acts, full(flats))
        return out, (acts, wires, pieces, states, vjp)

    def use_bwd(saved, cts):
        acts, wires, pieces, states, vjp = saved
        pieces, wires = dataflow.tie_after((acts, cts), (pieces, wires), barrier=g.barrier_ties)
        again = [
            g.gather(leaf, p, w, s, True)
            for leaf, p, w, s in zip(leaves, pieces, wires, states, strict=True)
        ]
        d_acts, d_flat = _pull(run_eqn, full, vjp, acts, again, cts)
        zero = functools.partial(jax.tree_util.tree_map, dataflow.zero_cotangent)
        d_own = [
            g.reduce([leaf], [dw], [s], jnp.int32(n))[0][0] if u else None
            for leaf, dw, s, n, u in zip(leaves, d_flat, states, nth, per_use, strict=True)
        ]
        d_shared = [zero(dw) if u else dw for dw, u in zip(d_flat, per_use, strict=True)]
        return d_own, d_shared, list(d_acts), zero(wires), zero(pieces), zero(states)

    use.defvjp(use_fwd, use_bwd)
    return use(own, flats, acts, wires, pieces, states)


# ----------------------------------------------------------------------------- scans


def _place_scan(
    eqn: jaxpr_compat.JaxprEqn, scan: jaxpr_compat.Scan, invals: list[Any], ctx: Context
) -> list[Any] | None:
    """A scan whose `xs` hold stacked lazy weights, rebuilt to gather one layer per
    iteration; None when this scan cannot be rebuilt so (the caller gathers whole).

    The weights may reach the scan through layout-only equations that keep their layer
    axis whole (see `layer_view`): a transpose or `moveaxis` (a scan over any axis), a
    reshape, a slice, a reversal, a cast. A leaf whose layer axis is not its axis 0 is
    re-laid out first (`relayout`: one all-to-all of its shard per step). A reversed scan
    runs as a forward one over reversed `xs`, its `ys` reversed back.
    """
    g = ctx.gathers
    nk, length = scan.num_carry, scan.length
    consts, init, xs = scan.split(invals)
    if any(isinstance(x, Lazy) for x in init):
        return None
    lazy_consts = [k for k, x in enumerate(consts) if isinstance(x, Lazy)]
    if lazy_consts:
        rewritten = indexed_scan.over_layers(eqn, scan, invals, lazy_consts)
        if rewritten is None:
            return None
        eqn, invals, layers = rewritten
        n = len(invals) - len(layers)
        for k, (start, step) in enumerate(layers):
            invals[n + k] = lazy.layers_read(invals[n + k], start, step, length)
        return _place_scan(eqn, jaxpr_compat.scan_of(eqn), invals, ctx)
    if scan.reverse:
        xs = [lazy.reverse(x) for x in xs]
    matrices, views, vectors = [], [], []
    for i, x in enumerate(xs):
        if not isinstance(x, Lazy):
            continue
        lo = g.layout(x.leaf)
        view = layer_view.layer_view(lo.shape, x.chain)
        if view is None or ctx.uses.get(x.leaf, 1) > 1:
            return None
        moved = view.axis != 0 or not lo.stacked
        if len(lo.shape) < 3:
            # Per-layer vectors (biases, norm scales) are small: gathered whole, before the
            # loop, together below (their gradients share a reduction).
            vectors.append(i)
        elif moved and not relayout.can_relayout(lo, view.axis):
            tail = "a leaf split over two axes" if lo.two_axis else "the axis it is stored split on"
            where = f"by a scan over its axis {view.axis}, {tail}"
            xs = _materialized(ctx, xs, [i], where)
        elif moved and (lo.tensor_parallel or g.state(x.leaf).residuals):
            # Re-laid out, a layer's residuals would need the same all-to-all, both ways.
            return None
        elif g.state(x.leaf).residuals and sorted(view.layers(length)) != list(range(lo.shape[0])):
            # Every layer's residual is sent once per step, also for a layer the scan skips.
            return None
        else:
            matrices.append(i)
            views.append(view)
    xs = _materialized(ctx, xs, vectors, None)
    if not matrices:
        forward = jaxpr_compat.rebuilt_scan(eqn, reverse=False)
        outs = jaxpr_compat.bind(forward, [*consts, *init, *xs])
        return _unreversed(outs, nk) if scan.reverse else outs
    plain_pos = [i for i in range(len(xs)) if i not in matrices]
    tie = dataflow.first_array(init) if ctx.tie is None or not ctx.prefetch else ctx.tie
    first = dataflow.first_array(init)
    ctx.tie = ctx.tie if first is None else first
    layouts, stacks, stored, states = [], [], [], []
    for i, view in zip(matrices, views, strict=True):
        lz, lo = xs[i], g.layout(xs[i].leaf)
        stack = lz.shard
        states.append(g.state(lz.leaf))
        if view.axis != 0 or not lo.stacked:
            stack = relayout.layers_to_front(stack, lo, view.axis)
            states[-1] = states[-1].relaid(view.axis)
            lo = relayout.layout(lo, view.axis, g.num_devices)
        layers = view.layers(length)
        if layers != list(range(lo.shape[0])):
            stack = stack[np.asarray(layers)]
        stored.append(None if layers == list(range(length)) else tuple(layers))
        layouts.append(lo)
        stacks.append(stack)
    loop = layered_scan.Loop(
        gathers=g,
        leaves=tuple(xs[i].leaf for i in matrices),
        layouts=tuple(layouts),
        chains=tuple(v.chain for v in views),
        body=scan.body,
        num_carry=nk,
        length=length,
        lazy_pos=tuple(matrices),
        plain_pos=tuple(plain_pos),
        lookahead=1 if ctx.prefetch else 0,
        stored_layers=tuple(stored),
    )
    outs = layered_scan.run(
        loop,
        stacks,
        list(consts),
        list(init),
        [xs[i] for i in plain_pos],
        states,
        tie,
    )
    return _unreversed(outs, nk) if scan.reverse else outs


def _unreversed(outs: list[Any], num_carry: int) -> list[Any]:
    """A forward scan's outputs over reversed `xs` -> the reversed scan's."""
    return outs[:num_carry] + [lax.rev(y, (0,)) for y in outs[num_carry:]]


# ----------------------------------------------------------------------------- entry


def run_placed(
    model: Callable[..., Any],
    weights: Sequence[Any],
    shards: Sequence[jax.Array],
    others: Any,
    gathers: dataflow.Gathers,
    prefetch: bool,
    per_use: frozenset[int] = frozenset(),
) -> Any:
    """`model(weights, *others)` with every sharded weight gathered where it is used.

    Runs inside `jax.shard_map`. Traces `model` once with `weights` (an abstract value of
    the full weight, per-device view, for each sharded leaf; the value itself for the
    others), then evaluates the program with each sharded weight as a `Lazy` of its stored
    shard.

    Args:
      model: `(weights, *others) -> any pytree`.
      weights: per parameter leaf, an abstract full weight (sharded leaves) or a value.
      shards: per parameter leaf, the per-device stored shard (used for sharded leaves).
      others: a tuple of the model's other inputs (pytrees of arrays).
      gathers: how each sharded leaf is gathered and reduced.
      prefetch: gather each weight one use (one layer) ahead.
      per_use: the leaves that, read by several equations, reduce each use's gradient as
        it is made, instead of the sum of all uses' once (`choices.per_use_leaves`).

    Returns:
      The model's output pytree.
    """
    jaxpr_compat.check_supported()
    sharded = [i for i in range(len(weights)) if not _is_value(weights[i])]
    closed, out_shape = jax.make_jaxpr(lambda w, o: model(w, *o), return_shape=True)(
        list(weights), tuple(others)
    )
    flat_others = jax.tree_util.tree_leaves(tuple(others))
    args: list[Any] = []
    for i, w in enumerate(weights):
        if i in sharded:
            args.append(Lazy(i, shards[i], w))
        else:
            args.append(w)
    args.extend(flat_others)
    lazy_leaves = {closed.jaxpr.invars[i]: i for i in sharded}
    ctx = Context(gathers, prefetch, count_uses(closed.jaxpr, lazy_leaves), per_use)
    outs = evaluate(closed.jaxpr, closed.consts, args, ctx)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)


def _is_value(x: Any) -> bool:
    return not isinstance(x, jaxpr_compat.ShapedArray)
