"""The experiment scripts' code paths at tiny sizes (so they do not rot).

Each script's `main` runs into a temporary folder; the ledgers of the tiny GPT are shared
between the volume-table and projection tests (one ledger per config).
"""

import csv
import functools
import math
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import error_compounding as ec  # noqa: E402
import projection as pj  # noqa: E402
import volume_table as vt  # noqa: E402

from zeropp_jax.wire import quant  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def shared_ledgers():
    original = vt.step_ledger
    vt.step_ledger = functools.cache(original)
    yield
    vt.step_ledger = original


def test_volume_table_tiny(tmp_path):
    rows = vt.main(["--runs", "32x1@2x4", "--variants", "ZeRO-3,ZeRO++", "--out", str(tmp_path)])
    by = {r["variant"]: r for r in rows}
    z3, zpp_ = by["ZeRO-3"], by["ZeRO++"]
    # ZeRO-3: three flat collectives over 8 devices, all cross-node: the forward gather and
    # the gradient reduction move 7/8 M per device; the backward re-gathers only what the
    # gradients need (every matrix and norm scale; not the biases or the position table).
    for part in ("fwd_gather", "bwd_gather", "grad_reduce"):
        assert z3[f"{part}_intra"] == 0
    for part in ("fwd_gather", "grad_reduce"):
        assert z3[f"{part}_cross"] == pytest.approx(7 / 8, rel=0.02)
    assert 0.75 <= z3["bwd_gather_cross"] <= z3["fwd_gather_cross"]
    parts = ("fwd_gather_cross", "bwd_gather_cross", "grad_reduce_cross")
    assert z3["total"] == pytest.approx(sum(z3[k] for k in parts), rel=1e-6)
    assert z3["scales"] == 0 and z3["reduction"] == 1
    # ZeRO++: no backward gather across nodes, float32 scales beside the int payloads.
    assert zpp_["bwd_gather_cross"] == 0
    assert zpp_["scales"] > 0
    assert zpp_["paper_count"] < 0.3 * z3["paper_count"]
    assert zpp_["total"] == pytest.approx(zpp_["total_cross"] + zpp_["total_intra"])
    for ext in ("md", "csv", "png"):
        assert (tmp_path / f"volume_table.{ext}").stat().st_size > 0
    with open(tmp_path / "volume_table.csv") as f:
        assert [r["variant"] for r in csv.DictReader(f)] == ["ZeRO-3", "ZeRO++"]


def test_error_compounding_tiny(tmp_path):
    rows, events = ec.main(
        ["--max-n", "8", "--size", "1024", "--bits", "4", "--max-k", "4", "--out", str(tmp_path)]
    )
    assert {r["n"] for r in rows} == {2, 4, 8}
    for r in rows:
        if r["n"] >= 8:
            assert r["one_shot"] < r["ring"], r
        # N <= 8: one group, so both two-hop variants are the one-shot reduction.
        assert r["two_hop_g8"] == r["one_shot"] and r["two_hop_g16"] == r["one_shot"]
    for mode in ("ring", "shifted"):
        errs = {e["k"]: e["rel_error"] for e in events if e["mode"] == mode}
        assert errs[0] == 0 and 0 < errs[1] <= errs[4]
    for name in ("error_compounding.md", "error_compounding.csv", "error_compounding.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "quantization_events.csv").exists()


def test_two_shard_ring_is_one_event():
    # N = 2: the ring quantizes shard 0 once and adds shard 1 in float32.
    shards = jnp.asarray(ec.make_shards("gaussian", 8, 1024, seed=3))  # shapes as above
    errs = ec.reduction_errors(shards, jnp.int32(2), bits=4, block_size=256)
    round_trip = jax.jit(ec.round_trip, static_argnames=("bits", "block_size"))
    want = round_trip(shards[0], bits=4, block_size=256) + shards[1]
    exact = shards[0] + shards[1]
    rel = jnp.linalg.norm(want - exact) / jnp.linalg.norm(exact)
    assert float(errs["ring"]) == pytest.approx(float(rel), rel=1e-6)


def test_inject_events_keeps_tree_and_bounds_one_event():
    grads = {"w": jnp.linspace(-1.0, 1.0, 300).reshape(3, 100), "b": jnp.ones((7,), jnp.bfloat16)}
    key = jax.random.key(0)
    same = ec.inject_quantization_events(grads, 0, bits=4, block_size=64, key=key)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), same, grads))
    once = ec.inject_quantization_events(grads, 1, bits=8, block_size=64, key=key, mode="shifted")
    assert jax.tree.map(lambda x: (x.shape, x.dtype), once) == jax.tree.map(
        lambda x: (x.shape, x.dtype), grads
    )
    # One shifted round trip errs by at most half a step of the (whole-array) absmax scale.
    w = np.asarray(grads["w"])
    half_step = np.abs(w).max() / quant.qmax(8) / 2
    assert np.max(np.abs(np.asarray(once["w"]) - w)) <= half_step * (1 + 1e-4)
    many = ec.inject_quantization_events(grads, 16, bits=4, block_size=64, key=key)
    assert not np.array_equal(np.asarray(many["w"]), w)
    with pytest.raises(ValueError, match="mode"):
        ec.inject_quantization_events(grads, 1, bits=4, block_size=64, key=key, mode="tree")


def test_projection_tiny(tmp_path):
    rows = pj.main(
        [
            "--gpt",
            "32x1",
            "--no-rescale-check",
            "--cluster-csv",
            str(tmp_path / "absent.csv"),
            "--out",
            str(tmp_path),
        ]
    )
    assert len(rows) == len(pj.MODELS) * len(pj.TOKENS) * len(pj.GBPS)
    for r in rows:
        if r["gbps"] == 100:
            assert r["speedup"] > 1.5
        slower = next(
            s
            for s in rows
            if (s["model"], s["tokens_per_gpu"], s["gbps"])
            == (r["model"], r["tokens_per_gpu"], 800)
        )
        assert r["speedup"] >= slower["speedup"]  # the slower the network, the larger the gain
        # XLA FSDP's CPU program sends float32 gathers and all-reduces: ZeRO-3's bytes or more.
        assert r["fsdp_step_s"] >= r["zero3_step_s"] > r["zeropp_step_s"]
    for ext in ("md", "csv", "png"):
        assert (tmp_path / f"projection.{ext}").stat().st_size > 0
    assert "no usable emulated-cluster CSV" in (tmp_path / "projection.md").read_text()


def test_calibrated_column_is_slower_links():
    node = dict(
        part="grad_reduce",
        op="all-to-all",
        axes=("node",),
        group_size=24,
        cross_node=True,
        kind="payload",
        M=0.01,
    )
    flat = dict(part="grad_reduce", op="all-to-all", axes=("node", "local"), group_size=384,
                cross_node=True, kind="payload", M=1.0)  # fmt: skip
    rows = pj.projection_rows(
        {"ZeRO-3": [flat], "ZeRO++": [node]},
        pj.Cluster(),
        models=pj.MODELS[:1],
        tokens_list=(1024,),
        gbps_list=(100,),
        calibrated_efficiency=0.5,
    )
    # Slower links make the step more communication-bound, so ZeRO++ gains more.
    assert rows[0]["speedup_calibrated"] > rows[0]["speedup"] > 1


def test_rescale_rule():
    terms = [
        dict(part="fwd_gather", op="all-gather", axes=("node",), group_size=2, cross_node=True,
             kind="payload", M=0.0625),
        dict(part="fwd_gather", op="all-gather", axes=("local",), group_size=4, cross_node=False,
             kind="payload", M=0.375),
        dict(part="grad_reduce", op="all-to-all", axes=("node", "local"), group_size=8,
             cross_node=True, kind="payload", M=0.875),
    ]  # fmt: skip
    node, local, flat = pj.rescale_terms(terms, (2, 4), (24, 16))
    assert node["M"] == pytest.approx(0.5 * (23 / 24) / 16)  # int8 secondary shard, 1/L slice
    assert local["M"] == pytest.approx(0.5 * 15 / 16)
    assert flat["M"] == pytest.approx(383 / 384) and flat["group_size"] == 384
    cluster = pj.Cluster()
    # Through one node's NICs: each of the 16 GPUs' node-hop streams, one ring's volume.
    assert pj.node_crossing_M([node, local, flat], cluster) == pytest.approx(
        16 * node["M"] + flat["M"]
    )


def test_calibrate_link_recovers_efficiency(tmp_path):
    path = tmp_path / "cluster.csv"
    fixed = {"zero3": 1.5, "zeropp": 2.0}
    link_mb = {"zero3": 80.0, "zeropp": 10.0}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rate", "config", "step_s", "mb_node0_to_node1", "mb_node1_to_node0"])
        for rate in ("100", "200", "400", "inf"):
            for config in fixed:
                ideal = link_mb[config] * 8 / float(rate)
                w.writerow([rate, config, fixed[config] + ideal / 0.8, link_mb[config], 1.0])
    got = pj.calibrate_link(path)
    assert got["efficiency"] == pytest.approx(0.8)
    assert got["fixed_s"] == pytest.approx(fixed, abs=1e-4)
    assert len(got["fit"]) == 8
    assert all(f["fitted_s"] == pytest.approx(f["step_s"]) for f in got["fit"])
    assert pj.calibrate_link(tmp_path / "missing.csv") is None
    assert math.isfinite(got["rms_s"])


def test_memory_reestimate_keeps_the_measured_columns(tmp_path):
    """The quick run's worker compiles with conftest's quick XLA flags (`worker_rows`
    passes the caller's on); its rows also set each compiled step against the estimate."""
    import memory

    first = memory.main(["--quick", "--out", str(tmp_path)])
    row = next(r for r in first if r["engine"] == "ZeRO++")
    assert row["mesh"] == "2x4" and row["model"] == "tiny"
    # the estimate is of the same size as XLA's figure even for a model this small, where
    # XLA's small temporaries, which it leaves out, weigh the most
    assert 0.5 < row["xla_over_estimate"] < 2.0
    again = memory.main(["--quick", "--reestimate", "--out", str(tmp_path)])
    assert len(again) == len(first) == len(memory.ENGINES) == 6
    for a, b in zip(again, first, strict=True):
        assert a == {
            **b,
            "estimate_GB": a["estimate_GB"],
            "xla_over_estimate": a["xla_over_estimate"],
        }
        assert a["estimate_GB"] == b["estimate_GB"]  # the same code estimates the same
    text = (tmp_path / "memory_quick.md").read_text()
    assert "Measured: " in text and "Estimate: " in text
    memory.main(["--quick", "--reestimate", "--out", str(tmp_path)])  # again: one of each
    text = (tmp_path / "memory_quick.md").read_text()
    assert text.count("Measured: ") == 1 and text.count("Estimate: ") == 1


def test_memory_merge_replaces_only_the_rows_it_measured(tmp_path):
    import _common
    import memory

    def row(model: str, engine: str, total: float) -> dict:
        return {"mesh": "2x4", "model": model, "engine": engine, "total_GB": total}

    old = [row(m, e, 1.0) for m in ("125m", "350m") for e in memory.ENGINES]
    _common.write_csv(tmp_path / "memory_2x4.csv", old)
    (tmp_path / "memory_2x4.md").write_text("# t\n\nold machine, commit 1111111.\n\nx\n")
    new = [{**row("350m", "XLA FSDP", 2.0), "ledger_M": ""}]
    piece = f"{memory.RUN}2x4 | 350m | XLA FSDP: new machine, commit 2222222; `cmd`."
    rows, runs = memory._merged(new, tmp_path / "memory_2x4.csv", piece)
    assert len(rows) == len(old)
    assert [(r["model"], r["engine"]) for r in rows] == [(r["model"], r["engine"]) for r in old]
    assert {r["total_GB"] for r in rows if (r["model"], r["engine"]) != ("350m", "XLA FSDP")} == {
        1.0
    }
    assert all(set(r) == set(rows[0]) for r in rows) and "ledger_M" in rows[0]
    assert runs[-1] == piece and "commit 1111111" in runs[0]
    (tmp_path / "memory_2x4.md").write_text("# t\n\n" + "\n".join(runs) + "\n\nx\n")
    commits = memory.row_commits(tmp_path / "memory_2x4.md")
    assert commits[("2x4", "350m", "XLA FSDP")] == "2222222"
    assert commits[("2x4", "125m", "XLA FSDP")] == "1111111"


def test_memory_summary_is_the_results_files_table():
    import _common
    import memory

    paths = [_common.RESULTS / "memory" / f"memory_{mesh}.csv" for mesh in ("2x4", "16x8")]
    text = memory.summary(paths)
    rows = {(r["mesh"], r["model"], r["engine"]): r for p in paths for r in memory._read_rows(p)}
    line = next(x for x in text.splitlines() if x.startswith("| 16x8 | 125m |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert float(cells[3]) == rows[("16x8", "125m", "XLA FSDP")]["total_GB"]
    assert cells[4].startswith(f"{rows[('16x8', '125m', 'ZeRO-3')]['total_GB']:.3f} (")
    assert "Rows measured at: commit" in text


LIVE_RANGE = """BufferLiveRange:
  Live ranges at 7 (peak):
    dus_fusion{}: 100 bytes (cumulative: 100 bytes)
    loop.param{2}: 100 bytes (cumulative: 200 bytes)
    other{}: 40 bytes (cumulative: 240 bytes)
    arg: 8 bytes (cumulative: 248 bytes)

"""
ASSIGNMENT = """allocation 0: size 8, parameter 0:
 value: <1 arg @0> (size=8,offset=0): f32[2]{0}
allocation 1: size 200, preallocated-temp:
 value: <2 dus_fusion @0> (size=100,offset=50): u16[50]{0}
 value: <3 loop.param{2} (phi) @0> (size=100,offset=50): u16[50]{0}
 value: <4 other @0> (size=40,offset=130): f32[10]{0}
 value: <5 elsewhere @0> (size=50,offset=0): f32[10]{0}
"""


def test_live_peak_counts_each_byte_once():
    """An in-place update and the loop carry it updates share a buffer (the same offset of
    the same allocation); XLA's live-range report lists both. `other` overlaps the shared
    buffer's last 20 bytes, `elsewhere` is not live at the peak."""
    from memory_live import live_peak_bytes

    assert live_peak_bytes(LIVE_RANGE, ASSIGNMENT) == 8 + (170 - 50)
    with pytest.raises(ValueError, match="not in the assignment"):
        live_peak_bytes(LIVE_RANGE.replace("other{}", "ghost{}"), ASSIGNMENT)


def test_memory_live_quick_rows(tmp_path):
    import memory_live

    rows = memory_live.main(["--quick", "--out", str(tmp_path)])
    assert [r["engine"] for r in rows] == list(memory_live.ENGINES)
    for r in rows:
        # what is live at the peak fits in what the heap and the arguments hold
        assert 0 < r["live_peak_GB"] <= r["total_GB"] + 0.001
    assert (tmp_path / "memory_live_quick.md").read_text().startswith("# Live bytes")


def test_worker_rows_passes_the_callers_xla_flags_less_the_device_count(monkeypatch):
    import _common

    monkeypatch.setenv("XLA_FLAGS", "--xla_a=1 --xla_force_host_platform_device_count=8 --xla_b")
    show = "import json, os; print(json.dumps({'flags': os.environ.get('XLA_FLAGS')}))"
    assert _common.worker_rows([sys.executable, "-c", show], "the echo") == [
        {"flags": "--xla_a=1 --xla_b"}
    ]
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert _common.worker_rows([sys.executable, "-c", show], "the echo") == [{"flags": None}]


def test_study_variants_folders_and_log(tmp_path, capsys):
    import argparse

    import _common

    p = argparse.ArgumentParser()
    known = {"zero3": 1, "zeropp": 2, "beyond": 3}
    assert _common.chosen_variants(p, None, known, ("zero3",)) == ("zero3",)
    assert _common.chosen_variants(p, "beyond, zero3", known, ()) == ("beyond", "zero3")
    with pytest.raises(SystemExit):
        _common.chosen_variants(p, "zero3,zeropq", known, ())
    assert "unknown variants ['zeropq']" in capsys.readouterr().err
    out, root = _common.study_dirs(tmp_path / "o", False, "study")
    assert (out, root) == (tmp_path / "o", tmp_path / "o" / "study") and root.is_dir()
    log = _common.file_logger(root / "log.txt")
    log("one")
    log("two")
    lines = (root / "log.txt").read_text().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["one", "two"]
    assert capsys.readouterr().out.splitlines() == lines


def test_a_study_writes_into_its_own_folder_by_default(tmp_path, monkeypatch):
    import _common

    monkeypatch.setattr(_common, "RESULTS", tmp_path / "results")
    folder = _common.study_dir("memory")
    assert folder == tmp_path / "results" / "memory" and folder.is_dir()
    out, root = _common.study_dirs(None, False, "convergence")
    assert out == root == tmp_path / "results" / "convergence" and root.is_dir()


def _loose_files(results: pathlib.Path) -> list[str]:
    """What sits at the top of `results` besides the study folders and the README."""
    return sorted(p.name for p in results.iterdir() if not p.is_dir() and p.name != "README.md")


def test_results_hold_only_study_folders(tmp_path):
    """Every results file lives in the folder of the study that wrote it
    (`experiments/results/<study>/`, `_common.study_dir`), and the README lists each folder
    and its script."""
    import _common

    loose = _loose_files(_common.RESULTS)
    assert not loose, (
        f"move {loose} into experiments/results/<study>/, the folder of the script that "
        "wrote them (`_common.study_dir`)"
    )
    readme = (_common.RESULTS / "README.md").read_text()
    listed = dict(re.findall(r"^\| `([^`/]+)/` \| `([^`]+)` \|", readme, re.M))
    folders = {p.name for p in _common.RESULTS.iterdir() if p.is_dir()}
    assert folders <= set(listed), f"add {sorted(folders - set(listed))} to results/README.md"
    assert [s for s in listed.values() if not (_common.ROOT / s).is_file()] == []
    (tmp_path / "study").mkdir()
    (tmp_path / "README.md").write_text("")
    (tmp_path / "stray.md").write_text("")
    assert _loose_files(tmp_path) == ["stray.md"]


def test_layout_memory_extracts_the_package_of_a_commit(tmp_path):
    import layout_memory as lm

    short = lm.extract("HEAD", tmp_path)
    assert short and (tmp_path / "zeropp_jax" / "__init__.py").is_file()
    assert not (tmp_path / "tests").exists()
    with pytest.raises(SystemExit, match="unknown models"):
        lm.main(["--models", "gpt,70b", "--out", str(tmp_path)])


def test_write_csv_heads_an_empty_table_with_its_fieldnames(tmp_path):
    import _common

    _common.write_csv(tmp_path / "t.csv", [], ("variant", "seed"))
    assert (tmp_path / "t.csv").read_text().splitlines() == ["variant,seed"]
    with pytest.raises(ValueError, match="no rows and no fieldnames"):
        _common.write_csv(tmp_path / "u.csv", [])


def test_program_kernels_counts_a_loop_body_once_per_trip():
    """`experiments/program_kernels.py` (`gpu_overhead.py`'s reader) reads a compiled
    program's kernels: a loop body's run once per trip (its known trip count), a GEMM's
    flops `2 x output x contracted`."""
    import program_kernels as go

    def f(x, w):
        return jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ w) * 2.0 + 1.0, x).sum()

    x = jnp.ones((64, 64), jnp.float32)
    ks = go.kernels(jax.jit(f).lower(x, x).compile().as_text())
    gemms = [k for k in ks if k.flops]
    assert sum(k.flops * k.launches for k in gemms) == 5 * 2 * 64**3
    assert all(k.launches == 5 for k in gemms)
    assert any(k.launches == 1 for k in ks)  # the entry's own kernels, once
