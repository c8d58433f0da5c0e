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

    def regather(kept_i, pieces_i, fixed, after):
        """Layer i's weights for its backward, gathered once `after` exists."""
        kept_i, pieces_i = dataflow.tie(after, (kept_i, pieces_i))
        return [
            w if keep else g.gather(leaf, p, w, f, True)
            for leaf, p, w, f, keep in zip(leaves, pieces_i, kept_i, fixed, small, strict=True)
        ]

    def backward_layer(consts, fixed, g_c, g_cs, i, c_in, x_plain, flats, g_y):
        dc, d_flats, dcs, d_plain = vjp_layer(consts, c_in, x_plain, flats, g_c, g_y)
        d_pieces = [
            g.reduce(leaf, d, f, None, i)[0]
            for leaf, d, f in zip(leaves, d_flats, fixed, strict=True)
        ]
        g_cs = [a + b for a, b in zip(g_cs, dcs, strict=True)]
        return dc, g_cs, d_plain, d_pieces

    def at(tree, i):
        return jax.tree_util.tree_map(lambda a: a[i], tree)

    def between(tree, lo, hi):
        return jax.tree_util.tree_map(lambda a: a[lo:hi], tree)

    def backward(shards, consts, plain, fixed, saved, g_carry, g_ys):
        """Layers in reverse; without prefetch each iteration re-gathers its own layer."""
        stacked, last = saved
        g_cs = [jnp.zeros_like(x) for x in consts if dataflow.is_inexact(x)]
        if last is not None:
            return backward_prefetched(shards, consts, plain, fixed, saved, g_carry, g_ys, g_cs)

        def iteration(carry, x):
            g_c, g_cs = carry
            i, (c_in, kept_i), x_plain, pieces, g_y = x
            flats = regather(kept_i, pieces, fixed, g_c)
            g_c, g_cs, dp, dpieces = backward_layer(
                consts, fixed, g_c, g_cs, i, c_in, x_plain, flats, g_y
            )
            return (g_c, g_cs), (dp, dpieces)

        xs = (jnp.arange(length), stacked, plain, shards, g_ys)
        (g_c, g_cs), (d_plain, d_pieces) = lax.scan(iteration, (g_carry, g_cs), xs, reverse=True)
        return d_pieces, _consts_cotangent(consts, g_cs), g_c, d_plain

    def backward_prefetched(shards, consts, plain, fixed, saved, g_carry, g_ys, g_cs):
        """Layer i - 1 is re-gathered once the cotangent reaching layer i exists, before
        layer i's backward computes; layers L - 1 and 0 run outside the loop."""
        stacked, (c_last, kept_last) = saved
        top = length - 1

        def layer_inputs(i):
            return [x[i] for x in plain], [y[i] for y in g_ys], [s[i] for s in shards]

        x_top, gy_top, pieces_top = layer_inputs(top)
        flats = regather(kept_last, pieces_top, fixed, g_carry)
        if length > 1:
            next_flats = regather(
                at(stacked[1], top - 1), [s[top - 1] for s in shards], fixed, g_carry
            )
        g_c, g_cs, dp_top, dpieces_top = backward_layer(
            consts, fixed, g_carry, g_cs, jnp.asarray(top), c_last, x_top, flats, gy_top
        )
        if length == 1:
            d_plain = _append(None, dp_top)
            d_pieces = _append(None, dpieces_top)
            return d_pieces, _consts_cotangent(consts, g_cs), g_c, d_plain
        flats = next_flats
        d_plain = d_pieces = None
        if length > 2:

            def iteration(carry, x):
                g_c, g_cs, flats = carry
                i, c_in, x_plain, g_y, kept_prev, pieces_prev = x
                prev = regather(kept_prev, pieces_prev, fixed, g_c)
                g_c, g_cs, dp, dpieces = backward_layer(
                    consts, fixed, g_c, g_cs, i, c_in, x_plain, flats, g_y
                )
                return (g_c, g_cs, prev), (dp, dpieces)

            xs = (
                jnp.arange(1, top),
                between(stacked[0], 1, top),
                [x[1:top] for x in plain],
                [y[1:top] for y in g_ys],
                between(stacked[1], 0, top - 1),
                [s[0 : top - 1] for s in shards],
            )
            (g_c, g_cs, flats), (d_plain, d_pieces) = lax.scan(
                iteration, (g_c, g_cs, flats), xs, reverse=True
            )
        x0, gy0, _ = layer_inputs(0)
        g_c, g_cs, dp0, dpieces0 = backward_layer(
            consts, fixed, g_c, g_cs, jnp.asarray(0), at(stacked[0], 0), x0, flats, gy0
        )
        d_plain = _prepend(dp0, _append(d_plain, dp_top))
        d_pieces = _prepend(dpieces0, _append(d_pieces, dpieces_top))
        return d_pieces, _consts_cotangent(consts, g_cs), g_c, d_plain

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


def _consts_cotangent(consts: list[Any], g_cs: list[Any]) -> list[Any]:
    """Per constant of the scan, its summed cotangent (zero for non-float constants)."""
    out = [dataflow.zero_cotangent(x) for x in consts]
    it = iter(g_cs)
    for k, x in enumerate(consts):
        if dataflow.is_inexact(x):
            out[k] = next(it)
    return out


def _prepend(first: Any, stacked: Any) -> Any:
    """`stacked` (leading axis = iterations) with `first` put before it."""
    return jax.tree_util.tree_map(
        lambda x, s: jnp.concatenate([x[None], s], axis=0), first, stacked
    )


def _append(stacked: Any, last: Any) -> Any:
    """`stacked` (leading axis = iterations, or None for none) with `last` appended."""
    if stacked is None:
        return jax.tree_util.tree_map(lambda x: x[None], last)
    return jax.tree_util.tree_map(lambda s, x: jnp.concatenate([s, x[None]], axis=0), stacked, last)
