"""Weight-delta references in the global view (`ZeroPPConfig.weight_delta_bits`).

Per parameter leaf, the reconstruction every node holds of the padded parameter, as pieces
`(padded_size,)` in partition order (see `partition`), compute dtype, sharded
`PartitionSpec('local')`; None for a leaf that is not sharded. Built by one full gather at
`TrainState.create` and after a restore, advanced by one delta gather per step (see
`zeropp_jax.wire._delta`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from zeropp_jax._choices import Plan
from zeropp_jax.state import _partition as part
from zeropp_jax.wire import _delta as delta
from zeropp_jax.wire.kernels import shard_map_mesh


def _reference_map(
    body: Callable[..., list[jax.Array]],
    mesh: Mesh,
    leaf_layouts: tuple[part.LeafLayout, ...],
    params: Any,
    refs: tuple[jax.Array | None, ...] | None,
) -> tuple[jax.Array | None, ...]:
    """Runs `body(shards[, refs])` over the sharded leaves in a shard_map island; the
    result has one entry per leaf (None for a leaf that is not sharded)."""
    leaves = jax.tree_util.tree_leaves(params)
    idx = [i for i, lo in enumerate(leaf_layouts) if lo.sharded]
    args: list[Any] = [[leaves[i] for i in idx]]
    in_specs: list[Any] = [[part.leaf_spec(leaf_layouts[i]) for i in idx]]
    if refs is not None:
        args.append([refs[i] for i in idx])
        in_specs.append([part.REFERENCE_SPEC] * len(idx))
    island = jax.shard_map(
        body,
        mesh=shard_map_mesh(mesh),
        in_specs=tuple(in_specs),
        out_specs=[part.REFERENCE_SPEC] * len(idx),
        # A gather over `node` is node-invariant, which the varying-axes check cannot see.
        check_vma=False,
    )
    with jax.named_scope("zeropp_weight_delta"):
        out = jax.jit(island)(*args)
    result: list[jax.Array | None] = [None] * len(leaf_layouts)
    for i, r in zip(idx, out, strict=True):
        result[i] = r
    return tuple(result)


def full_weight_references(
    params: Any, plan: Plan, mesh: Mesh, leaf_layouts: tuple[part.LeafLayout, ...]
) -> tuple[jax.Array | None, ...]:
    """The weight-delta references built by one full `plan.reference_bits` gather across
    nodes (at `TrainState.create` and after a restore; see `zeropp_jax.wire._delta`)."""
    kw = dict(bits=plan.reference_bits, block_size=plan.weight_block_size, codec=plan.codec)

    def body(shards):
        dtype = plan.compute_dtype
        return [delta.full_reference(x.reshape(-1), dtype=dtype, **kw) for x in shards]

    return _reference_map(body, mesh, leaf_layouts, params, None)


def advance_weight_references(
    params: Any,
    refs: tuple[jax.Array | None, ...],
    plan: Plan,
    mesh: Mesh,
    leaf_layouts: tuple[part.LeafLayout, ...],
) -> tuple[jax.Array | None, ...]:
    """The references after one delta gather of `params` (the new master parameters)."""
    kw = dict(bits=plan.delta_bits, block_size=plan.weight_block_size, codec=plan.codec)

    def body(shards, old):
        return [
            delta.delta_all_gather(x.reshape(-1), r, **kw) for x, r in zip(shards, old, strict=True)
        ]

    return _reference_map(body, mesh, leaf_layouts, params, refs)
