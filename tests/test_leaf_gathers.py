"""The per-leaf state of one island (`zeropp_jax.interpreter._leaf_gathers`): how present values are
spread over the leaves, and that `LeafGathers` is the interpreter's `Gathers`."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeropp_jax.interpreter import _dataflow as dataflow
from zeropp_jax.interpreter._leaf_gathers import (
    LeafGathers,
    LeafState,
    per_leaf,
    residuals_per_leaf,
)
from zeropp_jax.state import _blocks as blocks
from zeropp_jax.state import _partition as part


def test_per_leaf_spreads_present_values_in_order():
    assert per_leaf(["a", "b"], [False, True, False, True]) == (None, "a", None, "b")
    assert per_leaf([], [False, False]) == (None, None)


def test_residuals_per_leaf_pairs_the_hops_of_sharded_leaves_only():
    layouts = tuple(
        part.leaf_layout(name, x, 8)
        for name, x in [
            ("w", jnp.zeros((16, 4))),
            ("step", jnp.zeros((), jnp.int32)),  # not sharded: no residuals
            ("v", jnp.zeros((8, 8))),
        ]
    )
    assert layouts[0].sharded and not layouts[1].sharded and layouts[2].sharded
    r = [jnp.zeros(2), jnp.ones(2)]
    out = residuals_per_leaf((r, [r[0]]), ((True, True), (False, False), (True, False)), layouts)
    assert out[0] == (r[0], r[0]) and out[1] == () and out[2] == (r[1], None)
    assert residuals_per_leaf(([], []), (), layouts) == ((), (), ())


def test_leaf_gathers_is_the_interpreters_gathers():
    wanted = {n for n, _ in inspect.getmembers(dataflow.Gathers) if not n.startswith("_")}
    have = {n for n, _ in inspect.getmembers(LeafGathers) if not n.startswith("_")}
    assert wanted <= have
    # The interpreter's contract: per-leaf state lives in `LeafState`, not in more methods.
    assert len([n for n in wanted if callable(getattr(dataflow.Gathers, n))]) <= 7


def _stack_state(residuals=()):
    """A 3-layer stack's state on 8 devices: a key, a two-node reference and `residuals`."""
    layout = part.leaf_layout("stack", jnp.zeros((3, 8, 4)), 8)  # 3 layers, 4 values each
    piece = layout.padded // 8
    ref = jnp.arange(2 * 3 * piece, dtype=jnp.float32)  # two nodes' pieces, end to end
    return LeafState(key=jnp.uint32(7), ref=ref, residuals=residuals, layout=layout, num_devices=8)


def test_leaf_state_cuts_its_reference_and_residuals_to_a_layer_and_is_a_pytree():
    state = _stack_state()
    layout, piece = state.layout, state.layout.padded // 8
    bare = LeafState(key=None, ref=None, residuals=(), layout=layout, num_devices=8)
    assert state.has_reference and not bare.has_reference
    got = state.layer(1)
    np.testing.assert_array_equal(got.ref, blocks.layer_of_pieces(state.ref, 3, piece, 1))
    assert got.key is state.key and got.layout == layout and got.residuals == ()
    assert bare.layer(1).ref is None and bare.layer(1).residuals == ()
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert len(leaves) == 2 and jax.tree_util.tree_unflatten(treedef, leaves).layout == layout
    # Residuals of a stacked leaf: per-device pieces of the whole leaf, cut like the reference.
    hop1 = jnp.arange(8 * 3 * piece, dtype=jnp.float32)  # every device's piece
    fed = _stack_state((hop1, None)).layer(2)
    np.testing.assert_array_equal(fed.residuals[0], blocks.layer_of_pieces(hop1, 3, piece, 2))
    assert fed.residuals[1] is None


def test_leaf_state_cotangent_carries_the_new_residuals_only():
    hop1 = jnp.ones(8 * 3 * 4, jnp.float32)
    state = _stack_state((hop1, None))
    new = (2 * hop1, None)
    ct = state.cotangent(new)
    assert ct.residuals is new
    assert ct.key.dtype == jax.dtypes.float0 and not np.any(np.asarray(ct.ref))
    assert jax.tree_util.tree_structure(ct) == jax.tree_util.tree_structure(state)


def test_leaf_state_with_residuals_is_not_relaid():
    with pytest.raises(ValueError, match="residuals cannot be re-laid out"):
        _stack_state((jnp.zeros(8 * 3 * 4), None)).relaid(1)
