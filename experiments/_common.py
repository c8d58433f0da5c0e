"""Helpers shared by the experiment scripts: device setup, the machine line, table writers,
and a study's variants, folders and log.

Import this module before `jax` in a script that needs emulated CPU devices: it asks XLA
for them (`--xla_force_host_platform_device_count`) unless the caller already did.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def request_cpu_devices(count: int) -> None:
    """Asks XLA for `count` emulated CPU devices (no effect once jax has started)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def machine_line() -> str:
    """Date, platform, CPU count, jax version and devices, then the code (`source_version`)
    and the package versions: the head of every output."""
    import jax
    from _library import package_versions

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    packages = ", ".join(f"{k} {v}" for k, v in package_versions().items() if k != "jax")
    return (
        f"{now}; {platform.platform()}; python {platform.python_version()}; "
        f"{os.cpu_count()} CPUs; jax {jax.__version__} ({jax.default_backend()}, "
        f"{jax.device_count()} devices); {source_version()}; {packages}"
    )


def source_version() -> str:
    """`commit <short hash>`, plus the paths that differ from it when the tree is dirty."""
    from _library import describe, provenance

    return describe(provenance())


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A GitHub markdown table; `align` is one character per column, `l` or `r`."""
    align = align or "l" * len(head)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_csv(
    path: pathlib.Path, rows: Sequence[Mapping[str, Any]], fieldnames: Sequence[str] = ()
) -> None:
    """Writes dict rows under the header `fieldnames` (default: the first row's keys; a
    header alone when there are no rows)."""
    if not fieldnames and not rows:
        raise ValueError(f"write_csv({path}): no rows and no fieldnames; nothing to head it.")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fieldnames or rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_text(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def shown(path: pathlib.Path) -> str:
    """`path` relative to the repository root when it lies inside it."""
    try:
        return str(pathlib.Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def say_written(paths: Sequence[pathlib.Path]) -> None:
    for p in paths:
        print(f"wrote {shown(p)}")


def worker_rows(cmd: Sequence[str], what: str) -> list[dict[str, Any]]:
    """Runs a worker process `cmd` (with the caller's XLA_FLAGS less the device count, so
    that it asks for its own devices) and returns the JSON rows it prints, one per line,
    echoing each. Raises SystemExit with the end of its stderr if it fails; `what` names it
    in that message."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    if flags:  # e.g. the tests' quick compiles (tests/conftest.py)
        env["XLA_FLAGS"] = " ".join(flags)
    proc = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=6 * 3600)
    if proc.returncode:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        print(row, flush=True)
    return rows


def write_table(out: pathlib.Path, name: str, head: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Writes `name.csv` (the rows) and `name.md` (`head`, then the rows as a table) into
    `out`, and says so."""
    write_csv(out / f"{name}.csv", rows)
    table = markdown_table(list(rows[0]), [list(r.values()) for r in rows])
    write_text(out / f"{name}.md", head + table)
    say_written([out / f"{name}.md", out / f"{name}.csv"])


def worker_or_parent(argv: Sequence[str] | None, worker: Any) -> list[str] | None:
    """For a script that re-runs itself as `--worker ...`: runs `worker` on the rest of
    `argv` and returns None when `argv` starts with `--worker`; else returns `argv`
    (`sys.argv[1:]` when None) for the parent to parse."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(argv[1:])
        return None
    return argv


def chosen_variants(
    parser: argparse.ArgumentParser, text: str | None, known: Iterable[str], default: Sequence[str]
) -> tuple[str, ...]:
    """The variants a `--variants` flag names (comma-separated, in its order), or `default`
    when it is not given (`text` None or empty); `parser.error`s on a name not in `known`."""
    known = list(known)
    if not text:
        return tuple(default)
    names = tuple(v.strip() for v in text.split(","))
    unknown = [v for v in names if v not in known]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {known}")
    return names


def study_dir(name: str) -> pathlib.Path:
    """The folder a study writes by default, `experiments/results/<name>/` (made).

    `name` is the study's, usually its script's name: every results file lives in the
    folder of the study that wrote it, and none at the top of `experiments/results/`.
    """
    path = RESULTS / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def study_dirs(
    out: pathlib.Path | None, quick: bool, name: str
) -> tuple[pathlib.Path, pathlib.Path]:
    """A study's output folder and the folder of its runs (made).

    With the `--out` flag `out`, the tables go to `out` and the runs to `<out>/<name>`; with
    `--quick`, to `runs/<name>_quick` and its `<name>`; by default both go to the study's
    folder, `study_dir(name)`.
    """
    if out is None and not quick:
        root = study_dir(name)
        return root, root
    out = out or ROOT / "runs" / f"{name}_quick"
    root = out / name
    root.mkdir(parents=True, exist_ok=True)
    return out, root


def random_token_batches(
    steps: int, batch: int, seq: int, vocab: int, seed: int = 0
) -> list[dict[str, Any]]:
    """`steps` batches of uniform random token ids for a language-model probe: `tokens` and
    next-token `targets` (`(batch, seq)` int32, one draw of `seq + 1` ids per row) and
    `positions` (`0 ... seq - 1` per row)."""
    import numpy as np

    rs = np.random.RandomState(seed)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    out = []
    for _ in range(steps):
        t = rs.randint(0, vocab, (batch, seq + 1)).astype(np.int32)
        out.append({"tokens": t[:, :-1], "positions": positions.copy(), "targets": t[:, 1:]})
    return out


def file_logger(path: pathlib.Path) -> Callable[[str], None]:
    """A `log(msg)` that prints `[HH:MM:SS] msg` and appends that line to `path`."""

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with open(path, "a") as f:
            f.write(line + "\n")

    return log
