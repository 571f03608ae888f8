"""`bench.chkpt_latency`'s fork() baseline runs in a process that holds only its own state.

Forking the benchmark's main process would copy the page tables of the mmm
state, the numpy input and the compiled kernels too; the baseline's process
must import none of them and must hold the same dict state as the mmm side.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import checkout


@pytest.fixture
def loop_module(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(sys, "path", [*sys.path, str(checkout())])
    import bench._latency_loop as mod
    return mod


def test_the_fork_baseline_process_imports_no_state_core() -> None:
    code = ("import sys, bench._latency_loop\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('mmm', 'ioservice', 'sguard', 'numba', 'pyarrow'))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=checkout(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_fork_baseline_builds_the_same_state_and_runs(  # type: ignore[no-untyped-def]
        loop_module, tmp_path: Path) -> None:
    d = loop_module.build_dicts(1000, 4)
    assert [len(x) for x in d] == [250] * 4
    assert d[1][5] == [1, 5, 5] and 5 not in d[0]
    fb = loop_module.ForkBaseline(1000, 2, 60, 20, 1, 0.002, 0.05, 0.02, str(tmp_path),
                                  "normal")
    try:
        assert fb.info["ready"] and fb.info["rss_mb"] > 0
        res = fb.run()
    finally:
        fb.close()
    assert fb.proc.returncode == 0
    assert len(res["latency_s"]) == 60
    assert res["events"] and all(e["end_s"] is not None for e in res["events"])
    assert {e["partition"] for e in res["events"]} == {0, 1}  # partitions in turn
    assert res["diag"]["slowest"] and "cpu_ms" in res["diag"]["slowest"][0]
