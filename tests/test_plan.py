"""Planning from shapes: `zeropp-train --plan` against XLA's memory analysis of the step
built from arrays, the analytic estimate's terms, the presets and `--remat`."""

import contextlib
import dataclasses
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _support import abstract_gpt_state
from flax.training import train_state

import zeropp_jax as zpp
from zeropp_jax.train import cli, plan
from zeropp_jax.train.flags import gpt_config, parse_args
from zeropp_jax.train.model import GPT, PRESETS, GPTConfig, init_fn, loss_fn, param_count

PLAN_FLAGS = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16"]
PLAN_FLAGS += ["--batch", "8", "--remat", "full"]


def _bytes(report: str, label: str) -> tuple[float, float]:
    """The figure `label` shows, in bytes, and half its last digit (its rounding)."""
    value, unit = re.search(rf"{label}\s+([0-9.]+) (GB|MB)", report).groups()
    scale = 1e9 if unit == "GB" else 1e6
    return float(value) * scale, 0.5e-3 * scale


@pytest.fixture(scope="module")
def plan_report(module_compile_cache):
    """`zeropp-train --plan` with PLAN_FLAGS and these flags: what it printed (each set of
    flags planned once per module)."""

    @functools.cache
    def report(*flags: str) -> str:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert cli.main([*PLAN_FLAGS, "--plan", *flags]) == 0
        return printed.getvalue()

    return report


ZEROPP_PLAN = ("--engine", "zeropp", "--shared-grad", "once")
"""The default ZeRO++ plan, its defaults spelled out (shared by the two tests below)."""


@pytest.mark.parametrize("engine", ["zeropp", "xla-fsdp"])
def test_plan_prints_the_memory_analysis_of_the_step_built_from_arrays(engine, plan_report):
    # The step from arrays is the step `--plan` compiled from shapes: its compile finds the
    # program in `module_compile_cache` (a program that differs misses the cache and
    # compiles anew).
    report = plan_report(*(ZEROPP_PLAN if engine == "zeropp" else ("--engine", engine)))
    assert "Compiled from shapes; nothing was allocated." in report
    # the same step, built from real arrays the way a training run builds it
    args = parse_args([*PLAN_FLAGS, "--engine", engine])
    gpt = gpt_config(args)
    mesh = zpp.make_mesh(2, 4)
    batch = np.zeros((8, 17), np.int32)
    if engine == "xla-fsdp":
        from zeropp_jax.baselines import xla_fsdp_state, xla_fsdp_step

        state = xla_fsdp_state(
            apply_fn=GPT(gpt).apply, params=init_fn(gpt, 0), tx=cli.make_optimizer(args), mesh=mesh
        )
        step = xla_fsdp_step(cli.train_step, state, mesh)
    else:
        state = zpp.TrainState.create(
            apply_fn=GPT(gpt).apply,
            params=init_fn(gpt, 0),
            tx=cli.make_optimizer(args),
            mesh=mesh,
            config=zpp.ZeroPPConfig(shared_grad="once"),  # as ZEROPP_PLAN
        )
        step = zpp.shard(cli.train_step, donate_state=True)
    m = step.lower(state, batch).compile().memory_analysis()
    for label, want in (
        ("arguments", m.argument_size_in_bytes),
        ("temporaries", m.temp_size_in_bytes),
    ):
        shown, rounding = _bytes(report, label)
        assert want > 100 * rounding  # a figure with three significant digits at least
        assert shown == pytest.approx(want, abs=rounding), label
    assert f"{param_count(gpt) / 1e6:.2f}M parameters" in report
    assert re.search(r"per node link, each way\s+[0-9.]+ MB", report)


def test_plan_with_per_use_shared_gradients(plan_report):
    """`--shared-grad per_use`: the plan names it, and its estimate holds no tied gradient
    through the backward (the default holds the head's, in bfloat16)."""
    per_use = ("--engine", "zeropp", "--shared-grad", "per_use")
    for flags, held in ((ZEROPP_PLAN, True), (per_use, False)):
        report = plan_report(*flags)
        assert ("tied gradients reduced per use" in report) is not held
        assert (_bytes(report, "whole_leaves")[0] > 0) is held


def test_state_bytes_counts_each_device_s_shard():
    gpt = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2, scan=True)
    state = abstract_gpt_state(gpt, zpp.ZeroPPConfig.zero3())
    padded = sum(lo.padded_size for lo in state.layouts[1])
    # master + two Adam moments, float32, an eighth each; plus replicated scalars
    scalars = plan.state_bytes(state) - 3 * 4 * padded // 8
    assert 0 < scalars < 64


def test_estimate_terms():
    gpt = dataclasses.replace(PRESETS["125m"], scan=True, remat="full", seq_len=2048)
    kw = dict(batch=1, seq=2048, mesh_shape=(2, 4))
    shapes = {}
    for name, config in (("zero3", zpp.ZeroPPConfig.zero3()), ("zeropp", zpp.ZeroPPConfig())):
        state = abstract_gpt_state(gpt, config)
        shapes[name] = plan.estimate(
            gpt,
            state=state,
            layouts=state.layouts[1],
            weight_bits=config.weight_bits,
            hierarchical=config.hierarchical,
            **kw,
        )
        padded = sum(lo.padded_size for lo in state.layouts[1])
    z3, zpp_ = shapes["zero3"], shapes["zeropp"]
    assert z3.secondary == 0
    # int8 values plus a float32 scale per 256 values, over the 4 devices of a node
    assert zpp_.secondary == (padded + 4 * padded // 256) // 4
    assert zpp_.gradients == 4 * padded // 8 and zpp_.update == 2 * zpp_.gradients
    assert z3.saved == gpt.n_layers * 2 * 2048 * gpt.d_model
    # one vocabulary piece's float32 probabilities, gradient and transpose, its mask and
    # its float32 table rows, plus three float32 (S, d) arrays; the embedding gathered
    # again (bfloat16) becomes the head's gradient of it, which the whole leaves hold;
    # without pieces, the embedding beside the whole float32 logits and gradient
    n, V, d = gpt.loss_chunks, gpt.vocab_size, gpt.d_model
    rest = z3.whole_leaves // 2
    assert rest >= V * d  # the whole leaves: the embedding, positions, final norm
    assert z3.head == 13 * 2048 * V // n + 4 * rest // n + 12 * 2048 * d
    whole = dataclasses.replace(gpt, loss_chunks=1, attn_chunk=0)
    assert plan.estimate(whole, state=state, layouts=state.layouts[1], **kw).head == (
        2 * rest + 8 * 2048 * V
    )
    assert z3.total == z3.state + max(z3.backward, z3.update)
    # shared_grad="per_use": the head's gradient of the table (in the gathered table's
    # place) is reduced at the head, not held through the backward
    per_use = plan.estimate(gpt, state=state, layouts=state.layouts[1], per_use_reduce=True, **kw)
    assert per_use.whole_leaves == 0 and per_use.head == z3.head + 2 * rest
    assert per_use.whole_sum == z3.whole_sum == 2 * rest + 4 * rest // n
    assert per_use.block == z3.block
    # the platform: XLA:CPU keeps a block's internals in float32 and widens the lookup
    # gradient's scatter-add (one range of rows), a GPU keeps both in bfloat16
    on = {p: plan.estimate(gpt, state=state, layouts=state.layouts[1], platform=p, **kw)
          for p in ("cpu", "gpu")}  # fmt: skip
    assert on["cpu"].whole_sum == z3.whole_sum and on["gpu"].whole_sum == 2 * rest
    assert on["cpu"].block - on["gpu"].block == 17 * (4 - 2) * 2048 * d
    assert on["gpu"].block == z3.block  # without a platform: internals in the compute dtype


def test_estimate_takes_its_engine_fields_from_a_config():
    gpt = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2, scan=True)
    config = zpp.ZeroPPConfig(weight_block_size=64, prefetch=False, shared_grad="per_use")
    state = abstract_gpt_state(gpt, config)
    kw = dict(state=state, layouts=state.layouts[1], batch=1, seq=8, mesh_shape=(2, 4))
    by_hand = plan.estimate(
        gpt,
        weight_bits=8,
        weight_block_size=64,
        hierarchical=True,
        prefetch=False,
        per_use_reduce=True,
        **kw,
    )
    assert plan.estimate(gpt, config=config, **kw) == by_hand
    assert plan.estimate(gpt, config=config.replace(prefetch=True), **kw) != by_hand
    with pytest.raises(TypeError, match="config and prefetch"):
        plan.estimate(gpt, config=config, prefetch=False, **kw)


def test_presets_and_their_parameter_counts():
    counts = {k: param_count(v) for k, v in PRESETS.items()}
    assert counts["tiny"] < 1e6
    for name, want in (("125m", 125e6), ("350m", 355e6), ("1.3b", 1.3e9), ("6.7b", 6.7e9)):
        assert abs(counts[name] - want) / want < 0.02, (name, counts[name])
    args = parse_args(["--model", "350m", "--seq-len", "128"])
    gpt = gpt_config(args)
    assert (gpt.d_model, gpt.n_layers, gpt.n_heads, gpt.seq_len) == (1024, 24, 16, 128)
    assert gpt.scan and gpt.remat == "none"
    assert (gpt.attn_chunk, gpt.loss_chunks) == (256, 16)  # 128 tokens: attention whole
    big = gpt_config(parse_args(["--model", "1.3b"]))
    assert (big.attn_chunk, big.loss_chunks) == (256, 16) and big.vocab_size % 16 == 0
    assert gpt_config(parse_args(["--model", "tiny"])).loss_chunks == 1
    assert gpt_config(parse_args(["--no-scan-layers"])).scan is False


@pytest.mark.parametrize("remat", ["matmuls", "full"])
def test_remat_changes_memory_not_the_gradient(remat):
    """On one device, the scanned GPT with `remat` has the gradient of the one without (to
    float summation order), and its compiled step keeps less."""
    base = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=3, n_heads=2, scan=True)
    params = jax.jit(init_fn(base, 0))()
    batch = jnp.asarray(np.random.RandomState(0).randint(0, 64, (4, 33)), jnp.int32)

    def grads(cfg):
        return jax.jit(jax.grad(lambda p: loss_fn(GPT(cfg).apply, p, batch)))(params)

    want = grads(base)
    got = grads(dataclasses.replace(base, remat=remat))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)

    def temp(cfg):
        state = train_state.TrainState.create(
            apply_fn=GPT(cfg).apply, params=params, tx=optax.sgd(0.1)
        )
        step = jax.jit(cli.train_step)
        return step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes

    assert temp(dataclasses.replace(base, remat=remat)) < temp(base)
