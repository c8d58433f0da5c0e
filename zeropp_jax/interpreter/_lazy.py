"""A sharded weight not gathered yet (`Lazy`), and the layout-only reads of it that stay
lazy: which layers a scan reads, and a reversal (`placement` evaluates the model with these
in place of the weights; see `zeropp_jax.interpreter._placement`).

Shapes: a `Lazy` holds the per-device stored shard (see `partition`); its `aval` is the
global weight it stands for, after its `chain`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax import lax


@dataclasses.dataclass(frozen=True)
class Lazy:
    """A sharded weight not gathered yet.

    Attributes:
      leaf: parameter leaf index.
      shard: the per-device shard as the island holds it (`_blocks.island_shard`:
        `(lead, C / N)` or `(C / N,)`).
      aval: the abstract value this stands for (after `chain`).
      chain: layout-only equations `(primitive, params)` to apply after gathering.
    """

    leaf: int
    shard: jax.Array
    aval: Any
    chain: tuple[tuple[Any, dict[str, Any]], ...] = ()


def layers_read(lz: Lazy, start: int, step: int, length: int) -> Lazy:
    """`lz` (stacked along axis 0) cut to the layers `start + step * k`, k < `length`: a
    slice (after a reversal for a negative step) in its chain."""
    chain = list(lz.chain)
    size = lz.aval.shape[0]
    if step < 0:
        chain.append((lax.rev_p, {"dimensions": (0,)}))
        start, step = size - 1 - start, -step
    ndim = len(lz.aval.shape)
    limit = start + step * (length - 1) + 1
    if (start, step, limit) != (0, 1, size):
        params = {
            "start_indices": (start,) + (0,) * (ndim - 1),
            "limit_indices": (limit, *lz.aval.shape[1:]),
            "strides": None if step == 1 else (step,) + (1,) * (ndim - 1),
        }
        chain.append((lax.slice_p, params))
    shape = (length, *lz.aval.shape[1:])
    return dataclasses.replace(lz, chain=tuple(chain), aval=lz.aval.update(shape=shape))


def reverse(x: Any) -> Any:
    """`x` reversed along axis 0 (a lazy weight: one more equation in its chain)."""
    if isinstance(x, Lazy):
        return dataclasses.replace(x, chain=(*x.chain, (lax.rev_p, {"dimensions": (0,)})))
    return lax.rev(x, (0,))
