"""XLA FSDP (`zeropp_jax.baselines`) and the gradient scale of every engine, against one
device."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_engine import EXACT, TX, Net, data, max_rel_err, reference, train_step

import zeropp_jax as zpp
from zeropp_jax._activation_sharding import constrain_to_batch
from zeropp_jax.baselines import (
    cast_floats,
    embed_size_of,
    fsdp_spec,
    step_ledger,
    xla_fsdp_state,
    xla_fsdp_step,
)
from zeropp_jax.measure._hlo_text import call_paths, parse_hlo_module
from zeropp_jax.state._partition import BATCH_SPEC
from zeropp_jax.train.model import GPT, GPTConfig, init_fn, loss_fn, param_count

ALL = ("node", "local")


@pytest.mark.parametrize(
    "shape, spec",
    [
        ((16, 37), P(ALL)),  # the first dimension that divides
        ((37, 24), P(None, ALL)),
        ((32, 64), P(None, ALL)),  # the largest one
        ((4, 64, 16), P(None, ALL)),  # stacked: never the layer axis
        ((8, 3, 5), P()),  # only the layer axis divides: replicated
        ((37,), P()),
        ((), P()),
    ],
)
def test_fsdp_spec(shape, spec):
    assert fsdp_spec(shape, 8) == spec


def _fsdp(params, tx, mesh, compute_dtype=jnp.float32):
    state = xla_fsdp_state(
        apply_fn=Net().apply, params=params, tx=tx, mesh=mesh, compute_dtype=compute_dtype
    )
    return state, xla_fsdp_step(train_step, state, mesh)


def test_xla_fsdp_trains_like_one_device_and_shards_everything():
    mesh = zpp.make_mesh(2, 4)
    params = Net().init(jax.random.key(0), data()["x"])["params"]
    batches = [data(seed=s) for s in range(3)]
    ref_params, ref_losses = reference(params, TX, batches)
    state, step = _fsdp(params, TX, mesh)
    kernel = state.params["Dense_0"]["kernel"]  # (11, 37): no dimension divides by 8
    assert kernel.sharding.spec == P()
    mu = state.opt_state[1][0].mu["Dense_1"]["kernel"]  # (37, 19): neither
    assert mu.sharding.spec == P()
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    assert max_rel_err(state.params, ref_params) <= 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_xla_fsdp_shards_the_optimizer_state_and_computes_in_bfloat16():
    mesh = zpp.make_mesh(2, 4)
    params = {"w": jnp.ones((16, 24)), "b": jnp.zeros((24,))}
    state = xla_fsdp_state(
        apply_fn=lambda v, x: x @ v["params"]["w"] + v["params"]["b"],
        params=params,
        tx=optax.adam(1e-3),
        mesh=mesh,
    )
    assert state.params["w"].sharding.spec == P(None, ALL)
    assert state.opt_state[0].mu["w"].sharding.spec == P(None, ALL)
    assert state.params["w"].dtype == jnp.float32  # the master stays float32
    # bfloat16 inputs stay bfloat16 only if the float32 weights were cast to it.
    out = state.apply_fn({"params": state.params}, jnp.ones((8, 16), jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="expected \\('node', 'local'\\)"):
        xla_fsdp_state(
            apply_fn=None,
            params=params,
            tx=optax.sgd(1.0),
            mesh=jax.make_mesh((8,), ("data",)),
        )


def _one_device_gradient(params, batch):
    def loss_fn(p):
        return jnp.mean((Net().apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    return jax.jit(jax.grad(loss_fn))(params)


@pytest.mark.parametrize(
    "engine, tolerance",
    [
        ("xla_fsdp", 1e-5),
        ("zero3", 1e-5),
        ("zeropp_unquantized", 1e-5),
        # bfloat16 weights, gradients and partial sums: a few bfloat16 roundings (2^-8).
        ("zero3_bf16_reduce_scatter", 2**-5),
    ],
)
def test_gradient_scale_against_one_device(engine, tolerance):
    # SGD with learning rate 1 and no clipping: the update is the gradient itself, so a
    # wrong divisor (the device count, the node count, the batch per device) shows as a
    # factor, which AdamW's normalisation and clipping would hide.
    mesh = zpp.make_mesh(2, 4)
    batch = data(seed=4, batch=32)
    params = Net().init(jax.random.key(1), batch["x"])["params"]
    tx = optax.sgd(1.0)
    if engine == "xla_fsdp":
        state, step = _fsdp(params, tx, mesh)
    else:
        config = {
            "zero3": zpp.ZeroPPConfig.zero3(compute_dtype=jnp.float32),
            "zeropp_unquantized": zpp.ZeroPPConfig(**EXACT),
            "zero3_bf16_reduce_scatter": zpp.ZeroPPConfig.zero3(grad_reduce="reduce_scatter"),
        }[engine]
        state = zpp.TrainState.create(
            apply_fn=Net().apply, params=params, tx=tx, mesh=mesh, config=config
        )
        step = zpp.shard(train_step, mesh=mesh, config=config)
    state, _ = step(state, batch)
    new = state.params if engine == "xla_fsdp" else zpp.gather_params(state)
    update = jax.tree.map(lambda p, q: np.asarray(p) - np.asarray(q), params, new)
    assert max_rel_err(update, _one_device_gradient(params, batch)) <= tolerance


def test_reference_is_a_flax_train_state():
    # The baseline runs the user's train_step on flax's own TrainState, unchanged.
    mesh = zpp.make_mesh(2, 4)
    params = Net().init(jax.random.key(0), data()["x"])["params"]
    state, _ = _fsdp(params, TX, mesh)
    assert isinstance(state, train_state.TrainState)


@pytest.mark.parametrize(
    "shape, spec",
    [
        ((32, 96), P(ALL)),  # qkv: its input (the embedding) dimension, not the largest
        ((128, 32), P(None, ALL)),  # the MLP's output matrix
        ((32, 32), P(None, ALL)),  # square: the outputs
        ((2, 32, 128), P(None, ALL)),  # stacked: never the layer axis
        ((96,), P(ALL)),  # no embedding dimension: the largest
    ],
)
def test_fsdp_spec_splits_the_embedding_dimension(shape, spec):
    assert fsdp_spec(shape, 8, embed_size=32) == spec


# A scanned GPT whose sizes tell activations from weights: per-device batch 2 of global
# 16, sequence 24; weights of widths 32, 96, 128 and 256.
GPT_CFG = GPTConfig(seq_len=24, d_model=32, n_layers=2, n_heads=4, scan=True)
BATCH = 16


def _gpt_step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


@pytest.fixture(scope="module")
def gpt_baseline():
    mesh = zpp.make_mesh(2, 4)
    params = init_fn(GPT_CFG, 0)
    state = xla_fsdp_state(
        apply_fn=GPT(GPT_CFG).apply, params=params, tx=optax.adam(1e-3), mesh=mesh, abstract=True
    )
    assert embed_size_of(state.params) == GPT_CFG.d_model
    batch = jax.ShapeDtypeStruct(
        (BATCH, GPT_CFG.seq_len + 1), jnp.int32, sharding=NamedSharding(mesh, BATCH_SPEC)
    )
    return mesh, params, state, batch


def _activation_shaped(shape: str) -> bool:
    """A per-device or global activation of the GPT: the batch beside the sequence."""
    dims = [int(d) for d in re.findall(r"\[([\d,]*)\]", shape)[0].split(",") if d]
    seq, rows = GPT_CFG.seq_len, (BATCH, BATCH // 8)
    return any(d in rows for d in dims) and seq in dims or any(r * seq in dims for r in rows)


def _loop_collectives_on_activations(compiled_text: str) -> list[str]:
    module = parse_hlo_module(compiled_text)
    paths = call_paths(module)
    found = []
    for comp, instructions in module.computations.items():
        if not any(call.opcode == "while" for path in paths.get(comp, ()) for call, _ in path):
            continue
        shapes = {i.name: i.shape for i in instructions}
        for ins in instructions:
            if ins.opcode.removesuffix("-start") not in ("all-gather", "all-reduce", "all-to-all"):
                continue
            moved = [ins.shape] + [shapes[o] for o in ins.operands]
            if any(_activation_shaped(s) for s in moved):
                found.append(f"{ins.opcode} {ins.shape} in {comp}")
    return found


def test_xla_fsdp_loops_gather_weights_never_activations(gpt_baseline):
    mesh, _, state, batch = gpt_baseline
    compiled = xla_fsdp_step(_gpt_step, state, mesh).lower(state, batch).compile().as_text()
    assert "while" in compiled
    assert _loop_collectives_on_activations(compiled) == []
    # The same step traced without the mesh has no activation constraints, and XLA's
    # partitioner then moves activations inside the loop: what the check above catches.
    shardings = jax.tree.map(lambda x: x.sharding, state)
    free = jax.jit(
        _gpt_step,
        in_shardings=(shardings, batch.sharding),
        out_shardings=(shardings, NamedSharding(mesh, P())),
    )
    assert _loop_collectives_on_activations(free.lower(state, batch).compile().as_text())


def test_xla_fsdp_on_equal_wires_sends_what_zero3_sends(gpt_baseline):
    mesh, params, state, batch = gpt_baseline
    step = xla_fsdp_step(_gpt_step, state, mesh)
    wire = zpp.comm_ledger(step, state, batch, param_count=param_count(GPT_CFG), partitioned=True)
    # The partitioner's program: the weight matrices cross in bfloat16 (cast before the
    # gather; the LayerNorm vectors and the tied head's backward gather float32, as the
    # program asks), the gradients as reduce-scatters (an all-reduce sliced to 1/8).
    by_op = wire.bytes_by("op", "dtype")
    assert by_op[("all-gather", "bfloat16")] > 3 * by_op[("all-gather", "float32")]
    assert by_op[("reduce-scatter", "bfloat16")] > 0
    assert by_op.get(("all-reduce", "bfloat16"), 0) < 1e-3 * wire.total_bytes
    zero3 = step_ledger(
        _gpt_step,
        batch,
        apply_fn=GPT(GPT_CFG).apply,
        params=params,
        tx=optax.adam(1e-3),
        mesh=mesh,
        config=zpp.ZeroPPConfig.zero3(),
    )
    # ZeRO-3 sends every value in 16 bits, unpadded (the stored layout pads no leaf of this
    # GPT on 8 devices); the XLA program sends the LayerNorm vectors, the tied head's
    # backward gather and their reductions in float32, as the program asks. Counted at 16
    # bits, the two send the same within 10% (XLA's gathers of the int32 tokens and its
    # all-to-alls are the rest).
    at_16 = sum(b / 2 if dtype == "float32" else b for (_, dtype), b in by_op.items())
    assert 0.95 * zero3.total_bytes <= at_16 <= 1.1 * zero3.total_bytes, (at_16, zero3.total_bytes)
    assert wire.total_bytes <= 1.25 * zero3.total_bytes, (wire.total_bytes, zero3.total_bytes)


# XLA FSDP at a GPU's widths (`xla_fsdp_state(..., gpu_wire=True)`).

BF16_ROUNDING = 2.0**-8
"""bfloat16's unit roundoff: rounding to nearest moves a value by at most this times it."""


class WireMLP(nn.Module):
    """32 -> 32 -> 32 -> `out` in bfloat16, activations pinned to the batch. With `out`
    12 the head's bias is split over no dimension (8 does not divide 12): a leaf whose
    gradient a GPU all-reduces."""

    out: int = 12

    @nn.compact
    def __call__(self, x):
        x = x.astype(jnp.bfloat16)
        for i, width in enumerate((32, 32, self.out)):
            x = nn.Dense(width)(constrain_to_batch(x))
            x = jax.nn.gelu(x) if i < 2 else x
        return constrain_to_batch(x)


def _wire_step(state, batch):
    def loss_fn(params):
        out = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def _wire_batch(out, seed=0, rows=32):
    rs = np.random.RandomState(seed)
    return {
        "x": rs.randn(rows, 32).astype(np.float32),
        "y": rs.randn(rows, out).astype(np.float32),
    }


def _both(model, params, tx, mesh, abstract=False):
    """The plain baseline and the 16-bit-wire one: `{gpu_wire: (state, step)}`."""
    out = {}
    for gpu_wire in (False, True):
        state = xla_fsdp_state(
            apply_fn=model.apply,
            params=params,
            tx=tx,
            mesh=mesh,
            abstract=abstract,
            gpu_wire=gpu_wire,
        )
        out[gpu_wire] = state, xla_fsdp_step(_wire_step, state, mesh, donate_state=False)
    return out


def _partial_gradients(model, params, batch, n):
    """Each device's share of the gradient of the mean loss (the rows it holds, in device
    order), computed on one device in bfloat16 as the step computes it: `(n, ...)` per
    leaf."""

    def loss(p, rows):
        out = model.apply({"params": cast_floats(p, jnp.bfloat16)}, rows["x"])
        return jnp.mean((out.astype(jnp.float32) - rows["y"]) ** 2) / n

    blocks = jax.tree.map(lambda a: a.reshape(n, -1, *a.shape[1:]), batch)
    return jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(params, blocks)


def test_gpu_wire_trains_like_the_plain_baseline():
    # SGD with learning rate 1: the update is the gradient. The forward is the same
    # program on the same bits (a gather of uint16 bits is exact), so the loss is equal
    # to the bit. The gradients differ only in how the 16-bit partial gradients p_1..p_G
    # of the G devices are summed: XLA:CPU sums them in float32 and rounds once to
    # bfloat16; the 16-bit ring rounds its running sum to bfloat16 at each of its G - 1
    # hops, as a GPU's ring does. Each rounding moves a partial sum by at most u = 2^-8
    # of it, and every partial sum is at most sum_i |p_i|: with the two final roundings
    # and one for a partial that one side sums before rounding it, the two gradients
    # differ by at most (G + 2) u sum_i |p_i| per value (float32's own roundings, 2^-24,
    # in the last term).
    mesh = zpp.make_mesh(2, 4)
    n = 8
    model = WireMLP()
    batch = _wire_batch(12)
    params = model.init(jax.random.key(0), batch["x"][:1])["params"]
    runs = _both(model, params, optax.sgd(1.0), mesh)
    after, losses = {}, {}
    for gpu_wire, (state, step) in runs.items():
        assert state.params["Dense_0"]["kernel"].dtype == jnp.float32  # the master
        assert state.params["Dense_2"]["bias"].sharding.spec == P()
        new, metrics = step(state, batch)
        after[gpu_wire], losses[gpu_wire] = new.params, float(metrics["loss"])
    assert losses[True] == losses[False]
    plain_sharding = jax.tree.map(lambda x: x.sharding, after[False])
    assert jax.tree.map(lambda x: x.sharding, after[True]) == plain_sharding
    partials = _partial_gradients(model, params, batch, n)
    for path, p0 in jax.tree_util.tree_leaves_with_path(params):
        p0 = np.asarray(p0)
        g_plain, g_wire = (
            p0 - np.asarray(jax.tree_util.tree_leaves(after[w])[_index(params, path)])
            for w in (False, True)
        )
        absolute = np.abs(np.asarray(_leaf(partials, path))).sum(0)
        bound = (n + 2) * BF16_ROUNDING * absolute + 2.0**-22 * (np.abs(p0) + np.abs(g_plain))
        excess = np.abs(g_wire - g_plain) - bound
        assert excess.max() <= 0, (jax.tree_util.keystr(path), float(excess.max()))
        assert np.abs(g_plain).max() > 0


def _index(tree, path):
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    return paths.index(path)


def _leaf(tree, path):
    return jax.tree_util.tree_leaves(tree)[_index(tree, path)]


def test_gpu_wire_sends_what_the_partitioner_asks_at_16_bits():
    # Every leaf split over the 8 devices (out 32): the partitioner's program (a GPU's
    # widths) gathers the bfloat16 weights once, forward, and reduce-scatters their
    # bfloat16 gradients; XLA:CPU widens both to float32 (and all-reduces). The 16-bit
    # wire's compiled CPU program gathers uint16 and reduce-scatters in a uint16 ring:
    # per device the partitioner's bytes, half the widened gathers.
    mesh = zpp.make_mesh(2, 4)
    model = WireMLP(out=32)
    batch = _wire_batch(32)
    params = model.init(jax.random.key(0), batch["x"][:1])["params"]
    runs = _both(model, params, optax.adam(1e-3), mesh, abstract=True)
    (plain_state, plain_step), (wire_state, wire_step) = runs[False], runs[True]
    gpu = zpp.comm_ledger(plain_step, plain_state, batch, partitioned=True)
    cpu = zpp.comm_ledger(plain_step, plain_state, batch, compiled=True)
    wire = zpp.comm_ledger(wire_step, wire_state, batch, compiled=True)
    gpu_by, cpu_by, wire_by = (x.bytes_by("op", "dtype") for x in (gpu, cpu, wire))
    assert gpu_by[("all-gather", "bfloat16")] == wire_by[("all-gather", "uint16")]
    assert cpu_by[("all-gather", "float32")] == 2 * wire_by[("all-gather", "uint16")]
    assert gpu_by[("reduce-scatter", "bfloat16")] == wire_by[("collective-permute", "uint16")]
    # Nothing else moves but the loss's float32 scalar.
    assert set(wire_by) == {
        ("all-gather", "uint16"),
        ("collective-permute", "uint16"),
        ("all-reduce", "float32"),
    }
    assert all(r.in_bytes == 4 for r in wire.records if r.dtype == "float32")
    assert {r.phase for r in wire.records if r.op == "all-gather"} == {"forward"}
    # Through the node link: the partitioner's collectives in NCCL's ring order.
    nccl = zpp.comm_ledger(plain_step, plain_state, batch, partitioned=True, links="nccl")
    np.testing.assert_array_equal(wire.node_link_bytes(), nccl.node_link_bytes())


def test_gpu_wire_says_what_it_needs():
    params = {"w": jnp.ones((16, 24))}

    def make(mesh, **kw):
        return xla_fsdp_state(
            apply_fn=lambda v, x: x @ v["params"]["w"],
            params=params,
            tx=optax.sgd(1.0),
            mesh=mesh,
            gpu_wire=True,
            **kw,
        )

    with pytest.raises(ValueError, match="compute_dtype is float32"):
        make(zpp.make_mesh(2, 4), compute_dtype=jnp.float32)
    with pytest.raises(ValueError, match="without model_size"):
        make(zpp.make_mesh(2, 2, model_size=2))
    state = make(zpp.make_mesh(2, 4))
    with pytest.raises(ValueError, match="does not divide by the 8 devices"):
        state.apply_fn({"params": state.params}, jnp.ones((12, 16), jnp.bfloat16))
    out = state.apply_fn({"params": state.params}, jnp.ones((8, 16), jnp.bfloat16))
    np.testing.assert_array_equal(out, np.full((8, 24), 16.0))


def test_gpu_wire_runs_the_scanned_gpt_unchanged(gpt_baseline):
    # The trainer's GPT (a scanned stack, a tied head, the targets passed by keyword):
    # the model's own parameters, and the first step's loss to the bit.
    mesh, params, _, _ = gpt_baseline
    tokens = np.random.RandomState(0).randint(0, GPT_CFG.vocab_size, (BATCH, GPT_CFG.seq_len + 1))
    losses = {}
    for gpu_wire in (False, True):
        state = xla_fsdp_state(
            apply_fn=GPT(GPT_CFG).apply,
            params=params,
            tx=optax.adam(1e-3),
            mesh=mesh,
            gpu_wire=gpu_wire,
        )
        _, metrics = xla_fsdp_step(_gpt_step, state, mesh)(state, tokens)
        losses[gpu_wire] = float(metrics["loss"])
    assert losses[True] == losses[False]
