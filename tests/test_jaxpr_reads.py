"""How many equations read each weight (`zeropp_jax.jaxpr_reads.count_uses`)."""

import types

import jax
import jax.numpy as jnp
import pytest

from zeropp_jax.jaxpr_reads import count_uses, scan_counts


def test_moves_and_casts_are_followed_and_inlined_calls_entered():
    def f(w, v, x):
        w2 = w.reshape(4, 2).astype(jnp.float32)  # layout-only: still weight 0, no use
        h = x @ w2.T  # use 1 of weight 0
        h = jax.jit(lambda a, b: a * b)(h, v)  # inside an inlined call: use 1 of weight 1
        return h + jnp.sum(w)  # use 2 of weight 0

    closed = jax.make_jaxpr(f)(jnp.ones(8), jnp.ones((3, 4)), jnp.ones((3, 2)))
    w, v, _ = closed.jaxpr.invars
    assert count_uses(closed.jaxpr, {w: 0, v: 1}) == {0: 2, 1: 1}


def test_scan_counts_reads_the_scan_and_names_jax_011s_parameters():
    def f(c, xs):
        return jax.lax.scan(lambda k, x: (k + (c * x).sum(), x * c), jnp.float32(0), xs)

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones((5, 3)))
    [eqn] = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert scan_counts(eqn) == (1, 1, 5)
    # jax 0.11.2's scan of the same function (seen on the GPU machine): no num_consts.
    newer = types.SimpleNamespace(
        params=dict(reverse=False, length=5, jaxpr=None, ft_in=(), ft_out=(), unroll=1)
    )
    with pytest.raises(RuntimeError, match=r"ft_in.*--no-scan-layers"):
        scan_counts(newer)
