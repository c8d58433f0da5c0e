"""A scan over stacked weights, rebuilt so that each iteration gathers its own layer.

`run` executes a `Loop` inside the shard_map island (see `placement`). Forward and backward
are one `pipelined` loop each, whose lookahead is 0 (each iteration gathers its own layer)
or 1 (iteration i gathers the layer after i, in the order the loop runs, while layer i
computes), in the manner of JAX's `tests/overlap_test.py`. The backward loop is owned by a
custom VJP: it keeps what the model's own remat keeps of each layer (everything without
remat; what `nn.remat` / `jax.checkpoint`'s policy saves), minus the gathered weights and
whatever is computed from them alone, which it re-gathers (hpZ: from the kept secondary
shard, over `local` only) and recomputes; it reduces layer i's gradients inside the
iteration. A leaf's per-leaf state is read per layer: with weight deltas each layer is
gathered from its slice of the kept reference (read again in the backward, not kept),
with error feedback its reduction reads and returns its slice of the residuals. Shapes
are per device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zeropp_jax.interpreter import _dataflow as dataflow
from zeropp_jax.interpreter import _jaxpr_compat as jaxpr_compat
from zeropp_jax.state import _blocks as blocks
from zeropp_jax.state import _partition as part


@dataclasses.dataclass(frozen=True)
class Loop:
    """One scan over stacked weights, as the interpreter found it.

    Attributes:
      gathers: how each leaf is gathered and reduced.
      leaves: per stacked weight of the scan's `xs`, its parameter leaf.
      layouts: per stacked weight, the layout its layers are stored in (the leaf's, or the
        one `relayout` made); one layer is `layout.shape[1:]`.
      chains: per stacked weight, the layout-only equations that turn one gathered layer
        into what the scan's body reads.
      body: the scan's body, `(consts, carry, xs) -> (carry, ys)`.
      num_carry: carries of the scan.
      length: layers.
      lazy_pos: positions in `xs` of the stacked weights.
      plain_pos: positions in `xs` of the other operands.
      lookahead: 1 to gather one layer ahead of the one that computes, else 0.
      stored_layers: per stacked weight, the layer of the stored leaf (its axis 0) each
        iteration reads, or None when iteration i reads layer i (what `LeafState.layer`
        cuts a leaf's state by).
    """

    gathers: dataflow.Gathers
    leaves: tuple[int, ...]
    layouts: tuple[part.LeafLayout, ...]
    chains: tuple[tuple[tuple[Any, dict[str, Any]], ...], ...]
    body: jaxpr_compat.ClosedJaxpr
    num_carry: int
    length: int
    lazy_pos: tuple[int, ...]
    plain_pos: tuple[int, ...]
    lookahead: int
    stored_layers: tuple[tuple[int, ...] | None, ...] = ()

    def weights(self, flats: list[jax.Array]) -> list[jax.Array]:
        """One layer's gathered flats -> the weights the body reads."""
        return [
            dataflow.apply_chain(dataflow.unpiece_layer(self.gathers, lo, f), chain)
            for lo, f, chain in zip(self.layouts, flats, self.chains, strict=True)
        ]

    def xs(self, plain: list[Any], weights: list[Any]) -> list[Any]:
        """The body's `xs` of one layer from its plain operands and weights."""
        out: list[Any] = [None] * (len(self.lazy_pos) + len(self.plain_pos))
        for i, x in zip(self.plain_pos, plain, strict=True):
            out[i] = x
        for i, w in zip(self.lazy_pos, weights, strict=True):
            out[i] = w
        return out

    def states_at(self, states: list[Any], i: Any) -> list[Any]:
        """Per stacked weight, what its gather and reduction of iteration `i`'s layer read
        beside the piece (`LeafState.layer` of the layer that iteration reads)."""
        out = []
        for k, s in enumerate(states):
            ids = self.stored_layers[k] if self.stored_layers else None
            out.append(s.layer(i if ids is None else jnp.asarray(ids, jnp.int32)[i]))
        return out

    def residuals_of(self, per_layer: list[Any]) -> list[Any]:
        """Inverse of `states_at`'s cut of the residuals over all layers: per stacked
        weight, its residuals from their per-iteration values stacked `(length, ...)`
        (every stored layer read once: a checked precondition of error feedback in a
        loop)."""
        out = []
        for k, (leaf, stacks) in enumerate(zip(self.leaves, per_layer, strict=True)):
            ids = self.stored_layers[k] if self.stored_layers else None
            order = None if ids is None else np.argsort(ids)
            piece = self.gathers.layout(leaf).padded // self.gathers.num_devices

            def back(a, order=order, piece=piece):
                return blocks.pieces_of_layers(a if order is None else a[order], piece)

            out.append(jax.tree_util.tree_map(back, stacks))
        return out

    def rewired(self) -> list[bool]:
        """Per stacked weight, whether its wire is computed again in the backward loop (read
        from a kept weight-delta reference, no communication) rather than kept."""
        return [self.gathers.state(leaf).has_reference for leaf in self.leaves]

    def kept_whole(self) -> list[bool]:
        """Per stacked weight, whether its gathered layer is kept for the backward loop
        (slices of fewer dimensions than a matrix: a collective per vector for a few values
        otherwise) rather than re-gathered from its secondary shard (hpZ) or shard."""
        return [len(lo.shape) <= 2 for lo in self.layouts]


def pipelined(
    fetch: Callable[[Any, Any], Any],
    compute: Callable[[Any, Any, Any], tuple[Any, Any]],
    carry: Any,
    tie: Any,
    length: int,
    lookahead: int,
    reverse: bool,
    branch: bool = False,
) -> tuple[Any, Any]:
    """`compute(i, carry, fetch(i, after))` for layers i = 0 .. length - 1 (reversed with
    `reverse`), the outputs stacked by layer. `compute` takes a fourth argument, True for
    the layer peeled after the loop (below), which has no loop index to wait for.

    With `lookahead` 0 each iteration fetches its own layer once its carry exists. With 1
    the first layer is fetched before the loop (after `tie`), iteration i fetches the
    layer that runs next (after the carry entering layer i) and then computes layer i, and
    the last layer runs after the loop, so nothing is fetched in vain. Outputs are written
    into whole stacks carried through the loop (concatenating a peeled layer's with the
    loop's would copy them). Returns `(carry, outputs)`.

    With `branch` (`_Run.backward` on XLA:CPU, where the body recomputes under remat) the
    peeled layer runs as the taken branch of a `lax.cond` whose predicate is tied to the
    carry, so that XLA cannot fold it. Inline, what the layer's recompute builds from
    constants alone (an attention's zero accumulators, a mask's fill: activation-sized
    broadcasts) is shared with the forward's peeled layer by XLA's CSE, built at the
    step's start and held through the backward loop (16 MiB per device for the trainer's
    125M GPT); in the branch it is built when the layer runs. The branch returns the
    layer's outputs, written into the stacks after it (a branch returning the stacks would
    need a second buffer of them); the other branch, never taken, returns zeros and sends
    nothing.
    """
    step = -1 if reverse else 1
    first, last = (length - 1, 0) if reverse else (0, length - 1)

    def body(state, i):
        carry, ahead, outs = state
        if lookahead:
            now, ahead = ahead, fetch(i + step, carry)
        else:
            now = fetch(i, carry)
        carry, out = compute(i, carry, now, False)
        return (carry, ahead, _put(outs, out, i)), None

    shapes = jax.eval_shape(
        lambda c: compute(jnp.asarray(first), c, fetch(first, c), False)[1], carry
    )
    outs = _zeros_of(shapes, (length,))  # the stacks the loop writes each layer into
    ahead = fetch(jnp.asarray(first), tie) if lookahead else ()
    layers = jnp.arange(length - lookahead) + (lookahead if reverse else 0)
    (carry, ahead, outs), _ = lax.scan(body, (carry, ahead, outs), layers, reverse=reverse)
    if lookahead:
        peeled = lambda c: compute(jnp.asarray(last), c, ahead, True)  # noqa: E731
        if branch:
            taken = dataflow.tie(carry, jnp.asarray(1, jnp.int32)) > 0
            skipped = lambda c: (c, _zeros_of(shapes, ()))  # noqa: E731
            carry, out = lax.cond(taken, peeled, skipped, carry)
        else:
            carry, out = peeled(carry)
        outs = _put(outs, out, last)
    return carry, outs


def run(
    loop: Loop,
    shards: list[jax.Array],
    consts: list[Any],
    init: list[Any],
    plain: list[Any],
    states: list[Any],
    tie: Any,
) -> list[Any]:
    """The scan of `loop`, one layer gathered per iteration; returns its outputs (final
    carry, then stacked `ys`).

    Args:
      loop: the scan.
      shards: per stacked weight, the per-device stack `(layers, C / N)` of its layers'
        pieces.
      consts: the scan's constants.
      init: the scan's initial carry.
      plain: the scan's `xs` other than the stacked weights.
      states: per stacked weight, `gathers.state(leaf)` (re-laid out as its stack). Layer
        i's gathers and gradient reduction read layer i's cut of it (`Loop.states_at`);
        its cotangent carries the new error-feedback residuals, every layer's.
      tie: what the first gather waits for (None: nothing).
    """
    r = _Run(loop)

    @jax.custom_vjp
    def scan(shards, consts, init, plain, states, tie):
        c, ys, _ = r.forward(shards, consts, init, plain, states, tie, False)
        return c, ys

    def scan_fwd(shards, consts, init, plain, states, tie):
        c, ys, saved = r.forward(shards, consts, init, plain, states, tie, True)
        return (c, ys), (shards, consts, plain, states, saved, tie)

    def scan_bwd(res, cts):
        shards, consts, plain, states, saved, tie = res
        g_carry, g_ys = cts
        d_shards, d_consts, d_init, d_plain, d_states = r.backward(
            shards, consts, plain, states, saved, g_carry, g_ys
        )
        d_tie = None if tie is None else dataflow.zero_cotangent(tie)
        return d_shards, d_consts, d_init, d_plain, d_states, d_tie

    scan.defvjp(scan_fwd, scan_bwd)
    c, ys = scan(shards, consts, list(init), plain, states, tie)
    return [*c, *ys]


class _Run:
    """One run of a `Loop`: its forward (layer i gathered per iteration) and its backward
    (layer i re-gathered, its kept VJP applied, its gradient reduced), the two halves of
    `run`'s custom VJP."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.whole = loop.kept_whole()
        self.rewire = loop.rewired()
        self.split = _Split.of(loop)
        self.recomputes = _recomputes(loop.body.jaxpr)
        # How one layer's kept VJP flattens (its treedef and leaf dtypes), set when the
        # forward is traced and read when the backward is.
        self.traced: dict[str, Any] = {}

    def fetch(self, shards, states, i, after):
        """Layer i's `(flats, wires)`, gathered once `after` exists."""
        loop, g = self.loop, self.loop.gathers
        pieces = dataflow.tie(after, _take(shards, i), barrier=loop.gathers.barrier_ties)
        states = loop.states_at(states, i)
        wires = [g.wire(leaf, p, s) for leaf, p, s in zip(loop.leaves, pieces, states, strict=True)]
        flats = [
            g.gather(leaf, p, w, s, False)
            for leaf, p, w, s in zip(loop.leaves, pieces, wires, states, strict=True)
        ]
        return flats, wires

    def forward(self, shards, consts, init, plain, states, tie, save):
        """`(carry, ys, saved)`; with `save`, `saved` holds per layer (stacked) what its
        backward reads: the VJP of the layer without its weights, and the wires (or, for
        `whole` weights, the gathered layer; nothing for `rewire` ones) to re-gather
        them from."""
        loop = self.loop

        def compute(i, c, fetched, peeled):
            del peeled  # the forward's layers all compute from the carry
            flats, wires = fetched
            x_plain = _take(plain, i)
            if not save:
                xs_i = loop.xs(x_plain, loop.weights(flats))
                out = jaxpr_compat.eval_jaxpr(loop.body.jaxpr, loop.body.consts, *consts, *c, *xs_i)
                return out[: loop.num_carry], (out[loop.num_carry :], ())
            (new_c, y), vjp = self.split.vjp(loop.weights(flats), consts, c, x_plain)
            leaves, self.traced["tree"] = jax.tree_util.tree_flatten(vjp)
            self.traced["dtypes"] = [jnp.result_type(x) for x in leaves]
            kept = [
                f if keep else () if again else w
                for f, w, keep, again in zip(flats, wires, self.whole, self.rewire, strict=True)
            ]
            return new_c, (y, (_to_bits(leaves), kept))

        fetch = lambda i, after: self.fetch(shards, states, i, after)  # noqa: E731
        c, (ys, saved) = pipelined(
            fetch, compute, list(init), tie, loop.length, loop.lookahead, reverse=False
        )
        return c, ys, saved

    def fetch_back(self, shards, kept, states, i, after):
        """Layer i's gathered weights for the backward, once `after` exists: re-gathered
        from the kept wires (or wires computed again), or the kept layer itself."""
        loop, g = self.loop, self.loop.gathers
        kept_i, pieces = dataflow.tie(
            after, (_take(kept, i), _take(shards, i)), barrier=loop.gathers.barrier_ties
        )
        states_i = loop.states_at(states, i)
        kept_i = [
            g.wire(leaf, p, s) if again else w
            for leaf, p, w, s, again in zip(
                loop.leaves, pieces, kept_i, states_i, self.rewire, strict=True
            )
        ]
        return [
            w if keep else g.gather(leaf, p, w, s, True)
            for leaf, p, w, s, keep in zip(
                loop.leaves, pieces, kept_i, states_i, self.whole, strict=True
            )
        ]

    def backward(self, shards, consts, plain, states, saved, g_carry, g_ys):
        """Layers in reverse: re-gather layer i once the cotangent reaching it exists,
        apply its kept VJP, reduce its weights' gradients. Returns the cotangents of
        `shards`, `consts`, the carry, `plain` and `states` (the new residuals)."""
        loop, g = self.loop, self.loop.gathers
        res_bits, kept = saved
        floats = [dataflow.is_inexact(x) for x in plain]
        g_cs = [jnp.zeros_like(x) for x in consts if dataflow.is_inexact(x)]

        def compute(i, carry, flats, peeled):
            g_c, g_cs = carry
            if peeled and self.recomputes:
                # The layer after the loop reads its kept values and plain xs at an index
                # that waits for the cotangent reaching it (a scalar tie, no copy): else
                # XLA recomputes its forward from them before the loop and holds that
                # through every other layer's backward.
                i = dataflow.tie(g_c, i)
            kept_i, x_plain = _take(res_bits, i), _take(plain, i)
            leaves = _from_bits(kept_i, self.traced["dtypes"])
            vjp = jax.tree_util.tree_unflatten(self.traced["tree"], leaves)
            weights, pull_weights = jax.vjp(lambda f: self.split.prologue(loop.weights(f)), flats)
            d_pre, d_consts, g_c, d_plain = self.split.pull(
                vjp, weights, consts, x_plain, g_c, _take(g_ys, i)
            )
            (d_flats,) = pull_weights(d_pre)
            reduced = g.reduce(loop.leaves, d_flats, loop.states_at(states, i), i)
            g_cs = [a + b for a, b in zip(g_cs, _inexact(consts, d_consts), strict=True)]
            d_plain = [d if fl else None for d, fl in zip(d_plain, floats, strict=True)]
            d_layers = [
                _as_layer_rows(d, lo, g.num_devices)
                for (d, _), lo in zip(reduced, loop.layouts, strict=True)
            ]
            return (g_c, g_cs), (d_plain, d_layers, [r for _, r in reduced])

        fetch = lambda i, after: self.fetch_back(shards, kept, states, i, after)  # noqa: E731
        (g_c, g_cs), (d_plain, d_pieces, new_feedback) = pipelined(
            fetch, compute, (g_carry, g_cs), g_carry, loop.length, loop.lookahead, reverse=True,
            branch=loop.gathers.peel_in_branch and self.recomputes,
        )  # fmt: skip
        d_plain = [
            d if fl else dataflow.zero_cotangent(x)
            for d, fl, x in zip(d_plain, floats, plain, strict=True)
        ]
        d_states = [
            s.cotangent(r) for s, r in zip(states, loop.residuals_of(new_feedback), strict=True)
        ]
        d_pieces = [d.reshape(x.shape) for d, x in zip(d_pieces, shards, strict=True)]
        return d_pieces, _consts_cotangent(consts, g_cs), g_c, d_plain, d_states


@dataclasses.dataclass(frozen=True)
class _Split:
    """A loop body split by data dependence: the `prologue` computes from one layer's
    weights alone (casts, transposes, ...: recomputed in the backward loop, never kept),
    `main` computes the rest from the prologue's outputs, the constants, the carry and the
    plain `xs`.

    Attributes:
      known: `(weights) -> prologue outputs`.
      unknown: `(prologue outputs, consts, carry, plain xs) -> (carry, ys)`.
      loop: the loop.
    """

    known: jaxpr_compat.ClosedJaxpr
    unknown: jaxpr_compat.ClosedJaxpr
    loop: Loop

    @classmethod
    def of(cls, loop: Loop) -> _Split:
        body = loop.body.jaxpr
        nc = len(body.invars) - loop.num_carry - len(loop.lazy_pos) - len(loop.plain_pos)
        weight_in = {nc + loop.num_carry + i for i in loop.lazy_pos}
        unknowns = [k not in weight_in for k in range(len(body.invars))]
        known, unknown = jaxpr_compat.split_known(loop.body, unknowns)
        return cls(known, unknown, loop)

    def prologue(self, weights: list[Any]) -> list[Any]:
        return jaxpr_compat.eval_jaxpr(self.known.jaxpr, self.known.consts, *weights)

    def _main(self, pre, consts, carry, plain):
        # The unknown half reads the body's inputs in their order, minus the weights.
        lp = self.loop
        xs = lp.xs(plain, [None] * len(lp.lazy_pos))
        ins = [*consts, *carry, *(x for x in xs if x is not None)]
        out = jaxpr_compat.eval_jaxpr(self.unknown.jaxpr, self.unknown.consts, *pre, *ins)
        return list(out[: lp.num_carry]), list(out[lp.num_carry :])

    def vjp(self, weights, consts, carry, plain) -> tuple[tuple[list, list], Any]:
        """The layer's outputs and its VJP, whose residuals hold neither the prologue's
        outputs nor the constants nor the plain `xs` (`pull` puts them back)."""
        pre = self.prologue(weights)
        n = (len(pre), len(consts), len(carry), len(plain))

        def main(*args):
            a, b, c, d = _cuts(list(args), n)
            return self._main(a, b, c, d)

        return jaxpr_compat.vjp_dropping(main, [*pre, *consts, *carry, *plain], _saved(n))

    def pull(self, vjp, pre, consts, plain, g_c, g_y):
        """Cotangents of the prologue's outputs, the constants, the carry and the plain xs."""
        n = (len(pre), len(consts), len(g_c), len(plain))
        args = [*pre, *consts, *[None] * n[2], *plain]
        vjp = jaxpr_compat.vjp_restored(vjp, args, _saved(n))
        return _cuts(list(vjp((list(g_c), list(g_y)))), n)


def _recomputes(jaxpr: jaxpr_compat.Jaxpr) -> bool:
    """Whether a loop body holds a `jax.checkpoint` block (`nn.remat`), whose backward
    recomputes part of its forward (also inside calls it makes)."""
    for eqn in jaxpr.eqns:
        if jaxpr_compat.remat_of(eqn) is not None:
            return True
        inner = jaxpr_compat.inlined_call(eqn)
        if inner is not None and _recomputes(inner.jaxpr):
            return True
    return False


def _saved(n: tuple[int, int, int, int]) -> list[bool]:
    """Per argument of `_Split.main`, whether its VJP keeps it: the carry only (the
    prologue's outputs, the constants and the plain xs are put back by `pull`)."""
    a, b, c, d = n
    return [False] * (a + b) + [True] * c + [False] * d


def _cuts(xs: list[Any], n: tuple[int, ...]) -> list[list[Any]]:
    out, k = [], 0
    for m in n:
        out.append(xs[k : k + m])
        k += m
    return out


def _inexact(xs: list[Any], ds: list[Any]) -> list[Any]:
    return [d for x, d in zip(xs, ds, strict=True) if dataflow.is_inexact(x)]


def _consts_cotangent(consts: list[Any], g_cs: list[Any]) -> list[Any]:
    """Per constant of the scan, its summed cotangent (zero for non-float constants)."""
    out = [dataflow.zero_cotangent(x) for x in consts]
    it = iter(g_cs)
    for k, x in enumerate(consts):
        if dataflow.is_inexact(x):
            out[k] = next(it)
    return out


def _to_bits(xs: list[Any]) -> list[Any]:
    """Each 16-bit float of `xs` as its `uint16` bits, the others as they are.

    The backward loop reads each layer's saved residuals with a dynamic slice of their
    stack. XLA's CPU pipeline computes bfloat16 in float32 and moves the convert ahead of
    the slice, out of the loop: a float32 copy of every saved residual, twice the stack.
    The bitcast keeps the convert behind the slice. Values are unchanged to the bit.
    """
    out = []
    for x in xs:
        dtype = jnp.result_type(x)
        half = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2
        out.append(lax.bitcast_convert_type(x, jnp.uint16) if half else x)
    return out


def _from_bits(xs: list[Any], dtypes: list[Any]) -> list[Any]:
    """Inverse of `_to_bits`, given the original dtypes."""
    return [
        lax.bitcast_convert_type(x, d) if jnp.result_type(x) != d else x
        for x, d in zip(xs, dtypes, strict=True)
    ]


def _as_layer_rows(piece: jax.Array, layout: part.LeafLayout, num_devices: int) -> jax.Array:
    """One layer's reduced gradient piece in the shape it is stacked in: a stacked leaf's
    device block of the layer, `layout.block_shape(N)`, as it is stored (`partition`), so
    that the stack of every layer's is the stored gradient, written in place (XLA copies a
    stack written flat and then reshaped); as it is otherwise."""
    if layout.stacked and not layout.tensor_parallel:
        return piece.reshape(layout.block_shape(num_devices))
    return piece


def _take(stacks: Any, i: Any) -> Any:
    """Entry `i` (traced or static) along the leading axis of every leaf of `stacks`."""
    return jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), stacks)


def _put(stacks: Any, values: Any, i: Any) -> Any:
    """`stacks` with entry `i` of every leaf set to the matching leaf of `values`."""
    return jax.tree_util.tree_map(
        lambda a, v: lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, 0), stacks, values
    )


def _zeros_of(shapes: Any, lead: tuple[int, ...]) -> Any:
    """Zeros of shape `(*lead, *leaf.shape)` per leaf of `shapes`, varying over the manual
    axes the leaf varies over (what a loop's carry or a `lax.cond` branch must match)."""

    def zeros(x: jax.ShapeDtypeStruct) -> jax.Array:
        z = jnp.zeros((*lead, *x.shape), x.dtype)
        manual = getattr(x, "manual_axis_type", None)
        varying = tuple(sorted(manual.varying)) if manual is not None else ()
        return lax.pcast(z, varying, to="varying") if varying else z

    return jax.tree_util.tree_map(zeros, shapes)
