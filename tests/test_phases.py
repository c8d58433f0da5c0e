"""The phase of an HLO op and the trip counts of a program's loops (`zeropp_jax.phases`)."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zeropp_jax.hlo_text import parse_hlo_module
from zeropp_jax.optimizer_view import UPDATE_SCOPE
from zeropp_jax.phases import (
    collective_loops,
    compiled_trip_counts,
    lowered_trip_counts,
    phase_of,
)


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


def test_only_loops_that_hold_a_collective_are_counted():
    """A loop with no collective (a `fori_loop` in a backward rule, which the backward
    pass gives the layer loop's source location) never lends its count to a loop that
    has one."""
    quiet = _looped(3, collective=False)
    assert lowered_trip_counts(quiet) == {}
    assert compiled_trip_counts(parse_hlo_module(quiet.compile().as_text())) == {}
    module = parse_hlo_module(_looped(5, collective=True).as_text(dialect="hlo"))
    assert len(collective_loops(module)) == 1
