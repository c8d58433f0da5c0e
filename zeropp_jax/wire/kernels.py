"""The Pallas kernels of `pallas_kernels` as a `quant.Codec` for the collectives.

`pallas_kernels` is a leaf package (it imports nothing from `zeropp_jax`); this module is
where the two meet. The engine picks the codec from `ZeroPPConfig.kernels`
(`'pallas'` compiled, `'pallas_interpret'` interpreted), and lowers the compiled kernels
for a GPU on a machine without one with `trace_for_gpu` and `shard_map_mesh` (the mesh of
every `shard_map` whose body calls them).
"""

from __future__ import annotations

import functools

import pallas_kernels
from pallas_kernels import shard_map_mesh, trace_for_gpu
from zeropp_jax.wire.quant import Codec

__all__ = ["pallas_codec", "shard_map_mesh", "trace_for_gpu"]


def pallas_codec(*, interpret: bool) -> Codec:
    """The four block kernels as a `Codec`, with `interpret` bound.

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
    return _pallas_codec(interpret)


@functools.cache
def _pallas_codec(interpret: bool) -> Codec:
    return Codec(
        quantize_blocks=functools.partial(pallas_kernels.quantize_blocks, interpret=interpret),
        dequantize_blocks=functools.partial(pallas_kernels.dequantize_blocks, interpret=interpret),
        dequantize_sum_blocks=functools.partial(
            pallas_kernels.dequantize_sum_blocks, interpret=interpret
        ),
        dequantize_sum_quantize_blocks=functools.partial(
            pallas_kernels.dequantize_sum_quantize_blocks, interpret=interpret
        ),
    )
