"""`constrain_to_batch`: a batch constraint under a mesh, nothing without one or inside the
engine's island."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax._activation_sharding import batch_spec, constrain_to_batch


def test_batch_spec():
    assert batch_spec(3) == P(("node", "local"), None, None)
    with pytest.raises(ValueError, match="batch axis"):
        batch_spec(0)


def _lowered_text(fn, x):
    return jax.jit(fn).lower(x).as_text()


def test_constrains_only_under_a_mesh_whose_data_axes_are_automatic():
    mesh = zpp.make_mesh(2, 4)
    x = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P()))
    assert "sharding_constraint" not in _lowered_text(constrain_to_batch, x)  # no mesh set

    def under_mesh(x):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return constrain_to_batch(x)

    text = _lowered_text(under_mesh, x)
    assert 'sharding_constraint %arg0 <@mesh, [{"node", "local"}, {}]>' in text

    # Inside shard_map over the data axes each device holds its own rows: nothing to pin
    # (a constraint naming a manual axis would fail to trace).
    island = jax.shard_map(
        constrain_to_batch, mesh=mesh, in_specs=P(("node", "local")), out_specs=P(("node", "local"))
    )
    assert "sharding_constraint" not in _lowered_text(island, x)
