"""``sguard checkpoints ls|verify|show`` and the HDFS round trip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ioservice import CheckpointManager, CheckpointPolicy, open_root, restore
from sguard.cli import main

from tests.ioservice.ckpt_helpers import (REPO, child_env, mutate, new_pm, open_structures,
                                          state_of)


@pytest.fixture
def two_units(tmp_path: Path) -> Path:
    """A root with HA units a (3 checkpoints, incremental) and b (1 checkpoint)."""
    for unit, n in (("a", 3), ("b", 1)):
        pm = new_pm()
        s = open_structures(pm)
        with CheckpointManager(pm, str(tmp_path), unit,
                               policy=CheckpointPolicy(full_every=5)) as mgr:
            for step in range(n):
                mutate(s, step)
                mgr.checkpoint({"step": step}).result()
    return tmp_path


def test_ls_lists_units_checkpoints_sizes_and_ages(two_units: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """ls shows each HA unit and each checkpoint with kind, pages, size and age."""
    assert main(["checkpoints", "ls", str(two_units)]) == 0
    out = capsys.readouterr().out
    assert "HA unit a: 3 checkpoint(s)" in out and "HA unit b: 1 checkpoint(s)" in out
    for name in ("a-1", "a-2", "a-3", "b-1"):
        assert name in out
    assert "incr(+2)" in out and "KiB" in out and "s\n" in out
    assert main(["checkpoints", "ls", f"file://{two_units}", "--haunit", "b"]) == 0
    assert "a-1" not in capsys.readouterr().out


def test_ls_counts_a_damaged_manifest_apart(two_units: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint whose manifest does not parse is listed DAMAGED, not counted as one."""
    manifest = two_units / "checkpoint" / "a-3" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-20])
    assert main(["checkpoints", "ls", str(two_units)]) == 0
    out = capsys.readouterr().out
    assert "HA unit a: 2 checkpoint(s), 1 damaged" in out
    assert "HA unit b: 1 checkpoint(s)," in out and "b: 1 checkpoint(s), 1 damaged" not in out
    assert any(line.split()[:2] == ["a-3", "DAMAGED"] for line in out.splitlines())


def test_verify_ok_then_detects_flipped_byte(two_units: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """verify exits 0 on a healthy root and 1 naming the damaged checkpoint and page."""
    assert main(["checkpoints", "verify", str(two_units)]) == 0
    assert capsys.readouterr().out.count("ok ") == 4
    victim = two_units / "checkpoint" / "a-2" / "w000.pages"
    data = bytearray(victim.read_bytes())
    data[4096 + 77] ^= 1
    victim.write_bytes(bytes(data))
    assert main(["checkpoints", "verify", str(two_units)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED a-2" in out and "checksum" in out and "1 of 4" in out
    # a-3 references pages of a-2: it is damaged only if it references the flipped page
    assert main(["checkpoints", "verify", str(two_units), "--checkpoint", "b-1"]) == 0


def test_show_prints_manifest(two_units: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """show prints the latest manifest of a unit, a named one, or raw JSON."""
    assert main(["checkpoints", "show", str(two_units), "--haunit", "a"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint      a-3" in out and "incremental, depth 2, base a-2" in out
    assert '"step": 2' in out and "page table (first 10" in out
    assert main(["checkpoints", "show", str(two_units), "b-1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format_version"] == 2 and doc["name"] == "b-1"
    assert main(["checkpoints", "show", str(two_units)]) == 2  # two units: ambiguous
    assert "several HA units" in capsys.readouterr().err


def test_cli_bad_input_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Unknown schemes, missing checkpoints and empty roots give clear messages."""
    assert main(["checkpoints", "ls", "ftp://x/y"]) == 2
    assert "unsupported scheme" in capsys.readouterr().err
    assert main(["checkpoints", "ls", str(tmp_path)]) == 0
    assert "no checkpoints" in capsys.readouterr().out
    assert main(["checkpoints", "show", str(tmp_path), "nope-1"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["checkpoints", "verify", str(tmp_path), "--checkpoint", "../x"]) == 2
    assert "not a checkpoint name" in capsys.readouterr().err


def test_cli_runs_as_python_module(two_units: Path) -> None:
    """``python -m sguard checkpoints ls`` works in a fresh process."""
    proc = subprocess.run([sys.executable, "-m", "sguard", "checkpoints", "ls", str(two_units)],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)  # a hang guard, not a speed check
    assert proc.returncode == 0, proc.stderr
    assert "HA unit a" in proc.stdout


@pytest.mark.hdfs
def test_roundtrip_on_hdfs(hdfs_uri: str) -> None:
    """With SGUARD_TEST_HDFS_URI set, an incremental chain round-trips through HDFS."""
    root = open_root(hdfs_uri)
    pm = new_pm()
    s = open_structures(pm)
    with CheckpointManager(pm, root, "h", policy=CheckpointPolicy(full_every=2)) as mgr:
        for step in range(3):
            mutate(s, step)
            mgr.checkpoint().result(timeout_s=600)
    pm2 = new_pm()
    assert restore(pm2, root, "h").name == "h-3"
    assert state_of(open_structures(pm2)) == state_of(s)
