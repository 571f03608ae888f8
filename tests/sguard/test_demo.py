"""`sguard demo`: worker killed mid-run, recovery, replay, exactly-once check.

The demo runs as a user runs it: ``python -m sguard demo`` in a fresh process whose
working directory is a temporary directory (so the package comes from the
installation under test, never from a source tree in the working directory).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sguard.cli import main
from sguard.demo import verdict

SMALL = ["--batch", "2000", "--groups", "1500", "--page-bytes", "4096", "--io-workers", "2"]


def run_demo(cwd: Path, *args: str) -> tuple[int, list[str], dict[str, Any]]:
    """Run the demo with ``--json``; returns (exit status, printed lines, JSON result)."""
    out = subprocess.run([sys.executable, "-m", "sguard", "demo", *args, "--json"], cwd=cwd,
                         capture_output=True, text=True, timeout=300)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError:
        pytest.fail(f"no JSON result line; exit {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out.returncode, lines[:-1], result


def test_demo_recovers_after_sigkill_and_matches_failure_free_run(tmp_path: Path) -> None:
    """The demo kills its worker, recovers a checkpoint and ends with the oracle's state."""
    rc, lines, result = run_demo(tmp_path, "--batches", "12", "--checkpoint-every", "2",
                                 "--kill-at", "9", "--root", "data", *SMALL)
    assert rc == 0, "\n".join(lines)
    assert result["killed"] is True and result["ok"] is True
    assert result["recovered_from"] is not None
    assert 2 <= result["recovered_batches"] <= 9
    assert result["recovered_ok"] and result["final_ok"]
    assert Path(result["root"]) == tmp_path / "data" / "run-1"
    assert (tmp_path / "data" / "run-1" / "checkpoint").is_dir()
    assert lines[-2] == "[demo] verdict: OK"


@pytest.mark.parametrize("batches, every, kill_at", [
    (1, 6, None),   # killed at batch 0: nothing processed, nothing checkpointed
    (3, 6, None),   # killed before the first checkpoint: recovery from the empty state
    (6, 1, 5),      # a checkpoint after every batch
])
def test_demo_exit_status_matches_verdict_across_sizes(tmp_path: Path, batches: int, every: int,
                                                      kill_at: int | None) -> None:
    """Exit status 0 exactly when every printed check says OK and the verdict line says OK.

    Small runs used to exit 1 after printing only OK lines: no checkpoint had
    completed before the kill, and "recovered from nothing" counted as failure
    although replaying from the empty state is the correct recovery.
    """
    args = ["--batches", str(batches), "--checkpoint-every", str(every), "--root", "d", *SMALL]
    if kill_at is not None:
        args += ["--kill-at", str(kill_at)]
    rc, lines, result = run_demo(tmp_path, *args)
    checks = [ln for ln in lines if ln.startswith("[demo]") and
              (" OK" in ln or "MISMATCH" in ln or "NOT killed" in ln or "FAILED" in ln)]
    assert len(checks) >= 4, lines  # killed, recovered, final, verdict
    all_ok = all("MISMATCH" not in ln and "NOT killed" not in ln and "FAILED" not in ln
                 for ln in checks)
    verdict_lines = [ln for ln in lines if ln.startswith("[demo] verdict: ")]
    assert len(verdict_lines) == 1
    assert all_ok and verdict_lines[0] == "[demo] verdict: OK", "\n".join(lines)
    assert rc == 0 and result["ok"] is True
    assert result["killed"] and result["recovered_ok"] and result["final_ok"]
    if batches == 3:  # the case that used to exit 1
        assert result["recovered_from"] is None and result["recovered_batches"] == 0


@pytest.mark.parametrize("field, reason", [
    ("killed", "not killed"), ("recovered_ok", "differs from the oracle"),
    ("final_ok", "failure-free run")])
def test_verdict_names_each_failed_check(field: str, reason: str) -> None:
    """`verdict` (which decides the exit status) fails on each check, and only on those."""
    good = {"killed": True, "recovered_ok": True, "final_ok": True, "recovered_batches": 4,
            "recovered_from": None}
    assert verdict(good) == []
    reasons = verdict({**good, field: False})
    assert len(reasons) == 1 and reason in reasons[0]


def test_demo_never_touches_what_it_did_not_create(tmp_path: Path) -> None:
    """An existing checkpoint directory and earlier runs survive; the run gets a new run-N."""
    root = tmp_path / "data"
    mine = root / "checkpoint" / "aggregate-1"
    mine.mkdir(parents=True)
    (mine / "manifest.json").write_text("the user's own file")
    (root / "run-1").mkdir()
    (root / "run-1" / "notes.txt").write_text("keep me")
    rc, lines, result = run_demo(tmp_path, "--batches", "4", "--checkpoint-every", "1",
                                 "--root", str(root), *SMALL)
    assert rc == 0, "\n".join(lines)
    assert (mine / "manifest.json").read_text() == "the user's own file"
    assert (root / "run-1" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in (root / "run-1").iterdir()) == ["notes.txt"]
    assert Path(result["root"]) == root / "run-2"
    assert (root / "run-2" / "checkpoint").is_dir()


@pytest.mark.parametrize("argv, message", [
    (["--batches", "-5"], "argument --batches: must be a positive integer, got '-5'"),
    (["--batches", "0"], "argument --batches: must be a positive integer"),
    (["--batch", "x"], "argument --batch: must be an integer, got 'x'"),
    (["--groups", "-1"], "argument --groups: must be a positive integer"),
    (["--checkpoint-every", "0"], "argument --checkpoint-every: must be a positive integer"),
    (["--page-bytes", "1000"], "argument --page-bytes: page_bytes=1000: must be a power of two"),
    (["--io-workers", "0"], "argument --io-workers: must be a positive integer"),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0"),
    (["--kill-at", "-1"], "argument --kill-at: must be an integer >= 0"),
    (["--batches", "5", "--kill-at", "5"], "--kill-at 5 must be below --batches 5"),
    (["--root", "FILE/sub"], "exists and is not a directory"),
    (["--root", "FILE"], "exists and is not a directory"),
])
def test_demo_bad_arguments_exit_2_with_one_line_before_any_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str], message: str) -> None:
    """Each bad argument: exit status 2, one line naming it, nothing created on disk."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("a file in the way")
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sguard demo: error: ") and message in err[0], err
    assert captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]


def test_demo_bad_argument_from_the_shell_is_one_line_without_traceback(tmp_path: Path) -> None:
    """The installed module, run as a process: one stderr line, exit 2, no traceback."""
    out = subprocess.run([sys.executable, "-m", "sguard", "demo", "--batches", "-5"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "--batches" in out.stderr and out.stdout == ""
    assert list(tmp_path.iterdir()) == []
