"""One weight use's VJP, split at its weights (used by `zeropp_jax.interpreter._placement`).

A use is one equation that reads gathered weights. Its forward runs the equation under
`jax.vjp` and keeps the residuals the equation's own derivative keeps (a `custom_vjp`'s
saved values, e.g. a cross-entropy head's log-sum-exp), but not its arguments: the caller
keeps the activations and re-gathers the weights in the backward, and `pull` puts both
back. So the backward does not run the equation's forward again (for a `custom_vjp`
whose forward is a whole logits loop that doubled the head's work), and holds no
gathered weight between forward and backward.

One exception keeps the old route, re-running the equation in the backward: a residual
computed from the weights that is larger than the weights' stored shards (e.g. a
`custom_vjp` that saves its weight transposed), which would hold a gathered-size copy of
a weight from the forward to the backward (`keeps_residuals` says which route applies).

Shapes: everything here is per device, as the equation sees it inside the island.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from zeropp_jax.interpreter import _jaxpr_compat as jaxpr_compat
from zeropp_jax.interpreter._jaxpr_reads import computed_from

Run = Callable[[Sequence[Any], Sequence[jax.Array]], list[Any]]
"""`(activations, weights) -> outputs` of one equation."""


def _flat(run: Run, num_acts: int) -> Callable[..., list[Any]]:
    return lambda *args: run(args[:num_acts], args[num_acts:])


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def keeps_residuals(
    run: Run, acts: Sequence[Any], weights: Sequence[Any], shard_bytes: int
) -> bool:
    """Whether the forward may keep `run`'s residuals (True), or the backward must run it
    again (False): the residuals computed from the weights take at most `shard_bytes`
    (the per-device stored bytes of the weights read).

    Args:
      run: the equation.
      acts: its activations (arrays or abstract values).
      weights: abstract values of the full weights it reads.
      shard_bytes: bytes of those weights' per-device stored shards.
    """
    n = len(acts)

    def residuals(*args: Any) -> list[Any]:
        _, vjp = jaxpr_compat.vjp_dropping(_flat(run, n), args, [False] * len(args))
        return jax.tree_util.tree_leaves(vjp)

    avals = [jax.typeof(a) if isinstance(a, jax.Array) else a for a in (*acts, *weights)]
    closed = jax.make_jaxpr(residuals)(*avals)
    jaxpr = closed.jaxpr
    from_weights = computed_from(jaxpr, set(jaxpr.invars[n:]))
    held = sum(_nbytes(v.aval) for v, w in zip(jaxpr.outvars, from_weights, strict=True) if w)
    return held <= shard_bytes


def forward(run: Run, acts: Sequence[Any], weights: Sequence[jax.Array]) -> tuple[list, Any]:
    """`run(acts, weights)` and its VJP, which keeps neither `acts` nor `weights`."""
    args = [*acts, *weights]
    return jaxpr_compat.vjp_dropping(_flat(run, len(acts)), args, [False] * len(args))


def pull(
    vjp: Any, acts: Sequence[Any], weights: Sequence[jax.Array], cts: Any
) -> tuple[list[Any], list[Any]]:
    """Cotangents of `acts` and of `weights` from `vjp` (of `forward`), with the
    activations and the (re-gathered) weights put back."""
    args = [*acts, *weights]
    vjp = jaxpr_compat.vjp_restored(vjp, args, [False] * len(args))
    d = list(vjp(cts))
    return d[: len(acts)], d[len(acts) :]
