"""The wire: how shards travel between devices, as pure functions meant to run inside
`jax.shard_map` (they never look up a mesh or a config; shapes are per device).

Public (the extension points of `docs/api.md`):
  `quant`: block quantization, its formats (`quant.FORMATS`) and `quant.Codec`, the
    interface a quantizer implements (`quant.XLA_CODEC`, plain jnp, is the reference).
  `collectives`: the ZeRO++ weight gathers (qwZ, hpZ) for your own `shard_map`.
  `reductions`: the gradient reductions, in one hop or two (qgZ), and their `TwoHop` spec.
  `kernels`: the Pallas kernels of `pallas_kernels` as a `quant.Codec`.

Private (may change without notice):
  `_encoding`: a shard's wire dtype, quantization blocks and piece order.
  `_rotation`: block Hadamard rotation before quantizing.
  `_feedback`: error feedback for the two-hop reduction.
  `_delta`: weight-delta gathers through a kept secondary shard.
  `_weight_gather`: the differentiable gather: gather forward, reduce backward.
"""
