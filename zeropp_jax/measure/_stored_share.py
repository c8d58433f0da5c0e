"""How far each stored parameter leaf exceeds its share of the state, and why.

A leaf's share on `N` data-parallel devices is `size / N` of its values per device. The
stored layout (`zeropp_jax.state._partition`) splits one axis of each kept row (the leaf; each
slice of a leaf of rank 3 or more whose axis 0 is kept whole as a layer axis,
`partition.keeps_layers`) into
blocks of whole rows, one per device, padding that axis to a multiple of `N`: the first
axis, unless another pads less and the first more than `RATIO_LIMIT` times
(`partition.fit_axis`), or, where that pads above `RATIO_LIMIT` and two axes pad less, one
over the `local` devices and one over the nodes (`partition.fit_grid`); a tensor-parallel
leaf pads each `model` slice's first axis. The
master weights, the optimizer moments that mirror them and every gather of the leaf carry
that padding, so a leaf stored at `r` times its share costs `r` times its share in memory
and bytes (the ledger counts the padded bytes).

`over_share` names the leaves stored above `RATIO_LIMIT` times their share, with the
reason; `TrainState.create` warns once with that list (`StoredAboveShareWarning`), so the
padding is never a silent tax. Leaves under `EXEMPT_BYTES` of float32 master weights
(biases, norm scales, small heads) are not named: their padding is at most that much per
leaf over all devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from zeropp_jax.state import _partition as partition
from zeropp_jax.state._partition import LeafLayout

RATIO_LIMIT = partition.RATIO_LIMIT
"""A leaf stored above this many times its share is named."""
EXEMPT_BYTES = 64 * 1024
"""Leaves whose float32 master weights are smaller than this (16,384 values) are not named."""


class StoredAboveShareWarning(UserWarning):
    """Some parameter leaves are stored above `RATIO_LIMIT` times their share (padding)."""


@dataclasses.dataclass(frozen=True)
class Excess:
    """One leaf stored above its share.

    Attributes:
      path: the leaf's key path (`jax.tree_util.keystr`).
      shape: its global shape.
      stored_shape: the global shape it is stored in.
      ratio: stored values over its values (per device: stored over share).
      excess_bytes: float32 bytes of padding per device (master weights alone).
      reason: which rule pads it, in words.
    """

    path: str
    shape: tuple[int, ...]
    stored_shape: tuple[int, ...]
    ratio: float
    excess_bytes: float
    reason: str


def share_ratio(layout: LeafLayout, num_devices: int) -> float:
    """Per-device stored values over the leaf's share (`size / num_devices`): the padding
    factor of a sharded leaf; `num_devices` for a replicated one (stored whole)."""
    if layout.size == 0:
        return 1.0
    if not layout.sharded:
        return float(num_devices)
    return layout.padded_size / layout.size


def padding_reason(layout: LeafLayout, num_devices: int) -> str:
    """Why `layout` stores more than its values, in words."""
    if not layout.sharded:
        return f"not sharded ({layout.dtype}): stored whole on each of {num_devices} devices"
    if layout.two_axis:
        (a, pa), (b, pb) = layout.split_axes
        local, nodes = layout.grid
        return (
            f"split over two axes, its axis {a} over {local} 'local' devices and its axis {b} "
            f"over {nodes} nodes, pads them from {layout.shape[a]} to {pa} and from "
            f"{layout.shape[b]} to {pb} (no axis of {layout.row_shape} fits {num_devices} "
            "devices, and no pair of axes fits the mesh: this pair pads least)"
        )
    axis = layout.axis
    rows, padded = layout.row_shape[axis], layout.padded_rows
    if layout.tensor_parallel:
        where = f"each of its {layout.model_size} 'model' slices"
        if layout.stacked:
            where += f" of each of its {layout.lead} layers (axis 0 kept whole)"
        why = "a tensor-parallel slice pads its first axis"
    else:
        if layout.stacked:
            where = (
                f"axis 0 ({layout.lead}) is kept whole as a layer axis (splitting the whole "
                f"leaf pads no less), and each of its {layout.lead} slices"
            )
        elif len(layout.shape) >= 3:
            where = "the leaf (axis 0 not kept whole: no axis of a slice along it fits)"
        else:
            where = "the leaf"
        why = f"no axis of {layout.row_shape} divides evenly: this one pads least"
    return (
        f"{where} pads its axis {layout.padded_axis} from {rows} to {padded}, a multiple of "
        f"{num_devices} devices ({why}; each device holds a block of whole rows of it)"
    )


def over_share(
    paths: Sequence[str],
    layouts: Sequence[LeafLayout],
    num_devices: int,
    *,
    limit: float = RATIO_LIMIT,
    exempt_bytes: int = EXEMPT_BYTES,
) -> list[Excess]:
    """The sharded leaves stored above `limit` times their share whose float32 master
    weights hold at least `exempt_bytes`, largest padding first."""
    out = []
    for path, lo in zip(paths, layouts, strict=True):
        if not lo.sharded or 4 * lo.size < exempt_bytes:
            continue
        ratio = share_ratio(lo, num_devices)
        if ratio > limit:
            excess = 4 * (lo.padded_size - lo.size) / num_devices
            out.append(
                Excess(
                    path, lo.shape, lo.stored_shape, ratio, excess, padding_reason(lo, num_devices)
                )
            )
    return sorted(out, key=lambda e: -e.excess_bytes)


def state_ratio(layouts: Sequence[LeafLayout], num_devices: int) -> float:
    """Per-device stored values of all leaves over the ideal share of all of them
    (replicated leaves count whole on each device)."""
    size = sum(lo.size for lo in layouts)
    if not size:
        return 1.0
    stored = sum(lo.padded_size if lo.sharded else lo.size * num_devices for lo in layouts)
    return stored / size


def warning_text(excess: Sequence[Excess], layouts: Sequence[LeafLayout], n: int) -> str:
    """The message `TrainState.create` warns with: each leaf, its stored shape, factor and
    padding per device, and the whole state's factor."""
    lines = [
        f"{len(excess)} parameter leaves are stored above {RATIO_LIMIT}x their share of "
        f"{n} devices (the state as a whole: {state_ratio(layouts, n):.3f}x); their master "
        "weights, optimizer moments and gathers all carry the padding:"
    ]
    for e in excess:
        lines.append(
            f"  {e.path} {e.shape} stored as {e.stored_shape}: {e.ratio:.2f}x, "
            f"{e.excess_bytes / 2**20:.3f} MiB of padding per device in float32; {e.reason}"
        )
    lines.append(
        "A device count that divides one of a leaf's axes (a stacked leaf's: one after "
        "axis 0) stores it exactly (zeropp_jax.measure._stored_share)."
    )
    return "\n".join(lines)
