"""The sguard variant of `bench.spark_stateful`, measured from outside `sguard.spark`.

The query is ``sguard.spark.stateful(df, key="key", operator=RunningAggregate(value="ts",
aggs=(count, min, max)), state_uri=file://<run>/state, num_partitions=2,
local_dir=<run>/local)`` with the runtime's default checkpoint policy (every 4 batches,
asynchronous, incremental). The per-task timings come from the runtime's metrics
records (``<state_uri>/metrics/p*/b*.json``, `sguard.spark.metrics`):

* ``state_ms``: ``apply_ms`` (the operator's work on the partition's rows);
* ``prepare_ms``: the checkpoint's prepare pause (0 in batches without a checkpoint);
* ``snapshot_ms``: the rollback point (an mmm snapshot plus ``base.npy`` and the marker);
* ``log_wait_ms``: waiting for the input-log write that ran beside ``apply``;
* ``recovery_ms``: bringing the state to "after b-1" (re-attach, rollback or restore);
* ``lock_wait_ms``: waiting for the partition's lock (the previous worker keeps it until
  its checkpoint in flight is durable);
* ``checkpoint_start_ms``: the runtime's ``checkpoint_call_ms``, starting a checkpoint on
  the task's thread: prepare + adopting a recorded base + reading the page versions
  (``start_beyond_prepare_ms`` = that minus the prepare pause; its parts ``adopt_ms``,
  ``manager_ms`` (the checkpoint manager's call, prepare included), ``versions_ms``);
* ``commit_ms`` (the "checkpoint" column of the breakdown): everything the runtime does on
  the batch's critical path for durability and rollback: lock wait + checkpoint start +
  snapshot + log wait, of the partition where that sum is largest (`critical_path_ms`).

``state_ms`` and ``attach_ms`` are means over the partitions of a batch (the
per-partition figures); the durability parts are the slowest partition's.

The query can key on the workload's string or composite key columns (``kind``) and take
another checkpoint policy (``checkpoint_every``; `NO_CHECKPOINTS` for none).

`recovery` measures restore plus replay after the executor's local state is lost: a
query runs batches ``0..6`` (the default policy checkpoints "after 3" at the start of
batch 4), the local state directory is deleted, and the query restarts from its
``checkpointLocation`` with one more file; the partitions of batch 7 restore the
checkpoint and replay batches 4-6 from the input log (3 batches: the longest replay the
every-4-batches policy allows). ``recovery_s`` is the slowest partition's
``recovery_ms``; the whole first batch's duration is reported beside it.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import _spark_variants as V

CHECKPOINT_EVERY = 4


NO_CHECKPOINTS = 0
"""``checkpoint_every=NO_CHECKPOINTS``: `CheckpointConfig(every_n_batches=None,
interval_s=None)`, the runtime's way to take no checkpoints (rollback points and the
input log stay: exactly-once within the local state, nothing durable)."""


class KeysNotSupported(RuntimeError):
    """`sguard.spark.stateful` refuses this key (string / composite keys not built yet)."""


def _key_arg(kind: str) -> Any:
    cols = V.KEY_COLUMNS[kind]
    return cols[0] if len(cols) == 1 else list(cols)


def _query(spark: Any, df: Any, partitions: int, run_dir: Path, kind: str = "int",
           checkpoint_every: int = CHECKPOINT_EVERY) -> Any:
    import sguard.spark as ss

    op = ss.RunningAggregate(value="ts", aggs=("count", "min", "max"))
    ck = (ss.CheckpointConfig(every_n_batches=None, interval_s=None)
          if checkpoint_every == NO_CHECKPOINTS
          else ss.CheckpointConfig(every_n_batches=checkpoint_every))
    try:
        return ss.stateful(df, key=_key_arg(kind), operator=op,
                           state_uri=(run_dir / "state").as_uri(),
                           num_partitions=partitions, local_dir=str(run_dir / "local"),
                           checkpoint=ck)
    except Exception as e:  # noqa: BLE001 - only a refused key type is "not available"
        # a refused key type; a composite key that the API takes for one column name
        if kind != "int" and (type(e).__name__ == "UnsupportedKeyTypeError"
                              or isinstance(e, TypeError)
                              or (kind == "composite"
                                  and type(e).__name__ == "SchemaChangedError")):
            raise KeysNotSupported(f"{kind} keys: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:200]}") from e
        raise


def build(spark: Any, df: Any, n_keys: int, partitions: int, run_dir: Path, kind: str = "int",
          checkpoint_every: int = CHECKPOINT_EVERY) -> tuple[Any, str, Any]:
    (run_dir / "state").mkdir(parents=True, exist_ok=True)
    return (_query(spark, df, partitions, run_dir, kind, checkpoint_every), "append",
            {"run_dir": run_dir, "partitions": partitions})


def read_records(run_dir: Path, expect: int, timeout_s: float = 20.0
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The runtime's batch and checkpoint records, waiting (briefly) for ``expect`` batch
    records: the runtime writes them on a background thread."""
    from ioservice import open_root
    from sguard.spark.metrics import read_metrics

    root = open_root((run_dir / "state").as_uri())
    t0 = time.monotonic()
    while True:
        bs, cs = read_metrics(root)
        if len(bs) >= expect or time.monotonic() - t0 > timeout_s:
            return bs, cs
        time.sleep(0.2)


_FIELDS = ("apply_ms", "prepare_ms", "snapshot_ms", "log_wait_ms", "recovery_ms",
           "lock_wait_ms", "total_ms")


def critical_path_ms(rec: dict[str, Any]) -> dict[str, float]:
    """One task's durability and rollback work on its batch's critical path (ms).

    * ``lock_wait_ms``: waiting for the partition's lock, which the previous worker holds
      until its checkpoint in flight is durable (all of it is counted, whatever held it);
    * ``checkpoint_start_ms``: deciding and starting a checkpoint: the prepare pause plus
      adopting a recorded base and reading the page versions (the runtime's
      ``checkpoint_call_ms``; runtimes without that field: ``prepare_ms`` alone);
    * ``snapshot_ms``: the rollback point; ``log_wait_ms``: the input-log write's tail.
    """
    lock = float(rec.get("lock_wait_ms", 0.0))
    start = float(rec.get("checkpoint_call_ms", rec.get("prepare_ms", 0.0)))
    snap, logw = float(rec.get("snapshot_ms", 0.0)), float(rec.get("log_wait_ms", 0.0))
    return {"lock_wait_ms": lock, "checkpoint_start_ms": start,
            "start_beyond_prepare_ms": max(0.0, start - float(rec.get("prepare_ms", 0.0))),
            "snapshot_ms": snap, "log_wait_ms": logw, "total": lock + start + snap + logw}


def collect(ctx: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the runtime's per-task metrics into the per-batch rows.

    The state work (``state_ms``) is the mean over partitions (the per-partition figure);
    the checkpoint work on the critical path (``commit_ms``) and its parts are the
    slowest partition's (`critical_path_ms`: the batch ends when its slowest task does)."""
    p = int(ctx["partitions"])
    bs, cs = read_records(ctx["run_dir"], len(rows) * p)
    per: dict[int, list[dict[str, Any]]] = {}
    for r in bs:
        per.setdefault(int(r["batch"]), []).append(r)
    for row in rows:
        recs = per.get(row["batch"], [])
        if not recs:
            row["state_ms"] = row["commit_ms"] = None
            continue
        m = {f: float(np.mean([float(r.get(f, 0.0)) for r in recs])) for f in _FIELDS}
        row["state_ms"] = m["apply_ms"]
        row["state_ms_max"] = max(float(r.get("apply_ms", 0.0)) for r in recs)
        cp = [critical_path_ms(r) for r in recs]
        worst = max(cp, key=lambda c: c["total"])
        row["prepare_ms"] = max(float(r.get("prepare_ms", 0.0)) for r in recs)
        for f in ("lock_wait_ms", "checkpoint_start_ms", "start_beyond_prepare_ms",
                  "snapshot_ms", "log_wait_ms"):
            row[f] = max(c[f] for c in cp)       # each part's slowest partition
            row[f + "_critical"] = worst[f]      # the parts of the slowest partition's total
        row["attach_ms"] = m["recovery_ms"]
        row["attach_ms_max"] = max(float(r.get("recovery_ms", 0.0)) for r in recs)
        row["task_total_ms"] = m["total_ms"]
        row["task_total_ms_max"] = max(float(r.get("total_ms", 0.0)) for r in recs)
        row["commit_ms"] = worst["total"]
        row["commit_ms_mean_over_partitions"] = float(np.mean([c["total"] for c in cp]))
        row["checkpoint_started"] = any(float(r.get("prepare_ms", 0.0)) > 0 for r in recs)
        for f in ("adopt_ms", "manager_ms", "versions_ms"):  # the parts of checkpoint_start_ms
            row[f] = max(float(r.get(f, 0.0)) for r in recs)
        bases = sorted({str(r["checkpoint_base"]) for r in recs if "checkpoint_base" in r})
        if bases:
            row["checkpoint_base"] = bases
        row["recovery_actions"] = sorted({str(r.get("recovery", "")) for r in recs})
        row["state_keys"] = sum(int(r.get("state_keys", 0)) for r in recs)
    return {"checkpoints": [{k: c.get(k) for k in ("partition", "checkpoint_seq", "batch",
                                                   "written_bytes", "pages", "full")}
                            for c in cs]}


def recovery(spark: Any, work: Path, n_keys: int, partitions: int, batches: int = 7
             ) -> dict[str, Any]:
    """Restore + replay after the local state is lost (see the module docstring)."""
    run_dir = work / "runs" / f"recovery-k{n_keys}"
    run_dir.mkdir(parents=True)
    src_dir = run_dir / "input"
    src_dir.mkdir()
    all_dir = work / "input" / f"k{n_keys}" / "all"
    V.write_files(work / "input", n_keys, batches + 1)
    for b in range(batches):
        os.link(all_dir / f"batch-{b:05d}.parquet", src_dir / f"batch-{b:05d}.parquet")
    ckpt = run_dir / "checkpoint"
    (run_dir / "state").mkdir()
    r1 = V.run_query(spark, _query(spark, V.source(spark, src_dir), partitions, run_dir),
                     "append", ckpt, f"sguard_recovery_a_k{n_keys}")
    first = V.batch_rows(r1["progress"], partitions)
    # wait until the checkpoint "after CHECKPOINT_EVERY-1" of every partition is durable
    t0 = time.monotonic()
    while True:
        bs, cs = read_records(run_dir, batches * partitions)
        durable = {int(c["partition"]) for c in cs}
        if len(durable) == partitions or time.monotonic() - t0 > 60:
            break
        time.sleep(0.5)
    if len(durable) < partitions:
        raise RuntimeError(f"no durable checkpoint for partitions "
                           f"{sorted(set(range(partitions)) - durable)} after 60 s")
    ck_batch = max(int(c["batch"]) for c in cs)
    shutil.rmtree(run_dir / "local")  # the executor's local state is lost
    os.link(all_dir / f"batch-{batches:05d}.parquet", src_dir / f"batch-{batches:05d}.parquet")
    r2 = V.run_query(spark, _query(spark, V.source(spark, src_dir), partitions, run_dir),
                     "append", ckpt, f"sguard_recovery_b_k{n_keys}")
    second = V.batch_rows(r2["progress"], partitions)
    if len(second) != 1 or second[0]["batch"] != batches:
        raise RuntimeError(f"restart ran batches {[b['batch'] for b in second]}, "
                           f"expected [{batches}]")
    bs, _ = read_records(run_dir, (batches + 1) * partitions)
    recs = [r for r in bs if int(r["batch"]) == batches]
    if len(recs) != partitions:
        raise RuntimeError(f"restart: {len(recs)} metric records for batch {batches}")
    actions = sorted({str(r.get("recovery")) for r in recs})
    steady = [b["duration_ms"] for b in first[1:]]
    out = {"n_keys": n_keys, "batches_before_loss": batches, "checkpoint_batch": ck_batch,
           "recovery_s": max(float(r["recovery_ms"]) for r in recs) / 1e3,
           "recovery_ms_per_partition": [float(r["recovery_ms"]) for r in recs],
           "replay_batches": max(int(r.get("replayed_batches", 0)) for r in recs),
           "replay_rows": max(int(r.get("replayed_batches", 0)) for r in recs)
           * V.ROWS_PER_BATCH,
           "actions": actions,
           "first_batch_after_loss_ms": second[0]["duration_ms"],
           "steady_batch_ms_median": float(np.median(steady)) if steady else None,
           "state_keys_after": sum(int(r.get("state_keys", 0)) for r in recs)}
    shutil.rmtree(run_dir, ignore_errors=True)
    return out
