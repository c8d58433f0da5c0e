"""The wire: how shards travel between devices, as pure functions meant to run inside
`jax.shard_map` (they never look up a mesh or a config; shapes are per device).

Public (extension points):
  `quant`: block quantization and its formats (`quant.FORMATS`), and `quant.Codec`, the
    interface a quantizer implements (the Pallas kernels are one, `_kernels.pallas_codec`).
  `collectives`: the ZeRO++ weight gathers (qwZ, hpZ) for your own `shard_map`.

Private (may change without notice):
  `_encoding`: a shard's wire dtype, quantization blocks and piece order.
  `_reductions`: the gradient reductions, in one hop or two (qgZ), and their `TwoHop` spec.
  `_rotation`: block Hadamard rotation before quantizing.
  `_feedback`: error feedback for the two-hop reduction.
  `_delta`: weight-delta gathers through a kept secondary shard.
  `_weight_gather`: the differentiable gather: gather forward, reduce backward.
  `_kernels`: the Pallas kernels as a `quant.Codec`.
"""
