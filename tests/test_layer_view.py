"""Which layer a scan reads through layout-only equations (zeropp_jax/interpreter/_layer_view.py):
the per-layer chain applied to the leaf's layer equals the scan's slice of the chained leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from zeropp_jax.interpreter import _dataflow as dataflow
from zeropp_jax.interpreter import _layer_view as layer_view

SHAPE = (4, 3, 6)


def chain_of(f):
    """The equations of `f` on a leaf of SHAPE, as `(primitive, params)`."""
    jaxpr = jax.make_jaxpr(f)(jnp.zeros(SHAPE, jnp.float32)).jaxpr
    return tuple((e.primitive, e.params) for e in jaxpr.eqns)


CHAINS = {
    "front": lambda w: w,
    "moveaxis": lambda w: jnp.moveaxis(w, 1, 0).astype(jnp.bfloat16),
    "last_reshaped": lambda w: jnp.moveaxis(w, 2, 0).reshape(6, 2, 2, 3),
    "sliced_reversed": lambda w: lax.rev(w[1::2], (0,)),
    "squeezed": lambda w: w[None, :, :, 2:4].squeeze(0),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_per_layer_chain_reads_the_scans_slice(name):
    w = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    scanned = np.asarray(CHAINS[name](w), np.float32)
    view = layer_view.layer_view(SHAPE, chain_of(CHAINS[name]))
    assert view is not None
    for k, layer in enumerate(view.layers(scanned.shape[0])):
        one = np.take(w, layer, axis=view.axis)
        got = np.asarray(dataflow.apply_chain(jnp.asarray(one), view.chain), np.float32)
        np.testing.assert_array_equal(got, scanned[k])


def test_a_reshape_that_merges_the_layer_axis_is_not_followed():
    assert layer_view.layer_view(SHAPE, chain_of(lambda w: w.reshape(12, 6))) is None
