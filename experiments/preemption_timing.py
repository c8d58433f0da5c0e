"""How long `zeropp-train` takes from SIGTERM to exit, against its step time.

    python experiments/preemption_timing.py             # the default model, 3 trials
    python experiments/preemption_timing.py --trials 1 -- --d-model 32 --n-layers 1

Starts `zeropp-train` (default flags plus any given after `--`), waits until its
metrics show step `--at` (plus a random 0-4 steps), sends SIGTERM, and measures the time
until the process has exited, then checks that it exited with status 3 and left a
checkpoint of its last step. Step time: the median interval between consecutive steps as
they appear in `metrics.jsonl`, watched every 5 ms. Writes `preemption_timing.md` and
`.csv` into `--out` (default `experiments/results/preemption_timing/`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from _common import machine_line, markdown_table, request_cpu_devices, study_dir, write_csv

request_cpu_devices(8)  # what the trainer runs on (for the machine line)


def _steps(path: pathlib.Path) -> list[int]:
    try:
        with open(path) as f:
            return [json.loads(line)["step"] for line in f if '"loss"' in line]
    except (OSError, ValueError):
        return []


def trial(at: int, extra: list[str], seed: int, timeout: float = 900.0) -> dict:
    """One run: SIGTERM once step `at + random(0..4)` is logged; returns the timings."""
    target = at + random.Random(seed).randint(0, 4)
    with tempfile.TemporaryDirectory(prefix="zeropp_preempt_") as tmp:
        out = pathlib.Path(tmp) / "run"
        cmd = [sys.executable, "-m", "zeropp_jax.train", "--steps", "100000", "--no-progress"]
        cmd += ["--save-every", "0", "--eval-every", "0", "--out", str(out), *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                for s in _steps(out / "metrics.jsonl"):
                    seen.setdefault(s, time.monotonic())
                if seen and max(seen) >= target:
                    break
                time.sleep(0.005)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            output, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
        exited = time.monotonic()
        last = max(_steps(out / "metrics.jsonl"))
        checkpoints = sorted(os.listdir(out / "checkpoints"))
    times = [seen[s] for s in sorted(seen)]
    intervals = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {
        "signal_at_step": max(seen),
        "stopped_after_step": last,
        "status": proc.returncode,
        "checkpoint": checkpoints[-1] if checkpoints else "",
        "sigterm_to_exit_s": round(exited - sent, 3),
        "step_s_median": round(statistics.median(intervals), 4) if intervals else None,
        "line": next((ln for ln in output.splitlines() if "stopped by" in ln), ""),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--at", type=int, default=20, help="signal after about this step (20)")
    p.add_argument("--out", default=str(study_dir("preemption_timing")))
    p.add_argument("extra", nargs="*", help="zeropp-train flags, after --")
    args = p.parse_args(argv)
    machine = machine_line()
    rows = [trial(args.at, args.extra, seed) for seed in range(args.trials)]
    for r in rows:
        ok = r["status"] == 3 and r["checkpoint"] == f"step_{r['stopped_after_step']}"
        r["ok"] = ok
        print(r, flush=True)
    out = pathlib.Path(args.out)
    write_csv(out / "preemption_timing.csv", rows)
    head = ["SIGTERM after step", "stopped after step", "status", "checkpoint"]
    head += ["SIGTERM to exit (s)", "step time, median (s)", "status 3 and checkpoint of the step"]
    body = [[r[k] for k in list(r)[:6]] + [r["ok"]] for r in rows]
    flags = " ".join(args.extra) or "default flags"
    text = (
        "# zeropp-train: SIGTERM to exit\n\n"
        f"{machine} (this script's process); `zeropp-train` with {flags}, "
        f"SIGTERM once the metrics show step {args.at} + random 0-4.\n\n"
        + markdown_table(head, body, "rrrlrrl")
        + f"\nThe line it printed: `{rows[0]['line']}`\n"
    )
    (out / "preemption_timing.md").write_text(text)
    print(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
