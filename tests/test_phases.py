"""The phase of an HLO op and the trip counts of a program's loops
(`zeropp_jax.measure._phases`)."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zeropp_jax.measure._hlo_text import parse_hlo_module
from zeropp_jax.measure._phases import (
    _counts_by_key,
    collective_loops,
    compiled_trip_counts,
    lowered_trip_counts,
    phase_of,
)
from zeropp_jax.state._optimizer_view import UPDATE_SCOPE


def test_phase_of_op_names():
    assert phase_of(["jit(step)/jvp(loss)/dot_general"]) == "forward"
    assert phase_of(["jit(step)", "transpose(jvp(loss))/dot_general"]) == "backward"
    assert phase_of(["jit(step)/rematted_computation/dot_general"]) == "backward"
    assert phase_of(["jit(step)/retransposed/dot_general"]) == "forward"
    assert phase_of([f"jit(step)/{UPDATE_SCOPE}/transpose(jvp(f))/mul"]) == "update"


def _looped(steps: int, *, collective: bool):
    """A `fori_loop` of `steps` trips in a shard_map over 8 devices, with or without a
    `psum` in its body."""
    mesh = jax.make_mesh((8,), ("d",))

    def body(i, c):
        c = jnp.tanh(c @ c)
        return c + jax.lax.psum(c, "d") if collective else c

    f = jax.shard_map(
        lambda x: jax.lax.fori_loop(0, steps, body, x), mesh=mesh, in_specs=P("d"), out_specs=P("d")
    )
    rows = jax.sharding.NamedSharding(mesh, P("d"))
    return jax.jit(f).lower(jax.ShapeDtypeStruct((8 * 16, 16), jnp.float32, sharding=rows))


def test_a_loop_s_trip_count_in_the_lowered_and_the_compiled_program():
    lowered = _looped(7, collective=True)
    counts = lowered_trip_counts(lowered)
    assert list(counts.values()) == [{7}] and next(iter(counts))[1] == "forward"
    assert compiled_trip_counts(parse_hlo_module(lowered.compile().as_text())) == counts


def test_at_a_shared_key_the_loop_holding_a_collective_wins():
    """A loop with no collective (a `fori_loop` in a backward rule, which the backward pass
    gives the layer loop's source location) never lends its count to a loop that has one
    at the same key; alone at its key (XLA FSDP's layer scan before the partitioner fills
    it) it is counted."""
    key, other = (("f.py", "g", 1, 0), "backward"), (("f.py", "g", 2, 0), "forward")
    found = [(key, 3, False), (key, 1, True), (other, 12, False)]
    assert _counts_by_key(found) == {key: {1}, other: {12}}
    quiet = _looped(3, collective=False)
    assert list(lowered_trip_counts(quiet).values()) == [{3}]
    assert list(compiled_trip_counts(parse_hlo_module(quiet.compile().as_text())).values()) in (
        [{3}],
        [],  # XLA may unroll or drop a loop it can see through
    )
    module = parse_hlo_module(_looped(5, collective=True).as_text(dialect="hlo"))
    assert len(collective_loops(module)) == 1
    assert collective_loops(parse_hlo_module(quiet.as_text(dialect="hlo"))) == set()
