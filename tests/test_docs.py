"""The code in docs/ runs: every python block, the bash blocks marked to run, the tables.

Fenced blocks of docs/*.md:

* ```python blocks run, all blocks of one page in order in one fresh interpreter (like a
  notebook), on 8 emulated CPU devices, in a temporary directory; a block that needs a
  cluster is preceded by `<!-- docs-test: skip (reason) -->`.
* ```bash blocks run only when preceded by `<!-- docs-test: run -->` (in a temporary
  directory where `docs/` is visible); every other bash block must say why it does not
  run with `<!-- docs-test: skip (reason) -->`, so nothing that could run is forgotten.
* ```text blocks are output and never run.

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
PAGES = sorted(DOCS.glob("*.md"))
LANGUAGES = ("python", "bash", "text")
MARKER = re.compile(r"^<!-- docs-test: (run|skip \(.+\)) -->$")
FENCE = re.compile(r"^```(\S*)\s*$")
TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # "run", "skip (...)" or None

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def blocks(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of a page, with the docs-test marker right above each."""
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
            raise AssertionError(f"docs/{path.name}:{start + 1}: unclosed ``` block")
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k].strip()) if k >= 0 else None
        code = "\n".join(lines[start + 1 : j]) + "\n"
        out.append(Block(path.name, start + 1, lang, code, marker.group(1) if marker else None))
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]


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


# ------------------------------------------------------------------- python


PYTHON_PAGES = sorted(
    {b.page for b in ALL if b.lang == "python" and not (b.marker or "").startswith("skip")}
)


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks_run(page, tmp_path):
    parts = []
    for b in blocks(DOCS / page):
        if b.lang == "python" and not (b.marker or "").startswith("skip"):
            parts.append(f"# ---- {b.where}\n{b.code}")
    script = tmp_path / f"{page.removesuffix('.md')}_blocks.py"
    script.write_text("\n".join(parts))
    run([sys.executable, str(script)], tmp_path, f"the python blocks of docs/{page} ({script})")


def test_readme_python_runs_as_written_on_a_cpu(tmp_path):
    """README.md's python, run as a newcomer would on a laptop: a fresh interpreter with
    none of the tests' XLA flags (one CPU device until the example asks for more)."""
    code = [b.code for b in blocks(ROOT / "README.md") if b.lang == "python"]
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
