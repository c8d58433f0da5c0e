"""The data flags of `zeropp-train`: the training and validation files, the tokenizer and
the model's vocabulary, and their checks that need no devices (they read no data beyond
listing the files and loading the tokenizer).

A bad flag or combination raises `UsageError` (`zeropp_jax.train.flag_types`).
"""

from __future__ import annotations

import argparse

from zeropp_jax.train.flag_types import UsageError, positive_int


def add_data_flags(p: argparse.ArgumentParser) -> None:
    """Adds the `data` group: `--data`, `--val-data`, `--tokenizer`, `--train-tokenizer`
    and `--vocab-size`."""
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        action="append",
        metavar="PATH",
        default=None,
        help="train on your own data: a text file, a directory of them (read recursively; "
        "binary files skipped), a glob, or nanoGPT token files (*.bin: flat uint16 ids, "
        "memory-mapped; give --vocab-size or --tokenizer); repeatable (default: the "
        "standard library's .py files)",
    )
    g.add_argument(
        "--val-data",
        action="append",
        metavar="PATH",
        default=None,
        help="the validation split, as --data (default: 5%% of the --data files by a hash "
        "of their path, or the last 5%% of the tokens where that leaves a split empty)",
    )
    g.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="bytes|PATH",
        help="bytes (ids 0-255) or a Hugging Face tokenizer.json (needs the tokenizers "
        "package: pip install 'zeropp_jax[data]'; zeropp-tokenize trains one) (bytes)",
    )
    g.add_argument(
        "--train-tokenizer",
        type=int,
        default=None,
        metavar="N",
        help="learn a byte-level BPE of N ids from the training split of the --data text "
        "first (as zeropp-tokenize --vocab-size N; needs the tokenizers package), save it "
        "as OUT/tokenizer.json and train on it; --resume reuses it; one process only",
    )
    g.add_argument(
        "--vocab-size",
        type=positive_int,
        default=None,
        help="the model's vocabulary (default: the tokenizer's, rounded up to a multiple of "
        "128; with the built-in corpus, the GPT-3 sizes keep GPT-2's 50304)",
    )


VOCAB_MULTIPLE = 128
"""A tokenizer's vocabulary is rounded up to a multiple of this for the model (as nanoGPT
pads GPT-2's 50257 to 50304), so that it divides into vocabulary pieces and shards."""


def check_data(args: argparse.Namespace) -> None:
    """Checks the data flags that need no reading: the paths exist, the tokenizer parses,
    a token file has a vocabulary. Sets `args.tokenizer_vocab` (the tokenizer's ids)."""
    from zeropp_jax.train.corpus import TOKEN_FILE_SUFFIX, resolve_paths
    from zeropp_jax.train.tokenizer import BYTES, load_tokenizer

    if args.val_data and not args.data:
        raise UsageError("--val-data needs --data (the built-in corpus has its own split)")
    if args.train_tokenizer is not None:
        _check_train_tokenizer(args)
    try:
        args.tokenizer_vocab = args.train_tokenizer or load_tokenizer(args.tokenizer).vocab_size
        for flag, specs in (("--data", args.data), ("--val-data", args.val_data)):
            if specs:
                files, _ = resolve_paths(specs, flag)
                bins = [p for p, _ in files if p.endswith(TOKEN_FILE_SUFFIX)]
                if bins and args.tokenizer == BYTES and args.vocab_size is None:
                    raise UsageError(
                        f"{flag} {bins[0]}: a token file holds ids of some tokenizer; give "
                        "--vocab-size N or the --tokenizer it was made with"
                    )
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_train_tokenizer(args: argparse.Namespace) -> None:
    from zeropp_jax.train.corpus import TOKEN_FILE_SUFFIX
    from zeropp_jax.train.tokenizer import BYTES

    n = args.train_tokenizer
    if not args.data:
        raise UsageError(
            f"--train-tokenizer {n} learns from --data text; give --data (for the built-in "
            "corpus, zeropp-tokenize --vocab-size N writes token files)"
        )
    if args.tokenizer != BYTES:
        raise UsageError(
            f"--train-tokenizer {n} learns the tokenizer; drop --tokenizer {args.tokenizer}"
        )
    for spec in args.data + (args.val_data or []):
        if spec.endswith(TOKEN_FILE_SUFFIX):
            raise UsageError(f"--train-tokenizer {n}: {spec} is already a token file; give text")
    if not 256 < n <= 2**16:
        raise UsageError(
            f"--train-tokenizer {n}: a byte-level BPE needs more than the 256 byte ids and at "
            "most 65536 (a uint16 token file); pick a size in 257..65536"
        )


def resolve_vocab_size(args: argparse.Namespace, preset_vocab_size: int) -> None:
    """Sets `args.vocab_size` (after `check_data`): `--vocab-size`, else the tokenizer's
    ids rounded up to `VOCAB_MULTIPLE`; with the built-in corpus in bytes,
    `preset_vocab_size` (the `--model` preset's)."""
    from zeropp_jax.train.tokenizer import BYTES

    if args.vocab_size is None:
        if not args.data and args.tokenizer == BYTES:
            args.vocab_size = preset_vocab_size
        else:
            args.vocab_size = -(-args.tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    elif args.vocab_size < args.tokenizer_vocab:
        raise UsageError(
            f"--vocab-size {args.vocab_size} is below the {args.tokenizer_vocab} ids of "
            f"--tokenizer {args.tokenizer}; give at least that many, or leave it out"
        )
