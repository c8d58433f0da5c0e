"""The run directory `--out`: its checks before a run starts, its checkpoints and its
metrics file.

Layout: `run.json` (the flags and the code's provenance), `metrics.jsonl` (one line per
step and per evaluation), `summary.json`, and `checkpoints/step_<n>`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from zeropp_jax.train.flag_types import UsageError

# Arguments that fix the model and the data order: a resumed run must repeat them.
_RUN_IDENTITY = (
    "d_model",
    "n_layers",
    "n_heads",
    "seq_len",
    "scan_layers",
    "vocab_size",
    "batch",
    "seed",
    "max_corpus_mb",
    "data",
    "val_data",
    "tokenizer",
)


def checkpoint_dir(out: str) -> str:
    return os.path.join(out, "checkpoints")


def latest_checkpoint(out: str) -> tuple[int, str] | None:
    """`(step, path)` of the newest `checkpoints/step_<n>` under `out`, or None."""
    root = checkpoint_dir(out)
    if not os.path.isdir(root):
        return None
    found = []
    for name in os.listdir(root):
        if name.startswith("step_") and name[5:].isdigit():
            found.append((int(name[5:]), os.path.join(root, name)))
    return max(found) if found else None


def checkpoint_path(out: str, step: int) -> str:
    return os.path.join(checkpoint_dir(out), f"step_{step}")


def open_metrics(path: str, keep_until: int):
    """Opens metrics.jsonl for appending, first dropping records after step `keep_until`
    (written by an earlier attempt past the checkpoint a resumed run starts from)."""
    if os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if json.loads(line)["step"] <= keep_until]
        with open(path, "w") as f:
            f.writelines(kept)
    return open(path, "a")


def default_out(args: argparse.Namespace) -> str:
    import jax
    import numpy as np

    if args.name:
        return os.path.join("runs", args.name)
    stamp = int(time.time())
    if jax.process_count() > 1:  # every process must agree on the directory
        from jax.experimental import multihost_utils

        stamp = int(multihost_utils.broadcast_one_to_all(np.int64(stamp)))
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S", time.localtime(stamp)))


def check_writable(out: str) -> None:
    """Raises `UsageError` unless `out` can be created and written (before any compile)."""
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".write-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UsageError(
            f"--out {out}: cannot write there ({e.strerror or e}); choose a writable directory"
        ) from None


def check_resume(out: str, args: argparse.Namespace) -> None:
    path = os.path.join(out, "run.json")
    if not os.path.exists(path):
        raise UsageError(f"--resume: {path} not found; is {out!r} the directory of a run?")
    with open(path) as f:
        saved = json.load(f)
    for key in _RUN_IDENTITY:
        if key in saved and saved[key] != getattr(args, key):
            flag = "--" + key.replace("_", "-")
            raise UsageError(
                f"--resume: the run in {out} used {flag} {saved[key]}, got {getattr(args, key)}; "
                "repeat the original value"
            )
