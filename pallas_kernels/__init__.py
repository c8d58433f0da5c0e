"""Pallas kernels for block quantization, bit-exact with `zeropp_jax.quant`.

Same signatures and wire layout as the reference, plus keyword-only `tiling`, `interpret`
and `poison_outputs`. `interpret=True` runs the Pallas interpreter (CPU tests); otherwise
the kernels compile with the Triton backend on an NVIDIA GPU (see `_tiling.py` for why).
The float32 sums of the two `dequantize_sum` kernels match to the last bit only where the
compiler contracts `acc + q * scale` into FMAs as XLA does for the reference (see
`_planes.dequantize_sum_fine_planes`).
"""

from pallas_kernels._tiling import Tiling
from pallas_kernels.dequantize import dequantize_blocks
from pallas_kernels.dequantize_sum import dequantize_sum_blocks
from pallas_kernels.dequantize_sum_quantize import dequantize_sum_quantize_blocks
from pallas_kernels.quantize import quantize_blocks

__all__ = [
    "Tiling",
    "dequantize_blocks",
    "dequantize_sum_blocks",
    "dequantize_sum_quantize_blocks",
    "quantize_blocks",
]
