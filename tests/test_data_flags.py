"""The data flags of `zeropp-train` (`zeropp_jax.train.data_flags`): the checks that need
no devices and the model's vocabulary."""

import argparse

import pytest

from zeropp_jax.train.data_flags import (
    VOCAB_MULTIPLE,
    add_data_flags,
    check_data,
    resolve_vocab_size,
)
from zeropp_jax.train.flag_types import UsageError


def data_args(argv):
    p = argparse.ArgumentParser()
    add_data_flags(p)
    return p.parse_args(argv)


def test_the_vocabulary_follows_the_tokenizer_or_the_preset(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some text\n")
    args = data_args([])
    check_data(args)
    resolve_vocab_size(args, 50304)  # the built-in corpus in bytes: the preset's
    assert (args.tokenizer_vocab, args.vocab_size) == (256, 50304)
    args = data_args(["--data", str(text)])
    check_data(args)
    resolve_vocab_size(args, 50304)  # your data: the tokenizer's, rounded up
    assert args.vocab_size == 256 and 256 % VOCAB_MULTIPLE == 0
    args = data_args(["--data", str(text), "--train-tokenizer", "300"])
    check_data(args)
    resolve_vocab_size(args, 50304)
    assert (args.tokenizer_vocab, args.vocab_size) == (300, 384)
    args = data_args(["--data", str(text), "--vocab-size", "200"])
    check_data(args)
    with pytest.raises(UsageError, match="--vocab-size 200 is below the 256 ids"):
        resolve_vocab_size(args, 50304)


def test_bad_data_flags_raise_a_usage_error(tmp_path):
    text, ids = tmp_path / "t.txt", tmp_path / "ids.bin"
    text.write_text("some text\n")
    ids.write_bytes(b"\x00\x01" * 8)
    for argv, message in [
        (["--val-data", str(text)], "--val-data needs --data"),
        (["--data", str(ids)], "give --vocab-size N or the --tokenizer"),
        (["--train-tokenizer", "300"], "learns from --data text"),
        (["--data", str(ids), "--train-tokenizer", "300"], "already a token file"),
        (["--data", str(text), "--train-tokenizer", "256"], "pick a size in 257"),
        (["--data", str(tmp_path / "missing.txt")], "missing.txt"),
    ]:
        with pytest.raises(UsageError, match=message):
            check_data(data_args(argv))
