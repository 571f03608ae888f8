"""Aggregation upserts: per-field combine specs shared by the map structures.

A combine spec maps value fields to an operation and the input column it reads::

    {"n": "count", "first_ts": ("min", "ts"), "last_ts": ("max", "ts"), "total": ("sum", "x")}

Operations: ``count`` (adds one per input record; reads no column), ``sum``,
``min``, ``max``, ``last`` (the value of the last input record wins) and
``first`` (set on insert, never changed). ``op`` alone reads the input column of
the same name as the field. Value fields the spec does not mention are zero
when a key is inserted and unchanged when it is updated.

Semantics, exactly (the HashMap kernels apply the rows one by one in input
order; the oracle tests check every op and mix of them):

* An input column is first converted to its field's dtype. Integer inputs must
  fit the field (any integer dtype is accepted if its values do; otherwise
  `RecordTypeError`); other casts must be numpy ``same_kind`` (no float into an
  integer field); bytes longer than an ``S<n>`` field are refused.
* ``count`` and ``sum`` wrap around at the field's width for integer fields
  (numpy arithmetic, no overflow error) and round to the field's precision for
  float fields (a ``float32`` sum is a sum of ``float32`` values).
* ``min`` and ``max`` follow ``np.minimum`` / ``np.maximum``: a NaN input makes
  the field NaN and it stays NaN; ``-inf``/``inf`` are ordinary values. Bytes
  fields compare lexicographically (as numpy compares ``S`` values);
  datetimes compare by their int64 ticks. ``sum``/``count`` need a numeric
  field; ``min``/``max`` a numeric, bool, datetime or bytes field; ``first``/
  ``last`` take any field.

`compile_spec` and `input_columns` validate; `preaggregate`,
`preaggregate_sorted` and `merge_into` are the vectorized numpy combine the
`OrderedMap` uses (the `HashMap` combines inside its compiled kernel).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from mmm.errors import RecordTypeError

__all__ = ["CombineOp", "compile_spec", "input_columns", "preaggregate", "merge_into", "OPS"]

OPS = ("count", "sum", "min", "max", "last", "first")


@dataclass(frozen=True, slots=True)
class CombineOp:
    """One compiled ``field <- op(input)`` of a combine spec."""

    field: str
    op: str
    input: str | None
    """Input column name (None for ``count``)."""


def compile_spec(value_dtype: np.dtype[Any], combine: Mapping[str, Any], where: str
                 ) -> tuple[CombineOp, ...]:
    """Validate a combine spec against a structured value dtype.

    Raises
    ------
    RecordTypeError
        If the value dtype is not structured, a field is unknown, an op is not
        one of `OPS`, or ``count`` targets a non-numeric field.
    """
    if value_dtype.names is None:
        raise RecordTypeError(f"{where}: upsert needs a structured value dtype with named "
                              f"fields, not {value_dtype}")
    if not isinstance(combine, Mapping) or not combine:
        raise RecordTypeError(f"{where}: combine must be a non-empty dict field -> op, "
                              f"got {combine!r}")
    out = []
    for field, spec in combine.items():
        if field not in value_dtype.names:
            raise RecordTypeError(f"{where}: combine names field {field!r}, not in value "
                                  f"fields {value_dtype.names}")
        if isinstance(spec, str):
            op, src = spec, field
        elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str):
            op, src = spec
        else:
            raise RecordTypeError(f"{where}: combine[{field!r}] = {spec!r}: expected an op name "
                                  f"or (op, input_field)")
        if op not in OPS:
            raise RecordTypeError(f"{where}: combine[{field!r}]: unknown op {op!r}; "
                                  f"expected one of {OPS}")
        fields = value_dtype.fields
        assert fields is not None
        kind = fields[field][0].kind
        if op in ("count", "sum") and kind not in "iuf":
            raise RecordTypeError(f"{where}: combine[{field!r}]: {op} needs a numeric field, "
                                  f"not {fields[field][0]}")
        out.append(CombineOp(field, op, None if op == "count" else (src or field)))
    return tuple(out)


def input_columns(values: Any, spec: tuple[CombineOp, ...], n: int, where: str,
                  value_dtype: np.dtype[Any] | None = None) -> dict[str, npt.NDArray[Any]]:
    """Extract and validate the input columns a spec reads from ``values``.

    ``values`` is a structured array or a mapping of column name -> array.

    Raises
    ------
    RecordTypeError
        If a column is missing, not 1-D, of the wrong length or not numeric/comparable.
    """
    needed = sorted({c.input for c in spec if c.input is not None})
    cols: dict[str, npt.NDArray[Any]] = {}
    if not needed:
        return cols
    if values is None:
        raise RecordTypeError(f"{where}: combine reads columns {needed} but no values were given")
    for name in needed:
        try:
            col = values[name]
        except (KeyError, ValueError, IndexError, TypeError):
            raise RecordTypeError(f"{where}: input column {name!r} is missing") from None
        col = np.asarray(col)
        if col.ndim != 1 or len(col) != n:
            raise RecordTypeError(f"{where}: input column {name!r} has shape {col.shape}, "
                                  f"expected ({n},)")
        if col.dtype.kind not in "iufbSMm":
            raise RecordTypeError(f"{where}: input column {name!r} has dtype {col.dtype}")
        if value_dtype is not None and n:
            for c in spec:
                if c.input != name:
                    continue
                vfields = value_dtype.fields
                assert vfields is not None
                dst = vfields[c.field][0]
                if col.dtype.kind in "iub" and dst.kind in "iu":
                    if col.dtype.kind != "b":  # any integers whose values fit the field
                        info = np.iinfo(dst)
                        lo, hi = col.min(), col.max()
                        if lo < info.min or hi > info.max:
                            raise RecordTypeError(
                                f"{where}: input column {name!r} has values in [{lo}, {hi}] "
                                f"that do not fit field {c.field!r} of dtype {dst}")
                elif not np.can_cast(col.dtype, dst, casting="same_kind"):
                    raise RecordTypeError(
                        f"{where}: input column {name!r} of dtype {col.dtype} cannot be "
                        f"combined into field {c.field!r} of dtype {dst} without loss")
        cols[name] = col
    return cols


def _extreme(dt: np.dtype[Any], high: bool) -> Any:
    if dt.kind == "f":
        return np.inf if high else -np.inf
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return info.max if high else info.min
    return None


def preaggregate(inverse: npt.NDArray[np.intp], n_groups: int, spec: tuple[CombineOp, ...],
                 cols: dict[str, npt.NDArray[Any]], value_dtype: np.dtype[Any]
                 ) -> npt.NDArray[Any]:
    """Fold input records into one partial value per group (``inverse`` = group of each record).

    Returns a structured array of ``value_dtype`` with ``n_groups`` rows; fields
    not in the spec are zero. Runtime complexity: O(n) with numpy's ``ufunc.at``.
    """
    out = np.zeros(n_groups, dtype=value_dtype)
    n = len(inverse)
    for c in spec:
        dst = out[c.field]
        if c.op == "count":
            dst[:] = np.bincount(inverse, minlength=n_groups)
            continue
        col = cols[c.input]  # type: ignore[index]
        if c.op == "sum":
            acc = np.zeros(n_groups, dtype=np.result_type(dst.dtype, col.dtype))
            np.add.at(acc, inverse, col)
            dst[:] = acc
        elif c.op in ("min", "max"):
            high = c.op == "min"
            init = _extreme(dst.dtype, high)
            if init is None:  # bytes / datetimes: order positions instead
                order = np.lexsort((col, inverse)) if high else np.lexsort((-_rank(col), inverse))
                first = np.ones(n, dtype=bool)
                first[1:] = inverse[order][1:] != inverse[order][:-1]
                dst[inverse[order][first]] = col[order][first]
            else:
                acc = np.full(n_groups, init, dtype=dst.dtype)
                (np.minimum if high else np.maximum).at(acc, inverse, col.astype(dst.dtype,
                                                                                  copy=False))
                dst[:] = acc
        else:  # last / first: position of the last / first record of each group
            pos = np.full(n_groups, -1 if c.op == "last" else n, dtype=np.int64)
            (np.maximum if c.op == "last" else np.minimum).at(pos, inverse, np.arange(n))
            dst[:] = col[pos]
    return out


def _rank(col: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    r = np.empty(len(col), dtype=np.int64)
    r[np.argsort(col, kind="stable")] = np.arange(len(col))
    return r


def merge_into(stored: npt.NDArray[Any], partial: npt.NDArray[Any],
               spec: tuple[CombineOp, ...]) -> npt.NDArray[Any]:
    """Combine stored values with partial aggregates of the same keys (no duplicates).

    Returns the new values (a new structured array); ``stored`` is not modified.
    """
    new = stored.copy()
    for c in spec:
        a, b = stored[c.field], partial[c.field]
        if c.op in ("count", "sum"):
            new[c.field] = a + b
        elif c.op == "min":
            new[c.field] = np.minimum(a, b) if a.dtype.kind in "iuf" else np.where(b < a, b, a)
        elif c.op == "max":
            new[c.field] = np.maximum(a, b) if a.dtype.kind in "iuf" else np.where(b > a, b, a)
        elif c.op == "last":
            new[c.field] = b
        # first: keep the stored value
    return new


def preaggregate_sorted(order: npt.NDArray[np.intp], starts: npt.NDArray[np.intp],
                        spec: tuple[CombineOp, ...], cols: dict[str, npt.NDArray[Any]],
                        value_dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """`preaggregate` for records already grouped by a *stable* sort.

    ``order`` sorts the input records by key and ``starts`` are the first
    positions of each group in that order. Uses ``ufunc.reduceat`` on
    contiguous arrays, which is several times faster than ``ufunc.at``.
    """
    n = len(order)
    g = len(starts)
    out = np.zeros(g, dtype=value_dtype)
    ends = np.append(starts[1:], n)
    for c in spec:
        dst = out[c.field]
        if c.op == "count":
            dst[:] = ends - starts
            continue
        col = cols[c.input][order]  # type: ignore[index]
        if c.op == "sum":
            dst[:] = np.add.reduceat(col.astype(np.result_type(dst.dtype, col.dtype),
                                                copy=False), starts)
        elif c.op in ("min", "max"):
            if col.dtype.kind in "iufmM":
                dst[:] = (np.minimum if c.op == "min" else np.maximum).reduceat(col, starts)
            else:  # bytes: fall back to the unsorted path for this column
                inverse = np.repeat(np.arange(g), ends - starts)
                sub = preaggregate(inverse, g, (c,), {c.input: col}, value_dtype)  # type: ignore[dict-item]
                dst[:] = sub[c.field]
        elif c.op == "last":
            dst[:] = col[ends - 1]
        else:  # first
            dst[:] = col[starts]
    return out
