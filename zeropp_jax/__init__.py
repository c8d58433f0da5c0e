"""zeropp_jax: ZeRO++ for JAX.

Quantized weight all-gathers (qwZ), a secondary weight shard inside each node (hpZ) and a
quantized two-hop gradient reduction (qgZ) over a `('node', 'local')` device mesh.

The floor plan: the public names are this module's `__all__`; `zeropp_jax.wire` holds the
collectives and the quantizer (its public modules are the extension points), and the
trainer is `zeropp_jax.train`. Modules whose name starts with `_`, and everything in
`zeropp_jax.interpreter`, `zeropp_jax.measure` and `zeropp_jax.state`, are private.
"""

from zeropp_jax._choices import NothingSentWarning
from zeropp_jax._config import ZeroPPConfig
from zeropp_jax._distributed_muon import muon
from zeropp_jax._engine import ShardedStep, TrainState, gather_params, shard
from zeropp_jax._mesh import TopologyWarning, make_mesh
from zeropp_jax.measure._ledger import CommLedger, comm_ledger
from zeropp_jax.measure._stored_share import StoredAboveShareWarning
from zeropp_jax.state._checkpoint import restore_checkpoint, save_checkpoint
from zeropp_jax.state._preemption import StopGuard
from zeropp_jax.state._residuals import split as split_residuals
from zeropp_jax.state._state_init import ShardedInit
from zeropp_jax.wire.quant import QuantizedArray, dequantize_blockwise, quantize_blockwise

__all__ = [
    "CommLedger",
    "NothingSentWarning",
    "ShardedInit",
    "ShardedStep",
    "StopGuard",
    "StoredAboveShareWarning",
    "TopologyWarning",
    "TrainState",
    "QuantizedArray",
    "ZeroPPConfig",
    "comm_ledger",
    "dequantize_blockwise",
    "gather_params",
    "make_mesh",
    "muon",
    "quantize_blockwise",
    "restore_checkpoint",
    "save_checkpoint",
    "shard",
    "split_residuals",
]

__version__ = "0.1.0"
