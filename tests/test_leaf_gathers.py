"""The per-leaf state of one island (`zeropp_jax.leaf_gathers`): how present values are
spread over the leaves, and that `LeafGathers` is the interpreter's `Gathers`."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax import dataflow
from zeropp_jax import partition as part
from zeropp_jax.leaf_gathers import Fixed, LeafGathers, per_leaf, residuals_per_leaf


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
    # The interpreter's contract: per-leaf state lives in `Fixed`, not in more methods.
    assert len([n for n in wanted if callable(getattr(dataflow.Gathers, n))]) <= 8


def test_fixed_cuts_its_reference_to_a_layer_and_is_a_pytree():
    layout = part.leaf_layout("stack", jnp.zeros((3, 8, 4)), 8)  # 3 layers, 4 values each
    piece = layout.padded // 8
    ref = jnp.arange(2 * 3 * piece, dtype=jnp.float32)  # two nodes' pieces, end to end
    f = Fixed(jnp.uint32(7), ref, layout, 8)
    assert f.has_reference and not Fixed(None, None, layout, 8).has_reference
    got = f.layer(1)
    np.testing.assert_array_equal(got.ref, part.layer_of_pieces(ref, 3, piece, 1))
    assert got.key is f.key and got.layout == layout
    assert Fixed(None, None, layout, 8).layer(1).ref is None
    leaves, treedef = jax.tree_util.tree_flatten(f)
    assert len(leaves) == 2 and jax.tree_util.tree_unflatten(treedef, leaves).layout == layout
