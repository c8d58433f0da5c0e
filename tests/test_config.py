"""Tests of `ZeroPPConfig`: defaults, presets, immutability and validation."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import zeropp_jax as zpp
from zeropp_jax._config import ZeroPPConfig


def test_exported():
    assert zpp.ZeroPPConfig is ZeroPPConfig


def test_defaults_are_zeropp():
    cfg = ZeroPPConfig()
    assert cfg.weight_bits == 8  # qwZ
    assert cfg.hierarchical is True  # hpZ
    assert cfg.grad_bits == 4  # qgZ
    assert cfg.weight_block_size == cfg.grad_block_size == 256
    assert cfg.compute_dtype == jnp.dtype(jnp.bfloat16)
    assert cfg.kernels == "auto"
    assert cfg.skip_nonfinite_updates is False
    assert not cfg.is_zero3


def test_zero3_preset():
    cfg = ZeroPPConfig.zero3()
    assert cfg.weight_bits is None and cfg.grad_bits is None and cfg.hierarchical is False
    assert cfg.is_zero3
    # Everything else keeps its default; overrides apply and are validated.
    assert cfg.compute_dtype == ZeroPPConfig().compute_dtype
    assert ZeroPPConfig.zero3(compute_dtype=jnp.float32).compute_dtype == jnp.dtype("float32")
    assert not ZeroPPConfig.zero3(grad_bits=8).is_zero3
    with pytest.raises(ValueError, match="grad_bits=3"):
        ZeroPPConfig.zero3(grad_bits=3)


def test_is_zero3_needs_all_three_off():
    assert not ZeroPPConfig(weight_bits=None, grad_bits=None).is_zero3  # hierarchical on
    assert not ZeroPPConfig(weight_bits=8, grad_bits=None, hierarchical=False).is_zero3
    assert ZeroPPConfig(weight_bits=None, grad_bits=None, hierarchical=False).is_zero3


def test_frozen():
    cfg = ZeroPPConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.weight_bits = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hierarchical = False
    assert cfg.weight_bits == 8


def test_keyword_only():
    with pytest.raises(TypeError):
        ZeroPPConfig(8)  # type: ignore[misc]
    with pytest.raises(TypeError):
        ZeroPPConfig(8, 256, True, 4)  # type: ignore[misc]


def test_equal_and_hashable():
    """Usable as a static jit argument: equal configs hash equal."""
    a = ZeroPPConfig(compute_dtype="float32")
    b = ZeroPPConfig(compute_dtype=jnp.float32)
    c = ZeroPPConfig(compute_dtype=np.dtype("float32"))
    assert a == b == c and hash(a) == hash(b) == hash(c)
    assert a != ZeroPPConfig()
    assert len({a, b, c, ZeroPPConfig()}) == 2


@pytest.mark.parametrize(
    ("given", "name"),
    [
        (jnp.float32, "float32"),
        (jnp.bfloat16, "bfloat16"),
        (jnp.float16, "float16"),
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        (np.dtype("float16"), "float16"),
    ],
)
def test_compute_dtype_normalised(given, name):
    cfg = ZeroPPConfig(compute_dtype=given)
    assert isinstance(cfg.compute_dtype, np.dtype)
    assert cfg.compute_dtype.name == name


@pytest.mark.parametrize("bits", [None, 8, 4, 2])
def test_valid_bits(bits):
    cfg = ZeroPPConfig(weight_bits=bits, grad_bits=bits)
    assert cfg.weight_bits == cfg.grad_bits == bits


@pytest.mark.parametrize("block_size", [8, 16, 64, 128, 256, 512, 4096])
def test_valid_block_sizes(block_size):
    cfg = ZeroPPConfig(weight_block_size=block_size, grad_block_size=block_size)
    assert cfg.weight_block_size == cfg.grad_block_size == block_size


def test_replace_revalidates():
    cfg = ZeroPPConfig().replace(grad_bits=8, hierarchical=False)
    assert (cfg.grad_bits, cfg.hierarchical, cfg.weight_bits) == (8, False, 8)
    with pytest.raises(ValueError, match="weight_block_size=12"):
        ZeroPPConfig().replace(weight_block_size=12)


BITS_ALLOWED = "(None, 8, 4, 2, 'e4m3')"
BLOCK_ALLOWED = "multiple of 8"
DTYPE_ALLOWED = "('float32', 'bfloat16', 'float16')"
BOOL_ALLOWED = "True or False"

INVALID = [
    # (field, value, a fragment of the allowed values the message must show)
    *[("weight_bits", v, BITS_ALLOWED) for v in (3, 16, 0, 1, True, False, "8", 8.0)],
    *[("grad_bits", v, BITS_ALLOWED) for v in (3, 16, 0, 1, True, "4", 4.0)],
    *[("weight_block_size", v, BLOCK_ALLOWED) for v in (0, -8, 12, 7.5, True, 4, "64", None)],
    *[("grad_block_size", v, BLOCK_ALLOWED) for v in (0, -8, 12, 7.5, True, 4, 256.0)],
    *[
        ("compute_dtype", v, DTYPE_ALLOWED)
        for v in (jnp.int32, "int32", "foo", jnp.float64, "float64", jnp.int8, None, 5)
    ],
    *[("kernels", v, "'auto'") for v in ("cuda", "XLA", "", None, 1)],
    *[("grad_reduce", v, "'reduce_scatter'") for v in ("nccl", "RING", None, 1)],
    *[("hierarchical", v, BOOL_ALLOWED) for v in (1, 0, "True", None)],
    *[("skip_nonfinite_updates", v, BOOL_ALLOWED) for v in (1, "yes", None)],
    *[("shared_grad", v, "('auto', 'once', 'per_use')") for v in ("per-use", "twice", None, True)],
]


@pytest.mark.parametrize(("field", "value", "allowed"), INVALID, ids=repr)
def test_invalid_values_raise_naming_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as info:
        ZeroPPConfig(**{field: value})
    msg = str(info.value)
    assert f"{field}=" in msg, msg
    assert repr(value) in msg, msg  # the value given
    assert allowed in msg, msg  # the values allowed


def test_invalid_value_message_is_actionable():
    with pytest.raises(ValueError) as info:
        ZeroPPConfig(grad_block_size=12)
    msg = str(info.value)
    assert msg.startswith("ZeroPPConfig.grad_block_size=12 is not allowed; expected ")
    assert "64" in msg  # suggests typical values
    with pytest.raises(ValueError, match="Pass e.g. jnp.bfloat16"):
        ZeroPPConfig(compute_dtype="foo")


def test_grad_reduce_resolves_by_platform():
    from zeropp_jax._choices import resolve_grad_reduce

    auto = ZeroPPConfig.zero3()
    assert auto.grad_reduce == "auto"
    assert resolve_grad_reduce(auto, "cpu") == "ring"  # XLA:CPU would widen bf16
    assert resolve_grad_reduce(auto, "gpu") == "reduce_scatter"  # what NCCL runs
    chosen = ZeroPPConfig.zero3(grad_reduce="reduce_scatter")
    assert resolve_grad_reduce(chosen, "cpu") == "reduce_scatter"


def test_per_use_shared_gradients_refuse_error_feedback():
    with pytest.raises(ValueError, match="shared_grad='per_use'.*error_feedback=None") as info:
        ZeroPPConfig(shared_grad="per_use", error_feedback="node")
    assert "ZeroPPConfig.shared_grad='per_use' is not allowed" in str(info.value)
    assert ZeroPPConfig(shared_grad="per_use").shared_grad == "per_use"
    assert ZeroPPConfig().shared_grad == "auto"
    assert ZeroPPConfig(shared_grad="auto", error_feedback="node").shared_grad == "auto"
