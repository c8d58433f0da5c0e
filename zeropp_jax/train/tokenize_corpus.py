"""`zeropp-tokenize`: a corpus turned into nanoGPT token files, with a BPE learned offline.

`zeropp-tokenize --data PATH --vocab-size N --out DIR` learns a byte-level BPE of N ids
from the training split of the corpus (`tokenizers`' trainer, on this machine; nothing is
downloaded) and writes `DIR/tokenizer.json`, `DIR/train.bin` and `DIR/val.bin` (flat
`uint16` ids, nanoGPT's format) and `DIR/meta.json` (sizes, files, split). `--tokenizer
PATH` encodes with an existing `tokenizer.json` instead of learning one. Without `--data`
it reads the trainer's built-in corpus (the standard library's `.py` files within
`--max-corpus-mb`), split as `zeropp-train` splits it, so that a run on the token files
is scored on the same validation text as a run on bytes.

The splits follow `zeropp-train --data`'s rule (`zeropp_jax.train.corpus`). Then:

    zeropp-train --data DIR/train.bin --val-data DIR/val.bin --tokenizer DIR/tokenizer.json

Bad input prints one line `zeropp-tokenize: error: ...` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence

import numpy as np

from zeropp_jax.train.flag_types import UsageError

PROG = "zeropp-tokenize"
CHUNK_BYTES = 2**20
"""Text is learned from and encoded in pieces of about this size, cut after a newline."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The flags of `zeropp-tokenize`."""
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[1])
    p.add_argument(
        "--data",
        action="append",
        metavar="PATH",
        default=None,
        help="text files, directories or globs, as zeropp-train --data; repeatable "
        "(default: the standard library's .py files)",
    )
    p.add_argument("--val-data", action="append", metavar="PATH", default=None)
    p.add_argument(
        "--max-corpus-mb",
        type=int,
        default=16,
        help="MB of the built-in corpus to read (16), as zeropp-train's",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--vocab-size", type=int, help="learn a byte-level BPE of this many ids")
    what.add_argument("--tokenizer", metavar="PATH", help="encode with this tokenizer.json")
    p.add_argument("--out", required=True, help="directory to write the files to")
    return p


def text_chunks(tokens, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The byte ids of a split as pieces of about `size` bytes, each ending after a
    newline where there is one (so a piece never cuts a line, nor a UTF-8 character)."""
    n, lo = len(tokens), 0
    while lo < n:
        hi = min(n, lo + size)
        piece = tokens[lo:hi] if isinstance(tokens, np.ndarray) else tokens.slice(lo, hi)
        piece = piece.astype(np.uint8).tobytes()
        if hi < n and b"\n" in piece:
            piece = piece[: piece.rindex(b"\n") + 1]
        lo += len(piece)
        yield piece


def _byte_corpus(args: argparse.Namespace):
    from zeropp_jax.train import corpus, data
    from zeropp_jax.train.tokenizer import load_tokenizer

    if args.data:
        for spec in args.data + (args.val_data or []):
            if spec.endswith(corpus.TOKEN_FILE_SUFFIX):
                raise UsageError(f"--data {spec}: already a token file; give text")
        return corpus.load_corpus(args.data, args.val_data, load_tokenizer("bytes"), vocab_size=256)
    if args.val_data:
        raise UsageError("--val-data needs --data (the built-in corpus has its own split)")
    return data.load_corpus(max_bytes=args.max_corpus_mb * 2**20)


def learn_for_run(args: argparse.Namespace, out: str) -> None:
    """`zeropp-train --train-tokenizer N`: learns a byte-level BPE of N ids from the
    training split of `--data` (as `zeropp-tokenize --vocab-size N`) and saves it to
    `args.tokenizer` (`OUT/tokenizer.json`), which the trainer then encodes its text with.
    One process (the whole corpus is read).

    Raises:
      ValueError: no text to learn from (see `zeropp_jax.train.corpus.load_corpus`).
    """
    from zeropp_jax.train.tokenizer import train_bpe

    corpus = _byte_corpus(args)
    tokenizer = train_bpe(text_chunks(corpus.train), args.train_tokenizer)
    os.makedirs(out, exist_ok=True)
    tokenizer.hf.save(args.tokenizer)


def _encode_to(path: str, tokenizer, tokens) -> tuple[int, int]:
    """Encodes a split piece by piece into a token file; (tokens, bytes)."""
    from zeropp_jax.train.corpus import TOKEN_DTYPE

    count = size = 0
    with open(path, "wb") as f:
        for piece in text_chunks(tokens):
            ids = tokenizer.encode(piece)
            ids.astype(TOKEN_DTYPE).tofile(f)
            count += len(ids)
            size += len(piece)
    return count, size


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `zeropp-tokenize`; bad input raises `SystemExit(2)` after one line."""
    try:
        args = build_parser().parse_args(argv)
        return _main(args)
    except (UsageError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _main(args: argparse.Namespace) -> int:
    from zeropp_jax.train.tokenizer import load_tokenizer, train_bpe

    t0 = time.time()
    if args.tokenizer is not None:
        tokenizer = load_tokenizer(args.tokenizer)
        if tokenizer.vocab_size > 2**16:
            raise UsageError(
                f"--tokenizer {args.tokenizer}: {tokenizer.vocab_size} ids do not fit a "
                "uint16 token file"
            )
    elif not 256 < args.vocab_size <= 2**16:
        train_bpe([], args.vocab_size)  # raises the range error before reading anything
    corpus = _byte_corpus(args)
    if args.tokenizer is None:
        tokenizer = train_bpe(text_chunks(corpus.train), args.vocab_size)
    os.makedirs(args.out, exist_ok=True)
    tokenizer.hf.save(os.path.join(args.out, "tokenizer.json"))
    sizes = {}
    for split, tokens in (("train", corpus.train), ("val", corpus.val)):
        sizes[split] = _encode_to(os.path.join(args.out, f"{split}.bin"), tokenizer, tokens)
    meta = {
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": "learned byte-level BPE" if args.tokenizer is None else args.tokenizer,
        "source": args.data or f"the standard library's .py files ({args.max_corpus_mb} MB)",
        "split": corpus.description,
        **{f"{s}_tokens": sizes[s][0] for s in sizes},
        **{f"{s}_bytes": sizes[s][1] for s in sizes},
        "val_files": list(corpus.val_files),
    }
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    (nt, bt), (nv, bv) = sizes["train"], sizes["val"]
    print(
        f"{PROG}: {tokenizer.vocab_size} ids; train {nt:,} tokens ({bt / nt:.2f} bytes each), "
        f"val {nv:,} tokens ({bv / nv:.2f} bytes each) in {time.time() - t0:.1f} s -> "
        f"{args.out}/train.bin, val.bin, tokenizer.json\n"
        f"train with: zeropp-train --data {args.out}/train.bin --val-data {args.out}/val.bin "
        f"--tokenizer {args.out}/tokenizer.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
