"""Fused dequantize-sum-requantize kernel: `zeropp_jax.wire.quant.dequantize_sum_quantize_blocks`,
bit for bit, in one pass (the middle of the two-hop gradient reduction, qgZ)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _planes as planes
from pallas_kernels import _tiling
from pallas_kernels._tiling import Tiling


def _dequantize_sum_quantize_kernel(
    v_ref,
    s_ref,
    u_ref,
    o_ref,
    t_ref,
    *,
    bits: int,
    out_bits: int,
    kf: int,
    num_blocks: int,
    exact_asm: bool,
):
    """One program over `rows` blocks, on `kf` fine planes of width `w`.

    `v_ref` `(G, rows, r_in, w)` and `s_ref` `(G, rows)` in; `u_ref` `(rows, kf, w)` float32
    noise or None; `o_ref` `(rows, r_out, w)` packed at `out_bits` and `t_ref` `(rows,)` out.
    """
    rows = s_ref.shape[1]
    mask = _tiling.row_mask(rows, num_blocks)
    acc = planes.dequantize_sum_fine_planes(v_ref, s_ref, bits=bits, kf=kf, mask=mask)
    noise = None
    if u_ref is not None:
        noise = [planes.load(u_ref.at[:, planes.index(f), :], mask) for f in range(kf)]
    q, scales = planes.quantize_fine_planes(acc, bits=out_bits, noise=noise, exact_asm=exact_asm)
    planes.pack_fine_planes(o_ref, q, bits=out_bits, mask=mask)
    planes.store(t_ref, scales, mask)


@_tiling.shared("bits", "out_bits", "tiling", "interpret", "poison_outputs")
def dequantize_sum_quantize_blocks(
    values: jax.Array,
    scales: jax.Array,
    *,
    bits: int,
    out_bits: int,
    key: jax.Array | None = None,
    tiling: Tiling | None = None,
    interpret: bool = False,
    poison_outputs: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`dequantize_sum_blocks` then `quantize_blocks` at `out_bits`, fused: the float32 sum
    never leaves the chip. Equal to `zeropp_jax.wire.quant.dequantize_sum_quantize_blocks`.

    Args:
      values: packed values `(G, num_blocks, bytes_per_block)` at `bits` (per shard).
      scales: float32 `(G, num_blocks)`.
      bits: bits of the input, 8, 4 or 2.
      out_bits: bits of the output, 8, 4 or 2.
      key: PRNG key for stochastic rounding of the output; the noise is drawn outside the
        kernel with the reference's `jax.random.uniform(key, (num_blocks, block_size))` and
        read by the kernel. None rounds to nearest, ties to even.
      tiling: tile sizes; None picks them from the block size.
      interpret: run the kernel in the Pallas interpreter (CPU).
      poison_outputs: start from 255/-128/NaN-filled outputs (testing aid).

    Returns:
      `(values, scales)` at `out_bits`: packed `(num_blocks, block_size * out_bits // 8)`
      (int8 for 8 bits, else uint8) and float32 `(num_blocks,)`.
    """
    for name, b in (("bits", bits), ("out_bits", out_bits)):
        if isinstance(b, bool) or b not in _tiling.BITS:
            raise ValueError(f"{name}={b!r} is not supported; expected one of {_tiling.BITS}.")
    _tiling.check_packed(values, scales, bits, 2)
    groups, num_blocks, width_in = values.shape
    if groups == 0:
        raise ValueError("dequantize_sum_quantize_blocks needs at least one block set (G >= 1).")
    k_in, k_out = 8 // bits, 8 // out_bits
    block_size = width_in * k_in
    _tiling.check_bits(bits, block_size, interpret=interpret)
    _tiling.check_bits(out_bits, block_size, interpret=interpret, name="out_bits")
    cfg = tiling or Tiling()
    out_dtype = jnp.int8 if out_bits == 8 else jnp.uint8
    if num_blocks == 0:
        return jnp.zeros((0, block_size // k_out), out_dtype), jnp.zeros((0,), jnp.float32)
    kf = max(k_in, k_out)
    r_in, w = planes.layout(bits, block_size, kf)
    r_out, _ = planes.layout(out_bits, block_size, kf)
    rows = cfg.rows_for(num_blocks, block_size)
    operands = [values.reshape(groups, num_blocks, r_in, w), scales]
    in_specs = [
        pl.BlockSpec((groups, rows, r_in, w), lambda j: (0, j, 0, 0)),
        pl.BlockSpec((groups, rows), lambda j: (0, j)),
    ]
    static = dict(
        bits=bits, out_bits=out_bits, kf=kf, num_blocks=num_blocks, exact_asm=not interpret
    )
    if key is None:

        def body(v_ref, s_ref, o_ref, t_ref):
            _dequantize_sum_quantize_kernel(v_ref, s_ref, None, o_ref, t_ref, **static)

    else:
        noise = jax.random.uniform(key, (num_blocks, block_size), jnp.float32)
        operands.append(noise.reshape(num_blocks, kf, w))
        in_specs.append(pl.BlockSpec((rows, kf, w), lambda j: (j, 0, 0)))
        body = functools.partial(_dequantize_sum_quantize_kernel, **static)
    out, out_scales = _tiling.call(
        body,
        operands,
        grid=_tiling.num_programs(num_blocks, rows),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((rows, r_out, w), lambda j: (j, 0, 0)),
            planes.program_rows(rows),
        ],
        out_shapes=[((num_blocks, r_out, w), out_dtype), ((num_blocks,), jnp.float32)],
        tiling=cfg,
        interpret=interpret,
        poison_outputs=poison_outputs,
        name=f"dequantize_sum_quantize_blocks_{bits}to{out_bits}bit",
    )
    return out.reshape(num_blocks, r_out * w), out_scales
