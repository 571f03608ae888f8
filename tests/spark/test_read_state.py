"""`sguard.spark.read_state` on real Spark (``local[2,4]``), read while the query owning the
state URI is mid-batch, and state TTL on Spark with a worker killed mid-batch.

The running query is held inside batch 3 by a ``pause`` fault on partition 0 (which then
holds its partition lock); partition 1 has finished batch 3. The reader must pick batch 2
(the newest durable for *every* partition), rebuild it on the executors, write nothing,
and leave the query exactly-once when it is resumed."""
from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sguard.spark as ss
from ioservice import open_root
from mmm import PageManager
from sguard.keygroups import default_key_groups, key_group_range
from sguard.spark.groupstate import open_state, split_by_partition
from sguard.spark.reader import available_batches
from tests.spark.helpers import (StreamInput, every_batch, landed_metrics, make_input,
                                 running_oracle, stream, wait_until)

pytestmark = pytest.mark.timeout(900)
P = 2


def _canon(t: pa.Table) -> list[tuple[Any, ...]]:
    """Rows as sorted tuples, timestamps as integers."""
    cols = [c.cast(pa.int64()) if pa.types.is_timestamp(c.type) else c for c in t.columns]
    return sorted(zip(*[c.to_pylist() for c in cols]))


def _split(t: pa.Table) -> list[pa.Table]:
    return split_by_partition(t, "k", P, default_key_groups(P))


def _reference(op: ss.Operator, tables: list[pa.Table]) -> tuple[list[list[tuple[Any, ...]]],
                                                                 list[tuple[Any, ...]]]:
    """The operator applied in-process, partition by partition as Spark places the keys:
    (state rows with partition_id after each batch, all output rows)."""
    schema = pa.schema([f.with_nullable(True) for f in tables[0].schema])
    states = [open_state(op, PageManager(1 << 16, 1 << 28), schema, "k",
                         key_group_range(p, P, default_key_groups(P))) for p in range(P)]
    after, outs = [], []
    for t in tables:
        rows: list[tuple[Any, ...]] = []
        for p, part in enumerate(_split(t.cast(schema))):
            outs += _canon(states[p].apply(part, 0))
            rows += [(*r, p) for r in _canon(states[p].dump())]
        after.append(sorted(rows))
    return after, sorted(outs)


def _listing(*dirs: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for d in dirs:
        for dp, _, files in os.walk(d):
            for f in files:
                st = os.stat(os.path.join(dp, f))
                out[os.path.join(dp, f)] = (st.st_size, st.st_mtime_ns)
    return out


OPS = {
    "running": lambda: ss.RunningAggregate(value="v"),
    "window": lambda: ss.WindowAggregate(time="ts", window=dt.timedelta(seconds=4), value="v",
                                         lateness=dt.timedelta(seconds=3)),
}


@pytest.mark.parametrize("kind", sorted(OPS))
def test_read_state_while_the_query_runs(spark: Any, stream_input: StreamInput, tmp_path: Path,
                                         kind: str) -> None:
    op = OPS[kind]()
    tables = stream_input.tables
    ref_after, ref_out = _reference(op, tables)
    if kind == "running":  # the reference itself against the plain-Python oracle
        for b in (1, 2):
            assert [r[:-1] for r in ref_after[b]] == sorted(running_oracle(tables[:b + 1])[1])
    uri = f"file://{tmp_path}/state"
    (tmp_path / "faults").mkdir()
    plan = ss.FaultPlan((ss.Fault("pause", 3, 0, "start"),), str(tmp_path / "faults"))
    out = ss.stateful(stream(spark, stream_input), "k", op, uri, P, faults=plan,
                      local_dir=str(tmp_path / "local"),
                      checkpoint=ss.CheckpointConfig(every_n_batches=2))
    q = (out.writeStream.format("parquet").option("path", str(tmp_path / "out"))
         .option("checkpointLocation", str(tmp_path / "ckpt")).start())
    try:
        wait_until(lambda: (tmp_path / "faults" / "paused-b3-p0").exists() or None,
                   "the pause in batch 3")
        # what the tasks so far write in the background has landed: partition 0's records
        # of batches 0-2 and partition 1's of 0-3 (written last, by I/O threads) and every
        # checkpoint they started (its record is written once it is durable, trimmed and
        # retained); partition 0 waits at the start of batch 3, before its checkpoint
        landed_metrics(open_root(uri), every_batch(2, P) | {(3, 1)}, checkpoints=True)
        before = _listing(tmp_path / "state", tmp_path / "local")
        assert list((tmp_path / "state" / "inputlog" / "b000000000003").glob("g0-p0001*.arrow"))
        assert available_batches(uri)[1] == 2  # partition 1 logged batch 3, partition 0 not
        newest = ss.read_state(spark, uri)
        assert newest.rdd.getNumPartitions() == P
        got = newest.toArrow()
        assert got.column_names[-1] == "partition_id"
        assert _canon(got) == ref_after[2]
        assert _canon(ss.read_state(spark, uri, batch_id=1).toArrow()) == ref_after[1]
        with pytest.raises(ss.BatchNotAvailableError, match=r"batch 3 .*0\.\.2"):
            ss.read_state(spark, uri, batch_id=3)
        assert _listing(tmp_path / "state", tmp_path / "local") == before  # nothing written
        assert not q.exception()
        (tmp_path / "faults" / "resume-b3-p0").touch()
        q.processAllAvailable()
    finally:
        (tmp_path / "faults" / "resume-b3-p0").touch()
        q.stop()
    sink = spark.read.parquet(str(tmp_path / "out")).toArrow()
    assert _canon(sink) == ref_out  # exactly once
    assert _canon(ss.read_state(spark, uri).toArrow()) == ref_after[-1]


def _ttl_input(d: Path, batches: int, seed: int) -> StreamInput:
    """Keys drawn from a random third of 0..89 per batch, so keys go quiet and come back."""
    rng = np.random.default_rng(seed)
    tables = []
    for i in range(batches):
        live = rng.choice(90, 30, replace=False)
        n = 600
        ts = (i * 10_000_000 + rng.integers(0, 10_000_000, n)).astype("datetime64[us]")
        t = pa.table({"k": rng.choice(live, n).astype(np.int64),
                      "v": rng.integers(-500, 500, n, dtype=np.int64),
                      "ts": pa.array(ts, pa.timestamp("us", tz="UTC"))})
        f = d / f"part-{i:05d}.parquet"
        pq.write_table(t, f)
        os.utime(f, (1_700_000_000 + i, 1_700_000_000 + i))
        tables.append(t)
    return StreamInput(d, tables)


def _ttl_oracle(tables: list[pa.Table], span_us: int) -> tuple[list[tuple[Any, ...]],
                                                               list[tuple[Any, ...]], int]:
    """Event-time TTL oracle per partition: (output rows, final state rows, evictions)."""
    outs, final, evicted = [], [], 0
    for p in range(P):
        state: dict[int, list[int]] = {}
        last: dict[int, int] = {}
        clock: int | None = None
        for t in tables:
            part = _split(t)[p]
            if part.num_rows:
                m = int(part["ts"].cast(pa.int64()).to_numpy().max())
                clock = m if clock is None else max(clock, m)
            if clock is not None:
                for k in [k for k, s in last.items() if s + span_us <= clock]:
                    del state[k], last[k]
                    evicted += 1
            for k, v in zip(part["k"].to_pylist(), part["v"].to_pylist()):
                s = state.setdefault(k, [0, 0, v, v])
                s[0] += 1
                s[1] += v
                s[2] = min(s[2], v)
                s[3] = max(s[3], v)
                last[k] = clock  # type: ignore[assignment]
            outs += [(k, *state[k]) for k in set(part["k"].to_pylist())]
        final += [(k, *s, p) for k, s in state.items()]
    return sorted(outs), sorted(final), evicted


def test_event_time_ttl_on_spark_with_a_worker_killed(spark: Any, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    inp = _ttl_input(tmp_path / "in", 6, seed=4)
    want_out, want_state, evicted = _ttl_oracle(inp.tables, 15_000_000)
    assert evicted > 30
    (tmp_path / "faults").mkdir()
    plan = ss.FaultPlan((ss.Fault("kill", 3, 1, "mid"), ss.Fault("kill", 4, 0, "end")),
                        str(tmp_path / "faults"))
    uri = f"file://{tmp_path}/state"
    op = ss.RunningAggregate(value="v", ttl=ss.TTL(dt.timedelta(seconds=15), "event", "ts"))
    out = ss.stateful(stream(spark, inp), "k", op, uri, P, faults=plan,
                      local_dir=str(tmp_path / "local"),
                      checkpoint=ss.CheckpointConfig(every_n_batches=2))
    q = (out.writeStream.format("parquet").option("path", str(tmp_path / "out"))
         .option("checkpointLocation", str(tmp_path / "ckpt")).start())
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    assert len(list((tmp_path / "faults").glob("fired-*"))) == 2
    assert sorted(tuple(r) for r in spark.read.parquet(str(tmp_path / "out")).collect()) \
        == want_out
    assert _canon(ss.read_state(spark, uri).toArrow()) == want_state
    with pytest.raises(ss.SchemaChangedError, match="ttl"):  # another TTL: refused
        ss.stateful(stream(spark, inp), "k",
                    ss.RunningAggregate(value="v", ttl=ss.TTL(60, "event", "ts")), uri, P)


def test_processing_time_ttl_on_spark_through_a_kill_and_a_restore(spark: Any,
                                                                   tmp_path: Path) -> None:
    """Processing-time TTL on Spark: a worker killed mid-batch (the retry rolls back and reuses
    the recorded time) and the local state deleted (restore from the checkpoint plus the log,
    replayed at the recorded times). The oracle runs on the times the input log recorded (one
    checkpoint only, so the log is never trimmed). The TTL is 1 ms, so every batch starts from
an empty state (eviction comes first: a key of the batch is evicted too); how the recorded
time decides which keys go is tested with a controlled clock in test_ttl.py."""
    from sguard.spark import inputlog
    (tmp_path / "in").mkdir()
    inp = _ttl_input(tmp_path / "in", 6, seed=8)
    (tmp_path / "faults").mkdir()
    plan = ss.FaultPlan((ss.Fault("kill", 2, 0, "mid"), ss.Fault("delete_local", 4, 1, "start")),
                        str(tmp_path / "faults"))
    uri = f"file://{tmp_path}/state"
    op = ss.RunningAggregate(value="v", ttl=ss.TTL(dt.timedelta(milliseconds=1)))
    out = ss.stateful(stream(spark, inp), "k", op, uri, P, faults=plan,
                      local_dir=str(tmp_path / "local"),
                      checkpoint=ss.CheckpointConfig(every_n_batches=3))
    q = (out.writeStream.format("parquet").option("path", str(tmp_path / "out"))
         .option("checkpointLocation", str(tmp_path / "ckpt")).start())
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    assert len(list((tmp_path / "faults").glob("fired-*"))) == 2
    root = open_root(uri)
    times = [[inputlog.recorded_batch_time_ms(root, b, 0, p) for p in range(P)]
             for b in range(len(inp.tables))]
    assert all(t is not None for row in times for t in row), times
    assert all(times[b][p] > times[b - 1][p]  # type: ignore[operator]
               for b in range(1, len(times)) for p in range(P)), times
    want_out, want_state, evicted = [], [], 0
    for p in range(P):  # the oracle at the recorded times (any TTL)
        state: dict[int, list[int]] = {}
        last: dict[int, int] = {}
        for b, t in enumerate(inp.tables):
            now = times[b][p]
            assert now is not None
            for k in [k for k, s in last.items() if s + 1 <= now]:
                del state[k], last[k]
                evicted += 1
            part = _split(t)[p]
            for k, v in zip(part["k"].to_pylist(), part["v"].to_pylist()):
                s = state.setdefault(k, [0, 0, v, v])
                s[0] += 1
                s[1] += v
                s[2] = min(s[2], v)
                s[3] = max(s[3], v)
                last[k] = now
            want_out += [(k, *state[k]) for k in set(part["k"].to_pylist())]
        want_state += [(k, *s, p) for k, s in state.items()]
    assert evicted > 30
    assert sorted(tuple(r) for r in spark.read.parquet(str(tmp_path / "out")).collect()) \
        == sorted(want_out)
    assert _canon(ss.read_state(spark, uri).toArrow()) == sorted(want_state)
