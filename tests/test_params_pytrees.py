"""Parameters as users write them: any pytree of arrays. An Equinox model (blocks stacked
with `eqx.filter_vmap`, run with `lax.scan`, a tied head; parameters from `eqx.partition`)
and a NamedTuple holding a dataclass train exactly as on one device, and the stacked
weights are gathered per layer; under ZeRO++'s defaults an Equinox stack stays within the
quantizer's bound."""

import dataclasses
import typing
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _support import int8_gather_bound, ones_int4_two_hop_bound, zeropp_sum_step

import zeropp_jax as zpp
from zeropp_jax import baselines
from zeropp_jax.interpreter import _placement as placement

EXACT = zpp.ZeroPPConfig(weight_bits=None, grad_bits=None, compute_dtype=jnp.float32)
VOCAB, WIDTH, HIDDEN, LAYERS, SEQ = 32, 16, 24, 3, 8


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(WIDTH, HIDDEN, key=k1)
        self.down = eqx.nn.Linear(HIDDEN, WIDTH, key=k2)

    def __call__(self, h):
        def linear(lin, x):
            return x @ lin.weight.T + lin.bias

        return h + linear(self.down, jnp.tanh(linear(self.up, h)))


class GPT(eqx.Module):
    """A GPT-shaped Equinox model: embedding, scanned residual blocks, tied head."""

    embed: eqx.nn.Embedding
    blocks: Block  # stacked: every array has a leading layer axis

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=k1)
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(k2, LAYERS))

    def __call__(self, tokens):
        table = self.embed.weight
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(h, weights):
            return eqx.combine(weights, static)(h), None

        h, _ = jax.lax.scan(layer, table[tokens], dynamic)
        return h @ table.T


def train_step(state, tokens):
    def loss(p):
        logits = state.apply_fn({"params": p}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def batches(n):
    rs = np.random.RandomState(0)
    return [rs.randint(0, VOCAB, (8, SEQ + 1)).astype(np.int32) for _ in range(n)]


def max_rel_err(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def train_both(apply, params, data, mesh, step_fn=train_step):
    """`(zpp state, flax state, zpp step)` after training on `data` with both."""
    tx = optax.adam(1e-2)
    ref = baselines.TreeTrainState.create(apply_fn=apply, params=params, tx=tx)
    state = zpp.TrainState.create(apply_fn=apply, params=params, tx=tx, mesh=mesh, config=EXACT)
    step, ref_step = zpp.shard(step_fn), jax.jit(step_fn)
    for b in data:
        state, m = step(state, b)
        ref, rm = ref_step(ref, b)
        np.testing.assert_allclose(float(m["loss"]), float(rm["loss"]), rtol=1e-5)
    return state, ref, step


def test_an_equinox_model_trains_exactly_and_gathers_per_layer():
    model = GPT(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)

    def apply(variables, tokens):
        return eqx.combine(variables["params"], static)(tokens)

    mesh = zpp.make_mesh(2, 4)
    fsdp = baselines.xla_fsdp_state(
        apply_fn=apply, params=params, tx=optax.adam(1e-2), mesh=mesh, abstract=True
    )
    assert isinstance(fsdp.params, GPT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no whole-leaf gather
        state, ref, step = train_both(apply, params, batches(2), mesh)
    got = zpp.gather_params(state)
    assert isinstance(got, GPT) and got.blocks.up.weight.shape == (LAYERS, HIDDEN, WIDTH)
    assert max_rel_err(got, ref.params) <= 1e-5
    ledger = zpp.comm_ledger(step, state, batches(1)[0])
    # Gathered whole: only the per-layer vectors (the biases, `(layers, width)`, stored
    # padded to 8 rows), never a stacked matrix (its gather moves `(layers, 24, 16)`).
    whole = [r.out_bytes for r in ledger.records if placement.WHOLE_SCOPE in r.op_name]
    assert whole and max(whole) <= 4 * state.params.blocks.up.bias.size < 4 * LAYERS * 24 * 16
    # Each stacked weight's layer is gathered inside the loop: with prefetch, layers 1 ..
    # L-1 in the loop, one layer's float32 values per gather.
    layer_bytes = {4 * HIDDEN * WIDTH}
    looped = [
        r
        for r in ledger.records
        if r.phase == "forward" and r.op == "all-gather" and r.trip_count == LAYERS - 1
    ]
    assert layer_bytes <= {r.out_bytes for r in looped}, looped


class Dense(typing.NamedTuple):
    w: jax.Array
    b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLP:
    hidden: Dense
    out: Dense


def mse_step(state, batch):
    def loss(p):
        return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def test_a_dataclass_of_named_tuples_trains_exactly():
    rs = np.random.RandomState(1)
    params = MLP(
        hidden=Dense(rs.randn(6, 12).astype(np.float32), np.zeros(12, np.float32)),
        out=Dense(rs.randn(12, 3).astype(np.float32), np.zeros(3, np.float32)),
    )

    def apply(variables, x):
        p = variables["params"]
        return jnp.tanh(x @ p.hidden.w + p.hidden.b) @ p.out.w + p.out.b

    data = [{"x": rs.randn(16, 6).astype(np.float32), "y": rs.randn(16, 3)} for _ in range(2)]
    state, ref, _ = train_both(apply, params, data, zpp.make_mesh(2, 4), mse_step)
    got = zpp.gather_params(state)
    assert isinstance(got, MLP) and isinstance(got.hidden, Dense)
    assert max_rel_err(got, ref.params) <= 1e-5


class WithActivation(eqx.Module):
    w: jax.Array
    act: typing.Callable = jax.nn.gelu  # a pytree leaf, not an array


@pytest.mark.parametrize(
    "params,match",
    [
        (lambda: {"w": jnp.ones(8)}, r"callable\), not a tree of arrays.*zpp\.ShardedInit\(fn\)"),
        (
            WithActivation(jnp.ones(8)),
            r"parameter \.act is a .*eqx\.partition\(model, eqx\.is_array",
        ),
    ],
)
def test_a_function_is_not_taken_for_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        zpp.TrainState.create(
            apply_fn=lambda v, x: x, params=params, tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4)
        )


class Probe(eqx.Module):
    """Equinox layers stacked with `eqx.filter_vmap` and run by `lax.scan`, each emitting
    what it saw of its weight: with the identity as the batch, `x @ W.T` is `W.T`."""

    layers: eqx.nn.Linear  # stacked: weight (LAYERS, WIDTH, WIDTH)

    def __init__(self, key):
        make = lambda k: eqx.nn.Linear(WIDTH, WIDTH, use_bias=False, key=k)  # noqa: E731
        self.layers = eqx.filter_vmap(make)(jax.random.split(key, LAYERS))

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def layer(_, weights):
            return None, x @ eqx.combine(weights, static).weight.T

        return jnp.moveaxis(jax.lax.scan(layer, None, dynamic)[1], 0, 1)  # (batch, LAYERS, WIDTH)


def test_zeropp_defaults_on_an_equinox_stack_stay_within_the_quantizer_bound():
    """ZeRO++'s int8 weight gathers (per layer, inside the loop) and int4 two-hop gradients
    on an Equinox stack: each layer's weight as the model saw it is within half a step of
    the largest block, and the gradient of the output's sum (1 everywhere) within two
    hops' half steps of every contribution."""
    params, static = eqx.partition(Probe(jax.random.key(3)), eqx.is_array)

    def apply(variables, x):
        return eqx.combine(variables["params"], static)(x)

    x = np.eye(WIDTH, dtype=np.float32)  # WIDTH rows, 2 per device
    new, m = zeropp_sum_step(apply, params, x)  # no whole-leaf gather
    w = np.asarray(params.layers.weight, np.float64)
    seen = np.transpose(np.asarray(m["out"], np.float64), (1, 2, 0))  # (LAYERS, WIDTH, WIDTH)
    assert np.max(np.abs(seen - w)) <= int8_gather_bound(w)
    grad = w - np.asarray(zpp.gather_params(new).layers.weight, np.float64)
    assert np.max(np.abs(grad - 1.0)) <= ones_int4_two_hop_bound() + 1e-5
