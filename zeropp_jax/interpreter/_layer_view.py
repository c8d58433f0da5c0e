"""Which layer of a stored leaf each iteration of a scan reads, through the layout-only
equations between the leaf and the scan.

A model may move, reshape, slice or reverse a stacked weight before it scans over it
(MaxText's `param_scan_axis=1` transposes the layer axis to the front; a scan over any
axis is a `moveaxis` first; `reverse=True` reads the layers backwards). `layer_view`
follows a chain of such equations back from the scan's axis 0 to one axis of the leaf,
and writes the chain as it applies to one layer. Shapes are those of the full (gathered)
weight.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

Chain = tuple[tuple[Any, dict[str, Any]], ...]
"""Layout-only equations `(primitive, params)`, applied in order."""


@dataclasses.dataclass(frozen=True)
class LayerView:
    """How a scan's iterations read a leaf.

    Iteration k reads layer `start + step * k` along `axis` of the leaf, with `chain`
    applied to that layer (the leaf indexed at that layer, `axis` removed).

    Attributes:
      axis: the leaf's axis the scan runs over.
      start: the layer iteration 0 reads.
      step: layers between consecutive iterations (negative: backwards).
      chain: the equations that turn one layer into what the scan's body reads.
    """

    axis: int
    start: int
    step: int
    chain: Chain

    def layers(self, length: int) -> list[int]:
        """The leaf's layer read by each of `length` iterations."""
        return [self.start + self.step * k for k in range(length)]


def out_shape(name: str, shape: tuple[int, ...], params: dict[str, Any]) -> tuple[int, ...] | None:
    """The shape a layout-only equation `name` makes of `shape` (None: not one of them)."""
    if name in ("convert_element_type", "copy", "copy_p", "pcast"):
        return shape
    if name == "transpose":
        return tuple(shape[p] for p in params["permutation"])
    if name == "reshape":
        return tuple(params["new_sizes"])
    if name == "squeeze":
        return tuple(d for k, d in enumerate(shape) if k not in params["dimensions"])
    if name == "broadcast_in_dim":
        return tuple(params["shape"])
    if name == "slice":
        strides = params["strides"] or (1,) * len(shape)
        return tuple(
            -(-(hi - lo) // s)
            for lo, hi, s in zip(
                params["start_indices"], params["limit_indices"], strides, strict=True
            )
        )
    if name == "rev":
        return shape
    return None


def layer_view(shape: tuple[int, ...], chain: Chain) -> LayerView | None:
    """How a scan over axis 0 of `chain` applied to a leaf of `shape` reads that leaf, or
    None when a step of the chain does not keep that axis whole (a reshape that merges it
    with another, a broadcast along it, an equation not listed in `out_shape`)."""
    shapes = [tuple(shape)]
    for prim, params in chain:
        s = out_shape(prim.name, shapes[-1], params)
        if s is None:
            return None
        shapes.append(s)
    if len(shapes[-1]) == 0:
        return None
    # Back from axis 0 of the result to the leaf's axis, composing the layer index map
    # (iteration k reads index start + step * k of the current array).
    pos, start, step = 0, 0, 1
    positions = [0]
    for (prim, params), s_in, s_out in zip(
        reversed(chain), reversed(shapes[:-1]), reversed(shapes[1:]), strict=True
    ):
        back = _back(prim.name, params, s_in, s_out, pos)
        if back is None:
            return None
        pos, (a, b) = back
        start, step = a + b * start, b * step
        positions.append(pos)
    positions.reverse()  # positions[j]: the layer axis in shapes[j]
    per_layer = []
    for (prim, params), p_in, p_out, s_in, s_out in zip(
        chain, positions[:-1], positions[1:], shapes[:-1], shapes[1:], strict=True
    ):
        per_layer.append((prim, _layer_params(prim.name, params, p_in, p_out, s_in, s_out)))
    return LayerView(axis=pos, start=start, step=step, chain=tuple(per_layer))


def _back(
    name: str, params: dict[str, Any], s_in: Sequence[int], s_out: Sequence[int], pos: int
) -> tuple[int, tuple[int, int]] | None:
    """The input axis that output axis `pos` comes from, and the index map `(a, b)`:
    output index k reads input index `a + b * k`; None if `pos` is not one whole axis of
    the input."""
    same = (0, 1)
    if name in ("convert_element_type", "copy", "copy_p", "pcast"):
        return pos, same
    if name == "transpose":
        return params["permutation"][pos], same
    if name == "reshape":
        if params.get("dimensions") is not None:
            return None
        before = math.prod(s_out[:pos])
        for q in range(len(s_in)):
            if math.prod(s_in[:q]) == before and s_in[q] == s_out[pos]:
                return q, same
        return None
    if name == "squeeze":
        kept = [k for k in range(len(s_in)) if k not in params["dimensions"]]
        return kept[pos], same
    if name == "broadcast_in_dim":
        dims = list(params["broadcast_dimensions"])
        if pos not in dims or s_in[dims.index(pos)] != s_out[pos]:
            return None
        return dims.index(pos), same
    if name == "slice":
        strides = params["strides"] or (1,) * len(s_in)
        return pos, (params["start_indices"][pos], strides[pos])
    if name == "rev":
        if pos in params["dimensions"]:
            return pos, (s_in[pos] - 1, -1)
        return pos, same
    return None


def _layer_params(
    name: str,
    params: dict[str, Any],
    p_in: int,
    p_out: int,
    s_in: Sequence[int],
    s_out: Sequence[int],
) -> dict[str, Any]:
    """`params` of the equation as it applies to one layer (the layer axis removed)."""

    def drop(seq, k):
        return tuple(x for j, x in enumerate(seq) if j != k)

    def renumber(axes, k):
        return tuple(a - (a > k) for a in axes if a != k)

    p = dict(params)
    if name == "transpose":
        p["permutation"] = renumber(drop(params["permutation"], p_out), p_in)
    elif name == "reshape":
        p["new_sizes"] = drop(s_out, p_out)
        if "sharding" in p:
            p["sharding"] = None
    elif name == "squeeze":
        p["dimensions"] = renumber(params["dimensions"], p_in)
    elif name == "broadcast_in_dim":
        p["shape"] = drop(s_out, p_out)
        p["broadcast_dimensions"] = renumber(drop(params["broadcast_dimensions"], p_in), p_out)
        if "sharding" in p:
            p["sharding"] = None
    elif name == "slice":
        p["start_indices"] = drop(params["start_indices"], p_in)
        p["limit_indices"] = drop(params["limit_indices"], p_in)
        if params["strides"] is not None:
            p["strides"] = drop(params["strides"], p_in)
    elif name == "rev":
        p["dimensions"] = renumber(params["dimensions"], p_in)
    return p
