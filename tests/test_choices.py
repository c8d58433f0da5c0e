"""A `ZeroPPConfig` resolved once per mesh (`zeropp_jax.choices.resolve`), and read
nowhere else."""

import ast
import dataclasses
import pathlib

import jax.numpy as jnp
import pytest

import zeropp_jax as zpp
from zeropp_jax import choices
from zeropp_jax.quant import XLA_CODEC

LIBRARY = pathlib.Path(zpp.__file__).resolve().parent
FIELDS = {f.name for f in dataclasses.fields(zpp.ZeroPPConfig)}
ALLOWED = {"config.py", "choices.py"}
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
        for p in sorted(LIBRARY.glob("*.py"))
        if p.name not in ALLOWED and p.name != "checkpoint.py"
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
    assert on.rounding_seed == 5 and on.per_use_reduce


def test_resolve_refuses_error_feedback_with_no_hop_to_carry_it():
    config = zpp.ZeroPPConfig(error_feedback="node")
    assert choices.resolve(config, zpp.make_mesh(2, 4)).feedback_hops == (False, True)
    with pytest.raises(ValueError, match="no quantized gradient hop"):
        choices.resolve(config, zpp.make_mesh(1, 8))
