"""Replica groups on a mesh (zeropp_jax/measure/_groups.py): axes spanned, node crossings."""

import jax
import pytest

import zeropp_jax as zpp
from zeropp_jax.measure import _groups as groups


def test_groups_axes_and_node_crossings():
    mesh = zpp.make_mesh(num_nodes=2, local_size=4)  # logical id = node * 4 + local
    assert groups.device_coords(mesh, [0, 5]) == {0: (0, 0), 5: (1, 1)}
    inside = [[0, 1, 2, 3], [4, 5, 6, 7]]
    across = [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups.group_axes(mesh, inside) == ("local",)
    assert groups.group_axes(mesh, across) == ("node",)
    assert groups.group_axes(mesh, [list(range(8))]) == ("node", "local")
    assert list(groups.node_of(mesh)) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert not groups.crosses_nodes(mesh, inside)
    assert groups.crosses_nodes(mesh, across)
    with pytest.raises(ValueError, match="device id 8 .* outside the mesh of 8 devices"):
        groups.group_axes(mesh, [[0, 8]])
    assert len(jax.devices()) == 8
