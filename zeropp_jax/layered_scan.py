"""A scan over stacked weights, rebuilt so that each iteration gathers its own layer.

`layered_scan` runs inside the shard_map island (see `placement`): layer i + 1 is gathered
while layer i computes, and the backward loop, owned by a custom VJP, re-gathers layer i,
takes the VJP of the loop body at the carry that entered it and reduces layer i's
gradients inside the iteration. Shapes are per device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core

from zeropp_jax import dataflow


def layered_scan(
    g: dataflow.Gathers,
    lazies: list[Any],
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
    # Slices of fewer dimensions than a matrix are kept gathered for the backward loop (a
    # collective per vector for a few values each otherwise). Matrices are re-gathered
    # from their secondary shard (hpZ).
    small = [len(g.layout(leaf).shape) <= 2 for leaf in leaves]

    def kept(flats, wires):
        return [f if keep else w for f, w, keep in zip(flats, wires, small, strict=True)]

    def step(consts, carry, x_plain, flats):
        weights = [
            dataflow.apply_chain(dataflow.unpiece_layer(g, lz.leaf, f), lz.chain)
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
        pieces = dataflow.tie(tie, pieces)
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
                flats, wires = gathered(pieces, fixed, dataflow.first_array(c))
                new_c, y = step(consts, c, x_plain, flats)
                return new_c, (y, (c, kept(flats, wires)) if save else ())

            c, (ys, saved) = lax.scan(iteration, init, (plain, shards))
            return c, ys, (saved, None)

        def iteration(carry, x):
            c, flats, wires = carry
            x_plain, next_pieces = x
            next_flats, next_wires = gathered(next_pieces, fixed, dataflow.first_array(c))
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
        ci = [k for k, x in enumerate(consts) if dataflow.is_inexact(x)]
        xi = [k for k, x in enumerate(x_plain) if dataflow.is_inexact(x)]

        def f(c, flats, cs, xs):
            full_c, full_x = list(consts), list(x_plain)
            for k, v in zip(ci, cs, strict=True):
                full_c[k] = v
            for k, v in zip(xi, xs, strict=True):
                full_x[k] = v
            return step(full_c, c, full_x, flats)

        _, pull = jax.vjp(f, c_in, flats, [consts[k] for k in ci], [x_plain[k] for k in xi])
        dc, d_flats, dcs, dxs = pull((g_c, g_y))
        d_plain = [dataflow.zero_cotangent(x) for x in x_plain]
        for k, v in zip(xi, dxs, strict=True):
            d_plain[k] = v
        return dc, d_flats, dcs, d_plain

    def backward_layer(consts, fixed, g_c, g_cs, i, c_in, x_plain, wires, pieces, g_y):
        wires, pieces = dataflow.tie(g_c, (wires, pieces))
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
        g_cs = [jnp.zeros_like(x) for x in consts if dataflow.is_inexact(x)]
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
        d_consts = [dataflow.zero_cotangent(x) for x in consts]
        it = iter(g_cs)
        for k, x in enumerate(consts):
            if dataflow.is_inexact(x):
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
            jax.tree_util.tree_map(dataflow.zero_cotangent, fixed),
            None if tie is None else dataflow.zero_cotangent(tie),
        )

    run.defvjp(run_fwd, run_bwd)
    c, ys = run(shards, consts, init, plain, fixed, tie)
    return [*c, *ys]


def _append(stacked: Any, last: Any) -> Any:
    """`stacked` (leading axis = iterations, or None for none) with `last` appended."""
    if stacked is None:
        return jax.tree_util.tree_map(lambda x: x[None], last)
    return jax.tree_util.tree_map(lambda s, x: jnp.concatenate([s, x[None]], axis=0), stacked, last)
