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

OUTPUTS = ("experiments/results/",)
"""Where the studies write their results (tracked files): a change there is not a change of
code, so a study that writes its outputs as it goes still runs one clean commit."""


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
      version}}`. `dirty` is whether any changed path holds code (outside `OUTPUTS`).
      `commit` and `dirty` are None when the source is not a git checkout (an installed
      wheel), with the reason under `"git_error"`.
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
    record["dirty"] = bool(_code_changes(changed))
    record["changed"] = changed
    return record


def _code_changes(changed: list[str]) -> list[str]:
    return [path for path in changed if not path.startswith(OUTPUTS)]


def _clean_code(record: dict[str, Any]) -> bool:
    """A known commit with no change of code (records written before `OUTPUTS` existed
    called results-only changes dirty: they count as clean here)."""
    if record.get("commit") is None or record.get("dirty") is None:
        return False
    return not _code_changes(record.get("changed", []))


def describe(record: dict[str, Any]) -> str:
    """One line: `commit <short hash>, clean tree` or `..., tree dirty (<paths>)`."""
    if record.get("commit") is None:
        return f"commit unknown ({record.get('git_error', 'not a git checkout')})"
    head = record["commit"][:7]
    if not _clean_code(record):
        return f"commit {head}, tree dirty ({', '.join(_code_changes(record['changed']))})"
    if record.get("changed"):
        return f"commit {head}, clean code (results files changed: {len(record['changed'])})"
    return f"commit {head}, clean tree"


def same_code(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two records ran the same code: one commit with no change of code (results
    files aside), the same package versions."""
    return (
        _clean_code(a)
        and _clean_code(b)
        and a.get("commit") == b.get("commit")
        and a.get("packages") == b.get("packages")
    )
