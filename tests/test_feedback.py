"""Error feedback on the two-hop gradient reduction (issue #10): the collective, its
telescoping sums, and the engine that carries the residuals through an unchanged
train_step, apply_gradients and checkpoints."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax import _choices as choices
from zeropp_jax import make_mesh
from zeropp_jax.state import _partition as part
from zeropp_jax.state import _residuals as R
from zeropp_jax.state import _saved_layouts as L
from zeropp_jax.wire import _feedback as F
from zeropp_jax.wire import reductions

MESHES = [(2, 4), (4, 2), (1, 8), (8, 1)]
ROWS, COLS = 3, 11


def rand(shape, seed=0):
    return jax.random.t(jax.random.key(seed), 2.0, shape)


def per_device(mesh, body, *xs):
    spec = P("node", "local")
    f = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(xs), out_specs=spec, check_vma=False)
    return jax.jit(f)(*xs)


def hop_residuals(shape, bits, node_bits, x):
    """Zero residuals `(r1, r2)` per device for the hops that exist and are quantized."""
    nn, ll = shape
    r1 = jnp.zeros(x.shape, jnp.float32) if ll > 1 and bits is not None else None
    r2 = jnp.zeros((nn * ROWS, COLS), jnp.float32) if nn > 1 and node_bits is not None else None
    return r1, r2


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("bits,node_bits", [(4, 4), (2, 2), (8, 4), (4, None)])
def test_without_residuals_equals_two_hop_reduce_scatter(shape, bits, node_bits):
    mesh = make_mesh(*shape)
    n = shape[0] * shape[1]
    x = rand((*shape, n * ROWS, COLS), seed=1)
    kw = dict(bits=bits, block_size=8, node_bits=node_bits, node_block_size=8)

    def body(xs):
        plain = reductions.two_hop_reduce_scatter(xs[0, 0], **kw)
        fed, r1, r2 = F.two_hop_reduce_scatter_feedback(xs[0, 0], None, None, **kw)
        assert r1 is None and r2 is None
        return jnp.stack([plain, fed])[None, None]

    out = np.asarray(per_device(mesh, body, x))
    np.testing.assert_array_equal(out[:, :, 0], out[:, :, 1])


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("bits,node_bits", [(4, 4), (2, 2), (8, 2), (4, None)])
def test_feedback_sums_lose_only_the_last_residuals(shape, bits, node_bits):
    # sum_t out_t = T * exact - (what the last residuals still owe), on every device.
    mesh = make_mesh(*shape)
    nn, ll = shape
    n, steps = nn * ll, 6
    x = rand((nn, ll, n * ROWS, COLS), seed=2)
    r1, r2 = hop_residuals(shape, bits, node_bits, x[0, 0])
    kw = dict(bits=bits, block_size=8, node_bits=node_bits, node_block_size=8)

    def body(xs):
        def step(carry, _):
            a, b = carry
            out, a, b = F.two_hop_reduce_scatter_feedback(xs[0, 0], a, b, **kw)
            return (a, b), out

        (a, b), outs = jax.lax.scan(step, (r1, r2), None, length=steps)
        z1 = jnp.zeros(xs.shape[2:]) if a is None else a
        z2 = jnp.zeros((nn * ROWS, COLS)) if b is None else b
        return outs.sum(0)[None, None], z1[None, None], z2[None, None]

    spec = P("node", "local")
    f = jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=(spec,) * 3, check_vma=False)
    total, last1, last2 = (np.asarray(a, np.float64) for a in jax.jit(f)(x))
    xs = np.asarray(x, np.float64)
    pieces = xs.reshape(nn, ll, n, ROWS * COLS)
    owed = last1.reshape(nn, ll, n, ROWS * COLS).sum((0, 1))  # per piece
    # Device (a, l) holds, after hop 1, the partial sums of pieces l * nn + j, j < nn.
    owed2 = last2.reshape(nn, ll, nn, ROWS * COLS).sum(0).reshape(n, ROWS * COLS)
    owed = owed + owed2
    exact = pieces.sum((0, 1))
    scale = np.abs(exact).max() * steps
    for dn in range(nn):
        for dl in range(ll):
            piece = dl * nn + dn
            got = total[dn, dl].reshape(-1) + owed[piece]
            np.testing.assert_allclose(got, steps * exact[piece], rtol=0, atol=2e-6 * scale)
    if r1 is not None or r2 is not None:  # else no hop quantizes: the sums are exact
        assert np.abs(owed).max() > 0  # something was fed back (the test can fail)


def test_feedback_rejects_residuals_it_cannot_use():
    mesh = make_mesh(2, 4)
    x = rand((2, 4, 8 * ROWS, COLS))

    def run(r1, r2, **kw):
        def body(xs):
            return F.two_hop_reduce_scatter_feedback(
                xs[0, 0], r1, r2, block_size=8, node_block_size=8, **kw
            )[0][None, None]

        return per_device(mesh, body, x)

    with pytest.raises(ValueError, match="unquantized"):
        run(jnp.zeros((8 * ROWS, COLS)), None, bits=None, node_bits=4)
    with pytest.raises(ValueError, match="expected float32"):
        run(None, jnp.zeros((3, COLS)), bits=4, node_bits=4)
    mesh18 = make_mesh(1, 8)
    with pytest.raises(ValueError, match="no hop 2"):
        jax.jit(
            jax.shard_map(
                lambda xs: F.two_hop_reduce_scatter_feedback(
                    xs[0, 0],
                    None,
                    jnp.zeros((ROWS, COLS)),
                    bits=4,
                    block_size=8,
                    node_bits=4,
                    node_block_size=8,
                )[0][None, None],
                mesh=mesh18,
                in_specs=(P("node", "local"),),
                out_specs=P("node", "local"),
                check_vma=False,
            )
        )(rand((1, 8, 8 * ROWS, COLS)))


def test_config_error_feedback_checks():
    with pytest.raises(ValueError, match="error_feedback='both'"):
        zpp.ZeroPPConfig(error_feedback="both")
    with pytest.raises(ValueError, match="cross-node gradient hop is unquantized"):
        zpp.ZeroPPConfig(error_feedback="node", grad_node_bits=None)
    with pytest.raises(ValueError, match="no gradient hop is quantized"):
        zpp.ZeroPPConfig(error_feedback="all", grad_bits=None)
    with pytest.raises(ValueError, match="error_feedback_decay=1.5"):
        zpp.ZeroPPConfig(error_feedback_decay=1.5)
    with pytest.raises(ValueError, match="error_feedback_reset=-1"):
        zpp.ZeroPPConfig(error_feedback_reset=-1)


# ----------------------------------------------------------------------------- engine


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jnp.tanh(nn.Dense(37)(x)))


def loss_of(state, params, b):
    return jnp.mean((state.apply_fn({"params": params}, b["x"]) - b["y"]) ** 2)


def train_step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_of(state, p, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def batch(seed):
    rs = np.random.RandomState(seed)
    x = rs.randn(16, 11).astype(np.float32)
    return {"x": x, "y": np.tanh(x[:, :3])}


EF = zpp.ZeroPPConfig(
    weight_bits=None, grad_bits=2, grad_block_size=32, compute_dtype=jnp.float32
).replace(error_feedback="all")


def make_state(config, mesh_shape=(2, 4)):
    mesh = make_mesh(*mesh_shape)
    params = Net().init(jax.random.key(0), batch(0)["x"])["params"]
    state = zpp.TrainState.create(
        apply_fn=Net().apply, params=params, tx=optax.sgd(0.1), mesh=mesh, config=config
    )
    return state, zpp.shard(train_step, mesh=mesh, config=config)


def grads_of(state, b):
    return jax.jit(jax.grad(lambda p: loss_of(state, p, b)))(state.params)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_engine_first_step_equals_plain_and_residuals_come_back_as_gradients():
    state, _ = make_state(EF)
    plain, _ = make_state(EF.replace(error_feedback=None))
    g = grads_of(state, batch(0))
    model_g, res_g = R.split(g)
    for a, b in zip(leaves(model_g), leaves(grads_of(plain, batch(0))), strict=True):
        np.testing.assert_array_equal(a, b)  # zero residuals: plain ZeRO++
    assert set(res_g) == {"hop1", "hop2"}
    for hop in ("hop1", "hop2"):
        for got, kept in zip(res_g[hop], state.params[R.KEY][hop], strict=True):
            assert (got is None) == (kept is None)
            if got is not None:
                assert got.shape == kept.shape and got.sharding == kept.sharding
    assert max(np.abs(x).max() for x in leaves(res_g)) > 0


def test_engine_feedback_changes_later_steps_and_apply_gradients_keeps_residuals():
    cfg = EF.replace(error_feedback_decay=0.5)
    state, step = make_state(cfg)
    plain, plain_step = make_state(cfg.replace(error_feedback=None))
    state, _ = step(state, batch(0))
    plain, _ = plain_step(plain, batch(0))
    g = grads_of(state, batch(1))
    pg = grads_of(plain, batch(1))
    model_g, res_g = R.split(g)
    assert any(np.any(a != b) for a, b in zip(leaves(model_g), leaves(pg), strict=True))
    after = state.apply_gradients(grads=g)
    for got, new in zip(leaves(after.params[R.KEY]), leaves(res_g), strict=True):
        np.testing.assert_array_equal(got, np.float32(0.5) * new)
    # Reset every 2 steps: after step index 1 (the second step) the residuals are zero.
    reset = state.replace(config=cfg.replace(error_feedback_reset=2))
    zeroed = reset.apply_gradients(grads=g)
    assert all(np.all(x == 0) for x in leaves(zeroed.params[R.KEY]))


def test_engine_ledger_is_unchanged_by_feedback():
    b = batch(0)
    got = {}
    for name, cfg in {"ef": EF, "plain": EF.replace(error_feedback=None)}.items():
        state, step = make_state(cfg)
        ledger = zpp.comm_ledger(step, state, b)
        got[name] = sorted((r.op, r.dtype, r.axes, r.phase, r.bytes_sent) for r in ledger.records)
    assert got["ef"] == got["plain"]


def test_engine_feedback_needs_a_hop_on_this_mesh():
    with pytest.raises(ValueError, match="no quantized gradient hop"):
        make_state(EF.replace(error_feedback="node"), mesh_shape=(1, 8))


def test_resume_with_feedback_is_bit_identical(tmp_path):
    straight, step = make_state(EF)
    for t in range(3):
        straight, _ = step(straight, batch(t))
    part, _ = make_state(EF)
    for t in range(2):
        part, _ = step(part, batch(t))
    zpp.save_checkpoint(tmp_path / "ck", part)
    target, _ = make_state(EF)
    resumed = zpp.restore_checkpoint(tmp_path / "ck", target)
    resumed, _ = step(resumed, batch(2))
    for a, b in zip(leaves(straight.params), leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "mesh_shape,config", [((4, 2), EF), ((2, 4), EF.replace(error_feedback="node"))]
)
def test_restore_onto_another_mesh_keeps_what_the_residuals_owe(tmp_path, mesh_shape, config):
    state, step = make_state(EF)
    for t in range(2):
        state, _ = step(state, batch(t))
    zpp.save_checkpoint(tmp_path / "ck", state)
    target, step2 = make_state(config, mesh_shape)
    restored = zpp.restore_checkpoint(tmp_path / "ck", target)
    nn_, ll = mesh_shape
    want = R.missing_mass(state.params[R.KEY], state.layouts[1], 2, 4)
    got = R.missing_mass(restored.params[R.KEY], restored.layouts[1], nn_, ll)
    for w, g in zip(want, got, strict=True):
        if w is None:
            continue
        rows = min(w.shape[0], g.shape[0])
        np.testing.assert_allclose(np.asarray(g)[:rows], np.asarray(w)[:rows], atol=1e-7)
        assert np.abs(np.asarray(w)).max() > 0
    restored, metrics = step2(restored, batch(3))
    assert np.isfinite(float(metrics["loss"]))


def test_restore_without_feedback_drops_residuals_with_a_warning(tmp_path):
    state, step = make_state(EF)
    state, _ = step(state, batch(0))
    zpp.save_checkpoint(tmp_path / "ck", state)
    target, _ = make_state(EF.replace(error_feedback=None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = zpp.restore_checkpoint(tmp_path / "ck", target)
    assert any("error-feedback residuals" in str(w.message) for w in caught)
    assert R.KEY not in restored.params
    for a, b in zip(leaves(R.split(state.params)[0]), leaves(restored.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_pallas_interpret_equals_xla_with_feedback():
    results = []
    for kernels in ("xla", "pallas_interpret"):
        state, step = make_state(EF.replace(kernels=kernels))
        for t in range(2):
            state, _ = step(state, batch(t))
        results.append(leaves(state.params))
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def _filled_mass(layout, mesh8):
    """What random residuals of `layout` on `mesh8` owe, kept only where they stand for
    the leaf's real values (padding's gradient is 0), in its stored shape."""
    fresh = R.zeros((layout,), choices.resolve(EF, mesh8), mesh8)
    rng = np.random.default_rng(0)
    filled = {
        hop: tuple(
            None
            if r is None
            else jax.device_put(rng.normal(size=r.shape).astype(np.float32), r.sharding)
            for r in rs
        )
        for hop, rs in fresh.items()
    }
    (mass,) = R.missing_mass(filled, (layout,), 2, 4)
    assert mass.shape == layout.stored_shape
    return part.to_master(part.from_master(mass, layout), layout)


def test_missing_mass_of_a_stacked_leaf_respreads_onto_a_mesh_of_other_padding():
    # A stacked leaf (3 layers of 5 x 9) is stored (3, 8, 9) on 8 devices and (3, 6, 9) on
    # 6 (each layer padded on its first axis on both): what the residuals owe, respread
    # onto the other mesh, is owed there again.
    layout = part.leaf_layout("stack", jnp.zeros((3, 5, 9)), 8)
    mesh8, mesh6 = make_mesh(2, 4), make_mesh(2, 3, devices=jax.devices()[:6])
    real = np.asarray(_filled_mass(layout, mesh8))
    assert real.shape == (3, 8, 9) and np.abs(real[:, :5]).min() > 0
    layout6 = part.with_devices(layout, 6)
    assert layout6.stored_shape == (3, 6, 9)
    moved = R.respread((jnp.asarray(real),), (layout6,), choices.resolve(EF, mesh6), mesh6)
    (again,) = R.missing_mass(moved, (layout6,), 2, 3)
    np.testing.assert_allclose(np.asarray(again), real[:, :6], rtol=1e-6, atol=1e-6)


def test_missing_mass_respreads_onto_a_mesh_that_splits_another_axis():
    # 3 layers of 5 x 7: on 8 devices each layer is split on its 7 (padded to 8, (3, 5, 8)),
    # on 6 on its 5 (padded to 6, (3, 6, 7)). The mass is laid out again, then respread,
    # as `restore_checkpoint` does: what is owed on 6 devices is what was owed on 8.
    layout = part.leaf_layout("stack", jnp.zeros((3, 5, 7)), 8)
    layout6 = part.with_devices(layout, 6)
    assert (layout.stored_shape, layout6.stored_shape) == ((3, 5, 8), (3, 6, 7))
    mesh8, mesh6 = make_mesh(2, 4), make_mesh(2, 3, devices=jax.devices()[:6])
    real = _filled_mass(layout, mesh8)
    values = np.asarray(part.from_master(real, layout))
    assert values.shape == (3, 5, 7) and np.abs(values).min() > 0
    relaid = jax.jit(L.relayout, static_argnums=(1, 2))(real, layout, layout6)
    moved = R.respread(
        (jnp.asarray(np.asarray(relaid)),), (layout6,), choices.resolve(EF, mesh6), mesh6
    )
    (again,) = R.missing_mass(moved, (layout6,), 2, 3)
    np.testing.assert_allclose(
        np.asarray(part.from_master(again, layout6)), values, rtol=1e-6, atol=1e-6
    )
