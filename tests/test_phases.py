"""The phase of an HLO op and the trip counts of a program's loops (`zeropp_jax.phases`)."""

import jax
import jax.numpy as jnp

from zeropp_jax.hlo_text import parse_hlo_module
from zeropp_jax.optimizer_view import UPDATE_SCOPE
from zeropp_jax.phases import compiled_trip_counts, lowered_trip_counts, phase_of


def test_phase_of_op_names():
    assert phase_of(["jit(step)/jvp(loss)/dot_general"]) == "forward"
    assert phase_of(["jit(step)", "transpose(jvp(loss))/dot_general"]) == "backward"
    assert phase_of(["jit(step)/rematted_computation/dot_general"]) == "backward"
    assert phase_of(["jit(step)/retransposed/dot_general"]) == "forward"
    assert phase_of([f"jit(step)/{UPDATE_SCOPE}/transpose(jvp(f))/mul"]) == "update"


def test_a_loop_s_trip_count_in_the_lowered_and_the_compiled_program():
    def f(x):
        return jax.lax.fori_loop(0, 7, lambda i, c: jnp.tanh(c @ c), x)

    lowered = jax.jit(f).lower(jnp.ones((16, 16)))
    counts = lowered_trip_counts(lowered)
    assert list(counts.values()) == [{7}] and next(iter(counts))[1] == "forward"
    assert compiled_trip_counts(parse_hlo_module(lowered.compile().as_text())) == counts
