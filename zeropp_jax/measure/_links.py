"""Bytes through each node's network link: the device-to-device transfers a collective's
algorithm makes over its replica groups (see `zeropp_jax.measure._ledger` for the models)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from jax.sharding import Mesh

from zeropp_jax.measure._hlo_text import COLLECTIVE_OPS

LINK_MODELS = ("gloo", "nccl")
"""Collective algorithms the per-link bytes can follow (`comm_ledger(..., links=)`)."""


def _ring(order: Sequence[int], per_edge: float) -> Iterator[tuple[int, int, float]]:
    """The edges of a ring over `order`, each carrying `per_edge` bytes."""
    for k, src in enumerate(order):
        dst = order[(k + 1) % len(order)]
        if dst != src:
            yield src, dst, per_edge


def _halving(order: Sequence[int], in_bytes: float) -> Iterator[tuple[int, int, float]]:
    """gloo's recursive-halving reduce-scatter: step s sends in/2^(s+1) to the rank 2^s away."""
    size = len(order)
    distance, chunk = 1, in_bytes / 2
    while distance < size:
        for rank, src in enumerate(order):
            yield src, order[rank ^ distance], chunk
        distance, chunk = distance * 2, chunk / 2


def transfers(
    op: str,
    groups: Sequence[Sequence[int]],
    in_bytes: float,
    out_bytes: float,
    nodes: np.ndarray,
    links: str,
) -> Iterator[tuple[int, int, float]]:
    """The device-to-device transfers `(source id, target id, bytes)` of one execution.

    Args:
      op: one of `COLLECTIVE_OPS`.
      groups: replica groups (logical ids, in rank order); for a collective-permute its
        `(source, target)` pairs.
      in_bytes: operand bytes per device.
      out_bytes: result bytes per device.
      nodes: node index per logical id (`groups.node_of`).
      links: one of `LINK_MODELS`: the algorithms to follow (see the module docstring).
    """
    if links not in LINK_MODELS:
        raise ValueError(f"links={links!r}; expected one of {LINK_MODELS}.")
    if op == "collective-permute":
        for src, dst in groups:
            yield src, dst, float(in_bytes)
        return
    for group in groups:
        size = len(group)
        if size < 2:
            continue
        share = (size - 1) / size
        ring = sorted(group, key=lambda i: int(nodes[i])) if links == "nccl" else list(group)
        if op == "all-to-all":
            for src in group:
                for dst in group:
                    if dst != src:
                        yield src, dst, in_bytes / size
        elif op == "all-gather":
            yield from _ring(ring, out_bytes * share)
        elif op == "all-reduce":
            yield from _ring(ring, 2 * in_bytes * share)
        elif op == "reduce-scatter":
            if links == "gloo" and size & (size - 1) == 0:
                yield from _halving(group, in_bytes)
            else:
                yield from _ring(ring, in_bytes * share)
        else:
            raise ValueError(f"transfers: op={op!r}; expected one of {COLLECTIVE_OPS}.")


def node_traffic(
    op: str,
    groups: Sequence[Sequence[int]],
    in_bytes: float,
    out_bytes: float,
    nodes: np.ndarray,
    links: str,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Bytes leaving and entering each node's network link in one execution of a collective.

    Arguments as for `transfers`. Returns `(out, in)`, each indexed by node.
    """
    num_nodes = int(nodes.max()) + 1 if nodes.size else 0
    leaving, entering = np.zeros(num_nodes), np.zeros(num_nodes)
    for src, dst, nbytes in transfers(op, groups, in_bytes, out_bytes, nodes, links):
        if nodes[src] != nodes[dst]:
            leaving[nodes[src]] += nbytes
            entering[nodes[dst]] += nbytes
    return tuple(leaving.tolist()), tuple(entering.tolist())


def default_links(mesh: Mesh) -> str:
    """`'gloo'` for a mesh of CPU devices (XLA:CPU's collectives), else `'nccl'`."""
    return "gloo" if mesh.devices.flat[0].platform == "cpu" else "nccl"
