"""The types of `zeropp-train`'s flag values, and the error a bad flag raises.

Each type is an `argparse` `type=` function: it returns the value or raises
`argparse.ArgumentTypeError`, which the parser reports as a `UsageError`.
"""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """A bad flag or flag combination: reported as one line, exit status 2."""


def bit_width(text: str) -> int | None:
    """A weight or gradient bit width: 8, 4, 2, or None for `none`."""
    if text.lower() == "none":
        return None
    if text in ("8", "4", "2"):
        return int(text)
    raise argparse.ArgumentTypeError(f"invalid bit width {text!r} (choose from 8, 4, 2, none)")


def hop_bit_width(text: str) -> int | str | None:
    """A second hop's bit width: as `bit_width`, or `same` (the first hop's)."""
    if text == "same":
        return text
    try:
        return bit_width(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"invalid bit width {text!r} (choose from 8, 4, 2, none, same)"
        ) from None


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value
