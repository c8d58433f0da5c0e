"""Compiled memory of a train step through `zpp.shard`, with no XLA flags: each weight is
gathered where it is used, so the temp memory does not grow with depth.

For an unrolled model and an `nn.scan` model of 4 and 8 layers, ZeRO-3 and ZeRO++ (float32
compute, so a layer's full weight is `WIDTH * WIDTH * 4` bytes), against plain one-device
training of the same per-device batch (`jax.jit`, no sharding): the temp added per added
layer is at most one-device training's plus half a layer of full weights, and the temp of
the 8-layer model is less than half its full weights. Only the device count is set (by
conftest); XLA's default CPU scheduler runs, and these programs are compiled with XLA's
default code generation (`XLA_DEFAULTS`), not the quick compiles of the rest of the suite
(the figures are the same either way: buffer assignment comes before code generation).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _support import XLA_DEFAULTS, gpt_step_temp
from flax.training import train_state

import zeropp_jax as zpp

WIDTH = 256
BATCH = 16
DEPTHS = (4, 8)
LAYER_BYTES = WIDTH * WIDTH * 4
CONFIGS = {
    "zero3": zpp.ZeroPPConfig.zero3(compute_dtype=jnp.float32),
    "zeropp": zpp.ZeroPPConfig(compute_dtype=jnp.float32),
}


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        return jnp.tanh(nn.Dense(WIDTH, use_bias=False)(x)), None


def model(depth: int, scanned: bool) -> nn.Module:
    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            if scanned:
                scan = nn.scan(
                    Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=depth
                )
                x, _ = scan()(x, None)
            else:
                for _ in range(depth):
                    x, _ = Block()(x)
            return x

    return Deep()


def train_step(state, batch):
    def loss_fn(p):
        return jnp.mean(state.apply_fn({"params": p}, batch) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=g), {"loss": loss}


def measure(engine: str, depth: int, scanned: bool) -> dict[str, int]:
    m = model(depth, scanned)
    x = np.ones((BATCH, WIDTH), np.float32)
    params = m.init(jax.random.key(0), x)["params"]
    tx = optax.adam(1e-3)
    if engine == "one_device":
        state = train_state.TrainState.create(apply_fn=m.apply, params=params, tx=tx)
        lowered = jax.jit(train_step).lower(state, x[: BATCH // 8])
    else:
        mesh = zpp.make_mesh(2, 4)
        state = zpp.TrainState.create(
            apply_fn=m.apply, params=params, tx=tx, mesh=mesh, config=CONFIGS[engine]
        )
        lowered = zpp.shard(train_step).lower(state, x)
    analysis = lowered.compile(compiler_options=XLA_DEFAULTS).memory_analysis()
    return {
        "temp": int(analysis.temp_size_in_bytes),
        "args": int(analysis.argument_size_in_bytes),
    }


@pytest.fixture(scope="module")
def measured() -> dict[tuple[str, bool, int], dict[str, int]]:
    return {
        (engine, scanned, depth): measure(engine, depth, scanned)
        for engine in ("one_device", *CONFIGS)
        for scanned in (False, True)
        for depth in DEPTHS
    }


def per_layer(measured, engine, scanned, key="temp") -> float:
    lo, hi = DEPTHS
    return (measured[engine, scanned, hi][key] - measured[engine, scanned, lo][key]) / (hi - lo)


@pytest.mark.parametrize("scanned", [False, True])
@pytest.mark.parametrize("engine", list(CONFIGS))
def test_temp_per_added_layer_is_at_most_half_a_layer_above_one_device(measured, engine, scanned):
    added = per_layer(measured, engine, scanned)
    baseline = per_layer(measured, "one_device", scanned)
    assert added <= baseline + LAYER_BYTES / 2, (engine, scanned, added / LAYER_BYTES)
    deepest = measured[engine, scanned, DEPTHS[-1]]["temp"]
    assert deepest < DEPTHS[-1] * LAYER_BYTES / 2, (engine, scanned, deepest / LAYER_BYTES)


LIVE_LAYERS = 3.5
"""At most this many layers' full weights in all the temporaries of a step (docs/concepts.md:
the layer in use, the next one prefetched, one layer's full gradient before its reduction)."""


@pytest.mark.parametrize("scanned", [False, True])
@pytest.mark.parametrize("engine", list(CONFIGS))
def test_at_most_three_and_a_half_layers_of_full_weights_are_live(measured, engine, scanned):
    """The whole step's compiled temporaries, in units of one layer's full float32 weights
    (one-device training of the same batch needs 0.15 of a layer), at 4 and 8 layers."""
    for depth in DEPTHS:
        live = measured[engine, scanned, depth]["temp"] / LAYER_BYTES
        assert live <= LIVE_LAYERS, (engine, scanned, depth, live)


@pytest.mark.parametrize("scanned", [False, True])
@pytest.mark.parametrize("engine", list(CONFIGS))
def test_argument_bytes_are_one_eighth_of_params_and_adam_state(measured, engine, scanned):
    for depth in DEPTHS:
        m = measured[engine, scanned, depth]
        unsharded = 3 * depth * LAYER_BYTES  # parameters, mu, nu in float32
        batch_bytes = BATCH * WIDTH * 4 // 8
        extra = m["args"] - unsharded // 8 - batch_bytes
        assert 0 <= extra <= 1024, (engine, scanned, depth, m)  # step and skip counters


# ---------------------------------------------------------------- whole-stack copies
# Buffers of a stack's size that XLA's CPU pipeline made from the layered scan before the
# engine kept them from it: a float32 copy of the bfloat16 carries saved for the backward
# (a convert moved ahead of the loop's slice) and a copy of a stacked gradient (an
# elementwise finite check that recomputed the last layer's write into it).
STACK_DEPTH, STACK_ROWS = 8, 512


def stack_program() -> str:
    m = model(STACK_DEPTH, scanned=True)
    x = jnp.ones((STACK_ROWS, WIDTH), jnp.bfloat16)
    params = m.init(jax.random.key(0), x.astype(jnp.float32))["params"]
    state = zpp.TrainState.create(
        apply_fn=m.apply,
        params=params,
        tx=optax.adam(1e-3),
        mesh=zpp.make_mesh(2, 4),
        config=zpp.ZeroPPConfig.zero3(),
    )
    return zpp.shard(train_step).lower(state, x).compile(compiler_options=XLA_DEFAULTS).as_text()


def test_the_layered_scan_makes_no_copy_of_a_whole_stack():
    hlo = stack_program()
    rows = STACK_ROWS // 8
    carries = f"f32[{STACK_DEPTH},{rows},{WIDTH}]"
    grads = f"[{STACK_DEPTH},{WIDTH * WIDTH // 8}]"
    assert carries not in hlo, f"a float32 copy of the saved carries: {carries}"
    assert f"pred{grads}" not in hlo, "a boolean array of a gradient stack's size"
    copies = [ln for ln in hlo.splitlines() if f"f32{grads}" in ln and " copy(" in ln]
    assert not copies, copies


def test_per_use_shared_gradient_holds_less_than_a_sum_of_uses():
    """A tied embedding that dominates the model (vocabulary 32768 x 128, bfloat16
    compute): with `shared_grad="once"` the head's full gradient of the table waits for the
    lookup's through the whole backward; `"per_use"` reduces it at the head. The
    temporaries drop by at least a quarter of the table in bfloat16 (the end of the
    backward, the lookup's float32 scatter-add, then bounds the peak from below)."""
    from zeropp_jax.train.model import GPTConfig

    cfg = GPTConfig(
        seq_len=16, d_model=128, n_layers=4, n_heads=4, vocab_size=32768, scan=True,
        remat="full", loss_chunks=8,
    )  # fmt: skip
    temp = {
        shared_grad: gpt_step_temp(cfg, zpp.ZeroPPConfig.zero3(shared_grad=shared_grad))
        for shared_grad in ("once", "per_use")
    }
    table = cfg.vocab_size * cfg.d_model * 2
    assert temp["per_use"] <= temp["once"] - table // 4, (temp, table)
