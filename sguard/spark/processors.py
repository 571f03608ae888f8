"""PySpark's ``StatefulProcessor``, unchanged, on sguard state.

A processor written for Spark 4's ``transformWithStateInPandas`` (pandas flavour) or
``transformWithState`` (Row flavour) runs on sguard by changing one line::

    out = df.groupBy("user").transformWithStateInPandas(
        MyProcessor(), "user string, n long", "Update", "None")            # Spark
    out = ss.transform_with_state_in_pandas(
        df, "user", MyProcessor(), "user string, n long", "Update", "None",
        state_uri="file:///tmp/state")                                      # sguard

The processor gets a handle with Spark's methods and semantics
(`sguard.spark.processor_state`): ``getValueState``, ``getListState``, ``getMapState``
(schemas as ``StructType`` or DDL, ``ttlDurationMs``), ``deleteIfExists``,
``registerTimer``, ``deleteTimer``, ``listTimers``; ``handleInputRows``,
``handleExpiredTimer`` and ``handleInitialState`` are called as Spark calls them:

* per partition and batch: ``init(handle)``, then every key with rows (in key order;
  its initial state first in the query's first batch, also for keys without rows),
  then every due timer in order of expiry, then ``close()``;
* ``TimerValues``: the batch's processing time (the same for every key of the
  partition, recorded with the batch so a retry or replay sees it again; -1 in time
  mode ``"None"``) and, in ``"EventTime"``, the query's watermark as Spark computes it
  (`sguard.spark.watermark`); processing-time timers fire at or below the batch's
  time, event-time timers at or below the watermark; rows at or below the previous
  batch's watermark are late and dropped in ``"EventTime"``;
* TTL runs from the batch that last wrote a value (processing time); an expired value
  reads as absent; a list ``put`` renews every element, ``appendValue`` only the new
  one; map entries expire one by one.

Everything sguard promises for its own operators holds: the variables live in the
pages of each key group, so checkpoints, rollback, exactly-once recovery, fencing,
rescaling and `sguard.spark.read_state` (``state_var=``) work unchanged.

Where this differs from Spark: the output is a plain streaming DataFrame
(``mapInArrow``), so Spark runs no extra "no-data" batches for it (run Spark's own
with ``spark.sql.streaming.noDataMicroBatches.enabled=false`` to compare batch by
batch); ``event_time_column`` re-declares a zero-delay watermark on the output
column; the rows of a key arrive sorted (key, then the columns), so a processor sees
the same rows in the same order when a batch is replayed.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sguard.spark.errors import SchemaChangedError
from sguard.spark.hosting import HostedOperator, ProcessorOutputError, parse_struct
from sguard.spark.keys import KeyIndex
from sguard.spark.operators import OperatorState, register_operator
from sguard.spark.processor_state import (GroupStore, ListStateImpl, MapStateImpl,
                                          ProcessorPhaseError, ValueStateImpl, VarSpec)
from sguard.spark import watermark as _wm
from sguard.spark.vectorized import VectorizedProcessor, vectorized_operator

__all__ = ["transform_with_state", "transform_with_state_in_pandas", "ProcessorOperator",
           "ProcessorOutputError", "ProcessorPhaseError", "INITIAL_STATE_FILE"]

INITIAL_STATE_FILE = "initial/state.arrow"
"""Where the initial state is kept under the state URI (Arrow IPC, with key groups)."""
_TIME_MODES = {"none": "None", "processingtime": "ProcessingTime", "eventtime": "EventTime"}
_OUTPUT_MODES = {"append": "Append", "update": "Update", "complete": "Complete"}


# ------------------------------------------------------------------------------ the handle
class _Handle:
    """The handle a processor's ``init`` gets (a `StatefulProcessorHandle`)."""

    def __init__(self, ctx: "_Ctx | None", spark: Any = None, time_mode: str = "None") -> None:
        self._ctx = ctx
        self._spark = spark
        self.time_mode = time_mode
        self.declared: dict[str, VarSpec] = {}
        self._parsed: dict[str, Any] = {}

    # driver: record; executor: bind
    def _declare(self, name: str, kind: str, schema: Any, key_schema: Any,
                 ttl: Any) -> Any:
        if not isinstance(name, str) or not name:
            raise ValueError(f"state variable name must be a non-empty string, got {name!r}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0):
            raise ValueError(f"state variable {name!r}: ttlDurationMs must be a positive "
                             f"integer, got {ttl!r}")
        if self._ctx is None:  # on the driver: record the declaration
            if ttl is not None and self.time_mode != "ProcessingTime":
                raise ValueError(
                    f"state variable {name!r}: a TTL needs time mode 'ProcessingTime' (TTL "
                    f"runs on processing time, as in Spark); this query runs with "
                    f"{self.time_mode!r}")
            if name in self.declared:
                raise ValueError(f"state variable {name!r} is declared twice")
            s = parse_struct(self._spark, schema, f"state variable {name!r} schema")
            ks = (parse_struct(self._spark, key_schema, f"state variable {name!r} key schema")
                  if kind == "map" else None)
            from sguard.spark.statecodec import StateCodec
            StateCodec(name, [s])  # refuses unsupported types now, naming the field
            if ks is not None:
                StateCodec(f"{name} (map key)", [ks])
            self.declared[name] = VarSpec(name, kind, (s.json(),),
                                          (ks.json(),) if ks is not None else (), ttl)
            return None
        ctx = self._ctx
        if ctx.phase != "init":
            raise ProcessorPhaseError(f"state variable {name!r} declared outside init(); "
                                      f"Spark allows get{kind.title()}State only in init")
        spec = ctx.op.var(name)
        if spec is None or spec.kind != kind:
            raise ProcessorPhaseError(
                f"state variable {name!r} ({kind}) was not declared when the query started "
                f"(declared: {sorted(v.name for v in ctx.op.vars)}); init() must declare "
                f"the same variables on every call")
        if (spec.ttl_ms or None) != (ttl or None):
            raise SchemaChangedError(f"state variable {name!r}: ttlDurationMs {ttl} differs "
                                     f"from the {spec.ttl_ms} the query started with")
        cls = {"value": ValueStateImpl, "list": ListStateImpl, "map": MapStateImpl}[kind]
        return cls(ctx, name)

    def getValueState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None
                      ) -> Any:
        return self._declare(stateName, "value", schema, None, ttlDurationMs)

    def getListState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None
                     ) -> Any:
        return self._declare(stateName, "list", schema, None, ttlDurationMs)

    def getMapState(self, stateName: str, userKeySchema: Any, valueSchema: Any,
                    ttlDurationMs: int | None = None) -> Any:
        return self._declare(stateName, "map", valueSchema, userKeySchema, ttlDurationMs)

    def _timers(self, what: str) -> tuple[GroupStore, int]:
        if self._ctx is None or self._ctx.store is None:
            raise ProcessorPhaseError(f"{what} needs a current key: call it from "
                                      f"handleInputRows, handleExpiredTimer or "
                                      f"handleInitialState")
        if self._ctx.op.time_mode == "None":
            raise ProcessorPhaseError(f"{what}: timers need time mode 'ProcessingTime' or "
                                      f"'EventTime'; this processor runs with 'None'")
        return self._ctx.store, self._ctx.kid

    def registerTimer(self, expiryTimestampMs: int) -> None:
        store, kid = self._timers("registerTimer")
        t = store.timer_list(kid)
        ts = int(expiryTimestampMs)
        if ts not in t:
            t.append(ts)
            t.sort()
            store.timers_changed(kid)

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        store, kid = self._timers("deleteTimer")
        t = store.timer_list(kid)
        ts = int(expiryTimestampMs)
        if ts in t:
            t.remove(ts)
            store.timers_changed(kid)

    def listTimers(self) -> Iterator[int]:
        store, kid = self._timers("listTimers")
        return iter(list(store.timer_list(kid)))

    def deleteIfExists(self, stateName: str) -> None:
        if self._ctx is None:
            return
        if self._ctx.phase != "init":
            raise ProcessorPhaseError("deleteIfExists is allowed only in init()")
        self._ctx.deleted.add(stateName)


def _handle_class() -> type:
    """`_Handle` as a subclass of PySpark's `StatefulProcessorHandle` (isinstance checks)."""
    from pyspark.sql.streaming.stateful_processor import StatefulProcessorHandle

    class StatefulProcessorHandleImpl(_Handle, StatefulProcessorHandle):
        pass
    return StatefulProcessorHandleImpl


# -------------------------------------------------------------------------- the operator
class _Ctx:
    """One partition's batch: the processor's handle, times, and the current key."""

    def __init__(self, op: "ProcessorOperator", batch: int, now: int, wm: int, late: int
                 ) -> None:
        self.op, self.batch, self.now, self.wm, self.late = op, batch, now, wm, late
        self.phase = "init"
        self.store: GroupStore | None = None
        self.kid = 0
        self.deleted: set[str] = set()
        self.handle = _handle_class()(self)
        from pyspark.sql.streaming.stateful_processor import TimerValues
        tm = op.time_mode
        self.timer_values = TimerValues(now if tm != "None" else -1,
                                        wm if tm == "EventTime" else -1)

    def current(self, name: str) -> tuple[GroupStore, int]:
        if self.store is None:
            raise ProcessorPhaseError(
                f"state variable {name!r} used without a current key: Spark allows state "
                f"access only in handleInputRows, handleExpiredTimer and handleInitialState")
        return self.store, self.kid


@register_operator
class ProcessorOperator(HostedOperator):
    """The sguard operator that hosts a ``StatefulProcessor`` (built by
    `transform_with_state`; its parameters are what the layout records)."""

    kind = "processor"

    def __init__(self, vars: list[dict[str, Any]], output_schema: str, time_mode: str,
                 output_mode: str, flavour: str, watermark: list[Any] | None = None,
                 initial_state: bool = False, processor_class: str = "",
                 *, processor: Any = None, state_uri: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.vars = [VarSpec.from_json(v) for v in vars]
        self.output_schema_json = output_schema
        self.time_mode = time_mode
        self.output_mode = output_mode
        self.flavour = flavour
        self.watermark = None if watermark is None else (str(watermark[0]), int(watermark[1]))
        self.initial_state = bool(initial_state)
        self.processor_class = processor_class
        self.processor = processor
        self.state_uri = state_uri
        self.storage_options = dict(storage_options or {})
        self.ttl = None  # no operator-level TTL: variables have their own
        self._ctx: _Ctx | None = None
        self._initial: dict[int, pa.Table] | None = None

    # -- the contract -----------------------------------------------------------------------
    def params(self) -> dict[str, Any]:
        return {"vars": [v.to_json() for v in self.vars], "output_schema": self.output_schema_json,
                "time_mode": self.time_mode, "output_mode": self.output_mode,
                "flavour": self.flavour,
                "watermark": None if self.watermark is None else list(self.watermark),
                "initial_state": self.initial_state, "processor_class": self.processor_class}

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_ctx"] = None
        d["_initial"] = None
        return d

    def var(self, name: str) -> VarSpec | None:
        return next((v for v in self.vars if v.name == name), None)

    @property
    def event_time(self) -> tuple[str, int] | None:
        """``(column, delay_ms)`` when the runtime must keep the query's watermark."""
        return self.watermark if self.time_mode == "EventTime" else None

    @property
    def visits_every_key_group(self) -> bool:
        return self.time_mode != "None" or any(v.ttl_ms for v in self.vars)

    def check_input(self, schema: pa.Schema, key: Any) -> None:
        from sguard.spark.keys import key_spec
        key_spec(schema, key)
        if self.event_time is not None and self.event_time[0] not in schema.names:
            raise SchemaChangedError(f"the watermark column {self.event_time[0]!r} is not in "
                                     f"the stream's columns {schema.names}")

    def open(self, pm: Any, schema: pa.Schema, key: Any) -> OperatorState:
        return _ProcessorGroup(self, pm, schema, key)

    def reconcile(self, old: dict[str, Any]) -> dict[str, Any]:
        """The parameters to record when the query restarts on state written with `old`:
        each variable's schema history grows by its new schema when that can evolve
        (`StateCodec` refuses what cannot, naming the variable and the change); other
        parameters must not change."""
        from pyspark.sql.types import StructType

        from sguard.spark.statecodec import StateCodec
        mine = self.params()
        for k in ("output_schema", "time_mode", "flavour", "watermark", "output_mode"):
            if old.get(k) != mine.get(k) and not (k == "watermark" and
                                                   self.time_mode != "EventTime"):
                raise SchemaChangedError(
                    f"the processor's {k} changed since the state was written: was "
                    f"{old.get(k)!r}, now {mine.get(k)!r}; use a new state URI")
        was = {v["name"]: VarSpec.from_json(v) for v in old.get("vars", [])}
        merged: list[VarSpec] = []
        for v in self.vars:
            o = was.pop(v.name, None)
            if o is None:
                merged.append(v)
                continue
            if o.kind != v.kind:
                raise SchemaChangedError(f"state variable {v.name!r} was a {o.kind} state, "
                                         f"now a {v.kind} state; use a new name or state URI")

            def grow(hist: tuple[str, ...], new: tuple[str, ...], what: str) -> tuple[str, ...]:
                if not new or json.loads(hist[-1]) == json.loads(new[-1]):
                    return hist
                StateCodec(what, [StructType.fromJson(json.loads(s)) for s in (*hist, new[-1])])
                return (*hist, new[-1])
            merged.append(VarSpec(v.name, v.kind, grow(o.schemas, v.schemas, v.name),
                                  grow(o.key_schemas, v.key_schemas, f"{v.name} (map key)"),
                                  v.ttl_ms))
        merged.extend(was.values())  # variables no longer declared keep their state
        self.vars = merged
        out = self.params()
        out["initial_state"] = old.get("initial_state", False)
        out["processor_class"] = old.get("processor_class", self.processor_class)
        self.initial_state = out["initial_state"]
        return out

    # -- one partition's batch (`sguard.spark.groupstate.KeyGroupedState`) --------------------
    def begin_partition_batch(self, batch_id: int, table: pa.Table,
                              kg_range: tuple[int, int]) -> None:
        from sguard.spark.ttl import batch_time_ms
        now = batch_time_ms(table)
        now = -1 if now is None else now
        st = _wm.stamped(table)
        wm, late = st if st is not None else (0, 0)
        ctx = self._ctx = _Ctx(self, batch_id, now, wm, late)
        self._initial = self._load_initial(kg_range) if batch_id == 0 and self.initial_state \
            else None
        if self.processor is not None:
            self.processor.init(ctx.handle)
        ctx.phase = "data"

    def end_partition_batch(self) -> None:
        ctx = self._ctx
        if ctx is not None:
            ctx.phase = "closed"
            ctx.store = None
            if self.processor is not None:
                self.processor.close()
        self._ctx = None
        self._initial = None

    def extra_key_groups(self) -> list[int]:
        return sorted(self._initial) if self._initial else []

    def _load_initial(self, kg_range: tuple[int, int]) -> dict[int, pa.Table]:
        import pyarrow.ipc as ipc

        from ioservice import open_root
        from sguard.spark.columns import KG_COLUMN
        if self.state_uri is None:
            return {}
        root = open_root(self.state_uri, **self.storage_options)
        if not root.exists(INITIAL_STATE_FILE):
            return {}
        t = ipc.open_file(pa.py_buffer(root.read_bytes(INITIAL_STATE_FILE))).read_all()
        kg = np.asarray(t.column(KG_COLUMN).to_numpy(zero_copy_only=False))
        t = t.drop_columns([KG_COLUMN])
        out = {}
        for g in np.unique(kg[(kg >= kg_range[0]) & (kg < kg_range[1])]).tolist():
            out[int(g)] = t.filter(pa.array(kg == g))
        return out

    def initial_rows(self, kg: int) -> pa.Table | None:
        return None if self._initial is None else self._initial.get(kg)


def _pyvals(table: pa.Table, names: list[str]) -> list[list[Any]]:
    return [table.column(n).to_pylist() for n in names]


def _sort_keys(table: pa.Table, extra: list[str]) -> list[tuple[str, str]]:
    """Sort keys over `extra` columns that Arrow can sort."""
    ok = []
    for n in extra:
        t = table.schema.field(n).type
        if not (pa.types.is_nested(t) or pa.types.is_dictionary(t)):
            ok.append((n, "ascending"))
    return ok


class _ProcessorGroup(OperatorState):
    """The processor over one key group's state."""

    def __init__(self, op: ProcessorOperator, ns: Any, schema: pa.Schema, key: Any) -> None:
        self.op, self.schema = op, schema
        self.keys = KeyIndex.open(ns, schema, key)
        self.key_names = [f.name for f in self.keys.fields]
        self.store = GroupStore(ns, op.vars, self.keys.dtype)
        self.out_schema = op.arrow_output_schema()
        self.kg = int(ns.prefix[2:7]) if hasattr(ns, "prefix") else -1

    # -- helpers ------------------------------------------------------------------------------
    def _groups(self, table: pa.Table) -> tuple[pa.Table, np.ndarray, list[int], list[int]]:
        """`table` sorted by (key order, columns); each key's id and row range."""
        ids = self.keys.ids(table)
        rank = self.keys.rank(ids)
        rest = [n for n in table.column_names if n not in self.key_names]
        t = table.append_column("__rank", pa.array(rank, pa.int64()))
        order = pc.sort_indices(t, sort_keys=[("__rank", "ascending"), *_sort_keys(t, rest)])
        t = table.take(order)
        ids = ids[order.to_numpy()]
        r = rank[order.to_numpy()]
        cuts = (np.flatnonzero(np.diff(r)) + 1).tolist()
        starts = [0, *cuts]
        return t, ids, starts, [*cuts, len(r)]

    def _key_tuples(self, t: pa.Table, rows: list[int]) -> list[tuple[Any, ...]]:
        if not rows:
            return []
        k = t.select(self.key_names).take(pa.array(rows, pa.int64()))
        cols = _pyvals(k, self.key_names)
        return list(zip(*cols))

    def _rows_iter(self, t: pa.Table, pdf: Any, rows: Any, s: int, e: int) -> Iterator[Any]:
        if self.op.flavour == "pandas":
            return iter([pdf(s, e)])
        return iter(rows[s:e])

    def _prepared(self, t: pa.Table) -> tuple[Any, Any]:
        """The rows in the flavour's form: a pandas DataFrame's `_frame_slicer`, or a list
        of Rows."""
        if self.op.flavour == "pandas":
            return _frame_slicer(_to_pandas(t)), None
        from pyspark.sql import Row
        names = list(t.column_names)
        new = tuple.__new__
        rows = []
        for x in zip(*_pyvals(t, names)):  # Row(*names)(*x) without its per-call checks
            r = new(Row, x)
            r.__fields__ = names
            rows.append(r)
        return None, rows

    # -- a batch ------------------------------------------------------------------------------
    def apply(self, table: pa.Table, batch_id: int) -> pa.Table:
        op = self.op
        ctx = op._ctx
        if ctx is None:  # a tool calling apply directly: one batch of its own
            op.begin_partition_batch(batch_id, table, (self.kg, self.kg + 1))
            try:
                return self.apply(table, batch_id)
            finally:
                op.end_partition_batch()
        store = self.store
        store.begin(ctx.now)
        if op.event_time is not None and table.num_rows:
            late = _wm.late_rows(table, op.event_time[0], ctx.late)
            if late.any():
                table = table.filter(pa.array(~late))
        outs: list[Any] = []
        t, ids, starts, ends = self._groups(table) if table.num_rows else (table, None, [], [])
        init_t = op.initial_rows(self.kg)
        init_groups: dict[int, tuple[int, int]] = {}
        init_keys: dict[int, tuple[Any, ...]] = {}
        if init_t is not None and init_t.num_rows:
            it, iids, ist, ien = self._groups(init_t)
            ipdf, irows = self._prepared(it)
            ktups = self._key_tuples(it, ist)
            for j, (s, e) in enumerate(zip(ist, ien)):
                init_groups[int(iids[s])] = (s, e)
                init_keys[int(iids[s])] = ktups[j]
        kids = [] if ids is None else ids[starts].tolist()
        ktups = self._key_tuples(t, starts)
        order: list[tuple[int, tuple[Any, ...], int, int]] = [
            (kid, kt, s, e) for kid, kt, s, e in zip(kids, ktups, starts, ends)]
        if init_groups:
            have = set(kids)
            extra = [k for k in init_groups if k not in have]
            order += [(k, init_keys[k], 0, 0) for k in extra]
            if extra:  # keys with initial state only, in key order among the rest
                allk = np.array([o[0] for o in order], self.keys.dtype)
                rk = self.keys.rank(allk)
                order = [order[i] for i in np.argsort(rk, kind="stable").tolist()]
        store.prefetch(np.array([o[0] for o in order], self.keys.dtype))
        pdf, rows = self._prepared(t) if table.num_rows else (None, None)
        proc = op.processor
        for kid, kt, s, e in order:
            ctx.store, ctx.kid = store, kid
            if kid in init_groups:
                a, b = init_groups[kid]
                if op.flavour == "pandas":
                    proc.handleInitialState(kt, ipdf(a, b), ctx.timer_values)
                else:
                    for r in irows[a:b]:
                        proc.handleInitialState(kt, r, ctx.timer_values)
            if e > s:
                res = proc.handleInputRows(kt, self._rows_iter(t, pdf, rows, s, e),
                                           ctx.timer_values)
                if res is not None:
                    outs.extend(res)
        # timers due now, in order of expiry
        tm = op.time_mode
        if tm != "None":
            threshold = ctx.now if tm == "ProcessingTime" else ctx.wm
            due = store.due_timers(threshold)
            if due:
                from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo
                dk = sorted({k for _, k in due})
                store.prefetch(np.array(dk, self.keys.dtype))  # one lookup per variable
                kt_of = dict(zip(dk, (tuple(x) for x in zip(*[
                    a.to_pylist() for a in self.keys.arrays(np.array(dk, self.keys.dtype))]))))
                for ts, kid in due:
                    if ts not in store.timer_list(kid):
                        continue  # deleted meanwhile
                    ctx.store, ctx.kid = store, kid
                    res = proc.handleExpiredTimer(kt_of[kid], ctx.timer_values,
                                                  ExpiredTimerInfo(ts))
                    if res is not None:
                        outs.extend(res)
                    tl = store.timer_list(kid)
                    if ts in tl:
                        tl.remove(ts)
                        store.timers_changed(kid)
        ctx.store = None
        for name in ctx.deleted:
            self._delete_var(name)
        store.write_back()
        return self._output(outs)

    def _delete_var(self, name: str) -> None:
        v = self.store.vars.get(name)
        if v is None or not len(v.map):
            return
        k, ent = v.map.items()
        self.store.heap.remove(ent["blob"])
        v.map.delete(k)

    def _output(self, outs: list[Any]) -> pa.Table:
        sch = self.out_schema
        if not outs:
            return sch.empty_table()
        try:
            if self.op.flavour == "pandas":
                import pandas as pd
                bad = [type(o).__name__ for o in outs if not isinstance(o, pd.DataFrame)]
                if bad:
                    raise ProcessorOutputError(f"handleInputRows/handleExpiredTimer must yield "
                                               f"pandas DataFrames, got {bad[0]}")
                df = _concat_frames(outs, sch.names) if len(outs) > 1 else outs[0]
                missing = [f.name for f in sch if f.name not in df.columns]
                if missing:
                    raise ProcessorOutputError(
                        f"the processor's output lacks column(s) {missing} of output_schema "
                        f"{sch.names} (got {list(df.columns)})")
                return pa.Table.from_pandas(df[sch.names], schema=sch, preserve_index=False)
            n = len(sch)
            names = sch.names
            if all(getattr(r, "__fields__", None) == names for r in outs):  # Rows in order
                return pa.Table.from_arrays([pa.array(list(c), f.type)
                                             for c, f in zip(zip(*outs), sch)], schema=sch)
            cols: list[list[Any]] = [[] for _ in sch]
            for r in outs:
                if isinstance(r, dict):
                    r = tuple(r.get(f.name) for f in sch)
                elif hasattr(r, "asDict") and getattr(r, "__fields__", None):
                    d = r.asDict()
                    r = tuple(d.get(f.name) for f in sch)
                if not isinstance(r, (tuple, list)) or len(r) != n:
                    raise ProcessorOutputError(
                        f"each output row must have the {n} fields of output_schema "
                        f"{sch.names}, got {r!r}")
                for i, x in enumerate(r):
                    cols[i].append(x)
            return pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(cols, sch)],
                                        schema=sch)
        except ProcessorOutputError:
            raise
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, KeyError) as exc:
            raise ProcessorOutputError(f"the processor's output does not fit output_schema "
                                       f"{sch}: {exc}") from exc

    # -- reading back ---------------------------------------------------------------------------
    def dump(self) -> pa.Table:
        """Every variable of every key, one row per value (list elements, map entries),
        with the value as JSON text (`dump_var` gives typed columns)."""
        parts = [self.dump_var(v.name) for v in self.op.vars]
        rows = []
        for v, t in zip(self.op.vars, parts):
            if t.num_rows:
                kt = t.select(self.key_names)
                vals = t.drop_columns(self.key_names + ["expiration_timestamp_ms"]
                                      if "expiration_timestamp_ms" in t.column_names
                                      else self.key_names)
                js = [json.dumps(r, default=str, sort_keys=True) for r in vals.to_pylist()]
                rows.append(kt.append_column("state_var", pa.array([v.name] * t.num_rows))
                            .append_column("value", pa.array(js, pa.string())))
        if not rows:
            return pa.schema([*self.keys.fields, pa.field("state_var", pa.string()),
                              pa.field("value", pa.string())]).empty_table()
        return pa.concat_tables(rows)

    def dump_var(self, name: str) -> pa.Table:
        """Variable `name` of every key: the key columns, then ``value`` (value state), one
        row per element ``value`` (list), or ``user_map_key``, ``user_map_value`` (map), and
        ``expiration_timestamp_ms`` when it has a TTL; in key order."""
        v = self.store.vars.get(name)
        if v is None:
            raise KeyError(f"no state variable {name!r}; this processor has "
                           f"{[x.name for x in self.op.vars]}")
        store = self.store
        kids: list[int] = []
        vals: list[Any] = []
        keys_: list[Any] = []
        exps: list[int] = []
        for kid, obj in store.dump_var(name):
            if v.spec.kind == "value":
                kids.append(kid)
                vals.append(obj[1])
                exps.append(obj[0])
            elif v.spec.kind == "list":
                for e, x in obj:
                    kids.append(kid)
                    vals.append(x)
                    exps.append(e)
            else:
                for e, k, x in obj.values():
                    kids.append(kid)
                    keys_.append(k)
                    vals.append(x)
                    exps.append(e)
        idx = np.array(kids, self.keys.dtype)
        order = self.keys.order(idx) if len(idx) else np.zeros(0, np.int64)
        o = order.tolist()
        arrays = self.keys.arrays(idx[order]) if len(idx) else [pa.array([], f.type)
                                                                for f in self.keys.fields]
        t = pa.Table.from_arrays(arrays, schema=pa.schema(self.keys.fields))
        vt = v.codec.to_arrow([vals[i] for i in o])
        t = t.append_column(pa.field("user_map_value" if v.spec.kind == "map" else "value",
                                     pa.struct(vt.schema)),
                            _struct_array(vt))
        if v.spec.kind == "map":
            kt = v.key_codec.to_arrow([keys_[i] for i in o])
            t = t.add_column(len(self.keys.fields), pa.field("user_map_key", pa.struct(kt.schema)),
                             _struct_array(kt))
        if v.spec.ttl_ms is not None:
            t = t.append_column("expiration_timestamp_ms",
                                pa.array([exps[i] for i in o], pa.int64()))
        return t

    def dump_timers(self) -> pa.Table:
        kids, ts = [], []
        for kid, t in self.store.dump_timers():
            for x in t:
                kids.append(kid)
                ts.append(x)
        idx = np.array(kids, self.keys.dtype)
        order = self.keys.order(idx) if len(idx) else np.zeros(0, np.int64)
        arrays = self.keys.arrays(idx[order]) if len(idx) else [pa.array([], f.type)
                                                                for f in self.keys.fields]
        t = pa.Table.from_arrays(arrays, schema=pa.schema(self.keys.fields))
        return t.append_column("expiration_timestamp_ms",
                               pa.array([ts[i] for i in order.tolist()], pa.int64()))

    def n_keys(self) -> int:
        return self.store.n_keys()


def _struct_array(t: pa.Table) -> pa.Array:
    """The columns of `t` as one struct array."""
    return pa.StructArray.from_arrays([c.combine_chunks() for c in t.columns],
                                      fields=list(t.schema))


def _frame_slicer(pdf: Any) -> Callable[[int, int], Any]:
    """``(s, e) ->`` rows ``s:e`` of `pdf` as a DataFrame of their own, indexed
    ``0..e-s-1`` as Spark hands each key's rows: a view of `pdf`'s column blocks.
    pandas' own slicing (``iloc`` then a new index) costs about twice as much per call,
    and a processor call per key is what the pandas flavour is made of; it is the
    fallback."""
    import pandas as pd
    mgr = getattr(pdf, "_mgr", None)
    from_mgr = getattr(pd.DataFrame, "_from_mgr", None)
    ri = pd.RangeIndex
    if mgr is not None and from_mgr is not None and hasattr(mgr, "get_slice"):
        get_slice = mgr.get_slice

        def fast(s: int, e: int) -> Any:
            m = get_slice(slice(s, e), axis=1)
            m.set_axis(1, ri(e - s))
            return from_mgr(m, m.axes)
        return fast

    def slow(s: int, e: int) -> Any:
        part = pdf.iloc[s:e]
        part.index = ri(e - s)
        return part
    return slow


def _concat_frames(outs: list[Any], names: list[str]) -> Any:
    """The processor's output frames as one DataFrame of the columns `names`: each
    column's numpy arrays concatenated once (a ``pd.concat`` of thousands of one-row
    frames costs about 3x as much). Frames whose columns are not `names` in order, or
    whose column dtypes differ between frames or are not numpy's, go through
    ``pd.concat`` (its type promotion is then the one that applies)."""
    import pandas as pd
    cols: list[list[Any]] = [[] for _ in names]
    try:
        for o in outs:
            if o.columns.tolist() != names:
                raise LookupError
            for acc, a in zip(cols, o._iter_column_arrays()):
                if not isinstance(a, np.ndarray) or (acc and acc[0].dtype != a.dtype):
                    raise LookupError
                acc.append(a)
    except (LookupError, AttributeError):
        return pd.concat(outs, ignore_index=True)
    return pd.DataFrame({n: np.concatenate(acc) for n, acc in zip(names, cols)}, copy=False)


def _to_pandas(t: pa.Table) -> Any:
    """Arrow -> pandas as Spark hands rows to a pandas processor (timestamps naive)."""
    df = t.to_pandas(timestamp_as_object=False)
    for f in t.schema:
        if pa.types.is_timestamp(f.type) and f.type.tz is not None:
            df[f.name] = df[f.name].dt.tz_convert(None)
    return df


# --------------------------------------------------------------------------- the entry points
def _flavour_check(processor: Any) -> None:
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor
    if not isinstance(processor, StatefulProcessor):
        raise TypeError(f"processor must be a pyspark.sql.streaming.StatefulProcessor (or an "
                        f"sguard.spark.VectorizedProcessor), got {type(processor).__name__}")


def _initial_table(initial_state: Any, key_cols: list[str]) -> Any:
    """The initial state as a batch DataFrame (a GroupedData is accepted, as in Spark)."""
    from pyspark.sql import DataFrame, GroupedData
    if isinstance(initial_state, GroupedData):
        return initial_state._df
    if isinstance(initial_state, DataFrame):
        if initial_state.isStreaming:
            raise TypeError("initial_state must be a batch DataFrame (spark.read...), not a "
                            "streaming one")
        return initial_state
    raise TypeError(f"initial_state must be a DataFrame or df.groupBy(...), got "
                    f"{type(initial_state).__name__}")


def _transform(df: Any, key: Any, processor: Any, output_schema: Any, output_mode: str,
               time_mode: str, state_uri: str, num_partitions: int | None, flavour: str,
               initial_state: Any, event_time_column: str | None, kw: dict[str, Any]) -> Any:
    from pyspark.sql.pandas.types import to_arrow_schema

    from ioservice import open_root
    from sguard.spark.api import stateful
    from sguard.spark.errors import NotStreamingError
    from sguard.spark.keys import key_columns
    from sguard.statelayout import read_layout

    if not getattr(df, "isStreaming", False):
        raise NotStreamingError("transform_with_state needs a streaming DataFrame "
                                "(spark.readStream...); this one is a batch DataFrame")
    vectorized = isinstance(processor, VectorizedProcessor)
    if not vectorized:
        _flavour_check(processor)
    tm = _TIME_MODES.get(str(time_mode).lower()) if isinstance(time_mode, str) else None
    if tm is None:
        raise ValueError(f"time_mode must be one of 'None', 'ProcessingTime', 'EventTime', "
                         f"got {time_mode!r}")
    om = _OUTPUT_MODES.get(str(output_mode).lower()) if isinstance(output_mode, str) else None
    if om not in ("Append", "Update"):
        raise ValueError(f"output_mode must be 'Append' or 'Update' (as Spark allows for "
                         f"transformWithState), got {output_mode!r}")
    spark = df.sparkSession
    out_st = parse_struct(spark, output_schema, "output_schema")
    to_arrow_schema(out_st, timezone="UTC")
    cols = key_columns(key)
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise SchemaChangedError(f"key column(s) {missing} are not in the stream's columns "
                                 f"{df.columns}")
    wm = _wm.input_watermark(df)
    if tm == "EventTime" and wm is None:
        raise ValueError("time_mode 'EventTime' needs an event-time watermark on the input: "
                         "df.withWatermark('<time column>', '<delay>')")
    if event_time_column is not None and event_time_column not in out_st.fieldNames():
        raise ValueError(f"event_time_column {event_time_column!r} is not a column of "
                         f"output_schema {out_st.fieldNames()}")
    if vectorized:
        if initial_state is not None:
            raise ValueError("initial_state is not supported by the vectorized form")
        return stateful(df, cols if not isinstance(key, str) else key,
                        vectorized_operator(spark, processor, out_st, tm, om), state_uri,
                        num_partitions, **kw)
    # init() on the driver, as Spark does: the declared variables and their schemas
    # (on a copy, as Spark runs it in a worker of its own: what init stores on the processor,
    # such as the handle, must not travel to the executors with it)
    rec = _Handle(None, spark, tm)
    probe = copy.deepcopy(processor)
    probe.init(rec)
    probe.close()
    init_df = None if initial_state is None else _initial_table(initial_state, cols)
    opts = dict(kw.get("storage_options") or {})
    op = ProcessorOperator(
        [v.to_json() for v in rec.declared.values()], out_st.json(), tm, om, flavour,
        None if wm is None else list(wm), init_df is not None,
        f"{type(processor).__module__}.{type(processor).__qualname__}",
        processor=processor, state_uri=state_uri, storage_options=opts)
    root = open_root(state_uri, **opts)
    fresh = read_layout(root) is None
    out = stateful(df, cols if not isinstance(key, str) else key, op, state_uri, num_partitions,
                   **kw)
    if init_df is not None and fresh:
        _write_initial(root, init_df, cols, state_uri)
    if event_time_column is not None and om == "Append":
        out = out.withWatermark(event_time_column, "0 seconds")
    return out


def _write_initial(root: Any, init_df: Any, cols: list[str], state_uri: str) -> None:
    """Write the initial state with each row's key group (applied in the first batch)."""
    import pyarrow.ipc as ipc

    from sguard.keygroups import key_group_of
    from sguard.spark.columns import KG_COLUMN
    from sguard.statelayout import read_layout
    lay = read_layout(root)
    assert lay is not None
    t = init_df.toArrow()
    missing = [c for c in cols if c not in t.column_names]
    if missing:
        raise SchemaChangedError(f"initial_state lacks the key column(s) {missing}")
    kg = key_group_of(t.select(cols), lay.key_groups)
    t = t.append_column(pa.field(KG_COLUMN, pa.int32(), nullable=False), pa.array(kg, pa.int32()))
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    root.write_atomic(INITIAL_STATE_FILE, sink.getvalue().to_pybytes())


def transform_with_state(df: Any, key: str | list[str], processor: Any, output_schema: Any,
                         output_mode: str, time_mode: str, state_uri: str,
                         num_partitions: int | None = None, *, initial_state: Any = None,
                         event_time_column: str | None = None, **kwargs: Any) -> Any:
    """Run a PySpark ``StatefulProcessor`` (Row flavour, as ``transformWithState``) per `key`
    on sguard state.

    Parameters are those of ``df.groupBy(key).transformWithState(processor,
    output_schema, output_mode, time_mode, initial_state, event_time_column)``, plus
    `state_uri` and `num_partitions` (and the other keyword arguments of
    `sguard.spark.stateful`: ``checkpoint=``, ``local_dir=``, ``key_groups=`` ...).
    ``handleInputRows`` gets an iterator of ``Row`` and yields ``Row`` (or tuples).

    Raises
    ------
    TypeError
        `processor` is not a ``StatefulProcessor``; a schema is neither a StructType
        nor DDL.
    ValueError
        An unknown output or time mode; ``"EventTime"`` without a watermark.
    sguard.spark.statecodec.UnsupportedStateTypeError
        A state variable's schema has a type sguard does not store (named).
    SchemaChangedError
        The state URI holds state that cannot evolve into the declared variables.
    """
    return _transform(df, key, processor, output_schema, output_mode, time_mode, state_uri,
                      num_partitions, "row", initial_state, event_time_column, kwargs)


def transform_with_state_in_pandas(df: Any, key: str | list[str], processor: Any,
                                   output_schema: Any, output_mode: str, time_mode: str,
                                   state_uri: str, num_partitions: int | None = None, *,
                                   initial_state: Any = None,
                                   event_time_column: str | None = None,
                                   **kwargs: Any) -> Any:
    """`transform_with_state` in the pandas flavour (as ``transformWithStateInPandas``):
    ``handleInputRows`` gets an iterator of pandas DataFrames and yields DataFrames;
    ``handleInitialState`` gets one DataFrame per key."""
    return _transform(df, key, processor, output_schema, output_mode, time_mode, state_uri,
                      num_partitions, "pandas", initial_state, event_time_column, kwargs)

