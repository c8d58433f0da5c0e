"""One use's VJP split at its weights (`zeropp_jax.interpreter._use_vjp`), against `jax.vjp`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeropp_jax.interpreter import _use_vjp as use_vjp
from zeropp_jax.interpreter._jaxpr_reads import computed_from


def matmul(acts, weights):
    return [acts[0] @ weights[0]]


def saves_transposed(acts, weights):
    @jax.custom_vjp
    def f(x, w):
        return x @ w

    f.defvjp(lambda x, w: (x @ w, (x, w.T)), lambda s, g: (g @ s[1], s[0].T @ g))
    return [f(acts[0], weights[0])]


def exp_of_weight(acts, weights):
    return [acts[0] @ jnp.exp(weights[0])]  # keeps exp(w): as large as w


X = jax.ShapeDtypeStruct((4, 6), jnp.float32)
W = jax.ShapeDtypeStruct((6, 8), jnp.float32)
W_BYTES = 6 * 8 * 4


@pytest.mark.parametrize(
    "run, shard_bytes, keeps",
    [
        (matmul, 0, True),  # keeps only its arguments, which the caller holds
        (saves_transposed, W_BYTES // 8, False),
        (saves_transposed, W_BYTES, True),  # the whole weight is the shard: N = 1
        (exp_of_weight, W_BYTES // 8, False),
    ],
)
def test_keeps_residuals_unless_those_from_the_weights_outgrow_the_shard(run, shard_bytes, keeps):
    assert use_vjp.keeps_residuals(run, [X], [W], shard_bytes) is keeps


@pytest.mark.parametrize("run", [matmul, saves_transposed, exp_of_weight])
def test_forward_and_pull_are_the_vjp_with_arguments_put_back(run):
    rs = np.random.RandomState(0)
    x = jnp.asarray(rs.randn(4, 6), jnp.float32)
    w = jnp.asarray(rs.randn(6, 8), jnp.float32)
    ct = [jnp.asarray(rs.randn(4, 8), jnp.float32)]
    out, vjp = use_vjp.forward(run, [x], [w])
    for leaf in jax.tree_util.tree_leaves(vjp):  # neither x nor w is kept as such
        assert leaf is not x and leaf is not w
    d_acts, d_weights = use_vjp.pull(vjp, [x], [w], ct)
    want_out, want_vjp = jax.vjp(lambda x, w: run([x], [w]), x, w)
    want_dx, want_dw = want_vjp(ct)
    np.testing.assert_allclose(out[0], want_out[0], rtol=1e-6)
    np.testing.assert_allclose(d_acts[0], want_dx, rtol=1e-6)
    np.testing.assert_allclose(d_weights[0], want_dw, rtol=1e-6)


def test_computed_from_follows_data_not_position():
    def f(a, b):
        return a * 2.0, b + 1.0, jnp.sum(a) * b

    jaxpr = jax.make_jaxpr(f)(1.0, 2.0).jaxpr
    a, b = jaxpr.invars
    assert computed_from(jaxpr, {a}) == [True, False, True]
    assert computed_from(jaxpr, {b}) == [False, True, True]
