"""The GPU compile-time study (`experiments/gpu_compile_time.py`): the XLA:CPU figures its
reading quotes, read from the results files (runs everywhere), and its quick mode, which
compiles for 2 x 4 H200s and needs the CUDA plugin of the installed jaxlib (skipped where
it is missing, as in `tests/test_gpu_compile.py`)."""

import csv
import importlib.util
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import _common  # noqa: E402
import gpu_compile_time  # noqa: E402

HAS_PLUGIN = importlib.util.find_spec("jax_plugins") is not None and (
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
)


def test_cpu_figures_are_the_compile_time_results():
    """The reading quotes `compile_time.csv`'s compile seconds and names its commit and
    mesh from `compile_time.md`."""
    results = _common.RESULTS / "compile_time"
    cpu = gpu_compile_time.cpu_figures(results, "compile_time")
    assert cpu is not None
    with open(results / "compile_time.csv") as f:
        rows = {r["variant"]: float(r["compile_s"]) for r in csv.DictReader(f)}
    assert cpu["compile_s"] == {e: rows[e] for e in gpu_compile_time.ENGINES}
    assert cpu["where"].startswith("`compile_time.md` (commit ")
    assert gpu_compile_time.cpu_figures(results, "no_such_study") is None
    text = gpu_compile_time.ratios({"ZeRO++": 6.0, "ZeRO-3": 3.0, "XLA FSDP": 4.0})
    assert "2.00x ZeRO-3's, 1.50x XLA FSDP's" in text


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_PLUGIN,
    reason="needs the CUDA plugin of the installed jaxlib (pip install -e '.[gpu-compile]'; "
    ".ci/gpu_compile_test), not installed by .ci/run",
)
def test_quick_mode_times_zero3_and_zeropp(tmp_path):
    """`--quick` (the trainer's GPT on 2 x 4 H200s), ZeRO-3 and ZeRO++, one compile each
    (about a minute on 2 cores): a row per engine with positive seconds and a program."""
    argv = ["--quick", "--engines", "ZeRO-3,ZeRO++", "--repeats", "1", "--out", str(tmp_path)]
    rows = gpu_compile_time.main(argv)
    assert [r["engine"] for r in rows] == ["ZeRO-3", "ZeRO++"]
    for r in rows:
        assert (r["mesh"], r["model"], r["flags"]) == ("2x4", "gpt", "none")
        assert r["lower_s"] > 0 and r["compile_s"] > 0
        assert r["hlo_instructions"] > 0 and r["whiles"] >= 2  # the forward and backward loops
    with open(tmp_path / "gpu_compile_time_quick.csv") as f:
        assert [r["engine"] for r in csv.DictReader(f)] == ["ZeRO-3", "ZeRO++"]
    text = (tmp_path / "gpu_compile_time_quick.md").read_text()
    assert "| ZeRO-3 | gpt | 2x4 |" in text and "| ZeRO++ | gpt | 2x4 |" in text
