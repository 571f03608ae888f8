"""Argument types and the one-line usage error shared by the ``sguard`` commands.

An argparse ``type=`` function here raises `argparse.ArgumentTypeError` with a
message that names the rule; argparse adds the option's name. Checks that
involve several arguments go in a ``validate(args)`` function registered with
`set_validator`, which raises `UsageError`. Either way the command answers
with one line on stderr and exit status 2 before any work starts.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import NoReturn

__all__ = ["OneLineErrorParser", "UsageError", "positive_int", "nonnegative_int",
           "output_file", "set_validator"]


class UsageError(ValueError):
    """A combination of arguments that cannot work; the message names the arguments."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose usage errors are one line (no usage dump).

    Subparsers created through ``add_subparsers`` inherit the class, so every
    ``sguard`` subcommand answers the same way.
    """

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message> (see <prog> --help)`` and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def output_file(text: str) -> str:
    """A file path to write: its directory must exist and it must not be a directory."""
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


def set_validator(parser: argparse.ArgumentParser,
                  validate: Callable[[argparse.Namespace], None]) -> None:
    """Run ``validate(args)`` (raising `UsageError`) after parsing, before the command."""
    parser.set_defaults(validate=validate, usage_prog=parser.prog)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
