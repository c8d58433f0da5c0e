"""Checkpoints: restore onto other meshes, exact resume, atomic saves, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from test_engine import TX, Net, data, train_step

import zeropp_jax as zpp
from zeropp_jax import partition as part

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
