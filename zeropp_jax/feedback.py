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

import math

import jax
import jax.numpy as jnp
from jax import lax

from zeropp_jax import collectives as C
from zeropp_jax.collectives import Format
from zeropp_jax.quant import XLA_CODEC, Codec, check_bits


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
    *,
    bits: Format | None,
    block_size: int,
    node_bits: Format | None | str = "same",
    node_block_size: int | None = None,
    node_axis: str = "node",
    local_axis: str = "local",
    codec: Codec = XLA_CODEC,
    key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """`collectives.two_hop_reduce_scatter` with error feedback on either hop.

    Hop 1 sends `c1 = x + hop1_residual` (each of the `N` pieces in its own blocks, as the
    plain reduction does); hop 2 sends `c2 = partial + hop2_residual`. A hop given a
    residual returns, as its new residual, what its quantization lost: `c - dequant(q(c))`.
    A hop over an axis of size 1 does not exist: its residual must be None.

    Args:
      x: per-device gradient `(N * rows, ...)` in partition order.
      hop1_residual: float32 `(N * rows, ...)` or None (no feedback on hop 1).
      hop2_residual: float32 `(num_nodes * rows, ...)` or None (no feedback on hop 2).
      bits: format on hop 1 (8, 4, 2, "e4m3") or None for an unquantized hop.
      block_size: values per quantization block on hop 1.
      node_bits: format on hop 2; "same" uses `bits`.
      node_block_size: values per quantization block on hop 2; None uses `block_size`.
      node_axis: name of the inter-node mesh axis.
      local_axis: name of the intra-node mesh axis.
      codec: block quantization implementation.
      key: a PRNG key, the same on every device, for stochastic rounding on both hops
        (see `collectives.hop_keys`); None rounds to nearest.

    Returns:
      `(sum, new_hop1_residual, new_hop2_residual)`: float32 `(rows, ...)`, the sum over all
      devices of this device's piece; the new residuals (None where None was given).

    Raises:
      ValueError: for a residual on an unquantized or absent hop, or of the wrong shape.
    """
    nn, ll = lax.axis_size(node_axis), lax.axis_size(local_axis)
    n = nn * ll
    hop2_bits = bits if node_bits == "same" else node_bits
    hop2_block = block_size if node_block_size is None else node_block_size
    if x.shape[0] % n:
        raise ValueError(
            f"two_hop_reduce_scatter_feedback: leading dimension {x.shape[0]} is not divisible "
            f"by the {n} devices of the mesh; pad it to a multiple of {n}."
        )
    rows_shape = (x.shape[0] // n, *x.shape[1:])
    piece = math.prod(rows_shape)
    if ll == 1 and hop1_residual is not None:
        raise ValueError("two_hop_reduce_scatter_feedback: no hop 1 on a 1-device node.")
    if nn == 1 and hop2_residual is not None:
        raise ValueError("two_hop_reduce_scatter_feedback: no hop 2 on a 1-node mesh.")
    _check_residual("hop-1", hop1_residual, tuple(x.shape), bits)
    _check_residual("hop-2", hop2_residual, (nn * rows_shape[0], *rows_shape[1:]), hop2_bits)
    k1, k2 = C.hop_keys(key, node_axis=node_axis, local_axis=local_axis)

    new1 = None
    partial = x
    if ll > 1:
        if bits is None:
            partial = C.reduce_scatter_quantized(
                x, axis_name=local_axis, bits=None, block_size=block_size, codec=codec
            )
        else:
            c1 = x.astype(jnp.float32)
            if hop1_residual is not None:
                c1 = c1 + hop1_residual
            partial, values, scales = C.local_hop_per_piece(
                c1,
                bits=bits,
                block_size=block_size,
                node_axis=node_axis,
                local_axis=local_axis,
                codec=codec,
                key=k1,
            )
            if hop1_residual is not None:
                bs = C.effective_block_size(piece, block_size)
                sent = C._dequantize(values, scales, bits, jnp.float32, codec)
                new1 = c1 - C.unblock(sent.reshape(n, -1, bs), rows_shape)
    if nn == 1:
        return partial.astype(jnp.float32).reshape(rows_shape), new1, None
    if hop2_bits is None:
        out = C.reduce_scatter_quantized(
            partial.astype(x.dtype), axis_name=node_axis, bits=None, block_size=hop2_block
        )
        return out.reshape(rows_shape), new1, None
    check_bits(hop2_bits, hop2_block)
    c2 = partial.astype(jnp.float32)
    if hop2_residual is not None:
        c2 = c2 + hop2_residual
    v2, s2 = C._quantize(C.shard_blocks(c2, nn, hop2_block), hop2_bits, codec, k2)
    new2 = None
    if hop2_residual is not None:
        new2 = c2 - C.unblock(C._dequantize(v2, s2, hop2_bits, jnp.float32, codec), rows_shape)
    rv2 = lax.all_to_all(v2, node_axis, 0, 0)
    rs2 = lax.all_to_all(s2, node_axis, 0, 0)
    out = C.unblock(codec.dequantize_sum_blocks(rv2, rs2, bits=hop2_bits)[None], rows_shape)
    return out, new1, new2
