"""Tests of `make_mesh` on the 8 emulated CPU devices (tests/conftest.py sets them up)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import zeropp_jax as zpp
from zeropp_jax._mesh import AXES, make_mesh, mesh_shape


def ids(mesh: Mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.id)(mesh.devices)


def check_mesh(mesh: Mesh, shape: tuple[int, int], devices=None) -> None:
    devices = jax.devices() if devices is None else devices
    assert isinstance(mesh, Mesh)
    assert mesh.axis_names == ("node", "local") == AXES
    assert mesh.devices.shape == shape
    assert dict(mesh.shape) == {"node": shape[0], "local": shape[1]}
    assert mesh_shape(mesh) == shape
    assert tuple(mesh.axis_types) == (AxisType.Auto, AxisType.Auto)
    # Row-major over the devices in id order: node row r holds a contiguous run of devices.
    expected = np.array(sorted(d.id for d in devices)).reshape(shape)
    np.testing.assert_array_equal(ids(mesh), expected)


def test_eight_emulated_devices():
    assert jax.device_count() == 8
    assert jax.process_count() == 1
    assert zpp.make_mesh is make_mesh


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8), (8, 1)])
def test_both_sizes_given(shape):
    check_mesh(make_mesh(num_nodes=shape[0], local_size=shape[1]), shape)


@pytest.mark.parametrize(
    ("num_nodes", "shape"), [(1, (1, 8)), (2, (2, 4)), (4, (4, 2)), (8, (8, 1))]
)
def test_only_num_nodes_given(num_nodes, shape):
    check_mesh(make_mesh(num_nodes=num_nodes), shape)


@pytest.mark.parametrize(
    ("local_size", "shape"), [(8, (1, 8)), (4, (2, 4)), (2, (4, 2)), (1, (8, 1))]
)
def test_only_local_size_given(local_size, shape):
    check_mesh(make_mesh(local_size=local_size), shape)


def test_neither_given_is_one_node_in_one_process():
    check_mesh(make_mesh(), (1, 8))


def test_positional_arguments():
    check_mesh(make_mesh(2, 4), (2, 4))


def test_device_subset():
    four = jax.devices()[4:]
    check_mesh(make_mesh(devices=four), (1, 4), four)
    check_mesh(make_mesh(num_nodes=2, devices=four), (2, 2), four)
    check_mesh(make_mesh(local_size=2, devices=four), (2, 2), four)
    check_mesh(make_mesh(num_nodes=4, local_size=1, devices=four), (4, 1), four)
    # Given out of order, the devices are laid out in id order.
    shuffled = [jax.devices()[i] for i in (6, 1, 3, 0)]
    check_mesh(make_mesh(num_nodes=2, devices=shuffled), (2, 2), shuffled)


def test_mesh_runs_a_sharded_computation():
    """Auto axes: jit with a NamedSharding over both axes works without explicit types."""
    mesh = make_mesh(num_nodes=2, local_size=4)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("node", "local")))
    x = jax.device_put(np.arange(16.0, dtype=np.float32), sharding)
    total = jax.jit(lambda x: (x * 2).sum())(x)
    assert float(total) == 240.0


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(num_nodes=3, local_size=3), "num_nodes * local_size = 3 * 3 = 9"),
        (dict(num_nodes=2, local_size=2), "2 * 2 = 4"),
        (dict(num_nodes=4, local_size=4), "4 * 4 = 16"),
        (dict(num_nodes=3), "num_nodes=3"),
        (dict(num_nodes=5), "num_nodes=5"),
        (dict(local_size=3), "local_size=3"),
        (dict(num_nodes=0), "num_nodes=0"),
        (dict(num_nodes=-1), "num_nodes=-1"),
        (dict(local_size=0), "local_size=0"),
        (dict(local_size=-2), "local_size=-2"),
        (dict(num_nodes=True), "num_nodes=True"),
        (dict(num_nodes=2.0), "num_nodes=2.0"),
        (dict(local_size="4"), "local_size='4'"),
        (dict(devices=[]), "no devices"),
        (dict(num_nodes=3, devices=jax.devices()[:4]), "num_nodes=3"),
    ],
    ids=repr,
)
def test_invalid_shapes_raise(kwargs, fragment):
    with pytest.raises(ValueError, match="make_mesh") as info:
        make_mesh(**kwargs)
    assert fragment in str(info.value)


def test_mesh_shape_rejects_foreign_mesh():
    foreign = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    with pytest.raises(ValueError, match="'node', 'local'"):
        mesh_shape(foreign)
