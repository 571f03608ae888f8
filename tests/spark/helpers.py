"""Helpers of the Spark tests: input generation, query runs, a numpy oracle, and waits
for what a query writes asynchronously (metrics records, checkpoints)."""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HANG_S = 600.0  #: every wait's bound: far above any load, it only turns a hang into a failure
T = TypeVar("T")


@dataclass
class StreamInput:
    dir: Path
    tables: list[pa.Table]


def make_input(d: Path, batches: int, rows: int, keys: int, seed: int) -> StreamInput:
    return make_input_spec(d, [(rows, 0, keys)] * batches, seed)


def make_input_spec(d: Path, spec: list[tuple[int, int, int]], seed: int) -> StreamInput:
    """One parquet file per batch: ``(rows, lowest key, highest key + 1)`` each."""
    tables = []
    for i, (rows, lo, hi) in enumerate(spec):
        rng = np.random.default_rng([seed, i])
        ts = (i * 10_000_000 + rng.integers(0, 10_000_000, rows)).astype("datetime64[us]")
        t = pa.table({"k": rng.integers(lo, hi, rows, dtype=np.int64),
                      "v": rng.integers(-500, 500, rows, dtype=np.int64),
                      "ts": pa.array(ts, pa.timestamp("us", tz="UTC"))})
        f = d / f"part-{i:05d}.parquet"
        pq.write_table(t, f)
        os.utime(f, (1_700_000_000 + i, 1_700_000_000 + i))  # the file source orders by mtime
        tables.append(t)
    return StreamInput(d, tables)


def running_oracle(tables: list[pa.Table]) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(sorted sink rows, sorted final state rows) of RunningAggregate(value="v")."""
    state: dict[int, list[int]] = {}
    out = []
    for t in tables:
        k, v = t["k"].to_numpy(), t["v"].to_numpy()
        for key, val in zip(k.tolist(), v.tolist()):
            s = state.get(key)
            if s is None:
                state[key] = [1, val, val, val]
            else:
                s[0] += 1
                s[1] += val
                s[2] = min(s[2], val)
                s[3] = max(s[3], val)
        for key in np.unique(k).tolist():
            out.append((key, *state[key]))
    return sorted(out), sorted((k, *s) for k, s in state.items())


def stream(spark: Any, inp: StreamInput) -> Any:
    return (spark.readStream.schema("k long, v long, ts timestamp")
            .option("maxFilesPerTrigger", 1).parquet(str(inp.dir)))


def run_query(spark: Any, inp: StreamInput, work: Path, operator: Any, *, faults: Any = None,
              partitions: int = 2, restarts: int = 3, state_uri_override: str | None = None,
              durable: bool = False,
              **kw: Any) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], int]:
    """Run a stateful query to the end of the input, restarting it (same
    checkpointLocation) when it fails; returns (sink rows, state rows, failures).

    The state rows are read from the executors' local pools, or with `durable` from the
    state URI alone (checkpoints and input log: any page size), sorted."""
    import sguard.spark as ss
    from sguard.spark.state import read_durable_state, read_local_state
    failures = 0
    uri = state_uri_override or str(work / "state")
    while True:
        out = ss.stateful(stream(spark, inp), "k", operator, uri, partitions,
                          faults=faults, local_dir=str(work / "local"), **kw)
        q = (out.writeStream.format("parquet").option("path", str(work / "out"))
             .option("checkpointLocation", str(work / "ckpt")).start())
        try:
            q.processAllAvailable()
            q.stop()
            break
        except Exception:
            failures += 1
            q.stop()
            if failures > restarts:
                raise
            time.sleep(0.2)
    rows = sorted(tuple(r) for r in spark.read.parquet(str(work / "out")).collect())
    if durable:
        got, _ = read_durable_state(uri)
        return rows, sorted(tuple(r.values()) for r in got.to_pylist()), failures
    # taking each partition's lock also waits for its checkpoint in flight (a worker
    # holds the lock until the checkpoint is durable): the bound only catches a hang
    st, _ = read_local_state(uri, storage_options=kw.get("storage_options"),
                             local_dir=str(work / "local"), lock_timeout_s=HANG_S)
    return rows, [tuple(r.values()) for r in st.to_pylist()], failures


# ------------------------------------------------------------- asynchronous writes


def wait_until(ready: Callable[[], T | None], what: str, hang_s: float = HANG_S) -> T:
    """Poll `ready` until it returns something other than None; return that."""
    t0 = time.monotonic()
    while (got := ready()) is None:
        assert time.monotonic() - t0 < hang_s, f"{what}: not after {hang_s} s (a hang)"
        time.sleep(0.1)
    return got


def every_batch(last: int, partitions: int) -> set[tuple[int, int]]:
    """``(batch, partition)`` of batches 0..`last` in every one of `partitions`."""
    return {(b, p) for b in range(last + 1) for p in range(partitions)}


def last_batch(work: Path) -> int:
    """The last batch the query in `work` committed (its Spark checkpointLocation)."""
    return max(int(f.name) for f in (work / "ckpt" / "commits").iterdir() if f.name.isdigit())


def landed_metrics(root: Any, tasks: Iterable[tuple[int, int]], *, checkpoints: bool = False
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`read_metrics` once the records of `tasks` (``(batch, partition)``) have landed.

    A task's record is written by an I/O thread after the task returned, so a query
    (or a task) can be over before its record is there. With `checkpoints`, also wait until
    every checkpoint those records say was started (a record of batch b with
    ``checkpoint_base``: the state after b-1) has its durable record: which batches start
    one depends on which worker ran each batch (a worker that attaches a partition seeds its
    policy from the durable batch it finds). Only for one generation's records (checkpoint
    records are per HA unit's sequence number) whose started checkpoints all commit."""
    from sguard.spark.metrics import read_metrics
    want = set(tasks)

    def ready() -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
        batches, ckpts = read_metrics(root)
        if not {(r["batch"], r["partition"]) for r in batches} >= want:
            return None
        if checkpoints:
            started = sorted((r["partition"], r["batch"] - 1) for r in batches
                             if "checkpoint_base" in r)
            if started != sorted((r["partition"], r["batch"]) for r in ckpts):
                return None
        return batches, ckpts
    return wait_until(ready, f"metrics records of {sorted(want)}"
                      + (" and their checkpoints" if checkpoints else ""))


def task_records(root: Any, tasks: Iterable[tuple[int, int]]) -> dict[tuple[int, int],
                                                                     dict[str, Any]]:
    """The batch records by ``(batch, partition)``, once those of `tasks` have landed."""
    return {(r["batch"], r["partition"]): r for r in landed_metrics(root, tasks)[0]}
