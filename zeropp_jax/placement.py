"""Gathering each sharded weight where the model reads it: trace the model, then place.

Inside the shard_map island, the model's apply is traced once with full-size abstract
weights into a jaxpr, which `evaluate` then runs with each sharded weight as a `Lazy`
value (its per-device shard, not yet gathered):

- an equation that reads a lazy weight runs inside `_at_use`, a custom VJP that gathers the
  weight just before the equation and drops it after; its backward re-gathers it (hpZ: from
  the saved secondary shard, over `local` only), takes the equation's VJP and reduces the
  weight's gradient (qgZ). Only the equation's other inputs are saved, never the weight;
- a `scan` whose `xs` hold a stacked weight (`nn.scan`, `nnx.scan`, `lax.scan` over a
  `(layers, ...)` leaf) runs as `_layered_scan`: each iteration gathers its own layer
  (layer i+1 is gathered while layer i computes), and the backward loop, owned by a custom
  VJP, re-gathers layer i, takes the VJP of the loop body at the carry that entered it and
  reduces layer i's gradient inside the iteration;
- layout-only equations (`reshape`, `transpose`, `convert_element_type`, ...) of a lazy
  weight stay lazy; `jit` calls are inlined; a user's `jax.checkpoint` block is evaluated
  under `jax.checkpoint` with the same policy (plus the secondary shard saved);
- a weight read more than once (a tied embedding) is gathered whole once, at its first use,
  under `jax.checkpoint` that saves only its secondary shard;
- a weight read inside a `cond` or `while`, or by a scan this module does not rebuild (a
  reversed scan, a weight among its constants or carry, a layer axis other than 0), is
  gathered whole at that point, with a warning naming the leaf.

Order comes from data dependencies, not from the scheduler: `_barrier` ties each gather's
input shard to an activation (the previous weight use's input, so the gather
runs one use ahead; in the backward, the cotangent reaching that use).

Shapes: a `Lazy` holds the per-device stored shard (see `partition`); the collectives see
it flattened as the device's piece.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import ad_checkpoint, core, source_info_util
from jax._src.lax.control_flow import cond_p, scan_p, while_p
from jax._src.pjit import jit_p

from zeropp_jax import partition as part

CHAIN_PRIMITIVES = frozenset(
    {
        "convert_element_type",
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "pcast",
        "copy",
        "copy_p",
    }
)
"""Equations of one lazy weight (and literals) that only move or cast it: they stay lazy."""

WHOLE_SCOPE = "zeropp_whole_gather"
"""Named scope of every gather of a whole leaf that the engine could not place per use."""


class Gathers(Protocol):
    """What the island tells the interpreter about each sharded leaf (by leaf index).

    `fixed(leaf)` (stochastic-rounding key, weight-delta reference) and `residuals(leaf)`
    (error feedback) are traced values of the island; the interpreter passes them back
    explicitly, so the methods below read nothing traced from the object itself.
    """

    num_devices: int
    layered: bool

    def layout(self, leaf: int) -> part.LeafLayout: ...
    def name(self, leaf: int) -> str: ...
    def fixed(self, leaf: int) -> Any: ...
    def residuals(self, leaf: int) -> Any: ...
    def wire(self, leaf: int, piece: jax.Array, fixed: Any) -> tuple[jax.Array, ...]: ...
    def gather(
        self, leaf: int, piece: jax.Array, wire: tuple[jax.Array, ...], fixed: Any, alternate: bool
    ) -> jax.Array: ...
    def reduce(
        self, leaf: int, g: jax.Array, fixed: Any, residuals: Any, layer: jax.Array | None
    ) -> tuple[jax.Array, Any]: ...
    def whole(self, leaf: int, piece: jax.Array, fixed: Any, residuals: Any) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class Lazy:
    """A sharded weight not gathered yet.

    Attributes:
      leaf: parameter leaf index.
      shard: the per-device stored shard (`(lead, C / N)` or `(C / N,)`).
      aval: the abstract value this stands for (after `chain`).
      chain: layout-only equations `(primitive, params)` to apply after gathering.
    """

    leaf: int
    shard: jax.Array
    aval: Any
    chain: tuple[tuple[Any, dict[str, Any]], ...] = ()


@dataclasses.dataclass
class Context:
    """Interpreter state shared across one evaluation."""

    gathers: Gathers
    prefetch: bool
    uses: dict[int, int]
    whole_cache: dict[int, jax.Array] = dataclasses.field(default_factory=dict)
    tie: Any = None
    warned: set[tuple[int, str]] = dataclasses.field(default_factory=set)


# ----------------------------------------------------------------------------- helpers


def _barrier(tie: Any, x: Any) -> Any:
    """`x`, computed from `tie`: a data dependency that makes every array of `x` wait for
    the array `tie` (None: `x` as it is).

    XLA's CPU pipeline removes `lax.optimization_barrier` before scheduling, so the tie is
    a real one: `-0.0` derived from one element of `tie` (also when it is NaN or
    infinite), cast to each array's dtype and added to it. `v + -0.0 == v` for every float
    `v` (signed zeros and NaN included) and `v + 0 == v` for integers, so values are
    unchanged to the bit; the cost is one pass over `x`, a piece or a secondary shard.
    """
    leaves = [v for v in jax.tree_util.tree_leaves(tie) if _is_inexact(v) and v.size]
    if not leaves:
        return x
    first = jnp.ravel(leaves[0])[0].astype(jnp.float32)
    zero = jnp.where(first == first, -jnp.minimum(jnp.abs(first), 0.0), -0.0)
    return jax.tree_util.tree_map(lambda v: v + zero.astype(v.dtype), x)


def _apply_chain(x: jax.Array, chain: Sequence[tuple[Any, dict[str, Any]]]) -> jax.Array:
    for prim, params in chain:
        x = prim.bind(x, **params)
    return x


def _bind(eqn: core.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _zero_cotangent(x: Any) -> Any:
    aval = jax.typeof(x)
    if jnp.issubdtype(aval.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return jnp.zeros(aval.shape, jax.dtypes.float0)


def _is_inexact(x: Any) -> bool:
    return jnp.issubdtype(jax.typeof(x).dtype, jnp.inexact)


def _first_array(xs: Sequence[Any]) -> Any:
    return next((x for x in xs if _is_inexact(x)), None)


def _full_weight(g: Gathers, lz: Lazy, flat: jax.Array, layer: bool = False) -> jax.Array:
    return _apply_chain(part.unpiece(flat, g.layout(lz.leaf), g.num_devices, layer), lz.chain)


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


# ----------------------------------------------------------------------------- use counts


def count_uses(jaxpr: core.Jaxpr, lazy_leaves: dict[core.Var, int]) -> dict[int, int]:
    """Per leaf, how many equations read it (layout-only equations and inlined calls
    followed through)."""
    counts: dict[int, int] = {}

    def walk(jx: core.Jaxpr, where: dict[core.Var, int]) -> None:
        for eqn in jx.eqns:
            read = [where[v] for v in eqn.invars if isinstance(v, core.Var) and v in where]
            if not read:
                continue
            name = eqn.primitive.name
            if name in CHAIN_PRIMITIVES and len(read) == 1 and len(eqn.outvars) == 1:
                where[eqn.outvars[0]] = read[0]
                continue
            if eqn.primitive is jit_p or eqn.primitive is core.closed_call_p:
                inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
                sub = {
                    iv: where[v]
                    for iv, v in zip(inner.jaxpr.invars, eqn.invars, strict=True)
                    if isinstance(v, core.Var) and v in where
                }
                walk(inner.jaxpr, sub)
                continue
            for leaf in set(read):
                counts[leaf] = counts.get(leaf, 0) + 1

    walk(jaxpr, dict(lazy_leaves))
    return counts


# ----------------------------------------------------------------------------- evaluation


def evaluate(jaxpr: core.Jaxpr, consts: Sequence[Any], args: Sequence[Any], ctx: Context) -> list:
    """Runs `jaxpr` on `args`, some of which are `Lazy` weights; returns its outputs."""
    env: dict[core.Var, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, core.Literal) else env[v]

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
    return [_materialize(ctx, x, "as a model output") if isinstance(x, Lazy) else x for x in outs]


def _eval_eqn(eqn: core.JaxprEqn, invals: list[Any], ctx: Context) -> list[Any]:
    lazy_idx = [i for i, x in enumerate(invals) if isinstance(x, Lazy)]
    if not lazy_idx:
        return _bind(eqn, invals)
    prim = eqn.primitive
    if prim.name in CHAIN_PRIMITIVES and len(lazy_idx) == 1 and len(eqn.outvars) == 1:
        lz = invals[lazy_idx[0]]
        others = [x for i, x in enumerate(invals) if i != lazy_idx[0]]
        if not others:
            params = prim.get_bind_params(eqn.params)
            return [
                dataclasses.replace(lz, aval=eqn.outvars[0].aval, chain=(*lz.chain, (prim, params)))
            ]
    if prim is jit_p or prim is core.closed_call_p:
        inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        return evaluate(inner.jaxpr, inner.consts, invals, ctx)
    if prim is ad_checkpoint.remat_p:
        return _checkpointed(eqn, invals, ctx)
    if prim is scan_p:
        out = _place_scan(eqn, invals, ctx)
        if out is not None:
            return out
        where = "by a lax.scan the engine does not rebuild per layer"
        for i in lazy_idx:
            invals[i] = _materialize(ctx, invals[i], where)
        return _bind(eqn, invals)
    if prim in (cond_p, while_p):
        for i in lazy_idx:
            invals[i] = _materialize(ctx, invals[i], f"inside a `{prim.name}`")
        return _bind(eqn, invals)
    # A weight read by more than one equation is gathered once, whole.
    for i in lazy_idx:
        if ctx.uses.get(invals[i].leaf, 1) > 1:
            invals[i] = _materialize(ctx, invals[i], None)
    lazy_idx = [i for i, x in enumerate(invals) if isinstance(x, Lazy)]
    if not lazy_idx:
        return _bind(eqn, invals)
    return _at_use(eqn, invals, lazy_idx, ctx)


def _materialize(ctx: Context, lz: Lazy, where: str | None) -> jax.Array:
    """The whole gathered weight of `lz` (cached per leaf); warns unless `where` is None."""
    g = ctx.gathers
    if where is not None:
        _warn(ctx, lz.leaf, where)
    if lz.leaf not in ctx.whole_cache:
        piece = lz.shard.reshape(-1)
        fixed, res = g.fixed(lz.leaf), g.residuals(lz.leaf)
        policy = jax.checkpoint_policies.save_only_these_names(*_saved_names())

        def gather(piece, fixed, res):
            with jax.named_scope(WHOLE_SCOPE):
                return g.whole(lz.leaf, piece, fixed, res)

        flat = jax.checkpoint(gather, policy=policy)(_barrier(ctx.tie, piece), fixed, res)
        ctx.whole_cache[lz.leaf] = part.unpiece(flat, g.layout(lz.leaf), g.num_devices)
    return _apply_chain(ctx.whole_cache[lz.leaf], lz.chain)


def _saved_names() -> tuple[str, ...]:
    from zeropp_jax.weight_gather import SECONDARY_NAME

    return (SECONDARY_NAME,)


def _checkpointed(eqn: core.JaxprEqn, invals: list[Any], ctx: Context) -> list[Any]:
    """A user's `jax.checkpoint` block, evaluated under `jax.checkpoint` with its policy
    plus the secondary shards saved (so its recompute never crosses nodes)."""
    inner = eqn.params["jaxpr"]
    lazy_idx = [i for i, x in enumerate(invals) if isinstance(x, Lazy)]
    shards = [invals[i].shard for i in lazy_idx]
    others = [x for i, x in enumerate(invals) if i not in lazy_idx]
    names = jax.checkpoint_policies.save_only_these_names(*_saved_names())
    user = eqn.params.get("policy")
    policy = names if user is None else jax.checkpoint_policies.save_from_both_policies(user, names)

    def block(shards, others):
        it_s, it_o = iter(shards), iter(others)
        args = [
            dataclasses.replace(x, shard=next(it_s)) if isinstance(x, Lazy) else next(it_o)
            for x in invals
        ]
        sub = Context(ctx.gathers, ctx.prefetch, ctx.uses, {}, None, ctx.warned)
        consts = inner.consts if hasattr(inner, "consts") else ()
        jx = inner.jaxpr if hasattr(inner, "jaxpr") else inner
        return evaluate(jx, consts, args, sub)

    return jax.checkpoint(block, policy=policy, prevent_cse=eqn.params.get("prevent_cse", True))(
        shards, others
    )


# ----------------------------------------------------------------------------- one use


def _at_use(eqn: core.JaxprEqn, invals: list[Any], lazy_idx: list[int], ctx: Context) -> list:
    """Runs one equation that reads lazy weights, gathering them for it alone."""
    g = ctx.gathers
    lazies = [invals[i] for i in lazy_idx]
    act_idx = [i for i in range(len(invals)) if i not in lazy_idx]
    acts = [invals[i] for i in act_idx]
    leaves = [lz.leaf for lz in lazies]
    own_tie = _first_array(acts)
    tie = ctx.tie if (ctx.prefetch and ctx.tie is not None) else own_tie
    ctx.tie = own_tie if own_tie is not None else ctx.tie

    def run_eqn(acts: Sequence[Any], weights: Sequence[jax.Array]) -> list[Any]:
        merged: list[Any] = [None] * len(invals)
        for i, a in zip(act_idx, acts, strict=True):
            merged[i] = a
        for i, w in zip(lazy_idx, weights, strict=True):
            merged[i] = w
        return _bind(eqn, merged)

    def flats(pieces, wires, fixed, alternate):
        return [
            g.gather(leaf, p, w, f, alternate)
            for leaf, p, w, f in zip(leaves, pieces, wires, fixed, strict=True)
        ]

    def run_flat(acts, flat):
        return run_eqn(acts, [_full_weight(g, lz, f) for lz, f in zip(lazies, flat, strict=True)])

    def forward(pieces, acts, fixed, tie):
        pieces = _barrier(tie, pieces)
        wires = [g.wire(leaf, p, f) for leaf, p, f in zip(leaves, pieces, fixed, strict=True)]
        return run_flat(acts, flats(pieces, wires, fixed, False)), (pieces, wires)

    @jax.custom_vjp
    def use(pieces, res, acts, fixed, tie):
        return forward(pieces, acts, fixed, tie)[0]

    def use_fwd(pieces, res, acts, fixed, tie):
        out, (pieces, wires) = forward(pieces, acts, fixed, tie)
        return out, (pieces, wires, res, acts, fixed, tie)

    def use_bwd(saved, cts):
        pieces, wires, res, acts, fixed, tie = saved
        pieces, wires = _barrier(cts, (pieces, wires))
        _, pull = jax.vjp(run_flat, acts, flats(pieces, wires, fixed, True))
        d_acts, d_flat = pull(cts)
        d_pieces, d_res = [], []
        for leaf, dw, f, r in zip(leaves, d_flat, fixed, res, strict=True):
            dp, nr = g.reduce(leaf, dw, f, r, None)
            d_pieces.append(dp)
            d_res.append(nr)
        d_tie = None if tie is None else _zero_cotangent(tie)
        fixed_ct = jax.tree_util.tree_map(_zero_cotangent, fixed)
        return d_pieces, d_res, list(d_acts), fixed_ct, d_tie

    use.defvjp(use_fwd, use_bwd)
    pieces = [lz.shard.reshape(-1) for lz in lazies]
    res = [g.residuals(leaf) for leaf in leaves]
    fixed = [g.fixed(leaf) for leaf in leaves]
    return use(pieces, res, acts, fixed, tie)


# ----------------------------------------------------------------------------- scans


def _place_scan(eqn: core.JaxprEqn, invals: list[Any], ctx: Context) -> list[Any] | None:
    """A scan whose `xs` hold stacked lazy weights, rebuilt to gather one layer per
    iteration; None when this scan cannot be rebuilt so (the caller gathers whole)."""
    g = ctx.gathers
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    if p["reverse"] or not g.layered:
        return None
    if any(isinstance(x, Lazy) for x in (*consts, *init)):
        return None
    lazy_pos = [i for i, x in enumerate(xs) if isinstance(x, Lazy)]
    for i in lazy_pos:
        lz = xs[i]
        lo = g.layout(lz.leaf)
        if not lo.stacked or lo.lead != p["length"] or lz.shard.ndim != 2:
            return None
        if any(prim.name != "convert_element_type" for prim, _ in lz.chain):
            return None
    if ctx.uses.get(xs[lazy_pos[0]].leaf, 1) > 1:
        return None
    lazies = [xs[i] for i in lazy_pos]
    plain_pos = [i for i in range(len(xs)) if i not in lazy_pos]
    plain = [xs[i] for i in plain_pos]
    body = p["jaxpr"]
    length = p["length"]
    tie = _first_array(init) if ctx.tie is None or not ctx.prefetch else ctx.tie
    first = _first_array(init)
    ctx.tie = ctx.tie if first is None else first
    outs = _layered_scan(
        g,
        lazies,
        body,
        nk,
        length,
        lazy_pos,
        plain_pos,
        ctx.prefetch,
        [lz.shard for lz in lazies],
        list(consts),
        list(init),
        plain,
        [g.fixed(lz.leaf) for lz in lazies],
        tie,
    )
    return outs


def _layered_scan(
    g: Gathers,
    lazies: list[Lazy],
    body: core.ClosedJaxpr,
    num_carry: int,
    length: int,
    lazy_pos: list[int],
    plain_pos: list[int],
    prefetch: bool,
    shards: list[jax.Array],
    consts: list[Any],
    init: list[Any],
    plain: list[Any],
    fixed: list[Any],
    tie: Any,
) -> list[Any]:
    """The scan, one layer gathered per iteration, with its backward loop owned here.

    `shards` are per device `(layers, C / N)`; every other argument is as the scan had it.
    With `prefetch`, layer 0 is gathered before the loop and iteration i gathers layer
    i + 1 (issued once layer i's input carry exists, before layer i's compute); the last
    layer runs after the loop, so no gather is wasted. The backward loop re-gathers layer
    i's matrices once the cotangent reaching it exists (its vectors are kept from the
    forward), recomputes the layer from the carry that entered it, and reduces the layer's
    gradients inside the iteration. Returns the scan's outputs (final carry, then
    stacked `ys`).
    """
    leaves = [lz.leaf for lz in lazies]
    n_xs = len(lazy_pos) + len(plain_pos)
    # A layer's vectors (biases, norm scales) are kept gathered for the backward loop, as
    # one-device training keeps them: re-gathering them costs a collective per vector for
    # a few values each. Matrices are re-gathered from their secondary shard (hpZ).
    small = [len(g.layout(leaf).shape) == 2 for leaf in leaves]

    def kept(flats, wires):
        return [f if keep else w for f, w, keep in zip(flats, wires, small, strict=True)]

    def step(consts, carry, x_plain, flats):
        weights = [
            _apply_chain(part.unpiece(f, g.layout(lz.leaf), g.num_devices, True), lz.chain)
            for lz, f in zip(lazies, flats, strict=True)
        ]
        xs_i: list[Any] = [None] * n_xs
        for i, x in zip(plain_pos, x_plain, strict=True):
            xs_i[i] = x
        for i, w in zip(lazy_pos, weights, strict=True):
            xs_i[i] = w
        out = core.eval_jaxpr(body.jaxpr, body.consts, *consts, *carry, *xs_i)
        return list(out[:num_carry]), list(out[num_carry:])

    def gathered(pieces, fixed, tie, alternate=False):
        pieces = _barrier(tie, pieces)
        wires = [g.wire(leaf, p, f) for leaf, p, f in zip(leaves, pieces, fixed, strict=True)]
        flats = [
            g.gather(leaf, p, w, f, alternate)
            for leaf, p, w, f in zip(leaves, pieces, wires, fixed, strict=True)
        ]
        return flats, wires

    def forward(shards, consts, init, plain, fixed, tie, save):
        """Returns `(carry, ys, saved)`; `saved` (with `save`) holds, per layer, the carry
        that entered it and its wires: `(stacked, last)`, `last` None without prefetch."""
        if not prefetch:

            def iteration(c, x):
                x_plain, pieces = x
                flats, wires = gathered(pieces, fixed, _first_array(c))
                new_c, y = step(consts, c, x_plain, flats)
                return new_c, (y, (c, kept(flats, wires)) if save else ())

            c, (ys, saved) = lax.scan(iteration, init, (plain, shards))
            return c, ys, (saved, None)

        def iteration(carry, x):
            c, flats, wires = carry
            x_plain, next_pieces = x
            next_flats, next_wires = gathered(next_pieces, fixed, _first_array(c))
            new_c, y = step(consts, c, x_plain, flats)
            return (new_c, next_flats, next_wires), (y, (c, kept(flats, wires)) if save else ())

        flats, wires = gathered([s[0] for s in shards], fixed, tie)
        carry = (init, flats, wires)
        ys = saved = None
        if length > 1:
            head = ([x[:-1] for x in plain], [s[1:] for s in shards])
            carry, (ys, saved) = lax.scan(iteration, carry, head)
        c, flats, wires = carry
        last_c, last_y = step(consts, c, [x[-1] for x in plain], flats)
        ys = _append(ys, last_y)
        return last_c, ys, (saved if save else (), (c, kept(flats, wires)) if save else ())

    def vjp_layer(consts, c_in, x_plain, flats, g_c, g_y):
        """Cotangents of one layer: carry, plain xs, gathered flats, inexact consts."""
        ci = [k for k, x in enumerate(consts) if _is_inexact(x)]
        xi = [k for k, x in enumerate(x_plain) if _is_inexact(x)]

        def f(c, flats, cs, xs):
            full_c, full_x = list(consts), list(x_plain)
            for k, v in zip(ci, cs, strict=True):
                full_c[k] = v
            for k, v in zip(xi, xs, strict=True):
                full_x[k] = v
            return step(full_c, c, full_x, flats)

        _, pull = jax.vjp(f, c_in, flats, [consts[k] for k in ci], [x_plain[k] for k in xi])
        dc, d_flats, dcs, dxs = pull((g_c, g_y))
        d_plain = [_zero_cotangent(x) for x in x_plain]
        for k, v in zip(xi, dxs, strict=True):
            d_plain[k] = v
        return dc, d_flats, dcs, d_plain

    def backward_layer(consts, fixed, g_c, g_cs, i, c_in, x_plain, wires, pieces, g_y):
        wires, pieces = _barrier(g_c, (wires, pieces))
        flats = [
            w if keep else g.gather(leaf, p, w, f, True)
            for leaf, p, w, f, keep in zip(leaves, pieces, wires, fixed, small, strict=True)
        ]
        dc, d_flats, dcs, d_plain = vjp_layer(consts, c_in, x_plain, flats, g_c, g_y)
        d_pieces = [
            g.reduce(leaf, d, f, None, i)[0]
            for leaf, d, f in zip(leaves, d_flats, fixed, strict=True)
        ]
        g_cs = [a + b for a, b in zip(g_cs, dcs, strict=True)]
        return dc, g_cs, d_plain, d_pieces

    def backward(shards, consts, plain, fixed, saved, g_carry, g_ys):
        stacked, last = saved
        g_cs = [jnp.zeros_like(x) for x in consts if _is_inexact(x)]
        g_c = g_carry
        tail = None
        n_loop = length
        if last is not None:
            n_loop = length - 1
            c_in, wires = last
            k = length - 1
            g_c, g_cs, d_plain_last, d_pieces_last = backward_layer(
                consts,
                fixed,
                g_c,
                g_cs,
                jnp.asarray(k),
                c_in,
                [x[k] for x in plain],
                wires,
                [s[k] for s in shards],
                [y[k] for y in g_ys],
            )
            tail = (d_plain_last, d_pieces_last)
        d_plain = d_pieces = None
        if n_loop:

            def iteration(carry, x):
                g_c, g_cs = carry
                i, (c_in, wires), x_plain, pieces, g_y = x
                g_c, g_cs, dp, dpieces = backward_layer(
                    consts, fixed, g_c, g_cs, i, c_in, x_plain, wires, pieces, g_y
                )
                return (g_c, g_cs), (dp, dpieces)

            xs = (
                jnp.arange(n_loop),
                stacked,
                [x[:n_loop] for x in plain],
                [s[:n_loop] for s in shards],
                [y[:n_loop] for y in g_ys],
            )
            (g_c, g_cs), (d_plain, d_pieces) = lax.scan(iteration, (g_c, g_cs), xs, reverse=True)
        if tail is not None:
            d_plain = _append(d_plain, tail[0])
            d_pieces = _append(d_pieces, tail[1])
        d_consts = [_zero_cotangent(x) for x in consts]
        it = iter(g_cs)
        for k, x in enumerate(consts):
            if _is_inexact(x):
                d_consts[k] = next(it)
        return d_pieces, d_consts, g_c, d_plain

    @jax.custom_vjp
    def run(shards, consts, init, plain, fixed, tie):
        c, ys, _ = forward(shards, consts, init, plain, fixed, tie, False)
        return c, ys

    def run_fwd(shards, consts, init, plain, fixed, tie):
        c, ys, saved = forward(shards, consts, init, plain, fixed, tie, True)
        return (c, ys), (shards, consts, plain, fixed, saved, tie)

    def run_bwd(res, cts):
        shards, consts, plain, fixed, saved, tie = res
        g_carry, g_ys = cts
        d_shards, d_consts, d_init, d_plain = backward(
            shards, consts, plain, fixed, saved, g_carry, g_ys
        )
        return (
            d_shards,
            d_consts,
            d_init,
            d_plain,
            jax.tree_util.tree_map(_zero_cotangent, fixed),
            None if tie is None else _zero_cotangent(tie),
        )

    run.defvjp(run_fwd, run_bwd)
    c, ys = run(shards, consts, init, plain, fixed, tie)
    return [*c, *ys]


def _append(stacked: Any, last: Any) -> Any:
    """`stacked` (leading axis = iterations, or None for none) with `last` appended."""
    if stacked is None:
        return jax.tree_util.tree_map(lambda x: x[None], last)
    return jax.tree_util.tree_map(lambda s, x: jnp.concatenate([s, x[None]], axis=0), stacked, last)


# ----------------------------------------------------------------------------- entry


def run_placed(
    model: Callable[..., Any],
    weights: Sequence[Any],
    shards: Sequence[jax.Array],
    others: Any,
    gathers: Gathers,
    prefetch: bool,
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

    Returns:
      The model's output pytree.
    """
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
    ctx = Context(gathers, prefetch, count_uses(closed.jaxpr, lazy_leaves))
    outs = evaluate(closed.jaxpr, closed.consts, args, ctx)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)


def _is_value(x: Any) -> bool:
    return not isinstance(x, core.ShapedArray)
