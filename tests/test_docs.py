"""The code in README.md and docs/ runs: every python block, the bash blocks marked to run,
the tables; and the README's results numbers are read from results files.

Fenced blocks of README.md and docs/*.md:

* ```python blocks run, all blocks of one page in order in one fresh interpreter (like a
  notebook), on 8 emulated CPU devices, in a temporary directory; a block that needs a
  cluster is preceded by `<!-- docs-test: skip (reason) -->`.
* ```bash blocks run only when preceded by `<!-- docs-test: run -->` (in a temporary
  directory where `docs/` is visible); every other bash block must say why it does not
  run with `<!-- docs-test: skip (reason) -->`, so nothing that could run is forgotten.
* ```text blocks are output and never run.

README.md's python runs as a newcomer would run it on a laptop: in a fresh interpreter
without the tests' XLA flags, so it must ask for its emulated devices itself. Its first two
lines of code are the install-and-train command and the test command that `.ci/run` runs.

A table between `<!-- results-table:start -->` and `<!-- results-table:end -->` (README.md,
experiments/RESULTS.md) is read from results files: its last column names one or more files
(paths relative to the page), and every number in its other columns must be one of those
files' numbers, written the same way; a column named `commit` holds commits that one of those
files records, and a column named `section` links to a heading of the page.

The ledger table of docs/concepts.md must be what `python docs/ledger_table.py` prints.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

import zeropp_jax as zpp

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
RESULTS_MD = ROOT / "experiments" / "RESULTS.md"
PAGES = sorted(DOCS.glob("*.md"))
LANGUAGES = ("python", "bash", "text")
MARKER = re.compile(r"^<!-- docs-test: (run|skip \(.+\)) -->$")
FENCE = re.compile(r"^```(\S*)\s*$")
TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # the page's path from the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # "run", "skip (...)" or None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of a page, with the docs-test marker right above each."""
    page = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"{page}:{start + 1}: unclosed ``` block")
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k].strip()) if k >= 0 else None
        code = "\n".join(lines[start + 1 : j]) + "\n"
        out.append(Block(page, start + 1, lang, code, marker.group(1) if marker else None))
        i = j + 1
    return out


ALL = [b for page in [README, *PAGES] for b in blocks(page)]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["XLA_FLAGS"] = os.environ["XLA_FLAGS"]  # conftest's: 8 devices, quick compiles
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), e.get("PATH", "")])
    return e


def run(cmd: list[str], cwd: pathlib.Path, what: str, **extra_env: str) -> None:
    proc = subprocess.run(
        cmd, cwd=cwd, env=env() | extra_env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, (
        f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )


# ------------------------------------------------------------------- structure


def test_pages_and_nav():
    names = {p.name for p in PAGES}
    assert {
        "index.md",
        "quickstart.md",
        "concepts.md",
        "gpu_cluster.md",
        "troubleshooting.md",
        "api.md",
        "trainer.md",
        "results.md",
        "limits.md",
    } <= names
    nav = (ROOT / "mkdocs.yml").read_text()
    for name in names:
        assert f": {name}" in nav, f"docs/{name} is missing from the nav of mkdocs.yml"


def test_every_block_is_accounted_for():
    for b in ALL:
        assert b.lang in LANGUAGES, f"{b.where}: fence language {b.lang!r}; use {LANGUAGES}"
        if b.lang == "bash":
            assert b.marker is not None, (
                f"{b.where}: a bash block needs <!-- docs-test: run --> or "
                "<!-- docs-test: skip (why it cannot run on CPU) --> right above it"
            )
        if b.lang == "python":
            assert b.marker != "run", f"{b.where}: python blocks run unless skipped"
        if b.lang == "text":
            assert b.marker is None, f"{b.where}: text blocks are output, never run"


def test_every_config_field_is_described():
    text = (DOCS / "concepts.md").read_text()
    for field in dataclasses.fields(zpp.ZeroPPConfig):
        assert f"| `{field.name}` (" in text, (
            f"ZeroPPConfig.{field.name} has no row in the field table of docs/concepts.md"
        )


# ------------------------------------------------------------------- README


def test_readme_starts_with_the_two_commands():
    """The README opens with the two commands, the second the test command `.ci/run` runs."""
    lines = README.read_text().splitlines()
    assert lines[2] == "    pip install -e . && zeropp-train", lines[2]
    test = 'pip install -e ".[dev,experiments,data]" && python -m pytest -n 2 --dist loadfile tests'
    assert lines[3] == f"    {test}", lines[3]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    runs_it = [c for c in ci if c.startswith("python -m pytest")]
    assert runs_it and runs_it[0] == test.split(" && ")[1], (
        f"README.md's test command and .ci/run's differ: {test!r} against {runs_it}"
    )


def test_readme_links_land():
    """Every relative link of the README names a file that exists and, with an anchor, one of
    its headings (mkdocs checks the links inside docs/; the README is outside it)."""
    for target in re.findall(r"\]\(([^)#:]+)(?:#([^)]*))?\)", README.read_text()):
        path, anchor = ROOT / target[0], target[1]
        assert path.exists(), f"README.md links to {target[0]}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
            assert anchor in {github_anchor(h) for h in headings}, (
                f"README.md links to {target[0]}#{anchor}, which is no heading there"
            )


# A number as a table writes it: a sign, digits, a decimal part, an exponent, a % or an x;
# never a part of a name or a version (int8, d64, ZeRO-3, 2x4's 4, jax 0.10.2).
NUMBER = re.compile(r"(?<![\w.+\-])[-+]?\d+(?:\.\d+)?(?:e[-+]\d+)?(?:%|x)?(?!\d|\.\d)")
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")
LINK = re.compile(r"\]\(#([^)]+)\)")


def numbers(text: str) -> list[str]:
    return NUMBER.findall(text)


def has_number(text: str, number: str) -> bool:
    """Whether `number` is one of `text`'s numbers, written the same way: 0.3855 is not in
    0.38550, 10.3855 or -0.3855."""
    return re.search(r"(?<![\w.+\-])" + re.escape(number) + r"(?!\d|\.\d)", text) is not None


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and mkdocs' toc, for these headings) gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@dataclasses.dataclass(frozen=True)
class ResultRow:
    page: pathlib.Path
    line: int
    cells: dict[str, str]  # column name -> cell text
    sources: list[pathlib.Path]

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def result_rows(page: pathlib.Path) -> list[ResultRow]:
    """The rows of the results table of `page`, between its results-table markers."""
    lines = page.read_text().splitlines()
    start = lines.index("<!-- results-table:start -->")
    end = lines.index("<!-- results-table:end -->")
    split = lambda row: [c.strip() for c in row.strip().strip("|").split("|")]  # noqa: E731
    header = split(lines[start + 1])
    rows = []
    for k in range(start + 3, end):
        cells = dict(zip(header, split(lines[k]), strict=True))
        sources = re.findall(r"`([^`]+)`", cells[header[-1]])
        rows.append(ResultRow(page, k + 1, cells, [page.parent / s for s in sources]))
    return rows


RESULT_ROWS = [r for page in (README, RESULTS_MD) for r in result_rows(page)]


def check_result_row(row: ResultRow) -> list[str]:
    """What in `row` its source files do not hold."""
    bad = [f"{s} does not exist" for s in row.sources if not s.is_file()]
    if not row.sources or bad:
        return bad or ["the last column names no file (a path in backticks)"]
    text = "\n".join(s.read_text(errors="replace") for s in row.sources)
    source_column = list(row.cells)[-1]
    for column, cell in row.cells.items():
        if column in (source_column, "section"):
            continue
        if column == "commit":
            bad += [f"commit {c} is not in the file" for c in COMMIT.findall(cell) if c not in text]
            continue
        missing = [n for n in numbers(cell) if not has_number(text, n)]
        bad += [f"{column}: {n} is not in the file" for n in missing]
    if "section" in row.cells:
        headings = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", row.page.read_text(), re.M)}
        bad += [f"no heading #{a}" for a in LINK.findall(row.cells["section"]) if a not in headings]
    return bad


def test_results_tables_name_existing_files():
    assert len([r for r in RESULT_ROWS if r.page == README]) >= 5
    assert len([r for r in RESULT_ROWS if r.page == RESULTS_MD]) >= 10
    for row in RESULT_ROWS:
        assert row.sources, f"{row.where}: the last column names no file"
        for s in row.sources:
            assert s.is_file(), f"{row.where}: {s} does not exist"
            assert s.resolve().is_relative_to(ROOT / "experiments"), (
                f"{row.where}: {s} is not under experiments/"
            )


@pytest.mark.parametrize("row", RESULT_ROWS, ids=[r.where for r in RESULT_ROWS])
def test_every_results_number_is_read_from_its_file(row):
    bad = check_result_row(row)
    assert not bad, f"{row.where}: " + "; ".join(bad)


def test_results_archive_is_linked_section_by_section():
    """Every superseded run moved out of experiments/RESULTS.md leaves a link to its section
    of experiments/RESULTS_archive.md behind, and every link lands on a heading there."""
    archive = (ROOT / "experiments" / "RESULTS_archive.md").read_text()
    sections = {github_anchor(h) for h in re.findall(r"^## (.+)$", archive, re.M)}
    links = set(re.findall(r"\(RESULTS_archive\.md#([^)]+)\)", RESULTS_MD.read_text()))
    assert links <= sections, f"no such section of RESULTS_archive.md: {links - sections}"
    assert sections <= links, f"no link reaches these sections: {sections - links}"


def test_the_results_check_fails_on_a_drifted_number(tmp_path):
    """The check above can fail: a number that drifted from its file, a commit the file does
    not record, a section that does not exist."""
    source = tmp_path / "results.md"
    source.write_text("| ZeRO++ | 0.3855 | +1.79% | 6.74x | commit ee8a29c |\n")
    page = tmp_path / "page.md"
    page.write_text("# Results\n\n## The ledger\n")

    def row(**cells):
        return ResultRow(page, 1, {**cells, "file": "`results.md`"}, [source])

    assert check_result_row(row(result="0.3855, +1.79%, 6.74x", commit="ee8a29c")) == []
    assert check_result_row(row(result="0.3856")) == ["result: 0.3856 is not in the file"]
    assert check_result_row(row(result="0.385")) == ["result: 0.385 is not in the file"]
    assert check_result_row(row(result="-1.79%")) == ["result: -1.79% is not in the file"]
    assert check_result_row(row(result="6.75x")) == ["result: 6.75x is not in the file"]
    assert check_result_row(row(commit="abc1234")) == ["commit abc1234 is not in the file"]
    assert check_result_row(row(section="[x](#the-ledger)")) == []
    assert check_result_row(row(section="[x](#the-volume)")) == ["no heading #the-volume"]
    # Names and versions are not numbers.
    assert numbers("int8 d64 ZeRO-3 2x4 jax 0.10.2, 1.3b: +0.29% / -0.35%, 6.81x 1.93e-01") == [
        "2",
        "1.3",
        "+0.29%",
        "-0.35%",
        "6.81x",
        "1.93e-01",
    ]


# ------------------------------------------------------------------- python


def runs(b: Block) -> bool:
    return b.lang == "python" and not (b.marker or "").startswith("skip")


# README.md's python runs in its own test below, without the tests' XLA flags.
PYTHON_PAGES = sorted({b.page for b in ALL if runs(b) and b.page != "README.md"})


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks_run(page, tmp_path):
    parts = [f"# ---- {b.where}\n{b.code}" for b in blocks(ROOT / page) if runs(b)]
    script = tmp_path / f"{pathlib.Path(page).stem}_blocks.py"
    script.write_text("\n".join(parts))
    run([sys.executable, str(script)], tmp_path, f"the python blocks of {page} ({script})")


def test_readme_python_runs_as_written_on_a_cpu(tmp_path):
    """README.md's python, run as a newcomer would on a laptop: a fresh interpreter with
    none of the tests' XLA flags (one CPU device until the example asks for more)."""
    code = [b.code for b in blocks(README) if runs(b)]
    assert code, "README.md has no python block"
    script = tmp_path / "readme.py"
    script.write_text("\n".join(code))
    bare = {k: v for k, v in env().items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=bare,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"README.md's python failed:\n{proc.stderr[-5000:]}"
    assert "all-gather" in proc.stdout  # the ledger it prints


def test_skipped_python_blocks_compile():
    for b in ALL:
        if b.lang == "python" and (b.marker or "").startswith("skip"):
            compile(b.code, b.where, "exec")


# ------------------------------------------------------------------- bash


BASH_RUN = [b for b in ALL if b.lang == "bash" and b.marker == "run"]


@pytest.mark.slow
@pytest.mark.parametrize("block", BASH_RUN, ids=[b.where for b in BASH_RUN])
def test_bash_blocks_run(block, tmp_path):
    (tmp_path / "docs").symlink_to(DOCS)
    # A block's commands that compile the same programs (a run, then its resumption) find
    # them in a compilation cache of the block's own.
    cache = {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    bash = ["bash", "-euo", "pipefail", "-c", block.code]
    run(bash, tmp_path, f"the bash block {block.where}", **cache)


# ------------------------------------------------------------------- generated tables


@pytest.mark.slow
def test_concepts_ledger_table_is_what_the_script_prints():
    spec = importlib.util.spec_from_file_location("ledger_table", DOCS / "ledger_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = (DOCS / "concepts.md").read_text()
    shown = text.split("<!-- ledger-table:start -->\n", 1)[1].split("<!-- ledger-table:end -->")[0]
    assert shown == module.table(), (
        "docs/concepts.md's ledger table is stale: replace it with the output of "
        "`python docs/ledger_table.py`"
    )
