"""State time-to-live: keys not updated for a while are evicted, exactly once.

``RunningAggregate(value="v", ttl=TTL(timedelta(hours=1)))`` evicts a key's
state when no row of the key arrived for an hour. The clock is per
partition and advances once per batch:

* ``mode="processing"``: the batch's processing time, taken on the executor
  when the partition's batch is first run and recorded in that batch's
  input-log file (`sguard.spark.inputlog`, schema metadata
  ``sguard.batch_time_ms``). A retried batch, and a replay of the log after a
  failure, read the recorded time back, so they evict exactly the same keys.
  Milliseconds; each partition records its own.
* ``mode="event"``: the largest event time of column `TTL.time` the partition
  has seen (its watermark before lateness), so eviction follows the data, not
  the wall clock, and is deterministic on replay by construction.

A key's *last update* is the clock of the last batch that had a row of it.
At the start of each batch the clock is advanced and every key with
``last_update + ttl <= clock`` is evicted (before the batch's rows are
applied: a key that comes back after expiring starts afresh). Eviction emits
nothing. It is an ordinary part of the batch: rolled back with it when the
batch is retried, checkpointed with it, replayed with it. The clock never goes
back: a batch recorded (or seen) at an earlier time than the key group's clock
keeps that clock.

Where the bookkeeping lives (TTL state layout 2, ``ttl_layout`` in the
operator's parameters): a key's last update is one more field (``_t``) of the
aggregate map's record, written by the same upsert, in the same probe, as the
aggregates. Beside the map, in the operator's page manager like the rest of its
state, `KeyExpiry` keeps the *touch log*: ``ttl.fifo``, a deque of the keys each
batch touched, appended in clock order, and ``ttl.batches``, one ``(clock, keys)``
record per batch (``keys`` 0 for a batch that touched none but advanced the clock),
whose last record holds the key group's clock. A batch pops
the log's records whose clock has expired (a prefix, as the clock never goes
back) and evicts those of their keys whose *current* stamp expired, in one probe
per key (`HashMap.expire`: the stamp is read and the key deleted in the same pass; a
key touched again since has a newer stamp and a newer entry further on). So a batch
costs one sequential append of the keys it touched, one sequential pop and one
probe of the keys whose entries expired: O(keys touched + entries expired), never a scan of the map, and
no second map probed per key as the earlier layout's expiry buckets did.

State of TTL layout 1 (the bucketed expiry index: ``ttl.last`` and ``ttl.b.<j>``
beside an aggregate without ``_t``) is not read by this version: a restart on
such a state URI is refused by the parameter check (`SchemaChangedError`, the
parameters now carry ``ttl_layout``), and opening such state directly raises
`TTLLayoutError`, never reads it as the new layout.

Windows need no TTL: `WindowAggregate` evicts every window once the
watermark closes it, and `WindowJoin` evicts buffered rows older than the
watermark minus the window; their state is already bounded by event time.

The TTL is part of the operator's parameters, stored in the state URI's
layout: restarting a query on an existing state URI with another (or no)
TTL is refused (`SchemaChangedError`), as for any parameter change; use a
new state URI.
"""
from __future__ import annotations

import datetime as _dt
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from mmm import HashMap, Namespace, PageManager, PagedDeque
from sguard.spark.errors import BatchTimeMissingError, SchemaChangedError
from sguard.spark.columns import column_numpy, duration_units, time_unit

__all__ = ["TTL", "KeyExpiry", "TTLLayoutError", "TTL_LAYOUT", "STAMP_FIELD", "BATCH_TIME_KEY",
           "needs_batch_time", "batch_time_ms", "with_batch_time"]

BATCH_TIME_KEY = b"sguard.batch_time_ms"
"""Schema metadata key of a batch's recorded processing time (ms since the epoch)."""
_MODES = ("processing", "event")
TTL_LAYOUT = 2
"""The TTL state layout this version writes and reads (module docstring)."""
STAMP_FIELD = "_t"
"""The field of the aggregate's record holding the key's last update."""
_BATCH = [("t", "<i8"), ("n", "<i8")]
_NO_CLOCK = np.iinfo(np.int64).min


class TTLLayoutError(SchemaChangedError):
    """The state holds TTL bookkeeping of another layout than this version's."""


@dataclass(frozen=True)
class TTL:
    """How long a key's state lives without an update.

    Parameters
    ----------
    duration : timedelta or float
        The time to live (a number is seconds; for an integer event-time
        column, a number is in the column's units). Must be > 0.
    mode : {"processing", "event"}
        The clock: the batch's processing time (recorded once per batch) or
        the largest event time seen in column `time`.
    time : str, optional
        The event-time column (timestamp or integer); required for ``"event"``.

    Raises
    ------
    ValueError
        A non-positive duration, an unknown mode, or ``"event"`` without `time`.
    """

    duration: _dt.timedelta | float
    mode: str = "processing"
    time: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"TTL mode must be one of {_MODES}, got {self.mode!r}")
        d = self.duration
        if isinstance(d, bool) or not isinstance(d, (int, float, _dt.timedelta)):
            raise TypeError(f"TTL duration must be a timedelta or a number of seconds, got {d!r}")
        secs = d.total_seconds() if isinstance(d, _dt.timedelta) else float(d)
        if not secs > 0:
            raise ValueError(f"TTL duration must be > 0, got {d!r}")
        if self.mode == "event" and not self.time:
            raise ValueError("TTL mode 'event' needs the event-time column: TTL(duration, "
                             "mode='event', time='ts')")
        if self.mode == "processing" and self.time is not None:
            raise ValueError(f"TTL mode 'processing' takes no time column (got {self.time!r}); "
                             f"use mode='event' for event time")

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored in the layout's operator parameters."""
        d = self.duration
        return {"seconds": d.total_seconds() if isinstance(d, _dt.timedelta) else d,
                "mode": self.mode, "time": self.time}

    @classmethod
    def coerce(cls, value: Any) -> TTL | None:
        """A `TTL` from a `TTL`, its `to_json` form, a timedelta (processing time) or None."""
        if value is None or isinstance(value, TTL):
            return value
        if isinstance(value, _dt.timedelta):
            return cls(value)
        if isinstance(value, dict):
            return cls(value["seconds"], value.get("mode", "processing"), value.get("time"))
        raise TypeError(f"ttl must be a sguard.spark.TTL, a timedelta or None, got {value!r}")

    def units(self, schema: pa.Schema) -> int:
        """The duration in clock units (ms for processing time, the column's for event time)."""
        if self.mode == "processing":
            return max(1, duration_units(self.duration, 1000, "ttl"))
        return max(1, duration_units(self.duration, time_unit(schema, str(self.time))[1],
                                      "ttl"))

    def check(self, schema: pa.Schema) -> None:
        """Raise if the input schema lacks the event-time column (event mode)."""
        if self.mode == "event":
            if self.time not in schema.names:
                raise SchemaChangedError(f"TTL event-time column {self.time!r} is not in the "
                                         f"stream's columns {schema.names}")
            time_unit(schema, str(self.time))


def needs_batch_time(operator: Any) -> bool:
    """Whether the runtime must record a processing time for `operator`'s batches."""
    if getattr(operator, "needs_batch_time", False) is True:  # e.g. a processor's clock
        return True
    ttl = getattr(operator, "ttl", None)
    return isinstance(ttl, TTL) and ttl.mode == "processing"


def batch_time_ms(table: pa.Table) -> int | None:
    """The processing time recorded in a batch table's schema metadata, if any."""
    v = (table.schema.metadata or {}).get(BATCH_TIME_KEY)
    return None if v is None else int(v)


def _wall_clock_ms() -> int:
    """Milliseconds since the epoch (the one place processing time is read; tests set it)."""
    return int(time.time() * 1000)


def with_batch_time(table: pa.Table, recorded_ms: int | None) -> pa.Table:
    """`table` stamped with `recorded_ms`, or with the wall clock now if None."""
    ms = recorded_ms if recorded_ms is not None else _wall_clock_ms()
    return table.replace_schema_metadata({**(table.schema.metadata or {}),
                                          BATCH_TIME_KEY: str(ms).encode()})


class KeyExpiry:
    """The touch log of one key group's TTL (see the module docstring).

    `begin` advances the clock and evicts expired keys from the aggregate map (whose
    records carry the `STAMP_FIELD`); `touch` logs the keys the batch updated (the
    operator's upsert wrote their stamps, `now`).

    Raises
    ------
    TTLLayoutError
        The page manager holds TTL state of layout 1 (``ttl.last``).
    """

    @staticmethod
    def check_layout(pm: PageManager | Namespace) -> None:
        """Raise `TTLLayoutError` if `pm` holds TTL state of layout 1 (creates nothing)."""
        names = pm.names()
        if "ttl.last" in names or any(n.startswith("ttl.b.") for n in names):
            raise TTLLayoutError(
                "the state holds TTL bookkeeping of TTL layout 1 (the expiry buckets "
                "'ttl.last', 'ttl.b.<j>'); this version reads TTL layout "
                f"{TTL_LAYOUT} only: run the query on a new state URI")

    def __init__(self, pm: PageManager | Namespace, key_dtype: Any, ttl: TTL, schema: pa.Schema) -> None:
        self.check_layout(pm)
        self.pm, self.kdt, self.ttl = pm, np.dtype(key_dtype), ttl
        self.span = ttl.units(schema)
        self.fifo = PagedDeque.create(pm, "ttl.fifo", self.kdt)
        self.batches = PagedDeque.create(pm, "ttl.batches", _BATCH)
        self.now = _NO_CLOCK

    # -- the clock ------------------------------------------------------------------------
    def _clock(self, table: pa.Table) -> int:
        """This batch's clock: the key group's clock (the log's last record) advanced to the
        batch's processing time or largest event time, never back."""
        clock = int(self.batches.item(-1)[0]) if len(self.batches) else _NO_CLOCK
        if self.ttl.mode == "processing":
            ms = batch_time_ms(table)
            if ms is None:
                raise BatchTimeMissingError(
                    "processing-time TTL: the batch carries no recorded processing time "
                    f"(schema metadata {BATCH_TIME_KEY.decode()!r}); the sguard runtime records "
                    "it in the input log; apply batches through it (or stamp them with "
                    "sguard.spark.ttl.with_batch_time)")
            return max(clock, ms)
        if table.num_rows:
            return max(clock, int(column_numpy(table, str(self.ttl.time)).max()))
        return clock

    # -- eviction -------------------------------------------------------------------------
    def begin(self, table: pa.Table, agg: HashMap) -> npt.NDArray[Any]:
        """Advance the clock to this batch's and evict expired keys from `agg`; returns
        the evicted keys (distinct).

        Runtime complexity: O(entries expired), one probe of their keys (`HashMap.expire`:
        the lookup and the delete in one pass); the map is not scanned.
        """
        self.now = now = self._clock(table)
        none = np.zeros(0, self.kdt)
        bound = now - self.span  # a stamp at or before it has expired
        if (now == _NO_CLOCK or bound < _NO_CLOCK or len(self.batches) == 0
                or self.batches.item(0)[0] > bound):
            return none
        k = 4  # the expired records are a prefix (stamps never go back): read the front
        while True:  # of the log until a live record, usually one or two records
            bt = self.batches.head(k)
            m = int(np.count_nonzero(bt["t"] <= bound))
            if m < len(bt) or len(bt) == len(self.batches):
                break
            k *= 4
        if m == 0:
            return none
        n = int(bt["n"][:m].sum())
        self.batches.evict(m)
        # sorted and distinct (a key touched in several of these batches is logged once in
        # each), so the delete needs no sort of its own
        cand = np.sort(self.fifo.popleft(n))
        if m > 1:
            cand = cand[np.r_[True, cand[1:] != cand[:-1]]]
        # a key touched again since has a newer stamp (and log entry): it stays; one probe
        # per key looks its stamp up and deletes it if expired
        return cand[agg.expire(cand, STAMP_FIELD, bound)]

    def touch(self, keys: npt.NDArray[Any]) -> None:
        """Log `keys` (distinct), stamped `now` by the batch's upsert (after `begin`; every
        batch calls it, with no keys if it had no rows, so the log keeps the clock).

        Runtime complexity: O(n) for n keys, sequential appends.
        """
        if self.now == _NO_CLOCK:
            return
        if len(keys):
            self.fifo.extend(np.ascontiguousarray(keys, dtype=self.kdt))
        elif len(self.batches) and self.batches.item(-1)[0] == self.now:
            return  # the clock did not advance: nothing to log
        self.batches.append((self.now, len(keys)))  # its last record: the clock

    def stamps(self, n: int) -> npt.NDArray[np.int64]:
        """The stamp column of an upsert of `n` rows: the clock (after `begin`)."""
        return np.full(n, self.now, np.int64)

    def _check(self, agg: HashMap) -> None:
        """Assert the invariants: the log's entries are one per batch record, in clock
        order, none expired; every key of the map is live and logged at its stamp."""
        bt = self.batches.to_numpy()
        fk = self.fifo.to_numpy()
        assert int(bt["n"].sum()) == len(fk), "log records and keys disagree"
        assert (np.diff(bt["t"]) >= 0).all(), "log out of clock order"
        assert not (self.now != _NO_CLOCK and (bt["t"] + self.span <= self.now).any()), \
            "expired log records kept"
        logged = set(zip(fk.tolist(), np.repeat(bt["t"], bt["n"]).tolist()))
        k, v = agg.items()
        t = v[STAMP_FIELD]
        assert not (self.now != _NO_CLOCK and (t + self.span <= self.now).any()), \
            "expired keys kept"
        missing = [(a, b) for a, b in zip(k.tolist(), t.tolist()) if (a, b) not in logged]
        assert not missing, f"keys not logged at their stamp: {missing[:5]}"
