"""The step as XLA's SPMD partitioner leaves it (`zeropp_jax.partitioned`): the dump of the
partitioned program, and the all-reduces a GPU compiler turns into reduce-scatters."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.hlo_text import parse_hlo_module
from zeropp_jax.partitioned import partitioned_program, sliced_all_reduces

SLICED = """\
HloModule sliced

region_add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

ENTRY main {
  p = f32[32]{0} parameter(0)
  i = s32[] parameter(1)
  kept = f32[32]{0} all-reduce(p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, \
to_apply=region_add
  ROOT slice = f32[4]{0} dynamic-slice(kept, i), dynamic_slice_sizes={4}
}
"""


def test_an_all_reduce_whose_one_user_keeps_one_group_member_s_slice():
    mesh = jax.make_mesh((8,), ("d",))
    module = parse_hlo_module(SLICED)
    assert sliced_all_reduces(module.computations["main"], mesh) == {"kept"}
    # a slice of another size, or a second user, leaves it an all-reduce
    wider = parse_hlo_module(SLICED.replace("f32[4]{0} dynamic-slice", "f32[8]{0} dynamic-slice"))
    assert sliced_all_reduces(wider.computations["main"], mesh) == set()
    twice = SLICED.replace("  ROOT slice", "  other = f32[32]{0} negate(kept)\n  ROOT slice")
    assert sliced_all_reduces(parse_hlo_module(twice).computations["main"], mesh) == set()


def test_the_partitioned_program_holds_per_device_shapes_and_the_collectives():
    mesh = jax.make_mesh((8,), ("d",))
    rows = NamedSharding(mesh, P("d"))
    step = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=rows)
    lowered = step.lower(jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=rows))
    assert "all-reduce" not in lowered.as_text(dialect="hlo")  # XLA adds it
    partitioned, compiled = partitioned_program(lowered)
    ops = {
        ins.opcode: ins.shape
        for comp in parse_hlo_module(partitioned).computations.values()
        for ins in comp
    }
    assert ops["parameter"].startswith("f32[8,32]") and ops["all-reduce"].startswith("f32[32]")
    assert "all-reduce" in compiled
