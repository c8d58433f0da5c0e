"""What code a run ran: the git commit of this package's source tree, whether the tree was
dirty, and the versions of the packages the numbers depend on.

Every results file and every trainer `run.json` records it, so that a study compares runs
of one commit and a finished run is reused only by the same code.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import platform
import subprocess
from typing import Any

SOURCE = pathlib.Path(__file__).resolve().parents[1]
"""The directory holding the `zeropp_jax` package (the repository root when checked out)."""

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
"""The packages whose versions a run records."""


def _git(*args: str) -> str:
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")  # read-only: never take the index lock
    return subprocess.run(
        ["git", "-C", str(SOURCE), *args],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
        env=env,
    ).stdout


def package_versions() -> dict[str, str | None]:
    """`{package: version}` for `PACKAGES` (None when one is not installed)."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def provenance() -> dict[str, Any]:
    """The code and packages of this process.

    Returns:
      `{"commit": full hash or None, "dirty": bool or None, "changed": [paths that differ
      from the commit, tracked files only], "python": version, "packages": {name:
      version}}`. `commit` and `dirty` are None when the source is not a git checkout
      (an installed wheel), with the reason under `"git_error"`.
    """
    record: dict[str, Any] = {
        "commit": None,
        "dirty": None,
        "changed": [],
        "python": platform.python_version(),
        "packages": package_versions(),
    }
    try:
        record["commit"] = _git("rev-parse", "HEAD").strip()
        changed = [line[3:] for line in _git("status", "--porcelain", "-uno").splitlines()]
    except (OSError, subprocess.SubprocessError) as e:
        record["git_error"] = str(e).strip() or type(e).__name__
        return record
    record["dirty"] = bool(changed)
    record["changed"] = changed
    return record


def describe(record: dict[str, Any]) -> str:
    """One line: `commit <short hash>, clean tree` or `..., tree dirty (<paths>)`."""
    if record.get("commit") is None:
        return f"commit unknown ({record.get('git_error', 'not a git checkout')})"
    head = record["commit"][:7]
    if not record["dirty"]:
        return f"commit {head}, clean tree"
    return f"commit {head}, tree dirty ({', '.join(record['changed'])})"


def same_code(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two records ran the same code: one clean commit, the same package versions."""
    return (
        a.get("commit") is not None
        and a.get("commit") == b.get("commit")
        and a.get("dirty") is False
        and b.get("dirty") is False
        and a.get("packages") == b.get("packages")
    )
