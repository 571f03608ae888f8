"""The `StatefulProcessor` classes of `bench.spark_processors`, written once for both sides.

Every class is a plain ``pyspark.sql.streaming.StatefulProcessor``: Spark runs it with
``groupBy("k").transformWithStateInPandas(...)`` / ``transformWithState(...)``, sguard
with `sguard.spark.transform_with_state_in_pandas` / `sguard.spark.transform_with_state`,
unchanged. Pandas-flavour classes take and yield pandas DataFrames, Row-flavour classes
`Row` objects.

Input rows: ``k`` (long, the grouping key), ``v`` (long), ``id`` (long), ``ts``
(timestamp). The processors:

* `CountProcessor` (pandas) / `CountRowProcessor` (Row): a running count per key in a
  ``ValueState`` ``"count"`` (``count long``) with a TTL of `COUNT_TTL_MS` (processing
  time, so ``time_mode="ProcessingTime"``); each batch emits ``(k, count)`` for every key
  it saw. The TTL is longer than any run: no value expires, every update pays for the TTL
  bookkeeping;
* `BufferProcessor` (pandas): a ``ListState`` ``"buf"`` of the rows' ``v``; when a key's
  buffer starts (it was empty), an event-time timer at (the max ``ts`` of the key's rows in
  that batch + `FLUSH_AFTER_MS`); ``handleExpiredTimer`` emits ``(k, count, sum)`` of the
  buffer and clears it (``time_mode="EventTime"``, watermark from ``withWatermark("ts",
  WATERMARK_DELAY)``);
* `DedupProcessor` (pandas): a ``MapState`` ``"seen"`` (``id`` -> first-seen ``ts`` in ms);
  emits ``(k, id, v)`` for the rows whose ``id`` the key had not seen (the first such row
  per id within a batch).

The vectorized count (`vectorized_count_processor`) is the one variant whose API is not
fixed yet: see that function.

The classes are defined at module level so that Python workers import them from here
(the driver puts the repository on ``PYTHONPATH``).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor

COUNT_TTL_MS = 3_600_000
"""The count's TTL: an hour, longer than any run (nothing expires, the TTL is maintained)."""
FLUSH_AFTER_MS = 10_000
"""`BufferProcessor` flushes a key's buffer this long (event time) after it started."""
WATERMARK_DELAY = "5 seconds"

COUNT_SCHEMA = "k long, count long"
BUFFER_SCHEMA = "k long, count long, sum long"
DEDUP_SCHEMA = "k long, id long, v long"


def _ms(ts: Any) -> int:
    """Milliseconds since the epoch of a pandas / numpy datetime64 value."""
    import numpy as np

    return int(np.datetime64(ts, "ms").astype(np.int64))


class CountProcessor(StatefulProcessor):
    """Running count in a ``ValueState`` with TTL; pandas in, pandas out."""

    def init(self, handle: Any) -> None:
        self.count = handle.getValueState("count", "count long", COUNT_TTL_MS)

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any
                        ) -> Iterator[Any]:
        import pandas as pd

        n = 0
        for pdf in rows:
            n += len(pdf)
        if self.count.exists():
            n += self.count.get()[0]
        self.count.update((n,))
        yield pd.DataFrame({"k": [key[0]], "count": [n]})

    def close(self) -> None:
        pass


class CountRowProcessor(StatefulProcessor):
    """`CountProcessor` with Rows in and out (``transformWithState``)."""

    def init(self, handle: Any) -> None:
        self.count = handle.getValueState("count", "count long", COUNT_TTL_MS)

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any
                        ) -> Iterator[Any]:
        n = 0
        for _ in rows:
            n += 1
        if self.count.exists():
            n += self.count.get()[0]
        self.count.update((n,))
        yield Row(k=key[0], count=n)

    def close(self) -> None:
        pass


class BufferProcessor(StatefulProcessor):
    """``ListState`` buffer of ``v``, flushed as ``(k, count, sum)`` by an event-time timer."""

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.buf = handle.getListState("buf", "v long")

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any
                        ) -> Iterator[Any]:
        started = self.buf.exists()
        hi = None
        for pdf in rows:
            self.buf.appendList([(int(x),) for x in pdf["v"]])
            m = _ms(pdf["ts"].max())
            hi = m if hi is None or m > hi else hi
        if not started and hi is not None:
            self.handle.registerTimer(hi + FLUSH_AFTER_MS)
        return iter([])

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any
                           ) -> Iterator[Any]:
        import pandas as pd

        n = s = 0
        for (x,) in self.buf.get():
            n += 1
            s += x
        self.buf.clear()
        if n:
            yield pd.DataFrame({"k": [key[0]], "count": [n], "sum": [s]})

    def close(self) -> None:
        pass


class DedupProcessor(StatefulProcessor):
    """``MapState`` of the ids a key has seen; emits the rows with a new id."""

    def init(self, handle: Any) -> None:
        self.seen = handle.getMapState("seen", "id long", "first_seen long")

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any
                        ) -> Iterator[Any]:
        import pandas as pd

        ids: list[int] = []
        vs: list[int] = []
        for pdf in rows:
            tss = pdf["ts"].to_numpy(dtype="datetime64[ms]").astype("int64")
            for i, v, t in zip(pdf["id"].tolist(), pdf["v"].tolist(), tss.tolist()):
                if not self.seen.containsKey((i,)):
                    self.seen.updateValue((i,), (t,))
                    ids.append(i)
                    vs.append(v)
        if ids:
            yield pd.DataFrame({"k": [key[0]] * len(ids), "id": ids, "v": vs})

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# VECTORIZED VARIANT: the count in sguard's vectorized processor form (columnar state access
# for all the keys of a batch). Adapt here if sguard.spark.VectorizedProcessor's API changes.
# ---------------------------------------------------------------------------------------------
try:
    from sguard.spark import VectorizedProcessor as _VectorizedBase
except ImportError:  # a checkout without the vectorized form: the variant is reported missing
    _VectorizedBase = None

if _VectorizedBase is not None:
    class VectorizedCountProcessor(_VectorizedBase):  # type: ignore[misc, valid-type]
        """`CountProcessor` as one call per key group and batch: the counts of the batch's
        keys read and written as arrays (same state variable, TTL and output)."""

        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("count", "count long", COUNT_TTL_MS)

        def handleInputBatch(self, keys: Any, rows: Any, key_index: Any, timerValues: Any
                             ) -> Any:
            import numpy as np
            import pyarrow as pa

            exists, cur = self.count.get()
            n = np.bincount(key_index, minlength=keys.num_rows)
            total = np.where(exists, cur["count"], 0) + n
            self.count.update({"count": total})
            return keys.append_column("count", pa.array(total, pa.int64()))

        def close(self) -> None:
            pass


def vectorized_count_processor() -> Any:
    """The vectorized form of `CountProcessor` for sguard, or ``None`` where sguard has no
    ``VectorizedProcessor``.

    `bench.spark_processors` runs the ``sguard_vectorized_value`` variant only when
    ``sguard.spark`` has ``VectorizedProcessor`` and this returns a processor; it passes
    the result to `sguard.spark.transform_with_state` with the count's arguments (key
    ``"k"``, output `COUNT_SCHEMA`, ``"Update"``, ``"ProcessingTime"``: change
    `bench.spark_processors.build_sguard_vectorized` if the vectorized form takes another
    entry point). Otherwise the variant is reported as missing with the reason.
    """
    return None if _VectorizedBase is None else VectorizedCountProcessor()
