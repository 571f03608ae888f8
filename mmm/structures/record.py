"""Plain-Python access to records in page frames: the building blocks of the per-record paths.

A per-record operation has a budget of a few hundred nanoseconds (a Python
``dict`` or ``deque`` operation costs 50-100 ns). A numba dispatch (~0.3-0.5 µs)
or a numpy scalar read or write (~0.1 µs each, and a new numpy scalar or
``np.void`` per record read) spends it several times over. So the per-record
paths of `PagedDeque` and `OrderedMap` read and write the page frames through
`memoryview` objects over the whole pool (typed casts for scalar keys and
values, header fields) and `struct.Struct` for whole records: Python ints and
floats go in and come out, no numpy object is created.

Only record layouts whose every field is a native little-endian integer or
float have a `struct` twin (`record_struct`); other schemas (bytes, datetime,
bool, big-endian or subarray fields) use the batch paths, one record at a time.
"""
from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np

from mmm.page import HEADER_DTYPE

__all__ = ["scalar_code", "record_struct", "cast", "pool_views", "typed_view", "COUNT_WORD",
           "START_WORD"]

_CODES = {("i", 1): "b", ("i", 2): "h", ("i", 4): "i", ("i", 8): "q",
          ("u", 1): "B", ("u", 2): "H", ("u", 4): "I", ("u", 8): "Q",
          ("f", 2): "e", ("f", 4): "f", ("f", 8): "d"}

# header fields as indices into a uint32 view of a frame (``frame * page_bytes // 4 + word``)
_HF = HEADER_DTYPE.fields
assert _HF is not None and _HF["count"][0] == np.dtype("<u4") == _HF["start"][0]
COUNT_WORD = _HF["count"][1] // 4
START_WORD = _HF["start"][1] // 4


def scalar_code(dt: np.dtype[Any]) -> str | None:
    """The `struct` / `memoryview` format code of a native little-endian integer or float
    dtype (these cast and compare exactly as numpy does), else None."""
    if dt.fields is not None or dt.subdtype is not None or sys.byteorder != "little":
        return None
    if dt.byteorder == ">":
        return None
    return _CODES.get((dt.kind, dt.itemsize))


def record_struct(dt: np.dtype[Any]) -> struct.Struct | None:
    """A `struct.Struct` whose bytes are exactly one record of ``dt`` (padding included),
    if every field has a `scalar_code`; else None. Unpacking gives the tuple that
    ``np.void.item()`` gives (a 1-tuple for a scalar dtype)."""
    if dt.fields is None:
        code = scalar_code(dt)
        return struct.Struct("<" + code) if code else None
    parts = [(dt.fields[n][1], dt.fields[n][0]) for n in dt.names or ()]
    fmt, pos = "<", 0
    for off, fdt in parts:  # numpy orders names by declaration; offsets must ascend
        code = scalar_code(fdt)
        if code is None or off < pos:
            return None
        fmt += "x" * (off - pos) + code
        pos = off + fdt.itemsize
    fmt += "x" * (dt.itemsize - pos)
    s = struct.Struct(fmt)
    return s if s.size == dt.itemsize else None


def cast(mv: memoryview, code: str) -> memoryview:
    """``mv.cast(code)`` for a format code only known at run time."""
    return mv.cast(code)  # type: ignore[call-overload,no-any-return]


def pool_views(frames: np.ndarray) -> tuple[memoryview, memoryview]:
    """``(bytes, uint32)`` flat memoryviews over a pool's ``(n_frames, page_bytes)`` frames."""
    b = frames.data.cast("B")
    return b, b.cast("I")


def typed_view(arr: np.ndarray, code: str) -> memoryview:
    """A flat memoryview of the contiguous array ``arr`` read as format ``code``; it shares
    ``arr``'s memory, so writes through either show in both."""
    if not arr.flags.c_contiguous:
        raise ValueError("typed_view needs a contiguous array (a copy would not share memory)")
    return cast(arr.reshape(-1).view(np.uint8).data, code)
