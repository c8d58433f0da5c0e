"""The interpreter: it reads the user's model as a jaxpr and gathers each sharded weight
where the model reads it (layer by layer inside scans). Everything here is private.

  `_island`: the `shard_map` island that runs on each device inside `state.apply_fn`.
  `_placement`: trace the model, then place each weight's gather at its use.
  `_layered_scan`, `_indexed_scan`, `_layer_view`, `_relayout`: scans over stacked weights,
    rebuilt so each iteration gathers its own layer.
  `_leaf_gathers`: how each leaf is gathered and its gradient reduced (`Gathers`, the
    interpreter's contract with the wire).
  `_jaxpr_reads`, `_dataflow`, `_use_vjp`: which equations read a weight, shared pieces, and
    one use's VJP.
  `_jaxpr_compat`: the one module that reads jax's internals (the adapter to jax 0.10-0.12).
"""
