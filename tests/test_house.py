"""How the library's code is kept (issue #51's floor plan): no function longer than a
screenful and a half."""

import ast
import pathlib

import zeropp_jax

LIBRARY = pathlib.Path(zeropp_jax.__file__).resolve().parent
LONGEST = 120
"""Lines of the longest function the library may hold (docstring included)."""


def _lengths(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [
        (node.end_lineno - node.lineno + 1, f"{path.name}:{node.name}")
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def test_no_function_is_longer_than_the_limit():
    long = [f"{where} ({n} lines)" for p in LIBRARY.rglob("*.py") for n, where in _lengths(p)]
    long = [w for w in long if int(w.rsplit("(", 1)[1].split()[0]) > LONGEST]
    assert not long, f"split these into named steps (at most {LONGEST} lines):\n" + "\n".join(long)


def test_the_length_reader_counts_lines(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n" + "    x = 1\n" * 130 + "    return x\n")
    assert _lengths(probe)[0][0] == 132
