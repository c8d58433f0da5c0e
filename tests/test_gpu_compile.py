"""Reading GPU programs compiled without a GPU (`experiments/gpu_compile.py`, which
compiles them, and `experiments/gpu_program.py`, which reads them and keeps the table).

Two kinds of tests:

* on saved programs (`tests/data/gpu_*.hlo.gz`: the trainer GPT's ZeRO++ and XLA FSDP
  steps compiled for 2 x 4 H200s with the flags of `docs/gpu_cluster.md` by the runs of
  the results table (`experiments/results/gpu_compile/gpu_compile.md`, its `code` column), cut by
  `gpu_program.minimal_hlo`) and on a hand-written scheduled module: what
  `hlo_text.scheduled_collectives` reads, and that the saved programs keep what the
  results table claims. These run everywhere.
* compiling for the GPU, which needs the CUDA plugin of the installed jaxlib (the
  `gpu-compile` extra: 0.12.0.1 on Python >= 3.12, 0.10.2 on 3.11; not installed by
  `.ci/run`, installed by `.ci/gpu_compile_test`): skipped where it is missing. One
  compiles the trainer's scanned GPT's ZeRO++ step for 2 x 4 H200s, one a Pallas kernel.
"""

import argparse
import gzip
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import _gpu_target as gpu_target  # noqa: E402
import gpu_compile  # noqa: E402
import gpu_program  # noqa: E402

import zeropp_jax as zpp  # noqa: E402
from zeropp_jax.measure import _hlo_text as hlo_text  # noqa: E402
from zeropp_jax.measure._phases import phase_of  # noqa: E402
from zeropp_jax.state._partition import BATCH_SPEC  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parent / "data"
HAS_PLUGIN = importlib.util.find_spec("jax_plugins") is not None and (
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
)
needs_plugin = pytest.mark.skipif(
    not HAS_PLUGIN,
    reason="needs the CUDA plugin of the installed jaxlib (pip install -e '.[gpu-compile]'; "
    ".ci/gpu_compile_test), not installed by .ci/run",
)

SCHEDULED = """\
HloModule m, is_scheduled=true

%fused_dot (p0: bf16[4,4], p1: bf16[4,4]) -> bf16[4,4] {
  %p0 = bf16[4,4]{1,0} parameter(0)
  %p1 = bf16[4,4]{1,0} parameter(1)
  ROOT %dot = bf16[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_neg (q0: bf16[4,4]) -> bf16[4,4] {
  %q0 = bf16[4,4]{1,0} parameter(0)
  ROOT %neg = bf16[4,4]{1,0} negate(%q0)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%rs_computation (x: f32[8]) -> f32[4] {
  %x = f32[8]{0} parameter(0)
  ROOT %reduce-scatter = f32[4]{0} reduce-scatter(%x), replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}

ENTRY %main (w: s8[2,256], x: bf16[4,4], g: f32[8]) -> (s8[4,256], s8[4,256], s8[4,256], f32[4]) {
  %w = s8[2,256]{1,0} parameter(0)
  %x = bf16[4,4]{1,0} parameter(1)
  %g = f32[8]{0} parameter(2)
  %ag0 = (s8[2,256]{1,0}, s8[4,256]{1,0}) all-gather-start(%w), replica_groups={{0,1}}, dimensions={0}, metadata={op_name="jit(f)/transpose(jvp())/all_gather"}, backend_config={"collective_backend_config":{"is_sync":false}}
  %mm = bf16[4,4]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot
  %agd0 = s8[4,256]{1,0} all-gather-done(%ag0)
  %ag1 = (s8[2,256]{1,0}, s8[4,256]{1,0}) all-gather-start(%w), replica_groups={{0,1}}, dimensions={0}, backend_config={"collective_backend_config":{"is_sync":false}}
  %bc = bf16[4,4]{1,0} bitcast(%x)
  %agd1 = s8[4,256]{1,0} all-gather-done(%ag1)
  %ag2 = (s8[2,256]{1,0}, s8[4,256]{1,0}) all-gather-start(%w), replica_groups={{0,1}}, dimensions={0}, backend_config={"collective_backend_config":{"is_sync":true}}
  %n0 = bf16[4,4]{1,0} fusion(%x), kind=kLoop, calls=%fused_neg
  %agd2 = s8[4,256]{1,0} all-gather-done(%ag2)
  %rss = ((f32[8]{0}), f32[4]{0}) async-start(%g), calls=%rs_computation
  %rsu = ((f32[8]{0}), f32[4]{0}) async-update(%rss)
  %n1 = bf16[4,4]{1,0} fusion(%mm), kind=kLoop, calls=%fused_neg
  %rsd = f32[4]{0} async-done(%rsu)
  %ar = f32[4]{0} all-reduce(%rsd), replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s8[4,256]{1,0}, s8[4,256]{1,0}, s8[4,256]{1,0}, f32[4]{0}) tuple(%agd0, %agd1, %agd2, %ar)
}
"""  # noqa: E501


def test_scheduled_collectives_read_what_runs_between_start_and_done():
    got = hlo_text.scheduled_collectives(hlo_text.parse_hlo_module(SCHEDULED))
    summary = [(c.op, c.asynchronous, c.dtypes, c.between, c.matmuls) for c in got]
    assert summary == [
        ("all-gather", True, ("int8",), ("mm",), 1),  # a GEMM fusion in between
        ("all-gather", True, ("int8",), (), 0),  # only a bitcast: nothing to overlap
        ("all-gather", False, ("int8",), (), 0),  # is_sync: XLA runs it in line
        ("reduce-scatter", True, ("float32",), ("n1",), 0),  # async-start around it
        ("all-reduce", False, ("float32",), (), 0),
    ]
    assert [c.overlapped for c in got] == [True, False, False, True, False]
    assert got[0].op_name.endswith("transpose(jvp())/all_gather")
    assert got[3].replica_groups == "{{0,1}}"


def test_most_in_flight_counts_collectives_started_and_not_done():
    module = hlo_text.parse_hlo_module(SCHEDULED)
    assert gpu_program.most_in_flight(module, hlo_text.scheduled_collectives(module)) == 1
    agd0 = "  %agd0 = s8[4,256]{1,0} all-gather-done(%ag0)\n"
    agd1 = "  %agd1 = s8[4,256]{1,0} all-gather-done(%ag1)\n"
    both = hlo_text.parse_hlo_module(SCHEDULED.replace(agd0, "").replace(agd1, agd1 + agd0))
    assert gpu_program.most_in_flight(both, hlo_text.scheduled_collectives(both)) == 2


def test_scheduled_collectives_refuse_a_start_without_its_done():
    text = SCHEDULED.replace("  %agd1 = s8[4,256]{1,0} all-gather-done(%ag1)\n", "")
    with pytest.raises(ValueError, match="'ag1' in 'main' has no 'all-gather-done'"):
        hlo_text.scheduled_collectives(hlo_text.parse_hlo_module(text))


def test_minimal_hlo_keeps_the_schedule_and_drops_the_rest():
    text = SCHEDULED + '\nFileNames\n1 "model.py"\n'
    cut = gpu_program.minimal_hlo(text)
    assert "%fused_dot (" not in cut and "FileNames" not in cut
    assert "%rs_computation (" in cut  # an async computation, not a fusion's
    read = hlo_text.scheduled_collectives(hlo_text.parse_hlo_module(cut))
    full = hlo_text.scheduled_collectives(hlo_text.parse_hlo_module(text))
    assert [(c.name, c.between, c.op_name) for c in read] == [
        (c.name, c.between, c.op_name) for c in full
    ]
    assert [c.matmuls for c in read] == [0] * 5  # the fused dot's body is gone, so only
    # the name says GEMM; the saved programs' GEMM fusions are named so by XLA


def _saved(name: str) -> hlo_text.HloModule:
    return hlo_text.parse_hlo_module(gzip.decompress((DATA / name).read_bytes()).decode())


def _places(module) -> dict[str, str]:
    """`{collective name: 'forward' / 'backward', + ' loop' inside a loop body}`."""
    bodies, paths = hlo_text.loop_bodies(module), hlo_text.call_paths(module)
    out = {}
    for c in hlo_text.scheduled_collectives(module):
        chain = paths.get(c.computation) or [()]
        phase = phase_of([call.op_name for call, _ in chain[0]] + [c.op_name])
        out[c.name] = phase + (" loop" if c.computation in bodies else "")
    return out


@pytest.fixture(scope="module")
def zeropp_program():
    return _saved("gpu_zeropp_gpt_2x4_docs.hlo.gz")


def test_zeropp_on_h200s_gathers_8_bit_asynchronously_overlapped_in_both_loops(zeropp_program):
    """The goal of the GPU schedule: in the scanned layers' forward and backward loops,
    every weight gather is asynchronous with compute between its start and its done."""
    module = zeropp_program
    gathers = [c for c in hlo_text.scheduled_collectives(module) if c.op == "all-gather"]
    assert all(g.dtypes == ("int8", "float32") for g in gathers)  # payload, block scales
    in_loops = {"forward loop": [], "backward loop": []}
    places = _places(module)
    for g in gathers:
        in_loops.get(places[g.name], []).append(g)
    for place, found in in_loops.items():
        assert found, place
        assert all(g.asynchronous and g.overlapped for g in found), place
    assert len(hlo_text.loop_bodies(module)) == 2  # the forward and the backward loop
    # XLA's GPU schedule runs one collective at a time: none outside the loops can stay in
    # flight across a loop that communicates (why those gathers are not overlapped)
    assert gpu_program.most_in_flight(module, hlo_text.scheduled_collectives(module)) == 1


def test_zeropp_on_h200s_sends_what_the_ledger_says(zeropp_program):
    """The compiled GPU program's collectives, read by the ledger (NCCL's rings), move the
    bytes the lowered step's ledger counts, through each node's link and per dtype: the
    cross-node gradient hop stays packed 4-bit (uint8), the gathers 8-bit."""
    from zeropp_jax.train.cli import make_optimizer, train_step
    from zeropp_jax.train.flags import gpt_config, parse_args
    from zeropp_jax.train.model import GPT, init_fn

    mesh = zpp.make_mesh(2, 4)
    args = parse_args(gpu_target.model_args("gpt", 8))
    gpt = gpt_config(args)
    state = zpp.TrainState.abstract(
        apply_fn=GPT(gpt).apply,
        params=init_fn(gpt, 0),
        tx=make_optimizer(args),
        mesh=mesh,
        config=zpp.ZeroPPConfig(),
    )
    sharding = jax.sharding.NamedSharding(mesh, BATCH_SPEC)
    batch = jax.ShapeDtypeStruct((args.batch, gpt.seq_len + 1), jnp.int32, sharding=sharding)
    asked = zpp.comm_ledger(zpp.shard(train_step), state, batch, links="nccl")
    text = gzip.decompress((DATA / "gpu_zeropp_gpt_2x4_docs.hlo.gz").read_bytes()).decode()
    gpu = zpp.comm_ledger(
        gpu_program.Precompiled(_Text(text)), state, batch, compiled=True, links="nccl"
    )
    assert gpu_program.same_bytes(gpu, asked)
    node_hop = {r.dtype for r in gpu.records if r.op == "all-to-all" and r.axes == ("node",)}
    assert node_hop == {"uint8", "float32"}
    assert gpu.link_bytes == pytest.approx(asked.link_bytes, rel=1e-3)


class _Text:
    def __init__(self, text: str) -> None:
        self.text = text

    def as_text(self) -> str:
        return self.text


def test_xla_fsdp_on_h200s_gathers_its_weight_matrices_in_bfloat16():
    """XLA's GPU compiler moves the cast to the compute dtype before the gather
    (`CollectiveQuantizer`): every gathered matrix travels in bfloat16; only vectors
    (LayerNorm scales and biases, kept float32 by the model) may travel wider."""
    module = _saved("gpu_xla_fsdp_gpt_2x4_docs.hlo.gz")
    gathers = [c for c in hlo_text.scheduled_collectives(module) if c.op == "all-gather"]
    assert gathers
    for g in gathers:
        for shape in g.shapes:
            for dtype, _ in hlo_text.array_shapes(shape):
                dims = shape[shape.index("[") + 1 : shape.index("]")].split(",")
                if sum(int(d) > 1 for d in dims if d) >= 2:
                    assert dtype == "bfloat16", (g.name, shape)


def test_rows_are_picked_one_by_one_and_merged_per_gpu():
    """`--rows` names single rows; a row compiled for the H100 sits beside the H200's of the
    same key, and rows written before the `gpu` column count as the H200's."""
    args = argparse.Namespace(rows="ZeRO++/gpt/2x8/docs,ZeRO++/gpt/2x8/none")
    assert gpu_compile.selected(args) == [("2x8", "gpt", "ZeRO++", ["docs", "none"])]
    with pytest.raises(SystemExit, match="not engine/model/mesh/flags"):
        gpu_compile.selected(argparse.Namespace(rows="ZeRO++/gpt/2x8"))
    options = gpu_target.compiler_options("docs+xla_gpu_x=2+xla_gpu_y=false", 1000)
    assert options["xla_gpu_x"] == 2 and options["xla_gpu_y"] is False
    assert options["xla_gpu_all_gather_combine_threshold_bytes"] == 1000
    assert gpu_target.compiler_options("none", 1000) == {}
    with pytest.raises(SystemExit, match="is not 'xla_<name>=<value>'"):
        gpu_target.compiler_options("docs+overlap", 1000)
    row = {"engine": "ZeRO++", "model": "gpt", "mesh": "2x4", "flags": "docs"}
    old = [{**row, "gathers": "18"}]  # no gpu column
    new = [{**row, "gpu": "h100", "gathers": "17"}, {**row, "gpu": "h200", "gathers": "19"}]
    got = gpu_program.merged(old, new)
    assert [(r["gpu"], r["gathers"]) for r in got] == [("h200", "19"), ("h100", "17")]


def test_goals_read_the_loops_of_a_row():
    row = {"engine": "ZeRO++", "model": "gpt", "mesh": "2x8", "flags": "docs", "gpu": "h200"}
    met = {**row, "gathers_by_place": "bwd 2/2/4; bwd loop 2/2/2; fwd loop 5/4/5"}
    missed = {**row, "gathers_by_place": "bwd loop 2/1/2; fwd loop 4/4/4"}
    lines = gpu_program.goals([met, missed]).splitlines()
    assert ": met; fwd loop: 5 of 5 asynchronous, 4 overlapped" in lines[0]
    assert "outside the loops (not part of the goal): 2 of 4 overlapped" in lines[0]
    assert ": NOT met; " in lines[1]  # 1 of the backward loop's 2 overlapped: 50%


# ----------------------------------------------------------- with the CUDA plugin only


@needs_plugin
def test_kernels_compile_for_sm90():
    import pallas_kernels as pk

    mesh = gpu_target.gpu_mesh("h200", 1, 1)
    assert mesh.devices.flat[0].compute_capability == "9.0"
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=one)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the target, for Triton
        compiled = jax.jit(lambda x: pk.quantize_blocks(x, bits=8)).lower(x).compile()
    assert '"__gpu$xla.gpu.triton"' in compiled.as_text()


@needs_plugin
def test_zeropp_step_compiles_with_asynchronous_8_bit_gathers():
    """The trainer's scanned GPT's ZeRO++ step, compiled here for 2 x 4 H200s with the
    docs' flags (under the names this jaxlib takes), keeps what the saved program shows:
    both scanned loops, every gather in them asynchronous, every gather 8-bit, the 4-bit
    gradient hop across nodes. (At width 32 on 2 x 2 GPUs one backward-loop gather is
    synchronous: too little compute to put beside it.)"""
    mesh = gpu_target.gpu_mesh("h200", 2, 4)
    step = gpu_target.build_step("ZeRO++", "gpt", mesh)
    lowered = step.fn.lower(step.state, step.batch)
    options = gpu_target.compiler_options("docs", step.layer_bytes)
    compiled, _ = gpu_target.compile_for(lowered, options)
    module = hlo_text.parse_hlo_module(compiled.as_text())
    assert len(hlo_text.loop_bodies(module)) == 2  # the forward and the backward loop
    collectives = hlo_text.scheduled_collectives(module)
    gathers = [c for c in collectives if c.op == "all-gather"]
    in_loops = [g for g in gathers if g.computation in hlo_text.loop_bodies(module)]
    assert in_loops and all(g.asynchronous for g in in_loops)
    assert all("int8" in g.dtypes for g in gathers)
    program = gpu_program.read_program(compiled, mesh)
    assert "all-to-all/node: float32,uint8" in program["wire_dtypes"]


@needs_plugin
def test_engine_programs_on_one_h200_run_xla_fsdps_gemms_and_no_codec():
    """Issue #50's test on the compiled GPU program (`experiments/gpu_overhead.py`'s
    reading), for the trainer's tiny GPT unscanned on one H200: ZeRO-3's and ZeRO++'s
    programs run exactly XLA FSDP's GEMM flops (no use's forward run again in its
    backward: the tied head's was), ZeRO++ on one device runs no quantization kernel
    (nothing is sent there), and no weight's use runs a one-element kernel (on a GPU
    `dataflow.tie` is an optimization barrier; its `-0.0` kernels were 146 of the 125M
    step's launches), and the non-finite check of the gradients ends in one reduction,
    not one scalar kernel per leaf (`finite.all_finite(join=True)`; 14 of them in this
    step without the barrier, 52 in the 125M step)."""
    import warnings

    import gpu_overhead

    from zeropp_jax._choices import NothingSentWarning

    mesh = gpu_target.gpu_mesh("h200", 1, 1)
    argv = ["--batch", "2", "--seq-len", "64", "--no-scan-layers"]
    per = {}
    for engine in ("XLA FSDP", "ZeRO-3", "ZeRO++"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NothingSentWarning)
            fn, state, batch = gpu_overhead.build_step(engine, mesh, argv)
            per[engine] = gpu_overhead.kernels(fn.lower(state, batch).compile().as_text())
    flops = {e: sum(k.flops * k.launches for k in ks) for e, ks in per.items()}
    assert flops["XLA FSDP"] > 0
    assert flops["ZeRO-3"] == flops["ZeRO++"] == flops["XLA FSDP"], flops
    assert not [k.name for k in per["ZeRO++"] if k.kind == "pallas"]
    for engine in ("ZeRO-3", "ZeRO++"):
        ties = [
            k.name
            for k in per[engine]
            if gpu_overhead.origin_of(k) == "weights" and gpu_overhead.is_scalar(k)
        ]
        assert not ties, (engine, ties)
        checks = [k for k in per[engine] if gpu_overhead.origin_of(k) == "finite"]
        scalar = [k.name for k in checks if gpu_overhead.is_scalar(k)]
        assert checks and len(scalar) == 1, (engine, scalar)


@needs_plugin
def test_zero3_on_h200s_gathers_each_remat_block_weight_once_in_the_backward():
    """In a program for GPUs a use inside a remat block keeps the weights its recompute
    gathered for its backward (`Gathers.hold_recomputed`): the trainer's GPT unscanned
    under `--remat full` gathers no more in the backward than in the forward (the CPU
    form gathers each of those weights twice there)."""
    import warnings

    import gpu_overhead

    import zeropp_jax as zpp

    mesh = gpu_target.gpu_mesh("h200", 2, 4)
    argv = ["--batch", "8", "--seq-len", "64", "--no-scan-layers", "--remat", "full"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn, state, batch = gpu_overhead.build_step("ZeRO-3", mesh, argv)
        ledger = zpp.comm_ledger(fn, state, batch)
    gathers = {p: b for (op, p), b in ledger.bytes_by("op", "phase").items() if op == "all-gather"}
    assert 0 < gathers["backward"] <= gathers["forward"], gathers


class _Lowered:
    """Stands in for `jax.stages.Lowered`: refuses options named in `refused`."""

    def __init__(self, refused: set[str]) -> None:
        self.refused, self.calls = refused, []

    def compile(self, compiler_options):
        self.calls.append(dict(compiler_options))
        for name in compiler_options:
            if name in self.refused:
                raise RuntimeError(f"INVALID_ARGUMENT: No such compile option: '{name}'")
        return "compiled"


def test_compile_for_passes_the_renamed_pipelining_options_where_the_old_are_gone():
    options = gpu_target.compiler_options("docs", 1000)
    old = _Lowered(refused=set())  # jaxlib 0.10.2: the docs' names
    assert gpu_target.compile_for(old, options) == ("compiled", options)
    new = _Lowered(refused=set(gpu_target.RENAMED))  # jaxlib 0.12.0.1
    compiled, used = gpu_target.compile_for(new, options)
    assert compiled == "compiled" and len(new.calls) == 2
    assert used["xla_gpu_pipeline_all_gather"] == "COLLECTIVE_PIPELINING_MODE_ON"
    assert not set(gpu_target.RENAMED) & set(used)
    assert used["xla_gpu_all_gather_combine_threshold_bytes"] == 1000
    assert gpu_target.renamed({"xla_gpu_enable_pipelined_all_reduce": False}) == {
        "xla_gpu_pipeline_all_reduce": "COLLECTIVE_PIPELINING_MODE_OFF"
    }
    other = _Lowered(refused={"xla_gpu_enable_latency_hiding_scheduler"})
    with pytest.raises(RuntimeError, match="latency_hiding"):  # not a rename: raised
        gpu_target.compile_for(other, options)


def test_rows_of_another_jax_stay_beside_the_new_ones():
    """`--merge` replaces a row of the same key and jax only: the rows of jax 0.10.2
    (written before the `jax` column) stay, each key's rows together, oldest first."""
    row = {"engine": "ZeRO++", "model": "gpt", "mesh": "2x4", "flags": "docs", "gpu": "h200"}
    fsdp = {**row, "engine": "XLA FSDP"}
    old = [{**fsdp, "gathers": "11", "code": "a"}, {**row, "gathers": "18", "code": "a"}]
    new_jax = "0.12.0.1, plugin 0.12.0.1"
    new = [{**row, "jax": new_jax, "gathers": "17", "code": "b"}]
    got = gpu_compile.merged_by_jax(old, new)
    assert [(r["engine"], r["jax"], r["gathers"]) for r in got] == [
        ("ZeRO++", gpu_compile.OLD_JAX, "18"),
        ("ZeRO++", new_jax, "17"),
        ("XLA FSDP", gpu_compile.OLD_JAX, "11"),
    ]
    assert list(got[0])[:6] == [*gpu_program.KEY, "jax"]
    again = gpu_compile.merged_by_jax(got, [{**new[0], "gathers": "16"}])
    assert [r["gathers"] for r in again] == ["18", "16", "11"]
