"""Error feedback for the two-hop gradient reduction (LoCo-style), as pure functions.

A device that quantizes a value for a gradient hop keeps what the quantization lost (the
*residual*) and adds it to what it sends through that hop at the next step. Over `T` steps
the reduced sums then miss only the last residuals instead of `T` steps of rounding
errors: the rounding error no longer accumulates in the weights, it is delayed by a step.

Residuals, per device (shapes inside `jax.shard_map`):
  hop 1 (over `local`): the residual of this device's own gradient contribution, float32,
    the shape of the full (padded) weight `(N * rows, ...)`;
  hop 2 (over `node`): the residual of this device's hop-1 partial sums, float32,
    `(num_nodes * rows, ...)`.
Either may be None: that hop then runs without feedback.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeropp_jax.wire import reductions


def _check_residual(name: str, r: jax.Array | None, shape: tuple[int, ...], fmt) -> None:
    if r is None:
        return
    if fmt is None:
        raise ValueError(
            f"two_hop_reduce_scatter_feedback: a {name} residual was given, but that hop is "
            "unquantized (nothing to feed back); pass None for it or give the hop a format."
        )
    if tuple(r.shape) != shape or r.dtype != jnp.float32:
        raise ValueError(
            f"two_hop_reduce_scatter_feedback: the {name} residual is {r.dtype}{tuple(r.shape)}; "
            f"expected float32{shape}."
        )


def two_hop_reduce_scatter_feedback(
    x: jax.Array,
    hop1_residual: jax.Array | None,
    hop2_residual: jax.Array | None,
    spec: reductions.TwoHop | None = None,
    *,
    key: jax.Array | None = None,
    **fields: Any,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """`reductions.two_hop_reduce_scatter` with error feedback on either hop.

    Hop 1 sends `c1 = x + hop1_residual` (each of the `N` pieces in its own blocks, as the
    plain reduction does); hop 2 sends `c2 = partial + hop2_residual`. A hop given a
    residual returns, as its new residual, what its quantization lost: `c - dequant(q(c))`.
    A hop over an axis of size 1 does not exist: its residual must be None.

    Args:
      x: per-device gradient `(N * rows, ...)` in partition order.
      hop1_residual: float32 `(N * rows, ...)` or None (no feedback on hop 1).
      hop2_residual: float32 `(num_nodes * rows, ...)` or None (no feedback on hop 2).
      spec: what each hop sends (`reductions.TwoHop`); or give its attributes as keywords.
      key: a PRNG key, the same on every device, for stochastic rounding on both hops
        (see `reductions.hop_keys`); None rounds to nearest.
      **fields: `reductions.TwoHop`'s attributes, when `spec` is not given. With a
        rotation, the residual is what the rotated quantization lost, rotated back:
        `c - rotate(dequant(q(rotate(c))))`.

    Returns:
      `(sum, new_hop1_residual, new_hop2_residual)`: float32 `(rows, ...)`, the sum over all
      devices of this device's piece; the new residuals (None where None was given).

    Raises:
      ValueError: for a residual on an unquantized or absent hop, or of the wrong shape.
    """
    spec = reductions.TwoHop.of(spec, fields, "two_hop_reduce_scatter_feedback")
    nn, ll = lax.axis_size(spec.node_axis), lax.axis_size(spec.local_axis)
    rows = x.shape[0] // (nn * ll)
    if ll == 1 and hop1_residual is not None:
        raise ValueError("two_hop_reduce_scatter_feedback: no hop 1 on a 1-device node.")
    if nn == 1 and hop2_residual is not None:
        raise ValueError("two_hop_reduce_scatter_feedback: no hop 2 on a 1-node mesh.")
    _check_residual("hop-1", hop1_residual, tuple(x.shape), spec.bits)
    _check_residual("hop-2", hop2_residual, (nn * rows, *x.shape[1:]), spec.node_bits)
    return reductions.two_hop_with_residuals(x, hop1_residual, hop2_residual, spec, key)
