"""`state._finite`: the non-finite check finds one NaN or infinity in one device's block of
any float leaf, read either way (`join`), on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax.state import _finite as finite
from zeropp_jax.state import _partition as part

SPECS = (P(part.DP_AXES), P(None, part.DP_AXES), P(), P(part.DP_AXES), P(), P())


def _leaves() -> list[np.ndarray]:
    """Float32, bfloat16 (stacked), float32 replicated, complex, int32 and empty leaves."""
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((16, 3)).astype(np.float32),
        rng.standard_normal((2, 8, 5)).astype(jnp.bfloat16),
        rng.standard_normal((7,)).astype(np.float32),
        (rng.standard_normal(8) + 1j * rng.standard_normal(8)).astype(np.complex64),
        np.arange(5, dtype=np.int32),
        np.zeros((0,), np.float32),
    ]


def _both(leaves: list[np.ndarray]) -> tuple[bool, bool]:
    """`all_finite` of `leaves` stored by `SPECS` on 2 x 4 devices: (per block, joined)."""
    mesh = zpp.make_mesh(2, 4)
    put = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(leaves, SPECS, strict=True)]
    return tuple(
        bool(jax.jit(lambda ls, j=join: finite.all_finite(ls, SPECS, mesh, join=j))(put))
        for join in (False, True)
    )


def test_finite_leaves_are_finite_read_either_way():
    assert _both(_leaves()) == (True, True)


# Elements on the first and the last device of a sharded leaf, and on every device of a
# replicated one. The global `isfinite(max(|x|))` the check replaced missed a NaN in the
# sharded leaves (XLA:CPU's cross-device max drops it): 3 of these cases failed.
@pytest.mark.parametrize(
    "leaf,index", [(0, (15, 2)), (0, (0, 0)), (1, (1, 7, 4)), (2, (0,)), (3, (5,))]
)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_non_finite_element_in_one_block_is_found_read_either_way(leaf, index, bad):
    leaves = _leaves()
    leaves[leaf][index] = bad if leaf != 3 else complex(1.0, bad)
    assert _both(leaves) == (False, False)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("spec", [P(part.DP_AXES), P()])
def test_one_non_finite_element_in_a_large_leaf_is_found(spec, bad):
    # 8 x 8192 values: XLA:CPU's reduce-max drops a NaN from about 4,096 values up
    # (openxla/xla#21461), so a maximum over the block missed this NaN, sharded or not.
    mesh = zpp.make_mesh(2, 4)
    x = np.ones((8, 8192), np.float32)
    x[5, 1234] = bad
    leaf = jax.device_put(x, NamedSharding(mesh, spec))
    for join in (False, True):
        check = jax.jit(lambda ls, j=join: finite.all_finite(ls, (spec,), mesh, join=j))
        assert not bool(check([leaf])), join


def test_the_largest_finite_values_stay_finite():
    # The joined form reads the widest dtype: a float32 near its maximum beside bfloat16
    # leaves does not overflow.
    leaves = _leaves()
    leaves[0][3, 1] = np.finfo(np.float32).max
    leaves[1][0, 0, 0] = -float(jnp.finfo(jnp.bfloat16).max)
    assert _both(leaves) == (True, True)


def test_leaves_with_no_float_are_finite():
    mesh = zpp.make_mesh(2, 4)
    ints = [np.arange(8, dtype=np.int32)]
    assert bool(finite.all_finite(ints, (P(),), mesh, join=True))
