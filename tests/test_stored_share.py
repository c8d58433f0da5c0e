"""`zeropp_jax.measure._stored_share`: each leaf's stored values over its share, the reason, and
`TrainState.create`'s warning naming the leaves padded above 1.05x their share."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.measure import _stored_share as stored_share
from zeropp_jax.state import _partition as part


def layout(shape, n):
    return part.leaf_layout("p", jax.ShapeDtypeStruct(shape, jnp.float32), n)


@pytest.mark.parametrize(
    "shape, n, ratio",
    [
        # The cases of issue #48's table: each kept row split on the axis that fits.
        ((3, 3, 64, 64), 8, 1.0),  # conv kernel: axis 0 kept, a row's axis 64 splits
        ((3, 3, 64, 64), 128, 2.0),  # ... no axis fits 128: 64 -> 128 pads least
        ((768, 12, 64), 8, 1.0),  # unscanned DenseGeneral: 64 splits, not 12
        ((32, 32, 128, 4096), 8, 1.0),  # MaxText attention-out: rows 32 divide 8
        ((32, 32, 128, 4096), 64, 1.0),  # ... and 128 divides 64
        ((3, 4), 8, 2.0),  # the README's Dense(4) kernel: 4 -> 8
        ((4096, 4096), 1024, 1.0),
        ((50304, 768), 1024, 51200 / 50304),  # rows 50304 -> 51200: 1.018x, kept on axis 0
        ((32, 16384), 64, 1.0),  # a stacked bias: 16384, not the 32 layers
        # Layout 5: axis 0 not kept whole where no axis of a slice fits and it pads less.
        ((768, 12, 64), 128, 1.0),  # split on its 768 (a slice's 64 -> 128: 2.0x)
        ((768, 12, 64), 1024, 4 / 3),  # 768 -> 1024 (a slice's 64 -> 1024: 16x)
        ((4096, 32, 32, 128), 1024, 1.0),  # MaxText's, scanned on axis 1 (kept: 8.0x)
        ((3, 3, 512, 512), 1024, 2.0),  # axis 0 (3 -> 1024) pads more: kept whole
        ((4, 128, 512), 1024, 2.0),  # a 4-layer stack: kept whole
    ],
)
def test_share_ratio_follows_the_layout(shape, n, ratio):
    lo = layout(shape, n)
    assert stored_share.share_ratio(lo, n) == pytest.approx(ratio)
    assert lo.padded_size / n == pytest.approx(ratio * lo.size / n)


@pytest.mark.parametrize(
    "shape, n, ratio",
    [
        # Layout 3 (always the first axis of a row) stored the factors.
        ((3, 3, 64, 64), 8, 8 / 3),
        ((3, 3, 64, 64), 128, 128 / 3),
        ((768, 12, 64), 8, 16 / 12),
        ((32, 32, 128, 4096), 64, 2.0),
        ((3, 4), 8, 8 / 3),
        ((32, 16384), 64, 2.0),
    ],
)
def test_layout_3_padded_the_first_axis(shape, n, ratio):
    lo = part.with_devices(layout(shape, n), n, version=3)
    assert lo.axis == 0
    assert stored_share.share_ratio(lo, n) == pytest.approx(ratio)


@pytest.mark.parametrize(
    "shape, n, ratio",
    [
        # Layout 4 kept axis 0 of every leaf of rank >= 3 whole.
        ((768, 12, 64), 128, 2.0),
        ((768, 12, 64), 1024, 16.0),
        ((4096, 32, 32, 128), 1024, 8.0),
    ],
)
def test_layout_4_kept_every_axis_0_whole(shape, n, ratio):
    lo = part.with_devices(layout(shape, n), n, version=4)
    assert lo.stacked
    assert stored_share.share_ratio(lo, n) == pytest.approx(ratio)


@pytest.mark.parametrize(
    "shape, n, keeps",
    [
        ((768, 12, 64), 8, True),  # a slice's 64 divides 8
        ((768, 12, 64), 128, False),
        ((16, 4, 12), 8, False),  # the test models' one-row leaf: 16 fits, 4 and 12 not
        ((3, 3, 64, 64), 128, True),  # 3 pads more than a slice's 64
        ((4, 128, 512), 1024, True),
        ((12, 768, 2304), 1024, True),  # GPT-125M's qkv: 768 -> 1024 is 1.33x, 12 worse
    ],
)
def test_axis_0_is_kept_whole_unless_splitting_the_whole_leaf_pads_less(shape, n, keeps):
    lo = layout(shape, n)
    assert part.keeps_layers(shape, n) == keeps == lo.stacked
    if not keeps:
        assert lo.axis == lo.padded_axis == 0 == part.view_split(shape, n)[0]
        assert lo.stored_shape[1:] == shape[1:]
        assert part.leaf_spec(lo) == part.P(part.DP_AXES)


def test_over_share_names_the_big_padded_leaves_with_their_reason():
    shapes = [(3, 3, 64, 64), (200, 12, 64), (3, 4), (1024, 1024), (60,)]
    layouts = [layout(s, 128) for s in shapes]
    excess = stored_share.over_share([f"leaf{i}" for i in range(5)], layouts, 128)
    # The Dense(4) kernel and the bias pad too, but are under EXEMPT_BYTES; the square
    # matrix divides.
    assert [e.path for e in excess] == ["leaf1", "leaf0"]  # largest padding first
    conv = excess[1]
    assert conv.stored_shape == (3, 3, 128, 64)
    assert conv.ratio == 2.0
    assert conv.excess_bytes == 4 * 3 * 3 * 64 * 64 / 128
    assert "axis 0 (3) is kept whole as a layer axis" in conv.reason
    assert "pads its axis 2 from 64 to 128" in conv.reason
    # No axis of a slice of (200, 12, 64) fits 128 (64 -> 128: 2.0x); its 200 pads less.
    dense = excess[0]
    assert dense.stored_shape == (256, 12, 64)
    assert dense.ratio == 256 / 200
    assert "axis 0 not kept whole" in dense.reason
    assert "pads its axis 0 from 200 to 256" in dense.reason
    assert stored_share.state_ratio(layouts[3:4], 128) == 1.0


class ConvNet(nn.Module):
    channels: int = 64
    kernel: int = 3

    @nn.compact
    def __call__(self, x):
        k = (self.kernel, self.kernel)
        x = nn.Conv(self.channels, k)(x)
        x = nn.Conv(self.channels, k)(jax.nn.relu(x))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


def test_a_conv_kernel_is_stored_at_its_share():
    x = jnp.ones((8, 8, 8, 3))
    params = ConvNet().init(jax.random.key(0), x)["params"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", stored_share.StoredAboveShareWarning)
        state = zpp.TrainState.create(
            apply_fn=ConvNet().apply, params=params, tx=optax.adam(1e-3), mesh=zpp.make_mesh(2, 4)
        )
    kernel = state.params["Conv_1"]["kernel"]
    assert kernel.shape == (3, 3, 64, 64)
    assert kernel.sharding.spec == part.P(None, None, part.DP_AXES)


def test_create_warns_once_naming_each_padded_leaf():
    x = jnp.ones((8, 8, 8, 3))
    model = ConvNet(channels=37, kernel=5)
    params = model.init(jax.random.key(0), x)["params"]
    mesh = zpp.make_mesh(2, 4)
    with pytest.warns(stored_share.StoredAboveShareWarning) as caught:
        state = zpp.TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adam(1e-3), mesh=mesh
        )
    assert len(caught) == 1
    text = str(caught[0].message)
    # The second conv kernel (5, 5, 37, 37): no axis of a row (5, 37, 37) divides 8, 37
    # -> 40 pads least, and no pair of axes over 4 local devices and 2 nodes pads less
    # (40 x 38); the first (5, 5, 3, 37) is exempt (2775 values).
    assert "['Conv_1']['kernel'] (5, 5, 37, 37) stored as (5, 5, 40, 37): 1.08x" in text
    assert "Conv_0" not in text
    assert state.params["Conv_1"]["kernel"].shape == (5, 5, 40, 37)
    # Shapes alone (`abstract`) do not warn: `create` does, once.
    with warnings.catch_warnings():
        warnings.simplefilter("error", stored_share.StoredAboveShareWarning)
        zpp.TrainState.abstract(apply_fn=model.apply, params=params, tx=optax.adam(1e-3), mesh=mesh)


def test_no_warning_where_every_big_leaf_divides():
    from zeropp_jax.train.model import GPT, GPTConfig, init_fn

    gpt = GPTConfig(seq_len=16, d_model=128, n_layers=2, n_heads=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", stored_share.StoredAboveShareWarning)
        zpp.TrainState.create(
            apply_fn=GPT(gpt).apply, params=init_fn(gpt, 0), tx=optax.adam(1e-3),
            mesh=zpp.make_mesh(2, 4),
        )  # fmt: skip
