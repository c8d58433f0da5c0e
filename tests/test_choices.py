"""A `ZeroPPConfig` resolved once per mesh (`zeropp_jax._choices.resolve`), and read
nowhere else."""

import ast
import dataclasses
import pathlib

import jax.numpy as jnp
import pytest

import zeropp_jax as zpp
from zeropp_jax import _choices as choices
from zeropp_jax.wire.quant import XLA_CODEC

LIBRARY = pathlib.Path(zpp.__file__).resolve().parent
FIELDS = {f.name for f in dataclasses.fields(zpp.ZeroPPConfig)}
ALLOWED = {"_config.py", "_choices.py"}
"""Where the config's fields may be read: where they are defined and where they are
resolved. The trainer (`train/`) builds configs from flags, and the checkpoint writes the
whole config into its metadata; they are outside the engine."""


def _config_reads(path: pathlib.Path) -> list[str]:
    """`config.<field>` / `cfg.<field>` / `self.config.<field>` reads of a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute) or node.attr not in FIELDS:
            continue
        base = node.value
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
        if name in ("config", "cfg"):
            out.append(f"{path.relative_to(LIBRARY.parent)}:{node.lineno} {name}.{node.attr}")
    return out


def test_the_engine_reads_the_config_only_through_its_plan():
    engine = [
        p
        for p in sorted(LIBRARY.rglob("*.py"))
        if p.name not in ALLOWED and p.name != "_checkpoint.py" and "train" not in p.parts
    ]
    reads = [r for p in engine for r in _config_reads(p)]
    assert not reads, "read the resolved choices.Plan instead:\n" + "\n".join(reads)


def test_the_read_finder_finds_reads():
    probe = LIBRARY.parent / "tests" / "_probe_config_reads.py"
    probe.write_text("def f(config, self):\n    return config.weight_bits, self.config.prefetch\n")
    try:
        assert [r.split(" ")[1] for r in _config_reads(probe)] == [
            "config.weight_bits",
            "config.prefetch",
        ]
    finally:
        probe.unlink()


def test_resolve_on_a_cpu_mesh():
    mesh = zpp.make_mesh(2, 4)
    plan = choices.resolve(zpp.ZeroPPConfig(), mesh)
    assert plan.platform == "cpu" and plan.codec is XLA_CODEC and plan.check_vma
    assert (plan.num_nodes, plan.local_size, plan.num_devices) == (2, 4, 8)
    assert plan.compute_dtype == jnp.bfloat16 and plan.spec.weight_bits == 8
    assert not (plan.stochastic_rounding or plan.weight_delta or plan.error_feedback)
    assert choices.resolve(zpp.ZeroPPConfig(), mesh) is plan  # once per config and mesh
    on = choices.resolve(
        zpp.ZeroPPConfig(stochastic_rounding=True, rounding_seed=5, shared_grad="per_use"), mesh
    )
    assert on.rounding_seed == 5 and on.shared_grad == "per_use"


def test_resolve_refuses_error_feedback_with_no_hop_to_carry_it():
    config = zpp.ZeroPPConfig(error_feedback="node")
    assert choices.resolve(config, zpp.make_mesh(2, 4)).feedback_hops == (False, True)
    with pytest.raises(ValueError, match="no quantized gradient hop"):
        choices.resolve(config, zpp.make_mesh(1, 8))


def test_per_use_leaves_picks_the_weights_whose_held_gradient_outweighs_the_shard():
    from zeropp_jax.state import _partition as part

    def layouts(table_rows, w_rows):
        shapes = {"table": (table_rows, 64), "w": (w_rows, 64), "b": (64,)}
        return tuple(part.leaf_layout(k, jnp.zeros(v), 8) for k, v in shapes.items())

    mesh = zpp.make_mesh(2, 4)
    auto = choices.resolve(zpp.ZeroPPConfig(), mesh)
    # Per use where a leaf's gradient whole in bfloat16 (2 bytes a value) exceeds 0.2 x
    # the master weights per device (4 bytes a value / 8): a leaf above 1/20 of the model.
    # A 1024-row table of a model of 66,624 values: 131 KB against 6.7 KB.
    assert choices.per_use_leaves(auto, layouts(1024, 16)) == {0}
    # An 8-row table beside a (256, 64) matrix: 1 KB against 1.7 KB (the matrix is in).
    assert choices.per_use_leaves(auto, layouts(8, 256)) == {1}
    big = layouts(1024, 16)
    once = choices.resolve(zpp.ZeroPPConfig(shared_grad="once"), mesh)
    per_use = choices.resolve(zpp.ZeroPPConfig(shared_grad="per_use"), mesh)
    assert choices.per_use_leaves(once, big) == frozenset()
    assert choices.per_use_leaves(per_use, big) == {0, 1, 2}
    feedback = choices.resolve(zpp.ZeroPPConfig(error_feedback="node"), mesh)
    assert feedback.shared_grad == "once" and not choices.per_use_leaves(feedback, big)


def test_one_device_sends_nothing_so_its_plan_quantizes_nothing():
    import jax
    import numpy as np
    import optax

    one = zpp.make_mesh(1, 1, devices=jax.devices()[:1])
    config = zpp.ZeroPPConfig(compute_dtype=jnp.float32, rounding_seed=11)  # a fresh resolve
    with pytest.warns(choices.NothingSentWarning, match="one data-parallel device"):
        plan = choices.resolve(config, one)
    spec = plan.spec
    assert (spec.weight_bits, spec.weight_stage2_bits, spec.grad_bits, spec.grad_hop2_bits) == (
        (None,) * 4
    )
    assert choices.resolve(config, zpp.make_mesh(2, 4)).spec.weight_bits == 8  # sent: kept

    # ZeRO++ on one device trains exactly as ZeRO-3 there (nothing else differs).
    rs = np.random.RandomState(0)
    params = {"w": rs.randn(6, 4).astype(np.float32)}
    x, y = rs.randn(8, 6).astype(np.float32), rs.randn(8, 4).astype(np.float32)

    def step(state, batch):
        def loss(p):
            return jnp.mean((state.apply_fn({"params": p}, batch[0]) - batch[1]) ** 2)

        return state.apply_gradients(grads=jax.grad(loss)(state.params)), None

    got = {}
    for name, cfg in (
        ("zeropp", config),
        ("zero3", zpp.ZeroPPConfig.zero3(compute_dtype=jnp.float32)),
    ):
        state = zpp.TrainState.create(
            apply_fn=lambda v, a: a @ v["params"]["w"],
            params=params,
            tx=optax.adam(1e-2),
            mesh=one,
            config=cfg,
        )
        for _ in range(2):
            state, _ = zpp.shard(step)(state, (x, y))
        got[name] = np.asarray(zpp.gather_params(state)["w"])
    np.testing.assert_array_equal(got["zeropp"], got["zero3"])
