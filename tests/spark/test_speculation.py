"""Exactly-once under aggressive speculative execution on ``local-cluster`` (issue 18):
two executor JVMs, ``spark.speculation=true`` with a 50 ms check interval, quantile 0.1
and multiplier 1.1, and the executor running a paused task SIGKILLed, so that attempts of
one partition's batch overlap (a speculative copy waits for the partition while the
original holds it) and one dies mid-batch."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.spark.helpers import StreamInput, running_oracle
from tests.spark.test_processes import _executor_of, _wait_for

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
SPECULATION = {"spark.speculation": "true", "spark.speculation.interval": "50ms",
               "spark.speculation.quantile": "0.1", "spark.speculation.multiplier": "1.1",
               "spark.speculation.minTaskRuntime": "1ms", "spark.task.maxFailures": "8"}


def test_exactly_once_with_aggressive_speculation_and_an_executor_killed(
        stream_input: StreamInput, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), SGUARD_TEST_SPARK_CONF=json.dumps(SPECULATION))
    log = open(tmp_path / "driver.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.spark.cluster_driver", "local-cluster[2,1,1024]",
         str(stream_input.dir), str(tmp_path), "pause:2:1:mid"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        paused = tmp_path / "faults" / "paused-b2-p1"
        _wait_for(paused, proc, 400)
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
