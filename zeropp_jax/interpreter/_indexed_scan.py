"""A loop that reads stacked weights by its counter, rewritten as a scan over them.

`lax.fori_loop(lo, hi, body, x)` with static bounds is a `scan` whose carry holds the
counter and whose body reads each stacked weight, a constant of the scan, at the counter
(`w[i]`: a `dynamic_slice` of one layer). `over_layers` rewrites such a scan so that those
weights become its `xs`, each iteration receiving the layer it read: what `placement`
gathers per layer. Which layer each iteration reads is computed at trace time from the
counter's start value; it must move by a fixed step.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax

from zeropp_jax.interpreter import _jaxpr_compat as jaxpr_compat
from zeropp_jax.interpreter._jaxpr_compat import Jaxpr, JaxprEqn, Literal, Var


def over_layers(
    eqn: JaxprEqn, scan: jaxpr_compat.Scan, invals: list[Any], lazy_consts: list[int]
) -> tuple[JaxprEqn, list[Any], list[tuple[int, int]]] | None:
    """The scan `eqn` with its constants at `lazy_consts` (stacked weights) moved to its
    `xs`, or None when the body reads them other than by one layer at a counter.

    Args:
      eqn: a `scan` equation.
      scan: what `jaxpr_compat.scan_of` reads of it.
      invals: its operands (constants, initial carry, xs); the initial carry of the
        counter must be a concrete integer.
      lazy_consts: positions among the constants of the stacked weights.

    Returns:
      `(eqn, invals, layers)`: the rewritten scan equation and its operands, in which
      the stacked weights are the last `xs` (the operand itself, to be indexed by the
      caller), and per stacked weight `(start, step)`: iteration k reads layer `start +
      step * k` along its axis 0.
    """
    nc, nk, length = scan.num_consts, scan.num_carry, scan.length
    body = scan.body
    jx = body.jaxpr
    weights = {jx.invars[k]: k for k in lazy_consts}
    reads: dict[Var, list[JaxprEqn]] = {v: [] for v in weights}
    for e in jx.eqns:
        used = [v for v in e.invars if isinstance(v, Var) and v in weights]
        if not used:
            continue
        w = e.invars[0]
        if (
            e.primitive is not lax.dynamic_slice_p
            or w not in weights
            or used != [w]
            or tuple(e.params["slice_sizes"]) != (1, *w.aval.shape[1:])
        ):
            return None
        reads[w].append(e)
    if any(isinstance(v, Var) and v in weights for v in jx.outvars):
        return None
    layers = {}
    for w, es in reads.items():
        seq = _layer_sequence(jx, body.consts, [e.invars[1] for e in es], invals, nc, nk, length)
        if seq is None:
            return None
        seq = np.clip(seq, 0, w.aval.shape[0] - 1)  # as dynamic_slice clamps
        if not (seq == seq[0]).all():
            return None
        steps = set(np.diff(seq[0]).tolist()) or {1}
        if len(steps) != 1 or 0 in steps:
            return None
        layers[w] = (int(seq[0][0]), steps.pop())
    # The new body: the weights' layers as the last inputs, each read broadcast to (1, ...).
    new_vars = {w: jaxpr_compat.new_var(w.aval.update(shape=w.aval.shape[1:])) for w in weights}
    eqns = []
    for e in jx.eqns:
        if e.primitive is lax.dynamic_slice_p and e.invars[0] in weights:
            w = e.invars[0]
            params = dict(
                shape=(1, *w.aval.shape[1:]),
                broadcast_dimensions=tuple(range(1, len(w.aval.shape))),
                sharding=None,
            )
            eqns.append(
                jaxpr_compat.new_eqn(
                    [new_vars[w]], e.outvars, lax.broadcast_in_dim_p, params, like=e
                )
            )
        else:
            eqns.append(e)
    kept = [v for k, v in enumerate(jx.invars[:nc]) if v not in weights]
    invars = [*kept, *jx.invars[nc:], *new_vars.values()]
    new_jx = jaxpr_compat.jaxpr_like(jx, invars, jx.outvars, eqns)
    new_jx = jaxpr_compat.dce(new_jx, [True] * len(jx.outvars), keep_inputs=True)[0]
    new_eqn = jaxpr_compat.rebuilt_scan(
        eqn,
        body=jaxpr_compat.closed(new_jx, body.consts),
        num_consts=nc - len(weights),
        num_xs=scan.num_xs + len(weights),
    )
    consts = [x for k, x in enumerate(invals[:nc]) if k not in lazy_consts]
    order = list(weights.values())
    new_invals = [*consts, *invals[nc:], *(invals[k] for k in order)]
    return new_eqn, new_invals, [layers[jx.invars[k]] for k in order]


def _layer_sequence(
    jx: Jaxpr,
    consts: list[Any],
    indices: list[Any],
    invals: list[Any],
    nc: int,
    nk: int,
    length: int,
) -> np.ndarray | None:
    """Per read (rows) and iteration (columns), the first index of each read, from the
    counter alone; None when an index depends on anything else or the counter's start is
    not concrete."""
    idx_vars = [v for v in indices if isinstance(v, Var)]
    literal = [None if isinstance(v, Var) else int(v.val) for v in indices]
    if not idx_vars:
        return None
    probe = jaxpr_compat.jaxpr_like(jx, jx.invars, idx_vars, jx.eqns)
    idx_jx, used = jaxpr_compat.dce(probe, [True] * len(idx_vars))
    counters = [k for k, u in enumerate(used) if u]
    if len(counters) != 1 or not nc <= counters[0] < nc + nk:
        return None
    j = counters[0]
    start = invals[j]
    if isinstance(start, jaxpr_compat.Tracer) or np.ndim(start) != 0:
        return None
    nxt = jx.outvars[j - nc]
    if not isinstance(nxt, Var):
        return None
    step_jx, step_used = jaxpr_compat.dce(
        jaxpr_compat.jaxpr_like(jx, jx.invars, [nxt], jx.eqns), [True]
    )
    if [k for k, u in enumerate(step_used) if u] != [j]:
        return None
    rows = []
    with jax.ensure_compile_time_eval():
        c = np.asarray(start)
        for _ in range(length):
            vals = iter(int(x) for x in _concrete(idx_jx, consts, c))
            rows.append([next(vals) if lit is None else lit for lit in literal])
            (c,) = _concrete(step_jx, consts, c)
            c = np.asarray(c)
    return np.asarray(rows).T


_VARYING = ("pvary", "pcast")
"""Primitives that only mark a value as varying over manual axes: no-ops on a value."""


def _concrete(jx: Jaxpr, consts: list[Any], *args: Any) -> list[Any]:
    """`jx` evaluated on concrete values (at trace time; varying-axes marks skipped)."""
    env: dict[Var, Any] = dict(zip(jx.constvars, consts, strict=True))
    env.update(zip(jx.invars, args, strict=True))

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for e in jx.eqns:
        ins = [read(v) for v in e.invars]
        if e.primitive.name in _VARYING:
            outs = ins
        else:
            outs = jaxpr_compat.bind_plain(e, ins)
        env.update(zip(e.outvars, outs, strict=True))
    return [read(v) for v in jx.outvars]
