"""Measurement: what a compiled step sends, per mesh axis, phase and network link, and what
code a run ran. Public through `zeropp_jax.comm_ledger` / `zeropp_jax.CommLedger`; the
modules here are private.

  `_ledger`: `comm_ledger`, the bytes every collective sends.
  `_hlo_text`, `_partitioned`, `_phases`: reading HLO text, the partitioner's program, and
    which phase each op serves.
  `_links`, `_groups`: bytes through each node's link; replica groups on the mesh.
  `_stored_share`: how far each stored leaf exceeds its share of the state.
  `_provenance`: the commit, dirty flag and package versions of a run.
"""
