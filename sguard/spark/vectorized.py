"""A vectorized processor: every key of a batch at once, with columnar state.

The compatible form (`sguard.spark.processors`) calls Python once per key, as Spark
does. For hot paths sguard also takes a processor that sees a whole batch of a key
group at once and reads and writes its state as arrays::

    class RunningCount(ss.VectorizedProcessor):
        def init(self, handle):
            self.count = handle.getValueState("count", "count long")

        def handleInputBatch(self, keys, rows, key_index, timerValues):
            exists, cur = self.count.get()              # one entry per row of `keys`
            n = np.bincount(key_index, minlength=keys.num_rows)
            total = np.where(exists, cur["count"], 0) + n
            self.count.update({"count": total})
            return keys.append_column("count", pa.array(total))

    out = ss.transform_with_state(df, "k", RunningCount(), "k long, count long",
                                  "Update", "None", state_uri)

``keys`` is a table of the batch's distinct keys (their columns, in key order);
``rows`` the batch's rows; ``key_index[i]`` the position in ``keys`` of row ``i``'s key.
A value state's schema takes fixed-width Spark types (numbers, booleans, dates,
timestamps: a date as int32 days, a timestamp as int64 µs); ``get()`` gives
``(exists, values)`` for the batch's keys, ``update(values, where=None)`` and
``clear(where=None)`` write them (``where``: a boolean mask over ``keys``). A TTL
(``ttlDurationMs``) works as in the compatible form: an expired value reads as absent.
The state lives in one `mmm.HashMap` per variable and key group, so everything else
(checkpoints, exactly-once recovery, rescaling) holds as for any operator.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from mmm import HashMap
from sguard.spark.errors import SchemaChangedError, SparkStateError
from sguard.spark.keys import KeyIndex
from sguard.spark.operators import OperatorState, register_operator
from sguard.spark.processor_state import NEVER, ProcessorPhaseError
from sguard.spark.hosting import HostedOperator, ProcessorOutputError, parse_struct

__all__ = ["VectorizedProcessor", "VectorizedOperator", "ColumnarValueState"]

_NUMPY = {"long": "<i8", "integer": "<i4", "short": "<i2", "byte": "i1", "double": "<f8",
          "float": "<f4", "boolean": "?", "date": "<i4", "timestamp": "<i8",
          "timestamp_ntz": "<i8"}


class VectorizedProcessor:
    """Base class of a vectorized processor (module docstring)."""

    def init(self, handle: Any) -> None:
        """Declare the state variables (``handle.getValueState(name, schema, ttlDurationMs)``)."""

    def handleInputBatch(self, keys: pa.Table, rows: pa.Table,
                         key_index: npt.NDArray[np.int64], timerValues: Any) -> pa.Table | None:
        """Process one key group's rows of a batch; return the output rows (or None)."""
        raise NotImplementedError

    def close(self) -> None:
        """Called after each batch of a partition."""


def _fields(st: Any, var: str) -> list[tuple[str, str]]:
    out = []
    for f in st.fields:
        t = f.dataType.typeName()
        if t not in _NUMPY:
            raise SparkStateError(f"vectorized state variable {var!r}, field {f.name!r}: type "
                                  f"{f.dataType.simpleString()} is not fixed-width; the "
                                  f"vectorized form stores numbers, booleans, dates and "
                                  f"timestamps (use the compatible form for others)")
        out.append((f.name, _NUMPY[t]))
    return out


class _VHandle:
    def __init__(self, op: "VectorizedOperator", group: "_VGroup | None", spark: Any = None,
                 time_mode: str = "None") -> None:
        self.op, self.group, self.spark, self.time_mode = op, group, spark, time_mode
        self.declared: dict[str, dict[str, Any]] = {}

    def getValueState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None
                      ) -> Any:
        if self.group is None:  # on the driver
            if ttlDurationMs is not None and self.time_mode != "ProcessingTime":
                raise ValueError(f"state variable {stateName!r}: a TTL needs time mode "
                                 f"'ProcessingTime' (as in Spark); this query runs with "
                                 f"{self.time_mode!r}")
            st = parse_struct(self.spark, schema, f"state variable {stateName!r} schema")
            self.declared[stateName] = {"name": stateName, "fields": _fields(st, stateName),
                                        "ttl_ms": ttlDurationMs}
            return None
        spec = next((v for v in self.op.vars if v["name"] == stateName), None)
        if spec is None:
            raise ProcessorPhaseError(f"state variable {stateName!r} was not declared when the "
                                      f"query started")
        return self.group.value(spec)


class ColumnarValueState:
    """A value state read and written as arrays over the batch's keys."""

    def __init__(self, group: "_VGroup", spec: dict[str, Any]) -> None:
        self.g, self.spec = group, spec
        fields = [(n, d) for n, d in spec["fields"]]
        self.dtype = np.dtype(fields + [("__expiry", "<i8")])
        self.map = HashMap.create(group.ns, f"vec.{spec['name']}", group.keys.dtype, self.dtype)
        self.names = [n for n, _ in fields]

    def get(self) -> tuple[npt.NDArray[np.bool_], npt.NDArray[Any]]:
        """``(exists, values)``: one entry per key of the batch (values of absent keys 0)."""
        found, v = self.map.get(self.g.ids)
        if self.spec.get("ttl_ms"):
            found &= v["__expiry"] > self.g.now
        return found, v[self.names]

    def update(self, values: Any, where: npt.NDArray[np.bool_] | None = None) -> None:
        n = len(self.g.ids)
        rec = np.zeros(n, self.dtype)
        for name in self.names:
            col = values[name] if not isinstance(values, np.ndarray) or values.dtype.names \
                else values
            rec[name] = np.asarray(col)
        ttl = self.spec.get("ttl_ms")
        rec["__expiry"] = NEVER if not ttl else self.g.now + int(ttl)
        ids = self.g.ids
        if where is not None:
            where = np.asarray(where, bool)
            ids, rec = ids[where], rec[where]
        self.map.put(ids, rec)

    def clear(self, where: npt.NDArray[np.bool_] | None = None) -> None:
        ids = self.g.ids if where is None else self.g.ids[np.asarray(where, bool)]
        self.map.delete(ids)


class _VGroup(OperatorState):
    def __init__(self, op: "VectorizedOperator", ns: Any, schema: pa.Schema, key: Any) -> None:
        self.op, self.ns = op, ns
        self.keys = KeyIndex.open(ns, schema, key)
        self.key_names = [f.name for f in self.keys.fields]
        self.ids = np.zeros(0, self.keys.dtype)
        self.now = -1
        self._vars: dict[str, ColumnarValueState] = {}
        self.out_schema = op.arrow_output_schema()

    def value(self, spec: dict[str, Any]) -> ColumnarValueState:
        v = self._vars.get(spec["name"])
        if v is None:
            v = self._vars[spec["name"]] = ColumnarValueState(self, spec)
        return v

    def apply(self, table: pa.Table, batch_id: int) -> pa.Table:
        from pyspark.sql.streaming.stateful_processor import TimerValues

        from sguard.spark.ttl import batch_time_ms
        if table.num_rows == 0:
            return self.out_schema.empty_table()
        now = batch_time_ms(table)
        self.now = -1 if now is None else now
        ids = self.keys.ids(table)
        uk, first, inv = np.unique(ids, return_index=True, return_inverse=True)
        order = self.keys.order(uk)
        rank = np.empty(len(uk), np.int64)
        rank[order] = np.arange(len(uk))
        self.ids = uk[order]
        keys = table.select(self.key_names).take(pa.array(first[order]))
        proc = self.op.processor
        proc.init(_VHandle(self.op, self))
        try:
            out = proc.handleInputBatch(keys, table, rank[inv.reshape(-1)],
                                        TimerValues(self.now if self.op.time_mode != "None"
                                                    else -1, -1))
        finally:
            proc.close()
        if out is None:
            return self.out_schema.empty_table()
        if isinstance(out, pa.RecordBatch):
            out = pa.Table.from_batches([out])
        try:
            return out.select(self.out_schema.names).cast(self.out_schema)
        except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ProcessorOutputError(f"the vectorized processor's output {out.schema} does "
                                       f"not fit output_schema {self.out_schema}: {exc}"
                                       ) from exc

    def dump(self) -> pa.Table:
        parts = []
        for spec in self.op.vars:
            v = self.value(spec)
            k, vals = v.map.items()
            if not len(k):
                continue
            o = self.keys.order(k)
            t = pa.Table.from_arrays(self.keys.arrays(k[o]), schema=pa.schema(self.keys.fields))
            t = t.append_column("state_var", pa.array([spec["name"]] * len(k)))
            rows = [json.dumps(dict(zip(v.names, r))) for r in vals[v.names][o].tolist()]
            parts.append(t.append_column("value", pa.array(rows, pa.string())))
        if not parts:
            return pa.schema([*self.keys.fields, pa.field("state_var", pa.string()),
                              pa.field("value", pa.string())]).empty_table()
        return pa.concat_tables(parts)

    def n_keys(self) -> int:
        return max([len(self.value(s).map) for s in self.op.vars] + [0])


@register_operator
class VectorizedOperator(HostedOperator):
    """The sguard operator that hosts a `VectorizedProcessor`."""

    kind = "vectorized_processor"

    def __init__(self, vars: list[dict[str, Any]], output_schema: str, time_mode: str,
                 output_mode: str, processor_class: str = "", *, processor: Any = None) -> None:
        self.vars = [dict(v, fields=[tuple(f) for f in v["fields"]]) for v in vars]
        self.output_schema_json = output_schema
        self.time_mode, self.output_mode = time_mode, output_mode
        self.processor_class = processor_class
        self.processor = processor
        self.ttl = None

    def params(self) -> dict[str, Any]:
        return {"vars": [dict(v, fields=[list(f) for f in v["fields"]]) for v in self.vars],
                "output_schema": self.output_schema_json, "time_mode": self.time_mode,
                "output_mode": self.output_mode, "processor_class": self.processor_class}

    @property
    def visits_every_key_group(self) -> bool:
        return False  # TTL is checked on read; nothing runs for a key group without rows

    def check_input(self, schema: pa.Schema, key: Any) -> None:
        from sguard.spark.keys import key_spec
        key_spec(schema, key)

    def open(self, pm: Any, schema: pa.Schema, key: Any) -> OperatorState:
        return _VGroup(self, pm, schema, key)


def vectorized_operator(spark: Any, processor: VectorizedProcessor, out_st: Any, tm: str,
                        om: str) -> VectorizedOperator:
    """The operator for `processor`: its ``init`` runs once on the driver to declare the
    variables (their schemas checked here)."""
    if tm == "EventTime":
        raise SchemaChangedError("the vectorized form has no event-time timers; use time mode "
                                 "'None' or 'ProcessingTime'")
    import copy
    h = _VHandle(None, None, spark, tm)  # type: ignore[arg-type]
    probe = copy.deepcopy(processor)  # what init stores must not travel to the executors
    probe.init(h)
    probe.close()
    return VectorizedOperator(list(h.declared.values()), out_st.json(), tm, om,
                              f"{type(processor).__module__}.{type(processor).__qualname__}",
                              processor=processor)
