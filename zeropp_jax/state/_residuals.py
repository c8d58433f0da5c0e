"""Error-feedback residuals in the train state (`ZeroPPConfig.error_feedback`).

An unchanged `train_step` takes `jax.grad` with respect to `state.params` only, so the only
way out of the backward pass is a gradient. With error feedback on, `state.params` holds
one more top-level entry, `state.params[KEY] = {"hop1": (...), "hop2": (...)}`, a tuple
per hop with one float32 residual (or None) per parameter leaf. The island passes each
residual to `weight_gather.gather_weight`, whose backward rule returns the *new* residual as
that entry's gradient; `TrainState.apply_gradients` takes the entry out of the gradients
and parameters, gives the optimizer the rest, and stores the new residuals (times the
decay, zeroed every `error_feedback_reset` steps).

Global shapes, every residual flat and sharded `PartitionSpec(('node', 'local'))` (device
`(n, l)` holds block `n * local_size + l`), with `P = layout.padded_size` values in piece
order (see `partition`): hop 1, `(N * P,)` (each device's residual of its own full-size
gradient contribution); hop 2, `(num_nodes * P,)` (each device's residual of its hop-1
partial sums, `num_nodes * P / N` values).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from zeropp_jax.state import _blocks as blocks
from zeropp_jax.state import _partition as part

if TYPE_CHECKING:
    from zeropp_jax._choices import Plan

KEY = "zeropp_error_feedback"
"""The entry of `state.params` (and so of the gradients) that carries the residuals."""

SPEC = part.BATCH_SPEC
"""Every residual is sharded over all devices in node-major order."""


def shapes(
    layout: part.LeafLayout, num_nodes: int, local_size: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global shapes of a sharded leaf's hop-1 and hop-2 residuals."""
    n = num_nodes * local_size
    return (n * layout.padded_size,), (num_nodes * layout.padded_size,)


def zeros(
    leaf_layouts: tuple[part.LeafLayout, ...], plan: Plan, mesh: Mesh
) -> dict[str, tuple[jax.Array | None, ...]] | None:
    """Fresh (zero) residuals for `mesh` (`plan.feedback_hops` says which hops keep
    them), or None without error feedback."""
    nn, ll = plan.num_nodes, plan.local_size
    hop1, hop2 = plan.feedback_hops
    if not (hop1 or hop2):
        return None
    wanted = [
        (hop, i, shapes(lo, nn, ll)[hop])
        for hop, on in ((0, hop1), (1, hop2))
        if on
        for i, lo in enumerate(leaf_layouts)
        if lo.sharded
    ]
    # One program for every buffer (not one compile per leaf at start-up).
    made = jax.jit(
        lambda: [jnp.zeros(shape, jnp.float32) for _, _, shape in wanted],
        out_shardings=NamedSharding(mesh, SPEC),
    )()
    out: list[list[jax.Array | None]] = [[None] * len(leaf_layouts) for _ in range(2)]
    for (hop, i, _), r in zip(wanted, made, strict=True):
        out[hop][i] = r
    return {"hop1": tuple(out[0]), "hop2": tuple(out[1])}


def split(params: Any) -> tuple[Any, Any]:
    """`(model_params, residuals)`: `params` without and with only its `KEY` entry (None
    when there is none)."""
    if isinstance(params, dict) and KEY in params:
        rest = {k: v for k, v in params.items() if k != KEY}
        return rest, params[KEY]
    return params, None


def join(model_params: Any, residuals: Any) -> Any:
    """Inverse of `split`.

    Raises:
      ValueError: when residuals are given but the parameters are not a dict.
    """
    if residuals is None:
        return model_params
    if not isinstance(model_params, dict):
        raise ValueError(
            "ZeroPPConfig.error_feedback needs the parameters to be a dict (flax's "
            f"variables['params']); got {type(model_params).__name__}."
        )
    if KEY in model_params:
        raise ValueError(f"the parameters already hold an entry named {KEY!r}.")
    return {**model_params, KEY: residuals}


def advance(
    new: dict[str, tuple[jax.Array | None, ...]], step: jax.Array, plan: Plan
) -> dict[str, tuple[jax.Array | None, ...]]:
    """The residuals to keep after step `step` (0-based) from the backward pass's `new`
    ones: times `plan.feedback_decay`, and zero after every `plan.feedback_reset`-th
    step."""
    decay = jnp.float32(plan.feedback_decay)
    reset = plan.feedback_reset
    keep = jnp.array(True) if not reset else (step + 1) % reset != 0

    def one(r):
        return None if r is None else jnp.where(keep, r * decay, jnp.zeros_like(r))

    return {k: tuple(one(r) for r in v) for k, v in new.items()}


def missing_mass(
    residuals: dict[str, tuple[jax.Array | None, ...]],
    leaf_layouts: tuple[part.LeafLayout, ...],
    num_nodes: int,
    local_size: int,
    *,
    flat_stacked: bool = False,
) -> tuple[jax.Array | None, ...]:
    """Per sharded leaf, what the reduced gradients still owe: the sum over devices of the
    hop-1 residuals plus the hop-2 residuals put back at their values, in the stored
    layout of the parameter (`layout.stored_shape`; with `flat_stacked`, a stacked leaf's
    flat per layer, `(layers, padded)`, as layouts 1 and 2 stored it). What `respread`
    distributes on another mesh."""
    n = num_nodes * local_size

    def owed(lo: part.LeafLayout, r1: jax.Array | None, r2: jax.Array | None) -> jax.Array:
        size = lo.padded_size
        total = jnp.zeros((size,), jnp.float32)
        if r1 is not None:
            total = total + r1.reshape(n, size).sum(0)
        if r2 is not None:
            per = r2.reshape(num_nodes, local_size, num_nodes * (size // n)).sum(0)
            total = total + per.reshape(size)
        if flat_stacked and lo.stacked and not lo.tensor_parallel:
            return jnp.swapaxes(total.reshape(n, lo.lead, lo.padded // n), 0, 1).reshape(
                lo.lead, lo.padded
            )
        return blocks.pieces_to_stored(total, lo, n)

    out: list[jax.Array | None] = []
    for i, lo in enumerate(leaf_layouts):
        r1, r2 = residuals["hop1"][i], residuals["hop2"][i]
        if r1 is None and r2 is None:
            out.append(None)
            continue
        # Under jit, so it also runs on arrays that span processes.
        out.append(jax.jit(owed, static_argnums=0)(lo, r1, r2))
    return tuple(out)


def respread(
    mass: tuple[jax.Array | None, ...],
    leaf_layouts: tuple[part.LeafLayout, ...],
    plan: Plan,
    mesh: Mesh,
) -> dict[str, tuple[jax.Array | None, ...]] | None:
    """Residuals for `mesh` that owe the same `mass` (padding resized to this mesh's):
    split evenly over the devices of the first hop that keeps residuals here."""
    fresh = zeros(leaf_layouts, plan, mesh)
    if fresh is None:
        return None
    nn, ll = mesh.shape["node"], mesh.shape["local"]
    n = nn * ll
    sharding = NamedSharding(mesh, SPEC)
    hop1 = any(r is not None for r in fresh["hop1"])
    out: dict[str, list[jax.Array | None]] = {k: list(v) for k, v in fresh.items()}

    def spread(lo: part.LeafLayout, m: jax.Array) -> jax.Array:
        m = blocks.stored_to_pieces(part.resize_padding(m, lo), lo, n)
        size = lo.padded_size
        if hop1:
            return jnp.broadcast_to(m / n, (n, size)).reshape(n * size)
        per = m.reshape(ll, nn * (size // n)) / nn
        return jnp.broadcast_to(per, (nn, *per.shape)).reshape(-1)

    for i, (m, lo) in enumerate(zip(mass, leaf_layouts, strict=True)):
        if m is None or not lo.sharded:
            continue
        r = jax.jit(spread, static_argnums=0, out_shardings=sharding)(lo, m)
        out["hop1" if hop1 else "hop2"][i] = r
    return {k: tuple(v) for k, v in out.items()}
