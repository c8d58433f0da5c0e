"""The step as XLA's SPMD partitioner leaves it (`zeropp_jax.measure._partitioned`): the dump of the
partitioned program, the all-reduces a GPU compiler turns into reduce-scatters, and the
ledger read from it: the whole step, the optimizer update's collectives included."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax import comm_ledger
from zeropp_jax.measure._hlo_text import parse_hlo_module
from zeropp_jax.measure._partitioned import partitioned_program, sliced_all_reduces

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


def test_the_whole_step_after_the_partitioner_and_the_program_named():
    """A scanned GPT step (the layered scan's loops, forward and backward) read after
    XLA's partitioner holds the lowered program's collectives with their trip counts,
    plus the update's collectives that XLA inserts, which the lowered program lacks:
    Muon's gathers. With 2 layers the layered
    scan's loop runs once and compiling removes it, so its count comes from the lowered
    program, the loop matched by its source and its call chain's phase (the backward
    loop's own op name, relative inside the shard_map body, does not show the phase).
    XLA FSDP's update is counted as the update phase too. Each ledger names the program
    it read."""
    from zeropp_jax.baselines import step_ledger
    from zeropp_jax.train import cli, optimizers
    from zeropp_jax.train.model import GPT, GPTConfig, init_fn

    gpt = GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4, scan=True)
    mesh = zpp.make_mesh(2, 4)
    tx = zpp.muon(1e-3, muon_weight_dimension_numbers=optimizers.muon_dims)
    state = zpp.TrainState.abstract(
        apply_fn=GPT(gpt).apply, params=init_fn(gpt, 0), tx=tx, mesh=mesh, config=zpp.ZeroPPConfig()
    )
    batch = jax.ShapeDtypeStruct((8, gpt.seq_len + 1), jnp.int32)
    step = zpp.shard(cli.train_step, mesh=mesh)
    lowered = comm_ledger(step, state, batch)
    after = comm_ledger(step, state, batch, partitioned=True)
    assert (lowered.program, after.program) == ("lowered", "partitioned")
    keys = ("op", "dtype", "phase", "axes", "trip_count")
    got = after.bytes_by(*keys)
    for key, num in lowered.bytes_by(*keys).items():
        assert got.get(key) == num, key
    assert not any(r.phase == "update" for r in lowered.records)
    gathers = {(k[1], k[3]) for k in got if k[2] == "update" and k[0] == "all-gather"}
    assert gathers == {("uint16", ("node",)), ("uint16", ("local",))}

    fsdp = step_ledger(
        cli.train_step,
        batch,
        apply_fn=GPT(gpt).apply,
        params=init_fn(gpt, 0),
        tx=optax.contrib.muon(1e-3, muon_weight_dimension_numbers=optimizers.muon_dims),
        mesh=mesh,
        config=None,
    )
    assert fsdp.program == "compiled"
    assert fsdp.link_bytes_by("phase")[("update",)] > fsdp.link_bytes_by("phase")[("forward",)]
