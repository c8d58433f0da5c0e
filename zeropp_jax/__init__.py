"""zeropp_jax: ZeRO++ for JAX.

Quantized weight all-gathers (qwZ), a secondary weight shard inside each node (hpZ) and a
quantized two-hop gradient reduction (qgZ) over a `('node', 'local')` device mesh.
"""

from zeropp_jax._config import ZeroPPConfig
from zeropp_jax._distributed_muon import muon
from zeropp_jax._engine import ShardedStep, TrainState, gather_params, shard
from zeropp_jax._mesh import make_mesh
from zeropp_jax.measure._ledger import CommLedger, comm_ledger
from zeropp_jax.state._checkpoint import restore_checkpoint, save_checkpoint
from zeropp_jax.state._preemption import StopGuard
from zeropp_jax.state._state_init import ShardedInit
from zeropp_jax.wire.quant import QuantizedArray, dequantize_blockwise, quantize_blockwise

__all__ = [
    "CommLedger",
    "ShardedInit",
    "ShardedStep",
    "StopGuard",
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
]

__version__ = "0.1.0"
