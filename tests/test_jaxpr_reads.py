"""How many equations read each weight (`zeropp_jax.interpreter._jaxpr_reads.count_uses`)."""

import jax
import jax.numpy as jnp

from zeropp_jax.interpreter._jaxpr_reads import count_uses


def test_moves_and_casts_are_followed_and_inlined_calls_entered():
    def f(w, v, x):
        w2 = w.reshape(4, 2).astype(jnp.float32)  # layout-only: still weight 0, no use
        h = x @ w2.T  # use 1 of weight 0
        h = jax.jit(lambda a, b: a * b)(h, v)  # inside an inlined call: use 1 of weight 1
        return h + jnp.sum(w)  # use 2 of weight 0

    closed = jax.make_jaxpr(f)(jnp.ones(8), jnp.ones((3, 4)), jnp.ones((3, 2)))
    w, v, _ = closed.jaxpr.invars
    assert count_uses(closed.jaxpr, {w: 0, v: 1}) == {0: 2, 1: 1}
