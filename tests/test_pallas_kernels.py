"""The Pallas kernels, and the whole-array functions on them, against the jnp reference in
`zeropp_jax.wire.quant`, bit for bit.

Kernels run with `interpret=True` on tiny inputs. Every input mixes normal and heavy-tailed
blocks, an all-zero block, a -0.0 block, NaN and +-Inf blocks, a block of exact rounding
ties and a block near the float32 maximum; the number of blocks is not a multiple of the
tile, and every output starts poisoned (NaN / -128 / 255) so a missed write shows.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from zeropp_jax.wire import quant

TILING = pk.Tiling(block_rows=4)
NUM_BLOCKS = 14  # not a multiple of the 4-row tile
ROOT = pathlib.Path(__file__).resolve().parents[1]

_quantize_ref = jax.jit(quant.quantize_blocks, static_argnames="bits")
_dequantize_ref = jax.jit(quant.dequantize_blocks, static_argnames=("bits", "dtype"))
_sum_ref = jax.jit(quant.dequantize_sum_blocks, static_argnames="bits")
_fused_ref = jax.jit(quant.dequantize_sum_quantize_blocks, static_argnames=("bits", "out_bits"))
_quantize_blockwise_ref = jax.jit(quant.quantize_blockwise, static_argnames=("bits", "block_size"))
_dequantize_blockwise_ref = jax.jit(quant.dequantize_blockwise, static_argnames="dtype")
_quantize_blockwise = jax.jit(
    functools.partial(pk.quantize_blockwise, interpret=True), static_argnames=("bits", "block_size")
)
_dequantize_blockwise = jax.jit(
    functools.partial(pk.dequantize_blockwise, interpret=True), static_argnames="dtype"
)


def _blocks(seed: int, block_size: int, bits: int, num_blocks: int = NUM_BLOCKS) -> jax.Array:
    """float32 `(num_blocks, block_size)` holding every kind of block the kernels must match."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = np.array(jax.random.normal(k1, (num_blocks, block_size)), np.float32)
    heavy = np.array(jax.random.cauchy(k2, (2, block_size)), np.float32)
    m = quant.qmax(bits)
    ties = [float(m)] + [(j % (2 * m)) - m + 0.5 for j in range(block_size - 1)]
    x[0] *= 1e3
    x[1] *= 1e-3
    x[2:4] = heavy
    x[4] = 0.0
    x[5] = -0.0
    x[6, 1] = np.nan
    x[7, 0], x[7, -1] = np.inf, -np.inf
    x[8] = ties  # scale is exactly 1, so x / scale lands on k + 0.5
    x[9] *= 1e37
    x[10, 2], x[10, 3] = np.nan, np.inf
    return jnp.asarray(x)


def _assert_bits_equal(got: jax.Array, want: jax.Array) -> None:
    """Same dtype, shape and bytes, signed zeros included; NaN where the reference has NaN
    (NaN sign and payload bits are left out: XLA does not define them)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    if got.dtype.kind == "f" or got.dtype == jnp.bfloat16:
        nan = np.isnan(want.astype(np.float32))
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
        bits = f"u{got.itemsize}"
        got, want = got.view(bits)[~nan], want.view(bits)[~nan]
    np.testing.assert_array_equal(got, want)


def _stack(seed: int, groups: int, block_size: int, bits: int):
    """`groups` reference-quantized block sets: values `(G, nb, bytes)`, scales `(G, nb)`."""
    sets = [_quantize_ref(_blocks(seed + g, block_size, bits), bits=bits) for g in range(groups)]
    return jnp.stack([v for v, _ in sets]), jnp.stack([s for _, s in sets])


BITS_AND_BLOCKS = [(b, n) for b in (8, 4, 2) for n in (8, 64, 256)]
# Every bits and every block size once, for the kernels whose quantizing half is covered by
# the full cross above (interpret mode compiles each case: keep the file fast).
COVERING = [(8, 8), (4, 64), (2, 256)]


@pytest.mark.parametrize("bits,block_size", BITS_AND_BLOCKS)
def test_quantize_blocks(bits, block_size):
    x = _blocks(0, block_size, bits)
    got = pk.quantize_blocks(x, bits=bits, tiling=TILING, interpret=True, poison_outputs=True)
    for g, w in zip(got, _quantize_ref(x, bits=bits), strict=True):
        _assert_bits_equal(g, w)


def test_quantize_blocks_stochastic():  # packed output: the stochastic fused test
    bits = 8
    x, key = _blocks(1, 64, bits), jax.random.key(7)
    got = pk.quantize_blocks(
        x, bits=bits, key=key, tiling=TILING, interpret=True, poison_outputs=True
    )
    for g, w in zip(got, _quantize_ref(x, bits=bits, key=key), strict=True):
        _assert_bits_equal(g, w)


def test_quantize_blocks_bfloat16_leading_axes_default_tiling():
    x = _blocks(2, 64, 4, num_blocks=150)
    x = jnp.where(jnp.isnan(x), 1.0, x)  # see test_nan_blocks_at_sizes_where_xla_cpu_drops_nan
    x = x.astype(jnp.bfloat16).reshape(3, 50, 64)
    got = pk.quantize_blocks(x, bits=4, interpret=True)  # 64 rows per program, 3 programs
    for g, w in zip(got, _quantize_ref(x, bits=4), strict=True):
        _assert_bits_equal(g, w)


def test_quantize_blocks_odd_block_size_in_interpret_mode():
    x = _blocks(3, 24, 4)
    got = pk.quantize_blocks(x, bits=4, tiling=TILING, interpret=True)
    for g, w in zip(got, _quantize_ref(x, bits=4), strict=True):
        _assert_bits_equal(g, w)


@pytest.mark.parametrize("bits,block_size", COVERING)
def test_dequantize_blocks(bits, block_size):
    values, scales = _quantize_ref(_blocks(4, block_size, bits), bits=bits)
    got = pk.dequantize_blocks(
        values, scales, bits=bits, tiling=TILING, interpret=True, poison_outputs=True
    )
    _assert_bits_equal(got, _dequantize_ref(values, scales, bits=bits))


def test_dequantize_blocks_bfloat16():
    values, scales = _quantize_ref(_blocks(5, 64, 2), bits=2)
    got = pk.dequantize_blocks(
        values, scales, bits=2, dtype=jnp.bfloat16, tiling=TILING, interpret=True
    )
    _assert_bits_equal(got, _dequantize_ref(values, scales, bits=2, dtype=jnp.bfloat16))


@pytest.mark.parametrize("bits,block_size", COVERING)
def test_dequantize_sum_blocks(bits, block_size):
    values, scales = _stack(10, 3, block_size, bits)
    got = pk.dequantize_sum_blocks(
        values, scales, bits=bits, tiling=TILING, interpret=True, poison_outputs=True
    )
    _assert_bits_equal(got, _sum_ref(values, scales, bits=bits))


@pytest.mark.parametrize("groups,bits", [(2, 8), (3, 4), (4, 2), (5, 8), (8, 4)])
def test_dequantize_sum_blocks_any_group_count(groups, bits):
    """For every G, the kernel equals the compiled and the op-by-op reference to the bit:
    scales have at most 16 significant bits, so however `acc + q * s` is contracted into
    FMAs (XLA:CPU picks a G-dependent product), every product is exact."""
    values, scales = _stack(60 + groups, groups, 64, bits)
    got = pk.dequantize_sum_blocks(values, scales, bits=bits, tiling=TILING, interpret=True)
    _assert_bits_equal(got, _sum_ref(values, scales, bits=bits))
    _assert_bits_equal(got, quant.dequantize_sum_blocks(values, scales, bits=bits))


FUSED = [(8, 8, 8), (8, 4, 64), (8, 2, 256), (4, 8, 256), (4, 4, 8), (4, 2, 64)]
FUSED += [(2, 8, 64), (2, 4, 256), (2, 2, 8)]


@pytest.mark.parametrize("bits,out_bits,block_size", FUSED)
def test_dequantize_sum_quantize_blocks(bits, out_bits, block_size):
    values, scales = _stack(20, 3, block_size, bits)
    got = pk.dequantize_sum_quantize_blocks(
        values,
        scales,
        bits=bits,
        out_bits=out_bits,
        tiling=TILING,
        interpret=True,
        poison_outputs=True,
    )
    want = _fused_ref(values, scales, bits=bits, out_bits=out_bits)
    for g, w in zip(got, want, strict=True):
        _assert_bits_equal(g, w)


def test_dequantize_sum_quantize_blocks_stochastic():
    values, scales = _stack(30, 2, 64, 4)
    key = jax.random.key(3)
    got = pk.dequantize_sum_quantize_blocks(
        values, scales, bits=4, out_bits=2, key=key, tiling=TILING, interpret=True
    )
    want = _fused_ref(values, scales, bits=4, out_bits=2, key=key)
    for g, w in zip(got, want, strict=True):
        _assert_bits_equal(g, w)


def test_inside_shard_map():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("node", "local"), (AxisType.Auto,) * 2)
    x = _blocks(40, 64, 4, num_blocks=8 * 6)  # 6 blocks per shard

    def per_shard(x):
        v, s = pk.quantize_blocks(x, bits=4, tiling=TILING, interpret=True)
        return pk.dequantize_sum_quantize_blocks(
            v[None], s[None], bits=4, out_bits=8, tiling=TILING, interpret=True
        )

    spec = P(("node", "local"))
    run = jax.jit(
        jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    )
    v, s = _quantize_ref(x, bits=4)
    for g, w in zip(run(x), _fused_ref(v[None], s[None], bits=4, out_bits=8), strict=True):
        _assert_bits_equal(g, w)


def test_nan_blocks_at_sizes_where_xla_cpu_drops_nan():
    """From 64 blocks up, XLA:CPU's reduce-max drops NaN (openxla/xla#21461), so the jnp
    reference gives a NaN block a finite scale and dequantizes its NaN to a number. The kernel
    keeps the documented contract: NaN scale, NaN on dequantization; other blocks bit-exact."""
    x = _blocks(6, 64, 4, num_blocks=150)
    nan_rows = np.isnan(np.asarray(x)).any(axis=1)
    v, s = pk.quantize_blocks(x, bits=4, interpret=True)
    rv, rs = _quantize_ref(x, bits=4)
    assert np.isnan(np.asarray(s)[nan_rows]).all()
    _assert_bits_equal(v[~nan_rows], rv[~nan_rows])
    _assert_bits_equal(s[~nan_rows], rs[~nan_rows])
    back = pk.dequantize_blocks(v, s, bits=4, interpret=True)
    assert np.isnan(np.asarray(back)[nan_rows]).all()


def test_subnormal_and_huge_blocks():
    """Subnormal blocks (XLA:CPU flushes them: the kernel must flush alike), blocks whose
    2-bit scale reaches 2**126 (pre-scaled by 2**-63) and blocks at the float32 maximum
    (scale capped at the largest 16-bit scale whose product with qmax is finite)."""
    x = _blocks(50, 64, 2)
    top = np.float32(np.finfo(np.float32).max)
    edge = jnp.asarray(np.resize(np.array([top, -top, top / 3, 1.0], np.float32), (2, 64)))
    x = jnp.concatenate([x * 1e-39, x[:4] * 1e-45, x[11:] * 6e37, edge])
    for bits in (2, 8):
        got = pk.quantize_blocks(x, bits=bits, tiling=TILING, interpret=True)
        for g, w in zip(got, _quantize_ref(x, bits=bits), strict=True):
            _assert_bits_equal(g, w)


BLOCKWISE = [  # bits, block_size, shape (not a whole number of blocks), dtype, stochastic
    (8, 8, (7, 15), jnp.float32, False),
    (4, 16, (210,), jnp.bfloat16, False),
    (2, 8, (3, 5, 7), jnp.float32, True),
]


@pytest.mark.parametrize("bits,block_size,shape,dtype,stochastic", BLOCKWISE)
def test_quantize_and_dequantize_blockwise(bits, block_size, shape, dtype, stochastic):
    """Equal to `quant.quantize_blockwise` / `dequantize_blockwise`, under `jit` (so the
    `QuantizedArray` pytree keeps `bits`, `block_size` and `shape` static); each package's
    `dequantize_blockwise` reads the other's `QuantizedArray`."""
    size = int(np.prod(shape))
    x = _blocks(80, block_size, bits).reshape(-1)[:size].reshape(shape).astype(dtype)
    key = jax.random.key(9) if stochastic else None
    got = _quantize_blockwise(x, bits=bits, block_size=block_size, key=key)
    want = _quantize_blockwise_ref(x, bits=bits, block_size=block_size, key=key)
    assert isinstance(got, pk.QuantizedArray)
    assert (got.bits, got.block_size, got.shape) == (want.bits, want.block_size, want.shape)
    assert got.size == want.size and got.nbytes == want.nbytes
    _assert_bits_equal(got.values, want.values)
    _assert_bits_equal(got.scales, want.scales)
    _assert_bits_equal(_dequantize_blockwise(want, dtype), _dequantize_blockwise_ref(got, dtype))


def test_empty_input():
    v, s = pk.quantize_blocks(jnp.zeros((0, 64)), bits=4, interpret=True)
    assert v.shape == (0, 32) and v.dtype == jnp.uint8 and s.shape == (0,)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: pk.Tiling(block_rows=3), "power of two"),
        (lambda: pk.Tiling(num_warps=64), "num_warps"),
        (lambda: pk.quantize_blocks(jnp.zeros((4, 64)), bits=3, interpret=True), "bits=3"),
        (lambda: pk.quantize_blocks(jnp.zeros((4, 64), jnp.int32), bits=8), "float"),
        (lambda: pk.quantize_blocks(jnp.zeros((4, 6)), bits=2, interpret=True), "multiple of 4"),
        (lambda: pk.quantize_blocks(jnp.zeros((4, 24)), bits=8), "power of two"),
        (
            lambda: pk.quantize_blockwise(jnp.zeros(8), bits="e4m3", block_size=8),
            "bits='e4m3'",
        ),
        (lambda: pk.quantize_blockwise(jnp.zeros(8), bits=8, block_size=8.0), "block_size=8.0"),
        (lambda: pk.quantize_blockwise(jnp.zeros(8, jnp.int8), bits=8, block_size=8), "float"),
        (lambda: pk.quantize_blockwise(jnp.zeros(96), bits=8, block_size=96), "power of two"),
        (
            lambda: pk.dequantize_blocks(
                jnp.zeros((4, 32), jnp.int8), jnp.zeros((4,)), bits=4, interpret=True
            ),
            "uint8",
        ),
        (
            lambda: pk.dequantize_sum_blocks(
                jnp.zeros((2, 4, 32), jnp.uint8), jnp.zeros((2, 5)), bits=4, interpret=True
            ),
            "scales of shape",
        ),
        (
            lambda: pk.dequantize_sum_quantize_blocks(
                jnp.zeros((2, 4, 32), jnp.uint8),
                jnp.zeros((2, 4)),
                bits=4,
                out_bits=16,
                interpret=True,
            ),
            "out_bits=16",
        ),
    ],
)
def test_rejects_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_gpu_script_smoke():
    """`experiments/gpu_kernels.py --smoke`: every check and the table, interpreted on CPU."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "gpu_kernels.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MISMATCH" not in proc.stdout and "copy" in proc.stdout, proc.stdout


def test_imports_nothing_from_zeropp_jax():
    """`pallas_kernels` is a leaf: jax and numpy only (`zeropp_jax.wire.kernels` wraps it)."""
    code = (
        "import sys, pallas_kernels; print([m for m in sys.modules if m.startswith('zeropp_jax')])"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
