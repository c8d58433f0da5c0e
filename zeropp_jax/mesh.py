"""`make_mesh`: the `('node', 'local')` device mesh with Auto axis types."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("node", "local")


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"make_mesh: {name}={value!r}; expected a positive int or None.")


def make_mesh(
    num_nodes: int | None = None,
    local_size: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds the `('node', 'local')` mesh.

    Devices of one process always share one node row. With several processes and no shape
    given, node = process and local = that process's devices. In one process with no shape
    given, the mesh is `1 x n` (all devices sit on one host); give `num_nodes` or
    `local_size` to emulate several nodes (e.g. 2 x 4 on 8 emulated CPU devices).

    Args:
      num_nodes: size of the `node` axis, or None to derive it.
      local_size: size of the `local` axis, or None to derive it.
      devices: devices to use (default: all of `jax.devices()`).

    Returns:
      A `jax.sharding.Mesh` of shape `(num_nodes, local_size)` with Auto axis types.

    Raises:
      ValueError: when the shape does not multiply to the device count, or would split one
        process's devices across node rows.
    """
    _check_positive("num_nodes", num_nodes)
    _check_positive("local_size", local_size)
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs)
    if n == 0:
        raise ValueError("make_mesh: no devices given.")
    devs.sort(key=lambda d: (d.process_index, d.id))
    procs = sorted({d.process_index for d in devs})
    if num_nodes is None and local_size is None:
        num_nodes = len(procs)
    if num_nodes is None:
        if n % local_size:
            raise ValueError(
                f"make_mesh: local_size={local_size} does not divide the {n} devices; "
                f"pick a divisor of {n}."
            )
        num_nodes = n // local_size
    if local_size is None:
        if n % num_nodes:
            raise ValueError(
                f"make_mesh: num_nodes={num_nodes} does not divide the {n} devices; "
                f"pick a divisor of {n}."
            )
        local_size = n // num_nodes
    if num_nodes * local_size != n:
        raise ValueError(
            f"make_mesh: num_nodes * local_size = {num_nodes} * {local_size} = "
            f"{num_nodes * local_size}, but there are {n} devices; the product must equal "
            "the device count."
        )
    grid = np.array(devs, dtype=object).reshape(num_nodes, local_size)
    if len(procs) > 1:
        for p in procs:
            rows = {i for i in range(num_nodes) for d in grid[i] if d.process_index == p}
            if len(rows) > 1:
                raise ValueError(
                    f"make_mesh: shape ({num_nodes}, {local_size}) splits the devices of "
                    f"process {p} across node rows {sorted(rows)}; a node must hold whole "
                    "processes. Use num_nodes = number of hosts."
                )
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    """`(num_nodes, local_size)` of a `('node', 'local')` mesh."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(
            f"expected a mesh with axes {AXES} (from zeropp_jax.make_mesh), got axes "
            f"{tuple(mesh.axis_names)}."
        )
    return int(mesh.shape["node"]), int(mesh.shape["local"])
