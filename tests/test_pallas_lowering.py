"""The compiled (Triton) Pallas kernels, lowered for CUDA on this CPU machine.

`jit(f).trace(...).lower(lowering_platforms=("cuda",))` under `pallas_kernels.trace_for_gpu`
(which gives jax 0.11 and newer a target GPU where there is none; `ShardedStep.lower`
enters it) runs JAX's Pallas-to-Triton lowering (each kernel becomes Triton IR inside a
`__gpu$xla.gpu.triton` call) without a GPU. So a primitive Triton cannot lower, a block
shape it refuses, or a shape the engine would hand the compiled kernels that they reject
fails here rather than on the first GPU run. What this cannot check is Triton's compile to
PTX and the numbers on a GPU: that is `experiments/gpu_kernels.py`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from _support import regression_batches, train_step
from test_engine_pallas import Tiny

import pallas_kernels as pk
import zeropp_jax as zpp
from zeropp_jax import _choices as choices
from zeropp_jax.wire.kernels import pallas_codec
from zeropp_jax.wire.quant import XLA_CODEC

TRITON = "__gpu$xla.gpu.triton"
NUM_BLOCKS, BLOCK = 14, 64  # 14 blocks: not a multiple of the 4-row tile
TILING = pk.Tiling(block_rows=4, num_warps=8)


def _lower_for_cuda(fn, *args) -> str:
    with pk.trace_for_gpu():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(text: str) -> set[str]:
    return set(re.findall(r"custom_call @([\w$.]+)", text))


def _kernel_names(text: str) -> list[str]:
    return re.findall(r'name = "(\w+bit)"', text)


def _packed(bits: int, lead: tuple[int, ...] = (NUM_BLOCKS,)):
    dtype = jnp.int8 if bits == 8 else jnp.uint8
    return (
        jax.ShapeDtypeStruct((*lead, BLOCK * bits // 8), dtype),
        jax.ShapeDtypeStruct(lead, jnp.float32),
    )


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_quantize_lowers_to_triton(bits, dtype, stochastic):
    def f(x, key):
        return pk.quantize_blocks(x, bits=bits, key=key if stochastic else None, tiling=TILING)

    x = jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK), dtype)
    text = _lower_for_cuda(f, x, jax.random.key(0))
    assert _custom_calls(text) == {TRITON}
    assert _kernel_names(text) == [f"quantize_blocks_{bits}bit"]
    assert "num_warps = 8" in text
    # The exact reciprocal (Triton's own f32 division is approximate; see `_tiling.py`).
    assert "div.rn.f32" in text


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dequantize_lowers_to_triton(bits, dtype):
    def f(values, scales):
        return pk.dequantize_blocks(values, scales, bits=bits, dtype=dtype, tiling=TILING)

    text = _lower_for_cuda(f, *_packed(bits))
    assert _custom_calls(text) == {TRITON}
    assert _kernel_names(text) == [f"dequantize_blocks_{bits}bit"]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dequantize_sum_lowers_to_triton(bits):
    def f(values, scales):
        return pk.dequantize_sum_blocks(values, scales, bits=bits, tiling=TILING)

    text = _lower_for_cuda(f, *_packed(bits, (3, NUM_BLOCKS)))
    assert _custom_calls(text) == {TRITON}
    assert _kernel_names(text) == [f"dequantize_sum_blocks_{bits}bit"]


@pytest.mark.parametrize("bits,out_bits", [(8, 8), (4, 4), (8, 2), (2, 4)])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_dequantize_sum_quantize_lowers_to_triton(bits, out_bits, stochastic):
    def f(values, scales, key):
        return pk.dequantize_sum_quantize_blocks(
            values,
            scales,
            bits=bits,
            out_bits=out_bits,
            key=key if stochastic else None,
            tiling=TILING,
        )

    text = _lower_for_cuda(f, *_packed(bits, (3, NUM_BLOCKS)), jax.random.key(0))
    assert _custom_calls(text) == {TRITON}
    assert _kernel_names(text) == [f"dequantize_sum_quantize_blocks_{bits}to{out_bits}bit"]


@pytest.fixture(autouse=True)
def _fresh_plans():
    """No plan resolved with the codec patched below outlives its test."""
    yield
    choices.resolve.cache_clear()


def _compiled_pallas_as_on_a_gpu(monkeypatch) -> None:
    """Lets this CPU process build an engine with the compiled kernels, as a GPU one would.

    Only lowering works afterwards: running anything that calls a kernel raises."""
    resolve = choices.resolve_codec
    monkeypatch.setattr(
        choices, "resolve_codec", lambda config, platform=None: resolve(config, platform="gpu")
    )
    # Plans are resolved once per config and mesh (`_fresh_plans` clears them after).
    choices.resolve.cache_clear()


class _CudaLowering:
    """`comm_ledger` wants a callable with `.lower`: the step lowered for CUDA, kept in
    `lowered` so a test reads its text without lowering it again."""

    def __init__(self, step: zpp.ShardedStep) -> None:
        self.step = step
        self.lowered: jax.stages.Lowered | None = None

    def lower(self, state, batch):
        self.lowered = self.step.lower(state, batch, platforms=("cuda",))
        return self.lowered


@pytest.mark.parametrize(
    "fields,kernels",
    [
        # ZeRO++: int8 weights (hpZ), int4 two-hop gradients.
        (
            dict(),
            {
                "quantize_blocks_8bit",
                "dequantize_blocks_8bit",
                "quantize_blocks_4bit",
                "dequantize_sum_quantize_blocks_4to4bit",
                "dequantize_sum_blocks_4bit",
            },
        ),
        # int2 on hop 2, error feedback, stochastic rounding.
        (
            dict(grad_node_bits=2, error_feedback="all", stochastic_rounding=True),
            {
                "quantize_blocks_8bit",
                "dequantize_blocks_8bit",
                "quantize_blocks_4bit",
                "dequantize_blocks_4bit",
                "dequantize_sum_blocks_4bit",
                "quantize_blocks_2bit",
                "dequantize_blocks_2bit",  # the hop-2 residual: what was sent, decoded
                "dequantize_sum_blocks_2bit",
            },
        ),
    ],
    ids=["zeropp", "int2_hop2_feedback"],
)
def test_training_step_lowers_for_cuda_and_sends_what_the_xla_step_sends(
    monkeypatch, fields, kernels
):
    """The whole sharded step with the compiled kernels (ZeRO++'s default on a GPU), lowered
    for CUDA: only Triton calls, the expected kernels, and a ledger equal to the XLA step's
    (as is the interpreted kernels' ledger on CPU). Before the kernels were wrapped in
    `jax.jit`, the backward pass kept four dead weight gathers here (see `_tiling.call`).

    The model's leaves are small and odd-sized (biases of 3 and 24 values over 8 devices),
    so the kernels see the small blocks `effective_block_size` picks for small pieces."""
    mesh = zpp.make_mesh(2, 4)
    model = Tiny()
    params = model.init(jax.random.key(0), jnp.ones((1, 10)))["params"]
    batch = regression_batches(1, 16, 3)[0]

    def build(config):
        state = zpp.TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adam(1e-2), mesh=mesh, config=config
        )
        return zpp.shard(train_step, mesh=mesh, config=config), state

    xla = zpp.ZeroPPConfig(kernels="xla", **fields)
    want = zpp.comm_ledger(*build(xla), batch)
    interpreted = zpp.comm_ledger(*build(xla.replace(kernels="pallas_interpret")), batch)
    assert interpreted.records == want.records

    _compiled_pallas_as_on_a_gpu(monkeypatch)
    step, state = build(xla.replace(kernels="pallas"))
    cuda = _CudaLowering(step)
    got = zpp.comm_ledger(cuda, state, batch)
    text = cuda.lowered.as_text()
    assert _custom_calls(text) == {TRITON}
    assert set(_kernel_names(text)) == kernels
    assert got.records == want.records
    assert got.cross_node_bytes > 0


def test_trace_for_gpu_names_an_h100_and_puts_shard_maps_on_it():
    """jax 0.11 and newer take the target GPU from the abstract mesh: sm_90 under
    `trace_for_gpu`, as jax 0.10 picks without a GPU; a `shard_map`'s mesh moves onto the
    same abstract device only there."""
    from jax.experimental.pallas import triton as pltriton

    mesh = zpp.make_mesh(2, 4)
    assert pk.shard_map_mesh(mesh) is mesh
    if not hasattr(pltriton, "get_gpu_info"):
        with pk.trace_for_gpu():
            assert pk.shard_map_mesh(mesh) is mesh
        return  # jax 0.10 lowers for sm_90 itself where there is no GPU: nothing to move
    with pk.trace_for_gpu():
        assert pltriton.get_gpu_info().compute_capability == 90
        on_gpu = pk.shard_map_mesh(mesh)
    assert on_gpu.abstract_device.device_kind == pk.ABSTRACT_GPU_KIND
    assert on_gpu.shape_tuple == mesh.abstract_mesh.shape_tuple
    assert on_gpu.axis_types == mesh.abstract_mesh.axis_types


def test_compiled_kernels_refuse_block_sizes_that_are_not_powers_of_two():
    config = zpp.ZeroPPConfig(kernels="pallas", grad_block_size=96)
    with pytest.raises(ValueError, match="tile blocks in powers of two, but grad_block_size=96"):
        choices.resolve_codec(config, platform="gpu")
    with pytest.raises(ValueError, match="weight_block_size=48"):  # "auto" is Pallas on GPU
        choices.resolve_codec(zpp.ZeroPPConfig(weight_block_size=48), platform="gpu")
    interpreted = choices.resolve_codec(config.replace(kernels="pallas_interpret"))
    assert interpreted is pallas_codec(interpret=True)
    assert choices.resolve_codec(config.replace(kernels="xla"), platform="gpu") is XLA_CODEC


def test_gpt_step_lowers_for_cuda_and_sends_what_the_xla_step_sends(monkeypatch):
    """The trainer's byte-level GPT (attention, LayerNorm, tied embedding), ZeRO++ default:
    the step `zeropp-train` runs on a GPU lowers for CUDA with the same ledger."""
    import test_engine_gpt as gpt

    mesh = zpp.make_mesh(2, 4)
    tx = optax.adamw(1e-3)
    xla = zpp.ZeroPPConfig(kernels="xla")
    want = zpp.comm_ledger(
        zpp.shard(gpt.train_step, mesh=mesh, config=xla),
        gpt.make_state(xla, mesh, tx),
        gpt.batch(0),
    )
    _compiled_pallas_as_on_a_gpu(monkeypatch)
    pallas = xla.replace(kernels="pallas")
    step = zpp.shard(gpt.train_step, mesh=mesh, config=pallas)
    cuda = _CudaLowering(step)
    got = zpp.comm_ledger(cuda, gpt.make_state(pallas, mesh, tx), gpt.batch(0))
    assert _custom_calls(cuda.lowered.as_text()) == {TRITON}
    assert got.records == want.records
    assert got.model_bytes == want.model_bytes
