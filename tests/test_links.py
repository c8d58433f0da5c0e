"""The per-link model: the bytes each collective sends through each node's network link,
from its algorithm ('gloo' or 'nccl') and replica groups (zeropp_jax/measure/_links.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax import comm_ledger
from zeropp_jax.measure._links import node_traffic

NODES = np.array([0, 0, 0, 0, 1, 1, 1, 1])  # 2 nodes x 4 devices, ids in node order
CONTIGUOUS = [tuple(range(8))]
INTERLEAVED = [(0, 4, 1, 5, 2, 6, 3, 7)]


@pytest.mark.parametrize(
    "op, groups, links, per_node",
    [
        # A ring of 8 in node order crosses on 2 edges (3->4, 7->0), each 7/8 of out.
        ("all-gather", CONTIGUOUS, "gloo", 70),
        # In rank order alternating nodes, gloo's ring crosses on all 8 edges ...
        ("all-gather", INTERLEAVED, "gloo", 4 * 70),
        # ... NCCL orders its ring node by node, whatever the group's order.
        ("all-gather", INTERLEAVED, "nccl", 70),
        ("all-reduce", CONTIGUOUS, "gloo", 2 * 70),
        # gloo's recursive halving sends 40, 20, 10 bytes at distances 1, 2, 4: only the
        # last step crosses, 10 bytes from each of a node's 4 devices.
        ("reduce-scatter", CONTIGUOUS, "gloo", 4 * 10),
        ("reduce-scatter", CONTIGUOUS, "nccl", 70),
        # Every device sends 1/8 of its operand to each of the 4 devices of the other node.
        ("all-to-all", CONTIGUOUS, "gloo", 4 * 4 * 10),
        ("all-to-all", CONTIGUOUS, "nccl", 4 * 4 * 10),
        # A pair per device, all across: 4 x 80 each way.
        ("collective-permute", [(i, (i + 4) % 8) for i in range(8)], "gloo", 4 * 80),
        # A ring of 6 (not a power of two) reduce-scatters as a ring.
        ("reduce-scatter", [(0, 1, 2, 4, 5, 6)], "gloo", 80 * 5 / 6),
    ],
)
def test_node_traffic_follows_the_algorithm(op, groups, links, per_node):
    leaving, entering = node_traffic(op, groups, 80, 80, NODES, links)
    assert leaving == entering == (per_node, per_node)


def test_node_traffic_inside_one_node_and_bad_model():
    assert node_traffic("all-gather", [(0, 1, 2, 3), (4, 5, 6, 7)], 8, 32, NODES, "gloo") == (
        (0.0, 0.0),
        (0.0, 0.0),
    )
    with pytest.raises(ValueError, match="links='mpi'"):
        node_traffic("all-gather", CONTIGUOUS, 8, 64, NODES, "mpi")


def test_links_default_and_choice_on_a_real_program():
    # Gathered over ('local', 'node'), the group's rank order alternates between the nodes.
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("node", "local"))
    spec = P(("local", "node"))
    gather = jax.jit(
        jax.shard_map(
            lambda x: lax.all_gather(x, ("local", "node"), tiled=True),
            mesh=mesh,
            in_specs=spec,
            out_specs=P(),
            check_vma=False,
        )
    )
    x = jax.device_put(jnp.zeros((16, 4)), NamedSharding(mesh, spec))  # 32 bytes per device
    per_edge = 8 * 32 * 7 / 8
    gloo = comm_ledger(gather, x)  # the default on CPU devices
    assert gloo.records[0].node_out_bytes == (8 / 2 * per_edge,) * 2
    nccl = comm_ledger(gather, x, links="nccl")
    assert nccl.link_bytes == per_edge
    assert gloo.total_bytes == nccl.total_bytes == per_edge  # per device: the same
    with pytest.raises(ValueError, match="links="):
        comm_ledger(gather, x, links="tcp")
