"""The ``sguard`` command line.

Each subsystem contributes its subcommands through a ``register(subparsers)``
function in its own ``cli`` module, so this file only wires them together.
"""
from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

#: modules that expose ``register(subparsers) -> None``; each subcommand sets ``func``.
_SUBCOMMAND_MODULES = ("sguard.demo", "ioservice.cli", "peace.cli", "sguard.state_cli")


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every subsystem's subcommands."""
    parser = argparse.ArgumentParser(prog="sguard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a subsystem not built yet
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
