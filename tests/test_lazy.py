"""`interpreter._lazy`: the layers a scan reads of a lazy weight, and its reversal, are
equations in its chain that give what the same reads of the gathered weight give."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from zeropp_jax.interpreter import _lazy as lazy

W = np.arange(6 * 2 * 3, dtype=np.float32).reshape(6, 2, 3)


def _applied(lz: lazy.Lazy) -> np.ndarray:
    """The chain of `lz` run on the whole weight `W` (as placement does once gathered)."""
    x = jnp.asarray(W)
    for prim, params in lz.chain:
        x = prim.bind(x, **params)
    assert x.shape == lz.aval.shape
    return np.asarray(x)


def _lazy() -> lazy.Lazy:
    aval = jax.make_jaxpr(lambda w: w)(W).jaxpr.invars[0].aval  # as placement gets them
    return lazy.Lazy(0, jnp.zeros(1), aval)


@pytest.mark.parametrize(
    "start,step,length,want",
    [
        (0, 1, 6, W),
        (1, 2, 3, W[1::2]),
        (2, 1, 3, W[2:5]),
        (0, -1, 6, W[::-1]),
        (4, -2, 3, W[4::-2]),
    ],
)
def test_layers_read_are_the_layers_a_scan_reads(start, step, length, want):
    got = lazy.layers_read(_lazy(), start, step, length)
    np.testing.assert_array_equal(_applied(got), want)


def test_reading_every_layer_in_order_adds_nothing_to_the_chain():
    assert lazy.layers_read(_lazy(), 0, 1, 6).chain == ()


def test_reverse_of_a_lazy_weight_and_of_an_array():
    np.testing.assert_array_equal(_applied(lazy.reverse(_lazy())), W[::-1])
    np.testing.assert_array_equal(np.asarray(lazy.reverse(jnp.asarray(W))), W[::-1])
    assert lazy.reverse(_lazy()).chain == ((lax.rev_p, {"dimensions": (0,)}),)
