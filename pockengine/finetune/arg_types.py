"""The argparse types of the command-line options: whole numbers, finite numbers in a
range, byte amounts such as ``300MB``, text encodings; each rejects bad text with one
message naming the rule."""

from __future__ import annotations

import argparse
import codecs
import math
from collections.abc import Callable

from pockengine.ir import CompileError
from pockengine.passes.remat_budget import parse_budget

__all__ = [
    "budget_or_none",
    "byte_amount",
    "encoding",
    "fraction",
    "non_negative_float",
    "positive_float",
    "positive_int",
]


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (threads, sizes, counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def budget_or_none(text: str) -> float:
    """``byte_amount``, or ``none`` as 0: no recomputation budget (over a recipe's)."""
    return 0.0 if text.strip().lower() == "none" else byte_amount(text)


def byte_amount(text: str) -> float:
    """An argparse type: ``300MB``/``300MiB``/``300M`` in bytes (binary units, as the
    report prints MiB)."""
    try:
        return float(parse_budget(text) or 0)
    except CompileError:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size > 0 such as 300MB"
        ) from None


def _number_where(text: str, ok: Callable[[float], bool], rule: str) -> float:
    """``text`` as a finite number for which ``ok`` holds; else an error naming ``rule``."""
    value = _number(text)
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (learning rates)."""
    return _number_where(text, lambda v: v > 0, "> 0")


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (weight decay)."""
    return _number_where(text, lambda v: v >= 0, ">= 0")


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1) (warmup, momentum; the config checks tighter)."""
    return _number_where(text, lambda v: 0 <= v < 1, "in [0, 1)")


def encoding(text: str) -> str:
    """An argparse type: a text encoding Python knows."""
    try:
        codecs.lookup(text)
    except LookupError:
        raise argparse.ArgumentTypeError(f"unknown encoding {text!r}") from None
    return text
