"""The types of `zeropp-train`'s flag values (`zeropp_jax.train.flag_types`)."""

import argparse

import pytest

from zeropp_jax.train.flag_types import bit_width, hop_bit_width, non_negative_int, positive_int


def test_bit_widths():
    assert [bit_width(t) for t in ("8", "4", "2", "none", "None")] == [8, 4, 2, None, None]
    assert hop_bit_width("same") == "same" and hop_bit_width("4") == 4
    with pytest.raises(argparse.ArgumentTypeError, match=r"'3' \(choose from 8, 4, 2, none\)"):
        bit_width("3")
    with pytest.raises(argparse.ArgumentTypeError, match="none, same"):
        hop_bit_width("16")


def test_counts():
    assert positive_int("1") == 1 and non_negative_int("0") == 0
    for text in ("0", "-2", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer"):
            positive_int(text)
    for text in ("-1", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="non-negative integer"):
            non_negative_int(text)
