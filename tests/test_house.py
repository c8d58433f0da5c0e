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


EXPERIMENTS = LIBRARY.parent / "experiments"
PRIVATE_PACKAGES = ("interpreter", "measure", "state")


def _is_private(name: str) -> bool:
    """A dotted name inside zeropp_jax that reaches a private module: one whose name, or a
    package's above it, starts with `_`, or one in a private package."""
    parts = name.split(".")
    if parts[0] != "zeropp_jax" or len(parts) == 1:
        return False
    inner = parts[1:]
    return inner[0] in PRIVATE_PACKAGES or any(p.startswith("_") for p in inner)


def _private_imports(source: str) -> list[tuple[int, str]]:
    """`(line, name)` for each import of a private zeropp_jax module or of a name from one
    (`from zeropp_jax.wire import _rotation` names `zeropp_jax.wire._rotation`)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module + "." + a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if _is_private(n)]
    return out


def test_experiments_read_private_names_only_through_their_declaration():
    found = [
        f"{p.relative_to(EXPERIMENTS)}:{line} {name}"
        for p in sorted(EXPERIMENTS.rglob("*.py"))
        if p.name != "_library.py"
        for line, name in _private_imports(p.read_text())
    ]
    assert not found, "import these through experiments/_library.py:\n" + "\n".join(found)


def test_the_private_import_finder_finds_them():
    probe = (
        "import zeropp_jax\n"
        "from zeropp_jax import shard, _choices\n"
        "from zeropp_jax.wire import quant, _rotation\n"
        "from zeropp_jax.measure._hlo_text import array_shapes\n"
        "import zeropp_jax.state._partition\n"
        "from zeropp_jax.wire.reductions import TwoHop\n"
        "from zeropp_jax.train import cli\n"
    )
    assert [line for line, _ in _private_imports(probe)] == [2, 3, 4, 5]
