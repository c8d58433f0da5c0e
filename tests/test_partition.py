"""`zeropp_jax.state._partition`'s split over two axes (stored layout 6): which rows take it,
that every device holds the block its pieces say, and that the engine trains such leaves
exactly as one device does."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _support import regression_batches, trained_beside_one_device
from test_distributed_muon import Net

import zeropp_jax as zpp
from zeropp_jax.measure import _stored_share as stored_share
from zeropp_jax.state import _blocks as blocks
from zeropp_jax.state import _partition as part


def _layout(shape, n, local):
    return part.leaf_layout("w", jax.ShapeDtypeStruct(shape, jnp.float32), n, local_size=local)


@pytest.mark.parametrize(
    "shape,nodes,local,two,ratio",
    [
        # No axis fits 1,024 devices; a pair fits 128 x 8 exactly.
        ((3, 3, 512, 512), 128, 8, True, 1.0),
        ((768, 12, 64), 128, 8, True, 1.0),
        ((12, 768, 2304), 128, 8, True, 1.0),
        # 6 over 2 nodes, 4 over 4 local devices: 1.0x, where one axis stores 1.33x.
        ((6, 4), 2, 4, True, 1.0),
        # One axis fits: kept (layout 5's rule).
        ((64, 96), 2, 4, False, 1.0),
        ((3, 3, 64, 64), 2, 4, False, 1.0),
        # No pair pads less than one axis: kept on one axis.
        ((13,), 2, 4, False, 16 / 13),
        ((5, 6, 7), 4, 2, False, 8 / 7),
    ],
)
def test_a_row_is_split_over_two_axes_only_where_one_axis_pads_above_the_limit(
    shape, nodes, local, two, ratio
):
    n = nodes * local
    lo = _layout(shape, n, local)
    one = part.leaf_layout("w", jax.ShapeDtypeStruct(shape, jnp.float32), n)
    assert lo.two_axis == two
    assert lo.padded_size / lo.size == pytest.approx(ratio)
    if two:
        assert one.padded_size / one.size > part.RATIO_LIMIT
        assert lo.grid == (local, nodes) and lo.stored_shape == shape
    else:
        assert lo == one


@pytest.mark.parametrize(
    "shape,nodes,local",
    [((6, 4), 2, 4), ((3, 4), 2, 4), ((10, 60), 2, 4), ((3, 60, 10), 2, 4), ((7, 6, 9, 4), 4, 2)],
)
def test_each_device_holds_the_block_its_piece_says(shape, nodes, local):
    """The stored leaf placed with `leaf_spec` on a `nodes x local` mesh: device (node n,
    local l)'s shard, flattened, is piece `l * nodes + n` of `stored_to_pieces` (partition
    order), and the pieces go back to the leaf (`unpiece`, `pieces_to_stored`)."""
    n = nodes * local
    lo = _layout(shape, n, local)
    assert lo.two_axis
    mesh = zpp.make_mesh(nodes, local)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1
    stored = part.to_master(x, lo)
    assert stored.shape == lo.stored_shape
    np.testing.assert_array_equal(np.asarray(part.from_master(stored, lo)), x)
    pieces = np.asarray(blocks.stored_to_pieces(stored, lo, n)).reshape(n, -1)
    placed = jax.device_put(stored, jax.sharding.NamedSharding(mesh, part.leaf_spec(lo)))
    ids = {d: (i, j) for (i, j), d in np.ndenumerate(mesh.devices)}  # (node, local)
    for shard in placed.addressable_shards:
        node, loc = ids[shard.device]
        block = lo.block_shape(n)
        assert shard.data.shape == ((lo.lead, *block) if lo.stacked else block)
        np.testing.assert_array_equal(
            np.asarray(shard.data).reshape(-1), pieces[loc * nodes + node]
        )
    flat = pieces.reshape(-1)
    np.testing.assert_array_equal(np.asarray(blocks.unpiece(jnp.asarray(flat), lo, n)), x)
    np.testing.assert_array_equal(np.asarray(blocks.pieces_to_stored(flat, lo, n)), stored)


def test_a_leaf_above_the_limit_on_two_axes_is_named_with_both():
    lo = _layout((3, 4), 8, 4)  # 3 -> 4 over 4 local devices, 4 over 2 nodes: 1.33x
    assert lo.two_axis and lo.padded_size / lo.size == pytest.approx(4 / 3)
    reason = stored_share.padding_reason(lo, 8)
    assert "two axes" in reason and "from 3 to 4" in reason


@pytest.mark.parametrize(
    "config",
    [
        dict(weight_bits=None, grad_bits=None, compute_dtype=jnp.float32, hierarchical=False),
        dict(weight_bits=None, grad_bits=None, compute_dtype=jnp.float32),
    ],
    ids=["zero3", "hpz"],
)
def test_two_axis_leaves_train_as_one_device(config):
    """Three unquantized steps of `zpp.shard` on 2 x 4 against `jax.jit` on one device:
    every kernel split over two axes, the scanned ones gathered a layer at a time; with
    and without hpZ's secondary shard."""
    data = regression_batches(3, 64, 10)
    model = Net()
    params = model.init(jax.random.key(1), data[0]["x"])["params"]
    tx = optax.adamw(1e-3, weight_decay=0.1)
    mesh = zpp.make_mesh(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", stored_share.StoredAboveShareWarning)
        state, ref = trained_beside_one_device(
            model, params, tx, mesh, zpp.ZeroPPConfig(**config), data
        )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    kernels = [lo for p, lo in zip(paths, state.layouts[1], strict=True) if "kernel" in p]
    assert len(kernels) == 3 and all(lo.two_axis for lo in kernels)
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(zpp.gather_params(state)),
        jax.tree_util.tree_leaves(ref.params),
        strict=True,
    ):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )
