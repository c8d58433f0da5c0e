"""`zeropp-sample`: text from a `zeropp-train` run's latest checkpoint, from its float
weights or from the block-quantized weights that qwZ gathers.

`zeropp-sample --out RUN --prompt TEXT` restores the run's latest checkpoint onto the same
mesh (read from `RUN/run.json`) and generates `--tokens` tokens after the prompt, sampled
at `--temperature` from the `--top-k` most likely (a seed makes it repeatable), and prints
the text and the tokens per second.

`--weights int8` (or `int4`) runs the model through the engine with
`ZeroPPConfig(weight_bits=8)` and no other change: every weight is block-quantized on its
shard, gathered in 8 (4) bits and dequantized where it is used, exactly as a training
step's forward receives it (one layer at a time inside the scanned blocks; the whole model
is never dequantized first). A model trained with ZeRO++ was trained on such weights, so it
serves from them without post-training quantization. It then prints the validation loss of
the float and of the quantized weights side by side (`--no-eval` skips it).

Bad input (no run at `--out`, a run without checkpoints, an empty prompt) prints one line
`zeropp-sample: error: ...` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from zeropp_jax.train.flag_types import UsageError

PROG = "zeropp-sample"
WEIGHTS = {"float": None, "int8": 8, "int4": 4}
"""The values of `--weights` and the weight bits each gathers with."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The flags of `zeropp-sample`."""
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[1])
    p.add_argument("--out", required=True, help="the run's directory (zeropp-train --out)")
    p.add_argument("--prompt", default="\n", help="text to continue (a newline)")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (200)")
    p.add_argument(
        "--temperature", type=float, default=0.8, help="softmax temperature, 0 = greedy (0.8)"
    )
    p.add_argument(
        "--top-k", type=int, default=40, help="sample among the k likeliest, 0 = all (40)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    p.add_argument("--num-samples", type=int, default=1, help="samples to print (1)")
    p.add_argument(
        "--weights",
        choices=tuple(WEIGHTS),
        default="float",
        help="float (the master weights in the run's compute dtype), or int8/int4: the "
        "block-quantized weights as qwZ gathers them (float)",
    )
    p.add_argument(
        "--no-eval",
        action="store_true",
        help="skip the validation loss of the float and the quantized weights",
    )
    return p


def run_flags(out: str) -> argparse.Namespace:
    """The parsed flags of the run in `out`, from its `run.json`, for one process.

    Raises:
      UsageError: no `run.json`, a run of `--engine xla-fsdp` (no checkpoints).
    """
    path = os.path.join(out, "run.json")
    if not os.path.isfile(path):
        raise UsageError(f"--out {out}: no run.json there; give the --out of a zeropp-train run")
    with open(path) as f:
        saved = json.load(f)
    if saved.get("engine") == "xla-fsdp":
        raise UsageError(f"--out {out}: an --engine xla-fsdp run writes no checkpoints")
    saved.setdefault("data", None)
    saved.setdefault("val_data", None)
    saved.setdefault("tokenizer", "bytes")
    # One process samples, on this machine's devices.
    saved.update(coordinator=None, num_processes=None, process_id=None, distributed=False)
    return argparse.Namespace(**saved)


def restore(run: argparse.Namespace, path: str, mesh, weight_bits: int | None):
    """The checkpoint at `path` on `mesh`, under a config whose forward gathers the
    weights in `weight_bits` (None: unquantized), in the run's compute dtype."""
    import zeropp_jax as zpp
    from zeropp_jax.train.cli import make_optimizer
    from zeropp_jax.train.flags import gpt_config
    from zeropp_jax.train.model import GPT, init_fn

    config = zpp.ZeroPPConfig(
        weight_bits=weight_bits,
        weight_block_size=run.weight_block_size,
        hierarchical=False,
        grad_bits=None,
        compute_dtype=run.compute_dtype,
        kernels=run.kernels,
    )
    gpt = gpt_config(run)
    target = zpp.TrainState.abstract(
        apply_fn=GPT(gpt).apply,
        params=init_fn(gpt, run.seed),
        tx=make_optimizer(run),
        mesh=mesh,
        config=config,
    )
    return zpp.restore_checkpoint(os.path.abspath(path), target)


def next_tokens(state, tokens, pos, key, *, temperature: float, top_k: int, vocab: int):
    """The next token of each row: sampled from the logits at position `pos` of
    `tokens` (rows, seq) over the first `vocab` ids (the tokenizer's; the model's
    vocabulary may be padded beyond it)."""
    import jax
    import jax.numpy as jnp

    logits = state.apply_fn({"params": state.params}, tokens)
    last = jax.lax.dynamic_index_in_dim(logits, pos, axis=1, keepdims=False)[:, :vocab]
    if temperature == 0:
        return jnp.argmax(last, axis=-1)
    if top_k:
        kth = jax.lax.top_k(last, min(top_k, vocab))[0][:, -1:]
        last = jnp.where(last < kth, -jnp.inf, last)
    return jax.random.categorical(key, last / temperature, axis=-1)


def generate(
    state, prompt: list[int], args: argparse.Namespace, *, rows: int, seq_len: int, vocab: int
) -> tuple[list[list[int]], float]:
    """`args.tokens` tokens after `prompt` for each of `rows` rows, from a window of the
    last `seq_len` tokens; and the tokens per second after the first (compiling) token."""
    import functools

    import jax
    import numpy as np

    step = jax.jit(
        functools.partial(next_tokens, temperature=args.temperature, top_k=args.top_k, vocab=vocab)
    )
    out = [list(prompt) for _ in range(rows)]
    key = jax.random.key(args.seed)
    start = 0.0
    for i in range(args.tokens):
        if i == 1:
            start = time.perf_counter()
        window = [row[-seq_len:] for row in out]
        n = len(window[0])
        buf = np.zeros((rows, seq_len), np.int32)
        buf[:, :n] = np.asarray(window, np.int32)
        new = np.asarray(step(state, buf, n - 1, jax.random.fold_in(key, i)))
        for row, t in zip(out, new, strict=True):
            row.append(int(t))
    elapsed = time.perf_counter() - start
    rate = (args.tokens - 1) * rows / elapsed if args.tokens > 1 and elapsed else float("nan")
    return out, rate


def validation_loss(state, run: argparse.Namespace, corpus, mesh) -> float:
    """Mean loss (nats per token) of the run's validation batches under `state`."""
    import jax
    import numpy as np

    from zeropp_jax.train import data
    from zeropp_jax.train.cli import eval_loss

    batches = data.eval_set(
        corpus.val,
        mesh,
        seed=run.seed,
        num_batches=run.eval_batches,
        batch_size=run.batch,
        seq_len=run.seq_len,
    )
    compiled = jax.jit(eval_loss).lower(state, batches[0]).compile()
    return float(np.mean([float(compiled(state, b)) for b in batches]))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `zeropp-sample`; bad input raises `SystemExit(2)` after one line."""
    try:
        args = build_parser().parse_args(argv)
        if args.tokens < 1 or args.num_samples < 1 or args.top_k < 0:
            raise UsageError("--tokens and --num-samples must be positive, --top-k >= 0")
        if args.temperature < 0:
            raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
        return _main(args)
    except (UsageError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _main(args: argparse.Namespace) -> int:
    from zeropp_jax.train.platform import configure_host_devices, make_mesh
    from zeropp_jax.train.rundir import latest_checkpoint
    from zeropp_jax.train.tokenizer import load_tokenizer

    run = run_flags(args.out)
    latest = latest_checkpoint(args.out)
    if latest is None:
        raise UsageError(f"--out {args.out}: the run has no checkpoint yet")
    tokenizer = load_tokenizer(run.tokenizer)
    prompt = [int(t) for t in tokenizer.encode(args.prompt.encode())]
    if not prompt:
        raise UsageError("--prompt: the prompt encodes to no tokens; give some text")
    configure_host_devices(run)

    import jax

    from zeropp_jax._mesh import data_parallel_size
    from zeropp_jax.train import data

    mesh = make_mesh(run)
    bits = WEIGHTS[args.weights]
    state = restore(run, latest[1], mesh, bits)
    where = f"{args.out} step {latest[0]}"
    what = (
        "float weights"
        if bits is None
        else f"{args.weights} weights (blocks of {run.weight_block_size}, as qwZ gathers them)"
    )
    if not args.no_eval:
        from zeropp_jax.train.corpus import from_flags

        corpus = from_flags(run)
        losses = {args.weights: validation_loss(state, run, corpus, mesh)}
        if bits is not None:
            losses["float"] = validation_loss(
                restore(run, latest[1], mesh, None), run, corpus, mesh
            )
        unit = corpus.unit
        shown = [f"{losses['float']:.4f} float"] + (
            [
                f"{losses[args.weights]:.4f} {args.weights} "
                f"({100 * (losses[args.weights] / losses['float'] - 1):+.2f}%)"
            ]
            if bits is not None
            else []
        )
        per_byte = corpus.bytes_per_token
        bpb = (
            f" ({data.bits(losses[args.weights]) / per_byte:.3f} bits per byte)"
            if per_byte and unit != "byte"
            else ""
        )
        print(f"{PROG}: {where}; validation loss nats/{unit}: {', '.join(shown)}{bpb}")
    rows = -(-args.num_samples // data_parallel_size(mesh)) * data_parallel_size(mesh)
    out, rate = generate(
        state,
        prompt,
        args,
        rows=rows,
        seq_len=run.seq_len,
        vocab=min(tokenizer.vocab_size, run.vocab_size),
    )
    for i, row in enumerate(out[: args.num_samples]):
        print(f"--- sample {i + 1} ({what}, {where}, seed {args.seed})")
        print(tokenizer.decode(row))
    print(
        f"--- {args.tokens} tokens x {rows} rows: {rate:,.0f} tokens/s on {mesh.size} "
        f"{jax.default_backend()} devices (the first token, which compiles, excluded)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
