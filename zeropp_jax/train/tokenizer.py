"""Tokenizers of the trainer: bytes, or a Hugging Face `tokenizer.json`; and a byte-level
BPE trained offline.

`load_tokenizer("bytes")` gives ids 0-255, one per byte of the text. Any other value is
the path of a `tokenizer.json` read through the `tokenizers` package (the `data` extra:
`pip install 'zeropp_jax[data]'`). `train_bpe` learns a byte-level BPE (GPT-2's
pre-tokenizer; every byte is in its alphabet, so any text encodes and decodes back to
itself) from text on this machine, with nothing downloaded.

Errors are `ValueError`s of one line that name the file, what was wrong and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

BYTES = "bytes"
"""The value of `--tokenizer` for byte-level ids."""


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Text to token ids and back.

    Attributes:
      name: "bytes" or the path of the `tokenizer.json` it was read from.
      vocab_size: number of ids it can produce (ids are 0 .. vocab_size - 1).
      hf: the `tokenizers.Tokenizer`, or None for bytes.
    """

    name: str
    vocab_size: int
    hf: Any = None

    def encode(self, text: bytes) -> np.ndarray:
        """Token ids of `text` (UTF-8 bytes; invalid sequences are replaced by U+FFFD for
        a `tokenizer.json`), as a uint16 array (uint32 above 65536 ids)."""
        if self.hf is None:
            return np.frombuffer(text, dtype=np.uint8)
        ids = self.hf.encode(text.decode("utf-8", errors="replace")).ids
        return np.asarray(ids, dtype=np.uint16 if self.vocab_size <= 2**16 else np.uint32)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` (invalid UTF-8 shown as U+FFFD)."""
        ids = [int(i) for i in ids]
        if self.hf is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.hf.decode(ids)


def _tokenizers_module():
    try:
        import tokenizers
    except ImportError:
        raise ValueError(
            "--tokenizer: a tokenizer.json needs the `tokenizers` package; install it with "
            "pip install 'zeropp_jax[data]' (or pip install tokenizers)"
        ) from None
    return tokenizers


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `--tokenizer` names: "bytes", or the path of a `tokenizer.json`.

    Raises:
      ValueError: the file is missing or does not parse as a Hugging Face tokenizer.
    """
    if spec == BYTES:
        return Tokenizer(BYTES, 256)
    import os

    if not os.path.isfile(spec):
        raise ValueError(
            f"--tokenizer {spec}: no such file; give 'bytes' or the path of a Hugging Face "
            "tokenizer.json (zeropp-tokenize writes one)"
        )
    tokenizers = _tokenizers_module()
    try:
        hf = tokenizers.Tokenizer.from_file(spec)
    except Exception as e:  # the Rust parser's error, on one line
        reason = " ".join(str(e).split())[:200]
        raise ValueError(
            f"--tokenizer {spec}: not a Hugging Face tokenizer.json ({reason}); give 'bytes' "
            "or a file written by tokenizers' Tokenizer.save (zeropp-tokenize writes one)"
        ) from None
    return Tokenizer(spec, hf.get_vocab_size(with_added_tokens=True), hf)


def train_bpe(texts: Iterable[bytes], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids learned from `texts` (GPT-2's pre-tokenizer
    and byte alphabet, no special tokens): every text encodes and decodes back exactly.

    Args:
      texts: the training text, one item per file (UTF-8; invalid bytes become U+FFFD).
      vocab_size: ids of the result, at least 257 (the 256 bytes and one merge) and at
        most 65536 (so that ids fit a uint16 token file).

    Raises:
      ValueError: `vocab_size` out of range.
    """
    if not 256 < vocab_size <= 2**16:
        raise ValueError(
            f"--vocab-size {vocab_size}: a byte-level BPE needs more than the 256 byte ids "
            "and at most 65536 (a uint16 token file); pick a size in 257..65536"
        )
    tokenizers = _tokenizers_module()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    hf.train_from_iterator((t.decode("utf-8", errors="replace") for t in texts), trainer)
    return Tokenizer("bpe", hf.get_vocab_size(with_added_tokens=True), hf)
