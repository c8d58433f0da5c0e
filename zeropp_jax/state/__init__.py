"""The train state: how each leaf is laid out, made, viewed by the optimizer, saved and
restored. Public through `zeropp_jax.TrainState`, `ShardedInit`, `save_checkpoint`,
`restore_checkpoint` and `StopGuard`; the modules here are private.

  `_partition`: the stored layout of each leaf over the mesh.
  `_state_init`: the stored master leaves, made sharded.
  `_optimizer_view`: model-shaped views the optimizer runs on.
  `_residuals`: error-feedback residuals.
  `_checkpoint`, `_saved_layouts`: checkpoints that restore onto another mesh or config.
  `_preemption`: stopping at a step every process agrees on.
"""
