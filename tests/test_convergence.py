"""The convergence study (experiments/convergence.py): its quick path end to end."""

import csv
import json
import pathlib
import sys

import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import _convergence_report  # noqa: E402
import _study_runs  # noqa: E402
import convergence  # noqa: E402


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence")
    assert convergence.main(["--quick", "--in-process", "--out", str(out)]) == 0
    return out


def test_quick_study_writes_table_curves_and_gap(quick):
    rows = list(csv.DictReader(open(quick / "convergence.csv")))
    assert [r["variant"] for r in rows] == list(convergence.QUICK_VARIANTS)
    ref, zpp = (float(r["final_val_loss"]) for r in rows)
    assert float(rows[0]["gap_pct"]) == 0.0
    assert float(rows[1]["gap_pct"]) == pytest.approx(100 * (zpp - ref) / ref)
    assert (quick / "convergence.png").stat().st_size > 0
    text = (quick / "convergence.md").read_text()
    assert "ZeRO-3 (reference)" in text and "python -m zeropp_jax.train" in text
    crcs = []
    for name in convergence.QUICK_VARIANTS:
        run = quick / "convergence" / name
        assert not (run / "checkpoints").exists()
        metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
        assert [m["step"] for m in metrics if "val_loss" in m] == [2, 4]
        crcs.append([m["data_crc32"] for m in metrics if "data_crc32" in m])
    assert crcs[0] == crcs[1]  # same data order for every variant


CLEAN = {"commit": "c" * 40, "dirty": False, "changed": [], "packages": {"jax": "x"}}


def _record_code(run: pathlib.Path, code: dict) -> None:
    record = json.loads((run / "run.json").read_text())
    record["provenance"] = code
    (run / "run.json").write_text(json.dumps(record))


def test_a_finished_run_is_reused_only_by_the_same_code(quick, capsys, monkeypatch):
    # Whatever state this checkout is in, pretend both runs and this process ran one
    # clean commit; then make one run's record name another commit.
    monkeypatch.setattr(_study_runs, "CODE", CLEAN)
    for name in convergence.QUICK_VARIANTS:
        _record_code(quick / "convergence" / name, CLEAN)
    assert convergence.main(["--quick", "--in-process", "--out", str(quick)]) == 0
    assert capsys.readouterr().out.count("reusing the finished run") == 2
    first = quick / "convergence" / convergence.QUICK_VARIANTS[0]
    _record_code(first, dict(CLEAN, commit="d" * 40))
    assert convergence.main(["--quick", "--in-process", "--out", str(quick)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("reusing the finished run") == 1  # the other commit's run retrained


def test_events_runs_go_through_the_worker_with_their_injection():
    k0, run = convergence.event_runs([0, 4], bits=4, seed=0)
    assert k0.injection.k == 0 and k0.path == "events/k0"
    assert run.path == "events/k4"
    assert convergence.event_runs([0, 1], bits=2, seed=0)[1].path == "events_b2/k1"
    command = run.command(convergence.QUICK, pathlib.Path("/tmp/x"))
    assert command[:2] == ["experiments/convergence.py", "--worker"]
    cut = command.index("--")
    assert command[cut - 10 : cut] == [
        *("--inject-k", "4", "--inject-bits", "4", "--inject-block-size", "256"),
        *("--inject-mode", "ring", "--inject-seed", "0"),
    ]
    assert "--zero3" in command[cut:] and command.count("--no-ledger") == 1


def test_first_break_is_the_smallest_k_over_the_threshold():
    rows = [dict(k=k, gap_pct=g) for k, g in ((0, 0.0), (8, 1.5), (2, 0.3), (4, 1.2))]
    assert _convergence_report.first_break(rows) == 4
    assert _convergence_report.first_break(rows, threshold=2.0) is None


def test_report_only_rewrites_the_tables_from_any_code_and_says_when_it_differs(
    quick, capsys, monkeypatch
):
    # The runs ran other code than this process: nothing trains, the tables are rewritten
    # from them, and the log names the codes when the runs disagree among themselves.
    monkeypatch.setattr(_study_runs, "CODE", dict(CLEAN, commit="e" * 40))
    for i, name in enumerate(convergence.QUICK_VARIANTS):
        _record_code(quick / "convergence" / name, dict(CLEAN, commit=str(i) * 40))
    (quick / "convergence.md").unlink()
    assert convergence.main(["--quick", "--report-only", "--out", str(quick)]) == 0
    printed = capsys.readouterr().out
    assert "python -m zeropp_jax.train" not in printed.split("main study on", 1)[1]  # no run
    assert "warning: these runs ran different code" in printed
    rows = list(csv.DictReader(open(quick / "convergence.csv")))
    assert [r["variant"] for r in rows] == list(convergence.QUICK_VARIANTS)
    assert (quick / "convergence.md").exists()
