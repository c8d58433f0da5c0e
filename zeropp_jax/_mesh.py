"""`make_mesh`: the `('node', 'local')` device mesh with Auto axis types, or
`('node', 'local', 'model')` with a tensor-parallel axis inside each node.

A node is a physical host: the devices that talk to each other over NVLink or PCIe rather
than the network. A job may run one process per host (each process owns all of its host's
GPUs) or one process per GPU (as SLURM's `srun` and most launchers start it); either way
`make_mesh()` puts the devices of one host on one `node` row. The processes find out who
shares a host by exchanging a hash of their host names once, through one small all-gather
over one device per process (`process_hosts`).
"""

from __future__ import annotations

import collections
import hashlib
import socket
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

AXES = ("node", "local")
TP_AXES = ("node", "local", "model")


class TopologyWarning(UserWarning):
    """An explicit mesh shape that does not follow the hosts of a multi-host job."""


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"make_mesh: {name}={value!r}; expected a positive int or None.")


# ----------------------------------------------------------------------------- hosts


def _host_key(host_name: str) -> np.ndarray:
    """A 64-bit hash of a host name as two uint32 (collectives without x64 carry uint32)."""
    digest = hashlib.blake2b(host_name.encode("utf-8"), digest_size=8).digest()
    return np.frombuffer(digest, dtype="<u4").astype(np.uint32)


def _identity(x: jax.Array) -> jax.Array:
    return x


def _allgather_per_process(row: np.ndarray) -> np.ndarray:
    """Every process's `row` (1-D uint32, same length everywhere), stacked by process index.

    A collective: every process of the job must call it. It moves the rows over a mesh of
    one device per process (the one with the lowest id), so it works whatever the number
    of devices per process.
    """
    leaders: dict[int, Any] = {}
    for d in jax.devices():
        if d.process_index not in leaders or d.id < leaders[d.process_index].id:
            leaders[d.process_index] = d
    order = [leaders[p] for p in sorted(leaders)]
    mesh = Mesh(np.array(order, dtype=object), ("process",))
    mine = jax.device_put(row[None, :], leaders[jax.process_index()])
    stacked = jax.make_array_from_single_device_arrays(
        (len(order), row.size), NamedSharding(mesh, PartitionSpec("process")), [mine]
    )
    out = jax.jit(_identity, out_shardings=NamedSharding(mesh, PartitionSpec()))(stacked)
    return np.asarray(out.addressable_data(0))


def process_hosts(host_name: str | None = None) -> tuple[int, ...]:
    """The host of every process of the job, as an index, by process index.

    Processes with the same host name share an index; hosts are numbered in the order of
    their lowest process index. In a job of several processes this is a collective: every
    process must call it (`make_mesh` does), and it runs one small all-gather. In a
    single-process job it returns `(0,)` without communicating.

    Args:
      host_name: this process's host identity; default `socket.gethostname()`. Pass your
        own where host names do not identify machines (e.g. containers that get a host
        name each on one machine), or in tests to emulate several hosts on one machine.

    Returns:
      A tuple of `jax.process_count()` host indices.

    Raises:
      ValueError: when `host_name` is given but is not a non-empty string.
    """
    if host_name is not None and (not isinstance(host_name, str) or not host_name):
        raise ValueError(
            f"make_mesh: host_name={host_name!r}; expected a non-empty str or None (None = "
            "socket.gethostname())."
        )
    if jax.process_count() == 1:
        return (0,)
    keys = _allgather_per_process(_host_key(host_name or socket.gethostname()))
    index: dict[bytes, int] = {}
    return tuple(index.setdefault(k.tobytes(), len(index)) for k in keys)


# ----------------------------------------------------------------------------- layout


def _describe_hosts(counts: dict[int, int], procs: dict[int, list[int]]) -> str:
    return ", ".join(
        f"host {h} (processes {procs[h]}): {counts[h]} devices" for h in sorted(counts)
    )


def device_grid(
    devices: Sequence[Any],
    hosts: Sequence[int],
    num_nodes: int | None = None,
    local_size: int | None = None,
) -> np.ndarray:
    """Lays devices out as a `(num_nodes, local_size)` grid, one host per node row.

    Pure (no communication): `make_mesh` calls it with the hosts from `process_hosts`.
    Devices are ordered by host (hosts in the order of `hosts`' indices), then process
    index, then device id, so each process's devices are contiguous and each host's
    devices fill whole rows when the shape follows the hosts.

    Args:
      devices: objects with `id` and `process_index` (`jax.Device`s).
      hosts: the host index of every process, by process index (see `process_hosts`).
      num_nodes: size of the `node` axis, or None to derive it.
      local_size: size of the `local` axis, or None to derive it.

    Returns:
      An object array of shape `(num_nodes, local_size)` holding the devices.

    Raises:
      ValueError: for no devices; a shape that does not multiply to the device count; a
        shape that splits one process's devices across node rows; or, with neither size
        given, hosts that hold different numbers of devices.

    Warns:
      TopologyWarning: when the job spans several hosts and an explicit shape splits a
        host across node rows or puts several hosts on one row.
    """
    _check_positive("num_nodes", num_nodes)
    _check_positive("local_size", local_size)
    devs = list(devices)
    if not devs:
        raise ValueError("make_mesh: no devices given.")
    devs.sort(key=lambda d: (hosts[d.process_index], d.process_index, d.id))
    counts = collections.Counter(hosts[d.process_index] for d in devs)
    procs: dict[int, list[int]] = collections.defaultdict(list)
    for d in devs:
        h = hosts[d.process_index]
        if d.process_index not in procs[h]:
            procs[h].append(d.process_index)
    num_nodes, local_size = _grid_shape(len(devs), counts, procs, num_nodes, local_size)
    grid = np.empty(len(devs), dtype=object)
    grid[:] = devs
    grid = grid.reshape(num_nodes, local_size)
    _check_whole_processes(grid)
    if len(counts) > 1:
        _warn_unless_rows_are_hosts(grid, hosts, counts, procs)
    return grid


def _grid_shape(
    n: int,
    counts: dict[int, int],
    procs: dict[int, list[int]],
    num_nodes: int | None,
    local_size: int | None,
) -> tuple[int, int]:
    """`(num_nodes, local_size)` for `n` devices: the sizes given, the missing one derived,
    or with neither given one node per host (`counts`: devices per host)."""
    if num_nodes is None and local_size is None:
        if len(set(counts.values())) > 1:
            raise ValueError(
                "make_mesh: the hosts hold different numbers of devices ("
                + _describe_hosts(counts, procs)
                + "); one node is one host, so every host must bring the same count. "
                "Pass devices= with the same number of devices from every host, or give "
                "num_nodes and local_size to override (the mesh then does not follow the "
                "hosts)."
            )
        num_nodes = len(counts)
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
    return num_nodes, local_size


def _check_whole_processes(grid: np.ndarray) -> None:
    """Raises `ValueError` when a process's devices span several node rows of `grid`."""
    num_nodes, local_size = grid.shape
    proc_rows: dict[int, set[int]] = collections.defaultdict(set)
    for i in range(num_nodes):
        for d in grid[i]:
            proc_rows[d.process_index].add(i)
    if len(proc_rows) > 1:
        for p, rows in sorted(proc_rows.items()):
            if len(rows) > 1:
                raise ValueError(
                    f"make_mesh: shape ({num_nodes}, {local_size}) splits the devices of "
                    f"process {p} across node rows {sorted(rows)}; a node must hold whole "
                    "processes. Use num_nodes = number of hosts."
                )


def _warn_unless_rows_are_hosts(
    grid: np.ndarray,
    hosts: Sequence[int],
    counts: dict[int, int],
    procs: dict[int, list[int]],
) -> None:
    """Warns (`TopologyWarning`, at `make_mesh`'s caller) when a host spans several node
    rows of `grid` or a row holds several hosts."""
    num_nodes, local_size = grid.shape
    host_rows: dict[int, set[int]] = collections.defaultdict(set)
    for i in range(num_nodes):
        for d in grid[i]:
            host_rows[hosts[d.process_index]].add(i)
    split = {h: sorted(r) for h, r in host_rows.items() if len(r) > 1}
    shared = {
        i: sorted({hosts[d.process_index] for d in grid[i]})
        for i in range(num_nodes)
        if len({hosts[d.process_index] for d in grid[i]}) > 1
    }
    if not (split or shared):
        return
    what = []
    if split:
        what.append(
            "it splits hosts across node rows ("
            + ", ".join(f"host {h}: rows {r}" for h, r in sorted(split.items()))
            + ")"
        )
    if shared:
        what.append(
            "it puts several hosts on one node row ("
            + ", ".join(f"row {i}: hosts {h}" for i, h in sorted(shared.items()))
            + ")"
        )
    warnings.warn(
        f"make_mesh: shape ({num_nodes}, {local_size}) does not follow the "
        f"{len(counts)} hosts ({_describe_hosts(counts, procs)}): "
        + " and ".join(what)
        + ". Training stays correct, but collectives meant to stay inside a node "
        "cross the network (or the reverse), and the ledger's cross-node bytes no "
        "longer describe the inter-host link. Call make_mesh() without num_nodes "
        "and local_size for one node per host.",
        TopologyWarning,
        stacklevel=4,
    )


def make_mesh(
    num_nodes: int | None = None,
    local_size: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    *,
    model_size: int | None = None,
    host_name: str | None = None,
) -> Mesh:
    """Builds the `('node', 'local')` mesh: one node row per host.

    With `model_size`, the mesh is `('node', 'local', 'model')` of shape `(num_nodes,
    local_size, model_size)`: each node's devices are `local_size x model_size`, the
    `model` axis innermost, so a tensor-parallel group is `model_size` consecutive devices
    of one node (one host). `local_size` then counts data-parallel ranks per node
    (default: the node's devices / `model_size`). `model_size=1` gives the three-axis
    mesh with a trivial `model` axis, which trains exactly as the two-axis mesh.

    With no shape given, `node` = host and `local` = that host's devices, whether the job
    runs one process per host or one process per device: processes that share a host name
    share a node row. In one process with no shape given, the mesh is `1 x n` (all devices
    sit on one host); give `num_nodes` or `local_size` to emulate several nodes (e.g.
    2 x 4 on 8 emulated CPU devices). In a job over several hosts an explicit shape that
    does not follow the hosts still works but warns (`TopologyWarning`).

    In a multi-process job every process must call `make_mesh` (it runs one small
    all-gather of host-name hashes, see `process_hosts`).

    Args:
      num_nodes: size of the `node` axis, or None to derive it.
      local_size: size of the `local` axis, or None to derive it.
      devices: devices to use (default: all of `jax.devices()`).
      model_size: size of the tensor-parallel `model` axis, or None for the two-axis
        mesh.
      host_name: this process's host identity (default `socket.gethostname()`); see
        `process_hosts`.

    Returns:
      A `jax.sharding.Mesh` of shape `(num_nodes, local_size)` (or `(num_nodes,
      local_size, model_size)`) with Auto axis types. Node `r` holds host `r`'s devices,
      by process index and then device id.

    Raises:
      ValueError: when the shape does not multiply to the device count, would split one
        process's devices across node rows, (no shape given) the hosts hold different
        numbers of devices, or `model_size` does not divide a node's devices or would put
        one tensor-parallel group on two hosts.
    """
    _check_positive("num_nodes", num_nodes)
    _check_positive("local_size", local_size)
    _check_positive("model_size", model_size)
    devs = list(jax.devices() if devices is None else devices)
    hosts = process_hosts(host_name)
    if model_size is None:
        grid = device_grid(devs, hosts, num_nodes, local_size)
        return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))
    per_node = None if local_size is None else local_size * model_size
    grid = device_grid(devs, hosts, num_nodes, per_node)
    return Mesh(model_grid(grid, model_size, hosts), TP_AXES, axis_types=(AxisType.Auto,) * 3)


def model_grid(grid: np.ndarray, model_size: int, hosts: Sequence[int]) -> np.ndarray:
    """A `(num_nodes, devices per node)` grid split into `(num_nodes, local_size,
    model_size)`, consecutive devices of a node forming one tensor-parallel group.

    Raises:
      ValueError: when `model_size` does not divide a node's devices, or a group would
        hold devices of two hosts (tensor parallelism never crosses the network).
    """
    num_nodes, per_node = grid.shape
    if per_node % model_size:
        raise ValueError(
            f"make_mesh: model_size={model_size} does not divide the {per_node} devices of "
            f"a node; a tensor-parallel group sits inside one node, so pick a divisor of "
            f"{per_node}."
        )
    out = grid.reshape(num_nodes, per_node // model_size, model_size)
    for n in range(num_nodes):
        for l in range(out.shape[1]):
            group_hosts = sorted({hosts[d.process_index] for d in out[n, l]})
            if len(group_hosts) > 1:
                raise ValueError(
                    f"make_mesh: the tensor-parallel group at node {n}, local {l} would span "
                    f"hosts {group_hosts}; a `model` group must sit on one host. Use "
                    "num_nodes = number of hosts and a model_size that divides each host's "
                    "devices."
                )
    return out


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    """`(num_nodes, local_size)` of a `('node', 'local')` or `('node', 'local', 'model')`
    mesh: the data-parallel (ZeRO) axes."""
    if tuple(mesh.axis_names) not in (AXES, TP_AXES):
        raise ValueError(
            f"expected a mesh with axes {AXES} or {TP_AXES} (from zeropp_jax.make_mesh), got "
            f"axes {tuple(mesh.axis_names)}."
        )
    return int(mesh.shape["node"]), int(mesh.shape["local"])


def model_axis_size(mesh: Mesh) -> int:
    """Size of the mesh's tensor-parallel `model` axis (1 for a two-axis mesh)."""
    mesh_shape(mesh)
    return int(mesh.shape.get("model", 1))


def data_parallel_size(mesh: Mesh) -> int:
    """Devices a parameter is ZeRO-sharded over: `num_nodes * local_size`."""
    nodes, local = mesh_shape(mesh)
    return nodes * local
