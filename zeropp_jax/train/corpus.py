"""The user's corpus (`zeropp-train --data`): text files, directories, globs or nanoGPT
token files, read as token ids without holding a large file in memory.

A `--data` (or `--val-data`) value is a file, a directory (read recursively, hidden files
and directories skipped, files holding a NUL byte in their first 8 KB skipped as binary),
or a glob. Files ending in `.bin` are token files in nanoGPT's format: a flat array of
little-endian `uint16` ids, memory-mapped. Other files are text, tokenized at start-up by
the `--tokenizer`; with bytes, a text file is memory-mapped as its own ids.

Without `--val-data`, 5% of the files, chosen by a hash of their path (relative to the
directory given, or the file's name), are the validation split, as for the standard
library; where that leaves a split without files (a corpus of one file, or of a few), the
last 5% of the tokens are the validation split instead.

The two splits are `Tokens`: the files' ids read as if concatenated, in sorted order.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

import numpy as np

from zeropp_jax.train.data import VAL_PERCENT, Corpus, is_validation
from zeropp_jax.train.tokenizer import BYTES, Tokenizer

TOKEN_FILE_SUFFIX = ".bin"
TOKEN_DTYPE = np.dtype("<u2")
"""The ids of a token file: nanoGPT's `uint16`, little-endian."""

_SKIP_DIRS = {"__pycache__"}
_SNIFF_BYTES = 8192
_BYTES_PER_TOKEN_SAMPLE = 2**20  # validation tokens decoded to measure bytes per token


class Tokens:
    """Token ids stored as pieces (arrays or memory maps), read as their concatenation.

    Only the windows asked for are read: a memory-mapped piece is never read whole.
    """

    def __init__(self, pieces: Sequence[np.ndarray]):
        self.pieces = tuple(p for p in pieces if len(p))
        self.ends = np.cumsum([len(p) for p in self.pieces], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def slice(self, lo: int, hi: int) -> np.ndarray:
        """Ids `lo .. hi - 1` of the concatenation, as int32."""
        if not 0 <= lo <= hi <= len(self):
            raise ValueError(f"Tokens.slice({lo}, {hi}) outside 0..{len(self)}")
        parts, k = [], int(np.searchsorted(self.ends, lo, side="right"))
        while lo < hi:
            begin = int(self.ends[k - 1]) if k else 0
            take = self.pieces[k][lo - begin : min(hi, int(self.ends[k])) - begin]
            parts.append(np.asarray(take, dtype=np.int32))
            lo += len(take)
            k += 1
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def windows(self, starts: np.ndarray, span: int) -> np.ndarray:
        """int32 array (len(starts), span): the ids `start .. start + span - 1` for each."""
        out = np.empty((len(starts), span), dtype=np.int32)
        for i, start in enumerate(starts):
            out[i] = self.slice(int(start), int(start) + span)
        return out

    def split_tail(self, percent: int) -> tuple[Tokens, Tokens]:
        """(the first tokens, the last `percent`% of them, at least one)."""
        n = len(self)
        cut = n - max(1, n * percent // 100)
        return Tokens([self.slice(0, cut)]), Tokens([self.slice(cut, n)])

    def max_id(self, chunk: int = 2**24) -> int:
        """The largest id (-1 when empty), read a chunk at a time."""
        top = -1
        for piece in self.pieces:
            for lo in range(0, len(piece), chunk):
                top = max(top, int(piece[lo : lo + chunk].max()))
        return top


def _is_binary(path: str) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(_SNIFF_BYTES)


def resolve_paths(specs: Sequence[str], flag: str) -> tuple[list[tuple[str, str]], int]:
    """The files `specs` name: `((path, split name), ...)` in sorted order, and the number
    of binary files skipped in directories and globs.

    The split name (what `is_validation` hashes) is the path relative to a directory given,
    the file name for a file given, and the path as matched for a glob.

    Raises:
      ValueError: a path that does not exist, or a glob that matches no file.
    """
    found: dict[str, str] = {}
    skipped = 0
    for spec in specs:
        if any(c in spec for c in "*?["):
            matches = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not matches:
                raise ValueError(f"{flag} {spec}: the pattern matches no file")
            listed = [(p, p) for p in matches]
        elif os.path.isdir(spec):
            listed = []
            for dirpath, dirnames, filenames in os.walk(spec):
                dirnames[:] = sorted(
                    d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS
                )
                for name in sorted(filenames):
                    if not name.startswith("."):
                        path = os.path.join(dirpath, name)
                        listed.append((path, os.path.relpath(path, spec)))
        elif os.path.isfile(spec):
            found.setdefault(spec, os.path.basename(spec))
            continue
        else:
            raise ValueError(
                f"{flag} {spec}: no such file or directory; give a text file, a directory of "
                "them, a glob or a .bin token file"
            )
        for path, name in listed:
            if not path.endswith(TOKEN_FILE_SUFFIX) and _is_binary(path):
                skipped += 1
            else:
                found.setdefault(path, name)
    return sorted(found.items()), skipped


def read_token_file(path: str) -> np.ndarray:
    """A nanoGPT token file as a read-only `uint16` memory map (an empty array if empty).

    Raises:
      ValueError: a size that is not a whole number of `uint16` ids.
    """
    size = os.path.getsize(path)
    if size % TOKEN_DTYPE.itemsize:
        raise ValueError(
            f"{path}: {size} bytes is not a whole number of uint16 ids; a .bin token file is "
            "a flat array of uint16 (nanoGPT's format, what zeropp-tokenize writes)"
        )
    if size == 0:
        return np.zeros(0, TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def write_token_file(path: str, ids: np.ndarray) -> None:
    """Writes ids as a nanoGPT token file (flat little-endian `uint16`).

    Raises:
      ValueError: an id that does not fit in 16 bits.
    """
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**16):
        raise ValueError(f"{path}: ids must lie in 0..65535 for a uint16 token file")
    ids.astype(TOKEN_DTYPE).tofile(path)


def _read_text(path: str, tokenizer: Tokenizer) -> np.ndarray:
    if tokenizer.name == BYTES:  # the file's bytes are its ids
        return np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else np.zeros(0)
    with open(path, "rb") as f:
        return tokenizer.encode(f.read())


def _files_tokens(files: list[tuple[str, str]], tokenizer: Tokenizer, flag: str) -> list:
    """Ids of each file; all token files or all text."""
    bins = [p for p, _ in files if p.endswith(TOKEN_FILE_SUFFIX)]
    if bins and len(bins) != len(files):
        raise ValueError(
            f"{flag}: mixes .bin token files ({bins[0]}) and text files; give one kind "
            "(zeropp-tokenize turns text into token files)"
        )
    if bins:
        return [read_token_file(p) for p in bins]
    return [_read_text(p, tokenizer) for p, _ in files]


def _bytes_per_token(tokens: Tokens, tokenizer: Tokenizer, token_files: bool) -> float | None:
    """UTF-8 bytes of text per token of the validation split, for bits per byte: 1 for
    bytes read from text; for a `tokenizer.json`, measured by decoding up to the first
    1M validation tokens; unknown (None) for token files read without a tokenizer."""
    if tokenizer.name == BYTES:
        return None if token_files else 1.0
    sample = tokens.slice(0, min(len(tokens), _BYTES_PER_TOKEN_SAMPLE))
    return len(tokenizer.decode(sample).encode()) / len(sample) if len(sample) else None


def load_corpus(
    data: Sequence[str],
    val_data: Sequence[str] | None,
    tokenizer: Tokenizer,
    *,
    vocab_size: int,
    val_percent: int = VAL_PERCENT,
) -> Corpus:
    """Reads the `--data` corpus (and `--val-data`) as the two splits of `Tokens`.

    Args:
      data: `--data` values (files, directories, globs, .bin token files).
      val_data: `--val-data` values, or None to split `data` (see the module docstring).
      tokenizer: turns text files into ids (token files are read as they are).
      vocab_size: the model's vocabulary; every id must lie below it.

    Raises:
      ValueError: a missing path, a split without tokens, an id beyond the vocabulary.
    """
    files, skipped = resolve_paths(data, "--data")
    val_files, val_skipped = resolve_paths(val_data, "--val-data") if val_data else ([], 0)
    if not files:
        raise ValueError(f"--data {' '.join(data)}: no files (only hidden or binary ones)")
    split = "--val-data"
    if not val_data:
        val_files = [f for f in files if is_validation(f[1], val_percent)]
        files = [f for f in files if not is_validation(f[1], val_percent)]
        split = f"{val_percent}% of the files by hash"
    train_ids = _files_tokens(files, tokenizer, "--data")
    val_ids = _files_tokens(val_files, tokenizer, "--val-data") if val_files else []
    train, val = Tokens(train_ids), Tokens(val_ids)
    if not val_data and len(train) + len(val) and (len(train) == 0 or len(val) == 0):
        train, val = Tokens(train_ids + val_ids).split_tail(val_percent)
        files, val_files = files + val_files, []
        split = f"the last {val_percent}% of the tokens"
    for name, tokens, flag in (("training", train, "--data"), ("validation", val, "--val-data")):
        if len(tokens) == 0:
            given = " ".join(val_data if flag == "--val-data" and val_data else data)
            raise ValueError(
                f"{flag} {given}: the {name} split holds no tokens (empty files); give files "
                "with text in them"
            )
        top = tokens.max_id()
        if top >= vocab_size:
            raise ValueError(
                f"{flag}: token id {top} in the {name} split is beyond the vocabulary of "
                f"{vocab_size}; give the --vocab-size (or --tokenizer) the file was made with"
            )
    token_files = all(p.endswith(TOKEN_FILE_SUFFIX) for p, _ in files + val_files)
    n_files = len(files) + len(val_files)
    desc = f"{n_files} {'token ' if token_files else ''}file{'s' * (n_files != 1)}"
    if skipped + val_skipped:
        desc += f" ({skipped + val_skipped} binary skipped)"
    return Corpus(
        train,
        val,
        tuple(name for _, name in files),
        tuple(name for _, name in val_files),
        unit="token" if token_files or tokenizer.name != BYTES else "byte",
        bytes_per_token=_bytes_per_token(val, tokenizer, token_files),
        description=f"{desc}, validation: {split}",
    )


def from_flags(args) -> Corpus:
    """The corpus `zeropp-train`'s parsed flags name: `--data` (with `--val-data`,
    `--tokenizer`, `--vocab-size`), or the standard library within `--max-corpus-mb`;
    checked to hold one sequence of `--seq-len` tokens in each split.

    Raises:
      ValueError: see `load_corpus` and `zeropp_jax.train.data.check_windows`.
    """
    from zeropp_jax.train import data
    from zeropp_jax.train.tokenizer import load_tokenizer

    if args.data:
        tokenizer = load_tokenizer(args.tokenizer)
        found = load_corpus(args.data, args.val_data, tokenizer, vocab_size=args.vocab_size)
    else:
        found = data.load_corpus(max_bytes=args.max_corpus_mb * 2**20)
    data.check_windows(found, args.seq_len)
    return found
