"""Stateful stream operators for the Spark runtime, and the contract they implement.

An operator is a small, picklable *description* (its parameters) made on the
driver. On an executor, `Operator.open` binds it to one partition's
`mmm.PageManager` and returns an `OperatorState` whose `OperatorState.apply`
consumes one micro-batch (an Arrow table: the partition's rows of that batch)
and returns the output rows. All state lives in mmm structures created by name
in that page manager, so the runtime can snapshot, roll back, checkpoint and
restore it without the operator's help.

Writing your own operator
-------------------------
Subclass `Operator` (set `Operator.kind`; implement `params`, `check_input`,
`output_schema`, `open`) and `OperatorState` (`apply`, `dump`). Rules:

* keep every bit of state in structures of the page manager (``HashMap``,
  ``PagedDeque``...), created by name in `open` (the same call recovers them);
  nothing in Python attributes survives a batch;
* `apply` must be deterministic in the *set* of input rows: Spark may hand a
  replayed batch's rows in another order, so sort (or aggregate) before any
  order-dependent step, and sort the output;
* `apply` must not catch and hide exceptions: a failed batch is rolled back;
* the structure name ``keydict`` (and names starting ``keydict.``) belong to the
  key dictionary (`sguard.spark.keys.KEYDICT`);
* optionally, `OperatorState.frames_for` names the pool frames `apply` of a table
  will read (e.g. ``HashMap.frames_for`` of its keys): under a memory budget the
  runtime reads them in together before the key group runs, instead of one page
  fault at a time (`sguard.spark.budget`).

How keys reach an operator: ``key`` is what the user passed to `stateful`, a
column name or a list of them (composite keys), of any key type (strings,
binary, booleans, dates, timestamps, integers; `sguard.spark.keys`). Open a
`KeyIndex` on the page manager: ``keys.ids(table)`` gives each row's state key
(the integer itself for ``key="k"`` on an integer column, else an exact int64 id
from the partition's key dictionary, null keys included), ``keys.dtype`` is
their numpy dtype for the structures, ``keys.arrays(ids)`` gives back the key
columns with their original names and types for the output and `dump`, and
``keys.order(ids)`` a canonical order. Ids are local to a key group: never put
them in the output.

How state is partitioned: the runtime opens the operator once per *key group*
(`sguard.spark.groupstate`): `open` receives an `mmm.Namespace` of the
partition's page manager (it takes the place of the `PageManager`: create
structures by name as usual), and `apply` receives the rows of that key group
only. A repartitioning moves whole key groups' pages (`sguard.rescale`), so an
operator needs nothing for it; but anything event-time (a watermark) is per key
group.

Example (a per-key row counter; tests/spark/test_custom_operator.py runs it with
integer, string and composite keys)::

    @register_operator            # lets tools rebuild it from the state URI's layout
    class CountRows(Operator):
        kind = "count_rows"
        def params(self): return {}
        def check_input(self, schema, key): key_spec(schema, key)
        def output_schema(self, schema, key):
            return pa.schema(key_spec(schema, key).fields + [pa.field("n", pa.int64())])
        def open(self, pm, schema, key): return _CountRowsState(pm, schema, key)

    class _CountRowsState(OperatorState):
        def __init__(self, pm, schema, key):
            self.keys = KeyIndex.open(pm, schema, key)
            self.m = mmm.HashMap.create(pm, "n", self.keys.dtype, [("n", "<i8")])
            self.names = [f.name for f in self.keys.fields] + ["n"]
        def apply(self, table, batch_id):
            ids = self.keys.ids(table)
            self.m.upsert(ids, None, {"n": "count"})
            u = np.unique(ids)
            return self._table(u, self.m.get(u)[1]["n"])
        def dump(self):
            k, v = self.m.items()
            o = self.keys.order(k)
            return self._table(k[o], v["n"][o])
        def _table(self, ids, n):
            return pa.Table.from_arrays(self.keys.arrays(ids) + [pa.array(n)], self.names)

    out = sguard.spark.stateful(df, ["tenant", "user"], CountRows(), "file:///tmp/cr", 4)

Operators shipped here: `RunningAggregate` (count/sum/min/max per key;
``ttl=`` evicts idle keys, `sguard.spark.ttl`), `WindowAggregate` (tumbling event-time windows, evicted by watermark, closed
windows emitted) and `WindowJoin` (the SGuard paper's windowed stream join:
deque buffers plus per-key maps).
"""
from __future__ import annotations

import abc
import datetime as _dt
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from mmm import HashMap, Namespace, PageManager, PagedDeque
from mmm import jit
from sguard.spark import ttl as _ttl
from sguard.spark.columns import column_numpy
from sguard.spark.columns import duration_units as _duration_units
from sguard.spark.columns import time_unit as _time_unit
from sguard.spark.errors import SchemaChangedError, UnsupportedKeyTypeError
from sguard.spark.keys import KeyIndex, key_spec

__all__ = ["Operator", "OperatorState", "RunningAggregate", "WindowAggregate", "WindowJoin",
           "register_operator", "operator_from_params", "KeyIndex", "key_spec",
           "check_key_type", "key_dtype", "column_numpy", "upsert_returning", "SIDE_COLUMN"]

SIDE_COLUMN = "_sguard_side"
Key = str | Sequence[str]
Pages = PageManager | Namespace
"""Where an operator's state lives: a key group's `mmm.Namespace` of the partition's page
manager (the runtime), or a page manager (tools, tests)."""
"""A key as the user gives it: a column name or a list of names (`sguard.spark.keys`)."""


def check_key_type(schema: pa.Schema, key: Key) -> None:
    """Raise `UnsupportedKeyTypeError` (or `SchemaChangedError`) unless `key` can key state
    (`sguard.spark.keys.key_spec`)."""
    key_spec(schema, key)


def key_dtype(schema: pa.Schema, key: Key) -> str:
    """The numpy dtype of the state keys (`KeyIndex.dtype`)."""
    return key_spec(schema, key).dtype.str


def _key_fields(schema: pa.Schema, key: Key) -> list[pa.Field]:
    """The output fields of the key column(s): non-null for a direct integer key."""
    spec = key_spec(schema, key)
    return [f.with_nullable(not spec.direct) for f in spec.fields]


def _value_kind(schema: pa.Schema, name: str, what: str) -> str:
    if name not in schema.names:
        raise SchemaChangedError(f"{what} column {name!r} is not in the stream's columns "
                                 f"{schema.names}")
    t = schema.field(name).type
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return "<i8"
    if pa.types.is_floating(t):
        return "<f8"
    raise UnsupportedKeyTypeError(f"{what} column {name!r} has type {t}; a numeric column is "
                                  f"needed")


def upsert_returning(m: HashMap, keys: npt.NDArray[Any], values: Any,
                     combine: dict[str, Any]) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """Upsert, then return ``(distinct keys, their values after the upsert)``.

    Keys come in the order of their first row in the batch. The value of a
    key's last row (`HashMap.upsert` returns one per input row) is its final
    value; the last rows are found by one compiled pass (`_last_rows`), not a
    sort. Integer keys only (the operators' key types).
    """
    rows, vals = _upsert_last_rows(m, keys, values, combine)
    return keys[rows], vals


def _upsert_last_rows(m: HashMap, keys: npt.NDArray[Any], values: Any,
                      combine: dict[str, Any]) -> tuple[npt.NDArray[np.int64], npt.NDArray[Any]]:
    """`upsert_returning`, giving the last row of each distinct key instead of the key."""
    res = m.upsert(keys, values, combine, returning=True)
    k64 = keys.view(np.int64) if keys.dtype.itemsize == 8 else keys.astype(np.int64)
    rows = _last_rows(np.ascontiguousarray(k64))
    if res is not None and len(res) == len(keys):
        return rows, np.asarray(res)[rows]
    found, vals = m.get(keys[rows])
    return rows, vals


@jit
def _last_rows(keys: Any) -> Any:  # pragma: no cover - compiled
    """Index of the last row of each distinct key, keys in order of first appearance."""
    n = keys.shape[0]
    cap = 16
    while cap < 2 * n:
        cap <<= 1
    mask = np.uint64(cap - 1)
    slot = np.full(cap, -1, np.int64)
    last = np.empty(n, np.int64)
    m = 0
    for i in range(n):
        k = keys[i]
        h = (np.uint64(k) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)
        while True:
            j = slot[h & mask]
            if j < 0:
                slot[h & mask] = m
                last[m] = i
                m += 1
                break
            if keys[last[j]] == k:
                last[j] = i
                break
            h += np.uint64(1)
    return last[:m]


class OperatorState(abc.ABC):
    """One partition's live operator, bound to its page manager (see module docstring)."""

    @abc.abstractmethod
    def apply(self, table: pa.Table, batch_id: int) -> pa.Table:
        """Consume the partition's rows of one micro-batch; return the output rows."""

    @abc.abstractmethod
    def dump(self) -> pa.Table:
        """The whole state as a table in a canonical order (tests, status, repartitioning)."""

    def n_keys(self) -> int:
        """Keys (or records) held, for metrics."""
        return 0

    def frames_for(self, table: pa.Table) -> npt.NDArray[np.int64] | None:
        """The pool frames `apply` of ``table`` will read, for a memory budget's page
        cache to bring in together before the batch (`sguard.spark.budget`), or None
        when the state cannot tell (then its pages fault in as they are touched).
        Changes nothing and adds no key."""
        return None


class Operator(abc.ABC):
    """The driver-side description of a stateful operator (picklable, stateless)."""

    kind: ClassVar[str] = ""

    @abc.abstractmethod
    def params(self) -> dict[str, Any]:
        """JSON parameters; stored with the state, a change between restarts is refused."""

    @abc.abstractmethod
    def check_input(self, schema: pa.Schema, key: Key) -> None:
        """Raise a specific error if the input schema does not fit this operator."""

    @abc.abstractmethod
    def output_schema(self, schema: pa.Schema, key: Key) -> pa.Schema:
        """The Arrow schema of the output rows."""

    @abc.abstractmethod
    def open(self, pm: Pages, schema: pa.Schema, key: Key) -> OperatorState:
        """Create or recover the operator's structures in `pm`."""

    def prepare_input(self, df: Any, key: Key) -> Any:
        """Spark-side projection applied before the shuffle (default: none)."""
        return df


# --------------------------------------------------------------------------- running aggregate
_AGGS = ("count", "sum", "min", "max")


class RunningAggregate(Operator):
    """count / sum / min / max of a numeric column per key, over the whole stream.

    Each batch outputs one row per key the batch touched, with the key's
    aggregates *after* the batch (an update stream; the last row per key is
    the current value).

    Parameters
    ----------
    value : str, optional
        The numeric column to aggregate (needed for sum/min/max).
    aggs : sequence of str
        Any of ``"count"``, ``"sum"``, ``"min"``, ``"max"``.
    ttl : sguard.spark.TTL or timedelta, optional
        Evict keys not updated for this long (a timedelta: processing time);
        see `sguard.spark.ttl`. Evicted keys emit nothing.
    ttl_layout : int, optional
        The TTL state layout (stored in the parameters; only the current one,
        `sguard.spark.ttl.TTL_LAYOUT`, is accepted: another raises `TTLLayoutError`).
    """

    kind = "running_aggregate"

    def __init__(self, value: str | None = None, aggs: Sequence[str] = _AGGS,
                 ttl: Any = None, ttl_layout: int | None = None) -> None:
        if ttl_layout is not None and ttl_layout != _ttl.TTL_LAYOUT:
            raise _ttl.TTLLayoutError(
                f"ttl_layout={ttl_layout!r}: this version keeps TTL state in layout "
                f"{_ttl.TTL_LAYOUT} only (state of another layout needs a new state URI)")
        aggs = tuple(aggs)
        bad = [a for a in aggs if a not in _AGGS]
        if bad or not aggs:
            raise ValueError(f"aggs must be a non-empty subset of {_AGGS}, got {aggs!r}")
        if value is None and any(a != "count" for a in aggs):
            raise ValueError(f"aggs {aggs!r} need a value column (value=...)")
        self.value = value
        self.aggs = aggs
        self.ttl = _ttl.TTL.coerce(ttl)

    def params(self) -> dict[str, Any]:
        p: dict[str, Any] = {"value": self.value, "aggs": list(self.aggs)}
        if self.ttl is not None:  # absent without one: layouts written before TTL stay equal
            p["ttl"] = self.ttl.to_json()
            p["ttl_layout"] = _ttl.TTL_LAYOUT  # state written with TTL layout 1 lacks it
        return p

    def check_input(self, schema: pa.Schema, key: Key) -> None:
        check_key_type(schema, key)
        if self.value is not None:
            _value_kind(schema, self.value, "value")
        if self.ttl is not None:
            self.ttl.check(schema)

    def _fields(self, schema: pa.Schema) -> list[tuple[str, str]]:
        vk = _value_kind(schema, self.value, "value") if self.value is not None else "<i8"
        return [(a, "<i8" if a == "count" else vk) for a in self.aggs]

    def output_schema(self, schema: pa.Schema, key: Key) -> pa.Schema:
        out = _key_fields(schema, key)
        for a, dt in self._fields(schema):
            name = a if a == "count" else f"{a}_{self.value}"
            out.append(pa.field(name, pa.from_numpy_dtype(np.dtype(dt)), nullable=False))
        return pa.schema(out)

    def open(self, pm: Pages, schema: pa.Schema, key: Key) -> OperatorState:
        return _RunningAggregateState(self, pm, schema, key)


class _RunningAggregateState(OperatorState):
    def __init__(self, op: RunningAggregate, pm: Pages, schema: pa.Schema, key: Key) -> None:
        if op.ttl is not None:
            _ttl.KeyExpiry.check_layout(pm)  # before anything is created
        self.keys = KeyIndex.open(pm, schema, key)
        self.value = op.value
        self.out_schema = op.output_schema(schema, key)
        fields = op._fields(schema)
        self.names = [a for a, _ in fields]  # the output's value fields
        self.vdt = np.dtype(fields[0][1]) if op.value is None else None
        self.spec: dict[str, Any] = {a: "count" if a == "count" else (a, "v") for a, _ in fields}
        self.val_kind = next((dt for a, dt in fields if a != "count"), "<i8")
        self.expiry = None
        if op.ttl is not None:
            # TTL layout 2: the key's last update is a field of its record, written by the
            # same upsert (sguard.spark.ttl), beside a touch log
            self.expiry = _ttl.KeyExpiry(pm, self.keys.dtype, op.ttl, schema)
            fields = fields + [(_ttl.STAMP_FIELD, "<i8")]
            self.spec[_ttl.STAMP_FIELD] = ("last", _ttl.STAMP_FIELD)
        self.map = HashMap.create(pm, "aggregate", self.keys.dtype, fields)

    def apply(self, table: pa.Table, batch_id: int) -> pa.Table:
        if self.expiry is not None:
            # evict first (an expired key starts afresh), and forget evicted keys in the key
            # dictionary before this batch's keys are interned
            self.keys.remove(self.expiry.begin(table, self.map))
        if table.num_rows == 0:
            if self.expiry is not None:
                self.expiry.touch(np.zeros(0, self.keys.dtype))  # the clock advanced
            return self.out_schema.empty_table()
        keys = self.keys.ids(table)
        cols: dict[str, Any] | None = None
        if self.value is not None:
            cols = {"v": column_numpy(table, self.value).astype(self.val_kind, copy=False)}
        if self.expiry is not None:
            cols = cols or {}
            cols[_ttl.STAMP_FIELD] = self.expiry.stamps(len(keys))
        rows, vals = _upsert_last_rows(self.map, keys, cols, self.spec)
        if self.expiry is not None:
            self.expiry.touch(keys[rows])  # one row per distinct key
        # the key columns of the output straight from the input rows (no dictionary decode)
        kcols = [table.column(f.name).take(pa.array(rows)) for f in self.keys.fields]
        return self._table(kcols, vals)

    def frames_for(self, table: pa.Table) -> npt.NDArray[np.int64] | None:
        # keys the partition has not seen yet (dictionary keys) have no bucket to read yet
        keys = self.keys.lookup(table)
        if not self.keys.spec.direct:
            keys = keys[keys >= 0]
        return self.map.frames_for(keys)

    def _table(self, keys: list[Any], vals: npt.NDArray[Any]) -> pa.Table:
        arrays = keys + [pa.array(vals[n]) for n in self.names]
        return pa.Table.from_arrays(arrays, schema=self.out_schema)

    def dump(self) -> pa.Table:
        k, v = self.map.items()
        order = self.keys.order(k)
        return self._table(self.keys.arrays(k[order]), v[order])

    def n_keys(self) -> int:
        return len(self.map)


# --------------------------------------------------------------------- window aggregate
class _EventTimeOperator(Operator):
    """What the event-time operators share: ``(time, window, value, lateness)`` parameters
    and their input checks (integer key, time column, numeric value)."""

    def __init__(self, time: str, window: float | _dt.timedelta, value: str,
                 lateness: float | _dt.timedelta = 0) -> None:
        self.time, self.window, self.value, self.lateness = time, window, value, lateness

    def params(self) -> dict[str, Any]:
        def j(d: Any) -> Any:
            return d.total_seconds() if isinstance(d, _dt.timedelta) else d
        return {"time": self.time, "window": j(self.window), "value": self.value,
                "lateness": j(self.lateness)}

    def check_input(self, schema: pa.Schema, key: Key) -> None:
        check_key_type(schema, key)
        _time_unit(schema, self.time)
        _value_kind(schema, self.value, "value")

    def _types(self, schema: pa.Schema) -> tuple[pa.DataType, pa.DataType]:
        """The Arrow types of the time and the value columns in the output."""
        return (_time_unit(schema, self.time)[0],
                pa.from_numpy_dtype(np.dtype(_value_kind(schema, self.value, "value"))))


_META = [("max_ts", "<i8"), ("seen", "<i8"), ("late", "<i8")]
_NO_TS = np.iinfo(np.int64).min


class _EventTimeState(OperatorState):
    """What the event-time operators' states share: the window and lateness in the time
    column's units, the keys, and the watermark map ``meta`` (largest time seen, rows
    seen, late rows dropped)."""

    def __init__(self, op: _EventTimeOperator, pm: Pages, schema: pa.Schema,
                 key: Key) -> None:
        self.pm, self.time, self.value = pm, op.time, op.value
        per_s = _time_unit(schema, op.time)[1]
        self.W = _duration_units(op.window, per_s, "window")
        self.L = _duration_units(op.lateness, per_s, "lateness")
        self.keys = KeyIndex.open(pm, schema, key)
        self.vk = _value_kind(schema, op.value, "value")
        self.out_schema = op.output_schema(schema, key)
        self.meta = HashMap.create(pm, "meta", "<u1", _META)

    def _meta(self) -> tuple[int, int, int]:
        """``(max_ts, seen, late)``."""
        found, v = self.meta.get(np.zeros(1, np.uint8))
        if not found[0]:
            return _NO_TS, 0, 0
        return int(v["max_ts"][0]), int(v["seen"][0]), int(v["late"][0])

    def _put_meta(self, max_ts: int, seen: int, late: int) -> None:
        self.meta.put(np.zeros(1, np.uint8), np.array([(max_ts, seen, late)], dtype=_META))

    def _watermark(self, max_ts: int) -> int:
        return max_ts - self.L if max_ts != _NO_TS else _NO_TS


class WindowAggregate(_EventTimeOperator):
    """Tumbling event-time windows per key: count / sum / min / max, emitted when closed.

    The watermark of a partition is the largest event time it has seen minus
    `lateness`; a window ``[start, start + window)`` closes (is emitted once
    and evicted) when its end is at or below the watermark. Rows of windows
    already closed are late: dropped and counted. Each open window is its
    own hash map, so evicting a window frees its pages at once.

    Parameters
    ----------
    time : str
        Event-time column (timestamp or integer).
    window : number or timedelta
        Window length: seconds (or a timedelta) for a timestamp column, units
        of the column for an integer one.
    value : str
        The numeric column aggregated.
    lateness : number or timedelta
        How far behind the largest event time rows may still arrive.
    """

    kind = "window_aggregate"

    def check_input(self, schema: pa.Schema, key: Key) -> None:
        super().check_input(schema, key)
        per_s = _time_unit(schema, self.time)[1]
        if _duration_units(self.window, per_s, "window") <= 0:
            raise ValueError(f"window must be > 0, got {self.window!r}")
        if _duration_units(self.lateness, per_s, "lateness") < 0:
            raise ValueError(f"lateness must be >= 0, got {self.lateness!r}")

    def output_schema(self, schema: pa.Schema, key: Key) -> pa.Schema:
        tt, vt = self._types(schema)
        return pa.schema([pa.field("window_start", tt, nullable=False),
                          pa.field("window_end", tt, nullable=False),
                          *_key_fields(schema, key),
                          pa.field("count", pa.int64(), nullable=False),
                          pa.field(f"sum_{self.value}", vt, nullable=False),
                          pa.field(f"min_{self.value}", vt, nullable=False),
                          pa.field(f"max_{self.value}", vt, nullable=False)])

    def open(self, pm: Pages, schema: pa.Schema, key: Key) -> OperatorState:
        return _WindowAggregateState(self, pm, schema, key)


class _WindowAggregateState(_EventTimeState):
    def __init__(self, op: WindowAggregate, pm: Pages, schema: pa.Schema, key: Key) -> None:
        super().__init__(op, pm, schema, key)
        self.kdt = self.keys.dtype
        self.fields = [("count", "<i8"), ("sum", self.vk), ("min", self.vk), ("max", self.vk)]
        self.spec: dict[str, Any] = {"count": "count", "sum": ("sum", "v"), "min": ("min", "v"),
                                     "max": ("max", "v")}
        # dictionary keys: in how many open windows each id is, so a key no open window
        # holds leaves the dictionary with the last of them
        self.refs = None
        if self.keys.kd is not None:
            fresh = "keyrefs" not in pm.names()
            self.refs = HashMap.create(pm, "keyrefs", "<i8", [("n", "<i8")])
            if fresh:  # state written without the counts: count the open windows' keys
                for s in self._open_windows():
                    self.refs.upsert(self._window(s).keys(), None, {"n": "count"})

    def _window(self, start: int) -> HashMap:
        return HashMap.create(self.pm, f"win.{start}", self.kdt, self.fields)

    def _open_windows(self) -> list[int]:
        return sorted(int(n[4:]) for n in self.pm.names() if n.startswith("win."))

    def apply(self, table: pa.Table, batch_id: int) -> pa.Table:
        max_ts, seen, late = self._meta()
        wm = self._watermark(max_ts)
        out: list[pa.Table] = []
        if table.num_rows:
            ts = column_numpy(table, self.time).astype(np.int64, copy=False)
            vals = column_numpy(table, self.value).astype(self.vk, copy=False)
            starts = np.floor_divide(ts, self.W) * self.W
            ok = starts + self.W > wm if wm != _NO_TS else np.ones(len(ts), bool)
            late += int(len(ts) - np.count_nonzero(ok))
            seen += len(ts)
            keys = self.keys.ids(_rows(table, ok))  # late rows' keys are never interned
            ts, vals, starts = ts[ok], vals[ok], starts[ok]
            if len(ts):
                order = np.argsort(starts, kind="stable")
                s_sorted = starts[order]
                bounds = np.flatnonzero(np.diff(s_sorted)) + 1
                for grp in np.split(order, bounds):
                    m = self._window(int(starts[grp[0]]))
                    if self.refs is not None:
                        u = np.unique(keys[grp])
                        self.refs.upsert(u[~m.contains(u)], None, {"n": "count"})
                    m.upsert(keys[grp], {"v": vals[grp]}, self.spec)
                max_ts = max(max_ts, int(ts.max()))
            self._put_meta(max_ts, seen, late)
        wm = self._watermark(max_ts)
        for start in self._open_windows():
            if wm == _NO_TS or start + self.W > wm:
                break
            m = self._window(start)
            k, v = m.items()
            out.append(self._table(start, k, v))
            self.pm.destroy(self.pm.recover(m.name))
            if self.refs is not None:
                self.keys.remove(_release(self.refs, k, np.ones(len(k), np.int64)))
        if not out:
            return self.out_schema.empty_table()
        return pa.concat_tables(out)

    def _table(self, start: int, k: npt.NDArray[Any], v: npt.NDArray[Any]) -> pa.Table:
        order = self.keys.order(k)
        k, v = k[order], v[order]
        n = len(k)
        st = self.out_schema.field("window_start").type
        s = pa.array(np.full(n, start, np.int64)).cast(st)
        e = pa.array(np.full(n, start + self.W, np.int64)).cast(st)
        return pa.Table.from_arrays([s, e, *self.keys.arrays(k), pa.array(v["count"]),
                                     pa.array(v["sum"]), pa.array(v["min"]),
                                     pa.array(v["max"])], schema=self.out_schema)

    def dump(self) -> pa.Table:
        parts = [self._table(s, *self._window(s).items()) for s in self._open_windows()]
        return pa.concat_tables(parts) if parts else self.out_schema.empty_table()

    def n_keys(self) -> int:
        return sum(len(self._window(s)) for s in self._open_windows())


def _rows(table: pa.Table, ok: npt.NDArray[np.bool_]) -> pa.Table:
    """`table`'s rows where `ok` (the table itself when every row is)."""
    return table if ok.all() else table.filter(pa.array(ok))


def _release(counts: HashMap, ids: npt.NDArray[Any], n: npt.NDArray[np.int64]
             ) -> npt.NDArray[Any]:
    """Subtract `n` from the counts of the distinct `ids`; those reaching 0 are deleted
    from `counts` and returned."""
    if not len(ids):
        return ids
    _, have = counts.get(ids)
    left = have["n"] - n
    gone: npt.NDArray[Any] = ids[left == 0]
    counts.delete(gone)
    keep = left > 0
    if keep.any():
        counts.put(ids[keep], np.array(left[keep], dtype=[("n", "<i8")]))
    return gone


# ------------------------------------------------------------------------- windowed join
@jit
def _band_join(pk: Any, pt: Any, bk: Any, bt: Any, w: int, out_p: Any, out_b: Any,
               count_only: bool) -> int:  # pragma: no cover - compiled
    """Pairs (i, j) with pk[i] == bk[j] and |pt[i] - bt[j]| <= w; (bk, bt) sorted by (key, ts)."""
    n = 0
    m = len(bk)
    for i in range(len(pk)):
        k = pk[i]
        lo, hi = 0, m
        while lo < hi:  # first j with (bk, bt) >= (k, pt - w)
            mid = (lo + hi) >> 1
            if bk[mid] < k or (bk[mid] == k and bt[mid] < pt[i] - w):
                lo = mid + 1
            else:
                hi = mid
        j = lo
        while j < m and bk[j] == k and bt[j] <= pt[i] + w:
            if not count_only:
                out_p[n] = i
                out_b[n] = j
            n += 1
            j += 1
    return n


def band_join(pk: npt.NDArray[Any], pt: npt.NDArray[np.int64], bk: npt.NDArray[Any],
              bt: npt.NDArray[np.int64], w: int) -> tuple[npt.NDArray[np.int64],
                                                          npt.NDArray[np.int64]]:
    """Indices ``(i, j)`` of all pairs with equal keys and ``|pt[i] - bt[j]| <= w``."""
    order = np.lexsort((bt, bk))
    sk, st = np.ascontiguousarray(bk[order]).astype(np.int64), np.ascontiguousarray(bt[order])
    pk64 = np.ascontiguousarray(pk).astype(np.int64)
    pt = np.ascontiguousarray(pt)
    empty = np.zeros(0, np.int64)
    n = _band_join(pk64, pt, sk, st, w, empty, empty, True)
    oi, oj = np.empty(n, np.int64), np.empty(n, np.int64)
    _band_join(pk64, pt, sk, st, w, oi, oj, False)
    return oi, order[oj]


class WindowJoin(_EventTimeOperator):
    """The SGuard paper's windowed stream join of two keyed inputs.

    A left row joins every right row with the same key whose event time is
    within `window` of its own (``|t_left - t_right| <= window``). Each side's
    rows wait in a paged deque buffer (arrival order, each batch sorted by
    time) with a per-key count map; rows older than the watermark minus the
    window can match nothing more and are evicted from the front. Rows older
    than the watermark (the largest time seen minus `lateness`) are late and
    dropped. Use `sguard.spark.stream_join` to build the input.

    Parameters
    ----------
    time : str
        The event-time column of both inputs.
    window : number or timedelta
        The join window (seconds for timestamps, column units for integers).
    value : str
        The numeric payload column of both inputs.
    lateness : number or timedelta
        Allowed lateness.
    """

    kind = "window_join"

    def check_input(self, schema: pa.Schema, key: Key) -> None:
        super().check_input(schema, key)
        if SIDE_COLUMN not in schema.names:
            raise SchemaChangedError(f"WindowJoin needs the side column {SIDE_COLUMN!r}; build its "
                                     f"input with sguard.spark.stream_join(left, right, ...)")

    def output_schema(self, schema: pa.Schema, key: Key) -> pa.Schema:
        tt, vt = self._types(schema)
        return pa.schema([*_key_fields(schema, key),
                          pa.field(f"left_{self.time}", tt, nullable=False),
                          pa.field(f"left_{self.value}", vt, nullable=False),
                          pa.field(f"right_{self.time}", tt, nullable=False),
                          pa.field(f"right_{self.value}", vt, nullable=False)])

    def open(self, pm: Pages, schema: pa.Schema, key: Key) -> OperatorState:
        return _WindowJoinState(self, pm, schema, key)


class _WindowJoinState(_EventTimeState):
    def __init__(self, op: WindowJoin, pm: Pages, schema: pa.Schema, key: Key) -> None:
        super().__init__(op, pm, schema, key)
        kdt = self.keys.dtype
        self.rec = np.dtype([("k", kdt), ("t", "<i8"), ("v", self.vk)])
        self.buf = [PagedDeque.create(pm, f"buf.{s}", self.rec) for s in "LR"]
        self.cnt = [HashMap.create(pm, f"cnt.{s}", kdt, [("n", "<i8")]) for s in "LR"]

    def apply(self, table: pa.Table, batch_id: int) -> pa.Table:
        max_ts, seen, late = self._meta()
        wm = self._watermark(max_ts)
        new: list[npt.NDArray[Any]] = []
        if table.num_rows:
            side = column_numpy(table, SIDE_COLUMN)
            recs = np.empty(table.num_rows, self.rec)
            recs["t"] = column_numpy(table, self.time)
            recs["v"] = column_numpy(table, self.value)
            ok = recs["t"] >= wm if wm != _NO_TS else np.ones(len(recs), bool)
            late += int(len(recs) - np.count_nonzero(ok))
            seen += len(recs)
            recs, side = recs[ok], side[ok]
            recs["k"] = self.keys.ids(_rows(table, ok))  # late rows' keys never interned
            for s in (0, 1):
                r = recs[side == s]
                new.append(r[np.lexsort((r["v"], r["k"], r["t"]))])
        else:
            new = [np.empty(0, self.rec), np.empty(0, self.rec)]
        old = [b.to_numpy() for b in self.buf]
        outs = []
        # left-new x (right-old + right-new), then left-old x right-new
        for lrec, rrec in ((new[0], np.concatenate([old[1], new[1]])), (old[0], new[1])):
            if len(lrec) and len(rrec):
                i, j = band_join(lrec["k"], lrec["t"], rrec["k"], rrec["t"], self.W)
                outs.append((lrec[i], rrec[j]))
        for s in (0, 1):
            if len(new[s]):
                self.buf[s].extend(new[s])
                self.cnt[s].upsert(new[s]["k"], None, {"n": "count"})
        both = np.concatenate(new)
        if len(both):
            max_ts = max(max_ts, int(both["t"].max()))
        self._put_meta(max_ts, seen, late)
        wm = self._watermark(max_ts)
        out = self._table(outs)  # before evicting: an evicted key may leave the dictionary
        if wm != _NO_TS:
            for s in (0, 1):
                cur = np.concatenate([old[s], new[s]])
                old_mask = cur["t"] < wm - self.W
                n_drop = int(np.argmin(old_mask)) if not old_mask.all() else len(cur)
                if n_drop:
                    self.buf[s].popleft(n_drop)
                    uk, c = np.unique(cur["k"][:n_drop], return_counts=True)
                    gone = _release(self.cnt[s], uk, c)
                    if len(gone) and self.keys.kd is not None:  # a key neither buffer
                        # holds leaves the dictionary
                        self.keys.remove(gone[~self.cnt[1 - s].contains(gone)])
        return out

    def _table(self, outs: list[tuple[npt.NDArray[Any], npt.NDArray[Any]]]) -> pa.Table:
        if not outs:
            return self.out_schema.empty_table()
        lv = np.concatenate([o[0] for o in outs])
        rv = np.concatenate([o[1] for o in outs])
        order = np.lexsort((rv["v"], rv["t"], lv["v"], lv["t"], self.keys.rank(lv["k"])))
        lv, rv = lv[order], rv[order]
        sch = self.out_schema
        nk = len(self.keys.fields)
        return pa.Table.from_arrays(
            [*self.keys.arrays(lv["k"]), pa.array(lv["t"]).cast(sch.field(nk).type),
             pa.array(lv["v"]), pa.array(rv["t"]).cast(sch.field(nk + 2).type),
             pa.array(rv["v"])], schema=sch)

    def dump(self) -> pa.Table:
        parts = []
        for s, b in enumerate(self.buf):
            r = b.to_numpy()
            r = r[np.lexsort((r["v"], r["t"], self.keys.rank(r["k"])))]
            cols = {"side": pa.array(np.full(len(r), s, np.int8))}
            cols.update((f.name, a) for f, a in zip(self.keys.fields, self.keys.arrays(r["k"])))
            cols.update(t=pa.array(r["t"]), v=pa.array(r["v"]))
            parts.append(pa.table(cols))
        return pa.concat_tables(parts)

    def n_keys(self) -> int:
        return len(self.buf[0]) + len(self.buf[1])


_REGISTRY: dict[str, type[Operator]] = {c.kind: c for c in (RunningAggregate, WindowAggregate,
                                                             WindowJoin)}


def register_operator(cls: type[Operator]) -> type[Operator]:
    """Make a custom operator kind known to `operator_from_params` (a class decorator)."""
    _REGISTRY[cls.kind] = cls
    return cls


def operator_from_params(kind: str, params: dict[str, Any]) -> Operator:
    """Rebuild an operator from the kind and parameters stored in a layout document.

    Raises
    ------
    ValueError
        If the kind is unknown (register custom operators with `register_operator`).
    """
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise ValueError(f"unknown operator kind {kind!r}; known: {sorted(_REGISTRY)} "
                         f"(custom operators: decorate with register_operator)")
    return cls(**params)
