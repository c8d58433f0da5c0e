"""Compiled step memory per device of the stored layouts, each at the commit that has it.

    python experiments/layout_memory.py                       # the default commits
    python experiments/layout_memory.py --commits 7e0b3d9,HEAD --models gpt

The optimizer's model-shaped view (issue #31) changed how parameters are stored: layout 1
(before it) ran the optimizer on each stacked leaf flattened per layer; layout 2 kept that
storage and gave the optimizer reshaped views, which made XLA copy the stacked moments and
gradients; layout 3 stores stacked leaves in their padded model shape. For each commit,
the script extracts `zeropp_jax/` from git into a temporary folder and compiles, in a
worker process that imports that copy, the training step of the trainer's GPT and of
`--model 1.3b` / `--model 6.7b` (full remat, 256 tokens, batch 8, 2 x 4 mesh) as
`experiments/memory.py` builds it: `memory_analysis()` per device (temporaries and
arguments). Nothing but the commit differs between rows of one model and engine.

Writes `layout_memory.md` and `layout_memory.csv` into `--out` (default
`experiments/results`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

from _common import ROOT, machine_line, study_dir, worker_or_parent, worker_rows, write_table

COMMITS = {
    "7e0b3d9": "1 (optimizer on flat storage)",
    "7934da3": "2 (model-shaped views of flat storage)",
    "HEAD": "3 (stored in padded model shape)",
}
MODELS = {
    "gpt": [],
    "1.3b": ["--model", "1.3b", "--remat", "full", "--seq-len", "256", "--batch", "8"],
    "6.7b": ["--model", "6.7b", "--remat", "full", "--seq-len", "256", "--batch", "8"],
}
ENGINES = ("ZeRO-3", "ZeRO++")
GB = 1e9


def worker(argv: list[str]) -> None:
    """`TREE MODELS`: imports `zeropp_jax` from the folder `TREE` and prints one JSON row
    per (model, engine): compiled memory per device."""
    import os

    sys.path.insert(0, argv[0])  # before this checkout's root, which `_common` put first
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeropp_jax as zpp
    from zeropp_jax.train.cli import make_optimizer, train_step
    from zeropp_jax.train.flags import gpt_config, parse_args
    from zeropp_jax.train.model import GPT, init_fn

    for model in argv[1].split(","):
        args = parse_args(MODELS[model])
        gpt = gpt_config(args)
        mesh = zpp.make_mesh(2, 4, devices=jax.devices()[:8])
        # The batch over all devices, node-major: spelled here, not imported, since the
        # copy of another commit may keep its layout module elsewhere.
        spec = NamedSharding(mesh, P(("node", "local")))
        batch = jax.ShapeDtypeStruct((args.batch, gpt.seq_len + 1), jnp.int32, sharding=spec)
        for engine in ENGINES:
            config = zpp.ZeroPPConfig.zero3() if engine == "ZeRO-3" else zpp.ZeroPPConfig()
            state = zpp.TrainState.abstract(
                apply_fn=GPT(gpt).apply,
                params=init_fn(gpt, 0),
                tx=make_optimizer(args),
                mesh=mesh,
                config=config,
            )
            step = zpp.shard(train_step, donate_state=True)
            m = step.lower(state, batch).compile().memory_analysis()
            row = {
                "model": model,
                "engine": engine,
                "temp": m.temp_size_in_bytes,
                "arguments": m.argument_size_in_bytes,
                "package": zpp.__file__,
            }
            print(json.dumps(row), flush=True)


def extract(commit: str, into: pathlib.Path) -> str:
    """`zeropp_jax/` of `commit` into `into`; returns the commit's short id."""
    short = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", commit],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", short, "zeropp_jax"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return short


def main(argv: list[str] | None = None) -> None:
    argv = worker_or_parent(argv, worker)
    if argv is None:
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--commits", default=",".join(COMMITS), help="commits, comma-separated")
    p.add_argument("--models", default=",".join(MODELS), help=f"of {sorted(MODELS)}")
    p.add_argument("--out", type=pathlib.Path, default=study_dir("layout_memory"))
    args = p.parse_args(argv)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        raise SystemExit(
            f"layout_memory: unknown models {sorted(unknown)}; expected {sorted(MODELS)}."
        )
    rows = []
    for commit in args.commits.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            short = extract(commit, pathlib.Path(tmp))
            cmd = [sys.executable, __file__, "--worker", tmp, args.models]
            for r in worker_rows(cmd, f"layout_memory worker at {short}"):
                if not r["package"].startswith(tmp):
                    raise SystemExit(
                        f"layout_memory: the worker imported {r['package']}, not {tmp}."
                    )
                rows.append(
                    {
                        "model": r["model"],
                        "engine": r["engine"],
                        "commit": short,
                        "layout": COMMITS.get(commit, ""),
                        "temp GB": f"{r['temp'] / GB:.3f}",
                        "arguments GB": f"{r['arguments'] / GB:.3f}",
                        "total GB": f"{(r['temp'] + r['arguments']) / GB:.3f}",
                    }
                )
    rows.sort(key=lambda r: (list(MODELS).index(r["model"]), r["engine"]))
    head = (
        "# Compiled step memory per device, per stored layout\n\n"
        f"{machine_line()}\n\n"
        f"Command: `python experiments/layout_memory.py --commits {args.commits} "
        f"--models {args.models}`. Each row compiles the training step (AdamW, 2 x 4 mesh, "
        "the trainer's GPT at its defaults; 1.3b and 6.7b with full remat, 256 tokens, batch "
        "8) with `zeropp_jax/` as it is at the row's commit; `memory_analysis()` per device.\n\n"
    )
    write_table(args.out, "layout_memory", head, rows)


if __name__ == "__main__":
    main()
