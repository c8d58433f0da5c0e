"""The trainer on two jax lines at one commit: `zeropp-train` (default flags, the same seed)
under each given Python / jax, on its own interpreter's standard library (what a user runs)
and on one shared copy of a corpus (what tells jax's part from the corpus's).

    python experiments/jax_versions.py --python .venv/bin/python .venv313/bin/python \
        --steps 200 --out experiments/results/jax_versions

Each run's `run.json` (commit, dirty flag, package versions) and `summary.json` are kept
under `--out`; the table is `jax_versions.{md,csv}`. The shared corpus is the first
interpreter's standard library `.py` files, copied (site-packages left out, as the trainer
leaves them out) so that every run reads the same bytes through `--data`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

COPY = (
    "import os, shutil, sys\n"
    "from zeropp_jax.train import data\n"
    "root, dst = data.stdlib_dir(), sys.argv[1]\n"
    "for rel in data.list_source_files(root):\n"
    "    os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)\n"
    "    shutil.copyfile(os.path.join(root, rel), os.path.join(dst, rel))\n"
    "print(root)\n"
)


TAG = "import sys, jax; v = sys.version_info; print(f'py{v[0]}{v[1]}_jax{jax.__version__}')"
"""Prints a run's folder name: its Python and jax versions."""


def run(python: str, out: pathlib.Path, steps: int, seed: int, data: str | None) -> dict:
    """One trainer run; its provenance and summary."""
    cmd = [python, "-m", "zeropp_jax.train", "--steps", str(steps), "--seed", str(seed)]
    cmd += ["--out", str(out)] + (["--data", data] if data else [])
    subprocess.run(cmd, check=True, timeout=3600, stdout=subprocess.DEVNULL)
    prov = json.loads((out / "run.json").read_text())["provenance"]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "python": prov["python"],
        "jax": prov["packages"]["jax"],
        "commit": prov["commit"][:7],
        "dirty": prov["dirty"],
        "train_loss": round(summary["final_train_loss"], 4),
        "val_loss": round(summary["final_val_loss"], 4),
        "link_M": round(summary["ledger"]["ZeRO++"]["link_M"], 4),
        "wall_s": round(summary["wall_s"], 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", nargs="+", required=True, help="interpreters, one per jax line")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=_common.study_dir("jax_versions"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shared = pathlib.Path(tmp) / "corpus"
        src = subprocess.run(
            [args.python[0], "-c", COPY, str(shared)], check=True, capture_output=True, text=True
        ).stdout.strip()
        for corpus, data in (("own stdlib", None), (f"shared copy of {src}", str(shared))):
            for py in args.python:
                tag = subprocess.run(
                    [
                        py,
                        "-c",
                        TAG,
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.strip()
                name = f"{tag}_{'own' if data is None else 'shared'}"
                out = args.out / name
                shutil.rmtree(out, ignore_errors=True)
                row = {"corpus": corpus, **run(py, out, args.steps, args.seed, data)}
                shutil.rmtree(out / "checkpoints", ignore_errors=True)
                print(row, flush=True)
                rows.append(row)
    cols = list(rows[0])
    _common.write_csv(args.out / "jax_versions.csv", rows, cols)
    lines = [
        "# The trainer on two jax lines",
        "",
        f"`zeropp-train --steps {args.steps} --seed {args.seed}` (default flags: the scanned GPT, "
        'ZeRO++ on a 2 x 4 mesh), final losses in nats per byte. "own stdlib": each '
        "interpreter's standard library, as a user runs it (Python 3.11 and 3.13 ship "
        'different files, so the splits differ); "shared copy": the same files for every run.',
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
        *("| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows),
    ]
    (args.out / "jax_versions.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
