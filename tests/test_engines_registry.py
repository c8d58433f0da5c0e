"""experiments/_engines.py: one registry of the engines the experiments compare, and the
states and steps it builds."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _support import Net, batch, train_step

import zeropp_jax as zpp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import _engines  # noqa: E402

EXACT = {"compute_dtype": jnp.float32}
"""Float32 compute: the unquantized engines then differ from one device by summation order."""
UNQUANTIZED = {
    "data parallel": EXACT,
    "XLA FSDP": EXACT,
    "ZeRO-3": EXACT,
    "ZeRO++": {**EXACT, "weight_bits": None, "grad_bits": None},  # hpZ alone
}


def test_every_spelling_names_one_engine():
    assert _engines.lookup("XLA FSDP") is _engines.lookup("xla_fsdp")
    assert _engines.lookup("xla_fsdp") is _engines.lookup("xla-fsdp")
    for engine in _engines.REGISTRY:
        for spelling in engine.spellings:
            assert _engines.lookup(spelling) is engine, spelling
        assert _engines.lookup(engine) is engine
    assert len({e.slug for e in _engines.REGISTRY}) == len(_engines.REGISTRY)


def test_an_unknown_engine_raises_listing_the_valid_names():
    with pytest.raises(ValueError, match="engine 'zero-3'") as raised:
        _engines.lookup("zero-3")
    for engine in _engines.REGISTRY:
        for spelling in engine.spellings:
            assert repr(spelling) in str(raised.value)


def test_presets_and_overrides_are_the_library_configs():
    assert _engines.config_of("ZeRO-3") == zpp.ZeroPPConfig.zero3()
    assert _engines.config_of("zeropp") == zpp.ZeroPPConfig()
    assert _engines.config_of("int2-delta") == zpp.ZeroPPConfig.beyond()
    assert _engines.config_of("zeropp_delta4", grad_bits=8) == zpp.ZeroPPConfig(
        weight_delta_bits=4, grad_bits=8
    )
    assert _engines.config_of("XLA FSDP") is None


def test_what_an_engine_does_not_take_raises():
    params = Net().init(jax.random.key(0), batch(0)["x"])["params"]
    kw = dict(apply_fn=Net().apply, params=params, tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4))
    with pytest.raises(ValueError, match=r"'XLA FSDP': overrides \['weight_bits'\]"):
        _engines.build("XLA FSDP", overrides={"weight_bits": 8}, abstract=True, **kw)
    with pytest.raises(ValueError, match="'XLA FSDP' takes no ZeroPPConfig"):
        _engines.build("XLA FSDP", config=zpp.ZeroPPConfig(), abstract=True, **kw)
    with pytest.raises(ValueError, match="both config and overrides"):
        _engines.build("ZeRO-3", config=zpp.ZeroPPConfig(), overrides=EXACT, abstract=True, **kw)
    with pytest.raises(ValueError, match="'one device' has no ZeroPPConfig"):
        _engines.config_of("one device", grad_bits=4)


def _params_of(engine: _engines.Engine, state) -> dict:
    """The global parameters of a state `_engines.build` made."""
    return zpp.gather_params(state) if engine.kind == "zpp" else state.params


def _one_step(name: str, overrides: dict):
    engine = _engines.lookup(name)
    params = Net().init(jax.random.key(0), batch(0)["x"])["params"]
    kw = dict(
        apply_fn=Net().apply,
        params=params,
        tx=optax.sgd(0.1),
        mesh=zpp.make_mesh(2, 4),
        overrides=overrides,
    )
    shapes, _ = _engines.build(engine, abstract=True, **kw)
    state, make_step = _engines.build(engine, **kw)
    for s, x in zip(jax.tree.leaves(shapes), jax.tree.leaves(state), strict=True):
        x = jnp.asarray(x)  # flax's step counter is a Python int under "one device"
        assert (s.shape, s.dtype) == (x.shape, x.dtype)
        assert s.sharding is None or s.sharding.is_equivalent_to(x.sharding, x.ndim)
    state, metrics = make_step(train_step)(state, batch(1))
    return float(metrics["loss"]), _params_of(engine, state)


@pytest.fixture(scope="module")
def one_device():
    return _one_step("one device", {})


@pytest.mark.parametrize("name", UNQUANTIZED)
def test_an_unquantized_engine_steps_as_one_device(name, one_device):
    """One SGD step: the loss and the updated parameters of one device, to float32
    summation order (each leaf's largest difference against its largest value, as
    tests/test_engine.py compares the engine with one device)."""
    loss, params = _one_step(name, UNQUANTIZED[name])
    ref_loss, ref_params = one_device
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert jax.tree.structure(params) == jax.tree.structure(ref_params)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


@pytest.mark.parametrize("name", [e.name for e in _engines.REGISTRY if e.kind == "zpp"])
def test_every_engine_of_ours_builds_and_steps(name):
    loss, params = _one_step(name, EXACT)
    assert np.isfinite(loss)
    assert jax.tree.map(np.shape, params) == jax.tree.map(
        np.shape, Net().init(jax.random.key(0), batch(0)["x"])["params"]
    )
