"""Bytes against a BPE learned offline, and the int8 / int4 sampled weights against float.

    nice -n 10 python experiments/tokenizer_study.py                  # 800 steps each
    python experiments/tokenizer_study.py --steps 4 --out /tmp/t      # smoke run

In parts, one training run at a time, each part stopped after `--time-limit` minutes and
continued by the next call (`--resume`), then the evaluation and the report:

    python experiments/tokenizer_study.py --work W --only bytes --time-limit 24   # until done
    python experiments/tokenizer_study.py --work W --only bpe --time-limit 24     # until done
    python experiments/tokenizer_study.py --work W                                # the report

On the built-in corpus (the standard library's `.py` files, 16 MB, the trainer's split):
`zeropp-tokenize` learns a byte-level BPE of `--vocab` ids from the training split; then
`zeropp-train` trains the `tiny` model (default flags: full ZeRO++ on a 2 x 4 mesh of
emulated CPU devices, 128 tokens per sequence, batch 32) for `--steps` steps on bytes and
on the BPE's token files, both runs at once. Validation losses are given per token and in
bits per byte of the same validation text, so the two compare. `zeropp-sample --weights
int8` and `int4` then score each final checkpoint with its block-quantized weights as qwZ
gathers them, beside the float weights, and write a sample. Writes `tokenizer.md` and
`tokenizer.csv` into `--out` (default `experiments/results/tokenizer_study/`); the runs go
to `--work`.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

from _common import machine_line, markdown_table, request_cpu_devices, study_dir, write_csv
from _library import describe, provenance, same_code

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


def _steps_saved(run: pathlib.Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))


def _latest_step(run: pathlib.Path) -> int:
    steps = _steps_saved(run)
    if not steps:
        raise RuntimeError(f"{run}: no checkpoint to evaluate")
    return steps[-1]


def _finished(run: pathlib.Path, steps: int) -> bool:
    done = run / "summary.json"
    return done.exists() and json.loads(done.read_text())["steps"] == steps


def _wall(run: pathlib.Path) -> dict[str, float]:
    """`{"train_s": seconds, "parts": n}`: the wall time of this run's training calls."""
    path = run / "study_wall.json"
    return json.loads(path.read_text()) if path.exists() else {"train_s": 0.0, "parts": 0}


def _val_curve(run: pathlib.Path) -> dict[int, float]:
    """`{step: validation loss}` of the trainer's periodic evaluations (`metrics.jsonl`)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def _changed_files(a: str, b: str) -> list[str]:
    """The files that differ between two commits of this checkout."""
    from _library import SOURCE

    diff = ["git", "-C", str(SOURCE), "diff", "--name-only", a, b]
    return subprocess.run(diff, capture_output=True, text=True, check=True).stdout.split()


def _parts_code(run: pathlib.Path) -> list[dict]:
    """The provenance of every part of a (resumed) run, first part first."""
    record = json.loads((run / "run.json").read_text())
    return [*record.get("earlier_provenance", []), record["provenance"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--out", type=pathlib.Path, default=study_dir("tokenizer_study"))
    p.add_argument(
        "--work", type=pathlib.Path, default=None, help="run directories (reused when finished)"
    )
    p.add_argument(
        "--evaluate-only",
        action="store_true",
        help="train nothing: evaluate the latest checkpoints in --work (runs stopped early "
        "by SIGTERM, which checkpoints the step it is on, are reported at that step)",
    )
    p.add_argument(
        "--only",
        choices=["bytes", "bpe"],
        default=None,
        help="train (or continue) this run only, and write no report: a later call "
        "without --only evaluates both (needs --work)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="minutes after which the training runs get SIGTERM (they checkpoint the step "
        "they are on); the call then exits 3 and writes no report, and the next call with "
        "the same --work continues them (needs --work; 0: no limit)",
    )
    args = p.parse_args(argv)
    if (args.only or args.time_limit) and args.work is None:
        p.error("--only and --time-limit train in parts: give --work, where the parts meet")
    if args.only and args.evaluate_only:
        p.error("--only trains, --evaluate-only does not: give one of them")
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="tokenizer_study_"))
    work.mkdir(parents=True, exist_ok=True)
    head = machine_line()
    tok = work / f"bpe{args.vocab}"
    t0 = time.time()
    tokenize = [sys.executable, "-m", "zeropp_jax.train.tokenize_corpus"]
    tokenize += ["--vocab-size", str(args.vocab), "--out", str(tok)]
    if not (tok / "meta.json").exists():  # kept in --work: a rerun reuses it
        print(_run(tokenize, "zeropp-tokenize").strip(), flush=True)
        (tok / "study_wall.json").write_text(json.dumps({"tokenize_s": time.time() - t0}))
    meta = json.loads((tok / "meta.json").read_text())
    common = ["--steps", str(args.steps), "--no-progress", "--no-ledger", "--save-every", "100"]
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
    runs = {name: work / name.replace(" ", "") for name in variants}
    targets = [n for n in variants if args.only in (None, n.split()[0].lower())]
    train = [] if args.evaluate_only else [n for n in targets if not _finished(runs[n], args.steps)]
    procs = {}
    for name in train:  # at once (one at a time with --only)
        out, flags = runs[name], variants[name][0]
        cmd = [sys.executable, "-m", "zeropp_jax.train", *common, "--out", str(out), *flags]
        if _steps_saved(out):
            cmd.append("--resume")  # a part stopped by --time-limit: continued
        print(f"{name}: {' '.join(cmd)}", flush=True)
        procs[name] = (cmd, time.time(), subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    deadline = t0 + 60 * args.time_limit if args.time_limit else None
    for name, (cmd, start, proc) in procs.items():
        stopped = (0, 3)  # 3: stopped by SIGTERM after a checkpoint
        try:
            wait = None if deadline is None else max(1.0, deadline - time.time())
            printed, _ = proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the trainer checkpoints the step it is on
            printed, _ = proc.communicate(timeout=600)
            stopped += (-signal.SIGTERM,)  # before its first step: no checkpoint, a rerun starts it
        wall = _wall(runs[name])
        wall = {"train_s": wall["train_s"] + time.time() - start, "parts": wall["parts"] + 1}
        (runs[name] / "study_wall.json").write_text(json.dumps(wall))
        print(printed.strip(), flush=True)
        if proc.returncode not in stopped:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{printed[-3000:]}")
    if not args.evaluate_only:
        unfinished = [n for n in variants if not _finished(runs[n], args.steps)]
        if args.only or unfinished:
            for name in variants:
                saved = _steps_saved(runs[name])
                print(
                    f"{name}: {'finished' if name not in unfinished else 'at step'} "
                    f"{saved[-1] if saved else 0} of {args.steps}, "
                    f"{_wall(runs[name])['train_s'] / 60:.1f} min of training in "
                    f"{_wall(runs[name])['parts']} part(s)",
                    flush=True,
                )
            if unfinished:
                print("not finished: call again with the same --work to continue", flush=True)
            return 3 if any(n in unfinished for n in targets) else 0
    t_eval = time.time()
    code = provenance()
    parts = {name: _parts_code(runs[name]) for name in variants}
    rows, samples = [], {}
    for name, out in runs.items():
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
                "train_min": round(_wall(out)["train_s"] / 60, 1),
                "train_parts": _wall(out)["parts"],
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
            "training (min, parts)",
        ],
        [
            [
                r["tokens"],
                r["vocab"],
                r["params_M"],
                r["steps"],
                f"{r['bytes_per_token']:.3f}",
                f"{r['val_loss_nats_per_token']:.4f}",
                f"{r['float_bits_per_byte']:.4f}",
                f"{r['int8_bits_per_byte']:.4f}",
                f"{r['int4_bits_per_byte']:.4f}",
                f"{r['int8_vs_float_pct']:+.2f}%",
                f"{r['int4_vs_float_pct']:+.2f}%",
                f"{r['train_min']}, {r['train_parts']}",
            ]
            for r in rows
        ],
        "lrrrrrrrrrrr",
    )
    tokenize_s = json.loads((tok / "study_wall.json").read_text())["tokenize_s"]
    mixed = [
        f"{name} part {i + 1}: {describe(part)}"
        for name, runs_parts in parts.items()
        for i, part in enumerate(runs_parts)
        if not same_code(part, code)
    ]
    code_line = (
        f"Every part of both training runs ran the code of this evaluation ({describe(code)})."
        if not mixed
        else f"This evaluation ran {describe(code)}; NOT the same code: " + "; ".join(mixed) + "."
    )
    commits = {part["commit"] for runs_parts in parts.values() for part in runs_parts}
    if mixed and len(commits) == 1 and None not in commits and code["commit"]:
        (trained,) = commits
        changed = _changed_files(trained, code["commit"]) + code["changed"]
        code_line += (
            f" The training's commit {trained[:7]} and this one differ in: "
            + (", ".join(sorted(set(changed))) or "nothing")
            + "."
        )
    curves = {name: _val_curve(out) for name, out in runs.items()}
    curve_steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    curve = markdown_table(
        ["step", *(f"{name} (bits/byte)" for name in variants)],
        [
            [
                step,
                *(f"{curves[n][step] / math.log(2) / variants[n][1]:.4f}" for n in variants),
            ]
            for step in curve_steps
        ],
        "r" * (1 + len(variants)),
    )
    calls = f"python experiments/tokenizer_study.py --steps {args.steps} --vocab {args.vocab}"
    calls += " --evaluate-only" if args.evaluate_only else ""
    if args.work is not None:  # trained by earlier calls, perhaps in parts
        calls = (
            f"`python experiments/tokenizer_study.py --steps {args.steps} --vocab {args.vocab} "
            "--work W --only bytes|bpe --time-limit M` (the parts are in the training column), "
            f"then `{calls} --work W`"
        )
    else:
        calls = f"`{calls}`"
    text = [
        "# Bytes against a BPE, and the quantized weights against float",
        "",
        head,
        "",
        f"{calls} (zeropp-tokenize {tokenize_s / 60:.1f} min; the "
        f"training runs' wall time is in the table; evaluation "
        f"{(time.time() - t_eval) / 60:.1f} min). {code_line} "
        "The tiny model (`zeropp-train` defaults: "
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
        "The trainer's own validation passes (`--eval-every 100`, float weights, the same "
        "8 batches; both runs on one schedule of "
        f"{args.steps} steps, so a step has the same learning rate in both), where both "
        "runs have one:",
        "",
        curve,
        "",
        "A sequence of 128 BPE tokens spans about "
        f"{rows[-1]['bytes_per_token'] * 128:.0f} bytes of text against 128 for bytes, and the "
        "BPE's embedding is "
        f"{rows[-1]['vocab'] / rows[0]['vocab']:.3g} times larger; both runs take the same "
        "steps and tokens per step.",
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
