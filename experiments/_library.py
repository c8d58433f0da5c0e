"""The library's private names the experiments depend on, declared in one place.

zeropp_jax promises `zeropp_jax.__all__`, its entry points and the extension points of
`docs/api.md`. The experiments also look inside the engine (HLO text, layouts, phases,
provenance): the private names they read are imported here and nowhere else in
`experiments/` (`tests/test_house.py` checks). A private module may move in any release;
when one does, this file is the one to fix.
"""

# ruff: noqa: F401
from zeropp_jax import _choices as choices
from zeropp_jax._activation_sharding import constrain_to_batch
from zeropp_jax.interpreter import _island as island
from zeropp_jax.interpreter import _jaxpr_compat as jaxpr_compat
from zeropp_jax.interpreter import _leaf_gathers as leaf_gathers
from zeropp_jax.interpreter import _placement as placement
from zeropp_jax.measure import _hlo_text as hlo_text
from zeropp_jax.measure import _stored_share as stored_share
from zeropp_jax.measure._groups import group_axes
from zeropp_jax.measure._hlo_text import array_shapes, parse_replica_groups
from zeropp_jax.measure._ledger import PARTS
from zeropp_jax.measure._phases import phase_of
from zeropp_jax.measure._provenance import SOURCE, describe, package_versions, provenance, same_code
from zeropp_jax.state import _partition as partition
from zeropp_jax.state._partition import BATCH_SPEC
from zeropp_jax.wire import _rotation as rotation
