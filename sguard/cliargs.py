"""Argument types and the one-line usage error shared by the ``sguard`` commands.

An argparse ``type=`` function (`positive_int`, `nonnegative_int`,
`output_file`: shared with the ``peace`` commands, see :mod:`peace.argtypes`)
raises `argparse.ArgumentTypeError` with a message that names the rule; argparse adds the option's name. Checks that
involve several arguments go in a ``validate(args)`` function registered with
`set_validator`, which raises `UsageError`. Either way the command answers
with one line on stderr and exit status 2 before any work starts.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

from peace.argtypes import nonnegative_int, output_file, positive_int

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


def set_validator(parser: argparse.ArgumentParser,
                  validate: Callable[[argparse.Namespace], None]) -> None:
    """Run ``validate(args)`` (raising `UsageError`) after parsing, before the command."""
    parser.set_defaults(validate=validate, usage_prog=parser.prog)

