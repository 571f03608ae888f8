"""Failures of whole processes on real Spark: an executor JVM killed under
``local-cluster``, the driver SIGKILLed mid-batch and restarted, and the state URI on
SeaweedFS with a volume server killed. (The demo, whose driver is SIGKILLed and
restarted, runs as the README's first command in tests/test_readme.py.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import sguard.spark as ss
from tests.spark.helpers import (StreamInput, run_query, running_oracle, task_records,
                                 wait_until)

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]


def _wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    """Wait until `path` exists; fail at once if the driver exits first."""
    def there() -> bool | None:
        if path.exists():
            return True
        assert proc.poll() is None, f"driver exited ({proc.returncode}) before {path.name}"
        return None
    wait_until(there, path.name)


def _executor_of(pid: int) -> int:
    """The executor JVM among the ancestors of a Python worker."""
    p = pid
    for _ in range(6):
        with open(f"/proc/{p}/stat") as f:
            p = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{p}/cmdline", "rb") as f:
            if b"CoarseGrainedExecutorBackend" in f.read():
                return p
    raise AssertionError(f"no executor JVM above worker {pid}")


def kill_executor_mid_batch(stream_input: StreamInput, tmp_path: Path, batch: int,
                            partition: int, env: dict[str, str]) -> None:
    """Run the cluster driver on `local-cluster[2,1,1024]`, SIGKILL the executor running
    `partition` of `batch` mid-batch, and check the sink and the state against the oracle."""
    log = open(tmp_path / "driver.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.spark.cluster_driver", "local-cluster[2,1,1024]",
         str(stream_input.dir), str(tmp_path), f"pause:{batch}:{partition}:mid"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        paused = tmp_path / "faults" / f"paused-b{batch}-p{partition}"
        _wait_for(paused, proc)
        executor = _executor_of(int(paused.read_text()))
        os.kill(executor, signal.SIGKILL)
        assert proc.wait(600) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    res = json.loads((tmp_path / "result.json").read_text())
    want_rows, want_state = running_oracle(stream_input.tables)
    assert [tuple(r) for r in res["rows"]] == want_rows
    assert [tuple(r) for r in res["state"]] == want_state


def test_executor_killed_under_local_cluster(stream_input: StreamInput, tmp_path: Path) -> None:
    """Two executor JVMs; the one running partition 0 of batch 3 is SIGKILLed mid-batch.
    Spark replaces it and retries the task elsewhere; the retry rolls back what the dead
    executor applied (both executors share this host's /dev/shm)."""
    kill_executor_mid_batch(stream_input, tmp_path, 3, 0, dict(os.environ, PYTHONPATH=str(ROOT)))


def test_driver_sigkilled_mid_batch_and_restarted(stream_input: StreamInput,
                                                  tmp_path: Path) -> None:
    """The driver (its process group: JVM and Python workers) is SIGKILLed while batch 3 is
    half applied in partition 1; a new driver on the same checkpointLocation replays
    batch 3 (same id, same rows), which is rolled back first."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "tests.spark.cluster_driver", "local[2,4]",
           str(stream_input.dir), str(tmp_path)]
    with open(tmp_path / "driver1.log", "wb") as log:
        proc = subprocess.Popen(cmd + ["pause:3:1:mid"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_for(tmp_path / "faults" / "paused-b3-p1", proc)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not (tmp_path / "result.json").exists()
    with open(tmp_path / "driver2.log", "wb") as log:
        out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             timeout=500)
    assert out.returncode == 0, (tmp_path / "driver2.log").read_text()[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    want_rows, want_state = running_oracle(stream_input.tables)
    assert [tuple(r) for r in res["rows"]] == want_rows
    assert [tuple(r) for r in res["state"]] == want_state
    from ioservice import open_root
    recs = task_records(open_root(str(tmp_path / "state")), {(3, 1)})
    assert recs[(3, 1)]["recovery"] == "rolled_back_file"
    status = subprocess.run([sys.executable, "-m", "sguard", "spark", "status",
                             str(tmp_path / "state")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert status.returncode == 0, status.stderr
    assert "recovery events:" in status.stdout
    assert "batch 3 partition 1: rolled_back_file" in status.stdout, status.stdout


def test_status_errors_are_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "sguard", "spark", "status", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "no sguard operator state" in out.stderr
    out = subprocess.run([sys.executable, "-m", "sguard", "spark", "demo", "--batches", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "--batches" in out.stderr


@pytest.mark.seaweedfs
def test_state_on_seaweedfs_with_a_volume_server_killed(spark: Any, stream_input: StreamInput,
                                                        tmp_path: Path, seaweed: Any) -> None:
    """Checkpoints, input log and metrics on S3 (SeaweedFS, replication 010). While batch 3
    is paused mid-way, a rack1 volume server is killed (writes go on to the other
    rack1 server and rack2; the ones caught by the failure are retried by Spark); the run then loses partition 0's
    local state and restores it from the S3 checkpoint plus the S3 input log."""
    seaweed.create_bucket("sguard-spark")
    uri = f"s3://sguard-spark/{uuid.uuid4().hex[:12]}"
    opts = {"s3_endpoint": seaweed.s3_endpoint, "s3_access_key": seaweed.access_key,
            "s3_secret_key": seaweed.secret_key, "timeout_s": 5.0}
    (tmp_path / "faults").mkdir()
    plan = ss.FaultPlan((ss.Fault("pause", 3, 1, "mid"), ss.Fault("delete_local", 4, 0, "start")),
                        str(tmp_path / "faults"))
    import threading

    def killer() -> None:
        p = tmp_path / "faults" / "paused-b3-p1"
        t0 = time.monotonic()
        while not p.exists() and time.monotonic() - t0 < 600:  # a hang guard
            time.sleep(0.05)
        seaweed.kill_volume(0)
        (tmp_path / "faults" / "resume-b3-p1").write_text("")

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    try:
        rows, state, _ = run_query(spark, stream_input, tmp_path, ss.RunningAggregate(value="v"),
                                   faults=plan, checkpoint=ss.CheckpointConfig(every_n_batches=2),
                                   state_uri_override=uri, storage_options=opts, restarts=6)
    finally:
        th.join(5)
        seaweed.restart_volume(0)
    want_rows, want_state = running_oracle(stream_input.tables)
    assert rows == want_rows and state == want_state
    from ioservice import open_root
    recs = task_records(open_root(uri, **opts), {(4, 0)})  # written after the task
    assert recs[(4, 0)]["recovery"] == "restored"
