"""The layered scan (zeropp_jax/interpreter/_layered_scan.py): the model's own remat inside
a scan over stacked weights, against one device, and what it computes."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _support import int8_gather_bound, ones_int4_two_hop_bound, zeropp_sum_step
from flax.training import train_state

import zeropp_jax as zpp
from zeropp_jax.interpreter import _placement as placement

EXACT = dict(weight_bits=None, grad_bits=None, compute_dtype=jnp.float32)
LAYERS, WIDTH, BATCH, STEPS = 2, 16, 16, 2
TX = optax.adam(1e-2)
REMATS = {"none": None, "full": dict(policy=None)}
"""The model's own remat around each scanned block: none, or `nn.remat` recomputing all."""


def train_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def data(seed):
    rs = np.random.RandomState(seed)
    x = rs.randn(BATCH, WIDTH).astype(np.float32)
    return {"x": x, "y": rs.randn(BATCH, WIDTH).astype(np.float32)}


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        u = jnp.tanh(nn.Dense(2 * WIDTH, use_bias=False)(h))
        return h + nn.Dense(WIDTH, use_bias=False)(u), None


def stack(remat: str) -> nn.Module:
    block = Block if REMATS[remat] is None else nn.remat(Block, **REMATS[remat])

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
            )
            h, _ = scan()(x, None)
            return h

    return Stack()


def test_without_remat_the_backward_recomputes_nothing():
    """The backward loop keeps what the model keeps: without remat it recomputes no layer,
    so the step computes less than with `nn.remat` recomputing every layer (exactness
    under each kind of remat: the placement tests below)."""
    mesh = zpp.make_mesh(2, 4)
    flops = {}
    for remat in REMATS:
        model = stack(remat)
        params = model.init(jax.random.key(0), data(0)["x"])["params"]
        state = zpp.TrainState.abstract(
            apply_fn=model.apply, params=params, tx=TX, mesh=mesh, config=zpp.ZeroPPConfig(**EXACT)
        )
        compiled = zpp.shard(train_step).lower(state, data(0)).compile()
        flops[remat] = compiled.cost_analysis()["flops"]
    # Full remat recomputes at least one layer's two matmuls more (2 * rows * W * 2W flops
    # each on this device's rows; XLA's cost analysis counts a loop's body once, whatever
    # its trip count).
    rows = BATCH // 8
    assert flops["full"] - flops["none"] >= 2 * (2 * rows * WIDTH * 2 * WIDTH), flops


def test_prefetch_holds_about_the_next_layer_not_the_peeled_layer_s_recompute():
    """With prefetch the backward loop's last layer runs after the loop (`pipelined`), and
    prefetch costs about the next layer's weights and their wire, under 1.25 layers of
    gathered weights here. Two things hold it there:
    - the peeled layer's kept values wait for the cotangent reaching it: else XLA
      recomputes that layer's forward from them before the loop and holds it through
      every other layer's backward (more than 1.75 layers);
    - on XLA:CPU the peeled layer runs in a `lax.cond` branch: else the attention's zero
      accumulators and the mask's fill that its recompute builds from constants are built
      at the step's start, shared with the forward's peeled layer, and held through the
      backward loop (1.43 layers).
    ZeRO-3 here; ZeRO++ runs the same `pipelined` (1.02 layers, 1.43 without the branch,
    in a probe)."""
    from _support import XLA_DEFAULTS, gpt_step_temp

    from zeropp_jax.train.model import GPTConfig

    cfg = GPTConfig(
        seq_len=256, d_model=256, n_layers=4, n_heads=4, vocab_size=256, scan=True,
        remat="full", attn_chunk=64,
    )  # fmt: skip
    temp = {
        prefetch: gpt_step_temp(cfg, zpp.ZeroPPConfig.zero3(prefetch=prefetch), XLA_DEFAULTS)
        for prefetch in (False, True)
    }
    layer = 12 * cfg.d_model**2 * 2  # one layer's gathered bfloat16 weights
    assert temp[True] - temp[False] < 1.25 * layer, (temp, layer)


# ----------------------------------------------------------------------------- placement
# Models whose stacked weights reach their scan through what MaxText, praxis and levanter
# put in between. Each is exact against one device (float32, unquantized), gathers every
# stacked weight once per layer inside its loop and nothing whole.


class AxisOneBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + jnp.tanh(nn.Dense(WIDTH)(h)), None


class AxisOne(nn.Module):
    """`nn.scan` with the layer axis stored at 1 (MaxText's `param_scan_axis=1`): flax
    moves it to the front with a transpose before the scan. The block is under `nn.remat`
    keeping its matmul outputs."""

    @nn.compact
    def __call__(self, x):
        block = nn.remat(AxisOneBlock, policy=jax.checkpoint_policies.dots_saveable)
        scan = nn.scan(
            block, variable_axes={"params": 1}, split_rngs={"params": True}, length=LAYERS
        )
        h, _ = scan()(x, None)
        return h


def lax_mix():
    """Plain functions over stacked weights: a nested scan (blocks of scanned sub-layers,
    no remat), a `lax.map` over a reshaped stack (`jax.checkpoint` keeping the matmul
    outputs), a reversed scan over a stack stored with its layer axis last (`jax.checkpoint`
    recomputing all), a scan over a slice of a stack, and a `fori_loop` indexing a stack."""
    rs = np.random.RandomState(3)

    def w(*shape):
        return (rs.randn(*shape) / np.sqrt(WIDTH)).astype(np.float32)

    params = {
        "nested": w(LAYERS, 2, WIDTH, WIDTH),
        "mapped": w(LAYERS, WIDTH, 2, WIDTH // 2),
        "last": w(WIDTH, WIDTH, LAYERS),
        "sliced": w(LAYERS + 1, WIDTH, WIDTH),
        "counted": w(LAYERS, WIDTH, WIDTH),
    }

    def apply(variables, x):
        p = variables["params"]

        def sub(h, w):
            return h + jnp.tanh(h @ w), None

        def block(h, ws):
            return jax.lax.scan(sub, h, ws)[0], None

        h, _ = jax.lax.scan(block, x, p["nested"])
        mapped = p["mapped"].reshape(LAYERS, WIDTH, WIDTH)
        dots = jax.checkpoint(
            lambda w: jnp.tanh(h @ w), policy=jax.checkpoint_policies.dots_saveable
        )
        h = h + jnp.mean(jax.lax.map(dots, mapped), axis=0)
        h, _ = jax.lax.scan(jax.checkpoint(sub), h, jnp.moveaxis(p["last"], 2, 0), reverse=True)
        h, _ = jax.lax.scan(sub, h, p["sliced"][1:])
        return jax.lax.fori_loop(0, LAYERS, lambda i, h: sub(h, p["counted"][i])[0], h)

    return apply, params


def axis_one():
    model = AxisOne()
    return model.apply, model.init(jax.random.key(0), data(0)["x"])["params"]


def split_inner():
    """Leaves whose first axis does not divide over 8 devices, so that the stored layout
    splits another (`partition.fit_axis`): a scan over `heads` `(LAYERS, 12, 1, 8)`, split
    on its last axis, and `back` `(LAYERS, 8, 12)`, on its rows; `up` `(12, WIDTH)`, on its
    columns, outside the loop."""
    rs = np.random.RandomState(5)

    def w(*shape):
        return (rs.randn(*shape) / np.sqrt(shape[-2])).astype(np.float32)

    params = {
        "down": w(WIDTH, 12),
        "heads": w(LAYERS, 12, 1, 8),
        "back": w(LAYERS, 8, 12),
        "up": w(12, WIDTH),
    }

    def apply(variables, x):
        p = variables["params"]

        def block(h, ws):
            heads, back = ws
            u = jnp.tanh(jnp.einsum("bd,dhk->bhk", h, heads).reshape(h.shape[0], 8))
            return h + jnp.tanh(u @ back), None

        h, _ = jax.lax.scan(block, x @ p["down"], (p["heads"], p["back"]))
        return h @ p["up"]

    return apply, params


def layers_split():
    """A stack scanned over its axis 1 whose 8 layers divide over 8 devices, `(12, 8, 12)`:
    stored split on its layer axis, so it is re-laid out by one all-to-all (`relayout`'s
    second case; `axis_one`'s 2 layers are not, and move locally)."""
    rs = np.random.RandomState(6)
    params = {"moved": (rs.randn(12, 8, 12) / np.sqrt(12)).astype(np.float32)}

    def apply(variables, x):
        def sub(h, w):
            return h + jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(sub, x[:, :12], jnp.moveaxis(variables["params"]["moved"], 1, 0))
        return jnp.concatenate([h, x[:, 12:]], axis=1)

    return apply, params


def one_row():
    """A leaf of rank 3 stored as one row, `(16, 4, 12)`: no axis of a slice along axis 0
    fits 8 devices (4 -> 8, 12 -> 16), its 16 does, so it is split on axis 0, unpadded
    (`partition.keeps_layers`). Scanned over its axis 1 (MaxText's way), each device's
    block is transposed locally into 4 layers of `(16, 12)`, each split on its 16 rows."""
    rs = np.random.RandomState(7)
    params = {"moved": (rs.randn(16, 4, 12) / np.sqrt(16)).astype(np.float32)}

    def apply(variables, x):
        def sub(h, w):
            return h + jnp.tanh(h @ w) @ w.T, None

        h, _ = jax.lax.scan(sub, x, jnp.moveaxis(variables["params"]["moved"], 1, 0))
        return h

    return apply, params


PLACED = {
    "axis_one": axis_one,
    "lax_mix": lax_mix,
    "split_inner": split_inner,
    "layers_split": layers_split,
    "one_row": one_row,
}
SPLIT_AXES = {
    "split_inner": {"back": 0, "down": 0, "heads": 2, "up": 1},
    # the kernel (16, 2, 16): its 2 layers do not divide 8, its columns do (moved locally).
    "axis_one": {
        "ScanCheckpointAxisOneBlock_0/Dense_0/bias": 0,
        "ScanCheckpointAxisOneBlock_0/Dense_0/kernel": 1,
    },
    "layers_split": {"moved": 0},
    "one_row": {"moved": 0},
}
"""Per model, the axis of each leaf's row (`LeafLayout.axis`) the stored layout splits."""


LAYER = WIDTH * WIDTH * 4
"""Bytes of one gathered float32 `(WIDTH, WIDTH)` layer."""
FORWARD_GATHERS = {
    "axis_one": {LAYER: LAYERS},
    # last, mapped, sliced and counted: a (WIDTH, WIDTH) layer each; nested: a block of two.
    "lax_mix": {LAYER: 4 * LAYERS, 2 * LAYER: LAYERS},
    # heads and back: 96 values a layer each, unpadded on their split axes.
    "split_inner": {96 * 4: 2 * LAYERS},
    # moved: each layer re-laid out on its 12 rows, padded to 16: 16 x 12 values.
    "layers_split": {16 * 12 * 4: 8},
    # moved: its 4 layers of (16, 12), unpadded.
    "one_row": {16 * 12 * 4: 4},
}
"""Per model, the whole-layer forward gathers it makes: bytes of one -> how many."""


@pytest.mark.parametrize("kind", list(PLACED))
def test_stacked_weights_are_gathered_per_layer_wherever_the_layer_axis_is(kind):
    apply, params = PLACED[kind]()
    ref = train_state.TrainState.create(apply_fn=apply, params=params, tx=TX)
    mesh = zpp.make_mesh(2, 4)
    state = zpp.TrainState.create(
        apply_fn=apply, params=params, tx=TX, mesh=mesh, config=zpp.ZeroPPConfig(**EXACT)
    )
    if kind in SPLIT_AXES:
        paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(params)]
        names = ["/".join(str(k.key) for k in path) for path in paths]
        axes = {n: lo.axis for n, lo in zip(names, state.layouts[1], strict=True)}
        assert axes == SPLIT_AXES[kind]
    step = zpp.shard(train_step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing falls back to a whole-leaf gather
        ledger = zpp.comm_ledger(step, state, data(0))
    ref_step = jax.jit(train_step)
    for t in range(STEPS):
        ref, want = ref_step(ref, data(t))
        state, got = step(state, data(t))
        np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5)
    for a, b in zip(
        jax.tree_util.tree_leaves(zpp.gather_params(state)),
        jax.tree_util.tree_leaves(ref.params),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Each layer's weights are gathered whole once in the forward (hpZ's second stage),
    # counted over the loop's trips and the layer peeled before it.
    gathers = {}
    for r in ledger.records:
        if r.phase == "forward" and r.op == "all-gather" and r.out_bytes in FORWARD_GATHERS[kind]:
            gathers[r.out_bytes] = gathers.get(r.out_bytes, 0) + r.trip_count
    assert gathers == FORWARD_GATHERS[kind], ledger.to_markdown()


def test_a_scan_over_the_axis_a_one_row_leaf_is_split_on_gathers_it_whole_and_says_so():
    """`one_row`'s leaf scanned over its axis 0, the axis it is stored split on: no device
    holds a share of each layer, so it is gathered whole before the loop, with a warning
    naming the leaf; the step still matches one device."""
    _, params = one_row()

    def apply(variables, x):
        def sub(h, w):  # a layer (4, 12): h's first 4 columns in, 12 out
            return h.at[:, :12].add(jnp.tanh(h[:, :4] @ w)), None

        h, _ = jax.lax.scan(sub, x, variables["params"]["moved"])
        return h

    ref = train_state.TrainState.create(apply_fn=apply, params=params, tx=TX)
    state = zpp.TrainState.create(
        apply_fn=apply,
        params=params,
        tx=TX,
        mesh=zpp.make_mesh(2, 4),
        config=zpp.ZeroPPConfig(**EXACT),
    )
    assert not state.layouts[1][0].stacked
    step = zpp.shard(train_step)
    with pytest.warns(UserWarning, match=r"\['moved'\].*axis 0, the axis it is stored split on"):
        state, got = step(state, data(0))
    ref, want = jax.jit(train_step)(ref, data(0))
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5)
    np.testing.assert_allclose(
        zpp.gather_params(state)["moved"], ref.params["moved"], rtol=1e-5, atol=1e-6
    )


def test_zeropp_defaults_on_a_relaid_stack_stay_within_the_quantizer_bound():
    """ZeRO++'s int8 weight gathers and int4 two-hop gradients, on stacks scanned by
    `lax.map`: one stored with its layer axis at 1 (re-laid out by an all-to-all) and one
    at 0. With the identity as the batch, the model's output is the weight it saw: within
    half a step of the largest block; the gradient of its sum is 1 everywhere, within two
    hops' half steps of every contribution."""
    rs = np.random.RandomState(4)
    params = {
        "moved": rs.randn(WIDTH, LAYERS, WIDTH).astype(np.float32),
        "front": rs.randn(LAYERS, WIDTH, WIDTH).astype(np.float32),
    }

    def apply(variables, x):
        p = variables["params"]
        seen = [
            jax.lax.map(lambda w: x @ w, s) for s in (jnp.moveaxis(p["moved"], 1, 0), p["front"])
        ]
        return jnp.moveaxis(jnp.concatenate(seen), 0, 1)  # (batch, 2 * LAYERS, WIDTH)

    x = np.eye(WIDTH, dtype=np.float32)  # BATCH rows, 2 per device
    new, m = zeropp_sum_step(apply, params, x)  # nothing falls back to a whole-leaf gather
    out = np.asarray(m["out"], np.float64)
    seen = {"moved": out[:, :LAYERS], "front": np.moveaxis(out[:, LAYERS:], 0, 1)}
    got = zpp.gather_params(new)
    for name, w in params.items():
        w = w.astype(np.float64)
        assert np.max(np.abs(seen[name] - w)) <= int8_gather_bound(w), name
        grad = w - np.asarray(got[name], np.float64)
        assert np.max(np.abs(grad - 1.0)) <= ones_int4_two_hop_bound() + 1e-5, name


# ----------------------------------------------------------------------------- weight deltas


DELTA = dict(weight_bits=None, weight_delta_bits=4, weight_block_size=32, compute_dtype=jnp.float32)
"""int4 weight deltas; the reference (built unquantized) gathered unquantized inside a node."""
KEPT_STATE = {
    "delta": zpp.ZeroPPConfig(grad_bits=None, **DELTA),
    # Per-layer pieces of 64 values: blocks of 32 cut a layer's piece where they cut the
    # whole stack's, so both routes quantize the same blocks.
    "delta_feedback": zpp.ZeroPPConfig(grad_block_size=32, error_feedback="all", **DELTA),
}
"""Configs whose state keeps per-leaf buffers that a loop reads per layer: the weight-delta
reference, and with error feedback each gradient hop's residual."""


def stacked():
    model = stack("none")
    return model.apply, model.init(jax.random.key(0), data(0)["x"])["params"]


KEPT_CASES = {
    "delta": (stacked, "delta", WIDTH * 2 * WIDTH * 4, 2, LAYERS),
    "delta_feedback": (stacked, "delta_feedback", WIDTH * 2 * WIDTH * 4, 2, LAYERS),
    "delta_axis_one": (axis_one, "delta", WIDTH * WIDTH * 4, 1, LAYERS),
    "delta_split_inner": (split_inner, "delta", 96 * 4, 2, LAYERS),
    "delta_layers_split": (layers_split, "delta", 16 * 12 * 4, 1, 8),
    "delta_one_row": (one_row, "delta", 16 * 12 * 4, 1, 4),
}
"""Per case: the model, the config, bytes of one gathered float32 layer of each stacked
matrix, how many stacked matrices and their layers. `axis_one` stores its layer axis at 1: its
reference is re-laid out per step locally, `layers_split`'s by one all-to-all over `local`.
`split_inner`'s stacks are split on an inner axis (`SPLIT_AXES`); `one_row`'s leaf is stored
as one row, its reference transposed locally."""


@pytest.mark.parametrize("name", list(KEPT_CASES))
def test_weight_deltas_and_error_feedback_gather_and_reduce_each_layer(name, monkeypatch):
    """int4 weight deltas (and error feedback) on a scanned model: each layer is gathered
    over `local` from its slice of the kept reference (the cross-node delta hop runs once
    per leaf, in `apply_gradients`), forward and backward, and its gradient reduced inside
    the backward loop with its slice of the residuals, instead of the whole stacks before
    the loop. Against the whole-gather route (the scan left to XLA): both gather the same
    values and quantize the same blocks of the same sums, so the three steps, references
    and residuals included, agree to float summation order (the two programs' backward
    sums differ in order: about 1 ulp, not bitwise equal). The per-layer route holds less
    than the whole stacks in its temporaries."""
    make, config_name, layer, matrices, layers = KEPT_CASES[name]
    config = KEPT_STATE[config_name]
    apply, params = make()
    mesh = zpp.make_mesh(2, 4)
    runs = {}
    for route in ("layered", "whole"):
        if route == "whole":
            monkeypatch.setattr(placement, "_place_scan", lambda *args: None)
        state = zpp.TrainState.create(
            apply_fn=apply, params=params, tx=TX, mesh=mesh, config=config
        )
        step = zpp.shard(train_step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ledger = zpp.comm_ledger(step, state, data(0))
            compiled = step.lower(state, data(0)).compile()
        whole = [w for w in caught if "gathered whole" in str(w.message)]
        assert bool(whole) == (route == "whole"), [str(w.message) for w in caught]
        losses = []
        for t in range(3):
            state, metrics = compiled(state, data(t))
            losses.append(float(metrics["loss"]))
        runs[route] = (ledger, compiled.memory_analysis().temp_size_in_bytes, state, losses)
    (ledger, temp, state, losses), (whole_ledger, whole_temp, whole_state, whole_losses) = (
        runs.values()
    )
    np.testing.assert_allclose(losses, whole_losses, rtol=1e-6)
    for a, b in zip(
        jax.tree_util.tree_leaves((state.params, state.weight_ref)),
        jax.tree_util.tree_leaves((whole_state.params, whole_state.weight_ref)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # Per sharded leaf one int4 delta hop across nodes (values and scales); then each layer
    # of each stacked matrix gathered over `local` in the forward and again in the
    # backward (hpZ from the reference), LAYERS times. Gathered whole: at most the stacks
    # of per-layer vectors (a bias), which a loop gathers before it, as without deltas.
    count = {}
    for r in ledger.records:
        if placement.WHOLE_SCOPE in r.op_name:
            assert r.out_bytes <= layers * WIDTH * 4, r
        if r.op == "all-gather":
            key = (r.phase, r.axes, r.out_bytes)
            count[key] = count.get(key, 0) + r.trip_count
    node = {k: n for k, n in count.items() if k[1] == ("node",)}
    sharded = sum(lo.sharded for lo in state.layouts[1])
    assert sum(node.values()) == 2 * sharded, ledger.to_markdown()
    assert count[("forward", ("local",), layer)] == matrices * layers, ledger.to_markdown()
    assert count[("backward", ("local",), layer)] == matrices * layers, ledger.to_markdown()
    whole_gathers = [r for r in whole_ledger.records if placement.WHOLE_SCOPE in r.op_name]
    # A stacked matrix's bytes, unpadded (a layer of `layers_split` is gathered padded).
    stack = max(np.asarray(x).nbytes for x in jax.tree.leaves(params) if np.ndim(x) >= 3)
    assert max(r.out_bytes for r in whole_gathers if r.op == "all-gather") >= stack
    # The whole route holds the stacks gathered; the layered one about a layer of each.
    assert whole_temp - temp >= (layers - 1) * matrices * stack // layers, (temp, whole_temp)


class NormBiasBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        u = jnp.tanh(nn.Dense(2 * WIDTH)(nn.LayerNorm()(h)))
        return h + nn.Dense(WIDTH)(u), None


class NormBiasStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            NormBiasBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=4
        )
        return scan()(x, None)[0]


def test_a_scans_per_layer_vectors_share_one_gradient_reduction():
    """The stacked biases and norm scales a scan reads are gathered whole before its loop,
    together: their gradients leave through one two-hop reduction (values and scales on
    each hop: four all-to-alls), not one per vector (four vectors here, each of which
    compiled its own quantizers and collectives: issue #48's compile time). The sums are
    those of each reduced alone, to the bit (`test_weight_gather`)."""
    model = NormBiasStack()
    x = data(0)["x"]
    params = model.init(jax.random.key(0), x)["params"]
    state = zpp.TrainState.abstract(
        apply_fn=model.apply, params=params, tx=TX, mesh=zpp.make_mesh(2, 4)
    )
    text = zpp.shard(train_step).lower(state, data(0)).compile().as_text()
    whole = [
        line
        for line in text.splitlines()
        if " all-to-all(" in line and placement.WHOLE_SCOPE in line
    ]
    assert len(whole) == 4, whole
