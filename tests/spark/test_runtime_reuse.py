"""A Python worker keeps its partitions from task to task in real Spark: every task
unpickles a new copy of the query's `RuntimeConfig` (and of its operator, which has no
equality of its own), and the runtime must still see the same query and keep the page
manager and rollback point it holds, rather than re-attach the pool file each batch."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

import sguard.spark as ss
from ioservice import open_root
from sguard.spark.runtime import RuntimeConfig
from sguard.statelayout import OperatorLayout
from tests.spark.helpers import StreamInput, every_batch, run_query, running_oracle, \
    task_records

ROOT = Path(__file__).resolve().parents[2]


def _same_worker_batches(work: Path, n: int) -> list[int]:
    """Batches that ran in the Python worker that ran the batch before; each must have
    found its partition in that worker's memory."""
    recs = task_records(open_root(str(work / "state")), every_batch(n - 1, 1))
    same = [b for b in range(1, n) if recs[(b, 0)]["pid"] == recs[(b - 1, 0)]["pid"]]
    for b in same:  # the worker that ran b - 1 holds "after b-1" in memory
        assert recs[(b, 0)]["recovery"] == "cached", (b, recs[(b, 0)]["reason"])
    return same


def test_same_worker_keeps_its_partition(spark: Any, stream_input: StreamInput,
                                         tmp_path: Path) -> None:
    n = len(stream_input.tables)
    rows, state, failures = run_query(spark, stream_input, tmp_path / "shared",
                                      ss.RunningAggregate("v"), partitions=1)
    assert failures == 0
    assert (rows, state) == running_oracle(stream_input.tables)
    if _same_worker_batches(tmp_path / "shared", n):
        return
    # Spark hands a task the longest-idle Python worker: with several idle workers (left by
    # earlier queries of this SparkSession) consecutive batches rotate through them. A
    # driver of its own (local[1]) has one Python worker, which serves every batch.
    work = tmp_path / "own"
    out = subprocess.run([sys.executable, "-m", "tests.spark.cluster_driver", "local[1]",
                          str(stream_input.dir), str(work)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), SGUARD_TEST_PARTITIONS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((work / "result.json").read_text())
    assert (res["failures"], [tuple(r) for r in res["rows"]], [tuple(r) for r in res["state"]]) \
        == (0, *running_oracle(stream_input.tables))
    assert _same_worker_batches(work, n), "no two consecutive batches ran in one Python worker"


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
