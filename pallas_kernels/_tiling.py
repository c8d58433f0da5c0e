"""Tile sizes, argument checks and the `pallas_call` plumbing every kernel shares.

GPU backend. On an NVIDIA GPU, a plain `pl.pallas_call` (no `compiler_params`) is lowered
with *Mosaic GPU* by jax 0.10 to 0.11.1, whose `jax_pallas_use_mosaic_gpu` flag defaults to
True (`gpu_lowering` in `jax/_src/pallas/pallas_call.py` picks the backend from the type of
`compiler_params`, else from that flag; it warns that `pallas_call` for Mosaic GPU is
deprecated in favour of `plgpu.kernel`), and with *Triton* by jax 0.11.2 and 0.12, which
have no such flag. These kernels target Triton on every version, by always passing
`jax.experimental.pallas.triton.CompilerParams` off interpret mode: grid plus `BlockSpec`
tiling of rows is Triton's programming model, it runs on any NVIDIA GPU from sm_80 (Mosaic
GPU wants Hopper or newer), and it lowers the integer shifts, masks and reductions the
packed layout needs. The Pallas changelog for jax 0.11.0
(docs.jax.dev/en/latest/pallas/CHANGELOG.html, "Triton") marks the Triton backend
deprecated; it still works in 0.12, and from 0.11.2 every Triton lowering emits a
`DeprecationWarning`. Where there is no GPU, jax 0.11 and newer need the target GPU named
(`_target.py`).

Bit-exactness on Triton needs three precautions, all in `_planes.py`: Triton lowers f32
division to the approximate `div.full.f32` (FDivOpConversion in Triton's NVIDIA backend), so
the per-block reciprocal is taken with inline `div.rn.f32`; Triton lowers `max` to
`maxnumf`, which drops NaN, so absmax is reduced over the integer bits of `|x|`; Triton has
no `round`, so round-half-to-even is built from `floor`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

BITS = (8, 4, 2)

# Elements of one block tile that one program handles when `block_rows` is automatic:
# 4096 float32 values are 16 KiB, 32 values per thread with Triton's default 4 warps.
_TARGET_TILE_ELEMENTS = 4096
_MAX_BLOCK_ROWS = 256


def _is_power_of_two(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the blocks are split over programs.

    Attributes:
      block_rows: quantization blocks per program, a power of two up to 4096; None picks
        `min(256, 4096 // block_size)` (at least 1), capped by the number of blocks.
      num_warps: Triton warps per program on a GPU, a power of two up to 32; None keeps
        Triton's default. Ignored in interpret mode.
    """

    block_rows: int | None = None
    num_warps: int | None = None

    def __post_init__(self):
        if self.block_rows is not None and not (
            _is_power_of_two(self.block_rows) and self.block_rows <= 4096
        ):
            raise ValueError(
                f"Tiling.block_rows={self.block_rows!r} is not supported; expected None or a "
                "power of two between 1 and 4096 (Triton tiles are powers of two)."
            )
        if self.num_warps is not None and not (
            _is_power_of_two(self.num_warps) and self.num_warps <= 32
        ):
            raise ValueError(
                f"Tiling.num_warps={self.num_warps!r} is not supported; expected None or a "
                "power of two between 1 and 32."
            )

    def rows_for(self, num_blocks: int, block_size: int) -> int:
        """Blocks per program for `num_blocks` blocks of `block_size` values."""
        if self.block_rows is not None:
            return self.block_rows
        rows = max(1, min(_MAX_BLOCK_ROWS, _TARGET_TILE_ELEMENTS // block_size))
        rows = 1 << (rows.bit_length() - 1)  # round down to a power of two
        return min(rows, 1 << max(0, (num_blocks - 1).bit_length()))


def qmax(bits: int) -> int:
    """Largest quantized magnitude for `bits`: 127, 7 or 1."""
    return 2 ** (bits - 1) - 1


def check_bits(bits: int, block_size: int, *, interpret: bool, name: str = "bits") -> None:
    """Raises `ValueError` unless `bits` and `block_size` can be quantized by these kernels."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"{name}={bits!r} is not supported; expected one of {BITS}.")
    per_byte = 8 // bits
    if block_size <= 0 or block_size % per_byte:
        raise ValueError(
            f"block_size={block_size} is not supported for {name}={bits}; expected a positive "
            f"multiple of {per_byte} (values per byte)."
        )
    if not interpret and not _is_power_of_two(block_size):
        raise ValueError(
            f"block_size={block_size} is not supported by the compiled (Triton) kernels; "
            "expected a power of two. Use interpret=True or the jnp reference for this size."
        )


def check_float(x: jax.Array, what: str) -> None:
    """Raises `ValueError` unless `x` is a float array."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{what} must be a float array, got dtype {x.dtype}.")


def check_packed(values: jax.Array, scales: jax.Array, bits: int, lead: int) -> None:
    """Checks packed `values` `(*L, bytes)` and float32 `scales` `(*L,)` (`lead` = len(L))."""
    want = jnp.int8 if bits == 8 else jnp.uint8
    if values.dtype != want:
        raise ValueError(
            f"values for bits={bits} must be {jnp.dtype(want).name}, got {values.dtype}."
        )
    if scales.dtype != jnp.float32:
        raise ValueError(f"scales must be float32, got {scales.dtype}.")
    if values.ndim != lead + 1 or scales.shape != values.shape[:-1]:
        raise ValueError(
            f"expected values of rank {lead + 1} and scales of shape values.shape[:-1]; got "
            f"values {values.shape} and scales {scales.shape}."
        )


def row_mask(rows: int, num_blocks: int) -> jax.Array | None:
    """In a kernel: which of this program's `rows` blocks exist; None if all always do."""
    if num_blocks % rows == 0:
        return None
    first = pl.program_id(0) * rows
    return first + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) < num_blocks


def _poison(dtype: jnp.dtype):
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.nan
    return -128 if dtype == jnp.int8 else np.iinfo(dtype).max


def _manual_axis_type(operands: Sequence[jax.Array]):
    """Union of the operands' varying mesh axes (inside `shard_map`), else None."""
    varying = frozenset()
    for x in operands:
        mat = getattr(jax.typeof(x), "manual_axis_type", None)
        varying |= getattr(mat, "varying", frozenset())
    manual_axis_type = getattr(jax.sharding, "ManualAxisType", None)
    if not varying or manual_axis_type is None:
        return None
    return manual_axis_type(varying=varying)


def call(
    kernel: Callable[..., None],
    operands: Sequence[jax.Array],
    *,
    grid: int,
    in_specs: Sequence[pl.BlockSpec],
    out_specs: Sequence[pl.BlockSpec],
    out_shapes: Sequence[tuple[tuple[int, ...], jnp.dtype]],
    tiling: Tiling,
    interpret: bool,
    poison_outputs: bool,
    name: str,
) -> tuple[jax.Array, ...]:
    """Runs `kernel(*in_refs, *out_refs)` over a 1-D grid with the Triton backend.

    With `poison_outputs`, every output starts as a NaN (floats), -128 (int8) or 255 (uint8)
    buffer aliased into the kernel, so an element the kernel fails to write shows up.
    """
    mat = _manual_axis_type(operands)
    out_shape = tuple(jax.ShapeDtypeStruct(s, d, manual_axis_type=mat) for s, d in out_shapes)
    body, aliases = kernel, {}
    in_specs, operands = list(in_specs), list(operands)
    if poison_outputs:
        n_in, n_out = len(operands), len(out_shape)

        def body(*refs):
            kernel(*refs[:n_in], *refs[n_in + n_out :])

        operands += [jnp.full(s.shape, _poison(s.dtype), s.dtype) for s in out_shape]
        in_specs += list(out_specs)
        aliases = {n_in + i: i for i in range(n_out)}
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        compiler_params = pltriton.CompilerParams(num_warps=tiling.num_warps)
    kernel_call = pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=(grid,),
        in_specs=in_specs,
        out_specs=list(out_specs),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=compiler_params,
        name=name,
    )
    # `jax.jit` makes the call removable when nothing uses its outputs: JAX never drops a
    # bare `pallas_call` (its DCE rule keeps it), so in a rematerialized backward pass a
    # dequantize whose weight the backward does not need kept its all-gather alive too.
    return tuple(jax.jit(kernel_call)(*operands))


def shared(*static: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: a block function under `jax.jit`, its keyword arguments `static` static.

    Calls with the same shapes, dtypes and static arguments then share one trace, and in
    one program one lowered Triton kernel (jax lowers a jitted function once per program
    for each of its traces); without it, each call traced and lowered its kernel anew
    (the 125M GPT's ZeRO++ step on 16 x 8 H200s: trace + lower 6.59 s at f5004a4, 2.09 s
    with it, `experiments/results/gpu_compile_time/`; issue #48).
    """
    return functools.partial(jax.jit, static_argnames=static)


def num_programs(num_blocks: int, rows: int) -> int:
    """Programs needed to cover `num_blocks` blocks, `rows` per program."""
    return math.ceil(num_blocks / rows)
