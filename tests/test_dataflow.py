"""`zeropp_jax.interpreter._dataflow`: the tie that orders a value after another."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeropp_jax.interpreter import _dataflow as dataflow


@pytest.mark.parametrize("to", [jnp.float32(3.5), jnp.float32(jnp.nan), jnp.float32(-jnp.inf)])
def test_a_tie_leaves_every_value_as_it_was_to_the_bit_and_passes_keys_through(to):
    """The arithmetic tie (XLA:CPU's form) adds a -0.0 derived from `to`: floats (signed
    zeros and NaN included), integers and booleans come back bit for bit, and a PRNG key
    (a scan's per-layer keys among what the peeled last layer waits for: MaxText's
    decoder) comes back as it is rather than failing the addition."""
    floats = jnp.array([0.0, -0.0, 1.5, jnp.nan, -jnp.inf], jnp.bfloat16)
    ints = jnp.array([0, -3, 7], jnp.int32)
    flags = jnp.array([True, False])
    keys = jax.random.split(jax.random.key(0), 3)
    got = jax.jit(lambda t, x: dataflow.tie(t, x))(to, (floats, ints, flags, keys))
    want = (floats, ints, flags)
    for a, b in zip(got[:3], want, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), strict=True
        )
    np.testing.assert_array_equal(jax.random.key_data(got[3]), jax.random.key_data(keys))


def test_a_tie_to_nothing_float_returns_the_value_itself():
    x = jnp.ones(3)
    assert dataflow.tie(None, x) is x
    assert dataflow.tie(jnp.arange(3), x) is x  # integers only: nothing to derive from
