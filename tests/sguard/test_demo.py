"""The README's main job: worker killed mid-run, recovery, replay, exactly-once check."""
import json
import os
import subprocess
import sys


def test_demo_recovers_after_sigkill_and_matches_failure_free_run(tmp_path):
    """The demo kills its worker, recovers the latest checkpoint and ends with the oracle's state."""
    root = tmp_path / "data"
    cmd = [sys.executable, "-m", "sguard", "demo", "--batches", "12", "--batch", "4000",
           "--groups", "3000", "--checkpoint-every", "2", "--kill-at", "9", "--root", str(root),
           "--page-bytes", "4096", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["killed"] is True
    assert result["recovered_from"] is not None
    assert 2 <= result["recovered_batches"] <= 9
    assert result["recovered_ok"] and result["final_ok"]
    assert (root / "checkpoint").is_dir()
