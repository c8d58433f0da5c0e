"""Tensor parallelism on a third mesh axis, `model`: layouts, the mesh, annotation errors,
and training against one device (exact when unquantized, within the quantizer's bound
with ZeRO++'s formats)."""

import dataclasses
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import zeropp_jax as zpp
from zeropp_jax import _mesh as mesh_lib
from zeropp_jax import _tensor_parallel as tensor_parallel
from zeropp_jax import baselines
from zeropp_jax.state import _blocks as blocks
from zeropp_jax.state import _partition as part
from zeropp_jax.train.model import GPT, GPTConfig, init_fn, init_params, loss_fn
from zeropp_jax.wire.quant import qmax

EXACT = dict(weight_bits=None, grad_bits=None, compute_dtype=jnp.float32)
COLUMN = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
ROW = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None))


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize(
    "shape,dim,k",
    [
        ((6, 8), 1, 2),
        ((6, 8), 1, 4),
        ((6, 8), 0, 2),
        ((8,), 0, 4),
        ((3, 6, 8), 2, 4),
        ((3, 6, 8), 1, 2),
        ((2, 3, 4, 6), 3, 2),
    ],
)
def test_layout_round_trips_and_pieces_gather_back(shape, dim, k):
    n = 4
    lo = part.with_model_split(part.leaf_layout("w", np.zeros(shape, np.float32), n), dim, k, n)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    stored = part.to_master(x, lo)
    assert stored.shape == lo.stored_shape
    np.testing.assert_array_equal(part.from_master(stored, lo), x)
    # Slice r of the stored leaf is model rank r's part of the original.
    for r in range(k):
        want = np.take(x, np.arange(r * shape[dim] // k, (r + 1) * shape[dim] // k), axis=dim)
        if lo.stacked:
            np.testing.assert_array_equal(stored[:, r, : lo.cols], want.reshape(shape[0], -1))
        else:
            np.testing.assert_array_equal(stored[r, : lo.cols], want.reshape(-1))
    width = lo.padded // n
    shards = [stored[..., i * width : (i + 1) * width] for i in range(n)]
    # What the collectives return: every device's piece, along the values axis.
    full = jnp.concatenate([blocks.piece(s, lo) for s in shards], axis=1)
    np.testing.assert_array_equal(blocks.unpiece(full, lo, n), x)
    if lo.stacked:
        for layer in range(shape[0]):
            one = jnp.concatenate([s[layer] for s in shards], axis=1)
            np.testing.assert_array_equal(blocks.unpiece(one, lo, n, layer=True), x[layer])


# ----------------------------------------------------------------------------- mesh


def test_make_mesh_with_a_model_axis():
    mesh = zpp.make_mesh(2, 2, model_size=2)
    assert mesh.axis_names == ("node", "local", "model")
    assert dict(mesh.shape) == {"node": 2, "local": 2, "model": 2}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    # A model group is consecutive devices of one node.
    np.testing.assert_array_equal(ids.reshape(2, 4), np.arange(8).reshape(2, 4))
    assert mesh_lib.data_parallel_size(mesh) == 4 and mesh_lib.model_axis_size(mesh) == 2
    assert dict(zpp.make_mesh(2, model_size=4).shape) == {"node": 2, "local": 1, "model": 4}
    with pytest.raises(ValueError, match="model_size=3 does not divide the 4 devices of a node"):
        zpp.make_mesh(2, model_size=3)


def test_a_model_group_never_spans_hosts():
    # Four hosts of two devices each (one process per host), laid out as 2 nodes of 4: a
    # node row holds two hosts (make_mesh warns), so a model group of 4 would span both.
    devs = [types.SimpleNamespace(id=i, process_index=i // 2) for i in range(8)]
    hosts = [0, 1, 2, 3]
    with pytest.warns(mesh_lib.TopologyWarning):
        grid = mesh_lib.device_grid(devs, hosts, 2, 4)
    assert mesh_lib.model_grid(grid, 2, hosts).shape == (2, 2, 2)
    with pytest.raises(ValueError, match=r"local 0 would span hosts \[0, 1\]"):
        mesh_lib.model_grid(grid, 4, hosts)


# ----------------------------------------------------------------------------- errors


class Annotated(nn.Module):
    names: tuple
    features: int = 8
    logical: bool = False  # `names` are flax logical names (resolved by axis rules)

    @nn.compact
    def __call__(self, x):
        boxed = nn.with_logical_partitioning if self.logical else nn.with_partitioning
        init = boxed(nn.initializers.lecun_normal(), self.names)
        return nn.Dense(self.features, kernel_init=init, use_bias=False)(x)


def create(model, mesh, x, config=None, tx=None):
    params = model.init(jax.random.key(0), x)["params"]
    tx = optax.sgd(0.1) if tx is None else tx
    return zpp.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx, mesh=mesh, config=config
    )


@pytest.mark.parametrize(
    "names,features,mesh_kw,match",
    [
        ((None, "tensor"), 8, dict(model_size=2), "names the mesh axis 'tensor'"),
        ((None, "model"), 8, {}, r"make_mesh\(\.\.\., model_size=K\)"),
        ((None, "local"), 8, dict(model_size=2), "names the ZeRO axis 'local'"),
        ((None, "model"), 6, dict(model_size=4), "does not divide it"),
        (("model", "model"), 8, dict(model_size=2), "for dimensions"),
        (("model",), 8, dict(model_size=2), "expected one name"),
    ],
)
def test_bad_annotations_fail_in_one_line_before_compiling(names, features, mesh_kw, match):
    mesh = zpp.make_mesh(2, **mesh_kw)
    with pytest.raises(ValueError, match=match) as err:
        create(Annotated(names, features), mesh, np.ones((8, 4), np.float32))
    assert "\n" not in str(err.value)


def test_the_layer_axis_of_a_stacked_leaf_cannot_be_split():
    with pytest.raises(ValueError, match="splits dimension 0 over 'model'"):
        tensor_parallel.model_dims(["w"], [(4, 6, 8)], [("model", None, None)], _mesh(2))


def test_weight_deltas_and_error_feedback_are_refused_with_a_split_leaf():
    mesh = zpp.make_mesh(2, model_size=2)
    x = np.ones((8, 4), np.float32)
    for cfg in (zpp.ZeroPPConfig(weight_delta_bits=4), zpp.ZeroPPConfig(error_feedback="all")):
        with pytest.raises(ValueError, match="cannot yet be combined"):
            create(Annotated((None, "model")), mesh, x, cfg)


def _mesh(k):
    return zpp.make_mesh(2, model_size=k)


# ----------------------------------------------------------------------------- training


class MLP(nn.Module):
    """Megatron's MLP (column then row), plus an unannotated layer with odd sizes."""

    @nn.compact
    def __call__(self, x):
        bias = nn.with_partitioning(nn.initializers.normal(0.1), ("model",))
        h = jnp.tanh(nn.Dense(16, kernel_init=COLUMN, bias_init=bias)(x))
        h = nn.Dense(5, kernel_init=ROW)(h)
        return nn.Dense(3)(jnp.tanh(h))


def mse_step(state, batch):
    def loss(p):
        return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def max_rel_err(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def mlp_batches(n=3):
    rs = np.random.RandomState(0)
    return [
        {"x": rs.randn(16, 6).astype(np.float32), "y": rs.randn(16, 3).astype(np.float32)}
        for _ in range(n)
    ]


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 1, 4), (1, 2, 4)])
@pytest.mark.parametrize("hierarchical", [False, True])
def test_annotated_mlp_unquantized_matches_one_device(shape, hierarchical):
    nodes, local, k = shape
    mesh = zpp.make_mesh(nodes, local, model_size=k)
    config = zpp.ZeroPPConfig(hierarchical=hierarchical, **EXACT)
    batches = mlp_batches()
    boxed = MLP().init(jax.random.key(0), batches[0]["x"])["params"]
    tx = optax.adam(1e-2)
    ref = train_state.TrainState.create(apply_fn=MLP().apply, params=nn.unbox(boxed), tx=tx)
    state = zpp.TrainState.create(
        apply_fn=MLP().apply, params=boxed, tx=tx, mesh=mesh, config=config
    )
    assert state.params["Dense_0"]["kernel"].sharding.spec == P_TP
    step, ref_step = zpp.shard(mse_step), jax.jit(mse_step)
    for b in batches:
        state, m = step(state, b)
        ref, rm = ref_step(ref, b)
        np.testing.assert_allclose(float(m["loss"]), float(rm["loss"]), rtol=1e-5)
    got = zpp.gather_params(state)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref.params)
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(got))
    assert max_rel_err(got, ref.params) <= 1e-5


P_TP = jax.sharding.PartitionSpec("model", ("local", "node"))


def test_model_size_one_trains_and_communicates_as_the_two_axis_mesh():
    batches = mlp_batches(2)
    boxed = MLP().init(jax.random.key(0), batches[0]["x"])["params"]
    runs = []
    for mesh in (zpp.make_mesh(2, 4), zpp.make_mesh(2, 4, model_size=1)):
        params = boxed if "model" in mesh.axis_names else nn.unbox(boxed)
        state = zpp.TrainState.create(
            apply_fn=MLP().apply, params=params, tx=optax.adam(1e-2), mesh=mesh
        )
        step = zpp.shard(mse_step)
        ledger = zpp.comm_ledger(step, state, batches[0]).to_markdown()
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        runs.append((ledger, losses, zpp.gather_params(state)))
    (l2, losses2, p2), (l3, losses3, p3) = runs
    assert l2 == l3
    assert losses2 == losses3
    assert max_rel_err(p3, p2) == 0.0


@pytest.mark.parametrize("logical", [False, True], ids=["mesh-names", "logical-names"])
def test_zeropp_formats_with_tensor_parallelism_stay_within_the_quantizer_bound(logical):
    """int8 weight gathers (hpZ) and int4 two-hop gradients on a column-parallel weight,
    annotated with the mesh's names or with logical names under `RULES`: the weight the
    model sees is within half a step of the largest block, and the gradient within two
    hops' half steps of every contribution."""
    mesh = zpp.make_mesh(2, 2, model_size=2)
    config = zpp.ZeroPPConfig(compute_dtype=jnp.float32, weight_block_size=8, grad_block_size=8)
    names = ("embed", "mlp") if logical else (None, "model")
    model = Annotated(names, 16, logical=logical)
    x = np.tile(np.eye(8, dtype=np.float32), (2, 1))  # 16 rows: the weight's rows, twice
    with nn.logical_axis_rules(RULES if logical else ()):
        state = create(model, mesh, x, config, tx=optax.sgd(1.0))
    assert state.params["Dense_0"]["kernel"].sharding.spec == P_TP
    w = np.asarray(zpp.gather_params(state)["Dense_0"]["kernel"], np.float64)

    def step(state, batch):
        out = state.apply_fn({"params": state.params}, batch["x"])
        grads = jax.grad(lambda p: jnp.sum(state.apply_fn({"params": p}, batch["x"])))(state.params)
        return state.apply_gradients(grads=grads), {"out": out}

    new, m = zpp.shard(step)(state, {"x": x})
    seen = np.asarray(m["out"], np.float64)[:8]
    assert np.max(np.abs(seen - w)) <= np.max(np.abs(w)) / qmax(8) / 2 * (1 + 2.0**-15) + 1e-7
    grad = w - np.asarray(zpp.gather_params(new)["Dense_0"]["kernel"], np.float64)
    # d/dW sum(x @ W) = column sums of x, 2 per row. Each of the 4 data-parallel devices
    # contributes its 4 rows' sums (at most 1), quantized once in hop 1 (half a step of at
    # most 1 / qmax each); each of the 2 nodes' partial sums (at most 2 plus its hop-1
    # error) is quantized once in hop 2.
    q = qmax(4) / (1 + 2.0**-15)
    exact = np.full_like(w, 2.0)
    hop1 = 4 * (1.0 / q) / 2
    hop2 = 2 * ((2.0 + 2 / (2 * q)) / q) / 2
    bound = hop1 + hop2 + 1e-5
    assert np.max(np.abs(grad - exact)) <= bound


class TwoColumnSplit(nn.Module):
    """Two column-split kernels: `once` read once (its cotangent reduced at that use), and
    `twice` read twice (gathered whole once, its summed cotangent reduced by the shared
    gather)."""

    @nn.compact
    def __call__(self, x):
        once = self.param("once", COLUMN, (x.shape[1], 16))
        twice = self.param("twice", COLUMN, (x.shape[1], 16))
        return x @ once + x @ twice + (2 * x) @ twice


def test_model_ranks_round_their_gradient_slices_with_different_noise():
    """With stochastic rounding and K = 2, the engine folds each `model` rank into the
    rounding key (`reductions.model_rank_key`), at a single use and at a shared gather:
    the loss `sum((x @ W) * c)` with `c`'s two halves equal gives the two ranks' slices
    equal gradients before rounding, which one key would round alike."""
    mesh = zpp.make_mesh(2, 2, model_size=2)
    config = zpp.ZeroPPConfig(
        weight_bits=None, grad_bits=4, grad_block_size=8, stochastic_rounding=True,
        compute_dtype=jnp.float32,
    )  # fmt: skip
    rs = np.random.RandomState(0)
    x = rs.randn(16, 8).astype(np.float32)
    c = np.tile(rs.randn(8).astype(np.float32), 2)
    state = create(TwoColumnSplit(), mesh, x, config, tx=optax.sgd(1.0))

    def step(state, batch):
        loss = lambda p: jnp.sum(state.apply_fn({"params": p}, batch["x"]) * c)  # noqa: E731
        return state.apply_gradients(grads=jax.grad(loss)(state.params)), {}

    before = zpp.gather_params(state)
    after = zpp.gather_params(zpp.shard(step)(state, {"x": x})[0])
    for name, uses in (("once", 1), ("twice", 3)):
        grad = np.asarray(before[name], np.float64) - np.asarray(after[name], np.float64)
        exact = uses * np.outer(x.sum(0), c)  # the two halves equal
        step_size = np.max(np.abs(exact)) / qmax(4)
        assert np.max(np.abs(grad - exact)) <= 4 * step_size  # rounded, not garbage
        # The two ranks' slices: apart by whole rounding steps somewhere, not by float noise.
        assert np.max(np.abs(grad[:, :8] - grad[:, 8:])) > step_size / 4, name


# ----------------------------------------------------------------------------- the GPT

GPT_TP = GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4, model_parallel=True)


def gpt_step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch, train=True))(
        state.params
    )
    return state.apply_gradients(grads=grads), {"loss": loss}


CHUNKS = dict(attn_chunk=8, loss_chunks=4)


@pytest.mark.parametrize(
    "k,scan,remat,chunks,shared_grad",
    [
        (2, True, "none", {}, "once"),
        (4, True, "full", {}, "once"),
        (2, False, "full", {}, "once"),
        (4, False, "none", {}, "once"),
        # attention in query chunks and the head and loss in vocabulary pieces: loops whose
        # carries vary over the mesh inside the island; with `model`, each piece split
        (1, True, "full", CHUNKS, "once"),
        (2, True, "full", CHUNKS, "once"),
        # the vocabulary-split tied embedding's gradient reduced at each use
        (2, True, "full", CHUNKS, "per_use"),
    ],
)
def test_gpt_unquantized_matches_one_device(k, scan, remat, chunks, shared_grad):
    cfg = dataclasses.replace(GPT_TP, scan=scan, remat=remat, model_parallel=k > 1, **chunks)
    tx = optax.sgd(0.5)
    ref = train_state.TrainState.create(apply_fn=GPT(cfg).apply, params=init_params(cfg, 0), tx=tx)
    mesh = zpp.make_mesh(2, 4 // k, model_size=k)
    config = zpp.ZeroPPConfig(**EXACT, shared_grad=shared_grad)
    state = zpp.TrainState.create(
        apply_fn=GPT(cfg).apply, params=init_fn(cfg, 0), tx=tx, mesh=mesh, config=config
    )
    step, ref_step = zpp.shard(gpt_step), jax.jit(gpt_step)
    rs = np.random.RandomState(0)
    for _ in range(2):
        b = rs.randint(0, 256, (8, cfg.seq_len + 1)).astype(np.int32)
        state, m = step(state, b)
        ref, rm = ref_step(ref, b)
        np.testing.assert_allclose(float(m["loss"]), float(rm["loss"]), rtol=1e-5)
    assert max_rel_err(zpp.gather_params(state), ref.params) <= 1e-5


def test_ledger_tensor_parallel_collectives_stay_on_model_inside_a_node():
    cfg = dataclasses.replace(GPT_TP, scan=True)
    mesh = zpp.make_mesh(2, 2, model_size=2)
    state = zpp.TrainState.create(
        apply_fn=GPT(cfg).apply, params=init_fn(cfg, 0), tx=optax.adam(1e-3), mesh=mesh
    )
    b = np.zeros((16, cfg.seq_len + 1), np.int32)  # 4 sequences per data-parallel rank
    step = zpp.shard(gpt_step)
    # As JAX wrote it: the ZeRO collectives, over the data-parallel axes only.
    lowered = zpp.comm_ledger(step, state, b)
    assert lowered.records and all("model" not in r.axes for r in lowered.records)
    # As XLA runs it: the tensor-parallel collectives it inserted are over `model` alone,
    # never across nodes, and move activations, never a weight: all-reduces, and one
    # all-gather of the vocabulary-split logits' gradient (4 x 16 x 256 float32 per
    # data-parallel rank; the embedding, 256 x 32, would be half that).
    compiled = zpp.comm_ledger(step, state, b, compiled=True)
    tp = [r for r in compiled.records if "model" in r.axes]
    assert tp and all(r.axes == ("model",) and not r.cross_node for r in tp)
    logits = 4 * cfg.seq_len * cfg.vocab_size * 4
    gathers = [r for r in tp if r.op != "all-reduce"]
    assert [(r.op, r.out_bytes, r.phase) for r in gathers] == [("all-gather", logits, "backward")]
    zero = [r for r in compiled.records if r.bytes_sent and "model" not in r.axes]
    assert {a for r in zero for a in r.axes} == {"node", "local"}


def test_xla_fsdp_with_tensor_parallelism_trains_like_one_device():
    from zeropp_jax.baselines import fsdp_spec, xla_fsdp_state, xla_fsdp_step

    assert fsdp_spec((8, 16), 4, model_dim=1) == jax.sharding.PartitionSpec(
        ("node", "local"), "model"
    )
    mesh = zpp.make_mesh(2, 2, model_size=2)
    batches = mlp_batches()
    boxed = MLP().init(jax.random.key(0), batches[0]["x"])["params"]
    tx = optax.adam(1e-2)
    ref = train_state.TrainState.create(apply_fn=MLP().apply, params=nn.unbox(boxed), tx=tx)
    state = xla_fsdp_state(
        apply_fn=MLP().apply, params=boxed, tx=tx, mesh=mesh, compute_dtype=jnp.float32
    )
    kernel = state.params["Dense_0"]["kernel"]  # (6, 16), column-parallel
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    mu = state.opt_state[0].mu["Dense_1"]["kernel"]  # (16, 5), row-parallel
    assert mu.sharding.spec == jax.sharding.PartitionSpec("model")
    step = xla_fsdp_step(mse_step, state, mesh)
    for b in batches:
        state, m = step(state, b)
        ref, rm = jax.jit(mse_step)(ref, b)
        np.testing.assert_allclose(float(m["loss"]), float(rm["loss"]), rtol=1e-5)
    assert max_rel_err(state.params, ref.params) <= 1e-5


# ----------------------------------------------------------------------------- the trainer

TRAINER_FLAGS = [
    "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "16",
    "--batch", "8", "--max-corpus-mb", "2", "--eval-batches", "1", "--eval-every", "0",
    "--no-progress", "--no-ledger",
]  # fmt: skip


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model-parallel", "3"], "--model-parallel 3 does not divide --n-heads 4"),
        (["--model-parallel", "2", "--weight-delta-bits", "4"], "cannot yet be combined"),
        (["--model-parallel", "2", "--plan"], "does not model --model-parallel 2"),
        (["--model-parallel", "8", "--n-heads", "8"], "does not divide the 4 devices of a node"),
        (["--model-parallel", "2", "--batch", "6"], "not divisible by the 4 data-parallel"),
    ],
)
def test_trainer_bad_model_parallel_flags_give_one_line(flags, message, capsys, tmp_path):
    from zeropp_jax.train import cli

    with pytest.raises(SystemExit) as exc:
        cli.main([*TRAINER_FLAGS, "--out", str(tmp_path / "run"), *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zeropp-train: error: "), err
    assert message in err


def test_trainer_model_parallel_runs_zero3_and_xla_fsdp_alike(tmp_path, capsys):
    """`--model-parallel 2` on the scanned GPT, unquantized float32: our ZeRO-3 and XLA's
    FSDP, both with tensor parallelism, compute the same steps (to summation order)."""
    import json

    from zeropp_jax.train import cli

    exact = [*TRAINER_FLAGS, "--steps", "3", "--compute-dtype", "float32", "--model-parallel", "2"]
    losses = {}
    for engine in ("zero3", "xla-fsdp"):
        out = tmp_path / engine
        assert cli.main([*exact, "--engine", engine, "--out", str(out)]) == 0
        with open(out / "metrics.jsonl") as f:
            losses[engine] = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    assert "2 x 2 x 2 ('node', 'local', 'model') mesh" in capsys.readouterr().out
    assert len(losses["zero3"]) == 3
    np.testing.assert_allclose(losses["xla-fsdp"], losses["zero3"], rtol=1e-5)


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoints_restore_onto_another_model_size_or_none(tmp_path):
    """Saved with TP 2 after a step; restored onto TP 2 on another data-parallel shape,
    TP 4 and no `model` axis, every restored state takes the next step as the saved one
    would (parameters and Adam moments laid out again)."""
    batches = mlp_batches(2)
    boxed = MLP().init(jax.random.key(0), batches[0]["x"])["params"]
    config = zpp.ZeroPPConfig(**EXACT)

    def make(mesh):
        params = boxed if "model" in mesh.axis_names else nn.unbox(boxed)
        return zpp.TrainState.create(
            apply_fn=MLP().apply, params=params, tx=optax.adam(1e-2), mesh=mesh, config=config
        )

    step = zpp.shard(mse_step)
    state, _ = step(make(zpp.make_mesh(2, 2, model_size=2)), batches[0])
    zpp.save_checkpoint(tmp_path / "ck", state)
    want_state, want = step(state, batches[1])
    meshes = [
        zpp.make_mesh(1, 4, model_size=2),
        zpp.make_mesh(2, 1, model_size=4),
        zpp.make_mesh(2, 4),
    ]
    for mesh in meshes:
        restored = zpp.restore_checkpoint(tmp_path / "ck", make(mesh))
        assert int(restored.step) == 1
        assert max_rel_err(zpp.gather_params(restored), zpp.gather_params(state)) == 0.0
        got_state, got = step(restored, batches[1])
        np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)
        # The update read the restored Adam moments.
        assert max_rel_err(zpp.gather_params(got_state), zpp.gather_params(want_state)) <= 1e-5


# ----------------------------------------------------------------------------- logical names

RULES = (("mlp", "model"), ("embed", "fsdp"), ("out", None))


def logical(names, init=None):
    return nn.with_logical_partitioning(init or nn.initializers.lecun_normal(), names)


class LogicalMLP(nn.Module):
    """`MLP` annotated with logical names (MaxText's and t5x's convention): under `RULES`
    'mlp' is tensor parallelism, 'embed' ZeRO only, 'vocab' unmapped and 'out' mapped to
    nothing, so its layout is `MLP`'s."""

    @nn.compact
    def __call__(self, x):
        bias = logical(("mlp",), nn.initializers.normal(0.1))
        h = jnp.tanh(nn.Dense(16, kernel_init=logical(("embed", "mlp")), bias_init=bias)(x))
        h = nn.Dense(5, kernel_init=logical(("mlp", "embed")))(h)
        return nn.Dense(3, kernel_init=logical(("vocab", "out")))(jnp.tanh(h))


def test_logical_names_under_rules_train_as_the_mesh_names_at_tp2():
    mesh = zpp.make_mesh(2, 2, model_size=2)
    config = zpp.ZeroPPConfig(**EXACT)
    batches = mlp_batches()
    x = batches[0]["x"]
    boxed = LogicalMLP().init(jax.random.key(0), x)["params"]
    tx = optax.adam(1e-2)
    mesh_named = MLP().init(jax.random.key(0), x)["params"]
    physical = zpp.TrainState.abstract(apply_fn=MLP().apply, params=mesh_named, tx=tx, mesh=mesh)
    # From the rules= argument (here), from the active context (below), and for XLA FSDP.
    by_arg = zpp.TrainState.abstract(
        apply_fn=LogicalMLP().apply, params=boxed, tx=tx, mesh=mesh, rules=RULES
    )
    assert by_arg.layouts == physical.layouts
    fsdp = [
        baselines.xla_fsdp_state(**kw, abstract=True)
        for kw in (
            dict(apply_fn=MLP().apply, params=mesh_named, tx=tx, mesh=mesh),
            dict(apply_fn=LogicalMLP().apply, params=boxed, tx=tx, mesh=mesh, rules=RULES),
        )
    ]
    shardings = [[a.sharding for a in jax.tree.leaves((s.params, s.opt_state))] for s in fsdp]
    assert shardings[0] == shardings[1]
    assert "model" in str(fsdp[1].params["Dense_0"]["kernel"].sharding.spec)
    with nn.logical_axis_rules(RULES):
        state = zpp.TrainState.create(
            apply_fn=LogicalMLP().apply, params=boxed, tx=tx, mesh=mesh, config=config
        )
    assert state.layouts == physical.layouts
    assert state.params["Dense_0"]["kernel"].sharding.spec == P_TP
    ref = train_state.TrainState.create(apply_fn=LogicalMLP().apply, params=nn.unbox(boxed), tx=tx)
    step, ref_step = zpp.shard(mse_step), jax.jit(mse_step)
    for b in batches:
        state, m = step(state, b)
        ref, rm = ref_step(ref, b)
        np.testing.assert_allclose(float(m["loss"]), float(rm["loss"]), rtol=1e-5)
    assert max_rel_err(zpp.gather_params(state), ref.params) <= 1e-5


@pytest.mark.parametrize(
    "rules,match",
    [
        (None, "no logical axis rules are given; pass rules="),
        ((("mlp", "tensor"),), "map 'mlp' to the mesh axis 'tensor'"),
    ],
)
def test_logical_names_without_rules_or_to_an_unknown_axis_fail_in_one_line(rules, match):
    x = np.ones((8, 6), np.float32)
    boxed = LogicalMLP().init(jax.random.key(0), x)["params"]
    mesh = zpp.make_mesh(2, 2, model_size=2)
    with pytest.raises(ValueError, match=match) as err:
        zpp.TrainState.abstract(
            apply_fn=LogicalMLP().apply, params=boxed, tx=optax.sgd(0.1), mesh=mesh, rules=rules
        )
    assert "\n" not in str(err.value)
