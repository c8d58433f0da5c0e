"""Bucketed gradient reductions (`zeropp_jax.wire._weight_gather.reduce_gradients`): gradients
share one reduction, bit for bit what each gets alone (a piece that is not whole blocks is
zero-padded to whole blocks, unless the reduction rotates)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from zeropp_jax import make_mesh
from zeropp_jax.measure._hlo_text import parse_hlo_module
from zeropp_jax.wire import _weight_gather as W

N = 8
SPECS = {  # name: (GatherSpec fields, collectives reduced alone, bucketed)
    # The four bf16 gradients share a bucket (the float32 one is alone); rotated, the one
    # whose piece is not whole blocks is reduced alone too. Each two-hop reduction runs
    # two all-to-alls per hop (values, scales); ZeRO-3's ring one collective-permute (in
    # its loop), float32 one reduce-scatter.
    "zeropp int8, int4, rotated": (
        dict(
            grad_bits=8,
            grad_hop2_bits=4,
            two_hop=True,
            grad_rotation_block_size=16,
            grad_hop2_rotation_block_size=16,
        ),
        {"all-to-all": 20},
        {"all-to-all": 12},
    ),
    "zeropp int8, int4": (
        dict(grad_bits=8, grad_hop2_bits=4, two_hop=True),
        {"all-to-all": 20},
        {"all-to-all": 8},
    ),
    "zero3 bf16 ring": (
        dict(grad_bits=None, grad_hop2_bits=None, two_hop=False),
        {"collective-permute": 4, "reduce-scatter": 1},
        {"collective-permute": 1, "reduce-scatter": 1},
    ),
}


def _spec(fields):
    return W.GatherSpec(
        hierarchical=fields["two_hop"],
        weight_bits=None,
        weight_block_size=32,
        weight_stage2_bits=None,
        grad_block_size=32,
        grad_hop2_block_size=64,
        dtype=jnp.dtype(jnp.bfloat16),
        **fields,
    )


def _gradients():
    """Per device, full-size: three that fill whole blocks of both hops (pieces of 64, 128
    and 192 values), one that does not (a piece of 6) and one float32 (its own bucket of
    one)."""
    shapes = [((N * 4, 16), jnp.bfloat16), ((N * 2, 64), jnp.bfloat16), ((N * 6, 32), jnp.bfloat16)]
    shapes += [((N * 3, 2), jnp.bfloat16), ((N * 8, 8), jnp.float32)]
    rng = np.random.default_rng(0)
    return [
        jnp.asarray(rng.normal(size=(N, *s)) * (1 + 9 * (i % 2)), d)  # device d's gradient at d
        for i, (s, d) in enumerate(shapes)
    ]


def _reduce(spec, gs, bucketed):
    mesh = make_mesh(2, 4)

    def island(*gs):
        gs = [g[0] for g in gs]
        if bucketed:
            out = W.reduce_gradients(gs, spec, [None] * len(gs), [()] * len(gs), N)
        else:
            out = [W.reduce_gradient(g, spec) for g in gs]
        return tuple(dx for dx, _ in out)

    f = jax.jit(
        jax.shard_map(
            island,
            mesh=mesh,
            in_specs=tuple(P(("node", "local")) for _ in gs),
            out_specs=tuple(P(("local", "node")) for _ in gs),
        )
    )
    return f(*gs), f.lower(*gs).as_text(dialect="hlo")


def _collectives(text):
    module = parse_hlo_module(text)
    return collections.Counter(
        i.opcode
        for comp in module.computations.values()
        for i in comp
        if i.opcode in ("all-to-all", "collective-permute", "reduce-scatter", "all-reduce")
    )


@pytest.mark.parametrize("name", SPECS)
def test_bucketed_reduction_is_bit_identical_in_fewer_collectives(name):
    fields, collectives_alone, collectives_bucketed = SPECS[name]
    spec = _spec(fields)
    gs = _gradients()
    alone, alone_text = _reduce(spec, gs, bucketed=False)
    together, together_text = _reduce(spec, gs, bucketed=True)
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _collectives(alone_text) == collectives_alone
    assert _collectives(together_text) == collectives_bucketed


def test_buckets_are_consecutive_and_no_larger_than_the_largest_member_or_the_floor():
    assert W._buckets([3, 1, 4, 4], [0, 1, 2, 3], floor=0) == [[0, 1], [2], [3]]
    assert W._buckets([1, 1, 1, 4], [5, 6, 7, 8], floor=0) == [[5, 6, 7], [8]]
    assert W._buckets([2, 2], [0, 1], floor=0) == [[0], [1]]
    assert W._buckets([2, 2], [0, 1], floor=4) == [[0, 1]]
    assert W._buckets([3, 1, 4, 4], [0, 1, 2, 3], floor=8) == [[0, 1, 2], [3]]
    assert W._buckets([], []) == []
    f = W.BUCKET_FLOOR
    assert W._buckets([f // 2, f // 2, 1], [0, 1, 2]) == [[0, 1], [2]]


def test_keys_residuals_and_lone_gradients_are_reduced_alone(monkeypatch):
    """A gradient with a stochastic-rounding key or error-feedback residuals is reduced on
    its own; so is the only member of its bucket."""
    spec = _spec(SPECS["zeropp int8, int4, rotated"][0])
    calls = []
    real = W.reduce_gradient
    monkeypatch.setattr(
        W, "reduce_gradient", lambda g, *a, **k: calls.append(g.shape) or real(g, *a, **k)
    )
    mesh = make_mesh(2, 4)
    g = jnp.ones((N, N * 4, 16), jnp.bfloat16)  # pieces of 64 values
    big = jnp.ones((N, N * 4, 48), jnp.bfloat16)  # pieces of 192
    res = (jnp.zeros((N, N * 4, 16), jnp.float32), jnp.zeros((N, 2 * 4, 16), jnp.float32))

    def run(keyed, with_residuals):
        def island(g, big, r1, r2):
            key = jax.random.key(0) if keyed else None
            residuals = [((r1[0], r2[0]) if with_residuals else ()), (), (), ()]
            gs = [g[0]] * 3 + [big[0]]
            out = W.reduce_gradients(gs, spec, [key, None, None, None], residuals, N)
            return out[0][0]

        calls.clear()
        f = jax.shard_map(
            island, mesh=mesh, in_specs=P(("node", "local")), out_specs=P(("local", "node"))
        )
        jax.eval_shape(f, g, big, *res)  # traced only: which reductions it asks for
        return sorted(calls)

    alone = (N * 4, 16)
    assert run(False, False) == [(N * (3 * 64 + 192),)]  # one bucket of four
    assert run(True, False) == sorted([(N * (2 * 64 + 192),), alone])  # the keyed one alone
    assert run(False, True) == sorted([(N * (2 * 64 + 192),), alone])  # the one with residuals
