"""Whole processes lost under a PySpark StatefulProcessor on sguard, with Spark as the
oracle: the driver SIGKILLed mid-batch and restarted on the same checkpointLocation and
state URI, and an executor JVM SIGKILLed mid-batch under ``local-cluster``. Every batch's
output must equal Spark's own ``transformWithStateInPandas`` run (computed once here), and
each batch reaches the sink once per driver that committed it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.spark.helpers import task_records
from tests.spark.test_processes import _executor_of, _wait_for
from tests.spark.test_processors import (INITIAL, KITCHEN_OUT, SCHEMA, KitchenSink, _input,
                                         _spark_run, _stream, _tws)

pytest.importorskip("pyspark")
pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
BATCHES = 5


@pytest.fixture(scope="module")
def oracle(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The input and Spark's own output of `KitchenSink` on it, batch by batch."""
    tmp = tmp_path_factory.mktemp("processor-failures")
    d = _input(tmp / "in", BATCHES, 300, 20, 5)
    with _tws(spark):
        init = spark.createDataFrame(INITIAL, "k long, start long")
        want = _spark_run(lambda: _stream(spark, d, SCHEMA, "2 seconds").groupBy("k")
                          .transformWithStateInPandas(KitchenSink(), KITCHEN_OUT, "Update",
                                                      "EventTime",
                                                      initialState=init.groupBy("k")),
                          tmp / "spark-ckpt")
    assert sorted(want) == list(range(BATCHES))
    assert any(r[1] == "timer" for b in (3, 4) for r in want[b])  # timers fire after the kill
    return d, want


def _driver(master: str, inp: Path, work: Path, *faults: str) -> list[str]:
    return [sys.executable, "-m", "tests.spark.processor_driver", master, str(inp), str(work),
            *faults]


def _outputs(work: Path) -> tuple[dict[int, list[tuple[Any, ...]]], list[tuple[int, int]]]:
    """(each batch's sink rows, ``(batch, driver pid)`` per sink call in order)."""
    got = {int(f.stem): [tuple(r) for r in json.loads(f.read_text())]
           for f in (work / "out").glob("*.json")}
    emitted = [(int(b), int(p)) for b, p in
               (line.split() for line in (work / "out" / "emitted").read_text().splitlines())]
    return got, emitted


def test_driver_sigkilled_mid_batch_and_restarted(oracle: Any, tmp_path: Path) -> None:
    """The driver (its process group: JVM and Python workers) is SIGKILLed while batch 3
    is half applied in partition 1; a second driver on the same checkpointLocation and
    state URI replays batch 3 after rolling back what was applied. Batches 0-2 reach the
    sink from the first driver only, 3-4 from the second only, all equal to Spark's."""
    d, want = oracle
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(tmp_path / "driver1.log", "wb") as log:
        first = subprocess.Popen(_driver("local[2,4]", d, tmp_path, "pause:3:1:mid"), cwd=ROOT,
                                 env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            _wait_for(tmp_path / "faults" / "paused-b3-p1", first)
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert not (tmp_path / "result.json").exists()
    with open(tmp_path / "driver2.log", "wb") as log:
        second = subprocess.run(_driver("local[2,4]", d, tmp_path), cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, timeout=600)
    assert second.returncode == 0, (tmp_path / "driver2.log").read_text()[-3000:]
    got, emitted = _outputs(tmp_path)
    assert got == want
    assert [b for b, _ in emitted] == list(range(BATCHES))
    assert {p for b, p in emitted if b < 3} == {first.pid}
    assert first.pid not in {p for b, p in emitted if b >= 3}
    from ioservice import open_root
    recs = task_records(open_root(str(tmp_path / "state")), {(3, 1)})
    assert recs[(3, 1)]["recovery"] == "rolled_back_file"


def test_executor_killed_under_local_cluster(oracle: Any, tmp_path: Path) -> None:
    """Two executor JVMs; the one running partition 0 of batch 3 is SIGKILLed mid-batch.
    Spark reschedules the task on a new executor, which rolls back what the dead one
    applied (both share this host's /dev/shm); one query run, output equal to Spark's."""
    d, want = oracle
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(tmp_path / "driver.log", "wb") as log:
        proc = subprocess.Popen(_driver("local-cluster[2,1,1024]", d, tmp_path,
                                        "pause:3:0:mid"), cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            paused = tmp_path / "faults" / "paused-b3-p0"
            _wait_for(paused, proc)
            os.kill(_executor_of(int(paused.read_text())), signal.SIGKILL)
            assert proc.wait(600) == 0, (tmp_path / "driver.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    got, emitted = _outputs(tmp_path)
    assert got == want
    assert [b for b, _ in emitted] == list(range(BATCHES))
    assert json.loads((tmp_path / "result.json").read_text())["failures"] == 0
