"""`experiments/memory_peak.py`: reading XLA's memory-usage report, and one tiny run whose
report is the compiled step's (its total is what `memory_analysis()` says)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import memory_peak as mp  # noqa: E402

REPORT = """Memory Space: default (color=0)
Total bytes: 596464176 (568.83MiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
   73.69MiB(  8%);   73.69MiB;            0;               15; f32[2048], 2×u16[50304,768]
  147.38MiB( 17%);   73.69MiB;     77266944;               20; u16[38633472], 5×u16[3144,16,768]
  183.38MiB( 21%);   36.00MiB;    154533888;               13; 2×f32[3144,768], f32[]
  183.50MiB( 21%);  128.00KiB;    154533999;                1; pred[2048,64]
"""


def test_slots_are_read_with_their_sizes_and_every_value_s_type():
    found = mp.slots(REPORT)
    assert [round(s.size) for s in found] == [
        round(73.69 * 2**20),
        round(73.69 * 2**20),
        36 * 2**20,
        128 * 2**10,
    ]
    assert found[0].shapes == (
        "f32[2048]",
        "u16[50304,768]",
        "u16[50304,768]",
    )
    assert found[1].shapes.count("u16[3144,16,768]") == 5
    assert mp.total_bytes(REPORT) == 596464176
    with pytest.raises(ValueError, match="Total bytes"):
        mp.total_bytes("Memory Space: default")


def test_whole_table_slots_are_found_by_element_count_in_any_shape():
    found = mp.slots(REPORT)
    assert mp.elements("u16[50304,768]") == 50304 * 768 == mp.elements("u16[38633472]")
    assert mp.elements("f32[]") == 1
    # both 73.69 MiB slots: one as (50304, 768), one flattened and one as (3144, 16, 768)
    assert mp.holding(found, 50304 * 768) == found[:2]
    assert mp.holding(found, 7) == []
    assert mp.largest_first(found[1].shapes) == ["u16[3144,16,768]", "u16[38633472]"]


LIVE_RANGE = """HloLiveRange (max 4):
  InstructionSequence:
    0:p.1
    1:copy.2
    2:ynn_fusion.7
  BufferLiveRange:
    p.1{}:0-4
  Live ranges at 2 (peak):
    copy.2{}: 4194304 bytes (cumulative: 4194304 bytes)
    while.3{1}: 8192 bytes (cumulative: 4202496 bytes)
    ynn_fusion.7{}: 8388608 bytes (cumulative: 12591104 bytes)
"""

HLO = """ENTRY %main {
  %p.1 = f32[64]{0} parameter(0)
  %copy.2 = u16[50304,768]{1,0} copy(%x)
  %while.3 = (s32[], f32[2,16]{1,0}) while(%t), condition=%c, body=%b
  ROOT %ynn_fusion.7 = f32[2048,1024]{1,0} fusion(%copy.2), metadata={op_name="f/while/out/dot"}
}
"""


def test_the_peak_is_read_with_its_instruction_and_live_buffers_largest_first():
    where, live = mp.peak(LIVE_RANGE, HLO)
    assert where == "f/while/out/dot"
    assert [(v.name, v.size, v.type) for v in live] == [
        ("ynn_fusion.7", 8388608, "f32[2048,1024]"),
        ("copy.2", 4194304, "u16[50304,768]"),
        ("while.3", 8192, ""),  # a tuple's element: no array type
    ]
    with pytest.raises(ValueError, match="live-range"):
        mp.peak("HloLiveRange (max 4):", HLO)


def test_a_tiny_run_reads_the_compiled_step_s_own_report(tmp_path):
    rows = mp.main(
        ["--meshes", "2x4", "--sizes", "tiny", "--seq", "128", "--out", str(tmp_path), "--top", "2"]
    )
    assert [r["engine"] for r in rows] == ["XLA FSDP", "ZeRO-3"]
    for r in rows:
        # the largest module's report is the step's: its total is the step's memory (to
        # the 0.5 MB that total_GB is rounded to)
        assert r["report_total_MiB"] * 2**20 == pytest.approx(r["total_GB"] * 1e9, abs=0.6e6)
        assert r["peak_largest"].count(" MiB ") == 2
        # the peak's live buffers fit in the heap the report lays them out in
        assert 0 < r["peak_live_MiB"] <= r["report_total_MiB"]
    assert (tmp_path / "memory_peak.md").exists()
