"""Pallas kernels for block quantization, bit-exact with `zeropp_jax.quant`.

Same signatures and wire layout as the reference, plus keyword-only `tiling`, `interpret`
and `poison_outputs`. `interpret=True` runs the Pallas interpreter (CPU tests); otherwise
the kernels compile with the Triton backend on an NVIDIA GPU (see `_tiling.py` for why).
The float32 sums of the two `dequantize_sum` kernels match the reference to the last bit
however either side contracts `acc + q * scale` into FMAs, because every product is exact
(scales have at most 16 significant bits; see `_planes.dequantize_sum_fine_planes`).

`codec(interpret=...)` bundles the four kernels as a `zeropp_jax.quant.Codec` for the
collectives (`ZeroPPConfig(kernels='pallas')` or `'pallas_interpret'`).
"""

from __future__ import annotations

import functools

from pallas_kernels._tiling import Tiling
from pallas_kernels.dequantize import dequantize_blocks
from pallas_kernels.dequantize_sum import dequantize_sum_blocks
from pallas_kernels.dequantize_sum_quantize import dequantize_sum_quantize_blocks
from pallas_kernels.quantize import quantize_blocks
from zeropp_jax.quant import Codec


def codec(interpret: bool = False) -> Codec:
    """The four kernels as a `zeropp_jax.quant.Codec`, with `interpret` bound.

    Args:
      interpret: run every kernel in the Pallas interpreter (CPU); False compiles them with
        the Triton backend (NVIDIA GPU).

    Returns:
      A `Codec` whose functions take the reference's arguments (`bits=`, `dtype=`,
      `out_bits=`, `key=`) and default tiling. The same object for the same `interpret`, so
      that specs holding it compare equal and jit caches hit.
    """
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret={interpret!r} is not supported; expected True or False.")
    return _codec(interpret)


@functools.cache
def _codec(interpret: bool) -> Codec:
    return Codec(
        quantize_blocks=functools.partial(quantize_blocks, interpret=interpret),
        dequantize_blocks=functools.partial(dequantize_blocks, interpret=interpret),
        dequantize_sum_blocks=functools.partial(dequantize_sum_blocks, interpret=interpret),
        dequantize_sum_quantize_blocks=functools.partial(
            dequantize_sum_quantize_blocks, interpret=interpret
        ),
    )


__all__ = [
    "Tiling",
    "codec",
    "dequantize_blocks",
    "dequantize_sum_blocks",
    "dequantize_sum_quantize_blocks",
    "quantize_blocks",
]
