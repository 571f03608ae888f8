"""PySpark StatefulProcessors on sguard, with Spark itself as the oracle.

Each processor runs through Spark's own ``transformWithStateInPandas`` /
``transformWithState`` (RocksDB state store, no no-data batches) and through
`sguard.spark.transform_with_state*` on the same input files; every batch's output
must be equal (order aside).
"""
from __future__ import annotations

import contextlib
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
    """A count and sum per key with a 1 hour TTL, and a 1 ms TTL value (expired by the next
    batch: Spark runs TTL on processing time), Row flavour, keyed by a string and an int."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "count long, total long", 3_600_000)
        self.recent = handle.getValueState("recent", "n long", 1)

    def handleInputRows(self, key: Any, rows: Iterator[Row],
                        timerValues: TimerValues) -> Iterator[Row]:
        cur = self.count.get() or (0, 0)
        n, s = cur
        m = 0
        for r in rows:
            n, s, m = n + 1, s + r.v, m + 1
        self.count.update((n, s))
        recent = (self.recent.get() or (0,))[0] + m  # the batch's own rows only
        self.recent.update((recent,))
        yield Row(name=key[0], g=key[1], count=n, total=s, recent=recent)

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


class KitchenSink(StatefulProcessor):
    """Every state kind at once, in event time (pandas): a running count in a ValueState,
    a ListState buffer flushed by an event-time timer, a MapState of distinct values, and
    initial state. (Spark allows TTL only in processing time: `CountRowProcessor`.)"""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.count = handle.getValueState("count", "count long")
        self.buf = handle.getListState("buf", "v long")
        self.seen = handle.getMapState("seen", "v long", "n long")

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame],
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        n, mx, new = 0, None, 0
        for df in rows:
            n += len(df)
            self.buf.appendList([(int(x),) for x in df["v"]])
            for v in df["v"].tolist():
                cur = self.seen.getValue((v,))
                new += cur is None
                self.seen.updateValue((v,), ((cur[0] if cur else 0) + 1,))
            m = int(df["ts"].max().value // 1_000_000)
            mx = m if mx is None else max(mx, m)
        total = (self.count.get() or (0,))[0] + n
        self.count.update((total,))
        if mx is not None and not list(self.handle.listTimers()):
            self.handle.registerTimer(mx + 5_000)
        yield pd.DataFrame({"k": [key[0]], "kind": ["rows"], "a": [total], "b": [n],
                            "c": [len(list(self.seen.keys()))], "d": [new]})

    def handleExpiredTimer(self, key: Any, timerValues: TimerValues,
                           expiredTimerInfo: ExpiredTimerInfo) -> Iterator[pd.DataFrame]:
        vals = [x[0] for x in self.buf.get()]
        self.buf.clear()
        yield pd.DataFrame({"k": [key[0]], "kind": ["timer"], "a": [len(vals)],
                            "b": [sum(vals)], "c": [expiredTimerInfo.getExpiryTimeInMs()],
                            "d": [timerValues.getCurrentWatermarkInMs()]})

    def handleInitialState(self, key: Any, initialState: pd.DataFrame,
                           timerValues: TimerValues) -> None:
        self.count.update((int(initialState["start"].sum()),))

    def close(self) -> None:
        pass


KITCHEN_OUT = "k long, kind string, a long, b long, c long, d long"
SCHEMA = "k long, v long, ts timestamp"
INITIAL = [(k, 100 * k) for k in range(0, 40, 3)]  #: `KitchenSink`'s initial state rows


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


def _spark_run(make_out: Any, ckpt: Path) -> dict[int, list[tuple[Any, ...]]]:
    """`_collect` of Spark's own query, once more from scratch if Spark could not start a
    Python worker in its fixed 10 s (a loaded host): the oracle is deterministic."""
    for attempt in range(3):
        try:
            return _collect(make_out(), ckpt.with_name(f"{ckpt.name}-{attempt}"))
        except Exception as exc:  # noqa: BLE001 - only that one failure is retried
            if "failed to connect back" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def sort_rows(rows: Iterator[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A batch's output rows in one order (nulls last): the comparison is order aside."""
    return sorted(rows, key=lambda r: tuple((x is None, x) for x in r))


def _collect(out: Any, ckpt: Path) -> dict[int, list[tuple[Any, ...]]]:
    got: dict[int, list[tuple[Any, ...]]] = {}

    def sink(bdf: Any, bid: int) -> None:
        got[bid] = sort_rows(tuple(r) for r in bdf.collect())

    q = (out.writeStream.foreachBatch(sink).option("checkpointLocation", str(ckpt))
         .trigger(availableNow=True).start())
    q.awaitTermination()
    ex = q.exception()
    assert ex is None, ex
    return got


@contextlib.contextmanager
def _tws(spark: Any) -> Iterator[None]:
    """Spark's TWS in its usual setup: RocksDB, no no-data batches (sguard runs none)."""
    conf = {"spark.sql.streaming.stateStore.providerClass": ROCKSDB,
            "spark.sql.streaming.noDataMicroBatches.enabled": "false"}
    old = {k: spark.conf.get(k, None) for k in conf}
    for k, v in conf.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


# ----------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def kitchen(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The input and Spark's own output of `KitchenSink` (computed once: Spark is the
    oracle of every sguard run below)."""
    tmp = tmp_path_factory.mktemp("kitchen")
    d = _input(tmp / "in", 5, 300, 20, 3)
    with _tws(spark):
        init = spark.createDataFrame(INITIAL, "k long, start long")
        want = _spark_run(lambda: _stream(spark, d, SCHEMA, "2 seconds").groupBy("k")
                          .transformWithStateInPandas(KitchenSink(), KITCHEN_OUT, "Update",
                                                      "EventTime",
                                                      initialState=init.groupBy("k")),
                          tmp / "spark-ckpt")
    assert len(want) == 5
    assert any(r[1] == "timer" for rows in want.values() for r in rows)  # timers fired
    return d, init, want


def _sguard_kitchen(spark: Any, d: Path, init: Any, tmp: Path, parts: int = 2,
                    **kw: Any) -> dict[int, Any]:
    out = ss.transform_with_state_in_pandas(
        _stream(spark, d, SCHEMA, "2 seconds"), "k", KitchenSink(), KITCHEN_OUT, "Update",
        "EventTime", f"file://{tmp}/state", parts, initial_state=init, **kw)
    return _collect(out, tmp / "sguard-ckpt")


def test_every_state_kind_timers_ttl_and_initial_state_equal_spark(
        spark: Any, kitchen: Any, tmp_path: Path) -> None:
    d, init, want = kitchen
    assert _sguard_kitchen(spark, d, init, tmp_path) == want


def test_failures_mid_batch_leave_output_equal_to_spark(spark: Any, kitchen: Any,
                                                        tmp_path: Path) -> None:
    """A Python worker SIGKILLed mid-batch, an exception after the batch was applied, and
    the local state deleted: sguard's output still equals Spark's, batch by batch."""
    from sguard.spark import Fault, FaultPlan
    d, init, want = kitchen
    faults = tmp_path / "faults"
    faults.mkdir()
    plan = FaultPlan((Fault("kill", 1, 0, "mid"), Fault("raise", 2, 1, "end"),
                      Fault("delete_local", 3, 0, "start")), str(faults))
    assert _sguard_kitchen(spark, d, init, tmp_path, faults=plan) == want
    assert len(list(faults.glob("fired-*"))) == 3  # every fault fired


def test_rescale_between_runs_equals_spark(spark: Any, kitchen: Any, tmp_path: Path) -> None:
    """Three batches on 2 partitions, then the query restarts on 3 partitions: every
    batch's output equals Spark's single run (Spark cannot change its partitions)."""
    src, init, want = kitchen
    d = tmp_path / "in"
    d.mkdir()
    got: dict[int, Any] = {}
    for files, parts in (([0, 1, 2], 2), ([3, 4], 3)):
        for i in files:
            f = src / f"part-{i:05d}.parquet"
            (d / f.name).write_bytes(f.read_bytes())
            os.utime(d / f.name, (1_700_000_000 + i, 1_700_000_000 + i))
        got.update(_sguard_kitchen(spark, d, init, tmp_path, parts))
    assert got == want


def test_row_flavour_string_and_composite_keys_equal_spark(spark: Any, tmp_path: Path
                                                           ) -> None:
    d = _input(tmp_path / "in", 3, 500, 60, 2, strings=True)
    schema = SCHEMA + ", name string, g int"
    out_schema = "name string, g int, count long, total long, recent long"
    with _tws(spark):
        want = _spark_run(lambda: _stream(spark, d, schema, None).groupBy("name", "g")
                          .transformWithState(CountRowProcessor(), out_schema, "Update",
                                              "ProcessingTime"), tmp_path / "spark-ckpt")
    got = _collect(ss.transform_with_state(_stream(spark, d, schema, None), ["name", "g"],
                                           CountRowProcessor(), out_schema, "Update",
                                           "ProcessingTime", f"file://{tmp_path}/state", 2),
                   tmp_path / "sguard-ckpt")
    assert len(want) == 3 and want == got
    assert any(r[0] is None for rows in got.values() for r in rows)  # the null key's group
    # the 1 ms TTL expired between batches: "recent" counts each batch's rows alone
    assert any(r[4] < r[2] for rows in list(got.values())[1:] for r in rows)


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
    with pytest.raises(ValueError, match="TTL needs time mode 'ProcessingTime'"):  # as Spark
        ss.transform_with_state(df, "k", CountProcessor(), "k long", "Update", "None", uri)
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
    from pyspark.sql.types import LongType, StructField, StructType
    st = StructType([StructField("c", LongType())])
    spec = VarSpec("c", "value", (st.json(),)).to_json()
    out = StructType([StructField("k", LongType()), StructField("n", LongType())]).json()
    import mmm
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 24)
    ns = mmm.Namespace(pm, "kg00000/", 1 << 16, 2 << 16)
    from sguard.spark.ttl import with_batch_time
    table = with_batch_time(pa.table({"k": pa.array([1, 2], pa.int64())}), 1000)
    op = ProcessorOperator([spec], out, "None", "Update", "pandas", processor=_BadOutput())
    with pytest.raises(ProcessorOutputError, match="lacks column"):
        op.open(ns, table.schema, "k").apply(table, 0)
    op = ProcessorOperator([spec], out, "None", "Update", "pandas", processor=_StateOutsideKey())
    with pytest.raises(ProcessorPhaseError, match="current key"):
        op.open(ns, table.schema, "k").apply(table, 0)


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


class _VectorCount(ss.VectorizedProcessor):
    def init(self, handle: Any) -> None:
        self.count = handle.getValueState("count", "count long, total long", 3_600_000)

    def handleInputBatch(self, keys: pa.Table, rows: pa.Table, key_index: Any,
                         timerValues: Any) -> pa.Table:
        exists, cur = self.count.get()
        n = np.bincount(key_index, minlength=keys.num_rows)
        s = np.bincount(key_index, weights=rows.column("v").to_numpy(), minlength=keys.num_rows)
        count = np.where(exists, cur["count"], 0) + n
        total = np.where(exists, cur["total"], 0) + s.astype(np.int64)
        self.count.update({"count": count, "total": total})
        return keys.append_column("count", pa.array(count)).append_column("total",
                                                                          pa.array(total))


def test_vectorized_count_equals_a_numpy_oracle(spark: Any, tmp_path: Path) -> None:
    d = _input(tmp_path / "in", 3, 400, 30, 12)
    out = ss.transform_with_state(_stream(spark, d, SCHEMA, None), "k", _VectorCount(),
                                  "k long, count long, total long", "Update", "ProcessingTime",
                                  f"file://{tmp_path}/state", 2)
    got = _collect(out, tmp_path / "ckpt")
    want: dict[int, list[tuple[int, int, int]]] = {}
    acc: dict[int, list[int]] = {}
    for b in range(3):
        t = pq.read_table(d / f"part-{b:05d}.parquet")
        for k, v in zip(t["k"].to_pylist(), t["v"].to_pylist()):
            a = acc.setdefault(k, [0, 0])
            a[0], a[1] = a[0] + 1, a[1] + v
        want[b] = sorted((k, *acc[k]) for k in set(t["k"].to_pylist()))
    assert got == want
