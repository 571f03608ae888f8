"""The query's event-time watermark, as Spark computes it, for processors in event time.

Spark keeps one watermark per query: after each micro-batch it takes the largest
event time any task saw in the ``withWatermark`` column, minus the delay, and the
watermark of batch ``b`` is the largest such value over batches ``< b`` (0 before any).
A processor in ``"EventTime"`` mode sees that watermark (timers at or below it fire;
`TimerValues.getCurrentWatermarkInMs`), and rows at or below the *previous* batch's
watermark are late and dropped.

``mapInArrow`` tasks do not get Spark's watermark, so the runtime computes the same
value from what every partition saw: at the end of batch ``b`` each partition writes
``watermark/b<b>/p<p>.json`` under the state URI (its largest event time of the batch
and the watermark it ran the batch with); at the start of batch ``b + 1`` a partition
reads the files of batch ``b`` (Spark runs batch ``b + 1`` only once every task of
``b`` has finished, so all of them are there) and takes
``max(watermark(b), max event time(b) - delay)``. The two values are stamped into the
batch table's schema metadata, which the input log keeps, so a retried batch and a
replay after a failure see exactly the same watermark.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from ioservice import StorageRoot
from sguard.spark.errors import SparkStateError

__all__ = ["WATERMARK_KEY", "LATE_KEY", "input_watermark", "stamp", "record", "stamped"]

WATERMARK_KEY = b"sguard.watermark_ms"
"""Schema metadata: the watermark a batch runs with (timers, eviction)."""
LATE_KEY = b"sguard.late_watermark_ms"
"""Schema metadata: the previous batch's watermark (rows at or below it are late)."""
_MS_PER_DAY = 86_400_000


class WatermarkFilesMissingError(SparkStateError, RuntimeError):
    """The partitions' event-time records of the previous batch are missing."""


def input_watermark(df: Any) -> tuple[str, int] | None:
    """``(column, delay_ms)`` of the ``withWatermark`` in `df`'s plan, or None.

    Spark's delay in ms: months count 31 days (`IntervalUtils.getDuration`).
    """
    from py4j.java_gateway import get_field

    found: list[tuple[str, int]] = []

    def walk(node: Any) -> None:
        if node.nodeName() == "EventTimeWatermark":
            d = node.delay()
            ms = (int(get_field(d, "months")) * 31 * _MS_PER_DAY
                  + int(get_field(d, "days")) * _MS_PER_DAY
                  + int(get_field(d, "microseconds")) // 1000)
            found.append((str(node.eventTime().name()), ms))
        it = node.children().iterator()
        while it.hasNext():
            walk(it.next())

    walk(df._jdf.queryExecution().analyzed())
    return found[0] if found else None


def _dir(b: int) -> str:
    return f"watermark/b{b:012d}"


def stamped(table: pa.Table) -> tuple[int, int] | None:
    """``(watermark, late watermark)`` stamped into `table`, or None."""
    m = table.schema.metadata or {}
    if WATERMARK_KEY not in m:
        return None
    return int(m[WATERMARK_KEY]), int(m[LATE_KEY])


def stamp(table: pa.Table, root: StorageRoot, b: int, delay_ms: int) -> pa.Table:
    """`table` with the watermarks of batch `b` in its metadata (kept if already there:
    a batch read back from the input log)."""
    if stamped(table) is not None:
        return table
    wm, late = _compute(root, b, delay_ms)
    return table.replace_schema_metadata({**(table.schema.metadata or {}),
                                          WATERMARK_KEY: str(wm).encode(),
                                          LATE_KEY: str(late).encode()})


def _compute(root: StorageRoot, b: int, delay_ms: int) -> tuple[int, int]:
    """``(watermark(b), watermark(b - 1))`` from the partitions' records of batch b-1."""
    if b <= 0:
        return 0, 0
    prev = _dir(b - 1)
    names = [e.relpath for e in root.list_dir(prev, allow_not_found=True)
             if e.relpath.endswith(".json") and not e.relpath.rsplit("/", 1)[-1].startswith(".")]
    if not names:  # the query's first batch (or one after the records were trimmed)
        return 0, 0
    wm_prev = 0
    mx: int | None = None
    for n in names:
        rec = json.loads(root.read_bytes(n))
        wm_prev = max(wm_prev, int(rec["watermark_ms"]))
        if rec.get("max_event_ms") is not None:
            mx = int(rec["max_event_ms"]) if mx is None else max(mx, int(rec["max_event_ms"]))
    wm = wm_prev if mx is None else max(wm_prev, mx - delay_ms)
    return wm, wm_prev


def event_us(table: pa.Table, column: str) -> np.ndarray:
    """The event times of `column` in µs (int64; nulls as int64 min), as Spark holds them."""
    col = table.column(column)
    t = col.type
    if pa.types.is_timestamp(t):
        per_s = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}[t.unit]
        raw = np.asarray(col.cast(pa.int64()).fill_null(np.iinfo(np.int64).min).to_numpy(),
                         np.int64)
        if per_s == 1_000_000:
            return raw
        ok = raw != np.iinfo(np.int64).min
        out = raw.copy()
        out[ok] = raw[ok] * 1_000_000 // per_s if per_s < 1_000_000 else raw[ok] // 1_000
        return out
    raise TypeError(f"the watermark column {column!r} has type {t}; Spark's withWatermark "
                    f"needs a timestamp")


def late_rows(table: pa.Table, column: str, late_ms: int) -> np.ndarray:
    """Rows at or below the watermark `late_ms` (Spark's predicate, in µs)."""
    return event_us(table, column) <= late_ms * 1000


def max_event_ms(table: pa.Table, column: str) -> int | None:
    """The largest event time (ms, µs floored as Spark divides them) of `column`, None if
    no row has one."""
    if not table.num_rows:
        return None
    us = event_us(table, column)
    us = us[us != np.iinfo(np.int64).min]
    return None if not len(us) else int(us.max()) // 1000


def record(root: StorageRoot, b: int, p: int, table: pa.Table, column: str) -> None:
    """Write partition `p`'s event-time record of batch `b` (idempotent: a retry writes
    the same bytes)."""
    st = stamped(table)
    rec = {"max_event_ms": max_event_ms(table, column), "watermark_ms": st[0] if st else 0}
    root.write_atomic(f"{_dir(b)}/p{p:05d}.json", json.dumps(rec, sort_keys=True).encode())
