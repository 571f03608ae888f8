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
batch is retried, checkpointed with it, replayed with it.

The expiry index (`KeyExpiry`), in the operator's page manager like the rest
of its state: ``ttl.last`` (key -> last update) and buckets ``ttl.b.<j>``
(key -> a stamp in ``[j*w, (j+1)*w)``, ``w = ttl/16``). Stamping a key writes
``ttl.last`` and the bucket of the new stamp, and nothing else: a key stamped
again is *not* removed from its older bucket (that would be one delete per
older bucket per batch, the dominant cost); its older entry goes stale and is
dropped when it expires. So a key's current stamp is always in its bucket, and
a bucket may also hold stale older stamps of keys updated since (at most one
per key and bucket, and only for the TTL plus one bucket width). A batch scans
only the buckets old enough to hold an expired stamp: a bucket wholly past the
TTL is dropped whole, the one straddling the boundary is kept until it is; of
their stamps, one vectorised comparison picks those that expired since the last
sweep (its clock is kept in ``ttl.meta``, so nothing is deleted from a bucket,
and a retried or replayed batch sweeps the same stamps); those stamps' keys are then
checked against ``ttl.last`` in one lookup, and only keys whose *last* update
expired are evicted. So a batch costs O(keys touched + entries in the expiring
buckets), not a scan of every key.

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

from mmm import HashMap, Namespace, PageManager
from sguard.spark.errors import BatchTimeMissingError, SchemaChangedError
from sguard.spark.columns import column_numpy, duration_units, time_unit

__all__ = ["TTL", "KeyExpiry", "BATCH_TIME_KEY", "needs_batch_time", "batch_time_ms",
           "with_batch_time"]

BATCH_TIME_KEY = b"sguard.batch_time_ms"
"""Schema metadata key of a batch's recorded processing time (ms since the epoch)."""
_MODES = ("processing", "event")
_BUCKETS_PER_TTL = 16
_STAMP = [("t", "<i8")]
_CLOCK = [("clock", "<i8")]
_NO_CLOCK = np.iinfo(np.int64).min


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
    """The expiry index of one partition (see the module docstring).

    `begin` advances the clock and evicts expired keys from the operator's
    maps; `touch` stamps the keys the batch updated.
    """

    def __init__(self, pm: PageManager | Namespace, key_dtype: Any, ttl: TTL, schema: pa.Schema) -> None:
        self.pm, self.kdt, self.ttl = pm, np.dtype(key_dtype), ttl
        self.span = ttl.units(schema)
        self.width = max(1, self.span // _BUCKETS_PER_TTL)
        self.last = HashMap.create(pm, "ttl.last", self.kdt, _STAMP)
        # key 0: the event-time clock (event mode); key 1: the clock of the last sweep
        self.meta = HashMap.create(pm, "ttl.meta", "<u1", _CLOCK)
        self.clock_map = self.meta if ttl.mode == "event" else None
        self.now = _NO_CLOCK
        self._handles: dict[int, HashMap] = {}

    # -- the clock ------------------------------------------------------------------------
    def _clock(self, table: pa.Table) -> int:
        if self.ttl.mode == "processing":
            ms = batch_time_ms(table)
            if ms is None:
                raise BatchTimeMissingError(
                    "processing-time TTL: the batch carries no recorded processing time "
                    f"(schema metadata {BATCH_TIME_KEY.decode()!r}); the sguard runtime records "
                    "it in the input log; apply batches through it (or stamp them with "
                    "sguard.spark.ttl.with_batch_time)")
            return ms
        assert self.clock_map is not None
        zero = np.zeros(1, np.uint8)
        found, v = self.clock_map.get(zero)
        clock = int(v["clock"][0]) if found[0] else _NO_CLOCK
        if table.num_rows:
            clock = max(clock, int(column_numpy(table, str(self.ttl.time)).max()))
            self.clock_map.put(zero, np.array([(clock,)], dtype=_CLOCK))
        return clock

    # -- eviction -------------------------------------------------------------------------
    def _buckets(self) -> list[int]:
        return sorted(int(n[6:]) for n in self.pm.names() if n.startswith("ttl.b."))

    def _bucket(self, j: int) -> HashMap:
        b = self._handles.get(j)
        if b is None:  # recovering a map by name costs ~ms: keep the handles of this state
            b = self._handles[j] = HashMap.create(self.pm, f"ttl.b.{j}", self.kdt, _STAMP)
        return b

    def begin(self, table: pa.Table, maps: list[HashMap]) -> npt.NDArray[Any]:
        """Advance the clock to this batch's and evict expired keys from `maps`; returns
        the evicted keys (distinct).

        Runtime complexity: O(entries of the buckets that may hold an expired stamp).
        """
        self.now = now = self._clock(table)
        if now == _NO_CLOCK:
            return np.zeros(0, self.kdt)
        one = np.ones(1, np.uint8)
        known, sv = self.meta.get(one)
        swept = int(sv["clock"][0]) if known[0] else _NO_CLOCK  # stamps expired by then are done
        cand: list[npt.NDArray[Any]] = []
        for j in self._buckets():
            if j * self.width + self.span > now:  # its oldest possible stamp is still live
                break
            b = self._bucket(j)
            bk, bv = b.items()
            end = bv["t"] + self.span
            sel = end <= now
            if swept != _NO_CLOCK:
                sel &= end > swept
            cand.append(bk[sel])
            if (j + 1) * self.width - 1 + self.span <= now:  # every entry expired: drop it
                self.pm.destroy(self.pm.recover(b.name))
                del self._handles[j]
        if swept != now:
            self.meta.put(one, np.array([(now,)], dtype=_CLOCK))
        keys = np.unique(np.concatenate(cand)) if len(cand) > 1 else (
            cand[0] if cand else np.zeros(0, self.kdt))
        if len(keys) == 0:
            return keys
        # a stale stamp's key was updated since: evict only keys whose last update expired
        found, last = self.last.get(keys)
        keys = keys[found & (last["t"] + self.span <= now)]
        if len(keys) == 0:
            return keys
        self.last.delete(keys)
        for m in maps:
            m.delete(keys)
        return keys

    def touch(self, keys: npt.NDArray[Any]) -> None:
        """Stamp `keys` (distinct) with this batch's clock (after `begin`): two puts, the
        last update and the bucket of this clock (an older bucket's entry goes stale).

        Runtime complexity: O(n) for n keys.
        """
        if len(keys) == 0 or self.now == _NO_CLOCK:
            return
        stamps = np.empty(len(keys), dtype=_STAMP)
        stamps["t"] = self.now
        self.last.put(keys, stamps)
        self._bucket(self.now // self.width).put(keys, stamps)

    def _check(self) -> None:
        """Assert the index's invariants: every stamped key's last update is in the bucket
        of that stamp, with the same stamp; every other bucket entry is an older stamp of
        a stamped key (stale) or an expired one; no bucket wholly expired is kept (for a clock
        that never goes back, as in the tests; eviction itself only trusts ``ttl.last``)."""
        lk, lv = self.last.items()
        current = 0
        for j in self._buckets():
            bk, bv = self._bucket(j).items()
            assert (bv["t"] // self.width == j).all(), f"bucket {j}: stamps of other buckets"
            found, cur = self.last.get(bk)
            expired = bv["t"] + self.span <= self.now
            assert (found | expired).all(), f"bucket {j}: live entries of unstamped keys"
            assert (cur["t"][found] >= bv["t"][found]).all(), f"bucket {j}: entries too new"
            assert not (self.now != _NO_CLOCK and (j + 1) * self.width - 1 + self.span
                        <= self.now), f"bucket {j}: wholly expired but kept"
            current += int(np.count_nonzero(cur["t"] == bv["t"]))
        assert current == len(lk), f"{current} current bucket entries for {len(lk)} keys"
