"""Sharded init and planning from shapes: `TrainState.create(params=zpp.ShardedInit(fn))`
against the materialised tree, `TrainState.abstract` against `create`, restoring onto an abstract
target."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax import baselines
from zeropp_jax.state import _partition as part
from zeropp_jax.state import _state_init as state_init
from zeropp_jax.train.cli import train_step
from zeropp_jax.train.model import GPT, GPTConfig

GPT_CFG = GPTConfig(vocab_size=96, seq_len=16, d_model=40, n_layers=3, n_heads=2, scan=True)
MODEL = GPT(GPT_CFG)
TX = optax.adamw(1e-3)
CONFIGS = {
    "zero3": zpp.ZeroPPConfig.zero3(),
    "zeropp": zpp.ZeroPPConfig(),
    "delta_ef_sr": zpp.ZeroPPConfig(
        weight_delta_bits=4, error_feedback="all", stochastic_rounding=True
    ),
}


def init_fn(seed=0):
    tokens = jnp.zeros((1, GPT_CFG.seq_len), jnp.int32)
    return zpp.ShardedInit(lambda: MODEL.init(jax.random.key(seed), tokens)["params"])


@pytest.fixture(scope="module")
def mesh():
    return zpp.make_mesh(num_nodes=2, local_size=4)


def create(mesh, config, params):
    return zpp.TrainState.create(
        apply_fn=MODEL.apply, params=params, tx=TX, mesh=mesh, config=config
    )


def assert_same_arrays(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for (path, x), y in zip(la, lb, strict=True):
        name = jax.tree_util.keystr(path)
        assert x.sharding == y.sharding, name
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sharded_init_equals_eager_init_bit_for_bit(mesh, name):
    config = CONFIGS[name]
    eager = create(mesh, config, jax.jit(init_fn())())
    lazy = create(mesh, config, init_fn())
    assert_same_arrays(lazy, eager)
    assert lazy.layouts == eager.layouts


def test_a_bare_callable_is_refused_not_guessed(mesh):
    fn = init_fn().fn
    for build in (zpp.TrainState.create, zpp.TrainState.abstract):
        with pytest.raises(ValueError, match=r"callable.*zpp\.ShardedInit\(fn\)"):
            build(apply_fn=MODEL.apply, params=fn, tx=TX, mesh=mesh)
    with pytest.raises(ValueError, match=r"callable.*zpp\.ShardedInit\(fn\)"):
        baselines.xla_fsdp_state(apply_fn=MODEL.apply, params=fn, tx=TX, mesh=mesh)
    with pytest.raises(ValueError, match="zero-argument callable"):
        zpp.ShardedInit({"w": jnp.zeros(3)})


def test_sharded_init_program_holds_no_unsharded_tree(mesh):
    """Per device, XLA's memory analysis of the init program: its outputs are one shard of
    every leaf, and outputs and temporaries together stay below half the unsharded tree (a
    program that built the tree on a device, or returned it replicated, needs all of it;
    measured at d_model 512 x 4 scanned layers: temporaries 7.5 MB, a device's share of the
    tree 6.4 MB, the tree 51 MB)."""
    fn = init_fn()
    shapes = jax.eval_shape(fn)
    layouts = tuple(
        jax.tree_util.tree_leaves(part.param_layouts(shapes, mesh.size), is_leaf=part.is_layout)
    )
    shardings = [jax.sharding.NamedSharding(mesh, part.leaf_spec(lo)) for lo in layouts]
    m = state_init.sharded_init(fn, layouts, shardings).lower().compile().memory_analysis()
    full = sum(4 * lo.size for lo in layouts)
    stored = sum(4 * lo.padded_size for lo in layouts)
    tuple_table = 8 * len(layouts)  # the output tuple's pointers
    assert stored // mesh.size <= m.output_size_in_bytes <= stored // mesh.size + tuple_table
    assert m.temp_size_in_bytes + m.output_size_in_bytes < full / 2, (m.temp_size_in_bytes, full)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_abstract_state_is_the_created_state_as_shapes(mesh, name, compile_cache):
    # The step from arrays is the step from shapes: its compile finds the program in
    # `compile_cache` (a program that differs misses the cache and compiles anew).
    config = CONFIGS[name]
    real = create(mesh, config, init_fn())
    shapes = zpp.TrainState.abstract(
        apply_fn=MODEL.apply, params=init_fn(), tx=TX, mesh=mesh, config=config
    )
    paths = lambda t: [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t)]  # noqa: E731
    assert paths(shapes) == paths(real)
    assert shapes.layouts == real.layouts
    for x, y in zip(
        jax.tree_util.tree_leaves(shapes), jax.tree_util.tree_leaves(real), strict=True
    ):
        assert isinstance(x, jax.ShapeDtypeStruct)
        assert (x.shape, x.dtype, x.sharding) == (y.shape, y.dtype, y.sharding)
    if name != "zeropp":
        return
    # planning: the step compiled from shapes alone is the step compiled from arrays
    step = zpp.shard(train_step)
    batch = jax.ShapeDtypeStruct((8, GPT_CFG.seq_len + 1), jnp.int32)
    planned = step.lower(shapes, batch).compile().memory_analysis()
    concrete = step.lower(real, np.zeros(batch.shape, np.int32)).compile().memory_analysis()
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
        assert getattr(planned, field) == getattr(concrete, field), field


def test_abstract_takes_a_tree_of_shapes(mesh):
    tree = jax.eval_shape(init_fn())
    a = zpp.TrainState.abstract(apply_fn=MODEL.apply, params=tree, tx=TX, mesh=mesh)
    b = zpp.TrainState.abstract(apply_fn=MODEL.apply, params=init_fn(), tx=TX, mesh=mesh)
    assert jax.tree.leaves(a) == jax.tree.leaves(b)
    assert a.param_count == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def test_restore_onto_an_abstract_target(mesh, tmp_path):
    """Onto another mesh (re-padding every leaf) with weight-delta references (rebuilt) and
    error-feedback residuals (re-spread): the same state as restoring onto a created one."""
    config = CONFIGS["delta_ef_sr"]
    state = create(mesh, config, init_fn())
    state = state.replace(step=state.step + 3)
    path = zpp.save_checkpoint(str(tmp_path / "ckpt"), state)
    other = zpp.make_mesh(num_nodes=1, local_size=4, devices=jax.devices()[:4])
    concrete = zpp.restore_checkpoint(path, create(other, config, init_fn(seed=5)))
    shapes = zpp.TrainState.abstract(
        apply_fn=MODEL.apply, params=init_fn(), tx=TX, mesh=other, config=config
    )
    restored = zpp.restore_checkpoint(path, shapes)
    assert not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(restored))
    assert_same_arrays(restored, concrete)
    assert int(restored.step) == 3


def test_an_abstract_state_cannot_be_stepped(mesh):
    shapes = zpp.TrainState.abstract(
        apply_fn=MODEL.apply, params=init_fn(), tx=TX, mesh=mesh, config=CONFIGS["zero3"]
    )
    batch = np.zeros((8, GPT_CFG.seq_len + 1), np.int32)
    with pytest.raises(ValueError, match="TrainState.abstract: shapes only.*TrainState.create"):
        zpp.shard(train_step)(shapes, batch)
