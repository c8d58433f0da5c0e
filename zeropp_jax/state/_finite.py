"""Whether the gradients are free of NaN and infinity (`TrainState.grads_finite`).

Each device reads its own blocks of every float leaf (`shard_map`) and writes one flag;
the flags are combined outside as booleans. Within a device the check reads
`isfinite` of every value (on XLA:CPU), or sums `|x| * 0`, which is 0 where every value
is finite and NaN otherwise, in any summation order (on GPUs, see below). A float
maximum would not do: XLA:CPU's reduce-max drops NaN from about 4,096 values up
(openxla/xla#21461, as `quant.block_absmax` says), and its cross-device `max` drops a NaN
that one device holds. The `isfinite(max(|x|))` on the global arrays that this replaced
answered True for a gradient holding a NaN in a leaf of 4,096 values or more, or in one
device's block of any leaf, and `skip_nonfinite_updates` wrote it into the weights.

On a device, two forms of one answer, picked by the platform the step compiles for:

- `join=False`: one integer maximum of `~isfinite` per block (`_any_non_finite`). XLA:CPU
  runs each where the leaf is written and holds nothing more; joined, its concatenation
  of every block would be materialised (a copy of all of them).
- `join=True`: each block's rows reduced to their sums (a row reduction, which XLA:GPU
  fuses into the optimizer's update of the leaf where it can), the sums of every block
  joined into one small vector, and one reduction over it. The vector passes an
  optimization barrier, which XLA:GPU keeps: without it, XLA's simplifier splits a
  reduction of a concatenation back into one reduction per operand, and each of those
  is a kernel of its own. In the 125M GPT's step on one H200 this is 28 kernels where
  a reduction per leaf was 76 (RESULTS "The engine's own cost on one GPU"). XLA:CPU
  drops barriers, so it would split there anyway.

Integer leaves cannot be non-finite and are not read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def _float_leaves(leaves: Sequence[Any]) -> list[int]:
    """Indices of the leaves a NaN or infinity can be in (inexact, not empty)."""
    return [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]


def _zero_or_nan(b: jax.Array) -> jax.Array:
    """0 where `b` is finite, NaN where it is not (`|b| * 0`; `|b|` keeps a complex
    value's non-finite part)."""
    return jnp.abs(b) * 0


def _any_non_finite(b: jax.Array) -> jax.Array:
    """A uint8 scalar: 1 if `b` holds a NaN or infinity, else 0. An integer maximum of
    `~isfinite(b)`: no float comparison, so nothing can drop a NaN. XLA:CPU runs it
    where the leaf is written and holds nothing more; `sum(|b| * 0)` (same answer) made it
    hold more (+38 MB per device for ZeRO-3's 1.3B step on 16 x 8: `experiments/memory.py`
    at 607541d, 1.301 GB against 1.263), and `all(isfinite(b))` +17 MB at 6.7B."""
    return jnp.max((~jnp.isfinite(b)).astype(jnp.uint8))


def _block_finite(blocks: Sequence[jax.Array], join: bool) -> jax.Array:
    """A scalar bool: every element of `blocks` (one device's, any shapes) is finite."""
    if not join:
        return jnp.all(jnp.stack([_any_non_finite(b) == 0 for b in blocks]))
    rows = [_zero_or_nan(b).reshape(-1, b.shape[-1] if b.ndim else 1) for b in blocks]
    partial = jnp.concatenate([jnp.sum(r, axis=1, dtype=jnp.float32) for r in rows])
    partial = jax.lax.optimization_barrier(partial)
    return jnp.isfinite(jnp.sum(partial))


def all_finite(
    leaves: Sequence[jax.Array], specs: Sequence[P], mesh: Mesh, *, join: bool
) -> jax.Array:
    """A scalar bool: every float leaf is free of NaN and infinity.

    Args:
      leaves: global arrays on `mesh`.
      specs: each leaf's `PartitionSpec`, as it is stored (another spec would make XLA
        move the leaf to read it).
      mesh: the mesh the leaves live on.
      join: read each device's blocks as one reduction (for XLA:GPU) rather than one per
        block (for XLA:CPU); the answer is the same.
    """
    idx = _float_leaves(leaves)
    if not idx:
        return jnp.array(True)
    ones = (1,) * len(mesh.axis_names)
    flags = jax.shard_map(
        lambda *blocks: _block_finite(blocks, join).reshape(ones),
        mesh=mesh,
        in_specs=tuple(specs[i] for i in idx),
        out_specs=P(*mesh.axis_names),
    )(*(leaves[i] for i in idx))
    return jnp.all(flags)
