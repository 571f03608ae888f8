"""PySpark StatefulProcessors on sguard, with Spark itself as the oracle.

Each processor runs through Spark's own ``transformWithStateInPandas`` /
``transformWithState`` (RocksDB state store, no no-data batches) and through
`sguard.spark.transform_with_state*` on the same input files; every batch's output
must be equal (order aside).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sguard.spark as ss
from sguard.spark.processors import ProcessorOutputError, ProcessorPhaseError

pyspark = pytest.importorskip("pyspark")
from pyspark import cloudpickle  # noqa: E402
from pyspark.sql import Row  # noqa: E402
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle  # noqa: E402
from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, TimerValues  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need these classes

ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


# ------------------------------------------------------------------------------ processors
class CountProcessor(StatefulProcessor):
    """A running count per key in a ValueState with a TTL (pandas)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "count long", 3_600_000)

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame],
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        n = sum(len(df) for df in rows)
        cur = self.count.get()
        total = (cur[0] if cur is not None else 0) + n
        self.count.update((total,))
        yield pd.DataFrame({"k": [key[0]], "count": [total]})

    def handleInitialState(self, key: Any, initialState: pd.DataFrame,
                           timerValues: TimerValues) -> None:
        self.count.update((int(initialState["start"].sum()),))

    def close(self) -> None:
        pass


class CountRowProcessor(StatefulProcessor):
    """The same count, Row flavour, keyed by a string and an int."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "count long, total long")

    def handleInputRows(self, key: Any, rows: Iterator[Row],
                        timerValues: TimerValues) -> Iterator[Row]:
        cur = self.count.get() or (0, 0)
        n, s = cur
        for r in rows:
            n += 1
            s += r.v
        self.count.update((n, s))
        yield Row(name=key[0], g=key[1], count=n, total=s)

    def close(self) -> None:
        pass


class BufferProcessor(StatefulProcessor):
    """Buffer values in a ListState; an event-time timer flushes them (pandas)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.buf = handle.getListState("buf", "v long")

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame],
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        mx = None
        for df in rows:
            self.buf.appendList([(int(x),) for x in df["v"]])
            m = int(df["ts"].max().value // 1_000_000)
            mx = m if mx is None else max(mx, m)
        if mx is not None and not list(self.handle.listTimers()):
            self.handle.registerTimer(mx + 5_000)
        return iter([])

    def handleExpiredTimer(self, key: Any, timerValues: TimerValues,
                           expiredTimerInfo: ExpiredTimerInfo) -> Iterator[pd.DataFrame]:
        vals = [x[0] for x in self.buf.get()]
        self.buf.clear()
        yield pd.DataFrame({"k": [key[0]], "n": [len(vals)], "s": [sum(vals)],
                            "at": [expiredTimerInfo.getExpiryTimeInMs()]})

    def close(self) -> None:
        pass


class DedupProcessor(StatefulProcessor):
    """Emit each (key, v) the first time it is seen; a MapState remembers them (pandas)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.seen = handle.getMapState("seen", "v long", "n long")

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame],
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        new = []
        for df in rows:
            for v in df["v"].tolist():
                if self.seen.containsKey((v,)):
                    n = self.seen.getValue((v,))[0]
                    self.seen.updateValue((v,), (n + 1,))
                else:
                    self.seen.updateValue((v,), (1,))
                    new.append(v)
        if new:
            yield pd.DataFrame({"k": [key[0]] * len(new), "v": new})

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------- harness
def _input(d: Path, batches: int, rows: int, keys: int, seed: int, *, strings: bool = False
           ) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(batches):
        rng = np.random.default_rng([seed, i])
        ts = (1_700_000_000_000_000 + i * 4_000_000
              + rng.integers(0, 4_000_000, rows)).astype("datetime64[us]")
        cols: dict[str, Any] = {"k": rng.integers(0, keys, rows, dtype=np.int64),
                                "v": rng.integers(0, 40, rows, dtype=np.int64),
                                "ts": pa.array(ts, pa.timestamp("us", tz="UTC"))}
        if strings:
            cols["name"] = pa.array([f"user-{x % 7}" if x % 11 else None
                                     for x in cols["k"].tolist()], pa.string())
            cols["g"] = pa.array((cols["k"] % 3).astype(np.int32))
        f = d / f"part-{i:05d}.parquet"
        pq.write_table(pa.table(cols), f)
        os.utime(f, (1_700_000_000 + i, 1_700_000_000 + i))
    return d


def _stream(spark: Any, d: Path, schema: str, watermark: str | None) -> Any:
    df = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(str(d))
    return df.withWatermark("ts", watermark) if watermark else df


def _collect(out: Any, ckpt: Path) -> dict[int, list[tuple[Any, ...]]]:
    got: dict[int, list[tuple[Any, ...]]] = {}

    def sink(bdf: Any, bid: int) -> None:
        got[bid] = sorted(tuple(r) for r in bdf.collect())

    q = (out.writeStream.foreachBatch(sink).option("checkpointLocation", str(ckpt))
         .trigger(availableNow=True).start())
    q.awaitTermination()
    ex = q.exception()
    assert ex is None, ex
    return got


@pytest.fixture()
def tws_spark(spark: Any) -> Iterator[Any]:
    """The session with Spark's TWS in its usual setup: RocksDB, no no-data batches."""
    conf = {"spark.sql.streaming.stateStore.providerClass": ROCKSDB,
            "spark.sql.streaming.noDataMicroBatches.enabled": "false"}
    old = {k: spark.conf.get(k, None) for k in conf}
    for k, v in conf.items():
        spark.conf.set(k, v)
    try:
        yield spark
    finally:
        for k, v in old.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


def _both(spark: Any, tmp: Path, d: Path, schema: str, key: list[str], make: Any,
          out_schema: str, time_mode: str, *, pandas: bool = True, watermark: str | None = None,
          initial: Any = None, **kw: Any) -> tuple[dict[int, Any], dict[int, Any]]:
    df = _stream(spark, d, schema, watermark)
    g = df.groupBy(*key)
    init_g = None if initial is None else initial.groupBy(*key)
    if pandas:
        spark_out = g.transformWithStateInPandas(make(), out_schema, "Update", time_mode,
                                                 initialState=init_g)
        fn = ss.transform_with_state_in_pandas
    else:
        spark_out = g.transformWithState(make(), out_schema, "Update", time_mode,
                                         initialState=init_g)
        fn = ss.transform_with_state
    want = _collect(spark_out, tmp / "spark-ckpt")
    ours = fn(_stream(spark, d, schema, watermark), key, make(), out_schema, "Update",
              time_mode, f"file://{tmp}/state", 2, initial_state=initial, **kw)
    got = _collect(ours, tmp / "sguard-ckpt")
    return want, got


# ----------------------------------------------------------------------------------- tests
def test_value_state_with_ttl_equals_spark(tws_spark: Any, tmp_path: Path) -> None:
    d = _input(tmp_path / "in", 4, 600, 50, 1)
    want, got = _both(tws_spark, tmp_path, d, "k long, v long, ts timestamp", ["k"],
                      CountProcessor, "k long, count long", "ProcessingTime")
    assert len(want) == 4 and want == got


def test_row_flavour_string_and_composite_keys_equal_spark(tws_spark: Any, tmp_path: Path
                                                           ) -> None:
    d = _input(tmp_path / "in", 3, 500, 60, 2, strings=True)
    want, got = _both(tws_spark, tmp_path, d, "k long, v long, ts timestamp, name string, g int",
                      ["name", "g"], CountRowProcessor,
                      "name string, g int, count long, total long", "None", pandas=False)
    assert len(want) == 3 and want == got
    assert any(r[0] is None for rows in got.values() for r in rows)  # the null key's group


def test_list_state_and_event_time_timers_equal_spark(tws_spark: Any, tmp_path: Path) -> None:
    d = _input(tmp_path / "in", 5, 300, 20, 3)
    want, got = _both(tws_spark, tmp_path, d, "k long, v long, ts timestamp", ["k"],
                      BufferProcessor, "k long, n long, s long, at long", "EventTime",
                      watermark="2 seconds")
    assert sum(len(v) for v in want.values()) > 0
    assert want == got


def test_map_state_dedup_equals_spark(tws_spark: Any, tmp_path: Path) -> None:
    d = _input(tmp_path / "in", 4, 400, 30, 4)
    want, got = _both(tws_spark, tmp_path, d, "k long, v long, ts timestamp", ["k"],
                      DedupProcessor, "k long, v long", "None")
    assert want == got


def test_initial_state_equals_spark(tws_spark: Any, tmp_path: Path) -> None:
    d = _input(tmp_path / "in", 3, 200, 20, 5)
    init = tws_spark.createDataFrame([(k, 100 * k) for k in range(0, 40, 3)], "k long, start long")
    want, got = _both(tws_spark, tmp_path, d, "k long, v long, ts timestamp", ["k"],
                      CountProcessor, "k long, count long", "ProcessingTime", initial=init)
    assert want == got


def test_read_state_of_a_value_variable(spark: Any, tmp_path: Path) -> None:
    d = _input(tmp_path / "in", 2, 300, 25, 6)
    out = ss.transform_with_state_in_pandas(
        _stream(spark, d, "k long, v long, ts timestamp", None), "k", CountProcessor(),
        "k long, count long", "Update", "ProcessingTime", f"file://{tmp_path}/state", 2)
    got = _collect(out, tmp_path / "ckpt")
    final: dict[int, int] = {}
    for b in sorted(got):
        for k, c in got[b]:
            final[k] = c
    uri = f"file://{tmp_path}/state"
    # past the newest checkpoint the log replays through the processor: it must be given
    with pytest.raises(Exception, match="pass processor="):
        ss.read_state(spark, uri, state_var="count").collect()
    st = ss.read_state(spark, uri, state_var="count", processor=CountProcessor())
    rows = {r["k"]: r["value"]["count"] for r in st.collect()}
    assert rows == final


def test_not_a_processor_and_bad_modes_are_refused(spark: Any, tmp_path: Path) -> None:
    d = _input(tmp_path / "in", 1, 10, 3, 7)
    df = _stream(spark, d, "k long, v long, ts timestamp", None)
    uri = f"file://{tmp_path}/state"
    with pytest.raises(TypeError, match="StatefulProcessor"):
        ss.transform_with_state(df, "k", object(), "k long", "Update", "None", uri)
    with pytest.raises(ValueError, match="time_mode"):
        ss.transform_with_state(df, "k", CountRowProcessor(), "k long", "Update", "Later", uri)
    with pytest.raises(ValueError, match="EventTime"):
        ss.transform_with_state(df, "k", BufferProcessor(), "k long", "Update", "EventTime", uri)
    assert not (tmp_path / "state").exists()


class _BadOutput(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        self.c = handle.getValueState("c", "c long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        yield pd.DataFrame({"wrong": [1]})

    def close(self) -> None:
        pass


class _StateOutsideKey(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        self.c = handle.getValueState("c", "c long")
        self.c.get()  # not allowed: no current key in init

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        return iter([])

    def close(self) -> None:
        pass


def test_output_not_matching_schema_and_state_call_outside_a_key_fail_named(
        tmp_path: Path) -> None:
    from sguard.spark.processors import ProcessorOperator
    from sguard.spark.processor_state import VarSpec
    import json as _json
    from pyspark.sql.types import LongType, StructField, StructType
    st = StructType([StructField("c", LongType())])
    spec = VarSpec("c", "value", (st.json(),)).to_json()
    out = StructType([StructField("k", LongType()), StructField("n", LongType())]).json()
    import mmm
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 24)
    ns = mmm.Namespace(pm, "kg00000/", 1 << 16, 2 << 16)
    table = pa.table({"k": pa.array([1, 2], pa.int64())})
    table = ss.ttl.with_batch_time(table, 1000) if hasattr(ss, "ttl") else table
    from sguard.spark.ttl import with_batch_time
    table = with_batch_time(pa.table({"k": pa.array([1, 2], pa.int64())}), 1000)
    op = ProcessorOperator([spec], out, "None", "Update", "pandas", processor=_BadOutput())
    with pytest.raises(ProcessorOutputError, match="lacks column"):
        op.open(ns, table.schema, "k").apply(table, 0)
    op = ProcessorOperator([spec], out, "None", "Update", "pandas", processor=_StateOutsideKey())
    with pytest.raises(ProcessorPhaseError, match="current key"):
        op.open(ns, table.schema, "k").apply(table, 0)
    assert _json.loads(out)


def test_failures_mid_batch_leave_output_equal_to_spark(tws_spark: Any, tmp_path: Path) -> None:
    """A Python worker SIGKILLed mid-batch, an exception after the batch was applied, and
    the local state deleted: sguard's output still equals Spark's, batch by batch."""
    from sguard.spark import Fault, FaultPlan
    d = _input(tmp_path / "in", 5, 300, 30, 8)
    faults = tmp_path / "faults"
    faults.mkdir()
    plan = FaultPlan((Fault("kill", 1, 0, "mid"), Fault("raise", 2, 1, "end"),
                      Fault("delete_local", 3, 0, "start")), str(faults))
    want, got = _both(tws_spark, tmp_path, d, "k long, v long, ts timestamp", ["k"],
                      DedupProcessor, "k long, v long", "None", faults=plan)
    assert len(want) == 5 and want == got
    assert len(list(faults.glob("fired-*"))) == 3  # every fault fired


def test_short_ttl_expires_between_batches_as_in_spark(tws_spark: Any, tmp_path: Path) -> None:
    """A 1 ms TTL: every value has expired by the next batch, in Spark and in sguard."""
    d = _input(tmp_path / "in", 3, 200, 10, 9)

    class ShortTTL(CountProcessor):
        def init(self, handle: StatefulProcessorHandle) -> None:
            self.count = handle.getValueState("count", "count long", 1)

    want, got = _both(tws_spark, tmp_path, d, "k long, v long, ts timestamp", ["k"], ShortTTL,
                      "k long, count long", "ProcessingTime")
    assert want == got
    per_batch = [dict(got[b]) for b in sorted(got)]
    t = pq.read_table(d / "part-00001.parquet").column("k").to_numpy()
    assert per_batch[1] == {int(k): int(n) for k, n in zip(*np.unique(t, return_counts=True))}


def test_rescale_between_runs_equals_spark(tws_spark: Any, tmp_path: Path) -> None:
    """Two batches on 2 partitions, then the query restarts on 3: the output of every
    batch equals Spark's (which cannot change its partitions, and need not)."""
    d = tmp_path / "in"
    src = _input(tmp_path / "all", 4, 300, 40, 10)
    d.mkdir()
    schema = "k long, v long, ts timestamp"
    want: dict[int, Any] = {}
    got: dict[int, Any] = {}
    for run, files, parts in ((0, [0, 1], 2), (1, [2, 3], 3)):
        for i in files:
            f = src / f"part-{i:05d}.parquet"
            (d / f.name).write_bytes(f.read_bytes())
            os.utime(d / f.name, (1_700_000_000 + i, 1_700_000_000 + i))
        sp = _stream(tws_spark, d, schema, None).groupBy("k").transformWithStateInPandas(
            DedupProcessor(), "k long, v long", "Update", "None")
        want.update(_collect(sp, tmp_path / "spark-ckpt"))
        ours = ss.transform_with_state_in_pandas(
            _stream(tws_spark, d, schema, None), "k", DedupProcessor(), "k long, v long",
            "Update", "None", f"file://{tmp_path}/state", parts)
        got.update(_collect(ours, tmp_path / "sguard-ckpt"))
    assert len(want) == 4 and want == got


class _KeyCount(StatefulProcessor):
    SCHEMA = "count long, total long"

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", self.SCHEMA)

    def handleInputRows(self, key: Any, rows: Iterator[Row],
                        timerValues: TimerValues) -> Iterator[Row]:
        cur = self.count.get()
        n, s = (0, 0) if cur is None else (int(cur[0]), int(cur[1]))
        for r in rows:
            n, s = n + 1, s + r.v
        self.count.update((n, s))
        yield Row(k=key[0], count=n, total=s)

    def close(self) -> None:
        pass


def test_state_schema_change_evolves_or_is_refused(spark: Any, tmp_path: Path) -> None:
    d = _input(tmp_path / "in", 2, 50, 5, 11)
    uri = f"file://{tmp_path}/state"

    class V1(_KeyCount):
        SCHEMA = "count int, total long"

    class Narrow(_KeyCount):
        SCHEMA = "count string, total long"

    df = _stream(spark, d, "k long, v long, ts timestamp", None)
    out_schema = "k long, count long, total long"
    first = _collect(ss.transform_with_state(df, "k", V1(), out_schema, "Update", "None", uri, 2),
                     tmp_path / "ckpt")
    # int -> long widens: accepted, and the layout records both schemas
    ss.transform_with_state(df, "k", _KeyCount(), out_schema, "Update", "None", uri)
    from ioservice import open_root
    from sguard.statelayout import read_layout
    lay = read_layout(open_root(uri))
    assert lay is not None and len(lay.schema["params"]["vars"][0]["schemas"]) == 2
    with pytest.raises(Exception, match="count"):
        ss.transform_with_state(df, "k", Narrow(), out_schema, "Update", "None", uri)
    assert len(first) == 2
