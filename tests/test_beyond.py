"""Beyond ZeRO++ (issue #10): per-hop precision, fp8 e4m3 blocks, stochastic rounding with
counter-based keys. Quantized paths are checked against the analytic bound of each hop's
format; stochastic rounding against a Hoeffding bound on the mean of many draws."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import batch, engine
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax import _choices as choices
from zeropp_jax import make_mesh
from zeropp_jax.wire import _encoding as wire
from zeropp_jax.wire import collectives as C
from zeropp_jax.wire import quant as Q
from zeropp_jax.wire import reductions

SCALE_ROUNDING = 1 + 2.0**-15  # scales are rounded up to 16 significant bits
F32_SLACK = 2.0**-20  # relative float32 rounding of the arithmetic (as in test_collectives)


def rand(shape, seed=0, heavy=True):
    k = jax.random.key(seed)
    return jax.random.t(k, 2.0, shape) if heavy else jax.random.normal(k, shape)


def per_device(mesh, fn, x, *extra):
    """`fn` on each device's slice `x[n, l]` of `x` `(Nn, L, ...)`; `extra` arrays are
    replicated."""

    def body(xs, *es):
        return fn(xs[0, 0], *es)[None, None]

    spec = P("node", "local")
    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(spec,) + (P(),) * len(extra),
        out_specs=spec,
        check_vma=False,
    )
    return np.asarray(jax.jit(f)(x, *extra))


def block_bound(x, bits, block_size, absmax_slack=None):
    """Round-to-nearest error bound of each value of `x` (1-D, numpy float64) quantized in
    blocks of `block_size`; `absmax_slack` (per value) widens each block's absmax (for a
    hop that quantizes an already-perturbed value)."""
    x = np.asarray(x, np.float64)
    pad = (-x.size) % block_size
    b = np.pad(x, (0, pad)).reshape(-1, block_size)
    absmax = np.abs(b).max(1)
    mag = np.abs(b)
    if absmax_slack is not None:
        s = np.pad(absmax_slack, (0, pad)).reshape(-1, block_size)
        absmax = absmax + s.max(1)
        mag = mag + s
    scale = absmax / Q.qmax(bits) * SCALE_ROUNDING
    if Q.is_float_format(bits):
        scale = np.maximum(scale, np.where(absmax > 0, Q.min_scale(bits), 0.0))
        err = np.maximum(mag * 2.0**-4, scale[:, None] * 2.0**-10)
    else:
        err = np.broadcast_to(scale[:, None] / 2, b.shape)
    return err.reshape(-1)[: x.size]


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(grad_node_bits=3),
        dict(grad_node_bits="e5m2"),
        dict(grad_node_bits=8.0),
        dict(grad_node_block_size=12),
        dict(weight_local_bits=4, hierarchical=False),
        dict(weight_local_bits="fp8"),
        dict(stochastic_rounding=1),
        dict(stochastic_rounding=True, grad_bits=None),
        dict(rounding_seed=1.5),
        dict(weight_bits="E4M3"),
    ],
)
def test_config_rejects(kwargs):
    with pytest.raises(ValueError, match="ZeroPPConfig"):
        zpp.ZeroPPConfig(**kwargs)


def test_config_resolves_per_hop_formats():
    cfg = zpp.ZeroPPConfig(grad_bits=8, grad_node_bits=4, weight_local_bits="e4m3")
    assert (cfg.grad_hop2_bits, cfg.weight_stage2_bits) == (4, "e4m3")
    same = zpp.ZeroPPConfig()
    assert (same.grad_hop2_bits, same.weight_stage2_bits) == (4, 8)
    # Hop 2 alone quantized is still quantized (not ZeRO-3), and SR is allowed there.
    hop2 = zpp.ZeroPPConfig.zero3(grad_node_bits=4, stochastic_rounding=True)
    assert not hop2.is_zero3
    assert choices.gather_spec(hop2, Q.XLA_CODEC).two_hop


def test_pallas_kernels_refuse_e4m3():
    cfg = zpp.ZeroPPConfig(grad_node_bits="e4m3", kernels="pallas_interpret")
    with pytest.raises(ValueError, match="e4m3"):
        choices.resolve_codec(cfg)


# ----------------------------------------------------------------------------- e4m3


@pytest.mark.parametrize("block_size", [8, 64])
def test_e4m3_round_trip_within_half_ulp(block_size):
    x = rand((999,), seed=1)
    # Tiny blocks: scales at (first 32) and near (next 32) the e4m3 minimum scale.
    x = x.at[:32].multiply(1e-36).at[32:64].multiply(1e-30)
    q = Q.quantize_blockwise(x, bits="e4m3", block_size=block_size)
    assert q.values.dtype == jnp.uint8 and q.values.shape[1] == block_size
    got = np.asarray(Q.dequantize_blockwise(q), np.float64)
    bound = block_bound(np.asarray(x), "e4m3", block_size)
    err = np.abs(got - np.asarray(x, np.float64))
    assert np.all(err <= bound * (1 + F32_SLACK)), float(np.max(err / bound))


def test_e4m3_nonfinite_block_stays_nonfinite():
    x = rand((32,), seed=2).at[3].set(jnp.nan).at[20].set(jnp.inf)
    got = np.asarray(Q.dequantize_blockwise(Q.quantize_blockwise(x, bits="e4m3", block_size=8)))
    assert np.all(np.isnan(got[:8])) and np.all(np.isnan(got[16:24]))
    assert np.all(np.isfinite(got[8:16])) and np.all(np.isfinite(got[24:]))


@pytest.mark.parametrize("bits", [4, "e4m3"])
def test_stochastic_rounding_is_unbiased(bits):
    # Values off the grid, K independent draws. Each draw's error lies in (-ulp, ulp) and
    # has mean 0, so by Hoeffding |mean error| <= ulp * sqrt(2 ln(2 / delta) / K) except
    # with probability delta per value (delta = 1e-9: < 1e-6 over all values).
    k, block = 4096, 16
    x = jnp.linspace(-1.0, 1.0, block).at[0].set(-1.0)
    keys = jax.random.split(jax.random.key(0), k)
    draw = jax.vmap(
        lambda kk: Q.dequantize_blocks(*Q.quantize_blocks(x[None], bits=bits, key=kk), bits=bits)
    )
    mean = np.asarray(jax.jit(draw)(keys)).mean(0)[0]
    nearest = np.asarray(Q.dequantize_blocks(*Q.quantize_blocks(x[None], bits=bits), bits=bits))
    ulp = 2 * block_bound(np.asarray(x), bits, block)  # a full step (ulp) per value
    t = ulp * math.sqrt(2 * math.log(2 / 1e-9) / k)
    assert np.all(np.abs(mean - np.asarray(x)) <= t + 1e-7)
    # Round to nearest is biased well beyond that somewhere: the test has power.
    assert np.max(np.abs(nearest[0] - np.asarray(x)) - t) > 0


# ----------------------------------------------------------------------------- two hops

MESHES = [(2, 4), (4, 2), (1, 8), (8, 1)]
ROWS, COLS = 3, 11  # 33 values per piece: not a multiple of any block size used


def exact_and_bound(x, bits, bs, node_bits, node_bs, piece_size=ROWS * COLS):
    """Exact two-hop sums and the per-value bound: half a step (half an fp8 ulp) per
    contribution on hop 1 in hop 1's blocks, plus hop 2's bound on the partial sums in
    hop 2's blocks, whose magnitudes are widened by the hop-1 error."""
    nn, ll = x.shape[:2]
    n = nn * ll
    x = np.asarray(x, np.float64)
    exact = np.zeros((nn, ll, piece_size))
    bound = np.zeros_like(exact)
    for dn in range(nn):
        for dl in range(ll):
            piece = dl * nn + dn
            for a in range(nn):
                partial = np.zeros(piece_size)
                err1 = np.zeros(piece_size)
                for b in range(ll):
                    p = x[a, b].reshape(n, -1)[piece]
                    partial += p
                    if ll > 1:
                        err1 += block_bound(p, bits, wire.effective_block_size(p.size, bs))
                exact[dn, dl] += partial
                bound[dn, dl] += err1
                if nn > 1 and node_bits is not None:
                    nbs = wire.effective_block_size(partial.size, node_bs)
                    bound[dn, dl] += block_bound(partial, node_bits, nbs, absmax_slack=err1)
    return exact, bound + np.abs(exact) * F32_SLACK + 1e-30


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize(
    "bits,bs,node_bits,node_bs",
    [(8, 8, 4, 8), (8, 16, 2, 8), (4, 8, "e4m3", 32), ("e4m3", 8, 8, 16), ("e4m3", 8, 4, 8)],
)
def test_two_hop_per_hop_formats_within_bound(shape, bits, bs, node_bits, node_bs):
    mesh = make_mesh(*shape)
    nn, ll = shape
    x = rand((nn, ll, nn * ll * ROWS, COLS), seed=4)
    fn = lambda s: reductions.two_hop_reduce_scatter(  # noqa: E731
        s, bits=bits, block_size=bs, node_bits=node_bits, node_block_size=node_bs
    )
    got = per_device(mesh, fn, x).reshape(nn, ll, -1)
    exact, bound = exact_and_bound(x, bits, bs, node_bits, node_bs)
    err = np.abs(got - exact)
    assert np.all(err <= bound), float(np.max(err / bound))


def test_two_hop_node_bits_none_keeps_hop2_exact():
    mesh = make_mesh(2, 4)
    # Whole blocks per piece: the unquantized-hop path blocks hop 1 per destination device
    # (two pieces), so only then do its blocks coincide with the per-piece bound's.
    x = rand((2, 4, 8 * ROWS, COLS), seed=5)[..., :8]
    got = per_device(
        mesh,
        lambda s: reductions.two_hop_reduce_scatter(
            s, bits=8, block_size=8, node_bits=None, node_block_size=8
        ),
        x,
    ).reshape(2, 4, -1)
    # Only the hop-1 half steps remain (hop 2 moves float32 partial sums).
    exact, bound = exact_and_bound(x, 8, 8, None, 8, piece_size=ROWS * 8)
    assert np.all(np.abs(got - exact) <= bound)


def _sr_draws(mesh, x, keys, **kw):
    """Two-hop reductions of `x` for each key of `keys` (vmapped): `(K, Nn, L, piece)`."""
    kd = jax.random.key_data(keys)

    def fn(s, kd):
        ks = jax.random.wrap_key_data(kd)
        return jax.vmap(lambda k: reductions.two_hop_reduce_scatter(s, key=k, **kw))(ks)

    out = per_device(mesh, fn, x, kd)  # (Nn, L, K, rows, cols)
    return np.moveaxis(out.reshape(*out.shape[:3], -1), 2, 0)


@pytest.mark.parametrize("shape", [(1, 8), (8, 1), (2, 4)])
def test_two_hop_stochastic_rounding_unbiased_and_reproducible(shape):
    mesh = make_mesh(*shape)
    nn, ll = shape
    n, k = nn * ll, 2048
    # Every block of every contribution: one value at qmax (step 1 exactly, up to the
    # scale's rounding) and the rest at 0.3 of a step, which round to nearest turns into 0.
    x = np.full((nn, ll, n * 2, 8), 0.3, np.float32)
    x[..., 0] = 7.0
    kw = dict(bits=4, block_size=8, node_bits=8 if nn > 1 and ll > 1 else 4, node_block_size=8)
    draws = _sr_draws(mesh, jnp.asarray(x), jax.random.split(jax.random.key(1), k), **kw)
    exact = np.full(draws.shape[1:], 0.3 * n)
    exact[..., ::8] = 7.0 * n
    # Per draw, each quantization event errs by less than one step: hop 1 by 1 per
    # contribution (n of them); hop 2 by its step on each of the nn partial sums, whose
    # block absmax is at most 7 * ll + ll (hop-1 error), over qmax(node_bits).
    ulp1 = SCALE_ROUNDING * (n if ll > 1 else 0)
    ulp2 = SCALE_ROUNDING * nn * (8 * ll if ll > 1 else 7) / Q.qmax(kw["node_bits"])
    ulp2 = ulp2 if nn > 1 else 0
    t = (ulp1 + ulp2) * math.sqrt(2 * math.log(2 / 1e-9) / k)
    mean = draws.mean(0)
    assert np.all(np.abs(mean - exact) <= t), float(np.max(np.abs(mean - exact)))
    nearest = per_device(mesh, lambda s: reductions.two_hop_reduce_scatter(s, **kw), jnp.asarray(x))
    if shape != (2, 4):  # one hop: nearest loses all 0.3s, far beyond t
        assert np.max(np.abs(nearest.reshape(exact.shape) - exact)) > t
    # Same key: the same bits; another key: other bits.
    again = _sr_draws(mesh, jnp.asarray(x), jax.random.split(jax.random.key(1), k)[:2], **kw)
    np.testing.assert_array_equal(again, draws[:2])
    assert not np.array_equal(draws[0], draws[1])


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("bits,local_bits", [(8, 4), (8, "e4m3"), (None, 8), (4, None)])
def test_hierarchical_gather_with_requantized_stage2(bits, local_bits):
    mesh = make_mesh(2, 4)
    bs = 8
    x = rand((2, 4, ROWS, COLS), seed=6)

    def fn(s):
        sec, full = C.hierarchical_all_gather(s, bits=bits, block_size=bs, local_bits=local_bits)
        # The stage-1 value of every piece (a gather of the stage-1 secondary shards).
        ref = C.hierarchical_all_gather(s, bits=bits, block_size=bs, local_bits=bits)[1]
        return jnp.stack([full, ref])

    out = per_device(mesh, fn, x)
    full, stage1 = out[0, 0, 0].reshape(8, -1), out[0, 0, 1].reshape(8, -1)
    # Stage 2 re-quantizes each stage-1 piece on its own: its bound applies to stage1.
    for piece in range(8):
        s1 = np.asarray(stage1[piece], np.float64)
        if local_bits is None:
            np.testing.assert_array_equal(full[piece], stage1[piece])
            continue
        b = block_bound(s1, local_bits, wire.effective_block_size(s1.size, bs))
        assert np.all(np.abs(full[piece] - s1) <= b * (1 + F32_SLACK) + 1e-30)
    # Every device ends with the same full array.
    assert np.all(out[:, :, 0] == out[0, 0, 0])


# ----------------------------------------------------------------------------- engine


def run(config, steps=2, mesh_shape=(2, 4)):
    state, step = engine(config, mesh_shape)
    for i in range(steps):
        state, _ = step(state, batch(i))
    return state, step


SR = zpp.ZeroPPConfig(
    grad_bits=8,
    grad_node_bits=4,
    grad_node_block_size=64,
    weight_bits=None,
    compute_dtype=jnp.float32,
    stochastic_rounding=True,
)


def test_engine_stochastic_rounding_reproducible_and_keyed_by_step():
    a, _ = run(SR)
    b, _ = run(SR)
    c, _ = run(SR.replace(rounding_seed=1))
    leaves = lambda s: [np.asarray(x) for x in jax.tree_util.tree_leaves(s.params)]  # noqa: E731
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(leaves(a), leaves(c), strict=True))
    # The island reads the state's step; replace / restore keep the two equal.
    assert int(a.step) == int(a.apply_fn.step) == 2
    assert int(a.replace(step=jnp.array(7)).apply_fn.step) == 7
    # Keys: a pure function of (seed, step, leaf).
    k = lambda s, i: jax.random.key_data(choices.rounding_key(SR.rounding_seed, jnp.array(s), i))  # noqa: E731
    np.testing.assert_array_equal(k(3, 1), k(3, 1))
    assert not np.array_equal(k(3, 1), k(4, 1)) and not np.array_equal(k(3, 1), k(3, 2))


def test_engine_gradients_with_stochastic_rounding_differ_per_step():
    # The same batch at two steps: the gradients (hence the updates) differ only through
    # the step-keyed rounding noise.
    state, _ = engine(SR)

    def grads(state):
        def loss_fn(p):
            return jnp.mean((state.apply_fn({"params": p}, batch(0)["x"]) - batch(0)["y"]) ** 2)

        return jax.grad(loss_fn)(state.params)

    g = jax.jit(grads)
    g0, g0b, g1 = g(state), g(state), g(state.replace(step=state.step + 1))
    l0, l0b, l1 = (jax.tree_util.tree_leaves(t) for t in (g0, g0b, g1))
    assert all(np.array_equal(x, y) for x, y in zip(l0, l0b, strict=True))
    assert any(not np.array_equal(x, y) for x, y in zip(l0, l1, strict=True))


def test_ledger_per_hop_formats():
    cfg = zpp.ZeroPPConfig(
        grad_bits=8, grad_node_bits=4, weight_bits=8, weight_local_bits=4, kernels="xla"
    )
    state, step = run(cfg, steps=0)
    led = zpp.comm_ledger(step, state, batch(0))
    kinds = {(r.phase, r.op, r.axes, r.dtype) for r in led.records}
    # Gradients: int8 inside the node, packed int4 (uint8) across nodes.
    assert ("backward", "all-to-all", ("local",), "int8") in kinds
    assert ("backward", "all-to-all", ("node",), "uint8") in kinds
    assert ("backward", "all-to-all", ("node",), "int8") not in kinds
    # Weights: int8 across nodes, the re-quantized packed int4 secondary inside the node.
    assert ("forward", "all-gather", ("node",), "int8") in kinds
    assert ("forward", "all-gather", ("local",), "uint8") in kinds
    assert ("forward", "all-gather", ("local",), "int8") not in kinds
    # Bytes: hop 2 sends half the payload of hop 1 (plus scales), per byte of the piece.
    node = sum(r.bytes_sent for r in led.records if r.phase == "backward" and r.axes == ("node",))
    local = sum(r.bytes_sent for r in led.records if r.phase == "backward" and r.axes == ("local",))
    assert node < local


def test_resume_with_stochastic_rounding_is_bit_identical(tmp_path):
    # The keys come from the step, and a restored state's island reads the restored step:
    # 1 step + save + restore + 1 step == 2 steps.
    straight, step = run(SR, steps=2)
    one, _ = run(SR, steps=1)
    zpp.save_checkpoint(tmp_path / "ck", one)
    target, _ = run(SR, steps=0)
    resumed = zpp.restore_checkpoint(tmp_path / "ck", target)
    assert int(resumed.apply_fn.step) == int(resumed.step) == 1
    resumed, _ = step(resumed, batch(1))
    for x, y in zip(
        jax.tree_util.tree_leaves(straight.params),
        jax.tree_util.tree_leaves(resumed.params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
