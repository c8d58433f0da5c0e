"""Non-finite gradients: reported, optionally skipped, never turned into finite garbage."""

import jax
import numpy as np
import pytest
from _support import per_device, rand
from test_engine import TX, Net, data, train_step

import zeropp_jax as zpp
from zeropp_jax.wire import reductions


def poisoned(i):
    b = data(i)
    b["y"][3, 1] = np.nan
    return b


@pytest.mark.parametrize("skip", [True, False])
def test_nonfinite_gradients_reported_and_skipped(skip):
    mesh = zpp.make_mesh(2, 4)
    config = zpp.ZeroPPConfig(skip_nonfinite_updates=skip)
    params = Net().init(jax.random.key(0), data()["x"])["params"]
    state = zpp.TrainState.create(
        apply_fn=Net().apply, params=params, tx=TX, mesh=mesh, config=config
    )
    step = zpp.shard(train_step, mesh=mesh, config=config)
    state, m = step(state, data(0))
    assert bool(m["grads_finite"]) and int(m["skipped_steps"]) == 0
    before = zpp.gather_params(state)
    state, m = step(state, poisoned(1))
    assert not bool(m["grads_finite"])
    assert int(state.step) == 2
    after = zpp.gather_params(state)
    if skip:
        assert int(m["skipped_steps"]) == 1
        for a, b in zip(
            jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(before), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # Training goes on from the untouched state.
        state, m = step(state, data(2))
        assert bool(m["grads_finite"]) and int(m["skipped_steps"]) == 1
        assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(state.params))
    else:
        assert int(m["skipped_steps"]) == 0
        assert any(np.any(~np.isfinite(x)) for x in jax.tree_util.tree_leaves(after))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_one_non_finite_gradient_element_on_one_device_is_skipped(bad):
    # One element of one device's block: a float max across devices dropped such a NaN
    # (grads_finite was True and the NaN reached the weights).
    mesh = zpp.make_mesh(2, 4)
    config = zpp.ZeroPPConfig(skip_nonfinite_updates=True)
    params = {"w": np.ones((64, 16), np.float32), "b": np.ones((16,), np.float32)}
    state = zpp.TrainState.create(
        apply_fn=lambda v, x: x, params=params, tx=TX, mesh=mesh, config=config
    )
    g = np.zeros((64, 16), np.float32)
    g[63, 5] = bad  # the last row: the last device's block
    grads = {"w": jax.device_put(g, state.params["w"].sharding), "b": state.params["b"] * 0}
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
    assert not bool(new.grads_finite) and int(new.skipped_steps) == 1
    np.testing.assert_array_equal(np.asarray(new.params["w"]), np.asarray(state.params["w"]))


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_block_stays_in_its_block_through_two_hops(bits, bad):
    mesh = zpp.make_mesh(2, 4)
    bs, rows = 8, 4  # each device's piece is 4 x 4 = 16 values = 2 blocks
    x = np.array(rand((2, 4, 8 * rows, 4), seed=9))
    x[1, 2, 5 * rows, 0] = bad  # device (1, 2): first value of piece 5's first block
    kw = dict(bits=bits, block_size=bs, node_bits=bits, node_block_size=bs)
    got = per_device(mesh, lambda s: reductions.two_hop_reduce_scatter(s, **kw), x)
    # Piece 5 is owned by device (n, l) with l * 2 + n = 5: (1, 2).
    for n in range(2):
        for l in range(4):
            out = got[n, l].reshape(-1)
            if (n, l) == (1, 2):
                assert np.all(~np.isfinite(out[:bs])), out[:bs]
                assert np.all(np.isfinite(out[bs:]))
            else:
                assert np.all(np.isfinite(out)), (n, l)
