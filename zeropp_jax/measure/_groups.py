"""Replica groups on a mesh: the mesh coordinates of a collective's devices, the axes a
group spans and whether it crosses nodes (what the ledger maps each collective to)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from jax.sharding import Mesh


def device_coords(mesh: Mesh, ids: Iterable[int]) -> dict[int, tuple[int, ...]]:
    """Mesh coordinates of logical device ids (positions in `mesh.devices.flat`)."""
    shape = mesh.devices.shape
    out = {}
    for i in ids:
        if not 0 <= i < mesh.devices.size:
            raise ValueError(
                f"device id {i} in the HLO is outside the mesh of {mesh.devices.size} devices "
                f"{dict(mesh.shape)}; pass the mesh the step runs on as mesh=."
            )
        out[i] = tuple(int(c) for c in np.unravel_index(i, shape))
    return out


def group_axes(mesh: Mesh, groups: Sequence[Sequence[int]]) -> tuple[str, ...]:
    """Mesh axes along which members of some group differ, in mesh order."""
    coords = device_coords(mesh, {i for g in groups for i in g})
    varying = set()
    for g in groups:
        for axis in range(len(mesh.axis_names)):
            if len({coords[i][axis] for i in g}) > 1:
                varying.add(axis)
    return tuple(name for axis, name in enumerate(mesh.axis_names) if axis in varying)


def node_of(mesh: Mesh) -> np.ndarray:
    """Node index per logical id: the `node` coordinate, else the device's process index."""
    if "node" in mesh.axis_names:
        axis = mesh.axis_names.index("node")
        return np.indices(mesh.devices.shape)[axis].reshape(-1)
    return np.array([d.process_index for d in mesh.devices.flat])


def crosses_nodes(mesh: Mesh, groups: Sequence[Sequence[int]]) -> bool:
    """Whether any group holds devices of different nodes."""
    device_coords(mesh, {i for g in groups for i in g})  # validates the ids
    nodes = node_of(mesh)
    return any(len({int(nodes[i]) for i in g}) > 1 for g in groups)
