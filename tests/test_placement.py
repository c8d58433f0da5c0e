"""Gathering at use (zeropp_jax/interpreter/_placement.py): scanned models against one device, the
per-layer layout, the whole-leaf fallback with its warning, and prefetch in the program."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import zeropp_jax as zpp
from zeropp_jax.interpreter import _placement as placement

EXACT = dict(weight_bits=None, grad_bits=None, compute_dtype=jnp.float32)
LAYERS, WIDTH, IN, OUT = 3, 24, 11, 2
TX = optax.adam(1e-2)


def train_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def data(seed, batch=16):
    rs = np.random.RandomState(seed)
    return {
        "x": rs.randn(batch, IN).astype(np.float32),
        "y": rs.randn(batch, OUT).astype(np.float32),
    }


# ----------------------------------------------------------------------------- models


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(WIDTH)(h)), None


class LinenScan(nn.Module):
    """Dense in, `nn.scan` over stacked layers, Dense out."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH)(x)
        scan = nn.scan(
            LinenLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
        )
        h, _ = scan()(h, None)
        return nn.Dense(OUT)(h)


def linen_model():
    model = LinenScan()
    return model.apply, model.init(jax.random.key(0), data(0)["x"])["params"]


def lax_model():
    """A plain function: `lax.scan` over a stacked weight and bias."""
    rs = np.random.RandomState(1)
    params = {
        "w_in": rs.randn(IN, WIDTH).astype(np.float32) * 0.3,
        "w": rs.randn(LAYERS, WIDTH, WIDTH).astype(np.float32) * 0.2,
        "b": rs.randn(LAYERS, WIDTH).astype(np.float32) * 0.1,
        "w_out": rs.randn(WIDTH, OUT).astype(np.float32) * 0.3,
    }

    def apply(variables, x):
        p = variables["params"]

        def layer(h, wb):
            w, b = wb
            return jnp.tanh(h @ w + b), None

        h, _ = jax.lax.scan(layer, x @ p["w_in"], (p["w"], p["b"]))
        return h @ p["w_out"]

    return apply, params


def nnx_model():
    """`nnx.scan` over layers built by `nnx.vmap`, with an input and output projection."""

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        def __call__(self, h):
            return jnp.tanh(self.lin(h))

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Layer(rngs)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.inp = nnx.Linear(IN, WIDTH, rngs=rngs)
            self.layers = make(rngs)
            self.out = nnx.Linear(WIDTH, OUT, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def run(layer, h):
                return layer(h)

            return self.out(run(self.layers, self.inp(x)))

    graphdef, state = nnx.split(Net(nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)

    def apply(variables, x):
        s = jax.tree_util.tree_map(lambda a: a, state)
        nnx.replace_by_pure_dict(s, variables["params"])
        return nnx.merge(graphdef, s)(x)

    return apply, params


MODELS = {"linen": linen_model, "lax": lax_model, "nnx": nnx_model}


def one_device(apply, params, steps):
    state = train_state.TrainState.create(apply_fn=apply, params=params, tx=TX)
    step = jax.jit(train_step)
    losses = []
    for t in range(steps):
        state, m = step(state, data(t))
        losses.append(float(m["loss"]))
    return state.params, losses


def sharded(apply, params, steps, config, mesh):
    state = zpp.TrainState.create(apply_fn=apply, params=params, tx=TX, mesh=mesh, config=config)
    step = zpp.shard(train_step)
    losses = []
    for t in range(steps):
        state, m = step(state, data(t))
        losses.append(float(m["loss"]))
    return state, step, losses


def max_rel_err(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "kind, shape, prefetch, hierarchical",
    [
        ("linen", (2, 4), True, True),
        ("linen", (2, 4), False, False),
        ("linen", (8, 1), True, True),
        ("lax", (2, 4), True, True),
        ("nnx", (1, 8), True, True),
    ],
)
def test_scanned_models_match_one_device(kind, shape, prefetch, hierarchical):
    apply, params = MODELS[kind]()
    want_params, want = one_device(apply, params, 3)
    config = zpp.ZeroPPConfig(hierarchical=hierarchical, prefetch=prefetch, **EXACT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing falls back to a whole-leaf gather
        state, _, got = sharded(apply, params, 3, config, zpp.make_mesh(*shape))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert max_rel_err(zpp.gather_params(state), want_params) <= 1e-5


def test_stacked_leaf_keeps_its_layer_axis_and_shards_each_layer():
    _, params = lax_model()
    mesh = zpp.make_mesh(2, 4)
    state = zpp.TrainState.create(
        apply_fn=lambda v, x: x, params=params, tx=TX, mesh=mesh, config=zpp.ZeroPPConfig()
    )
    w = state.params["w"]
    rows = -(-WIDTH // 8) * 8
    assert w.shape == (LAYERS, rows, WIDTH)
    for shard in w.addressable_shards:
        # Every device holds ceil(rows / N) whole rows of each layer: nothing is padded
        # along the layer axis.
        assert shard.data.shape == (LAYERS, rows // 8, WIDTH)


def test_ledger_of_a_scan_counts_each_layer_inside_the_loop():
    apply, params = lax_model()
    mesh = zpp.make_mesh(2, 4)
    config = zpp.ZeroPPConfig()
    state = zpp.TrainState.create(apply_fn=apply, params=params, tx=TX, mesh=mesh, config=config)
    ledger = zpp.comm_ledger(zpp.shard(train_step), state, data(0))
    looped = [r for r in ledger.records if r.trip_count > 1]
    # Prefetch: layer 0 before the loop, layers 1 .. L-1 inside it (trip count L - 1) in
    # the forward; the backward loop runs L - 1 times after its peeled last layer.
    assert looped and {r.trip_count for r in looped} == {LAYERS - 1}
    # hpZ: no backward weight gather crosses nodes.
    for r in ledger.records:
        if r.phase == "backward" and r.op == "all-gather":
            assert r.axes == ("local",), r


def test_weight_read_inside_a_cond_is_gathered_whole_with_a_warning():
    rs = np.random.RandomState(2)
    params = {"w": rs.randn(IN, OUT).astype(np.float32), "v": rs.randn(IN, OUT).astype(np.float32)}

    def apply(variables, x):
        p = variables["params"]
        return jax.lax.cond(
            jnp.sum(p["v"]) > 0, lambda: x @ p["v"] + x @ p["w"], lambda: x @ p["v"] - x @ p["w"]
        )

    want_params, want = one_device(apply, params, 2)
    mesh = zpp.make_mesh(2, 4)
    with pytest.warns(UserWarning, match=r"\['w'\] is read inside a `cond`"):
        state, step, got = sharded(apply, params, 2, zpp.ZeroPPConfig(**EXACT), mesh)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert max_rel_err(zpp.gather_params(state), want_params) <= 1e-5
    ledger = zpp.comm_ledger(step, state, data(0))  # the step's trace, already warned
    whole = [r for r in ledger.records if placement.WHOLE_SCOPE in r.op_name]
    assert whole and all(r.op == "all-gather" for r in whole if r.phase == "forward")


def _subjaxprs(eqn):
    import jax.extend.core

    subs = jax.extend.core.jaxprs_in_params(eqn.params)
    return [j.jaxpr if hasattr(j, "jaxpr") else j for j in subs]


def _kinds(eqn) -> set[str]:
    """Primitive names of `eqn` and of every equation inside it."""
    out = {eqn.primitive.name}
    for sub in _subjaxprs(eqn):
        for e in sub.eqns:
            out |= _kinds(e)
    return out


def _scans(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for sub in _subjaxprs(eqn):
            yield from _scans(sub)


def _reads_a_gather(body) -> bool:
    """Whether any matmul of a loop body reads (transitively) a value that body gathers."""
    gathered = set()
    for eqn in body.eqns:
        kinds = _kinds(eqn)
        reads = any(v in gathered for v in eqn.invars if not hasattr(v, "val"))
        if "dot_general" in kinds and reads:
            return True
        if reads or "all_gather" in kinds:
            gathered.update(eqn.outvars)
    return False


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_the_next_layer_is_gathered_before_this_layer_computes(prefetch):
    """Forward and backward loops: with prefetch, each iteration gathers the layer after
    (before) its own, and its own layer's matmuls read only what the carry brought."""
    apply, params = lax_model()
    mesh = zpp.make_mesh(2, 4)
    config = zpp.ZeroPPConfig(prefetch=prefetch, **EXACT)
    state = zpp.TrainState.create(apply_fn=apply, params=params, tx=TX, mesh=mesh, config=config)
    jaxpr = jax.make_jaxpr(train_step)(state, data(0)).jaxpr
    loops = {
        reverse: [
            e.params["jaxpr"].jaxpr
            for e in _scans(jaxpr)
            if e.params["reverse"] == reverse
            and "all_gather" in _kinds(e)
            and "dot_general" in _kinds(e)
        ]
        for reverse in (False, True)
    }
    # The forward loop and the backward loop (a reverse scan) both gather per layer.
    assert loops[False] and loops[True]
    for body in loops[False] + loops[True]:
        names = [e.primitive.name for e in body.eqns]
        # The loop body's gather is issued before the layer's first matmul...
        assert names.index("all_gather") < names.index("dot_general")
        # ...and with prefetch no matmul of the iteration reads it: it is the next layer's
        # (the previous layer's, in the backward loop).
        assert _reads_a_gather(body) == (not prefetch)


# ----------------------------------------------------------------------------- a use's VJP

VOCAB = 24  # rows of the head's table: a multiple of 8, so the table is stored unpadded


@jax.custom_vjp
def lse_head(x, w):
    """Log-sum-exp of the logits `x @ w.T` per row, whose backward recomputes the logits
    from its saved `(x, w, lse)` (as the trainer's `head_cross_entropy`)."""
    return jax.nn.logsumexp(x @ w.T, axis=-1)


def _lse_fwd(x, w):
    lse = jax.nn.logsumexp(x @ w.T, axis=-1)
    return lse, (x, w, lse)


def _lse_bwd(saved, g):
    x, w, lse = saved
    p = jnp.exp(x @ w.T - lse[:, None]) * g[:, None]
    return p @ w, p.T @ x


lse_head.defvjp(_lse_fwd, _lse_bwd)


@jax.custom_vjp
def lse_head_saving_wt(x, w):
    """`lse_head` whose forward saves its table transposed: a residual computed from the
    weight, as large as the weight."""
    return jax.nn.logsumexp(x @ w.T, axis=-1)


def _wt_fwd(x, w):
    wt = w.T
    return jax.nn.logsumexp(x @ wt, axis=-1), (x, wt)


def _wt_bwd(saved, g):
    x, wt = saved
    p = jax.nn.softmax(x @ wt, axis=-1) * g[:, None]
    return p @ wt.T, p.T @ x


lse_head_saving_wt.defvjp(_wt_fwd, _wt_bwd)


def head_model(head, tied):
    rs = np.random.RandomState(3)
    params = {
        "e": (rs.randn(IN, WIDTH) / np.sqrt(IN)).astype(np.float32),
        "w": (rs.randn(VOCAB, WIDTH) / np.sqrt(WIDTH)).astype(np.float32),
    }

    def apply(variables, x):
        p = variables["params"]
        h = jnp.tanh(x @ p["e"])
        if tied:  # the table read three times: gathered once, shared by its uses
            h = jnp.tanh(h @ p["w"].T) @ p["w"]
        return head(h, p["w"])

    return apply, params


def mean_step(state, batch):
    def loss_fn(params):
        return jnp.mean(state.apply_fn({"params": params}, batch["x"]))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def _count(jaxpr, name: str) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for sub in _subjaxprs(eqn):
            n += _count(sub, name)
    return n


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("head, reruns", [(lse_head, 0), (lse_head_saving_wt, 1)])
def test_a_use_keeps_its_residuals_unless_they_would_hold_the_weight(head, reruns, tied):
    """The backward of a use does not run the equation's forward again (here a
    `custom_vjp` head: its log-sum-exp's `exp` appears as often as in the unsharded step),
    unless a residual computed from the weight is as large as the weight (the table saved
    transposed: then the forward keeps nothing and the backward runs it again, one `exp`
    more). Either way the step is exact against one device."""
    apply, params = head_model(head, tied)
    mesh = zpp.make_mesh(2, 4)
    config = zpp.ZeroPPConfig(**EXACT)
    plain = train_state.TrainState.create(apply_fn=apply, params=params, tx=TX)
    state = zpp.TrainState.create(apply_fn=apply, params=params, tx=TX, mesh=mesh, config=config)
    batch = data(0)
    want = _count(jax.make_jaxpr(mean_step)(plain, batch).jaxpr, "exp")
    assert _count(jax.make_jaxpr(mean_step)(state, batch).jaxpr, "exp") == want + reruns

    step, ref_step = zpp.shard(mean_step), jax.jit(mean_step)
    for t in range(3):
        state, m = step(state, data(t))
        plain, m_ref = ref_step(plain, data(t))
        np.testing.assert_allclose(float(m["loss"]), float(m_ref["loss"]), rtol=1e-5)
    assert max_rel_err(zpp.gather_params(state), plain.params) <= 1e-5


# ------------------------------------------------------- remat: the recompute's weights


def _remat_step(monkeypatch, hold: bool):
    """One ZeRO-3 step of a small GPT (the trainer's model), unscanned, each block under
    `nn.remat`, on 2 x 4 CPU devices, with the GPU program's `hold_recomputed` forced to
    `hold`: (the new parameters, the ledger's all-gather bytes per phase)."""
    from zeropp_jax.interpreter import _island as island
    from zeropp_jax.interpreter import _leaf_gathers as leaf_gathers
    from zeropp_jax.train.model import GPT, GPTConfig, init_params, loss_fn

    # The class itself: `island.LeafGathers` may already be an earlier call's stand-in.
    build = leaf_gathers.LeafGathers
    monkeypatch.setattr(
        island, "LeafGathers", lambda **kw: build(**{**kw, "hold_recomputed": hold})
    )
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, remat="full")
    mesh = zpp.make_mesh(2, 4)
    config = zpp.ZeroPPConfig.zero3()
    state = zpp.TrainState.create(
        apply_fn=GPT(cfg).apply, params=init_params(cfg, 0), tx=TX, mesh=mesh, config=config
    )
    tokens = np.random.RandomState(0).randint(0, 64, (16, 17)).astype(np.int32)

    def step_fn(state, batch):
        grads = jax.grad(lambda p: loss_fn(state.apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads=grads), {}

    step = zpp.shard(step_fn, mesh=mesh, config=config)
    ledger = zpp.comm_ledger(step, state, tokens)
    gathers = {p: b for (op, p), b in ledger.bytes_by("op", "phase").items() if op == "all-gather"}
    return zpp.gather_params(step(state, tokens)[0]), gathers


def test_a_use_in_a_remat_block_holds_its_recomputed_weights_where_asked(monkeypatch):
    # The GPU program's form, forced on CPU: the same step bit for bit, and the backward
    # gathers each block weight once (in its recompute), not a second time for its use's
    # backward.
    held, held_gathers = _remat_step(monkeypatch, hold=True)
    again, again_gathers = _remat_step(monkeypatch, hold=False)
    for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert held_gathers["forward"] == again_gathers["forward"]
    assert held_gathers["backward"] <= held_gathers["forward"]
    assert again_gathers["backward"] > 1.5 * again_gathers["forward"], again_gathers
