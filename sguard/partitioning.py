"""Spark's key -> partition function, vectorized: ``pmod(murmur3(key, seed=42), P)``.

``df.repartition(P, "k")`` sends a row to partition ``pmod(hash(k), P)`` where
``hash`` is Spark's `Murmur3Hash` expression (Murmur3 x86 32-bit, seed 42) and
``pmod`` the non-negative remainder. To put a key's state where Spark will
send the key's rows, `partition_of` computes exactly that, over a whole numpy
(or Arrow) column at once, with compiled kernels (`mmm.jit`).

How each key type is hashed (what Spark's ``Murmur3HashFunction`` does):

=====================================  =========================  ====================
numpy dtype / Arrow type               Spark type                 hashed as
=====================================  =========================  ====================
bool                                   BooleanType                ``hashInt(1 or 0)``
int8, int16, int32, uint8, uint16      Byte/Short/IntegerType     ``hashInt(v)``
int64, uint32                          LongType                   ``hashLong(v)``
float32                                FloatType                  ``hashInt(floatToIntBits(v))``
float64                                DoubleType                 ``hashLong(doubleToLongBits(v))``
datetime64[D]                          DateType                   ``hashInt(days)``
datetime64[other units]                TimestampType              ``hashLong(microseconds)``
bytes ``S<n>``, Arrow binary/string    Binary/StringType          ``hashUnsafeBytes(utf8)``
=====================================  =========================  ====================

Floats are normalized as Spark does: ``-0.0`` hashes as ``0.0`` and every NaN
as the canonical NaN (``floatToIntBits``). A fixed-width ``S<n>`` key stands for
the bytes up to its trailing NULs (numpy's own reading of it). A null (an Arrow
null) hashes to the seed, so it goes to ``pmod(42, P)`` as in Spark. ``uint64``
has no Spark type and is refused.

`pmod` groups keys compatibly across partition counts: ``pmod(h, P) ==
pmod(pmod(h, M), P)`` whenever ``P`` divides ``M``; `sguard.rescale` relies on it
to know which old partitions feed which new ones.
"""
from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from mmm import jit

__all__ = ["SEED", "PartitioningError", "murmur3_hash", "partition_of", "pmod", "spark_type_of"]

SEED: Final = 42
"""The seed of Spark's ``hash()`` and of ``HashPartitioning``."""

_C1: Final = 0xCC9E2D51
_C2: Final = 0x1B873593
_M32: Final = 0xFFFFFFFF


class PartitioningError(TypeError):
    """A key column whose type has no Spark partitioning counterpart."""


# -- kernels: 32-bit arithmetic carried in uint64 and masked --------------------------------
@jit
def _mix_k1(k1: Any) -> Any:
    k1 = (k1 * np.uint64(_C1)) & np.uint64(_M32)
    k1 = ((k1 << np.uint64(15)) | (k1 >> np.uint64(17))) & np.uint64(_M32)
    return (k1 * np.uint64(_C2)) & np.uint64(_M32)


@jit
def _mix_h1(h1: Any, k1: Any) -> Any:
    h1 = h1 ^ k1
    h1 = ((h1 << np.uint64(13)) | (h1 >> np.uint64(19))) & np.uint64(_M32)
    return (h1 * np.uint64(5) + np.uint64(0xE6546B64)) & np.uint64(_M32)


@jit
def _fmix(h1: Any, length: Any) -> Any:
    h1 = h1 ^ length
    h1 = h1 ^ (h1 >> np.uint64(16))
    h1 = (h1 * np.uint64(0x85EBCA6B)) & np.uint64(_M32)
    h1 = h1 ^ (h1 >> np.uint64(13))
    h1 = (h1 * np.uint64(0xC2B2AE35)) & np.uint64(_M32)
    return h1 ^ (h1 >> np.uint64(16))


@jit
def _hash_ints(words: npt.NDArray[np.uint32], seeds: npt.NDArray[np.uint32]
               ) -> npt.NDArray[np.uint32]:
    """Spark ``hashInt`` of each 32-bit word, each with its own seed."""
    out = np.empty(len(words), np.uint32)
    for i in range(len(words)):
        h1 = _mix_h1(np.uint64(seeds[i]), _mix_k1(np.uint64(words[i])))
        out[i] = _fmix(h1, np.uint64(4))
    return out


@jit
def _hash_longs(words: npt.NDArray[np.uint64], seeds: npt.NDArray[np.uint32]
                ) -> npt.NDArray[np.uint32]:
    """Spark ``hashLong`` of each 64-bit word (low half first), each with its own seed."""
    out = np.empty(len(words), np.uint32)
    for i in range(len(words)):
        w = words[i]
        h1 = _mix_h1(np.uint64(seeds[i]), _mix_k1(w & np.uint64(_M32)))
        h1 = _mix_h1(h1, _mix_k1(w >> np.uint64(32)))
        out[i] = _fmix(h1, np.uint64(8))
    return out


@jit
def _hash_bytes(data: npt.NDArray[np.uint8], starts: npt.NDArray[np.int64],
                lengths: npt.NDArray[np.int64], seeds: npt.NDArray[np.uint32]
                ) -> npt.NDArray[np.uint32]:
    """Spark ``hashUnsafeBytes``: little-endian words, then each tail byte (sign-extended) alone."""
    out = np.empty(len(starts), np.uint32)
    for i in range(len(starts)):
        a = starts[i]
        n = lengths[i]
        aligned = n - n % 4
        h1 = np.uint64(seeds[i])
        for j in range(a, a + aligned, 4):
            w = (np.uint64(data[j]) | (np.uint64(data[j + 1]) << np.uint64(8))
                 | (np.uint64(data[j + 2]) << np.uint64(16)) | (np.uint64(data[j + 3]) << np.uint64(24)))
            h1 = _mix_h1(h1, _mix_k1(w))
        for j in range(a + aligned, a + n):
            b = np.uint64(data[j])
            if b >= np.uint64(128):
                b = b | np.uint64(0xFFFFFF00)  # (int) of a signed Java byte
            h1 = _mix_h1(h1, _mix_k1(b))
        out[i] = _fmix(h1, np.uint64(n) & np.uint64(_M32))
    return out


def _seeds(seed: Any, n: int) -> npt.NDArray[np.uint32]:
    """One seed per row: a scalar broadcast, or the running hash of the previous columns."""
    if np.ndim(seed) == 0:
        return np.full(n, int(seed) & _M32, np.uint32)
    s = np.ascontiguousarray(np.asarray(seed).view(np.uint32) if np.asarray(seed).dtype.itemsize
                             == 4 else np.asarray(seed).astype(np.uint32))
    if len(s) != n:
        raise ValueError(f"{len(s)} seeds for {n} keys")
    return s


# -- public API --------------------------------------------------------------------------------
def spark_type_of(dtype: npt.DTypeLike) -> str:
    """The Spark SQL type a numpy key dtype is hashed as (see the module table).

    Raises
    ------
    PartitioningError
        For a dtype with no Spark counterpart (uint64, complex, structured...).
    """
    dt = np.dtype(dtype)
    k, n = dt.kind, dt.itemsize
    if dt.fields is not None or dt.subdtype is not None:
        raise PartitioningError(f"key dtype {dt} is structured; partition by one of its fields")
    if k == "b":
        return "boolean"
    if k == "i" and n <= 4 or k == "u" and n <= 2:
        return {1: "byte", 2: "short", 4: "int"}[n] if k == "i" else ("short" if n == 1 else "int")
    if k == "i" and n == 8 or k == "u" and n == 4:
        return "long"
    if k == "f" and n in (4, 8):
        return "float" if n == 4 else "double"
    if k == "M":
        return "date" if dt.str.endswith("[D]") else "timestamp"
    if k == "S":
        return "binary"
    raise PartitioningError(f"key dtype {dt} has no Spark type to hash it as "
                            f"(supported: bool, int8-64, uint8-32, float32/64, datetime64, "
                            f"bytes S<n>, Arrow string/binary)")


def murmur3_hash(keys: Any, *, seed: Any = SEED) -> npt.NDArray[np.int32]:
    """Spark's ``hash(*cols)`` (Murmur3 x86 32, `seed`) of every key, as int32.

    Parameters
    ----------
    keys : numpy array, pyarrow Array / ChunkedArray, sequence, or a table of key columns
        One key column (a Python sequence of str is encoded as UTF-8), or a
        ``pyarrow.Table`` / ``RecordBatch`` whose columns form a composite key:
        hashed as Spark hashes ``hash(c1, c2, ...)`` and ``repartition(P, c1,
        c2, ...)``, the hash of column ``i`` being the seed of column ``i + 1``.
        A null leaves the running hash unchanged.
    seed : int or array of uint32/int32
        42 is what ``hash()`` and ``repartition`` use; an array gives each row
        its own seed (the running hash of earlier columns).

    Runtime complexity: O(total key bytes), one compiled pass per column.

    Raises
    ------
    PartitioningError
        An unsupported key type (see `spark_type_of`).

    Examples
    --------
    >>> murmur3_hash(np.array([0, 1], np.int32)).tolist()   # spark: SELECT hash(0), hash(1)
    [933211791, -559580957]
    """
    if isinstance(keys, (pa.Table, pa.RecordBatch)):
        h: Any = seed
        for i in range(keys.num_columns):
            h = murmur3_hash(keys.column(i), seed=h)
        out = _seeds(h, keys.num_rows).view(np.int32)
        return out
    if isinstance(keys, pa.ChunkedArray):
        if np.ndim(seed) == 0:
            parts = [murmur3_hash(c, seed=seed) for c in keys.chunks]
        else:
            offs = np.cumsum([0] + [len(c) for c in keys.chunks])
            parts = [murmur3_hash(c, seed=np.asarray(seed)[offs[i]:offs[i + 1]])
                     for i, c in enumerate(keys.chunks)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)
    if isinstance(keys, pa.Array):
        return _hash_arrow(keys, seed).view(np.int32)
    arr = np.asarray(keys)
    if arr.dtype.kind in "UO":
        return _hash_arrow(pa.array(arr.tolist(), type=pa.string()), seed).view(np.int32)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    t = spark_type_of(arr.dtype)
    seeds = _seeds(seed, len(arr))
    if t == "binary":
        w = arr.dtype.itemsize
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(len(arr), w)
        nz = raw != 0
        # length up to the last non-NUL byte (numpy drops trailing NULs of 'S')
        lengths = np.where(nz.any(axis=1), w - np.argmax(nz[:, ::-1], axis=1), 0).astype(np.int64)
        starts = np.arange(len(arr), dtype=np.int64) * w
        h = _hash_bytes(raw.reshape(-1), starts, lengths, seeds)
    elif t in ("long", "double", "timestamp"):
        h = _hash_longs(_long_words(arr, t), seeds)
    else:
        h = _hash_ints(_int_words(arr, t), seeds)
    res: npt.NDArray[np.int32] = h.view(np.int32)
    return res


def pmod(h: npt.NDArray[Any], num_partitions: int) -> npt.NDArray[np.int64]:
    """Spark's ``pmod(h, P)``: the remainder in ``[0, P)`` (floor modulo)."""
    return np.mod(np.asarray(h, dtype=np.int64), np.int64(num_partitions))


def partition_of(keys: Any, num_partitions: int) -> npt.NDArray[np.int64]:
    """The partition ``repartition(num_partitions, key)`` sends each key to.

    Raises
    ------
    ValueError
        If `num_partitions` is not an integer >= 1.
    PartitioningError
        An unsupported key type.

    Examples
    --------
    >>> partition_of(np.array([0, 1, 2, 3], np.int64), 4).tolist()
    [1, 1, 0, 3]
    """
    if not isinstance(num_partitions, (int, np.integer)) or isinstance(num_partitions, bool) \
            or num_partitions < 1:
        raise ValueError(f"num_partitions must be an integer >= 1, got {num_partitions!r}")
    return pmod(murmur3_hash(keys), int(num_partitions))


# -- helpers ------------------------------------------------------------------------------------
def _int_words(arr: npt.NDArray[Any], t: str) -> npt.NDArray[np.uint32]:
    """The 32-bit word Spark's ``hashInt`` sees for int-like and float keys."""
    if t == "float":
        f = np.ascontiguousarray(arr, dtype=np.float32)
        f = np.where(f == 0, np.float32(0), f)           # -0.0 -> 0.0
        bits = f.view(np.uint32).copy()
        bits[np.isnan(f)] = 0x7FC00000                    # floatToIntBits' canonical NaN
        return bits
    if t == "date":
        arr = arr.astype("datetime64[D]").view(np.int64)
    return np.ascontiguousarray(arr.astype(np.int32, copy=False)).view(np.uint32)


def _long_words(arr: npt.NDArray[Any], t: str) -> npt.NDArray[np.uint64]:
    """The 64-bit word Spark's ``hashLong`` sees for long, double and timestamp keys."""
    if t == "double":
        d = np.ascontiguousarray(arr, dtype=np.float64)
        d = np.where(d == 0, 0.0, d)
        bits = d.view(np.uint64).copy()
        bits[np.isnan(d)] = 0x7FF8000000000000
        return bits
    if t == "timestamp":
        us = arr.astype("datetime64[us]").view(np.int64)
        return np.ascontiguousarray(us).view(np.uint64)
    return np.ascontiguousarray(arr.astype(np.int64, copy=False)).view(np.uint64)


def _hash_arrow(arr: pa.Array, seed: Any) -> npt.NDArray[np.uint32]:
    """Hash an Arrow array: strings/binaries through their buffers, others via numpy.

    A null row keeps its seed (Spark skips null columns)."""
    typ = arr.type
    seeds = _seeds(seed, len(arr))
    if pa.types.is_dictionary(typ):
        return _hash_arrow(arr.cast(typ.value_type), seeds)
    if (pa.types.is_string(typ) or pa.types.is_binary(typ) or pa.types.is_large_string(typ)
            or pa.types.is_large_binary(typ)):
        large = pa.types.is_large_string(typ) or pa.types.is_large_binary(typ)
        bufs = arr.buffers()
        off_dt = np.int64 if large else np.int32
        offsets = np.frombuffer(bufs[1], dtype=off_dt, count=len(arr) + 1,
                                offset=arr.offset * np.dtype(off_dt).itemsize).astype(np.int64)
        data = (np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None
                else np.zeros(0, np.uint8))
        h = _hash_bytes(data, offsets[:-1].copy(), np.diff(offsets), seeds)
    elif pa.types.is_timestamp(typ) or pa.types.is_date(typ):
        unit = "D" if pa.types.is_date(typ) else typ.unit
        filled = arr.cast(pa.date32() if unit == "D" else typ)
        if filled.null_count:
            filled = filled.fill_null(pa.scalar(0, pa.int32() if unit == "D" else pa.int64()
                                                ).cast(filled.type))
        vals = filled.to_numpy(zero_copy_only=False)
        h = murmur3_hash(np.asarray(vals).astype(f"datetime64[{unit}]"), seed=seeds
                         ).view(np.uint32)
    else:
        try:
            vals = arr.fill_null(False if pa.types.is_boolean(typ) else 0).to_numpy(
                zero_copy_only=False) if arr.null_count else arr.to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise PartitioningError(f"Arrow key type {typ} is not supported: {exc}") from None
        h = murmur3_hash(np.asarray(vals), seed=seeds).view(np.uint32)
    if arr.null_count:
        valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False))
        h = np.where(valid, h, seeds).astype(np.uint32)
    out: npt.NDArray[np.uint32] = h
    return out

