"""`experiments/remat_gathers.py`: one tiny run on emulated CPU devices, where the two
forms train alike and `hold` gathers each block weight once in the backward."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import remat_gathers  # noqa: E402


def test_hold_gathers_once_in_the_backward_and_the_table_is_written(tmp_path):
    rows = remat_gathers.main(
        [
            *["--cpu", "--model", "tiny", "--mesh", "2x4", "--seq-len", "16"],
            *["--d-model", "32", "--n-heads", "2", "--n-layers", "2", "--out", str(tmp_path)],
        ]
    )
    by = {(r["engine"], r["form"]): r for r in rows}
    for engine in remat_gathers.ENGINES:
        hold, again = by[engine, "hold"], by[engine, "gather again"]
        assert hold["forward_gathers_M"] == again["forward_gathers_M"] > 0
        assert hold["backward_gathers_M"] < again["backward_gathers_M"]
        assert hold["per_device_M"] < again["per_device_M"]
    assert (tmp_path / "remat_gathers.md").read_text().count("| ZeRO") == 4
    assert (tmp_path / "remat_gathers.csv").exists()
