"""Issue #50's goal on the engine's own cost on one GPU (`experiments/gpu_overhead.py`):
ZeRO-3's compiled step within 2% of XLA FSDP's bytes accessed and fusion count, ZeRO++'s
within 4%, on the 125M GPT step timed on an H200, compiled here without a GPU.

* The goal's arithmetic (`goal_misses`) on made-up rows: runs everywhere, and shows the
  check can fail.
* The goal on the compiled programs: compiles the three steps for one H200 (deviceless),
  which needs the CUDA plugin of the installed jaxlib. `.ci/run`'s two suites do not
  install it, so there it skips; `.ci/gpu_compile_test` installs it and runs this file
  (about 4 minutes on 2 cores), so CI runs it once per submission.
"""

import importlib.util
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import gpu_overhead  # noqa: E402

HAS_PLUGIN = importlib.util.find_spec("jax_plugins") is not None and (
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
)


def _rows(zero3: float, zeropp: float) -> dict[str, dict[str, float]]:
    """Rows whose every goal column is XLA FSDP's times `1 + zero3` (ZeRO-3) or
    `1 + zeropp` (ZeRO++)."""
    base = {col: 100.0 for col in gpu_overhead.GOAL_COLUMNS}
    return {
        "XLA FSDP": base,
        "ZeRO-3": {col: v * (1 + zero3) for col, v in base.items()},
        "ZeRO++": {col: v * (1 + zeropp) for col, v in base.items()},
    }


def test_goal_misses_names_each_column_over_its_limit():
    assert gpu_overhead.goal_misses(_rows(0.019, 0.039)) == []
    assert gpu_overhead.goal_misses(_rows(-0.5, 0.0)) == []
    missed = gpu_overhead.goal_misses(_rows(0.021, 0.03))
    assert len(missed) == len(gpu_overhead.GOAL_COLUMNS)
    assert all(m.startswith("ZeRO-3 `") and "+2.1% over XLA FSDP" in m for m in missed)
    missed = gpu_overhead.goal_misses(_rows(0.0, 0.05))
    assert missed and all(m.startswith("ZeRO++ `") for m in missed)
    rows = _rows(0.0, 0.0)
    rows["ZeRO-3"]["fusions"] = 103.0
    assert gpu_overhead.goal_misses(rows) == [
        "ZeRO-3 `fusions` +3.0% over XLA FSDP (goal: at most +2%)"
    ]
    assert "ZeRO-3 within 2% of XLA FSDP: NOT met" in gpu_overhead.goal_lines(rows)


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_PLUGIN,
    reason="needs the CUDA plugin of the installed jaxlib (pip install -e '.[gpu-compile]'; "
    ".ci/gpu_compile_test), not installed by .ci/run",
)
def test_the_engines_own_cost_on_one_h200_is_within_the_goal():
    """The three 125M steps compiled for one H200: ZeRO-3 within 2% of XLA FSDP's bytes
    accessed, kernel bytes, fusions and kernel launches, ZeRO++ within 4%; and the same
    GEMM flops in all three (the engines add no matrix work)."""
    import warnings

    from _gpu_target import gpu_mesh

    rows = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engine's per-leaf notes
        for engine in gpu_overhead.ENGINES:
            program = gpu_overhead.compile_program(engine, gpu_mesh("h200", 1, 1))
            kernels = gpu_overhead.kernels(program["text"])
            rows[engine] = gpu_overhead.summary(engine, program, kernels)
    assert gpu_overhead.goal_misses(rows) == []
    flops = {e: r["gemm_flops_T"] for e, r in rows.items()}
    assert len(set(flops.values())) == 1, flops
    assert rows["ZeRO++"]["pallas_launches"] == 0  # nothing is sent on one device
