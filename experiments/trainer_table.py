"""The README's trainer table: `zeropp-train` on its defaults under each engine.

    python experiments/trainer_table.py              # 200 steps each (minutes)
    python experiments/trainer_table.py --steps 2 --out /tmp/t   # smoke run

Runs `zeropp-train` once per engine (ZeRO++, ZeRO-3, XLA FSDP), one after the other (or,
with `--parallel`, at the same time), with
the same flags, and writes `trainer.md` and `trainer.csv` into `--out` (default
`experiments/results`): final validation loss, unigram entropy, tokens/s (first step
excluded), wall time, and the ledger's bytes per step, per device and through each node's
link, in units of M. The run directories go to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import _engines
from _common import machine_line, markdown_table, request_cpu_devices, study_dir, write_csv

request_cpu_devices(8)  # what the trainer runs on (for the machine line)

from _library import describe  # noqa: E402

ENGINES = {name: _engines.lookup(name).flag for name in ("ZeRO++", "ZeRO-3", "XLA FSDP")}
"""Each engine's display name and its `zeropp-train --engine` value."""
WIRE = {"XLA FSDP": "XLA FSDP, 16-bit wire"}
"""The `summary.json` ledger of a run at its 16-bit width, where it has its own."""


def start(engine: str, steps: int, out: pathlib.Path, extra: list[str]) -> subprocess.Popen:
    """Starts one `zeropp-train` run writing into `out`."""
    cmd = [sys.executable, "-m", "zeropp_jax.train", "--engine", engine, "--steps", str(steps)]
    cmd += ["--out", str(out), "--no-progress", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, out: pathlib.Path) -> tuple[dict, dict]:
    """Waits for a run (an hour at most); returns its summary.json and its run.json."""
    try:
        _, err = proc.communicate(timeout=3600)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if proc.returncode:
        raise RuntimeError(f"{' '.join(proc.args)} exited {proc.returncode}:\n{err[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return summary, json.loads((out / "run.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=str(study_dir("trainer_table")))
    p.add_argument(
        "--parallel",
        action="store_true",
        help="run the engines at the same time (on a machine shared with other jobs; "
        "their tokens/s then compare runs that share the cores)",
    )
    p.add_argument("extra", nargs="*", help="more zeropp-train flags, after --")
    args = p.parse_args(argv)
    rows, codes = [], []
    with tempfile.TemporaryDirectory(prefix="zeropp_trainer_") as tmp:
        outs = {engine: pathlib.Path(tmp) / engine for engine in ENGINES.values()}
        procs = {}
        for engine in ENGINES.values() if args.parallel else ():
            procs[engine] = start(engine, args.steps, outs[engine], args.extra)
        for label, engine in ENGINES.items():
            proc = procs.get(engine) or start(engine, args.steps, outs[engine], args.extra)
            s, record = finish(proc, outs[engine])
            codes.append(describe(record["provenance"]))
            (ledger,) = [v for k, v in s["ledger"].items() if k == label]
            # XLA FSDP's wire at the partitioner's width (16-bit, as a GPU sends); the
            # engine's own collectives already cross at their width.
            wire = s["ledger"].get(WIRE.get(label), ledger)
            rows.append(
                {
                    "run": label,
                    "final_val_loss": round(s["final_val_loss"], 4),
                    "unigram_entropy": round(s["unigram_entropy_nats"], 4),
                    "tokens_per_s": round(s["tokens_per_s"]),
                    "wall_s": round(s["wall_s"], 1),
                    "ledger_total_M": round(wire["total_M"], 3),
                    "ledger_link_M": round(wire["link_M"], 3),
                    "compiled_total_M": round(ledger["total_M"], 3),
                    "compiled_link_M": round(ledger["link_M"], 3),
                    "code": codes[-1],
                }
            )
            print(rows[-1], flush=True)
    out = pathlib.Path(args.out)
    write_csv(out / "trainer.csv", rows)
    head = [
        "run",
        "final val loss (nats/byte)",
        "unigram entropy",
        "tokens/s",
        "wall (s)",
        "ledger, equal wires: per device (M)",
        "per node link (M)",
        "as XLA:CPU compiled: per device (M)",
        "per node link (M)",
    ]
    flags = " ".join(args.extra) or "no other flags"
    # Each run records the code it imported; one line when they agree, else per row.
    version = codes[0] if len(set(codes)) == 1 else "the runs imported different code"
    if len(set(codes)) == 1:
        for r in rows:
            del r["code"]
    else:
        head.append("code")
    text = (
        "# zeropp-train under each engine\n\n"
        f"{machine_line()} (this script's process); the runs: {version}; "
        f"`zeropp-train --steps {args.steps}` ({flags}), "
        "`--engine zeropp`, `zero3` and `xla-fsdp`, "
        + ("at the same time" if args.parallel else "one after the other")
        + ".\n\n"
        + markdown_table(
            head, [list(r.values()) for r in rows], "lrrrrrrrr" + "l" * (len(head) - 9)
        )
        + "\nTokens/s exclude the first step (timings on a shared, loaded machine are noisy). "
        "The ledger columns are one step's bytes in units of M (2 x parameters): sent per "
        "device, and through each node's network link in one direction. ZeRO++ and ZeRO-3 "
        "are read from the lowered program (their 16-bit values cross as raw bits, so what "
        "XLA:CPU compiles is the same). XLA FSDP's collectives exist only once XLA "
        "partitioned the step: 'equal wires' reads the program its SPMD partitioner wrote, "
        "at the width it gives each collective, an all-reduce sliced to a shard counted as a "
        "reduce-scatter (`comm_ledger(..., partitioned=True)`: the bfloat16 wire a GPU "
        "compilation sends); 'as XLA:CPU compiled' is the program XLA:CPU runs, which widens "
        "its bfloat16 collectives to float32. On emulated CPU devices no bytes cross a real "
        "link, so tokens/s compare compute and XLA:CPU's collectives, not link time.\n"
    )
    (out / "trainer.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
