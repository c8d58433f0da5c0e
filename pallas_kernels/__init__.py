"""Pallas kernels for block quantization, bit-exact with the jnp reference `zeropp_jax.wire.quant`.

Same signatures and wire layout as the reference, plus keyword-only `tiling`, `interpret`
and `poison_outputs`. `interpret=True` runs the Pallas interpreter (CPU tests); otherwise
the kernels compile with the Triton backend on an NVIDIA GPU (see `_tiling.py` for why).
The float32 sums of the two `dequantize_sum` kernels match the reference to the last bit
however either side contracts `acc + q * scale` into FMAs, because every product is exact
(scales have at most 16 significant bits; see `_planes.dequantize_sum_fine_planes`).

A leaf package: it imports only jax and numpy. The four block functions are what the
collectives call (`zeropp_jax.wire.kernels.pallas_codec` bundles them); `quantize_blockwise` and
`dequantize_blockwise` quantize a whole array, as the reference's functions of those names.
`trace_for_gpu` and `shard_map_mesh` lower the compiled kernels for a GPU on a machine
without one (see `_target.py`).
"""

from __future__ import annotations

from pallas_kernels._target import ABSTRACT_GPU_KIND, shard_map_mesh, trace_for_gpu
from pallas_kernels._tiling import Tiling
from pallas_kernels.blockwise import QuantizedArray, dequantize_blockwise, quantize_blockwise
from pallas_kernels.dequantize import dequantize_blocks
from pallas_kernels.dequantize_sum import dequantize_sum_blocks
from pallas_kernels.dequantize_sum_quantize import dequantize_sum_quantize_blocks
from pallas_kernels.quantize import quantize_blocks

__all__ = [
    "ABSTRACT_GPU_KIND",
    "QuantizedArray",
    "Tiling",
    "dequantize_blocks",
    "dequantize_blockwise",
    "dequantize_sum_blocks",
    "dequantize_sum_quantize_blocks",
    "quantize_blocks",
    "quantize_blockwise",
    "shard_map_mesh",
    "trace_for_gpu",
]
