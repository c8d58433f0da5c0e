"""docs/api.md documents the public names and the extension points, and nothing else.

The public names are `zeropp_jax.__all__`, the command-line entry points (`[project.scripts]`
of pyproject.toml, and the `python -m` modules below) and the extension points below. Every
one has a `###` heading on the page; every `###` heading names one of them, and so does every
`:::` line (the docstring mkdocs renders), so an internal cannot creep back onto the page.
"""

from __future__ import annotations

import importlib
import pathlib
import re
import tomllib
from typing import Any

import pytest

import zeropp_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"

EXTENSION_POINTS = (
    # The collectives, for your own `jax.shard_map`.
    "zeropp_jax.wire.collectives.all_gather_quantized",
    "zeropp_jax.wire.collectives.hierarchical_all_gather",
    "zeropp_jax.wire.reductions.reduce_scatter_quantized",
    "zeropp_jax.wire.reductions.two_hop_reduce_scatter",
    "zeropp_jax.wire.reductions.TwoHop",
    # The codec they quantize with.
    "zeropp_jax.wire.quant.Codec",
)
"""The extension points the page promises, each with a `###` heading."""
EXTENSION_HELPERS = ("zeropp_jax.wire.quant.XLA_CODEC", "zeropp_jax.wire.kernels.pallas_codec")
"""The codecs that are built, documented under `zeropp_jax.wire.quant.Codec`."""
MODULE_ENTRY_POINTS = ("zeropp_jax.launch",)
"""Modules run as `python -m` (`python -m zeropp_jax.train` is `zeropp-train`)."""
ENTRY_POINT_HELPERS = ("zeropp_jax.launch.initialize_from_env",)
"""What a worker started by the launcher calls, documented under it."""

HEADING = re.compile(r"^(#{1,6}) (.+?)\s*$")
DIRECTIVE = re.compile(r"^::: (\S+)\s*$")
CODE = re.compile(r"`([^`]+)`")


def resolve(dotted: str) -> Any:
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def page_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def headings(text: str, level: int) -> list[str]:
    """The text of every heading of `level`."""
    found = [HEADING.match(line) for line in page_lines(text)]
    return [m.group(2) for m in found if m and len(m.group(1)) == level]


def directives(text: str) -> list[str]:
    """The object every `:::` line names."""
    found = [DIRECTIVE.match(line) for line in page_lines(text)]
    return [m.group(1) for m in found if m]


def public_names() -> list[str]:
    return [f"zeropp_jax.{name}" for name in zeropp_jax.__all__]


def scripts() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return sorted(project["scripts"])


def promised_headings() -> list[str]:
    """What the `###` headings name, as code spans: each once, nothing else."""
    modules = [f"python -m {module}" for module in MODULE_ENTRY_POINTS]
    return [*public_names(), *EXTENSION_POINTS, *scripts(), *modules]


def names_in(heading: str) -> list[str]:
    return CODE.findall(heading)


def check(text: str) -> list[str]:
    """Every way `text` (an api.md) breaks the rules, as messages; [] when it keeps them."""
    problems = []
    named = [name for h in headings(text, 3) for name in names_in(h)]
    for h in headings(text, 3):
        if not names_in(h):
            problems.append(f"### {h}: a heading names one public name, in backticks")
    promised = promised_headings()
    for name in named:
        if name not in promised:
            problems.append(
                f"### `{name}`: not in zeropp_jax.__all__, not an extension point of "
                "tests/test_api_doc.py and not a [project.scripts] entry; internals get no "
                "heading (export it, or promise it in EXTENSION_POINTS)"
            )
    for name in promised:
        if name not in named:
            problems.append(f"{name} has no ### heading in docs/api.md")
    rendered = [*public_names(), *EXTENSION_POINTS, *EXTENSION_HELPERS, *ENTRY_POINT_HELPERS]
    objects = [resolve(name) for name in rendered]
    for target in directives(text):
        try:
            obj = resolve(target)
        except (ModuleNotFoundError, AttributeError):
            problems.append(f"::: {target}: names nothing importable")
            continue
        if not any(obj is o for o in objects):
            problems.append(f"::: {target}: renders an internal; only public names get one")
    return problems


def test_api_md_documents_the_public_names_and_nothing_else():
    assert check(API.read_text()) == []


@pytest.mark.parametrize(
    "name", [*EXTENSION_POINTS, *EXTENSION_HELPERS, *MODULE_ENTRY_POINTS, *ENTRY_POINT_HELPERS]
)
def test_every_promised_name_exists(name):
    resolve(name)


def test_the_check_fails_without_a_public_heading():
    text = API.read_text()
    assert "### `zeropp_jax.make_mesh`\n" in text
    problems = check(text.replace("### `zeropp_jax.make_mesh`\n", ""))
    assert problems == ["zeropp_jax.make_mesh has no ### heading in docs/api.md"]


@pytest.mark.parametrize(
    "extra",
    [
        "### `zeropp_jax.interpreter._layered_scan.run`\n",
        "### `layered_scan.run`\n",
        "::: zeropp_jax.interpreter._indexed_scan.over_layers\n",
        "::: zeropp_jax.interpreter._leaf_gathers.LeafGathers\n",
    ],
)
def test_the_check_fails_for_an_internal(extra):
    problems = check(API.read_text() + "\n" + extra)
    assert len(problems) == 1, problems
