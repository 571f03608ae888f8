"""Input columns as the operators and state TTL read them: a column as numpy, a time
column's unit, a duration in that unit; and the name of the key-group column the
runtime adds (`KG_COLUMN`)."""
from __future__ import annotations

import datetime as _dt
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from sguard.spark.errors import SchemaChangedError, UnsupportedKeyTypeError

__all__ = ["KG_COLUMN", "column_numpy", "time_unit", "duration_units"]

KG_COLUMN: Final = "_sguard_kg"
"""The int32 column with each row's key group, added on the JVM side before the shuffle
(`sguard.spark.keygroups`) and kept in the input log (`sguard.spark.groupstate`)."""


def column_numpy(table: pa.Table, name: str) -> npt.NDArray[Any]:
    """A column as a numpy array (timestamps as int64 in their unit); nulls are refused."""
    col = table.column(name)
    if col.null_count:
        raise ValueError(f"column {name!r} has {col.null_count} null value(s) in this batch; "
                         f"filter or fill them before the stateful operator")
    t = col.type
    if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_duration(t):
        col = col.cast(pa.int64()) if not pa.types.is_date32(t) else col.cast(pa.int32())
    arr = col.to_numpy() if col.num_chunks != 1 else col.chunk(0).to_numpy(zero_copy_only=False)
    return np.asarray(arr)


def time_unit(schema: pa.Schema, name: str) -> tuple[pa.DataType, int]:
    """The time column's Arrow type and how many of its integer units make a second."""
    if name not in schema.names:
        raise SchemaChangedError(f"time column {name!r} is not in the stream's columns "
                                 f"{schema.names}")
    t = schema.field(name).type
    if pa.types.is_timestamp(t):
        return t, {"s": 1, "ms": 1000, "us": 1_000_000, "ns": 1_000_000_000}[t.unit]
    if pa.types.is_integer(t):
        return t, 1
    raise UnsupportedKeyTypeError(f"time column {name!r} has type {t}; a timestamp or "
                                  f"integer column is needed")


def duration_units(d: float | int | _dt.timedelta, per_s: int, what: str) -> int:
    """Duration `d` (seconds, or a timedelta) in units of which `per_s` make a second."""
    if isinstance(d, _dt.timedelta):
        v = int(round(d.total_seconds() * per_s))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        v = int(round(float(d) * per_s)) if per_s != 1 else int(d)
    else:
        raise TypeError(f"{what} must be a number or a timedelta, got {d!r}")
    return v
