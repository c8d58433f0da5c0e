"""Shared pieces of the gather-at-use interpreter (`placement`, `layered_scan`): what the
island tells it about each leaf (`Gathers`), and small pure helpers on values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from zeropp_jax import _tensor_parallel as tensor_parallel
from zeropp_jax.state import _blocks as blocks
from zeropp_jax.state import _partition as part


class Gathers(Protocol):
    """What the island tells the interpreter about each sharded leaf (by leaf index).

    `state(leaf)` is the leaf's per-step state (a `leaf_gathers.LeafState`): its
    stochastic-rounding key, weight-delta reference and error-feedback residuals, traced
    values of the island. The interpreter passes it back to `wire`, `gather`, `reduce` and
    `full` explicitly, so they read nothing traced from this object. Of the state it reads
    `.layer(i)`, its cut to one layer of a stack (a stacked leaf's reference and residuals
    are per-device pieces of the whole leaf); `.relaid(axis)`, the state re-laid out as
    `relayout.layers_to_front` does the leaf's shard; `.has_reference`, whether `wire`
    reads a kept reference (no communication, so a loop computes it again where needed
    rather than keeping it); `.residuals`, empty without error feedback. Only the
    residuals are differentiated: `reduce` takes the gradients of several leaves at once
    (a layer's, or one use's: it may reduce them together, `weight_gather.reduce_gradients`)
    and returns `(gradient piece, new residuals)` for each, and
    `.cotangent(new)` is the state's cotangent that carries them out of the island.

    `reduce`'s `layer` is folded into the leaf's stochastic-rounding key (a scan's layer
    index, or which of a shared weight's per-use reductions it is); None: the key as is.
    `barrier_ties`: whether the program is for GPUs, whose compiler keeps
    `lax.optimization_barrier`, so that `tie` orders with one (see `tie`).
    `hold_recomputed`: whether a use inside a remat block keeps the weights its recompute
    gathered (in the backward) for its own backward, one gather fewer per use and step.
    XLA:GPU holds them from the recompute to that backward (one block's weights); XLA:CPU
    schedules every block's recompute gathers early and held every block's (a 4-layer
    GPT, unscanned: 33.8 -> 48.1 MB of temporaries, RESULTS "Unscanned blocks under
    remat"), so CPU programs gather again.
    `peel_in_branch`: whether the backward loop's peeled last layer, where the body
    recomputes, runs inside a `lax.cond` (`layered_scan.pipelined`). XLA:CPU builds that
    layer's constant broadcasts at the step's start and holds them through the backward
    loop; in a branch they are built when it runs. GPU programs keep it inline (XLA:GPU
    reads a conditional's predicate on the host).
    """

    num_devices: int
    barrier_ties: bool
    hold_recomputed: bool
    peel_in_branch: bool

    def layout(self, leaf: int) -> part.LeafLayout: ...
    def name(self, leaf: int) -> str: ...
    def state(self, leaf: int) -> Any: ...
    def wire(self, leaf: int, piece: jax.Array, state: Any) -> tuple[jax.Array, ...]: ...
    def gather(
        self, leaf: int, piece: jax.Array, wire: tuple[jax.Array, ...], state: Any, alternate: bool
    ) -> jax.Array: ...
    def reduce(
        self,
        leaves: Sequence[int],
        gs: Sequence[jax.Array],
        states: Sequence[Any],
        layer: jax.Array | None,
    ) -> list[tuple[jax.Array, Any]]: ...
    def full(
        self,
        leaves: Sequence[int],
        pieces: Sequence[jax.Array],
        wires: Sequence[tuple[jax.Array, ...]],
        states: Sequence[Any],
    ) -> list[jax.Array]: ...


def tie(to: Any, x: Any, *, barrier: bool = False) -> Any:
    """`x`, computed from `to`: a data dependency that makes every array of `x` wait for
    the arrays of `to` (None: `x` as it is).

    XLA's CPU pipeline removes `lax.optimization_barrier` before scheduling, so there the
    tie is a real one: `-0.0` derived from one element of `to` (also when it is NaN or
    infinite), cast to each array's dtype and added to it. `v + -0.0 == v` for every float
    `v` (signed zeros and NaN included) and `v + 0 == v` for integers, so values are
    unchanged to the bit; the cost is one pass over `x`, a piece or a secondary shard, and
    a one-element kernel. With `barrier` (a program for GPUs, whose compiler keeps the
    barrier): `lax.optimization_barrier` over one element of `to` and `x`, which costs no
    pass over `x` (one element, not the whole of `to`: a barrier over a whole activation
    makes XLA write it out where it would have fused it into its consumer). PRNG keys in
    `x` are returned as they are (they take no arithmetic).
    """
    leaves = [v for v in jax.tree_util.tree_leaves(to) if is_inexact(v) and v.size]
    if not leaves:
        return x
    if barrier:
        return lax.optimization_barrier((jnp.ravel(leaves[0])[0], x))[1]
    first = jnp.ravel(leaves[0])[0].astype(jnp.float32)
    zero = jnp.where(first == first, -jnp.minimum(jnp.abs(first), 0.0), -0.0)

    def tied(v: Any) -> Any:
        if jax.dtypes.issubdtype(jax.typeof(v).dtype, jax.dtypes.extended):
            return v  # a PRNG key (a scan's per-layer keys): no arithmetic, left as it is
        return v + zero.astype(v.dtype)

    return jax.tree_util.tree_map(tied, x)


def tie_after(tos: Sequence[Any], x: Any, *, barrier: bool = False) -> Any:
    """`x` tied to each of `tos` in turn (`tie`): it waits for all of them."""
    for to in tos:
        x = tie(to, x, barrier=barrier)
    return x


def apply_chain(x: jax.Array, chain: Sequence[tuple[Any, dict[str, Any]]]) -> jax.Array:
    """Binds each `(primitive, params)` of `chain` to `x` in turn."""
    for prim, params in chain:
        x = prim.bind(x, **params)
    return x


def zero_cotangent(x: Any) -> Any:
    """A zero cotangent for `x` (float0 for integer and key arrays)."""
    aval = jax.typeof(x)
    if jnp.issubdtype(aval.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return jnp.zeros(aval.shape, jax.dtypes.float0)


def is_inexact(x: Any) -> bool:
    """Whether `x` is a float or complex array."""
    return jnp.issubdtype(jax.typeof(x).dtype, jnp.inexact)


def first_array(xs: Sequence[Any]) -> Any:
    """The first float array of `xs`, or None."""
    return next((x for x in xs if is_inexact(x)), None)


def unpiece_layer(g: Gathers, layout: part.LeafLayout, flat: jax.Array) -> jax.Array:
    """One layer of a stacked leaf stored as `layout`, gathered, in its per-layer shape."""
    return tensor_parallel.place_gathered(
        blocks.unpiece(flat, layout, g.num_devices, True), layout, layer=True
    )
