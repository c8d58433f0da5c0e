"""Checkpoints: restore onto other meshes, exact resume, atomic saves, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from test_engine import TX, Net, data, train_step

import zeropp_jax as zpp
from zeropp_jax.state import _partition as part

CONFIG = zpp.ZeroPPConfig()


def mesh_of(shape, n_devices=8):
    return zpp.make_mesh(*shape, devices=jax.devices()[:n_devices])


def fresh(mesh, config=CONFIG, model=None, tx=TX):
    model = model or Net()
    params = model.init(jax.random.key(0), data()["x"])["params"]
    return zpp.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx, mesh=mesh, config=config
    )


def run(state, steps, start=0):
    step = zpp.shard(train_step, mesh=state.mesh, config=state.config)
    for i in range(start, start + steps):
        state, _ = step(state, data(i))
    return state


def logical(state):
    """Parameters and Adam moments without padding, in their original shapes, as numpy."""
    treedef, layouts = state.layouts

    def unpad(tree):
        leaves = jax.tree_util.tree_leaves(tree)
        return [
            np.asarray(part.from_master(x, lo, np.float32)) if lo.sharded else np.asarray(x)
            for x, lo in zip(leaves, layouts, strict=True)
        ]

    adam = state.opt_state[1][0]
    return unpad(state.params) + unpad(adam.mu) + unpad(adam.nu) + [np.asarray(adam.count)]


def assert_same(a, b):
    for x, y in zip(logical(a), logical(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_reshard_across_meshes_and_back(tmp_path):
    state = run(fresh(mesh_of((2, 4))), 3)
    zpp.save_checkpoint(tmp_path / "a", state)
    for shape, n in (((1, 8), 8), ((4, 2), 8), ((1, 4), 4), ((2, 2), 4)):
        target = fresh(mesh_of(shape, n))
        restored = zpp.restore_checkpoint(tmp_path / "a", target)
        assert restored.mesh == target.mesh
        assert int(restored.step) == 3
        assert_same(restored, state)
        for x in jax.tree_util.tree_leaves(restored.params):
            assert x.sharding.mesh == target.mesh
    # 1x4 -> save -> back onto 2x4 (rows padded to 4, then to 8 again).
    small = zpp.restore_checkpoint(tmp_path / "a", fresh(mesh_of((1, 4), 4)))
    zpp.save_checkpoint(tmp_path / "b", small)
    back = zpp.restore_checkpoint(tmp_path / "b", fresh(mesh_of((2, 4))))
    assert_same(back, state)
    # And the restored state keeps training on its new mesh.
    run(back, 1, start=3)


def test_restore_onto_another_config(tmp_path):
    state = run(fresh(mesh_of((2, 4))), 2)
    zpp.save_checkpoint(tmp_path / "c", state)
    z3 = zpp.ZeroPPConfig.zero3()
    restored = zpp.restore_checkpoint(tmp_path / "c", fresh(mesh_of((1, 8)), config=z3))
    assert restored.config == z3
    assert_same(restored, state)


def test_resume_is_bit_exact(tmp_path):
    k = 3
    straight = run(fresh(mesh_of((2, 4))), 2 * k)
    half = run(fresh(mesh_of((2, 4))), k)
    zpp.save_checkpoint(tmp_path / "k", half)
    resumed = zpp.restore_checkpoint(tmp_path / "k", fresh(mesh_of((2, 4))))
    resumed = run(resumed, k, start=k)
    assert int(resumed.step) == 2 * k
    assert_same(resumed, straight)


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    first = run(fresh(mesh_of((2, 4))), 1)
    zpp.save_checkpoint(path, first)
    later = run(first, 1, start=1)

    def crash(self, *args, **kwargs):
        raise RuntimeError("simulated crash mid-save")

    monkeypatch.setattr(ocp.StandardCheckpointer, "wait_until_finished", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        zpp.save_checkpoint(path, later, overwrite=True)
    monkeypatch.undo()
    restored = zpp.restore_checkpoint(path, fresh(mesh_of((2, 4))))
    assert int(restored.step) == 1
    assert_same(restored, first)
    # A save that fails with an exception removes its half-written '.saving-*' folder (a
    # SIGKILL would leave it, under that name, never read).
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert leftovers == []


def test_checkpoint_errors(tmp_path):
    state = fresh(mesh_of((2, 4)))
    zpp.save_checkpoint(tmp_path / "e", state)
    with pytest.raises(ValueError, match="already exists; pass overwrite=True"):
        zpp.save_checkpoint(tmp_path / "e", state)
    with pytest.raises(ValueError, match="not a zeropp_jax checkpoint"):
        zpp.restore_checkpoint(tmp_path, state)

    class Other(Net):
        @jax.named_call
        def __call__(self, x):
            return super().__call__(x[:, :5])

    other = fresh(mesh_of((2, 4)), model=Other())
    with pytest.raises(ValueError, match="parameter tree differs from the target"):
        zpp.restore_checkpoint(tmp_path / "e", other)
    with pytest.raises(ValueError, match="optimizer state has a different structure"):
        zpp.restore_checkpoint(tmp_path / "e", fresh(mesh_of((2, 4)), tx=optax.sgd(0.1)))
    with pytest.raises(ValueError, match="expects a zeropp_jax.TrainState"):
        zpp.save_checkpoint(tmp_path / "f", {"params": jnp.ones(3)})


# ----------------------------------------------------------------- the previous layout


def _stacked_state(tx, mesh):
    """A state with a stacked leaf (whose stored layout changed in versions 2 and 3), a
    leaf of rank 3 that layout 5 stores as one row (no axis of `(5, 7)` fits 8 devices,
    its axis 0 of 16 does), a matrix that layout 6 splits over two axes (`(6, 4)`: 6 over
    2 nodes, 4 over 4 local devices) and one step taken, so that the optimizer's moments
    are not zero."""
    params = {
        "stack": jnp.arange(3 * 5 * 7, dtype=jnp.float32).reshape(3, 5, 7) / 100,
        "one_row": jnp.arange(16 * 5 * 7, dtype=jnp.float32).reshape(16, 5, 7) / 1000,
        "w": jnp.ones((5, 7), jnp.float32),
        "grid": jnp.arange(6 * 4, dtype=jnp.float32).reshape(6, 4) / 10,
    }
    state = zpp.TrainState.create(apply_fn=lambda v, x: x, params=params, tx=tx, mesh=mesh)
    grads = jax.tree_util.tree_unflatten(
        state.layouts[0],
        [
            jax.device_put(part.to_master(jnp.full(lo.shape, 0.5), lo), x.sharding)
            for lo, x in zip(state.layouts[1], jax.tree_util.tree_leaves(state.params), strict=True)
        ],
    )
    return jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)


def _write_layout_1(path, state, opt_leaves, version=1):
    """`state` saved as a previous layout wrote it: layout 5 splits every row on one axis
    (`grid` (6, 4) stored (8, 4), where layout 6 stores it as it is); layout 4 keeps
    axis 0 of every leaf of rank 3 whole (`one_row` (16, 5, 7) stored (16, 5, 8), where
    layout 5 stores it as it is, split on its axis 0); layout 3 pads every leaf on its
    (row's) first axis (`stack` (3, 5, 7) stored (3, 8, 7), `w` (5, 7) stored (8, 7),
    where layouts 4 and 5 pad their last axis); stacked leaves then flattened per layer
    in version 2 (`(3, 56)`), and padded in values in version 1 (`C = ceil(35 / 8) * 8 =
    40`, not 8 rows x 7 = 56) with no `layout` field; the optimizer state's leaves are
    `opt_leaves(those leaves)`."""
    import json
    import os

    from zeropp_jax.state import _checkpoint as checkpoint

    n = 8
    by_shape = {lo.stored_shape: lo for lo in state.layouts[1] if lo.sharded}

    def old(x):
        lo = by_shape.get(tuple(x.shape))
        if lo is None:
            return x
        was = part.with_devices(lo, n, version=max(version, 3))
        x = part.to_master(part.from_master(x, lo), was)
        if not was.stacked or version >= 3:
            return x
        flat = x.reshape(was.lead, 56)
        return flat[:, :40] if version == 1 else flat

    tree = {
        "step": state.step,
        "params": jax.tree_util.tree_map(old, state.params),
        "opt_state": jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(state.opt_state),
            opt_leaves([old(x) for x in jax.tree_util.tree_leaves(state.opt_state)]),
        ),
        "skipped_steps": state.skipped_steps,
    }
    meta = checkpoint._metadata(state)
    if version == 1:
        del meta["layout"]
    else:
        meta["layout"] = version
    meta["stored_shapes"] = [list(x.shape) for x in jax.tree_util.tree_leaves(tree)]
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, checkpoint.STATE_DIR), tree)
    ckptr.wait_until_finished()
    ckptr.close()
    with open(os.path.join(path, checkpoint.META_FILE), "w") as f:
        json.dump(meta, f)


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
def test_restores_a_checkpoint_of_the_previous_layout(tmp_path, version):
    mesh = mesh_of((2, 4))
    tx = optax.adam(0.1)
    state = _stacked_state(tx, mesh)
    # Layout 4 pads the axis that fits 8 devices: 7 -> 8, where layout 3 padded 5 rows to 8.
    assert state.params["stack"].shape == (3, 5, 8)
    assert state.params["w"].shape == (5, 8)
    # Layout 5 splits `one_row` on its axis 0 (16 rows, 2 per device), unpadded.
    assert state.params["one_row"].shape == (16, 5, 7)
    assert state.params["one_row"].sharding.spec == part.P(part.DP_AXES)
    # Layout 6 splits `grid` over two axes, unpadded.
    assert state.params["grid"].shape == (6, 4)
    assert state.params["grid"].sharding.spec == part.P("node", "local")
    _write_layout_1(tmp_path / "v", state, lambda leaves: leaves, version)
    target = zpp.TrainState.create(
        apply_fn=lambda v, x: x, params=zpp.gather_params(state), tx=tx, mesh=mesh
    )
    restored = zpp.restore_checkpoint(tmp_path / "v", target)
    assert restored.params["stack"].shape == (3, 5, 8)
    for a, b in zip(
        jax.tree_util.tree_leaves((restored.params, restored.opt_state)),
        jax.tree_util.tree_leaves((state.params, state.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_previous_layout_with_shape_reading_optimizer_state_says_how_to_convert(tmp_path):
    mesh = mesh_of((2, 4))
    tx = optax.adafactor(0.1, min_dim_size_to_factor=2)
    state = _stacked_state(tx, mesh)
    # What the previous layout kept: the factored statistics of the stored (3, 40) leaf.
    layouts = state.layouts[1]
    old = jax.tree_util.tree_unflatten(
        state.layouts[0],
        [
            jax.ShapeDtypeStruct(
                (lo.shape[0], 40)
                if len(lo.shape) == 3
                else part.with_devices(lo, 8, version=1).stored_shape,
                jnp.float32,
            )
            for lo in layouts
        ],
    )
    old_leaves = [
        jnp.zeros(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(jax.eval_shape(tx.init, old))
    ]
    _write_layout_1(tmp_path / "v1", state, lambda leaves: old_leaves)
    target = zpp.TrainState.create(
        apply_fn=lambda v, x: x, params=zpp.gather_params(state), tx=tx, mesh=mesh
    )
    with pytest.raises(ValueError, match=r"stored layout 1.*reset_optimizer=True"):
        zpp.restore_checkpoint(tmp_path / "v1", target)
    restored = zpp.restore_checkpoint(tmp_path / "v1", target, reset_optimizer=True)
    assert int(restored.step) == 1
    for a, b in zip(
        jax.tree_util.tree_leaves((restored.params, restored.opt_state)),
        jax.tree_util.tree_leaves((state.params, target.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_two_axis_leaves_restore_onto_other_grids_with_moments_and_residuals(tmp_path):
    """A state whose kernels are stored split over two axes on 2 x 4 (`test_distributed_muon.Net`:
    `local` on one axis, `node` on the other), with Adam moments and error-feedback
    residuals, saved and restored onto 4 x 2 (the other grid), 1 x 8 (one axis) and 2 x 4:
    parameters and moments exactly, the residuals' missing mass to float summation order,
    and training goes on."""
    from _support import regression_batches
    from _support import train_step as plain_step
    from test_distributed_muon import Net as GridNet

    from zeropp_jax.state import _residuals as R

    config = zpp.ZeroPPConfig(
        weight_bits=None, grad_bits=2, grad_block_size=32, compute_dtype=jnp.float32
    ).replace(error_feedback="all")
    batches = regression_batches(3, 64, 10)
    params = GridNet().init(jax.random.key(0), batches[0]["x"])["params"]

    def make(shape):
        return zpp.TrainState.create(
            apply_fn=GridNet().apply,
            params=params,
            tx=optax.adam(1e-2),
            mesh=mesh_of(shape),
            config=config,
        )

    def values(state):
        layouts = state.layouts[1]
        adam = state.opt_state[0]
        trees = (R.split(state.params)[0], adam.mu, adam.nu)
        return [
            np.asarray(part.from_master(x, lo, np.float32))
            for tree in trees
            for x, lo in zip(jax.tree_util.tree_leaves(tree), layouts, strict=True)
        ]

    def owed(state, nodes, local):
        mass = R.missing_mass(state.params[R.KEY], state.layouts[1], nodes, local)
        return [
            None if m is None else np.asarray(part.from_master(m, lo, np.float32))
            for m, lo in zip(mass, state.layouts[1], strict=True)
        ]

    state = make((2, 4))
    # Its three kernels and the scanned biases, (2, 60): 2 over the nodes, 60 over `local`.
    assert sum(lo.two_axis for lo in state.layouts[1]) == 4
    step = zpp.shard(plain_step)
    for b in batches[:2]:
        state, _ = step(state, b)
    zpp.save_checkpoint(tmp_path / "grid", state)
    want_owed = owed(state, 2, 4)
    assert max(np.abs(m).max() for m in want_owed if m is not None) > 0
    for shape in ((4, 2), (1, 8), (2, 4)):
        target = make(shape)
        restored = zpp.restore_checkpoint(tmp_path / "grid", target)
        for a, b in zip(values(restored), values(state), strict=True):
            np.testing.assert_array_equal(a, b)
        for g, w in zip(owed(restored, *shape), want_owed, strict=True):
            assert (g is None) == (w is None)
            if w is not None:
                np.testing.assert_allclose(g, w, rtol=0, atol=1e-7)
        _, metrics = zpp.shard(plain_step)(restored, batches[2])
        assert np.isfinite(float(metrics["loss"]))
