"""A 350M-parameter scanned GPT trained for a few steps on 8 emulated CPU devices.

    python experiments/giant_cpu.py              # --model 350m, 6 steps (~15 min on 2 cores)
    python experiments/giant_cpu.py --quick      # the tiny preset, 3 steps

Runs `zeropp-train --model 350m --seq-len 128 --batch 8 --remat full` (full ZeRO++ on the
2 x 4 mesh; the parameters made by sharded init, so no device and not the host ever holds
the unsharded tree) as a child process, and reports the loss of every step, the step time
(the trainer's tokens/s, first step excluded), the wall time and the child's peak resident
memory (`getrusage(RUSAGE_CHILDREN).ru_maxrss`: all 8 emulated devices live in that one
process). Writes `giant_cpu.{md,csv}` into `--out` (default `experiments/results/giant_cpu/`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.request_cpu_devices(8)  # what the trainer runs on (for the machine line)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="350m")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="the tiny preset, 3 steps")
    p.add_argument("--out", default=str(_common.study_dir("giant_cpu")))
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.steps = "tiny", 3
    machine = _common.machine_line()  # before this run writes anything into the tree
    flags = [
        *("--model", args.model, "--seq-len", "128", "--batch", "8", "--remat", "full"),
        *("--steps", str(args.steps), "--warmup", "0", "--lr", "1e-3"),
        *("--eval-every", "0", "--eval-batches", "1", "--save-every", "0"),
        *("--no-ledger", "--no-progress"),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "zeropp_jax.train", *flags, "--out", tmp]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * 3600)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise SystemExit(f"giant_cpu.py: the trainer failed:\n{proc.stderr[-3000:]}")
        peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        summary = json.loads((pathlib.Path(tmp) / "summary.json").read_text())
        steps = [
            json.loads(line)
            for line in (pathlib.Path(tmp) / "metrics.jsonl").read_text().splitlines()
        ]
    losses = [r["loss"] for r in steps if "loss" in r]
    tokens_per_step = 8 * 128
    rows = [
        {
            "model": args.model,
            "params_M": round(summary["param_count"] / 1e6, 1),
            "steps": args.steps,
            "first_loss": round(losses[0], 4),
            "last_loss": round(losses[-1], 4),
            "losses": " ".join(f"{v:.3f}" for v in losses),
            "step_s": round(tokens_per_step / summary["tokens_per_s"], 2),
            "wall_s": round(wall, 1),
            "peak_rss_GB": round(peak_kb * 1024 / 1e9, 2),
        }
    ]
    name = "giant_cpu_quick" if args.quick else "giant_cpu"
    head = (
        f"# A {rows[0]['params_M']}M-parameter scanned GPT on 8 emulated CPU devices\n\n"
        f"{machine}.\n\n`zeropp-train {' '.join(flags)}` (ZeRO++, 2 x 4 mesh, sharded "
        "init). `step_s`: seconds per step from the trainer's tokens/s (first step, which "
        "compiles, excluded); `wall_s`: the whole process, start-up, compile, the final "
        "evaluation and checkpoint included; `peak_rss_GB`: the trainer process's peak "
        "resident memory (all 8 devices live in it).\n\n"
    )
    _common.write_table(pathlib.Path(args.out), name, head, rows)
    return rows


if __name__ == "__main__":
    main()
