"""Activations split over the batch at block boundaries, as MaxText's models constrain them.

Under XLA's FSDP (`zeropp_jax.baselines`) nothing but the weights' and the batch's
shardings tells XLA's SPMD partitioner how to run a layer, and in a scanned model it may
run the loop body tensor-parallel and gather the batch's activations instead of the
weights. MaxText pins the activations to the batch at every block's entry and exit
(`nn.with_logical_constraint(x, ('activation_batch', ...))` with the batch over the
data-parallel axes); `constrain_to_batch` is that constraint for a `('node', 'local')`
or `('node', 'local', 'model')` mesh.

It reads the mesh of the trace (`jax.sharding.get_abstract_mesh()`): under
`zeropp_jax.baselines.xla_fsdp_step` it constrains; with no mesh set (one device, or a
plain `jax.jit`) and inside a `shard_map` body manual over the data-parallel axes (the
ZeRO++ engine's island, where a constraint must not name a manual axis and every array is
already one device's rows) it returns its input unchanged.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("node", "local")
"""The mesh axes a batch is split over, node-major (`zeropp_jax.state._partition.BATCH_SPEC`)."""


def batch_spec(ndim: int) -> P:
    """`P(('node', 'local'), None, ...)` for an array of rank `ndim` (>= 1): rows over all
    data-parallel devices, every other dimension whole (replicated over `model`)."""
    if ndim < 1:
        raise ValueError(f"batch_spec: ndim={ndim}; expected an array with a batch axis (>= 1).")
    return P(BATCH_AXES, *([None] * (ndim - 1)))


def constrain_to_batch(x: jax.Array) -> jax.Array:
    """`x` (global shape, batch first) constrained to be split over the batch.

    A `with_sharding_constraint` to `batch_spec(x.ndim)` when the trace has a mesh with
    the axes `('node', 'local')` and neither of them is manual; otherwise `x` unchanged
    (no mesh set: nothing to constrain to; inside a `shard_map` body manual over them:
    `x` is already one device's rows).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
        return x
    if set(BATCH_AXES) & set(mesh.manual_axes):
        return x
    return jax.lax.with_sharding_constraint(x, batch_spec(x.ndim))
