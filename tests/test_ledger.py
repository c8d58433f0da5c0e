"""Tests for `zeropp_jax.measure._ledger`: every expected byte count is worked out by hand here."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax import CommLedger, comm_ledger
from zeropp_jax.measure._hlo_text import parse_replica_groups
from zeropp_jax.measure._ledger import CollectiveRecord

ROWS, COLS = 2, 4  # per-device block of every test input: 2 x 4 elements
F32_BLOCK = ROWS * COLS * 4  # 32 bytes
SHARDED = P(("node", "local"))


def make(num_nodes: int, local_size: int, order: list[int] | None = None) -> Mesh:
    devices = np.array(jax.devices())
    if order is not None:
        devices = devices[order]
    return Mesh(
        devices.reshape(num_nodes, local_size),
        ("node", "local"),
        axis_types=(AxisType.Auto, AxisType.Auto),
    )


def island(body, mesh: Mesh, **kw):
    """jit(shard_map(body)) with every argument and result sharded over both axes."""
    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=kw.get("in_specs", SHARDED),
            out_specs=kw.get("out_specs", SHARDED),
            check_vma=False,
        )
    )


def block_input(mesh: Mesh, dtype=jnp.float32) -> jax.Array:
    """A global (8 * ROWS, COLS) array; each device holds one ROWS x COLS block."""
    x = jnp.arange(8 * ROWS * COLS).reshape(8 * ROWS, COLS).astype(dtype)
    return jax.device_put(x, NamedSharding(mesh, SHARDED))


def only(ledger: CommLedger, **match) -> CollectiveRecord:
    found = [r for r in ledger.records if all(getattr(r, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, ledger.records)
    return found[0]


# ------------------------------------------------------------------ replica groups


def test_parse_replica_groups_explicit_empty_and_iota():
    assert parse_replica_groups("{{0,1},{2,3}}", 4) == ((0, 1), (2, 3))
    assert parse_replica_groups("{}", 4) == ((0, 1, 2, 3),)
    assert parse_replica_groups("[2,4]<=[8]", 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    # iota(8) as 2 x 4 = [[0,1,2,3],[4,5,6,7]], transposed = columns of it.
    assert parse_replica_groups("[4,2]<=[2,4]T(1,0)", 8) == ((0, 4), (1, 5), (2, 6), (3, 7))
    # iota(8) as 2 x 2 x 2, axes (1, 0, 2): [[[0,1],[4,5]],[[2,3],[6,7]]].
    assert parse_replica_groups("[2,4]<=[2,2,2]T(1,0,2)", 8) == ((0, 1, 4, 5), (2, 3, 6, 7))
    # Mesh-axes form (compiled HLO): ids iota over a 2 x 4 mesh.
    assert parse_replica_groups("mesh['node'=2,'local'=4] {'local'}", 8) == (
        (0, 1, 2, 3),
        (4, 5, 6, 7),
    )
    assert parse_replica_groups("mesh['node'=2,'local'=4] {'node'}", 8) == (
        (0, 4),
        (1, 5),
        (2, 6),
        (3, 7),
    )
    (everyone,) = parse_replica_groups("mesh['node'=2,'local'=4] {'node','local'}", 8)
    assert sorted(everyone) == list(range(8))
    # With device ids: iota(8) as 2 x 4, transposed, flattened = 0,4,1,5,2,6,3,7 at mesh
    # positions 0..7 of a 4 x 2 mesh; groups over 'b' are the mesh rows.
    text = "mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'b'}"
    assert parse_replica_groups(text, 8) == ((0, 4), (1, 5), (2, 6), (3, 7))


# ------------------------------------------------------------------- mesh axes


MESHES = [(2, 4), (4, 2), (1, 8), (8, 1)]
AXES = [("node",), ("local",), ("node", "local")]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("axes", AXES, ids="+".join)
def test_all_gather_axes_and_bytes(shape, axes):
    mesh = make(*shape)
    sizes = dict(zip(("node", "local"), shape, strict=True))
    fn = island(lambda x: lax.all_gather(x, axes, tiled=True), mesh)
    ledger = comm_ledger(fn, block_input(mesh))

    group = int(np.prod([sizes[a] for a in axes]))
    (rec,) = ledger.records
    assert rec.op == "all-gather" and rec.dtype == "float32" and rec.phase == "forward"
    assert rec.in_bytes == F32_BLOCK
    assert rec.out_bytes == F32_BLOCK * group
    assert rec.group_size == group
    assert rec.axes == tuple(a for a in axes if sizes[a] > 1)
    assert rec.cross_node == ("node" in axes and sizes["node"] > 1)
    # out * (G - 1) / G = block * (G - 1)
    assert ledger.total_bytes == F32_BLOCK * (group - 1)


@pytest.mark.parametrize(
    "order",
    [[1, 0, 3, 2, 5, 4, 7, 6], [0, 2, 4, 6, 1, 3, 5, 7]],
    ids=["pair-swapped", "interleaved"],
)
def test_permuted_device_order_maps_to_mesh_positions(order):
    """HLO device ids are positions in the mesh, not device ids.

    With the interleaved mesh, node 0 holds devices 0, 2, 4, 6; read as device ids, the
    `local` group {0,1,2,3} would span both nodes.
    """
    mesh = make(2, 4, order)
    x = block_input(mesh)
    for axes, cross in ((("local",), False), (("node",), True)):
        fn = island(lambda v, axes=axes: lax.all_gather(v, axes, tiled=True), mesh)
        (rec,) = comm_ledger(fn, x).records
        assert rec.axes == axes and rec.cross_node is cross

    # The runtime agrees: gathering over `local` collects the blocks of one mesh row.
    fn = island(lambda v: lax.all_gather(v, "local", tiled=True), mesh)
    out = np.asarray(fn(x)).reshape(2, 4, 4 * ROWS, COLS)  # [node, local] -> gathered rows
    blocks = np.asarray(x).reshape(2, 4 * ROWS, COLS)  # blocks in mesh order, per node
    for node in range(2):
        for local in range(4):
            np.testing.assert_array_equal(out[node, local], blocks[node])


def test_mesh_argument_must_match_the_arguments_device_order():
    mesh = make(2, 4)
    fn = island(lambda x: lax.all_gather(x, "local", tiled=True), mesh)
    with pytest.raises(ValueError, match="orders its devices differently"):
        comm_ledger(fn, block_input(mesh), mesh=make(2, 4, [0, 2, 4, 6, 1, 3, 5, 7]))


def test_no_mesh_raises():
    fn = jax.jit(lambda x: x + 1)
    with pytest.raises(ValueError, match="mesh="):
        comm_ledger(fn, np.ones(4))
    with pytest.raises(TypeError, match="jax.jit"):
        comm_ledger(lambda x: x, np.ones(4), mesh=make(2, 4))


# ------------------------------------------------------------- ops and dtypes


def test_each_collective_op_on_2x4():
    mesh = make(2, 4)

    def body(x):
        a = lax.psum_scatter(jnp.tile(x, (4, 1)), "local", tiled=True)  # in 4 blocks
        b = lax.all_to_all(x.astype(jnp.int8), "node", 0, 0, tiled=True)  # in 8 bytes
        c = lax.psum(x, ("node", "local"))
        d = lax.ppermute(x, "node", perm=[(0, 1), (1, 0)])
        e = lax.all_gather(x.astype(jnp.int8), "node", tiled=True)
        return a + b[:ROWS].astype(x.dtype) + c + d + e[:ROWS].astype(x.dtype)

    ledger = comm_ledger(island(body, mesh), block_input(mesh))
    i8_block = ROWS * COLS  # 8 bytes

    rs = only(ledger, op="reduce-scatter")
    assert (rs.in_bytes, rs.out_bytes, rs.axes, rs.cross_node) == (4 * 32, 32, ("local",), False)
    assert rs.bytes_sent == 4 * 32 * 3 / 4  # in * (G-1)/G, G = 4

    a2a = only(ledger, op="all-to-all")
    assert (a2a.dtype, a2a.in_bytes, a2a.axes, a2a.cross_node) == ("int8", 8, ("node",), True)
    assert a2a.bytes_sent == i8_block * 1 / 2

    ar = only(ledger, op="all-reduce")
    assert (ar.group_size, ar.axes, ar.cross_node) == (8, ("node", "local"), True)
    assert ar.bytes_sent == 2 * 32 * 7 / 8

    cp = only(ledger, op="collective-permute")
    assert (cp.axes, cp.cross_node, cp.bytes_sent) == (("node",), True, 32)

    ag = only(ledger, op="all-gather")
    assert (ag.dtype, ag.out_bytes, ag.bytes_sent) == ("int8", 2 * i8_block, i8_block)

    total = 96 + 4 + 56 + 32 + 8
    assert ledger.total_bytes == total
    assert ledger.intra_node_bytes == 96
    assert ledger.cross_node_bytes == total - 96

    # Through each node's link, per direction (gloo's algorithms, groups in id order):
    # the all-to-all's 4 devices send half their 8 bytes to the other node; the ring
    # all-reduce crosses on 1 edge each way (56 bytes); each permute pair sends 32; the
    # gathers over 'node' send 8 bytes per device; the reduce-scatter stays inside.
    per_op = {r.op: r.node_out_bytes for r in ledger.records}
    assert per_op == {
        "reduce-scatter": (0.0, 0.0),
        "all-to-all": (16.0, 16.0),
        "all-reduce": (56.0, 56.0),
        "collective-permute": (128.0, 128.0),
        "all-gather": (32.0, 32.0),
    }
    assert ledger.node_link_bytes().tolist() == [[232.0, 232.0], [232.0, 232.0]]
    assert ledger.link_bytes == 232
    assert ledger.link_bytes_by("cross_node") == {(False,): 0.0, (True,): 232.0}


def test_int8_gather_is_a_quarter_of_float32():
    mesh = make(2, 4)
    fn = island(lambda x: lax.all_gather(x, ("node", "local"), tiled=True), mesh)
    f32 = comm_ledger(fn, block_input(mesh))
    i8 = comm_ledger(fn, block_input(mesh, jnp.int8))
    assert f32.records[0].dtype == "float32" and i8.records[0].dtype == "int8"
    assert f32.total_bytes == 32 * 7 and i8.total_bytes == 8 * 7


# ------------------------------------------------------------------------- loops


def test_scan_multiplies_by_trip_count():
    mesh = make(2, 4)

    def body(x):
        def step(c, _):
            return lax.psum(c, "local"), None

        return lax.scan(step, x, None, length=5)[0]

    (rec,) = comm_ledger(island(body, mesh), block_input(mesh)).records
    assert rec.trip_count == 5
    assert rec.bytes_sent == 5 * 2 * 32 * 3 / 4


def test_nested_scans_multiply():
    mesh = make(2, 4)

    def body(x):
        def inner(c, _):
            return lax.all_gather(c, "node", tiled=True)[:ROWS] * 2, None

        def outer(c, _):
            return lax.scan(inner, c, None, length=3)[0], None

        return lax.scan(outer, x, None, length=5)[0]

    (rec,) = comm_ledger(island(body, mesh), block_input(mesh)).records
    assert rec.trip_count == 15
    assert rec.bytes_sent == 15 * 32  # out (64) * 1/2 per trip


def test_while_loop_uses_compiled_trip_count():
    """A counter stepping by 2 up to 8 is not scan-shaped; the compiled HLO knows n = 4."""
    mesh = make(2, 4)

    def body(x):
        return lax.while_loop(
            lambda c: c[0] < 8, lambda c: (c[0] + 2, lax.psum(c[1], "local")), (0, x)
        )[1]

    (rec,) = comm_ledger(island(body, mesh), block_input(mesh)).records
    assert rec.trip_count == 4


def test_data_dependent_loop_raises():
    mesh = make(2, 4)

    def body(x):
        return lax.while_loop(lambda c: c.sum() < 100.0, lambda c: lax.psum(c, "local"), x)

    with pytest.raises(ValueError, match="trip count is unknown"):
        comm_ledger(island(body, mesh), block_input(mesh))


# ------------------------------------------------------------------------- phases


def _loss_of(body, mesh):
    fn = jax.shard_map(body, mesh=mesh, in_specs=SHARDED, out_specs=SHARDED, check_vma=False)
    return jax.jit(jax.value_and_grad(lambda w: fn(w).sum()))


def test_grad_transpose_is_backward():
    mesh = make(2, 4)
    step = _loss_of(lambda w: jnp.sin(lax.all_gather(w, ("node", "local"), tiled=True)), mesh)
    ledger = comm_ledger(step, block_input(mesh))
    assert ledger.bytes_by("phase", "op") == {
        ("forward", "all-gather"): 32 * 8 * 7 / 8,  # out 256 bytes
        ("backward", "reduce-scatter"): 32 * 8 * 7 / 8,  # in 256 bytes
    }


def test_custom_vjp_backward_rule_is_backward():
    mesh = make(2, 4)

    @jax.custom_vjp
    def gather(w):
        return lax.all_gather(w, "node", tiled=True)

    def bwd(_, ct):
        q = lax.all_to_all(ct.astype(jnp.int8), "node", 0, 0, tiled=True)
        return (q.astype(jnp.float32).reshape(2, ROWS, COLS).sum(0),)

    gather.defvjp(lambda w: (gather(w), None), bwd)
    step = _loss_of(lambda w: jnp.sin(gather(w))[:ROWS], mesh)
    ledger = comm_ledger(step, block_input(mesh))
    assert ledger.bytes_by("phase", "op", "dtype", "axes") == {
        ("forward", "all-gather", "float32", ("node",)): 64 / 2,
        ("backward", "all-to-all", "int8", ("node",)): 16 / 2,  # ct: 4 x 4 int8
    }


def test_remat_recomputation_is_backward():
    mesh = make(2, 4)
    gather = jax.checkpoint(lambda w: jnp.sin(lax.all_gather(w, "local", tiled=True)))
    ledger = comm_ledger(_loss_of(lambda w: gather(w)[:ROWS], mesh), block_input(mesh))
    gathers = sorted((r.phase, r.op_name) for r in ledger.records if r.op == "all-gather")
    assert [p for p, _ in gathers] == ["backward", "forward"]
    assert "rematted_computation" in gathers[0][1]
    assert ledger.bytes_by("phase") == {
        ("forward",): 128 * 3 / 4,  # gather out 4 blocks
        ("backward",): 128 * 3 / 4 + 128 * 3 / 4,  # re-gather + reduce-scatter in 4 blocks
    }


def test_grad_inside_the_island():
    mesh = make(2, 4)

    def body(x):
        return jax.grad(lambda w: jnp.sin(lax.all_gather(w, "node", tiled=True)).sum())(x)

    ledger = comm_ledger(island(body, mesh), block_input(mesh))
    assert ledger.bytes_by("phase", "op") == {
        ("forward", "all-gather"): 32.0,
        ("backward", "reduce-scatter"): 32.0,
    }


# ------------------------------------------------ hand-written HLO: variadic, async, calls

FAKE_HLO = """\
HloModule fake

region_add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

body {
  q = f32[4,4]{1,0} parameter(0)
  ROOT r = f32[4,4]{1,0} all-reduce(q), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, \
use_global_device_ids=true, to_apply=region_add, metadata={op_name="psum"}
}

ENTRY main {
  p0 = s8[8,4]{1,0} parameter(0)
  p1 = f32[8,4]{1,0} parameter(1)
  p2 = f32[4,4]{1,0} parameter(2)
  a2a = (s8[8,4]{1,0}, f32[8,4]{1,0}) all-to-all(p0, p1), channel_id=1, \
replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, metadata={op_name="jit(s)/transpose(jvp())/a2a"}
  ags = (s8[8,4]{1,0}, s8[32,4]{1,0}) all-gather-start(p0), channel_id=2, \
replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, \
metadata={op_name="jit(s)/jvp()/ag"}
  agd = s8[32,4]{1,0} all-gather-done(ags)
  s4 = f32[4]{0} slice(p1), slice={[0:4]}
  arm = f32[4]{0} all-reduce(s4), channel_id=4, replica_groups=mesh['node'=2,'local'=4] {'node'}, \
use_global_device_ids=true, to_apply=region_add, metadata={op_name="jit(s)/jvp()/mean"}
  c1 = f32[4,4]{1,0} call(p2), to_apply=body, metadata={op_name="jit(s)/jvp()/shard_map"}
  c2 = f32[4,4]{1,0} call(c1), to_apply=body, metadata={op_name="jit(s)/transpose(jvp())/shard_map"}
  ROOT t = (s8[32,4]{1,0}, f32[4,4]{1,0}) tuple(agd, c2)
}
"""


class _FakeLowered:
    def as_text(self, dialect: str = "stablehlo", debug_info: bool = False) -> str:
        assert dialect == "hlo" and debug_info
        return FAKE_HLO


class _FakeStep:
    def lower(self, *args, **kwargs):
        return _FakeLowered()


@dataclasses.dataclass
class _State:
    param_count: int


def test_variadic_async_and_shared_bodies_from_hlo_text():
    ledger = comm_ledger(_FakeStep(), _State(param_count=64), mesh=make(2, 4))
    assert ledger.param_count == 64 and ledger.model_bytes == 128
    # Variadic all-to-all over `node` (iota groups = mesh columns): one record per dtype.
    assert only(ledger, op="all-to-all", dtype="int8").bytes_sent == 32 / 2
    assert only(ledger, op="all-to-all", dtype="float32").bytes_sent == 128 / 2
    assert only(ledger, op="all-to-all", dtype="int8").axes == ("node",)
    assert only(ledger, op="all-to-all", dtype="int8").phase == "backward"
    # all-gather-start over `local` (iota groups = mesh rows): out 128 bytes, G = 4.
    ag = only(ledger, op="all-gather")
    assert (ag.out_bytes, ag.axes, ag.cross_node, ag.phase) == (128, ("local",), False, "forward")
    assert ag.bytes_sent == 128 * 3 / 4
    # One body, two call sites: counted twice, phase from each call chain.
    assert ledger.bytes_by("op", "phase")[("all-reduce", "forward")] == 2 * 64 * 7 / 8 + 16
    assert ledger.bytes_by("op", "phase")[("all-reduce", "backward")] == 2 * 64 * 7 / 8
    # Mesh-axes replica groups (as in compiled HLO) over `node`: 2 * 16 * 1/2.
    arm = only(ledger, op="all-reduce", op_name="jit(s)/jvp()/mean")
    assert (arm.axes, arm.cross_node, arm.bytes_sent) == (("node",), True, 16)
    total = 16 + 64 + 96 + 2 * 112 + 16
    assert ledger.total_bytes == total
    assert ledger.in_units_of_M(ledger.total_bytes) == total / 128


# ------------------------------------------------------------------ ledger object


def _record(op, axes, cross, phase, in_bytes, out_bytes, group, trips=1, dtype="int8"):
    return CollectiveRecord(
        op=op,
        dtype=dtype,
        in_bytes=in_bytes,
        out_bytes=out_bytes,
        group_size=group,
        axes=axes,
        cross_node=cross,
        phase=phase,
        trip_count=trips,
    )


def test_ledger_sums_and_markdown():
    records = (
        _record("all-gather", ("node",), True, "forward", 100, 200, 2),  # 100
        _record("all-gather", ("local",), False, "backward", 100, 400, 4, trips=2),  # 600
        _record("reduce-scatter", ("local",), False, "backward", 400, 100, 4),  # 300
        _record("all-to-all", ("node",), True, "backward", 40, 40, 2, dtype="uint8"),  # 20
    )
    ledger = CommLedger(records=records, param_count=500)  # M = 1000 bytes
    assert ledger.total_bytes == 1020
    assert ledger.cross_node_bytes == 120
    assert ledger.intra_node_bytes == 900
    assert ledger.bytes_by("phase") == {("forward",): 100, ("backward",): 920}
    assert ledger.bytes_by("op", "axes")[("all-gather", ("local",))] == 600
    assert ledger.in_units_of_M(ledger.cross_node_bytes) == 120 / 1000
    with pytest.raises(ValueError, match="unknown key"):
        ledger.bytes_by("colour")

    table = ledger.to_markdown()
    head = [cell.strip() for cell in table.splitlines()[0].split("|")[-5:-1]]
    assert head == ["bytes/device", "M", "bytes/link", "M (link)"]
    # These records carry no per-node bytes: their link columns are zero.
    assert "| forward | all-gather | node | int8 | yes | 100 | 0.1000 | 0 | 0.0000 |" in table
    assert "| backward | all-gather | local | int8 | no | 600 | 0.6000 | 0 | 0.0000 |" in table
    assert "| **total** |  |  |  |  | 1,020 | 1.0200 | 0 | 0.0000 |" in table
    assert "| **cross-node** |  |  |  |  | 120 | 0.1200 |  |  |" in table

    no_m = CommLedger(records=records)
    assert no_m.model_bytes is None
    assert "M" not in no_m.to_markdown().splitlines()[0].split("|")[-2]
    with pytest.raises(ValueError, match="param_count"):
        no_m.in_units_of_M(1.0)


# ------------------------------------------------------- parts of a real training step


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jnp.tanh(nn.Dense(37)(x)))


def _step_ledger(config: zpp.ZeroPPConfig) -> CommLedger:
    """The ledger of one adam step of a small MLP on a 2 x 4 mesh."""

    def train_step(state, b):
        def loss(p):
            return jnp.mean((state.apply_fn({"params": p}, b["x"]) - b["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {"loss": value}

    mesh = zpp.make_mesh(2, 4)
    x = np.ones((16, 11), np.float32)
    params = _Net().init(jax.random.key(0), x)["params"]
    state = zpp.TrainState.create(
        apply_fn=_Net().apply, params=params, tx=optax.adam(1e-3), mesh=mesh, config=config
    )
    step = zpp.shard(train_step, mesh=mesh, config=config)
    return comm_ledger(step, state, {"x": x, "y": x[:, :3]})


def test_part_of_each_collective_of_a_training_step():
    zeropp = _step_ledger(zpp.ZeroPPConfig())
    # qwZ and hpZ: forward gathers, backward gathers inside the node; qgZ: all-to-alls.
    assert {(r.op, r.phase, r.part) for r in zeropp.records} == {
        ("all-gather", "forward", "fwd_gather"),
        ("all-gather", "backward", "bwd_gather"),
        ("all-to-all", "backward", "grad_reduce"),
    }
    assert {r.part for r in zeropp.records if r.cross_node} == {"fwd_gather", "grad_reduce"}
    by_part = zeropp.bytes_by("part")
    assert set(by_part) == {("fwd_gather",), ("bwd_gather",), ("grad_reduce",)}
    assert sum(by_part.values()) == zeropp.total_bytes

    # ZeRO-3 reduces gradients with a ring of collective-permutes.
    zero3 = _step_ledger(zpp.ZeroPPConfig.zero3())
    assert {(r.op, r.phase, r.part) for r in zero3.records} == {
        ("all-gather", "forward", "fwd_gather"),
        ("all-gather", "backward", "bwd_gather"),
        ("collective-permute", "backward", "grad_reduce"),
    }


def test_zero3_gradients_as_one_reduce_scatter():
    # grad_reduce="auto" is the ring on CPU devices; "reduce_scatter" is what NCCL runs:
    # the same bytes per device, in one bfloat16 collective.
    ring = _step_ledger(zpp.ZeroPPConfig.zero3())
    rs = _step_ledger(zpp.ZeroPPConfig.zero3(grad_reduce="reduce_scatter"))
    grads = {(r.op, r.dtype) for r in rs.records if r.part == "grad_reduce"}
    assert grads == {("reduce-scatter", "bfloat16")}
    assert {r.op for r in ring.records if r.part == "grad_reduce"} == {"collective-permute"}
    assert rs.bytes_by("part")[("grad_reduce",)] == ring.bytes_by("part")[("grad_reduce",)]


@pytest.mark.parametrize(
    "op,phase,part",
    [
        ("all-gather", "forward", "fwd_gather"),
        ("all-gather", "backward", "bwd_gather"),
        ("reduce-scatter", "backward", "grad_reduce"),
        ("all-to-all", "backward", "grad_reduce"),
        ("collective-permute", "backward", "grad_reduce"),
        ("reduce-scatter", "forward", "other"),
        ("all-to-all", "forward", "other"),
        ("collective-permute", "forward", "other"),
        ("all-reduce", "forward", "other"),
        ("all-reduce", "backward", "grad_reduce"),
    ],
)
def test_part_rule(op, phase, part):
    assert _record(op, ("node",), True, phase, 8, 8, 2).part == part


@pytest.mark.parametrize(
    "config",
    [
        zpp.ZeroPPConfig(),
        zpp.ZeroPPConfig.zero3(),  # its ring reduce-scatter is a loop: compiled trip counts
        zpp.ZeroPPConfig(weight_delta_bits=4, error_feedback="all"),
    ],
    ids=["zeropp", "zero3", "delta4_feedback"],
)
def test_the_compiled_program_runs_what_the_ledger_counts(config):
    """XLA's optimised program of the trainer's GPT step sends exactly the lowered ledger's
    bytes, per (op, dtype, phase, axes, part), plus only the scalar all-reduces that the
    SPMD partitioner adds outside the island: the loss, and the finite-gradient check's
    one float32 per parameter leaf (its largest magnitude)."""
    import test_engine_gpt as gpt

    mesh = zpp.make_mesh(2, 4)
    state = gpt.make_state(config, mesh, optax.adamw(1e-3))
    step = zpp.shard(gpt.train_step, mesh=mesh, config=config)

    keys = ("op", "dtype", "phase", "axes", "part")
    lowered = comm_ledger(step, state, gpt.batch(0)).bytes_by(*keys)
    compiled = comm_ledger(step, state, gpt.batch(0), compiled=True).bytes_by(*keys)
    for key, nbytes in lowered.items():
        assert compiled.get(key) == nbytes, key
    extra = {k: v for k, v in compiled.items() if k not in lowered}
    assert {(op, part) for op, _, _, _, part in extra} == {("all-reduce", "other")}
    scalars = len(jax.tree_util.tree_leaves(state.params)) + 1  # per leaf, and the loss
    assert sum(extra.values()) <= 2 * 4 * scalars  # all-reduce: 2 x bytes; ~250 KB beside
