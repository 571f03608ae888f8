"""Helpers of the Spark tests: input generation, query runs, and a numpy oracle."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


@dataclass
class StreamInput:
    dir: Path
    tables: list[pa.Table]


def make_input(d: Path, batches: int, rows: int, keys: int, seed: int) -> StreamInput:
    tables = []
    for i in range(batches):
        rng = np.random.default_rng([seed, i])
        ts = (i * 10_000_000 + rng.integers(0, 10_000_000, rows)).astype("datetime64[us]")
        t = pa.table({"k": rng.integers(0, keys, rows, dtype=np.int64),
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
              **kw: Any) -> tuple[list[tuple[Any, ...]],
                                                                          list[tuple[Any, ...]], int]:
    """Run a stateful query to the end of the input, restarting it (same
    checkpointLocation) when it fails; returns (sink rows, state rows, failures)."""
    import sguard.spark as ss
    from sguard.spark.state import read_local_state
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
    st, _ = read_local_state(uri, storage_options=kw.get("storage_options"),
                             local_dir=str(work / "local"))
    return rows, [tuple(r.values()) for r in st.to_pylist()], failures
