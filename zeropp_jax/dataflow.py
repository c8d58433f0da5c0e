"""Shared pieces of the gather-at-use interpreter (`placement`, `layered_scan`): what the
island tells it about each leaf (`Gathers`), and small pure helpers on values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from zeropp_jax import partition as part
from zeropp_jax import tensor_parallel


class Gathers(Protocol):
    """What the island tells the interpreter about each sharded leaf (by leaf index).

    `fixed(leaf)` (a `leaf_gathers.Fixed`: stochastic-rounding key, weight-delta
    reference; `.layer(i)` cuts it to one layer of a stack, `.relaid(axis)` re-lays it
    out as `relayout.layers_to_front` does the leaf's shard, `.has_reference` says whether
    the leaf's `wire` is read from a kept reference, no communication, so a loop computes
    it again where needed rather than keeping it) and `residuals(leaf)` (error feedback)
    are traced values of the island; the interpreter passes them back explicitly, so the
    methods below read nothing traced from the object itself. `reduce`'s `layer` is folded
    into the leaf's stochastic-rounding key (a scan's layer index, or which of a shared
    weight's per-use reductions it is); None: the key as is. `residuals(leaf)` of a
    stacked leaf are, like its reference, per-device pieces of the whole leaf
    (`partition.layer_of_pieces` cuts one layer's out).
    """

    num_devices: int

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
    def full(
        self, leaf: int, piece: jax.Array, wire: tuple[jax.Array, ...], fixed: Any, residuals: Any
    ) -> jax.Array: ...


def tie(to: Any, x: Any) -> Any:
    """`x`, computed from `to`: a data dependency that makes every array of `x` wait for
    the arrays of `to` (None: `x` as it is).

    XLA's CPU pipeline removes `lax.optimization_barrier` before scheduling, so the tie is
    a real one: `-0.0` derived from one element of `to` (also when it is NaN or
    infinite), cast to each array's dtype and added to it. `v + -0.0 == v` for every float
    `v` (signed zeros and NaN included) and `v + 0 == v` for integers, so values are
    unchanged to the bit; the cost is one pass over `x`, a piece or a secondary shard.
    """
    leaves = [v for v in jax.tree_util.tree_leaves(to) if is_inexact(v) and v.size]
    if not leaves:
        return x
    first = jnp.ravel(leaves[0])[0].astype(jnp.float32)
    zero = jnp.where(first == first, -jnp.minimum(jnp.abs(first), 0.0), -0.0)
    return jax.tree_util.tree_map(lambda v: v + zero.astype(v.dtype), x)


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
        part.unpiece(flat, layout, g.num_devices, True), layout, layer=True
    )
