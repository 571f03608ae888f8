"""The ``sguard`` command line.

Each subsystem contributes its subcommands through a ``register(subparsers)``
function in its own ``cli`` module (the registry `SUBCOMMAND_MODULES`), so this
file only wires them together. To add a subcommand, write
``register(subparsers)`` in your module and append the module's name here.

Conventions every subcommand follows:

* arguments are validated before any work starts: argparse ``type=`` functions
  (see `sguard.cliargs`) for single values, and an optional ``validate``
  default (``p.set_defaults(validate=fn)``; ``fn(args)`` raises
  `sguard.cliargs.UsageError`) for checks across arguments;
* a usage error is one line on stderr (``sguard demo: error: ...``) and exit
  status 2, never a traceback;
* each parser has a description and an epilog with an example.
"""
from __future__ import annotations

import argparse
import importlib
import textwrap
from collections.abc import Sequence

from sguard import __version__
from sguard.cliargs import OneLineErrorParser, UsageError

__all__ = ["SUBCOMMAND_MODULES", "build_parser", "main", "subparsers_of"]

#: modules that expose ``register(subparsers) -> None``; each leaf subcommand sets ``func``.
#: Every module listed must import: a missing one is a broken install, not an optional feature.
SUBCOMMAND_MODULES: tuple[str, ...] = ("sguard.demo", "ioservice.cli", "peace.cli",
                                       "sguard.spark.cli", "sguard.state_cli", "sguard.kernels")

_EPILOG = """\
examples:
  sguard spark demo                             # the main job: Spark streaming with injected failures
  sguard demo                                   # Aggregate, self-kill, recovery (local disk)
  sguard checkpoints ls sguard-data/run-1       # list the checkpoints a demo run wrote
  sguard checkpoints verify sguard-data/run-1   # check every page checksum
  sguard peace simulate --writers 8 --sizes-mb 128 --plot fig10.png
  sguard <command> --help                       # what a command and its options do
"""


#: examples for leaf commands whose module gives none (help texts stay in their module)
_EXAMPLES: dict[str, str] = {
    "sguard checkpoints": "example:\n  sguard checkpoints ls sguard-data/run-1",
    "sguard checkpoints ls": "examples:\n  sguard checkpoints ls sguard-data/run-1\n"
                             "  sguard checkpoints ls s3://bucket/prefix --all   "
                             "# with SGUARD_S3_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY",
    "sguard checkpoints verify": "example:\n  sguard checkpoints verify sguard-data/run-1 "
                                 "--checkpoint aggregate-3",
    "sguard checkpoints show": "example:\n  sguard checkpoints show sguard-data/run-1 "
                               "aggregate-3 --pages 5",
    "sguard spark": "examples:\n  sguard spark demo\n  sguard spark status file:///tmp/agg-state",
    "sguard spark demo": "examples:\n  sguard spark demo                      # the main job\n"
                         "  sguard spark demo --batches 8 --rows 2000 --keys 500 --keep",
    "sguard spark status": "examples:\n  sguard spark status file:///tmp/agg-state\n"
                           "  sguard spark status s3://bucket/agg --s3-endpoint 127.0.0.1:8333 --json",
    "sguard state": "examples:\n  sguard state repartition file:///tmp/agg-state --partitions 4\n"
                    "  sguard state show file:///tmp/agg-state --limit 10\n"
                    "  sguard state convert file:///tmp/agg-state",
    "sguard state convert": "examples:\n  sguard state convert file:///tmp/agg-state\n"
                            "  sguard state convert file:///tmp/agg-state --key-groups 256",
    "sguard state show": "examples:\n  sguard state show file:///tmp/agg-state\n"
                         "  sguard state show file:///tmp/agg-state --batch-id 12 --limit 5",
    "sguard state repartition": "examples:\n  sguard state repartition file:///tmp/agg-state "
                                "--partitions 4   # scale out\n"
                                "  sguard state repartition file:///tmp/agg-state --partitions 1",
}


def subparsers_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The direct subcommand parsers of ``parser`` by name (empty for a leaf)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _add_missing_examples(parser: argparse.ArgumentParser) -> None:
    """Give every parser a description (its one-line help if it has none) and an example."""
    if parser.epilog is None and parser.prog in _EXAMPLES:
        parser.epilog = _EXAMPLES[parser.prog]
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, child in action.choices.items():
                if child.description is None and helps.get(name):
                    child.description = f"{name}: {helps[name]}"
                _add_missing_examples(child)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every registered subsystem's subcommands."""
    parser = OneLineErrorParser(
        prog="sguard",
        description=textwrap.fill(
            "sguard: fault tolerance for stateful stream processing (SGuard, VLDB 2008): "
            "operator state in mmm pages, asynchronous copy-on-write checkpoints to a "
            "distributed file system, the Peace write scheduler."),
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    _add_missing_examples(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status (2 for a usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    validate = getattr(args, "validate", None)
    if validate is not None:
        try:
            validate(args)
        except UsageError as exc:
            prog = getattr(args, "usage_prog", "sguard")
            parser.exit(2, f"{prog}: error: {exc} (see {prog} --help)\n")
    return int(args.func(args) or 0)
