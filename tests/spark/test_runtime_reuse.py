"""A Python worker keeps its partitions from task to task in real Spark: every task
unpickles a new copy of the query's `RuntimeConfig` (and of its operator, which has no
equality of its own), and the runtime must still see the same query and keep the page
manager and rollback point it holds, rather than re-attach the pool file each batch."""
from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

import sguard.spark as ss
from ioservice import open_root
from sguard.spark.runtime import RuntimeConfig
from sguard.statelayout import OperatorLayout
from tests.spark.helpers import StreamInput, every_batch, run_query, running_oracle, \
    task_records

IDLE_WORKER_TIMEOUT_S = 75
"""Spark's PythonWorkerFactory stops its idle workers after 1 minute without Python tasks
(checked every 10 s)."""


def test_same_worker_keeps_its_partition(spark: Any, stream_input: StreamInput,
                                         tmp_path: Path) -> None:
    for attempt in range(2):
        work = tmp_path / f"run{attempt}"
        rows, state, failures = run_query(spark, stream_input, work, ss.RunningAggregate("v"),
                                          partitions=1)
        assert failures == 0
        assert (rows, state) == running_oracle(stream_input.tables)
        n = len(stream_input.tables)
        recs = task_records(open_root(str(work / "state")), every_batch(n - 1, 1))
        same = [b for b in range(1, n) if recs[(b, 0)]["pid"] == recs[(b - 1, 0)]["pid"]]
        for b in same:  # the worker that ran b - 1 holds "after b-1" in memory
            assert recs[(b, 0)]["recovery"] == "cached", (b, recs[(b, 0)]["reason"])
        if same:
            return
        # Spark hands a task the longest-idle Python worker: with several idle workers
        # (left by earlier queries of this SparkSession) consecutive batches rotate
        # through them. Spark stops idle workers after a minute without Python tasks;
        # then one worker serves every batch of a one-partition query.
        time.sleep(IDLE_WORKER_TIMEOUT_S)
    raise AssertionError("no two consecutive batches ran in the same Python worker")


def test_config_equal_after_unpickling_and_new_per_query(tmp_path: Path) -> None:
    op = ss.RunningAggregate("v")
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    lay = OperatorLayout(operator=op.kind, name="op", schema={"params": op.params()},
                         num_partitions=1, key="k")

    def config() -> RuntimeConfig:
        return RuntimeConfig(state_uri=str(tmp_path), state_key="x", layout=lay,
                             operator=ss.RunningAggregate("v"), key="k", input_schema=schema,
                             output_schema=op.output_schema(schema, "k"),
                             local_dir=str(tmp_path))
    cfg = config()
    copy = pickle.loads(pickle.dumps(cfg))
    assert copy.operator is not cfg.operator and copy == cfg  # what each task unpickles
    assert config() != cfg  # another query definition: a runtime of its own
