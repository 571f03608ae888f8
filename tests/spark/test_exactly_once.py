"""Exactly-once on real Spark (``local[2,4]``): after each failure the sink's rows and
the final state equal a failure-free run of the same input, row for row."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sguard.spark as ss
from ioservice import list_checkpoints, open_root
from tests.spark.helpers import StreamInput, run_query, running_oracle, task_records

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def reference(spark: Any, stream_input: StreamInput,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    """A failure-free run, itself checked against the numpy oracle."""
    rows, state, failures = run_query(spark, stream_input, tmp_path_factory.mktemp("ref"),
                                      ss.RunningAggregate(value="v"))
    want_rows, want_state = running_oracle(stream_input.tables)
    assert failures == 0
    assert rows == want_rows
    assert state == want_state
    return rows, state


def _faults(tmp: Path, *faults: ss.Fault) -> ss.FaultPlan:
    d = tmp / "faults"
    d.mkdir()
    return ss.FaultPlan(tuple(faults), str(d))


def _fired(plan: ss.FaultPlan) -> int:
    return len([f for f in os.listdir(plan.fault_dir) if f.startswith("fired-")])


def test_python_worker_killed_mid_batch(spark: Any, stream_input: StreamInput, tmp_path: Path,
                                        reference: Any) -> None:
    """SIGKILL of the Python worker after half a batch: Spark retries the task and the
    retry rolls the partly applied batch back (from the pool file, in a new worker)."""
    plan = _faults(tmp_path, ss.Fault("kill", 2, 0, "mid"), ss.Fault("kill", 4, 1, "end"))
    rows, state, failures = run_query(spark, stream_input, tmp_path, ss.RunningAggregate(value="v"),
                                      faults=plan)
    assert _fired(plan) == 2
    assert (rows, state) == reference


def test_exception_after_other_partition_applied(spark: Any, stream_input: StreamInput,
                                                 tmp_path: Path, reference: Any) -> None:
    """Partition 1 fails batch 3 in all 4 attempts after partition 0 applied it: the
    query fails; restarted from its checkpointLocation, Spark replays batch 3 and
    partition 0 rolls it back before applying it again."""
    plan = _faults(tmp_path, *[ss.Fault("raise", 3, 1, "mid")] * 4)
    rows, state, failures = run_query(spark, stream_input, tmp_path, ss.RunningAggregate(value="v"),
                                      faults=plan)
    assert failures == 1 and _fired(plan) == 4
    assert (rows, state) == reference


def test_local_state_deleted(spark: Any, stream_input: StreamInput, tmp_path: Path,
                             reference: Any) -> None:
    """An executor's local state vanishes (a lost host): the partition restores its DFS
    checkpoint and replays the logged input since."""
    plan = _faults(tmp_path, ss.Fault("delete_local", 4, 0, "start"),
                   ss.Fault("delete_local", 5, 1, "start"))
    rows, state, _ = run_query(spark, stream_input, tmp_path, ss.RunningAggregate(value="v"),
                               faults=plan, checkpoint=ss.CheckpointConfig(every_n_batches=2))
    assert _fired(plan) == 2
    assert (rows, state) == reference
    # the records are written after each task, by an I/O thread: batch 5's may land late
    recs = task_records(open_root(str(tmp_path / "state")), {(4, 0), (5, 1)})
    assert recs[(4, 0)]["recovery"] == "restored" and recs[(5, 1)]["recovery"] == "restored"
    assert recs[(4, 0)]["replayed_batches"] >= 1  # the checkpoint lags: the log fills the gap


def test_kill_during_checkpoint_write(spark: Any, stream_input: StreamInput, tmp_path: Path,
                                      reference: Any) -> None:
    """The worker is SIGKILLed while a checkpoint's pages are being written: that
    checkpoint never gets a manifest, the retried task proceeds from the local state."""
    plan = _faults(tmp_path, ss.Fault("kill_in_checkpoint", 3, 0, "checkpoint"))
    rows, state, _ = run_query(spark, stream_input, tmp_path, ss.RunningAggregate(value="v"),
                               faults=plan, checkpoint=ss.CheckpointConfig(every_n_batches=100))
    assert _fired(plan) == 1
    assert (rows, state) == reference
    root = open_root(str(tmp_path / "state"))
    from sguard.statelayout import haunit_name
    infos = list_checkpoints(root, haunit_name("running_aggregate", 0, 0))
    assert infos and not any(c.has_manifest for c in infos)  # killed mid-write: no manifest


@pytest.mark.parametrize("seed", [1])
def test_random_failure_schedule_on_spark(spark: Any, stream_input: StreamInput, tmp_path: Path,
                                          reference: Any, seed: int) -> None:
    """Seeded random mixes of worker kills, exceptions and lost local state in one run."""
    rng = np.random.default_rng(seed)
    kinds = ["kill", "raise", "delete_local"]
    faults = []
    for b in sorted(rng.choice(np.arange(1, 6), 3, replace=False).tolist()):
        kind = kinds[int(rng.integers(0, 3))]
        point = "start" if kind == "delete_local" else ["mid", "end"][int(rng.integers(0, 2))]
        faults.append(ss.Fault(kind, b, int(rng.integers(0, 2)), point))
    plan = _faults(tmp_path, *faults)
    rows, state, _ = run_query(spark, stream_input, tmp_path, ss.RunningAggregate(value="v"),
                               faults=plan, checkpoint=ss.CheckpointConfig(every_n_batches=2))
    assert _fired(plan) == len(faults), faults
    assert (rows, state) == reference, faults
