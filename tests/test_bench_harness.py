"""Benchmarks write to ``--out DIR`` (default: the untracked ``bench/out/``), never by
default into the committed ``bench/results/``, and refuse bad arguments before any work.

``bench`` is not part of the installed package: it is imported from the checkout
(``$SGUARD_REPO`` under scripts/test.sh), appended to ``sys.path`` so that mmm & co.
still come from the installation under test.
"""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.test_readme import checkout

#: each bench module and one numeric option it takes
BENCHES = {"mmm_ops": "--tuples", "chkpt_prepare": "--page-bytes",
           "chkpt_latency": "--state-mb", "io_throughput": "--repeats",
           "recovery": "--workers", "peace_fig10": "--seeds"}


@pytest.fixture
def bench_module(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Import ``bench.<name>`` from the checkout (appended to sys.path for the test)."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(checkout())])

    def load(name: str) -> ModuleType:
        return importlib.import_module(f"bench.{name}")
    return load


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_bench_takes_out_and_refuses_bad_arguments_up_front(
        name: str, bench_module, tmp_path: Path,  # type: ignore[no-untyped-def]
        capsys: pytest.CaptureFixture[str]) -> None:
    """--help documents --out; a file as --out and a non-positive number exit 2 in one line."""
    mod = bench_module(name)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    assert "--out DIR" in capsys.readouterr().out
    (tmp_path / "a-file").write_text("")
    for argv, what in ((["--out", str(tmp_path / "a-file")], "--out"),
                       ([BENCHES[name], "0"], BENCHES[name]),
                       ([BENCHES[name], "-3"], BENCHES[name])):
        with pytest.raises(SystemExit) as exc:
            mod.main(argv)
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"argument {what}" in err[-1], (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_results_go_to_out_dir_and_the_default_is_untracked(
        bench_module, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """write_result / figure follow --out; without it they aim at the git-ignored bench/out."""
    harness = bench_module("_harness")
    try:
        args = harness.parse_args(argparse.ArgumentParser(), ["--out", str(tmp_path / "o")])
        assert args.out == tmp_path / "o"
        path = harness.write_result("demo_bench", {"ratio": 1.5}, {"x": [1]}, {"quick": True})
        assert path == tmp_path / "o" / "demo_bench.json"
        assert json.loads(path.read_text())["summary"] == {"ratio": 1.5}
        plt, png = harness.figure("demo_bench")
        assert png == tmp_path / "o" / "demo_bench.png"
        fig, ax = plt.subplots()
        ax.plot([0, 1], [1, 0])
        assert harness.save_figure(fig, png, path) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert fig.number not in plt.get_fignums()  # closed

        harness.parse_args(argparse.ArgumentParser(), [])
        default = harness.out_dir()
        assert default == checkout() / "bench" / "out" and default != harness.RESULTS
    finally:
        harness.parse_args(argparse.ArgumentParser(), [])
    repo = checkout()
    if (repo / ".git").exists():
        out = subprocess.run(["git", "check-ignore", "-q", "bench/out/x.json"], cwd=repo)
        assert out.returncode == 0, "bench/out/ is not git-ignored"
    else:
        assert "/bench/out/" in (repo / ".gitignore").read_text().split()
