"""The ``sguard`` command line: version, help texts with examples, one-line usage errors."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import sguard
from sguard.cli import SUBCOMMAND_MODULES, build_parser, main, subparsers_of


def _leaves(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    children = subparsers_of(parser)
    if not children:
        return [parser]
    return [leaf for child in children.values() for leaf in _leaves(child)]


def _all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [parser] + [p for c in subparsers_of(parser).values() for p in _all_parsers(c)]


def test_version_is_the_installed_distribution_version(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """`sguard --version` prints the version of the installed distribution, from one source."""
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    installed = importlib.metadata.version("sguard")
    assert capsys.readouterr().out.strip() == f"sguard {installed}"
    assert sguard.__version__ == installed


def test_version_from_the_console_script(tmp_path: Path) -> None:
    """The `sguard` script installed next to this interpreter answers --version."""
    script = Path(sys.executable).parent / "sguard"
    assert script.exists(), f"no sguard console script next to {sys.executable}"
    out = subprocess.run([str(script), "--version"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)  # a hang guard, not a speed check
    assert out.returncode == 0 and out.stdout.strip() == f"sguard {sguard.__version__}"


def test_every_registered_module_contributes_a_command() -> None:
    """Each module in the registry imports and adds at least one top-level command."""
    parser = build_parser()
    commands = set(subparsers_of(parser))
    assert {"demo", "checkpoints", "peace"} <= commands
    for name in SUBCOMMAND_MODULES:
        assert callable(importlib.import_module(name).register)


def test_every_command_has_a_description_and_an_example() -> None:
    """Every parser says what it does; every leaf's epilog holds an `sguard ...` example."""
    parser = build_parser()
    assert parser.epilog and "sguard demo" in parser.epilog
    for p in _all_parsers(parser)[1:]:
        assert p.description, f"{p.prog} has no description"
        assert p.epilog and "example" in p.epilog, f"{p.prog} has no example"
        examples = [ln.strip() for ln in p.epilog.splitlines() if ln.startswith("  sguard ")]
        assert examples, f"{p.prog}: no example command line in its epilog"
        assert all(ex.startswith(p.prog) for ex in examples), (p.prog, examples)


def test_every_option_says_what_it_does() -> None:
    """Every option and positional of every leaf has a help text (or is deliberately hidden)."""
    for leaf in _leaves(build_parser()):
        for action in leaf._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{leaf.prog} {action.option_strings or action.dest}: no help"


def test_every_example_in_the_help_parses() -> None:
    """The examples printed by --help are valid command lines for the parser that prints them."""
    parser = build_parser()
    for p in _all_parsers(parser):
        for line in (p.epilog or "").splitlines():
            line = line.split("#")[0].strip()
            if not line.startswith("sguard ") or "<" in line:
                continue
            args = parser.parse_args(line.split()[1:])
            assert callable(args.func), line


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["checkpoints", "--help"],
                                  ["checkpoints", "ls", "--help"], ["peace", "--help"],
                                  ["peace", "simulate", "--help"], ["peace", "serve", "--help"]])
def test_help_exits_0(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """--help of each command prints its usage and an example, and exits 0."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: sguard") and "example" in out


@pytest.mark.parametrize("argv, message", [
    ([], "sguard: error: the following arguments are required: COMMAND"),
    (["nope"], "sguard: error: argument COMMAND: invalid choice: 'nope'"),
    (["peace"], "sguard peace: error: the following arguments are required: COMMAND"),
    (["peace", "simulate", "--sizes-mb", "-5"],
     "sguard peace simulate: error: argument --sizes-mb: must be a positive integer, got '-5'"),
    (["peace", "simulate", "--writers", "0"], "argument --writers: must be a positive integer"),
    (["peace", "simulate", "--seeds", "0"], "argument --seeds: must be a positive integer"),
    (["peace", "simulate", "--plot", "no-such-dir/fig10.png"],
     "argument --plot: directory"),
    (["peace", "simulate", "--json", "no-such-dir/runs.json"], "argument --json: directory"),
    (["peace", "simulate", "--plot", "."], "argument --plot: '.' is a directory"),
    (["peace", "schedule", "--request", "a,b"], "a request is WRITER,R,K"),
    (["peace", "schedule", "--request", "svr1.1,2,1", "--seed", "-1"], "argument --seed"),
    (["peace", "serve", "--port", "70000"], "argument --port: must be a TCP port 0..65535"),
    (["peace", "serve", "--advance-fraction", "1.5"], "argument --advance-fraction"),
    (["peace", "serve", "--serve-s", "-1"], "argument --serve-s: must be a positive number"),
    (["peace", "serve", "--max-pending", "0"], "argument --max-pending"),
])
def test_usage_errors_are_one_line_with_exit_2(argv: list[str], message: str,
                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A bad argument is refused while parsing (before any work): one stderr line, exit 2."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert captured.out == "" and list(tmp_path.iterdir()) == []


def test_simulate_refuses_more_writers_than_servers_before_simulating(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--writers 8 40`: refused up front (17 servers), not after the 8-writer runs."""
    assert main(["peace", "simulate", "--writers", "8", "40", "--sizes-mb", "128",
                 "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no result table: nothing was simulated
    assert captured.err.strip() == ("sguard peace simulate: error: argument --writers: at most "
                                    "17 (the paper topology's servers), got 40")
