"""Engine: sharded training against the same train_step run unsharded on one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import zeropp_jax as zpp
from zeropp_jax import _engine as engine

EXACT = dict(weight_bits=None, grad_bits=None, compute_dtype=jnp.float32)


class Net(nn.Module):
    """Odd sizes (padding on every leaf), a LayerNorm, a bias, a scalar parameter."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(37)(x)
        h = nn.LayerNorm()(jnp.tanh(h))
        h = nn.Dense(19, use_bias=False)(h)
        gain = self.param("gain", lambda k: jnp.ones((), jnp.float32))
        return nn.Dense(3)(h) * gain


def ndim_mask(params):
    return jax.tree_util.tree_map(lambda p: p.ndim > 1, params)


TX = optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1, mask=ndim_mask)
)


def train_step(state, batch):
    def loss_fn(params):
        out = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((out - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def data(seed=0, batch=16):
    rs = np.random.RandomState(seed)
    x = rs.randn(batch, 11).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]), np.cos(x[:, 1]), x[:, 2] * x[:, 3]], 1).astype(np.float32)
    return {"x": x, "y": y}


def reference(params, tx, batches):
    state = train_state.TrainState.create(apply_fn=Net().apply, params=params, tx=tx)
    step = jax.jit(train_step)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state.params, losses


def sharded(params, tx, batches, mesh, config):
    state = zpp.TrainState.create(
        apply_fn=Net().apply, params=params, tx=tx, mesh=mesh, config=config
    )
    step = zpp.shard(train_step, mesh=mesh, config=config)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def max_rel_err(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)])
@pytest.mark.parametrize("hierarchical", [False, True])
def test_unquantized_matches_single_device(shape, hierarchical):
    mesh = zpp.make_mesh(*shape)
    config = zpp.ZeroPPConfig(hierarchical=hierarchical, **EXACT)
    batch = data()
    params = Net().init(jax.random.key(0), batch["x"])["params"]
    batches = [data(i) for i in range(5)]
    ref_params, ref_losses = reference(params, TX, batches)
    state, losses = sharded(params, TX, batches, mesh, config)
    got = zpp.gather_params(state)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref_params)
    assert max_rel_err(got, ref_params) <= 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_gather_params_restores_shapes_and_dtypes():
    mesh = zpp.make_mesh(2, 4)
    params = {
        "w": jnp.arange(3 * 5, dtype=jnp.bfloat16).reshape(3, 5),
        "b": jnp.arange(7, dtype=jnp.float32),
        "s": jnp.float32(2.5),
        "table": jnp.arange(6, dtype=jnp.int32).reshape(2, 3),
        "stack": jnp.arange(2 * 3 * 3, dtype=jnp.float32).reshape(2, 3, 3),
    }
    state = zpp.TrainState.create(
        apply_fn=lambda v, x: x, params=params, tx=optax.sgd(0.1), mesh=mesh
    )
    # Master copies: float32, one axis padded to a multiple of 8 rows (the one that pads
    # least: 5 -> 8 rather than 3 -> 8; over two axes, 3 -> 4 and 5 -> 6, pads no less),
    # sharded on it; a stacked leaf (rank 3) keeps axis 0 and splits each 3 x 3 slice over
    # two axes, 4 local devices and 2 nodes (4 x 4, where one axis pads to 8 x 3); others
    # replicated.
    assert state.params["w"].shape == (3, 8) and state.params["w"].dtype == jnp.float32
    assert state.params["w"].sharding.spec == engine.part.P(None, engine.part.DP_AXES)
    assert state.params["b"].sharding.spec == engine.part.PARAM_SPEC
    assert state.params["stack"].shape == (2, 4, 4)
    assert state.params["stack"].sharding.spec == engine.part.P(None, "node", "local")
    assert state.params["table"].sharding.spec == engine.part.REPLICATED
    assert state.params["s"].sharding.spec == engine.part.REPLICATED
    got = zpp.gather_params(state)
    for k in params:
        assert got[k].shape == params[k].shape and got[k].dtype == params[k].dtype, k
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(params[k]))
    assert state.param_count == 15 + 7 + 1 + 6 + 18


def test_padding_stays_zero_and_optimizer_state_is_sharded():
    mesh = zpp.make_mesh(2, 4)
    batch = data()
    params = Net().init(jax.random.key(0), batch["x"])["params"]
    state, _ = sharded(params, TX, [batch] * 3, mesh, zpp.ZeroPPConfig())
    for lo, x in zip(state.layouts[1], jax.tree_util.tree_leaves(state.params), strict=True):
        if lo.sharded:
            padding = np.asarray(x)[lo.shape[0] :]
            assert not np.any(padding)
    mu = state.opt_state[1][0].mu
    for lo, x in zip(state.layouts[1], jax.tree_util.tree_leaves(mu), strict=True):
        if x.ndim:
            assert x.sharding.spec == engine.part.leaf_spec(lo)


def test_parameters_and_optimizer_state_take_one_eighth_per_device():
    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(8):
                x = jnp.tanh(nn.Dense(256, use_bias=False)(x))
            return x

    mesh = zpp.make_mesh(2, 4)
    x = np.ones((8, 256), np.float32)
    model = Deep()
    params = model.init(jax.random.key(0), x)["params"]
    state = zpp.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(1e-3), mesh=mesh
    )

    def step_fn(state, batch):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(state.apply_fn({"params": p}, batch) ** 2))(
            state.params
        )
        return state.apply_gradients(grads=g), {"loss": loss}

    compiled = zpp.shard(step_fn, mesh=mesh).lower(state, x).compile()
    args = compiled.memory_analysis().argument_size_in_bytes
    unsharded = 3 * 8 * 256 * 256 * 4  # params + two Adam moments, float32
    batch_bytes = x.nbytes // 8
    assert abs((args - batch_bytes) / (unsharded / 8) - 1) < 0.01, args


def test_dropout_rngs_and_pytree_outputs():
    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x, *, train: bool):
            h = nn.Dropout(0.5, deterministic=not train)(nn.Dense(16)(x))
            return (h, {"sum": h.sum(axis=1)})

    mesh = zpp.make_mesh(2, 4)
    x = np.ones((8, 4), np.float32)
    model = Drop()
    params = model.init(jax.random.key(0), x, train=False)["params"]
    state = zpp.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1), mesh=mesh)

    def step_fn(state, batch):
        def loss_fn(p):
            h, aux = state.apply_fn(
                {"params": p}, batch, train=True, rngs={"dropout": jax.random.key(3)}
            )
            return jnp.mean(aux["sum"]), h

        (loss, h), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=g), {"loss": loss, "h": h}

    _, m = zpp.shard(step_fn, mesh=mesh)(state, x)
    h = np.asarray(m["h"])
    assert h.shape == (8, 16)
    # Each device draws its own mask: rows of identical inputs differ across devices.
    assert len({tuple((h[i] == 0).tolist()) for i in range(8)}) > 1


def test_examples_run():
    from examples import linen_mlp, nnx_mlp

    assert linen_mlp.main(steps=30) < 0.5
    assert nnx_mlp.main(steps=30) < 0.5


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def setup():
    mesh = zpp.make_mesh(2, 4)
    batch = data()
    params = Net().init(jax.random.key(0), batch["x"])["params"]
    config = zpp.ZeroPPConfig()
    state = zpp.TrainState.create(
        apply_fn=Net().apply, params=params, tx=TX, mesh=mesh, config=config
    )
    return mesh, config, state, batch, params


def test_bad_batch(setup):
    mesh, config, state, batch, _ = setup
    step = zpp.shard(train_step, mesh=mesh, config=config)
    with pytest.raises(
        ValueError, match="global batch 12 is not divisible by the 8 data-parallel devices"
    ):
        step(state, data(batch=12))
    with pytest.raises(ValueError, match="disagree on the leading"):
        step(state, {"x": batch["x"], "y": batch["y"][:8]})
    with pytest.raises(ValueError, match="every batch leaf must be an array"):
        step(state, {"x": batch["x"], "y": 3.0})


def test_state_for_another_mesh_or_config(setup):
    _, config, state, batch, _ = setup
    other_mesh = zpp.make_mesh(1, 8)
    with pytest.raises(ValueError, match="state was built for mesh"):
        zpp.shard(train_step, mesh=other_mesh, config=config).lower(state, batch)
    with pytest.raises(
        ValueError, match="another ZeroPPConfig than the step .weight_bits: state 8, step None"
    ):
        zpp.shard(train_step, mesh=state.mesh, config=zpp.ZeroPPConfig.zero3()).lower(state, batch)
    plain = train_state.TrainState.create(apply_fn=Net().apply, params=setup[4], tx=TX)
    with pytest.raises(ValueError, match="expected a zeropp_jax.TrainState"):
        zpp.shard(train_step, mesh=state.mesh, config=config)(plain, batch)


def test_bad_parameters(setup):
    mesh = setup[0]
    with pytest.raises(ValueError, match=r"parameter \['w'\] is a str, not an array"):
        zpp.TrainState.create(apply_fn=None, params={"w": "x"}, tx=TX, mesh=mesh)
    with pytest.raises(ValueError, match="has dtype float64"):
        zpp.TrainState.create(
            apply_fn=None, params={"w": np.ones((4, 4), np.float64)}, tx=TX, mesh=mesh
        )
    with pytest.raises(ValueError, match="config must be a zeropp_jax.ZeroPPConfig"):
        zpp.TrainState.create(apply_fn=None, params={}, tx=TX, mesh=mesh, config={})


def test_non_batch_array_arguments_are_replicated():
    """A model argument whose leading dimension is not the batch (a position table) is
    given whole to every device, not split over them."""

    class Shift(nn.Module):
        @nn.compact
        def __call__(self, x, table):
            return nn.Dense(3)(x) + table[: x.shape[1]].sum()

    mesh = zpp.make_mesh(2, 4)
    x = np.ones((8, 4), np.float32)
    table = np.arange(16, dtype=np.float32)  # leading dimension 16, batch 8
    model = Shift()
    params = model.init(jax.random.key(0), x, table)["params"]
    state = zpp.TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=optax.sgd(0.0),
        mesh=mesh,
        config=zpp.ZeroPPConfig(**EXACT),
    )

    def step_fn(state, batch):
        out = state.apply_fn({"params": state.params}, batch, table)
        return state, {"out": out}

    _, m = zpp.shard(step_fn, mesh=mesh, config=zpp.ZeroPPConfig(**EXACT))(state, x)
    ref = model.apply({"params": params}, x, table)
    np.testing.assert_allclose(np.asarray(m["out"]), np.asarray(ref), rtol=1e-6)


def test_shard_takes_mesh_and_config_from_the_state():
    """`zpp.shard(train_step)` without mesh= or config= runs the same program as with them:
    loss and parameters equal bit for bit over two steps (with a config other than the
    default, which the step must take from the state)."""
    mesh = zpp.make_mesh(2, 4)
    config = zpp.ZeroPPConfig(**EXACT)
    model = nn.Dense(3)
    batches = [data(i) for i in range(2)]
    params = model.init(jax.random.key(0), batches[0]["x"])["params"]

    start = zpp.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(1e-2), mesh=mesh, config=config
    )

    def run(step):
        state, losses = start, []
        for b in batches:
            state, m = step(state, b)
            losses.append(np.asarray(m["loss"]))
        return losses, zpp.gather_params(state)

    got_losses, got = run(zpp.shard(train_step))
    want_losses, want = run(zpp.shard(train_step, mesh=mesh, config=config))
    np.testing.assert_array_equal(got_losses, want_losses)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_shard_compiles_per_mesh_and_config():
    """One step without checks serves states of different meshes and configs, each run
    on its own mesh."""
    model = nn.Dense(3)
    x = data()["x"]
    params = model.init(jax.random.key(0), x)["params"]

    def step_fn(state, batch):
        return state, {"out": state.apply_fn({"params": state.params}, batch)}

    step = zpp.shard(step_fn)
    ref = np.asarray(model.apply({"params": params}, x))
    for shape, config in [
        ((2, 4), EXACT),
        ((1, 8), EXACT),
        ((1, 8), dict(EXACT, hierarchical=False)),
    ]:
        mesh = zpp.make_mesh(*shape)
        state = zpp.TrainState.create(
            apply_fn=model.apply,
            params=params,
            tx=optax.sgd(0.0),
            mesh=mesh,
            config=zpp.ZeroPPConfig(**config),
        )
        _, m = step(state, x)
        assert m["out"].sharding.mesh == mesh
        np.testing.assert_allclose(np.asarray(m["out"]), ref, rtol=1e-6)


def test_shard_checks_mesh_and_config_when_given():
    batch = data()
    model = nn.Dense(3)
    params = model.init(jax.random.key(0), batch["x"])["params"]
    state = zpp.TrainState.create(
        apply_fn=model.apply, params=params, tx=TX, mesh=zpp.make_mesh(2, 4)
    )
    other_mesh = zpp.make_mesh(1, 8)
    with pytest.raises(
        ValueError,
        match=r"built for mesh \{'node': 2, 'local': 4\}.*but the step for mesh "
        r"\{'node': 1, 'local': 8\}.*leave out zpp.shard's mesh=",
    ):
        zpp.shard(train_step, mesh=other_mesh)(state, batch)
    with pytest.raises(
        ValueError,
        match=r"another ZeroPPConfig than the step \(weight_bits: state 8, step None.*"
        r"leave out zpp.shard's config=",
    ):
        zpp.shard(train_step, config=zpp.ZeroPPConfig.zero3())(state, batch)
    plain = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=TX)
    with pytest.raises(
        ValueError,
        match=r"expected a zeropp_jax.TrainState, got flax.training.train_state.TrainState; "
        r"build it with zpp.TrainState.create",
    ):
        zpp.shard(train_step)(plain, batch)
    with pytest.raises(ValueError, match="carries mesh NoneType and config NoneType"):
        zpp.shard(train_step)(state.replace(mesh=None, config=None), batch)
    with pytest.raises(
        ValueError, match="global batch 12 is not divisible by the 8 data-parallel devices"
    ):
        zpp.shard(train_step).lower(state, data(batch=12))
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        zpp.shard(train_step, mesh={"node": 2})
    with pytest.raises(ValueError, match="config must be a zeropp_jax.ZeroPPConfig, got dict"):
        zpp.shard(train_step, config={})
