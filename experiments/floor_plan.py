"""The library's floor plan at two commits, side by side (issue #51's figures).

    python experiments/floor_plan.py                      # 24865af^ against the checkout
    python experiments/floor_plan.py --before <commit> --after <commit>

Read from the source alone (nothing is imported or run): modules per package (public and
private: a module is private when its name, or a package above it, starts with `_`),
library lines, functions over 80 and over 120 lines and the longest one, the methods of the
interpreter's contract with the wire (`class Gathers`), and README's length. `--before`
and `--after` are git commits; `--after` left out reads the working tree. Writes
`floor_plan.md`, `floor_plan.csv` and `floor_plan.png` into `--out-dir`
(default `experiments/results/floor_plan/`).
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from _common import source_version, study_dir, write_csv  # noqa: E402

DEFAULT_BEFORE = "24865af^"
"""The library when issue #51 was filed: 42 flat modules."""
LIBRARY = "zeropp_jax"
LONG, LONGEST = 80, 120


@dataclasses.dataclass(frozen=True)
class Plan:
    """One commit's floor plan."""

    label: str
    modules: dict[str, tuple[int, int]]  # package -> (public, private) modules
    lines: int
    over_long: int
    over_longest: int
    longest: tuple[int, str]
    gathers_methods: int
    readme_lines: int


def _files(commit: str | None) -> dict[str, str]:
    """Path -> text of the library's Python files and README at `commit` (None: the tree)."""
    if commit is None:
        paths = [p.relative_to(ROOT).as_posix() for p in (ROOT / LIBRARY).rglob("*.py")]
        return {p: (ROOT / p).read_text() for p in [*paths, "README.md"]}
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", commit, LIBRARY],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    paths = [p for p in listed if p.endswith(".py")] + ["README.md"]
    return {
        p: subprocess.run(
            ["git", "show", f"{commit}:{p}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        for p in paths
    }


def _package(path: str) -> tuple[str, bool]:
    """The package a module sits in (relative to the library) and whether it is private."""
    parts = pathlib.PurePosixPath(path).parts[1:]
    package = "/".join(parts[:-1]) or "(top)"
    private = any(p.startswith("_") and p != "__init__.py" for p in parts)
    return package, private


def floor_plan(label: str, commit: str | None) -> Plan:
    """The floor plan of the library at `commit` (None: the working tree)."""
    files = _files(commit)
    modules: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    lengths: list[tuple[int, str]] = []
    gathers = 0
    lines = 0
    for path, text in sorted(files.items()):
        if not path.endswith(".py"):
            continue
        lines += text.count("\n")
        if not path.endswith("__init__.py") and not path.endswith("__main__.py"):
            package, private = _package(path)
            modules[package][int(private)] += 1
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lengths.append((node.end_lineno - node.lineno + 1, f"{path}:{node.name}"))
            if isinstance(node, ast.ClassDef) and node.name == "Gathers":
                gathers = sum(isinstance(n, ast.FunctionDef) for n in node.body)
    return Plan(
        label=label,
        modules={k: (v[0], v[1]) for k, v in sorted(modules.items())},
        lines=lines,
        over_long=sum(n > LONG for n, _ in lengths),
        over_longest=sum(n > LONGEST for n, _ in lengths),
        longest=max(lengths),
        gathers_methods=gathers,
        readme_lines=files["README.md"].count("\n"),
    )


def rows(plans: list[Plan]) -> list[dict[str, str]]:
    """One row per measure, one column per commit."""

    def each(name: str, get) -> dict[str, str]:
        return {"measure": name, **{p.label: str(get(p)) for p in plans}}

    packages = sorted({k for p in plans for k in p.modules})
    out = [
        each("modules (public / private)", lambda p: _split(p.modules.values())),
        each("packages", lambda p: len(p.modules)),
    ]
    out += [each(f"  in {k}", lambda p, k=k: _split([p.modules.get(k, (0, 0))])) for k in packages]
    out += [
        each("library lines", lambda p: p.lines),
        each(f"functions over {LONG} lines", lambda p: p.over_long),
        each(f"functions over {LONGEST} lines", lambda p: p.over_longest),
        each("longest function", lambda p: f"{p.longest[1]} ({p.longest[0]})"),
        each("`Gathers` methods", lambda p: p.gathers_methods),
        each("README lines", lambda p: p.readme_lines),
    ]
    return out


def _split(counts) -> str:
    public = sum(c[0] for c in counts)
    private = sum(c[1] for c in counts)
    return f"{public + private} ({public} / {private})"


def figure(plans: list[Plan], path: pathlib.Path) -> None:
    """Four panels: modules per package, long functions, the longest, `Gathers`' methods."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    packages = sorted({k for p in plans for k in p.modules})
    width = 0.8 / len(plans)
    for i, p in enumerate(plans):
        xs = [j + i * width for j in range(len(packages))]
        axes[0].bar(xs, [sum(p.modules.get(k, (0, 0))) for k in packages], width, label=p.label)
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(packages))], packages, rotation=30)
    axes[0].set_title("modules per package")
    axes[0].legend()
    labels = [p.label for p in plans]
    axes[1].bar(labels, [p.over_long for p in plans], label=f"> {LONG} lines")
    axes[1].bar(labels, [p.over_longest for p in plans], label=f"> {LONGEST} lines")
    axes[1].set_title("long functions")
    axes[1].legend()
    axes[2].bar(labels, [p.longest[0] for p in plans])
    axes[2].axhline(LONGEST, color="k", ls="--", lw=1)
    axes[2].set_title("longest function (lines)")
    axes[3].bar(labels, [p.gathers_methods for p in plans])
    axes[3].axhline(7, color="k", ls="--", lw=1)
    axes[3].set_title("`Gathers` methods (goal 7)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default=DEFAULT_BEFORE)
    p.add_argument("--after", default=None, help="a commit; default: the working tree")
    p.add_argument("--out-dir", default=str(study_dir("floor_plan")))
    args = p.parse_args(argv)
    plans = [
        floor_plan(f"before ({args.before})", args.before),
        floor_plan(f"after ({args.after or 'this tree'})", args.after),
    ]
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = rows(plans)
    write_csv(out / "floor_plan.csv", table)
    head = list(table[0])
    md = [
        "# Floor plan of the library",
        "",
        f"`python experiments/floor_plan.py --before {args.before}`; {source_version()}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r[h] for h in head) + " |" for r in table),
        "",
        "Modules: `.py` files other than `__init__` / `__main__`; private when its name or a "
        "package above it starts with `_`. `Gathers` methods: the interpreter's contract with "
        "the wire (`class Gathers`).",
        "",
    ]
    (out / "floor_plan.md").write_text("\n".join(md))
    figure(plans, out / "floor_plan.png")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
