"""argparse ``type=`` functions shared by the ``peace`` and ``sguard`` commands.

Each raises `argparse.ArgumentTypeError` with a message that names the rule;
argparse adds the option's name, and the command answers with one line and
exit status 2 before any work starts. They live in ``peace`` because it is the
one place both command sets may import (``sguard`` may import ``peace``,
``peace`` imports nothing of ``sguard``); :mod:`sguard.cliargs` re-exports them.

>>> positive_int("3"), fraction("0.5")
(3, 0.5)
"""
from __future__ import annotations

import argparse
import math
import os

__all__ = ["positive_int", "nonnegative_int", "port", "positive_float", "fraction", "output_file"]


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535."""
    value = nonnegative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port 0..65535, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def output_file(text: str) -> str:
    """A file path to write: its directory must exist and be writable, and it is no directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a file path, got an empty string")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"directory {parent} of {text!r} does not exist")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file path")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory {parent} of {text!r} is not writable")
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
