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

    carry_dtypes = [jnp.result_type(x) for x in init]

    def unbits(c):
        return [_from_bits(x, d) for x, d in zip(c, carry_dtypes, strict=True)]

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
        that entered it and its wires, stacked over the layers."""
        if not prefetch:

            def iteration(c, x):
                x_plain, pieces = x
                flats, wires = gathered(pieces, fixed, dataflow.first_array(c))
                new_c, y = step(consts, c, x_plain, flats)
                return new_c, (y, (_to_bits(c), kept(flats, wires)) if save else ())

            c, (ys, saved) = lax.scan(iteration, init, (plain, shards))
            return c, ys, saved

        # Iteration i runs layer i and gathers layer i + 1; the last layer runs after the
        # loop. Each layer's xs are read from the whole stacks and its outputs written
        # into whole stacks carried through the loop (slicing the stacks around a shorter
        # loop, and concatenating its outputs with the last layer's, would copy them).
        def layer(i, c, flats, wires):
            new_c, y = step(consts, c, _take(plain, i), flats)
            return new_c, y, ((_to_bits(c), kept(flats, wires)) if save else ())

        flats, wires = gathered(_take(shards, 0), fixed, tie)
        shapes = jax.eval_shape(layer, 0, init, flats, wires)
        ys, saved = (_stack_of(shapes[k], length) for k in (1, 2))

        def iteration(carry, i):
            c, flats, wires, ys, saved = carry
            next_flats, next_wires = gathered(_take(shards, i + 1), fixed, dataflow.first_array(c))
            new_c, y, kept_i = layer(i, c, flats, wires)
            return (new_c, next_flats, next_wires, _put(ys, y, i), _put(saved, kept_i, i)), None

        carry = (init, flats, wires, ys, saved)
        (c, flats, wires, ys, saved), _ = lax.scan(iteration, carry, jnp.arange(length - 1))
        last_c, y, kept_last = layer(length - 1, c, flats, wires)
        return last_c, _put(ys, y, length - 1), _put(saved, kept_last, length - 1)

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

    def backward(shards, consts, plain, fixed, saved, g_carry, g_ys):
        """Layers in reverse; without prefetch each iteration re-gathers its own layer."""
        g_cs = [jnp.zeros_like(x) for x in consts if dataflow.is_inexact(x)]
        if prefetch:
            return backward_prefetched(shards, consts, plain, fixed, saved, g_carry, g_ys, g_cs)

        def iteration(carry, x):
            g_c, g_cs = carry
            i, (c_in, kept_i), x_plain, pieces, g_y = x
            flats = regather(kept_i, pieces, fixed, g_c)
            c_in = unbits(c_in)
            g_c, g_cs, dp, dpieces = backward_layer(
                consts, fixed, g_c, g_cs, i, c_in, x_plain, flats, g_y
            )
            return (g_c, g_cs), (dp, dpieces)

        xs = (jnp.arange(length), saved, plain, shards, g_ys)
        (g_c, g_cs), (d_plain, d_pieces) = lax.scan(iteration, (g_carry, g_cs), xs, reverse=True)
        return d_pieces, _consts_cotangent(consts, g_cs), g_c, d_plain

    def backward_prefetched(shards, consts, plain, fixed, saved, g_carry, g_ys, g_cs):
        """Layer i - 1 is re-gathered once the cotangent reaching layer i exists, before
        layer i's backward computes; layers L - 1 and 0 run outside the loop. As in the
        forward, inputs are read from and gradients written into whole stacks."""
        top = length - 1

        def regather_layer(i, after):
            c_in, kept_i = _take(saved, i)
            return unbits(c_in), regather(kept_i, _take(shards, i), fixed, after)

        # Integer xs have float0 cotangents, which are not stacked but made whole.
        floats = [dataflow.is_inexact(x) for x in plain]

        def grads_of(i, g_c, g_cs, c_in, flats):
            g_c, g_cs, dp, dpieces = backward_layer(
                consts, fixed, g_c, g_cs, i, c_in, _take(plain, i), flats, _take(g_ys, i)
            )
            dp = [d if f else None for d, f in zip(dp, floats, strict=True)]
            return g_c, g_cs, (dp, dpieces)

        def layer(i, g_c, g_cs, c_in, flats, bufs):
            g_c, g_cs, grads = grads_of(i, g_c, g_cs, c_in, flats)
            return g_c, g_cs, _put(bufs, grads, i)

        def finish(g_c, g_cs, bufs):
            d_plain, d_pieces = bufs
            d_plain = [
                d if f else dataflow.zero_cotangent(x)
                for d, f, x in zip(d_plain, floats, plain, strict=True)
            ]
            return d_pieces, _consts_cotangent(consts, g_cs), g_c, d_plain

        c_top, flats = regather_layer(top, g_carry)
        if length > 1:
            _, next_flats = regather_layer(top - 1, g_carry)
        shapes = jax.eval_shape(lambda: grads_of(jnp.asarray(top), g_carry, g_cs, c_top, flats)[2])
        bufs = _stack_of(shapes, length)
        g_c, g_cs, bufs = layer(jnp.asarray(top), g_carry, g_cs, c_top, flats, bufs)
        if length == 1:
            return finish(g_c, g_cs, bufs)
        flats = next_flats

        def iteration(carry, i):  # layers top - 1 down to 1
            g_c, g_cs, flats, bufs = carry
            _, prev = regather_layer(i - 1, g_c)
            c_in = unbits(_take(saved, i)[0])
            g_c, g_cs, bufs = layer(i, g_c, g_cs, c_in, flats, bufs)
            return (g_c, g_cs, prev, bufs), None

        carry = (g_c, g_cs, flats, bufs)
        (g_c, g_cs, flats, bufs), _ = lax.scan(iteration, carry, jnp.arange(1, top), reverse=True)
        c0 = unbits(_take(saved, 0)[0])
        g_c, g_cs, bufs = layer(jnp.asarray(0), g_c, g_cs, c0, flats, bufs)
        return finish(g_c, g_cs, bufs)

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


def _to_bits(c: list[Any]) -> list[Any]:
    """Each 16-bit float of `c` as its `uint16` bits, the others as they are.

    The backward loop reads each layer's saved carry with a dynamic slice of the stack.
    XLA's CPU pipeline computes bfloat16 in float32 and moves the convert ahead of the
    slice, out of the loop: a float32 copy of every saved carry, twice the stack. The
    bitcast keeps the convert behind the slice. Values are unchanged to the bit.
    """
    out = []
    for x in c:
        dtype = jnp.result_type(x)
        half = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2
        out.append(lax.bitcast_convert_type(x, jnp.uint16) if half else x)
    return out


def _from_bits(x: Any, dtype: Any) -> Any:
    """Inverse of `_to_bits` for one carry of `dtype`."""
    return lax.bitcast_convert_type(x, dtype) if jnp.result_type(x) != dtype else x


def _take(stacks: Any, i: Any) -> Any:
    """Entry `i` (traced or static) along the leading axis of every leaf of `stacks`."""
    return jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), stacks)


def _put(stacks: Any, values: Any, i: Any) -> Any:
    """`stacks` with entry `i` of every leaf set to the matching leaf of `values`."""
    return jax.tree_util.tree_map(
        lambda a, v: lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, 0), stacks, values
    )


def _stack_of(shapes: Any, length: int) -> Any:
    """Zeros of `length` entries stacked along a new leading axis, one per leaf of
    `shapes` (`jax.ShapeDtypeStruct`s), varying over the manual axes its leaf varies over
    (so that a loop may carry it and write the leaf's values into it)."""

    def zeros(x: jax.ShapeDtypeStruct) -> jax.Array:
        z = jnp.zeros((length, *x.shape), x.dtype)
        manual = getattr(x, "manual_axis_type", None)
        varying = tuple(sorted(manual.varying)) if manual is not None else ()
        return lax.pcast(z, varying, to="varying") if varying else z

    return jax.tree_util.tree_map(zeros, shapes)
