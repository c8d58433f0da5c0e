"""The engine and the collectives with the Pallas kernels (interpreted on CPU) against the
XLA reference codec: bit for bit.

Every scale has at most 16 significant bits (`quant.SCALE_BITS`), so each product
`q * scale` is exact in float32 and no FMA contraction, in XLA's compiled reference or in
a kernel, can change a bit of a dequantized value or a sum of them. Interpret mode is
slow: the model and the shards are tiny.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _support import regression_batches, train_step
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax import _choices as choices
from zeropp_jax.wire import collectives as C
from zeropp_jax.wire import kernels, reductions
from zeropp_jax.wire.quant import XLA_CODEC

PALLAS = kernels.pallas_codec(interpret=True)


class Tiny(nn.Module):
    """Two Dense layers; 24 hidden units, so every leaf is padded to the 8 devices."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jnp.tanh(nn.Dense(24)(x)))


def train(config, data):
    mesh = zpp.make_mesh(2, 4)
    params = Tiny().init(jax.random.key(0), data[0]["x"])["params"]
    # SGD: the kernels' bits (losses, gradients) are what is compared. Adam's update, the
    # same HLO in both programs, compiles on XLA:CPU to results 1 ulp apart from its second
    # step on, depending on what surrounds it (test_delta's twin says the same).
    state = zpp.TrainState.create(
        apply_fn=Tiny().apply, params=params, tx=optax.sgd(0.05), mesh=mesh, config=config
    )
    step = zpp.shard(train_step, mesh=mesh, config=config)
    losses = []
    for b in data:
        state, metrics = step(state, b)
        losses.append(np.asarray(metrics["loss"]))
    return zpp.gather_params(state), losses


@pytest.mark.parametrize(
    "fields",
    [
        # ZeRO++ defaults: hpZ, int8 weights, int4 two-hop gradients, bfloat16 compute.
        dict(),
        # Flat gather and flat reduction (all 8 devices in one group), 4-bit weights.
        dict(hierarchical=False, weight_bits=4, grad_bits=8, compute_dtype=jnp.float32),
    ],
    ids=["zeropp", "flat"],
)
def test_training_with_interpreted_kernels_is_bit_identical(fields):
    data = regression_batches(3, 16, 3)
    cfg = zpp.ZeroPPConfig(weight_block_size=64, grad_block_size=64, **fields)
    ref_params, ref_losses = train(cfg.replace(kernels="xla"), data)
    got_params, got_losses = train(cfg.replace(kernels="pallas_interpret"), data)
    np.testing.assert_array_equal(got_losses, ref_losses)
    ref_leaves = jax.tree_util.tree_leaves_with_path(ref_params)
    for (path, want), got in zip(ref_leaves, jax.tree_util.tree_leaves(got_params), strict=True):
        assert got.dtype == want.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(
            np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path)
        )


def test_compiled_pallas_kernels_need_a_gpu():
    config = zpp.ZeroPPConfig(kernels="pallas")
    message = "kernels='pallas' needs a GPU, but the backend is 'cpu'"
    with pytest.raises(ValueError, match=message):
        choices.resolve_codec(config)
    with pytest.raises(ValueError, match=message):
        zpp.TrainState.create(
            apply_fn=Tiny().apply,
            params={"w": jnp.ones((8, 2))},
            tx=optax.sgd(0.1),
            mesh=zpp.make_mesh(2, 4),
            config=config,
        )
    assert choices.resolve_codec(config.replace(kernels="pallas_interpret")) is PALLAS
    assert choices.resolve_codec(config.replace(kernels="pallas"), platform="gpu") is (
        kernels.pallas_codec(interpret=False)
    )
    assert choices.resolve_codec(config.replace(kernels="auto")) is XLA_CODEC


def _collectives(codec):
    """Every quantized collective on a 2x4 mesh with `codec`, in one jitted shard_map."""
    mesh = zpp.make_mesh(2, 4)

    def body(w, g):
        w, g = w[0, 0], g[0, 0]  # per device: a (3, 5) weight shard, a (24, 5) gradient
        sec, full = C.hierarchical_all_gather(w, bits=8, block_size=8, local_bits=8, codec=codec)
        out = {
            "all_gather_local": C.all_gather_quantized(
                w, axis_name="local", bits=4, block_size=8, codec=codec
            ),
            "secondary": sec,
            "hierarchical": full,
            "flat_gather": C.flat_all_gather(
                w.astype(jnp.bfloat16), bits=2, block_size=8, codec=codec
            ),
            "two_hop": reductions.two_hop_reduce_scatter(
                g, bits=4, block_size=8, node_bits=4, node_block_size=8, codec=codec
            ),
            "two_hop_8_to_2": reductions.two_hop_reduce_scatter(
                g, bits=8, block_size=8, node_bits=2, node_block_size=8, codec=codec
            ),
            "flat_reduce": reductions.flat_reduce_scatter(g, bits=8, block_size=8, codec=codec),
            "reduce_local": reductions.reduce_scatter_quantized(
                g[:12], axis_name="local", bits=2, block_size=8, codec=codec
            ),
        }
        # An elementwise consumer, as in the engine (a matmul, the optimizer): XLA fuses the
        # reference's `acc + q * s` into it and contracts FMAs there differently from the
        # kernel; with scales of more than 16 significant bits, "two_hop" differed in the
        # last bits here (10 of 120 values).
        return {k: (v.astype(jnp.float32) * 1.5 - 0.25)[None, None] for k, v in out.items()}

    spec = P("node", "local")
    f = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False)
    k1, k2 = jax.random.split(jax.random.key(0))
    w = jax.random.t(k1, 2.0, (2, 4, 3, 5))
    g = jax.random.normal(k2, (2, 4, 24, 5)) * 10.0 ** jax.random.uniform(k2, (2, 4, 24, 1))
    return jax.jit(f)(w, g)


def test_collectives_with_pallas_codec_equal_xla_codec():
    """Two-hop and flat reductions (G = 4, 2, 8 and the fused requantizing middle) and the
    three quantized gathers, 8, 4 and 2 bits: identical bits with either codec."""
    want = _collectives(XLA_CODEC)
    got = _collectives(PALLAS)
    assert got.keys() == want.keys()
    for name in want:
        a, b = np.asarray(got[name]), np.asarray(want[name])
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.isfinite(b.astype(np.float32)).all(), name
        np.testing.assert_array_equal(a, b, err_msg=name)
