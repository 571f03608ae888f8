"""Record schemas: numpy dtypes with fixed size and no object fields.

A schema is stored inside pages (super pages) as the text of
``numpy.lib.format.dtype_to_descr`` and read back with ``ast.literal_eval``;
nothing is pickled.
"""
from __future__ import annotations

import ast
from typing import Any

import numpy as np
import numpy.typing as npt

from mmm.errors import RecordTypeError, SchemaError

__all__ = ["as_schema", "dtype_to_text", "dtype_from_text", "coerce_records"]


def _check_fields(dt: np.dtype[Any], where: str) -> None:
    if dt.hasobject:
        raise SchemaError(f"{where}: object fields are not allowed in a page schema (dtype {dt})")
    if dt.fields is not None:
        for name, (sub, *_rest) in dt.fields.items():
            _check_fields(sub, f"{where}.{name}")
    elif dt.subdtype is not None:
        _check_fields(dt.subdtype[0], where)
    elif dt.kind == "U":
        raise SchemaError(f"{where}: unicode dtype {dt} is not allowed; use fixed bytes ('S')")
    elif dt.kind == "O":
        raise SchemaError(f"{where}: object dtype {dt} is not allowed")
    if dt.itemsize == 0:
        raise SchemaError(f"{where}: dtype {dt} has size 0")


def as_schema(spec: npt.DTypeLike, what: str = "schema") -> np.dtype[Any]:
    """Return ``spec`` as a numpy dtype that pages can hold.

    Raises
    ------
    SchemaError
        If the dtype has object or unicode fields, or is not a numpy dtype.
    """
    try:
        dt = np.dtype(spec)
    except TypeError as exc:
        raise SchemaError(f"{what}: {spec!r} is not a numpy dtype ({exc})") from None
    _check_fields(dt, what)
    if dt.kind == "U":
        raise SchemaError(f"{what}: unicode dtype {dt} is not allowed; use fixed bytes ('S')")
    return dt


def dtype_to_text(dt: np.dtype[Any]) -> str:
    """Text form of a dtype that `dtype_from_text` reads back (no pickle)."""
    return repr(np.lib.format.dtype_to_descr(dt))


def dtype_from_text(text: str) -> np.dtype[Any]:
    """Inverse of `dtype_to_text`."""
    return np.lib.format.descr_to_dtype(ast.literal_eval(text))


def coerce_records(values: Any, dt: np.dtype[Any], what: str, n: int | None = None) -> np.ndarray:
    """Return ``values`` as a 1-D array of ``dt`` (copy only if needed).

    Structured schemas accept an array of the same dtype (or one with the same
    field names), or a sequence of tuples. Scalar schemas accept anything that
    numpy casts safely ("same_kind"). ``n`` checks the length.

    Raises
    ------
    RecordTypeError
        If the values have the wrong dtype, shape or length.
    """
    if dt.fields is not None:
        if isinstance(values, np.ndarray) and values.dtype.fields is not None:
            if values.dtype != dt:
                if set(values.dtype.names or ()) != set(dt.names or ()):
                    raise RecordTypeError(
                        f"{what}: fields {values.dtype.names} do not match schema fields {dt.names}")
                out = np.empty(values.shape, dt)
                for name in dt.names or ():
                    out[name] = values[name]
                values = out
            arr = values
        elif isinstance(values, tuple) and n is None:
            arr = _tuple_records([values], dt, what)
        else:
            arr = _tuple_records(values, dt, what)
    else:
        try:
            arr = np.asarray(values)
            if arr.size == 0 and arr.dtype.kind == "f" and not isinstance(values, np.ndarray):
                arr = arr.astype(dt)  # an empty list has no dtype of its own
        except (TypeError, ValueError, OverflowError) as exc:
            raise RecordTypeError(f"{what}: cannot convert to {dt}: {exc}") from None
        if arr.dtype != dt:
            if (dt.kind == "S") != (arr.dtype.kind == "S"):
                # numpy's same_kind casts numbers to text (1.5 -> b"1.5"): never silently
                raise RecordTypeError(f"{what}: dtype {arr.dtype} cannot be stored as {dt}")
            if arr.dtype.kind in "OUV" or not np.can_cast(arr.dtype, dt, casting="same_kind"):
                if not (arr.dtype.kind in "iu" and dt.kind in "iuf"):
                    raise RecordTypeError(f"{what}: dtype {arr.dtype} cannot be stored as {dt}")
            if arr.dtype.kind in "iu" and dt.kind in "iu" and arr.size:
                info = np.iinfo(dt)
                lo, hi = arr.min(), arr.max()
                if lo < info.min or hi > info.max:
                    raise RecordTypeError(
                        f"{what}: values in [{lo}, {hi}] do not fit {dt}")
            arr = arr.astype(dt)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise RecordTypeError(f"{what}: expected a 1-D array of {dt}, got shape {arr.shape}")
    if n is not None and len(arr) != n:
        raise RecordTypeError(f"{what}: expected {n} records, got {len(arr)}")
    result: np.ndarray = arr
    return result


def _tuple_records(values: Any, dt: np.dtype[Any], what: str) -> np.ndarray:
    try:
        return np.array([tuple(v) if not isinstance(v, tuple) else v for v in values], dtype=dt)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RecordTypeError(f"{what}: cannot convert to records of {dt}: {exc}") from None
