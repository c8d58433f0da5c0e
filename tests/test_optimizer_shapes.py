"""The optimizer sees the model's shapes (`zeropp_jax.state._optimizer_view`): shape-reading optax
transforms train exactly as on one device; views round-trip the stored layout."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _support import regression_batches, stored_grads, trained_beside_one_device
from flax.core import meta
from flax.training import train_state
from optax.contrib import MuonDimensionNumbers

import zeropp_jax as zpp
from zeropp_jax.measure import _ledger as ledger_lib
from zeropp_jax.state import _optimizer_view as optimizer_view
from zeropp_jax.state import _partition as part

EXACT = dict(weight_bits=None, grad_bits=None, compute_dtype=jnp.float32)
COLUMN = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
COLUMN_BIAS = nn.with_partitioning(nn.initializers.normal(0.1), ("model",))
ROW = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None))


class Block(nn.Module):
    """Dense(60) + LayerNorm; with `split`, a column- then a row-parallel Dense."""

    split: bool = False

    @nn.compact
    def __call__(self, h, _=None):
        if self.split:
            h = jnp.tanh(nn.Dense(60, kernel_init=COLUMN, bias_init=COLUMN_BIAS)(h))
            h = nn.Dense(60, kernel_init=ROW)(h)
        else:
            h = nn.Dense(60, bias_init=nn.initializers.normal(0.1))(h)
        return nn.LayerNorm(scale_init=nn.initializers.normal(1.0))(jnp.tanh(h)), None


class Net(nn.Module):
    """Dense(60), `unrolled` blocks, three blocks under `nn.scan`, Dense(10): every width
    leaves padding on 8 devices (and on 4, in some `model` slices)."""

    split: bool = False
    unrolled: int = 2

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(60)(x)
        for _ in range(self.unrolled):
            h, _ = Block(self.split)(h)
        blocks = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
            metadata_params={nn.PARTITION_NAME: None},
        )
        h, _ = blocks(self.split)(h, None)
        return nn.Dense(10)(h)


def rank_mask(params):
    return jax.tree_util.tree_map(lambda p: p.ndim > 1, params)


def muon_dims(params):
    """Newton-Schulz on each kernel, a stacked one per layer; Adam for the rest."""
    dims = {2: MuonDimensionNumbers(0, 1), 3: MuonDimensionNumbers(1, 2)}
    return jax.tree_util.tree_map_with_path(
        lambda path, p: dims[p.ndim] if path[-1].key == "kernel" else None, params
    )


OPTIMIZERS = {
    "adamw_by_rank": lambda: optax.adamw(1e-3, weight_decay=0.1, mask=rank_mask),
    "adafactor": lambda: optax.adafactor(1e-3, min_dim_size_to_factor=8),
    "muon": lambda: optax.contrib.muon(1e-3, muon_weight_dimension_numbers=muon_dims),
    # The trainer's Muon: each matrix gathered once, in bfloat16, across nodes first (with
    # tensor parallelism, the `model` axis gathered in the same stage as `local`).
    "zpp_muon": lambda: zpp.muon(1e-3, muon_weight_dimension_numbers=muon_dims),
    "lion": lambda: optax.lion(1e-4, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}
MODELS = {  # name: (model, mesh (node, local, model))
    "unrolled_and_scanned": (Net(), (2, 4, 1)),
    "tensor_parallel": (Net(split=True, unrolled=1), (2, 2, 2)),
}


def loss_fn(params, apply_fn, batch):
    out = apply_fn({"params": params}, batch["x"])
    return jnp.mean((out - batch["y"]) ** 2)


def apply(state, grads):
    return state.apply_gradients(grads=grads)


@functools.partial(jax.jit, static_argnums=(1, 2))
def round_trip(x, layout, mesh):
    view = optimizer_view.to_view(x, layout, mesh)
    return optimizer_view.from_view(view, layout, mesh)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_shape_reading_optimizers_match_one_device(model_name):
    """Three steps of every optimizer from the same one-device gradients: the sharded
    update (stored layout in, model-shaped views inside) against optax on one device."""
    model, (nodes, local, k) = MODELS[model_name]
    data = regression_batches(3, 64, 10)
    params = model.init(jax.random.key(1), data[0]["x"])["params"]
    mesh = zpp.make_mesh(nodes, local, model_size=k)
    grad_fn = jax.jit(jax.grad(loss_fn), static_argnums=1)
    for opt, make in OPTIMIZERS.items():
        tx = make()
        ref = train_state.TrainState.create(apply_fn=model.apply, params=meta.unbox(params), tx=tx)
        state = zpp.TrainState.create(
            apply_fn=model.apply, params=params, tx=tx, mesh=mesh, config=zpp.ZeroPPConfig(**EXACT)
        )
        step, ref_step = jax.jit(apply), jax.jit(apply)
        for b in data:
            grads = grad_fn(ref.params, model.apply, b)
            ref = ref_step(ref, grads)
            state = step(state, stored_grads(grads, state))
        got = zpp.gather_params(state)
        for (path, g), w in zip(
            jax.tree_util.tree_leaves_with_path(got),
            jax.tree_util.tree_leaves(ref.params),
            strict=True,
        ):
            err = float(jnp.max(jnp.abs(g - w))) / float(jnp.max(jnp.abs(w)))
            assert err <= 1e-6, f"{opt} {jax.tree_util.keystr(path)}: relative error {err:.2e}"
        # The optimizer state mirrors the model's shapes: each moment kept in its
        # parameter's stored layout, padding zero.
        layouts = state.layouts[1]
        mirror = state.opt_mirror
        for x, i in zip(jax.tree_util.tree_leaves(state.opt_state), mirror, strict=True):
            if i is not None:
                lo = layouts[i]
                assert x.shape == lo.stored_shape and x.sharding.spec == part.leaf_spec(lo)
                back = round_trip(x, lo, mesh)
                np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
        assert any(i is not None for i in mirror), opt


@pytest.mark.parametrize("opt", ["adafactor", "muon"])
def test_end_to_end_on_the_scanned_model_matches_one_device(opt):
    """`zpp.shard` training (the island's gradients and the update on model-shaped views)
    against `jax.jit` on one device, 3 steps, unquantized float32: the three `nn.scan`
    blocks alone (stacked leaves, widths that leave padding on 8 devices)."""
    model = Net(unrolled=0)
    data = regression_batches(3, 64, 10)
    params = model.init(jax.random.key(1), data[0]["x"])["params"]
    mesh, config = zpp.make_mesh(2, 4), zpp.ZeroPPConfig(**EXACT)
    state, ref = trained_beside_one_device(model, params, OPTIMIZERS[opt](), mesh, config, data)
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(zpp.gather_params(state)),
        jax.tree_util.tree_leaves(ref.params),
        strict=True,
    ):
        err = float(jnp.max(jnp.abs(g - w))) / float(jnp.max(jnp.abs(w)))
        assert err <= 1e-5, f"{opt} {jax.tree_util.keystr(path)}: relative error {err:.2e}"


def test_elementwise_updates_add_no_collective_and_muon_shows_as_update():
    model, _ = MODELS["unrolled_and_scanned"]
    params = model.init(jax.random.key(1), jnp.ones((8, 10)))["params"]
    mesh = zpp.make_mesh(2, 4)
    update_bytes = {}
    for opt in ("adamw_by_rank", "muon"):
        state = zpp.TrainState.create(
            apply_fn=model.apply,
            params=params,
            tx=OPTIMIZERS[opt](),
            mesh=mesh,
            config=zpp.ZeroPPConfig(**EXACT),
        )
        grads = jax.tree_util.tree_map(jnp.zeros_like, state.params)
        led = zpp.comm_ledger(jax.jit(apply), state, grads, compiled=True)
        update_bytes[opt] = sum(r.bytes_sent for r in led.records if r.phase == "update")
    assert update_bytes["adamw_by_rank"] == 0
    assert update_bytes["muon"] > 0
    assert "update" in ledger_lib.PHASES


def test_elementwise_update_on_stacked_leaves_copies_nothing():
    # Stored layout 3 keeps a stacked leaf's rank, so where the device count divides its
    # rows the optimizer's view is the stored array: AdamW's compiled update holds no more
    # temporaries than the same optax chain under plain jax.jit on the model-shaped arrays
    # (plus the engine's finiteness check). Layout 2's reshaped views held one more
    # leaf-sized copy here (43,152 temporary bytes against 30,864 for both).
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from zeropp_jax.state._finite import all_finite

    mesh = zpp.make_mesh(2, 4)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    model = {"stack": jnp.full((4, 64, 96), 0.1), "w": jnp.full((64, 96), 0.1)}
    state = zpp.TrainState.create(apply_fn=lambda v, x: x, params=model, tx=tx, mesh=mesh)
    assert state.params["stack"].shape == (4, 64, 96)
    grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 0.01), state.params)
    step = jax.jit(lambda s, g: s.apply_gradients(grads=g), donate_argnums=0)
    engine = step.lower(state, grads).compile().memory_analysis().temp_size_in_bytes

    specs = {"stack": P(None, part.DP_AXES), "w": P(part.DP_AXES)}
    put = lambda t: {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in t.items()}  # noqa: E731
    p, g = put(model), put(jax.tree_util.tree_map(lambda x: jnp.full_like(x, 0.01), model))

    def plain(p, s, g):
        u, s = tx.update(g, s, p)
        finite = all_finite([g["stack"], g["w"]], [specs["stack"], specs["w"]], mesh, join=False)
        return optax.apply_updates(p, u), s, finite

    ref = jax.jit(plain, donate_argnums=(0, 1)).lower(p, tx.init(p), g).compile()
    assert engine <= ref.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    "shape,dim,k,n",
    [
        ((10, 7), None, 1, 8),
        ((13,), None, 1, 8),
        ((3, 10, 7), None, 1, 8),
        ((6, 10), 1, 2, 4),
        ((6, 10), 0, 2, 4),
        ((10,), 0, 2, 4),
        ((3, 6, 10), 2, 2, 4),
        ((3, 6, 10), 1, 2, 4),
        ((2, 6, 4, 10), 3, 2, 4),
    ],
)
def test_views_crop_the_stored_layout(shape, dim, k, n):
    mesh = zpp.make_mesh(2, n // 2, model_size=k)
    lo = part.with_model_split(part.leaf_layout("w", np.zeros(shape, np.float32), n), dim, k, n)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1
    stored = part.to_master(x, lo)
    view = jax.jit(optimizer_view.to_view, static_argnums=(1, 2))(stored, lo, mesh)
    np.testing.assert_array_equal(np.asarray(view), x)
    back = jax.jit(optimizer_view.from_view, static_argnums=(1, 2))(jnp.asarray(x), lo, mesh)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(stored))
    # Whole rows per device: every kept row's padding is whole rows of its split axis at
    # its end.
    assert lo.padded % n == 0 and lo.padded_rows % n == 0
    assert int(np.prod(lo.padded_row_shape)) == lo.padded_cols
    assert lo.padded_row_shape[lo.axis] == lo.padded_rows
