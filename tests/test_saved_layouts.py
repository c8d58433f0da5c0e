"""How saved leaves map onto a target's stored layout (`zeropp_jax.state._saved_layouts`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from zeropp_jax.state import _partition as part
from zeropp_jax.state import _saved_layouts as L


def test_layout_version_reads_1_to_current_and_refuses_newer():
    assert L.layout_version({}) == 1
    assert L.layout_version({"layout": 2}) == 2
    with pytest.raises(ValueError, match="restore it with the zeropp_jax that wrote it"):
        L.layout_version({"layout": part.LAYOUT_VERSION + 1})


def test_param_of_takes_the_longest_matching_path():
    tree = {"params": {"a": {"b": 1}, "b": 2}, "opt_state": {"mu": {"a": {"b": 3}}, "c": 4}}
    paths = ["['b']", "['a']['b']"]
    # leaf order: opt_state.c, opt_state.mu.a.b, params.a.b, params.b
    assert L.param_of(tree, paths) == [None, 1, 1, 0]


def test_a_stacked_leaf_saved_flat_per_layer_unflattens_into_rows():
    layout = part.leaf_layout("stack", jnp.zeros((3, 5, 7)), 8)
    x = np.arange(3 * 5 * 7, dtype=np.float32).reshape(3, 5, 7)
    want = np.asarray(part.to_master(jnp.asarray(x), layout))
    assert want.shape == (3, 5, 8)  # a row (5, 7) splits its axis 7: 1.14x, not 1.6x
    for values in (40, 56):  # layout 1 (values padded to 8) and layout 2 (rows padded)
        flat = np.zeros((3, values), np.float32)
        flat[:, :35] = x.reshape(3, 35)
        assert L.is_flat_stacked(flat.shape, layout)
        np.testing.assert_array_equal(
            np.asarray(L.unflatten(jnp.asarray(flat), layout, layout)), want
        )
    assert not L.is_flat_stacked((3, 8, 7), layout) and not L.is_flat_stacked((3, 30), layout)


def test_padded_axis_and_resize():
    assert L.padded_axis((3, 8, 7), (3, 6, 7)) == 1
    assert L.padded_axis((3, 8, 7), (3, 6, 6)) is None
    assert L.padded_axis((8,), (8, 1)) is None
    x = jnp.arange(8.0)
    np.testing.assert_array_equal(L.resize(x, 0, 6), np.arange(6.0))
    np.testing.assert_array_equal(L.resize(x, 0, 10), np.r_[np.arange(8.0), 0, 0])
