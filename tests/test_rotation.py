"""The block Hadamard rotation (`zeropp_jax.wire._rotation`) and the gradient hops that use it:
the rotation's math on plain arrays, the config fields, the rotated two-hop reduction
against the quantizer's bound in the rotated basis, with error feedback, and in the
engine (the ledger's bytes do not change)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _support import batch, engine
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax import make_mesh
from zeropp_jax.wire import _feedback as feedback
from zeropp_jax.wire import _rotation as rotation
from zeropp_jax.wire import quant, reductions
from zeropp_jax.wire._encoding import effective_block_size
from zeropp_jax.wire.kernels import pallas_codec

EPS = 2.0**-24  # float32 unit roundoff
SCALE_ROUNDING = 1 + 2.0**-15  # scales are rounded up to 16 significant bits


def butterfly_bound(x, block):
    """Float32 rounding bound of `rotate_blocks(x, block)` per value: `log2(block)` adds,
    the rounded constant and the product, each `(1 + eps)`, on a sum of `|x|` over the
    block divided by `sqrt(block)`."""
    stages = int(math.log2(block)) + 2
    mass = np.abs(x).reshape(*x.shape[:-1], -1, block).sum(-1, keepdims=True) / math.sqrt(block)
    return np.broadcast_to(1.01 * stages * EPS * mass, (*x.shape[:-1], x.shape[-1] // block, block))


def test_rotation_is_the_orthonormal_hadamard_and_its_own_inverse():
    for size in (2, 8, 64):
        h = rotation.hadamard_matrix(size)
        np.testing.assert_array_equal(h, h.T)
        np.testing.assert_allclose(h @ h, np.eye(size), rtol=0, atol=1e-12)
        assert np.all(np.abs(np.abs(h) * math.sqrt(size) - 1) < 1e-12)  # entries +-1/sqrt(n)
    block = 64
    x = np.asarray(jax.random.t(jax.random.key(block), 2.0, (3, 4 * block)), np.float32)
    rotate = jax.jit(rotation.rotate_blocks, static_argnums=1)
    got = np.asarray(rotate(jnp.asarray(x), block), np.float64)
    want = (x.astype(np.float64).reshape(3, 4, block) @ h).reshape(3, -1)
    bound = butterfly_bound(x.astype(np.float64), block).reshape(3, -1)
    assert np.all(np.abs(got - want) <= bound)
    # Norms per block are kept (to rounding), and twice is the identity (to rounding).
    norms = lambda a: np.linalg.norm(a.reshape(3, 4, block), axis=-1)  # noqa: E731
    np.testing.assert_allclose(norms(got), norms(x.astype(np.float64)), rtol=4 * block * EPS)
    back = np.asarray(rotate(jnp.asarray(got, jnp.float32), block), np.float64)
    # Rotating `got` (off by at most `bound` per value) errs by the rotation of that error,
    # at most its sum over the block over sqrt(block), plus the second rounding.
    carried = bound.reshape(3, 4, block).sum(-1, keepdims=True) / math.sqrt(block)
    twice = butterfly_bound(got, block).reshape(3, 4, block) + carried
    assert np.all(np.abs(back - x).reshape(3, 4, block) <= twice)
    assert not np.array_equal(got, x)  # it did rotate


def test_rotation_checks_its_block_sizes():
    assert rotation.is_power_of_two(64) and not rotation.is_power_of_two(48)
    assert not rotation.is_power_of_two(True) and not rotation.is_power_of_two(0)
    for bad in (0, 3, 48, 8.0, True):
        with pytest.raises(ValueError, match="power of two"):
            rotation.check_rotation_block_size(bad)
    with pytest.raises(ValueError, match="not a multiple"):
        rotation.rotate_blocks(jnp.zeros((2, 24)), 16)
    assert rotation.effective_rotation_block(None, 64) is None
    assert rotation.effective_rotation_block(256, 64) == 64  # a small piece's block caps it
    assert rotation.effective_rotation_block(32, 64) == 32
    with pytest.raises(ValueError, match="does not divide"):
        rotation.effective_rotation_block(16, 24)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(grad_rotation=1), "grad_rotation"),
        (dict(grad_node_rotation="yes"), "grad_node_rotation"),
        (dict(grad_rotation=True, grad_rotation_block_size=48), "grad_rotation_block_size"),
        (dict(grad_rotation_block_size=64), "grad_rotation_block_size"),
        (dict(grad_rotation=True, grad_bits=None, grad_node_bits=4), "grad_rotation"),
        (dict(grad_node_rotation=True, grad_node_bits=None), "grad_node_rotation"),
        (dict(grad_rotation=True, grad_block_size=24), "grad_block_size"),
        (dict(grad_rotation=True, grad_rotation_block_size=512), "grad_block_size"),
    ],
)
def test_config_rejects_rotations_it_cannot_run(kwargs, field):
    with pytest.raises(ValueError, match=f"ZeroPPConfig.{field}="):
        zpp.ZeroPPConfig(**kwargs)


def test_config_resolves_each_hops_rotation():
    both = zpp.ZeroPPConfig(grad_rotation=True, grad_node_block_size=64)
    assert (both.grad_hop1_rotation_block_size, both.grad_hop2_rotation_block_size) == (256, 64)
    node = zpp.ZeroPPConfig(grad_node_rotation=True, grad_rotation_block_size=32)
    assert (node.grad_hop1_rotation_block_size, node.grad_hop2_rotation_block_size) == (None, 32)
    off = zpp.ZeroPPConfig()
    assert (off.grad_hop1_rotation_block_size, off.grad_hop2_rotation_block_size) == (None, None)


# ----------------------------------------------------------------------------- two hops

ROWS, COLS = 3, 11  # 33 values per piece: padded inside its last block


def per_device(mesh, fn, x):
    spec = P("node", "local")
    f = jax.shard_map(
        lambda xs: fn(xs[0, 0])[None, None],
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
        check_vma=False,  # Pallas calls carry no varying-axes types
    )
    return np.asarray(jax.jit(f)(x), np.float64)


def rotated_bound(x, kw):
    """Exact two-hop sums and a bound on the L2 error of each device's piece.

    In the rotated basis each quantization event errs by at most half a step per value
    (the step from the rotated block's absmax). Hop 1's errors add over the `L`
    contributions; hop 2 quantizes partial sums whose rotated values are off by at most
    hop 1's error: per value when hop 2 keeps hop 1's rotated blocks (same blocks and
    rotation), else by its L2 norm (`|<h_j, e>| <= ||e||`, rows of `H` have unit norm).
    The rotation is orthonormal, so the L2 error of a piece is at most the L2 norm of its
    rotated-basis bound.
    """
    nn, ll = x.shape[:2]
    n, piece = nn * ll, ROWS * COLS
    x = np.asarray(x, np.float64)
    bs1 = effective_block_size(piece, kw["block_size"])
    bs2 = effective_block_size(piece, kw["node_block_size"])
    rb1 = rotation.effective_rotation_block(kw["rotation_block_size"], bs1)
    rb2 = rotation.effective_rotation_block(kw["node_rotation_block_size"], bs2)

    def rotated_steps(v, bits, bs, rb, slack):  # half steps, per padded value
        pad = -(-v.size // bs) * bs
        blocks = np.pad(v, (0, pad - v.size)).reshape(-1, bs // rb, rb) @ rotation.hadamard_matrix(
            rb
        )
        absmax = np.abs(blocks.reshape(-1, bs)).max(1) + slack.reshape(-1, bs).max(1)
        step = absmax / quant.qmax(bits) * SCALE_ROUNDING
        return np.repeat(step / 2, bs), blocks.reshape(-1)

    exact = np.zeros((nn, ll, piece))
    bound = np.zeros((nn, ll))
    for dn in range(nn):
        for dl in range(ll):
            p = dl * nn + dn
            for a in range(nn):
                parts = [x[a, b].reshape(n, -1)[p] for b in range(ll)]
                partial = np.sum(parts, 0)
                exact[dn, dl] += partial
                pad1 = -(-piece // bs1) * bs1
                e1 = np.zeros(pad1)
                for v in parts:
                    e1 += rotated_steps(v, kw["bits"], bs1, rb1, np.zeros(pad1))[0]
                if bs1 == bs2 and rb1 == rb2:
                    slack = e1
                else:
                    pad2 = -(-piece // bs2) * bs2
                    slack = np.full(pad2, np.linalg.norm(e1))
                e2 = rotated_steps(partial, kw["node_bits"], bs2, rb2, slack)[0]
                bound[dn, dl] += np.linalg.norm(e1) + np.linalg.norm(e2)
    # Float32 rounding of the rotations, sums and products: a few units of roundoff per
    # rotation stage on every quantity that passes through one.
    mass = np.linalg.norm(x.reshape(nn * ll, -1)) + np.linalg.norm(exact)
    return exact, bound + 64 * EPS * math.log2(max(rb1, rb2)) * mass


ROTATED = [
    # hop 2 keeps hop 1's rotated blocks (the fused dequantize-sum-quantize path)
    ((2, 4), dict(bits=8, block_size=16, node_bits=4, node_block_size=16)),
    # hop 2 re-blocks: rotate back, re-block, rotate again
    ((4, 2), dict(bits=8, block_size=8, node_bits=4, node_block_size=32)),
]


@pytest.mark.parametrize("shape,kw", ROTATED)
def test_rotated_two_hop_within_the_bound_in_the_rotated_basis(shape, kw):
    mesh = make_mesh(*shape)
    nn, ll = shape
    # Heavy tails (Student-t, 2 degrees of freedom): the outliers rotation is for.
    x = jax.random.t(jax.random.key(7), 2.0, (nn, ll, nn * ll * ROWS, COLS))
    kw = dict(kw, rotation_block_size=8, node_rotation_block_size=8)
    got = per_device(mesh, lambda s: reductions.two_hop_reduce_scatter(s, **kw), x)
    exact, bound = rotated_bound(x, kw)
    err = np.linalg.norm(got.reshape(nn, ll, -1) - exact, axis=-1)
    assert np.all(err <= bound), float(np.max(err / bound))
    # The rotation is what the bound describes: without it the same data errs more.
    plain = dict(kw, rotation_block_size=None, node_rotation_block_size=None)
    unrotated = per_device(mesh, lambda s: reductions.two_hop_reduce_scatter(s, **plain), x)
    assert np.linalg.norm(got.reshape(-1) - exact.reshape(-1)) < np.linalg.norm(
        unrotated.reshape(-1) - exact.reshape(-1)
    )


def test_rotated_hops_refuse_unquantized_hops_and_pallas_matches_xla():
    mesh = make_mesh(2, 4)
    x = jax.random.t(jax.random.key(8), 2.0, (2, 4, 8 * ROWS, COLS))
    kw = dict(bits=8, block_size=8, node_bits=4, node_block_size=8)
    for bad in (
        dict(bits=None, rotation_block_size=8),
        dict(node_bits=None, node_rotation_block_size=8),
    ):
        with pytest.raises(ValueError, match="unquantized"):
            per_device(mesh, lambda s, b=bad: reductions.two_hop_reduce_scatter(s, **kw | b), x)
    kw.update(rotation_block_size=8, node_rotation_block_size=8)
    xla = per_device(mesh, lambda s: reductions.two_hop_reduce_scatter(s, **kw), x)
    kw["codec"] = pallas_codec(interpret=True)
    pallas = per_device(mesh, lambda s: reductions.two_hop_reduce_scatter(s, **kw), x)
    np.testing.assert_array_equal(pallas, xla)


def test_rotated_feedback_sums_lose_only_the_last_residuals():
    # sum_t out_t + what the last residuals still owe == T * exact, with both hops rotated
    # and the cross-node hop at 2 bits.
    mesh = make_mesh(2, 4)
    nn, ll, n, steps = 2, 4, 8, 5
    x = jax.random.t(jax.random.key(9), 2.0, (nn, ll, n * ROWS, COLS))
    kw = dict(
        bits=8,
        block_size=8,
        node_bits=2,
        node_block_size=16,
        rotation_block_size=8,
        node_rotation_block_size=8,
    )

    def body(xs):
        r1 = jnp.zeros(xs.shape[2:], jnp.float32)
        r2 = jnp.zeros((nn * ROWS, COLS), jnp.float32)

        def step(carry, _):
            out, a, b = feedback.two_hop_reduce_scatter_feedback(xs[0, 0], *carry, **kw)
            return (a, b), out

        (a, b), outs = jax.lax.scan(step, (r1, r2), None, length=steps)
        return outs.sum(0)[None, None], a[None, None], b[None, None]

    spec = P("node", "local")
    f = jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=(spec,) * 3, check_vma=False)
    total, last1, last2 = (np.asarray(a, np.float64) for a in jax.jit(f)(x))
    pieces = np.asarray(x, np.float64).reshape(nn, ll, n, ROWS * COLS)
    owed = last1.reshape(nn, ll, n, -1).sum((0, 1))
    owed = owed + last2.reshape(nn, ll, nn, -1).sum(0).reshape(n, -1)
    exact = pieces.sum((0, 1))
    # Float32 rounding only: the residuals are exact differences of float32 values up to
    # the rotations' and sums' roundoff, over `steps` steps of `n` contributions.
    tol = 64 * EPS * steps * n * np.abs(pieces).sum((0, 1)).max()
    for dn in range(nn):
        for dl in range(ll):
            p = dl * nn + dn
            got = total[dn, dl].reshape(-1) + owed[p]
            assert np.max(np.abs(got - steps * exact[p])) <= tol
    assert np.abs(owed).max() > 1e3 * tol  # something was fed back: the test can fail


# ----------------------------------------------------------------------------- engine


def test_engine_rotated_hops_train_and_send_the_same_bytes():
    rotated = zpp.ZeroPPConfig(
        grad_bits=8, grad_node_bits=4, grad_block_size=64, grad_rotation=True, kernels="xla"
    )
    plain = rotated.replace(grad_rotation=False)
    state, step = engine(rotated)
    ledgers = [zpp.comm_ledger(step, state, batch(0))]
    plain_state, plain_step = engine(plain)
    ledgers.append(zpp.comm_ledger(plain_step, plain_state, batch(0)))
    # The rotation moves no bytes: the same collectives, dtypes and sizes.
    key = lambda r: (r.op, r.dtype, r.axes, r.phase, r.in_bytes, r.out_bytes)  # noqa: E731
    assert sorted(map(key, ledgers[0].records)) == sorted(map(key, ledgers[1].records))
    assert ledgers[0].link_bytes == ledgers[1].link_bytes
    # The engine's reduction runs the rotation: the step's update is the rotated sum's.
    new, _ = step(state, batch(0))
    old = [np.asarray(v) for v in jax.tree_util.tree_leaves(state.params)]
    got = [np.asarray(v) for v in jax.tree_util.tree_leaves(new.params)]
    assert all(np.all(np.isfinite(v)) for v in got)
    assert any(not np.array_equal(a, b) for a, b in zip(old, got, strict=True))
