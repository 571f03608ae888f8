"""State keys: the Spark key column(s) of a stream -> the int64 keys the state structures use.

A stateful operator groups rows by a key of one or several columns (``key="user"`` or
``key=["tenant", "user"]``), of any type a Spark user groups by. The state structures
(``mmm.HashMap``, buffers) key on fixed-width integers, so a `KeyIndex`, bound to one
partition's page manager, turns each row's key into one:

* ``key="k"`` naming one **integer** column (byte, short, int, long): the value itself,
  as today (no dictionary, no extra cost). Such a column holds no null key: a null is
  refused (`NullKeyError`), since every integer value is taken; pass ``key=["k"]`` to
  key through the dictionary instead, where null is a group of its own;
* anything else (strings, binary, booleans, dates, timestamps, several columns, or an
  integer column given as a list): an exact, dense ``int64`` id from a
  `mmm.structures.keydict.KeyDict` of the page manager (named ``KEYDICT``), so it is
  snapshotted, rolled back, checkpointed, restored and repartitioned with the rest of
  the state. Keys are never hashed into a smaller space: equal ids mean equal keys.

The bytes a key is interned as (`encode`): a single string or binary column passes its
Arrow buffers as they are (a null is the dictionary's null key); otherwise each column
in order contributes a flag byte (0 null, 1 present) and, when present, its value:
little-endian fixed width for booleans (1 byte), integers, dates (4-byte days) and
timestamps (8-byte ticks in the column's unit), or a 4-byte little-endian length and
the bytes for strings and binaries. One compiled pass per column, no per-row Python;
`decode` is the inverse, back to Arrow columns of the original names and types.

Null keys form their own group, as in Spark's ``groupBy`` (and a composite key with
some null columns is the group of those values). Float and decimal key columns are
refused (`UnsupportedKeyTypeError`): floating-point equality (``-0.0``, NaN payloads)
makes a poor identity for state, and a cast to a decimal string or a scaled long says
what the user means; maps, arrays and structs are refused too.

Ids are per partition: the same key has another id in another partition, and a
replayed batch may give a new key another id than the failed attempt did (ids follow
the order keys first appear). The ids never leave the partition: outputs, `dump`,
the input log and repartitioning all carry the decoded key columns.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from mmm import jit
from sguard.spark.errors import SchemaChangedError, UnsupportedKeyTypeError

__all__ = ["KEYDICT", "KeySpec", "KeyIndex", "NullKeyError", "key_columns", "key_spec",
           "encode", "decode"]

KEYDICT: Final = "keydict"
"""The name of the partition's key dictionary in its page manager."""

_INT_TYPES: Final = {pa.int8(): "<i1", pa.int16(): "<i2", pa.int32(): "<i4", pa.int64(): "<i8",
                     pa.uint8(): "<u1", pa.uint16(): "<u2", pa.uint32(): "<u4"}


class NullKeyError(UnsupportedKeyTypeError, ValueError):
    """A null in an integer key column keyed directly (``key="k"``)."""


def key_columns(key: str | Sequence[str]) -> list[str]:
    """The key column names of `key` (a name or a list of names).

    Raises
    ------
    TypeError
        If `key` is neither a str nor a non-empty sequence of distinct str.
    """
    if isinstance(key, str):
        return [key]
    cols = list(key) if isinstance(key, Sequence) else None
    if not cols or not all(isinstance(c, str) for c in cols) or len(set(cols)) != len(cols):
        raise TypeError(f"key must be a column name or a non-empty list of distinct column "
                        f"names, got {key!r}")
    return cols


def _width(t: pa.DataType) -> int:
    """Bytes of a fixed-width key value; 0 for variable-length (string/binary)."""
    if pa.types.is_boolean(t):
        return 1
    if t in _INT_TYPES:
        return int(t.bit_width) // 8
    if pa.types.is_date32(t):
        return 4
    if pa.types.is_date64(t) or pa.types.is_timestamp(t):
        return 8
    return 0


def _var(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t))


def _check_type(name: str, t: pa.DataType) -> None:
    if _width(t) or _var(t):
        return
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        why = ("floating-point equality (-0.0, NaN payloads) makes a poor state identity; "
               "cast it to a string, a decimal string or a scaled long")
    elif pa.types.is_nested(t) or pa.types.is_dictionary(t):
        why = "maps, arrays, structs and dictionaries cannot be keys; key on their fields"
    else:
        why = "cast it to a supported type"
    raise UnsupportedKeyTypeError(
        f"key column {name!r} has type {t}: sguard.spark keys state on strings, binary, "
        f"booleans, dates, timestamps and integers (byte, short, int, long); {why}")


@dataclass(frozen=True)
class KeySpec:
    """The key of a stream: its columns and types, and how the state stores it."""

    columns: tuple[str, ...]
    types: tuple[pa.DataType, ...]
    direct: bool
    """True: one integer column keyed by its value (``key="k"``); False: the dictionary."""

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the keys the state structures hold."""
        return np.dtype(_INT_TYPES[self.types[0]] if self.direct else "<i8")

    @property
    def fields(self) -> list[pa.Field]:
        """The key columns as output fields (original names and types)."""
        return [pa.field(c, t) for c, t in zip(self.columns, self.types)]

    def describe(self) -> dict[str, Any]:
        """What the layout document records (``extra["keys"]``)."""
        return {"columns": list(self.columns), "types": [str(t) for t in self.types],
                "encoding": "direct" if self.direct else "dictionary"}


def key_spec(schema: pa.Schema, key: str | Sequence[str]) -> KeySpec:
    """Validate `key` against `schema` and say how it is stored (see the module docstring).

    Raises
    ------
    SchemaChangedError
        A key column is not in the schema.
    UnsupportedKeyTypeError
        A key column has a type that cannot be a key (naming it).
    """
    cols = key_columns(key)
    for c in cols:
        if c not in schema.names:
            raise SchemaChangedError(f"key column {c!r} is not in the stream's columns "
                                     f"{schema.names}")
        _check_type(c, schema.field(c).type)
    types = tuple(schema.field(c).type for c in cols)
    return KeySpec(tuple(cols), types, isinstance(key, str) and types[0] in _INT_TYPES)


# -- encoding kernels -----------------------------------------------------------------------
@jit
def _lengths_fixed(lens: Any, valid: Any, w: int) -> None:  # pragma: no cover - compiled
    for i in range(len(lens)):
        lens[i] += 1 + (w if valid[i] else 0)


@jit
def _lengths_var(lens: Any, offs: Any, valid: Any) -> None:  # pragma: no cover - compiled
    for i in range(len(lens)):
        lens[i] += 1 + ((4 + offs[i + 1] - offs[i]) if valid[i] else 0)


@jit
def _put_fixed(out: Any, cur: Any, vals: Any, valid: Any, w: int) -> None:  # pragma: no cover
    for i in range(len(cur)):
        p = cur[i]
        if valid[i]:
            out[p] = 1
            for j in range(w):
                out[p + 1 + j] = vals[i * w + j]
            cur[i] = p + 1 + w
        else:
            out[p] = 0
            cur[i] = p + 1


@jit
def _put_var(out: Any, cur: Any, data: Any, offs: Any, valid: Any) -> None:  # pragma: no cover
    for i in range(len(cur)):
        p = cur[i]
        if valid[i]:
            a = offs[i]
            n = offs[i + 1] - a
            out[p] = 1
            for j in range(4):
                out[p + 1 + j] = (n >> (8 * j)) & 0xFF
            for j in range(n):
                out[p + 5 + j] = data[a + j]
            cur[i] = p + 5 + n
        else:
            out[p] = 0
            cur[i] = p + 1


@jit
def _get_fixed(data: Any, cur: Any, vals: Any, valid: Any, w: int) -> None:  # pragma: no cover
    for i in range(len(cur)):
        p = cur[i]
        if data[p]:
            valid[i] = True
            for j in range(w):
                vals[i * w + j] = data[p + 1 + j]
            cur[i] = p + 1 + w
        else:
            valid[i] = False
            cur[i] = p + 1


@jit
def _var_lengths(data: Any, cur: Any, offs: Any, valid: Any) -> None:  # pragma: no cover
    offs[0] = 0
    for i in range(len(cur)):
        p = cur[i]
        n = np.int64(0)
        if data[p]:
            valid[i] = True
            for j in range(4):
                n |= np.int64(data[p + 1 + j]) << np.int64(8 * j)
        else:
            valid[i] = False
        offs[i + 1] = offs[i] + n


@jit
def _get_var(data: Any, cur: Any, offs: Any, valid: Any, out: Any) -> None:  # pragma: no cover
    for i in range(len(cur)):
        p = cur[i]
        if valid[i]:
            n = offs[i + 1] - offs[i]
            for j in range(n):
                out[offs[i] + j] = data[p + 5 + j]
            cur[i] = p + 5 + n
        else:
            cur[i] = p + 1


def _arrow_var(arr: pa.Array) -> tuple[npt.NDArray[np.uint8], npt.NDArray[Any]]:
    """The data bytes and the (n + 1) offsets of a string/binary array, zero-copy."""
    t = arr.type
    off_dt = np.int64 if (pa.types.is_large_string(t) or pa.types.is_large_binary(t)) \
        else np.int32
    bufs = arr.buffers()
    offs = np.frombuffer(bufs[1], off_dt, count=len(arr) + 1,
                         offset=arr.offset * np.dtype(off_dt).itemsize)
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    return data, offs


def _valid(arr: pa.Array) -> npt.NDArray[np.bool_]:
    if arr.null_count == 0:
        return np.ones(len(arr), bool)
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False))


def _fixed_bytes(arr: pa.Array, w: int) -> npt.NDArray[np.uint8]:
    """The little-endian value bytes of a fixed-width key column (nulls as zeros)."""
    t = arr.type
    if pa.types.is_boolean(t):
        v = np.asarray(arr.fill_null(False).to_numpy(zero_copy_only=False)).astype(np.uint8)
    else:
        phys = {1: pa.int8(), 2: pa.int16(), 4: pa.int32(), 8: pa.int64()}[w]
        if t in _INT_TYPES and not pa.types.is_signed_integer(t):
            phys = {1: pa.uint8(), 2: pa.uint16(), 4: pa.uint32()}[w]
        a = arr.view(phys) if t != phys else arr
        v = np.asarray(a.fill_null(0).to_numpy(zero_copy_only=False))
    return np.ascontiguousarray(v.astype(v.dtype.newbyteorder("<"), copy=False)).view(np.uint8)


def _chunk(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


def encode(spec: KeySpec, table: pa.Table | pa.RecordBatch
           ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[Any], npt.NDArray[np.bool_] | None]:
    """The dictionary bytes of every row's key: ``(data, offsets, valid)`` (see the module
    docstring; `valid` is None when every key is non-null).

    Runtime complexity: O(rows + key bytes), one compiled pass per column.
    """
    arrs = [_chunk(table.column(c)) for c in spec.columns]
    n = table.num_rows
    if len(arrs) == 1 and _var(arrs[0].type):
        data, offs = _arrow_var(arrs[0])
        return data, offs, (_valid(arrs[0]) if arrs[0].null_count else None)
    lens = np.zeros(n, np.int64)
    cols: list[tuple[int, npt.NDArray[np.uint8], Any, npt.NDArray[np.bool_]]] = []
    for a in arrs:
        valid = _valid(a)
        if _var(a.type):
            data, offs = _arrow_var(a)
            _lengths_var(lens, offs, valid)
            cols.append((0, data, offs, valid))
        else:
            w = _width(a.type)
            _lengths_fixed(lens, valid, w)
            cols.append((w, _fixed_bytes(a, w), None, valid))
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    out = np.empty(int(offsets[-1]), np.uint8)
    cur = offsets[:-1].copy()
    for w, data, offs, valid in cols:
        if w:
            _put_fixed(out, cur, data, valid, w)
        else:
            _put_var(out, cur, data, offs, valid)
    return out, offsets, None


def _bitmap(valid: npt.NDArray[np.bool_]) -> pa.Buffer | None:
    if valid.all():
        return None
    return pa.py_buffer(np.packbits(valid, bitorder="little"))


def _var_array(t: pa.DataType, data: npt.NDArray[np.uint8], offs: npt.NDArray[np.int64],
               valid: npt.NDArray[np.bool_]) -> pa.Array:
    n = len(offs) - 1
    binary = pa.types.is_binary(t) or pa.types.is_large_binary(t)
    large = pa.large_binary() if binary else pa.large_string()
    arr = pa.Array.from_buffers(large, n, [_bitmap(valid), pa.py_buffer(offs.astype(np.int64)),
                                           pa.py_buffer(data)],
                                null_count=int(n - np.count_nonzero(valid)))
    return arr if arr.type == t else arr.cast(t)


def _fixed_array(t: pa.DataType, vals: npt.NDArray[np.uint8], valid: npt.NDArray[np.bool_],
                 w: int) -> pa.Array:
    n = len(valid)
    if pa.types.is_boolean(t):
        return pa.array(vals.astype(bool), pa.bool_(), mask=~valid)
    if t in _INT_TYPES:
        np_t = np.dtype(_INT_TYPES[t])
    else:
        np_t = np.dtype({4: "<i4", 8: "<i8"}[w])
    v = vals.view(np_t)
    phys = pa.from_numpy_dtype(np_t)
    a = pa.Array.from_buffers(phys, n, [_bitmap(valid), pa.py_buffer(v)],
                              null_count=int(n - np.count_nonzero(valid)))
    return a if a.type == t else a.view(t)


def decode(spec: KeySpec, data: npt.NDArray[np.uint8], offsets: npt.NDArray[Any],
           valid: npt.NDArray[np.bool_] | None = None) -> list[pa.Array]:
    """The key columns (original types) of keys encoded by `encode`.

    Runtime complexity: O(keys + key bytes).
    """
    data = np.ascontiguousarray(data, np.uint8)
    offsets = np.ascontiguousarray(offsets, np.int64)
    n = len(offsets) - 1
    valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool)
    if len(spec.columns) == 1 and _var(spec.types[0]):
        return [_var_array(spec.types[0], data, offsets, valid)]
    cur = offsets[:-1].copy()
    out = []
    for t in spec.types:
        ok = np.empty(n, bool)
        if _var(t):
            offs = np.empty(n + 1, np.int64)
            _var_lengths(data, cur, offs, ok)
            buf = np.empty(int(offs[-1]), np.uint8)
            _get_var(data, cur, offs, ok, buf)
            out.append(_var_array(t, buf, offs, ok))
        else:
            w = _width(t)
            vals = np.zeros(n * w, np.uint8)
            _get_fixed(data, cur, vals, ok, w)
            out.append(_fixed_array(t, vals, ok, w))
    return out


class KeyIndex:
    """One partition's keys: rows -> state keys (`ids`) and back (`arrays`).

    Parameters
    ----------
    pm : mmm.PageManager
        The partition's page manager (the dictionary lives there, as ``KEYDICT``).
    spec : KeySpec
        From `key_spec`.
    """

    def __init__(self, pm: Any, spec: KeySpec) -> None:
        self.spec = spec
        self.kd: Any = None
        if not spec.direct:
            from mmm.structures.keydict import KeyDict
            self.kd = KeyDict.create(pm, KEYDICT)

    @classmethod
    def open(cls, pm: Any, schema: pa.Schema, key: str | Sequence[str]) -> KeyIndex:
        """`key_spec` then bind to `pm` (creates or recovers the dictionary)."""
        return cls(pm, key_spec(schema, key))

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the state keys (`KeySpec.dtype`)."""
        return self.spec.dtype

    @property
    def fields(self) -> list[pa.Field]:
        return self.spec.fields

    def ids(self, table: pa.Table | pa.RecordBatch) -> npt.NDArray[Any]:
        """Each row's state key; a new key is added to the dictionary.

        Raises
        ------
        NullKeyError
            A null in a directly keyed integer column.
        """
        if self.kd is None:
            return self._direct(table)
        return np.asarray(self.kd.intern(*encode(self.spec, table)), np.int64)

    def lookup(self, table: pa.Table | pa.RecordBatch) -> npt.NDArray[Any]:
        """Each row's state key, -1 for keys the partition has never seen (dictionary only)."""
        if self.kd is None:
            return self._direct(table)
        return np.asarray(self.kd.lookup(*encode(self.spec, table)), np.int64)

    def _direct(self, table: pa.Table | pa.RecordBatch) -> npt.NDArray[Any]:
        c = self.spec.columns[0]
        col = table.column(c)
        if col.null_count:
            raise NullKeyError(
                f"key column {c!r} has {col.null_count} null value(s) in this batch; an "
                f"integer key given as key={c!r} is stored as its value, which leaves no "
                f"room for a null: pass key=[{c!r}] to key the state through the key "
                f"dictionary (null is then its own group), or filter the nulls out")
        arr = col.to_numpy() if not isinstance(col, pa.ChunkedArray) or col.num_chunks != 1 \
            else col.chunk(0).to_numpy(zero_copy_only=False)
        return np.asarray(arr).astype(self.dtype, copy=False)

    def arrays(self, ids: npt.NDArray[Any]) -> list[pa.Array]:
        """The key columns (original names' types) of state keys `ids`, in order."""
        if self.kd is None:
            return [pa.array(np.asarray(ids, self.dtype)).cast(self.spec.types[0])]
        ids = np.asarray(ids, np.int64)
        if not len(ids):
            return [pa.array([], t) for t in self.spec.types]
        return decode(self.spec, *self.kd.keys(ids))

    def remove(self, ids: npt.NDArray[Any]) -> None:
        """Forget the keys of `ids` (no state refers to them any more; dictionary only: a
        later row with the same key gets a new id). A no-op for direct integer keys."""
        if self.kd is not None and len(ids):
            self.kd.remove(np.asarray(ids, np.int64))

    def table(self, ids: npt.NDArray[Any]) -> pa.Table:
        """`arrays` as a table of the key columns."""
        return pa.Table.from_arrays(self.arrays(ids), schema=pa.schema(self.fields))

    def order(self, ids: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
        """A permutation sorting `ids` by their keys' values (nulls last): a canonical order."""
        if self.kd is None:
            return np.argsort(ids, kind="stable")
        t = self.table(ids)
        return np.asarray(pc.sort_indices(
            t, sort_keys=[(c, "ascending") for c in self.spec.columns]).to_numpy(), np.int64)

    def rank(self, ids: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
        """Each id's rank among the distinct `ids` in key order (a sort key for `np.lexsort`)."""
        if self.kd is None:
            return np.asarray(ids)
        uk, inv = np.unique(np.asarray(ids, np.int64), return_inverse=True)
        r = np.empty(len(uk), np.int64)
        r[self.order(uk)] = np.arange(len(uk))
        return r[inv.reshape(-1)]

    def __len__(self) -> int:
        return 0 if self.kd is None else len(self.kd)
