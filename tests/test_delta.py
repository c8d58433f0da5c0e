"""Weight-delta all-gather (issue #10): the kept secondary shard as a reference, deltas across
nodes. Reconstructions are checked against the analytic bound of the delta's quantizer;
sender and receivers must agree to the bit; a restore keeps the saved reference (or rebuilds
it on another mesh)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax import _references as references
from zeropp_jax import make_mesh
from zeropp_jax.state import _blocks as blocks
from zeropp_jax.state import _checkpoint as checkpoint
from zeropp_jax.state import _partition as part
from zeropp_jax.wire import _delta as D
from zeropp_jax.wire import _encoding as wire
from zeropp_jax.wire import quant as Q

F32_SLACK = 2.0**-22  # one float32 rounding of the reference update, relative to |x|
MESHES = [(2, 4), (4, 2), (8, 1), (1, 8)]


def delta_bound(delta: np.ndarray, bits, block_size: int) -> np.ndarray:
    """Half a quantization step per value of `delta` (one device's piece, any shape),
    blocked as `delta_all_gather` blocks it."""
    flat = jnp.asarray(delta, jnp.float32).reshape(-1)
    bs = wire.effective_block_size(flat.size, block_size)
    step = Q.step_size(flat, bits=bits, block_size=bs)
    return np.asarray(Q.max_error(flat, step, bits)).reshape(delta.shape)


def run_delta(mesh, x, ref, bits, block_size):
    """`delta_all_gather` on every device; returns each device's new reference,
    `(num_nodes, local_size, num_nodes * rows, ...)`."""

    def body(xs, r):
        return D.delta_all_gather(xs[0, 0], r, bits=bits, block_size=block_size)[None, None]

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("node", "local"), P("local")),
        out_specs=P("node", "local"),
        check_vma=False,
    )
    return np.asarray(jax.jit(f)(x, ref))


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("bits,block_size", [(4, 32), (8, 256), (2, 16), ("e4m3", 64)])
def test_delta_all_gather_within_bound_and_identical_on_every_node(mesh_shape, bits, block_size):
    nn_, ll = mesh_shape
    mesh = make_mesh(nn_, ll)
    rows, cols = 6, 5
    x = jax.random.t(jax.random.key(1), 2.0, (nn_, ll, rows, cols))
    # The reference: each local rank's secondary shard, x plus an error, the same on every node.
    noise = 0.05 * jax.random.normal(jax.random.key(2), x.shape)
    ref = np.asarray(x + noise).transpose(1, 0, 2, 3).reshape(ll * nn_ * rows, cols)
    new = run_delta(mesh, x, ref, bits, block_size)
    x = np.asarray(x)
    for n in range(nn_):
        for b in range(ll):
            # Every node holds the same reference to the bit.
            np.testing.assert_array_equal(new[n, b], new[0, b])
            own_old = ref[b * nn_ * rows + n * rows : b * nn_ * rows + (n + 1) * rows]
            own_new = new[0, b][n * rows : (n + 1) * rows]
            bound = delta_bound(x[n, b] - own_old, bits, block_size)
            err = np.abs(own_new - x[n, b])
            assert np.all(err <= bound + np.abs(x[n, b]) * F32_SLACK), float(np.max(err - bound))
            # The delta itself moved the reference (the test could fail).
            assert np.any(own_new != own_old)


def test_delta_all_gather_rejects_a_mismatched_reference():
    mesh = make_mesh(2, 4)
    x = jnp.ones((2, 4, 6, 5))
    with pytest.raises(ValueError, match="reference of shape"):
        run_delta(mesh, x, np.ones((4 * 6 * 3, 5), np.float32), 4, 32)


def test_config_weight_delta_needs_hpz():
    with pytest.raises(ValueError, match="weight_delta_bits=4 is not allowed.*hierarchical"):
        zpp.ZeroPPConfig(weight_delta_bits=4, hierarchical=False)
    with pytest.raises(ValueError, match="weight_delta_bits=3"):
        zpp.ZeroPPConfig(weight_delta_bits=3)
    assert not zpp.ZeroPPConfig.zero3(hierarchical=True, weight_delta_bits=4).is_zero3


# ----------------------------------------------------------------------------- engine


class Net(nn.Module):
    """Dense layers of `hidden` widths, then Dense(3). `GRID`'s (60, 60) kernel is stored
    split over two axes on 2 x 4 (60 over 4 local devices, 60 over 2 nodes)."""

    hidden: tuple[int, ...] = (37,)

    @nn.compact
    def __call__(self, x):
        for width in self.hidden:
            x = jnp.tanh(nn.Dense(width)(x))
        return nn.Dense(3)(x)


GRID = Net(hidden=(60, 60))
MODELS = {"one_axis": Net(), "two_axis": GRID}


def loss_of(apply_fn, params, b):
    return jnp.mean((apply_fn({"params": params}, b["x"]) - b["y"]) ** 2)


def train_step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_of(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def batch(seed):
    rs = np.random.RandomState(seed)
    x = rs.randn(16, 11).astype(np.float32)
    return {"x": x, "y": np.tanh(x[:, :3])}


DELTA = zpp.ZeroPPConfig(weight_delta_bits=4, weight_block_size=32, compute_dtype=jnp.float32)


def make_state(config, mesh_shape=(2, 4), lr=0.05, tx=None, model=None):
    mesh = make_mesh(*mesh_shape)
    model = Net() if model is None else model
    params = model.init(jax.random.key(0), batch(0)["x"])["params"]
    tx = optax.adam(lr) if tx is None else tx
    state = zpp.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx, mesh=mesh, config=config
    )
    return state, zpp.shard(train_step, mesh=mesh, config=config)


def from_pieces(r, lo, n):
    """A reference (pieces) in the parameter's original shape."""
    return part.from_master(blocks.pieces_to_stored(r, lo, n), lo, np.float32)


def node_copies(ref):
    """Every device's buffer of a reference, grouped by the slice it holds."""
    groups = {}
    for s in ref.addressable_shards:
        groups.setdefault(str(s.index), []).append(np.asarray(s.data))
    return groups


@pytest.mark.parametrize("model", list(MODELS))
def test_engine_sender_and_receivers_agree_and_reference_tracks_the_weights(model):
    state, step = make_state(DELTA, model=MODELS[model])
    n = state.mesh.size
    sharded = [i for i, lo in enumerate(state.layouts[1]) if lo.sharded]
    assert any(state.layouts[1][i].two_axis for i in sharded) == (model == "two_axis")
    assert sharded and all(state.weight_ref[i] is not None for i in sharded)
    for t in range(12):
        old = [np.asarray(state.weight_ref[i]) for i in sharded]
        state, _ = step(state, batch(t))
        params = jax.tree_util.tree_leaves(state.params)
        for i, r_old in zip(sharded, old, strict=True):
            ref = state.weight_ref[i]
            assert ref.sharding == NamedSharding(state.mesh, P("local"))
            for copies in node_copies(ref).values():
                assert len(copies) == state.mesh.shape["node"]
                for c in copies:
                    np.testing.assert_array_equal(c, copies[0])
            # Closed loop: every piece is within half a step of its last delta.
            lo = state.layouts[1][i]
            w = np.asarray(blocks.stored_to_pieces(params[i], lo, n))
            r = np.asarray(ref)
            rows = w.shape[0] // n
            for p in range(n):
                sl = slice(p * rows, (p + 1) * rows)
                bound = delta_bound(w[sl] - r_old[sl], 4, 32) + np.abs(w[sl]) * F32_SLACK
                assert np.all(np.abs(r[sl] - w[sl]) <= bound), (t, i, p)


@pytest.mark.parametrize("model", list(MODELS))
def test_engine_forward_uses_the_reference_exactly(model):
    """With an unquantized stage 2 and gradient reduction, the sharded loss and gradients
    are the unsharded ones at the reference (to float summation order)."""
    cfg = zpp.ZeroPPConfig(
        weight_delta_bits=8,
        weight_local_bits=None,
        grad_bits=None,
        compute_dtype=jnp.float32,
    )
    state, step = make_state(cfg, model=MODELS[model])
    for t in range(3):
        state, _ = step(state, batch(t))
    treedef, layouts = state.layouts
    ref_params = jax.tree_util.tree_unflatten(
        treedef,
        [
            np.asarray(from_pieces(r, lo, state.mesh.size)) if r is not None else np.asarray(x)
            for r, x, lo in zip(
                state.weight_ref, jax.tree_util.tree_leaves(state.params), layouts, strict=True
            )
        ],
    )
    b = batch(7)
    want_loss, want_grads = jax.value_and_grad(lambda p: loss_of(MODELS[model].apply, p, b))(
        ref_params
    )
    got_loss, got_grads = jax.jit(jax.value_and_grad(lambda p: loss_of(state.apply_fn, p, b)))(
        state.params
    )
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for g, w, lo in zip(
        jax.tree_util.tree_leaves(got_grads),
        jax.tree_util.tree_leaves(want_grads),
        layouts,
        strict=True,
    ):
        g = part.from_master(g, lo, np.float32) if lo.sharded else g
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-7)
    # The master weights moved away from the reference: the test compares something.
    assert any(
        np.any(
            np.asarray(from_pieces(r, lo, state.mesh.size))
            != np.asarray(part.from_master(x, lo, np.float32))
        )
        for r, x, lo in zip(
            state.weight_ref, jax.tree_util.tree_leaves(state.params), layouts, strict=True
        )
        if r is not None
    )


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_restore_keeps_the_saved_reference_or_rebuilds_it_on_another_mesh(tmp_path, mesh_shape):
    state, step = make_state(DELTA)
    for t in range(4):
        state, _ = step(state, batch(t))
    zpp.save_checkpoint(tmp_path / "ckpt", state)
    meta = checkpoint.read_metadata(tmp_path / "ckpt")
    # The references are saved, but they are not parameters: the layout check ignores them.
    saved = jax.tree_util.tree_leaves((state.step, state.params, state.opt_state))
    assert meta["weight_ref"]["leaves"] and len(meta["stored_shapes"]) == len(saved) + 1
    target, step2 = make_state(DELTA, mesh_shape)
    restored = zpp.restore_checkpoint(tmp_path / "ckpt", target)
    fresh = references.full_weight_references(
        restored.params, restored.plan, restored.mesh, restored.layouts[1]
    )
    moved = False
    same_mesh = mesh_shape == (2, 4)
    for got, want, kept in zip(restored.weight_ref, fresh, state.weight_ref, strict=True):
        if want is None:
            assert got is None
            continue
        assert got.sharding == NamedSharding(restored.mesh, P("local"))
        # Same mesh: what every node held at the save; another mesh: one full gather.
        np.testing.assert_array_equal(np.asarray(got), np.asarray(kept if same_mesh else want))
        if got.shape == kept.shape:
            moved |= bool(np.any(np.asarray(want) != np.asarray(kept)))
    # The deltas had taken the kept reference away from a fresh int8 gather.
    assert moved or not same_mesh
    restored, metrics = step2(restored, batch(5))
    assert np.isfinite(float(metrics["loss"]))
    if same_mesh:  # the next step is the uninterrupted run's, bit for bit
        state, _ = step(state, batch(5))
        for a, b in zip(
            jax.tree_util.tree_leaves((restored.params, restored.weight_ref)),
            jax.tree_util.tree_leaves((state.params, state.weight_ref)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ledger_sends_the_int4_delta_across_nodes():
    b = batch(0)
    ledgers = {}
    configs = {"zeropp": zpp.ZeroPPConfig(), "delta": DELTA.replace(compute_dtype=jnp.bfloat16)}
    for name, cfg in configs.items():
        state, step = make_state(cfg)
        ledgers[name] = zpp.comm_ledger(step, state, b)
    cross = {
        (r.op, r.dtype) for r in ledgers["delta"].records if r.cross_node and r.op == "all-gather"
    }
    assert ("all-gather", "uint8") in cross and ("all-gather", "int8") not in cross
    assert ledgers["delta"].cross_node_bytes < ledgers["zeropp"].cross_node_bytes
    # No backward weight gather crosses nodes, and nothing is all-reduced.
    assert not any(r.op == "all-reduce" for r in ledgers["delta"].records)
    assert not any(
        r.cross_node and r.phase == "backward" and r.op == "all-gather"
        for r in ledgers["delta"].records
    )


def test_pallas_interpret_equals_xla_with_weight_delta():
    # SGD, as test_feedback's twin: the kernels' bits (gradients, references) are what is
    # compared. Adam's update, the same HLO in both programs, is compiled by XLA:CPU to
    # results 1 ulp apart from its second step on (seen on leaves whose rows do not divide
    # the devices), depending on what surrounds it.
    results = []
    for kernels in ("xla", "pallas_interpret"):
        state, step = make_state(DELTA.replace(kernels=kernels), tx=optax.sgd(0.05))
        for t in range(2):
            state, _ = step(state, batch(t))
        results.append(state)
    for a, b in zip(
        jax.tree_util.tree_leaves((results[0].params, results[0].weight_ref)),
        jax.tree_util.tree_leaves((results[1].params, results[1].weight_ref)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_apply_gradients_refuses_to_replace_the_references_carrier():
    state, _ = make_state(DELTA)
    grads = jax.jit(jax.grad(lambda p: loss_of(state.apply_fn, p, batch(0))))(state.params)
    with pytest.raises(ValueError, match="carries the weight references"):
        state.apply_gradients(grads=grads, apply_fn=state.apply_fn)


def test_references_follow_the_mesh_platform_not_the_default_backend(monkeypatch):
    """A CPU mesh on a host whose default backend is a GPU: the references are built with
    the codec the mesh's platform resolves (XLA's on CPU), as the island's gathers are;
    `jax.default_backend()` would pick the compiled Pallas kernels, which cannot run here."""
    want, _ = make_state(DELTA)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got, _ = make_state(DELTA)
    for a, b in zip(
        jax.tree_util.tree_leaves(got.weight_ref),
        jax.tree_util.tree_leaves(want.weight_ref),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
