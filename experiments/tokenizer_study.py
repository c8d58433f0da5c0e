"""Bytes against a BPE learned offline, and the int8 / int4 sampled weights against float.

    nice -n 10 python experiments/tokenizer_study.py                  # 800 steps each
    python experiments/tokenizer_study.py --steps 4 --out /tmp/t      # smoke run

On the built-in corpus (the standard library's `.py` files, 16 MB, the trainer's split):
`zeropp-tokenize` learns a byte-level BPE of `--vocab` ids from the training split; then
`zeropp-train` trains the `tiny` model (default flags: full ZeRO++ on a 2 x 4 mesh of
emulated CPU devices, 128 tokens per sequence, batch 32) for `--steps` steps on bytes and
on the BPE's token files, both runs at once. Validation losses are given per token and in
bits per byte of the same validation text, so the two compare. `zeropp-sample --weights
int8` and `int4` then score each final checkpoint with its block-quantized weights as qwZ
gathers them, beside the float weights, and write a sample. Writes `tokenizer.md` and
`tokenizer.csv` into `--out` (default `experiments/results`); the runs go to `--work`.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import time

from _common import RESULTS, machine_line, markdown_table, request_cpu_devices, write_csv

request_cpu_devices(8)  # what the trainer runs on (for the machine line)


def _run(cmd: list[str], what: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=6 * 3600)
    if done.returncode:
        raise RuntimeError(
            f"{what}: {' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}"
        )
    return done.stdout


def _sample(run: pathlib.Path, weights: str) -> tuple[dict[str, float], str]:
    """(validation losses by weights, the sample text) of `zeropp-sample --weights`."""
    cmd = [sys.executable, "-m", "zeropp_jax.train.sample", "--out", str(run)]
    cmd += ["--weights", weights, "--prompt", "def ", "--tokens", "120", "--seed", "0"]
    out = _run(cmd, f"zeropp-sample {weights}").splitlines()
    losses = {}
    for part in out[0].split("nats/")[1].split(": ", 1)[1].split(", "):
        value, name = part.split()[:2]
        losses[name] = float(value)
    return losses, "\n".join(out[2:-1])


def _latest_step(run: pathlib.Path) -> int:
    steps = [int(p.name[5:]) for p in (run / "checkpoints").glob("step_*")]
    if not steps:
        raise RuntimeError(f"{run}: no checkpoint to evaluate")
    return max(steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    p.add_argument(
        "--work", type=pathlib.Path, default=None, help="run directories (reused when finished)"
    )
    p.add_argument(
        "--evaluate-only",
        action="store_true",
        help="train nothing: evaluate the latest checkpoints in --work (runs stopped early "
        "by SIGTERM, which checkpoints the step it is on, are reported at that step)",
    )
    args = p.parse_args(argv)
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="tokenizer_study_"))
    work.mkdir(parents=True, exist_ok=True)
    head = machine_line()
    tok = work / f"bpe{args.vocab}"
    t0 = time.time()
    tokenize = [sys.executable, "-m", "zeropp_jax.train.tokenize_corpus"]
    tokenize += ["--vocab-size", str(args.vocab), "--out", str(tok)]
    if not (tok / "meta.json").exists():  # kept in --work: a rerun reuses it
        print(_run(tokenize, "zeropp-tokenize").strip(), flush=True)
    meta = json.loads((tok / "meta.json").read_text())
    common = ["--steps", str(args.steps), "--no-progress", "--no-ledger", "--save-every", "0"]
    variants = {
        "bytes": ([], 1.0),
        f"BPE {args.vocab}": (
            [
                *("--data", str(tok / "train.bin"), "--val-data", str(tok / "val.bin")),
                *("--tokenizer", str(tok / "tokenizer.json")),
            ],
            # The same validation text in both: its bytes over its BPE tokens.
            meta["val_bytes"] / meta["val_tokens"],
        ),
    }
    procs = {}
    for name, (flags, _) in variants.items():
        out = work / name.replace(" ", "")
        cmd = [sys.executable, "-m", "zeropp_jax.train", *common, "--out", str(out), *flags]
        done = out / "summary.json"
        if args.evaluate_only or (
            done.exists() and json.loads(done.read_text())["steps"] == args.steps
        ):
            procs[name] = (out, cmd, None)  # finished (or stopped) in --work: reused
        else:
            procs[name] = (out, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    rows, samples = [], {}
    for name, (out, cmd, proc) in procs.items():
        if proc is not None:
            printed, _ = proc.communicate(timeout=6 * 3600)
            if proc.returncode not in (0, 3):  # 3: stopped by SIGTERM after a checkpoint
                raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{printed[-3000:]}")
        record = json.loads((out / "run.json").read_text())
        steps_done = _latest_step(out)
        int8, sample = _sample(out, "int8")
        int4, _ = _sample(out, "int4")
        per_token = variants[name][1]
        samples[name] = sample

        def bpb(nats: float, per_token: float = per_token) -> float:
            return nats / math.log(2) / per_token

        rows.append(
            {
                "tokens": name,
                "vocab": record["vocab_size"],
                "params_M": round(record["param_count"] / 1e6, 3),
                "steps": f"{steps_done} of {args.steps}",
                "bytes_per_token": round(per_token, 3),
                "val_loss_nats_per_token": round(int8["float"], 4),
                "float_bits_per_byte": round(bpb(int8["float"]), 4),
                "int8_bits_per_byte": round(bpb(int8["int8"]), 4),
                "int4_bits_per_byte": round(bpb(int4["int4"]), 4),
                "int8_vs_float_pct": round(100 * (int8["int8"] / int8["float"] - 1), 3),
                "int4_vs_float_pct": round(100 * (int4["int4"] / int4["float"] - 1), 3),
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "tokenizer.csv", rows)
    table = markdown_table(
        [
            "tokens",
            "vocab",
            "params (M)",
            "steps",
            "bytes/token",
            "val loss, float (nats/token)",
            "float bits/byte",
            "int8 bits/byte",
            "int4 bits/byte",
            "int8 vs float",
            "int4 vs float",
        ],
        [
            [
                r["tokens"],
                r["vocab"],
                r["params_M"],
                r["steps"],
                r["bytes_per_token"],
                r["val_loss_nats_per_token"],
                r["float_bits_per_byte"],
                r["int8_bits_per_byte"],
                r["int4_bits_per_byte"],
                f"{r['int8_vs_float_pct']:+.2f}%",
                f"{r['int4_vs_float_pct']:+.2f}%",
            ]
            for r in rows
        ],
        "lrrrrrrrrrr",
    )
    text = [
        "# Bytes against a BPE, and the quantized weights against float",
        "",
        head,
        "",
        f"`python experiments/tokenizer_study.py --steps {args.steps} --vocab {args.vocab}`"
        + (" --evaluate-only" if args.evaluate_only else "")
        + f" ({(time.time() - t0) / 60:.0f} min). The tiny model (`zeropp-train` defaults: "
        "d_model 128, 4 layers, 128 tokens per sequence, batch 32, full ZeRO++ on a 2 x 4 "
        f"mesh of emulated CPU devices), {args.steps} steps scheduled on the standard "
        "library's `.py` files (16 MB, the trainer's split), on bytes and on a byte-level BPE of "
        f"{args.vocab} ids learned offline from the training split by `zeropp-tokenize` "
        f"({meta['train_tokens']:,} training and {meta['val_tokens']:,} validation tokens). "
        "A run stopped early (the steps column; SIGTERM checkpoints the step it is on) is "
        "scored at that checkpoint, in the middle of its learning-rate schedule. "
        "Bits per byte are of the same validation text for both (nats per token / ln 2 / "
        "bytes per token, the BPE's measured on its validation token file). The float "
        "column is the master weights in the run's compute dtype (bfloat16); int8 and int4 are "
        "`zeropp-sample --weights int8|int4`: every weight block-quantized (blocks of 256) "
        "as qwZ gathers it.",
        "",
        table,
        "",
        "A sequence of 128 BPE tokens spans about "
        f"{rows[-1]['bytes_per_token'] * 128:.0f} bytes of text against 128 for bytes, and the "
        "BPE's embedding is 16 times larger; both runs take the same steps and tokens per "
        "step.",
        "",
    ]
    for name, sample in samples.items():
        text += [f"Sample ({name}, int8 weights, prompt `def `, seed 0):", "", "```text"]
        text += [sample, "```", ""]
    (args.out / "tokenizer.md").write_text("\n".join(text))
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
