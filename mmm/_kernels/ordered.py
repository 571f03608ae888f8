"""Compiled kernels of `mmm.structures.ordered_map.OrderedMap`.

Keys reach the kernels in one of two forms, chosen once per map:

* numeric keys (bool, integers, floats, datetime64 / timedelta64 viewed as
  int64 — NaT is never stored, so the order is the same) as 2-D typed views
  ``K[frame, slot]`` of the leaves and 1-D arrays of query keys and fences;
* fixed-size byte keys (``'S'``) as 3-D ``uint8`` views ``K[frame, slot, byte]``
  and 2-D query / fence rows, compared lexicographically (numpy's order for
  ``'S'``: shorter strings are NUL-padded).

`kcmp` and `acmp` pick the comparison at compile time from the array ranks, so
every kernel below has one source for both forms. Records are moved as bytes
(``frames`` is the pool's ``(n_frames, page_bytes)`` uint8 array; keys start at
byte ``ko`` of a leaf, values at ``vo``), whatever their dtype.

No kernel allocates pages or passes the write barrier: callers make the leaves
writable (``PageManager.writable``) before a kernel writes them.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba.extending import overload

from mmm._kernels import jit
from mmm._kernels.pages import copy_bytes, move_bytes

__all__ = ["locate", "span", "merge_into_leaves"]


def kcmp(K: Any, f: Any, s: Any, q: Any, i: Any, mode: Any) -> int:
    """Sign of ``K[f, s] - q[i]`` (compiled only)."""
    raise NotImplementedError


def acmp(A: Any, i: Any, q: Any, j: Any, mode: Any) -> int:
    """Sign of ``A[i] - q[j]`` (compiled only)."""
    raise NotImplementedError


@jit
def _bytes_cmp(a: Any, b: Any, mode: int) -> int:
    """Compare two key byte rows: mode 0 unsigned lexicographic (``'S'``, big-endian
    unsigned), 1 big-endian two's complement, 2 big-endian IEEE float."""
    w = a.shape[0]
    xa0 = 0
    xb0 = 0
    xa = 0
    xb = 0
    if mode == 1:
        xa0 = 0x80
        xb0 = 0x80
    elif mode == 2:
        if a[0] >= 128:
            xa0 = 0xFF
            xa = 0xFF
        else:
            xa0 = 0x80
        if b[0] >= 128:
            xb0 = 0xFF
            xb = 0xFF
        else:
            xb0 = 0x80
    for t in range(w):
        u = np.int64(a[t]) ^ (xa0 if t == 0 else xa)
        v = np.int64(b[t]) ^ (xb0 if t == 0 else xb)
        if u != v:
            return -1 if u < v else 1
    return 0


@overload(kcmp, jit_options={"cache": True})  # type: ignore[typeddict-unknown-key]
def _kcmp(K: Any, f: Any, s: Any, q: Any, i: Any, mode: Any) -> Any:
    if K.ndim == 2:
        def num(K: Any, f: Any, s: Any, q: Any, i: Any, mode: Any) -> int:
            a = K[f, s]
            b = q[i]
            return -1 if a < b else (1 if b < a else 0)
        return num

    def byt(K: Any, f: Any, s: Any, q: Any, i: Any, mode: Any) -> int:
        return _bytes_cmp(K[f, s], q[i], mode)
    return byt


@overload(acmp, jit_options={"cache": True})  # type: ignore[typeddict-unknown-key]
def _acmp(A: Any, i: Any, q: Any, j: Any, mode: Any) -> Any:
    if A.ndim == 1:
        def num(A: Any, i: Any, q: Any, j: Any, mode: Any) -> int:
            a = A[i]
            b = q[j]
            return -1 if a < b else (1 if b < a else 0)
        return num

    def byt(A: Any, i: Any, q: Any, j: Any, mode: Any) -> int:
        return _bytes_cmp(A[i], q[j], mode)
    return byt


@jit
def _leaf(fence: Any, L: int, q: Any, i: int, mode: int) -> int:
    """Index of the leaf whose range holds ``q[i]``: fences ``fence[1:L] <= q[i]``."""
    lo = 1
    hi = L
    while lo < hi:
        mid = (lo + hi) >> 1
        if acmp(fence, mid, q, i, mode) <= 0:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@jit
def _bound(K: Any, f: int, c: int, q: Any, i: int, right: bool, mode: int) -> int:
    """First slot in ``[0, c)`` whose key is ``>= q[i]`` (``> q[i]`` with ``right``)."""
    return _bound_from(K, f, 0, c, q, i, right, mode)


@jit
def _bound_from(K: Any, f: int, lo: int, hi: int, q: Any, i: int, right: bool,
                mode: int) -> int:
    """`_bound` within slots ``[lo, hi)`` (the answer is known to lie there)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        d = kcmp(K, f, mid, q, i, mode)
        if d < 0 or (right and d == 0):
            lo = mid + 1
        else:
            hi = mid
    return lo


@jit
def locate(K: Any, lf: Any, counts: Any, fence: Any, q: Any, mode: int) -> Any:
    """``(leaf index, slot, found)`` of every query key; the slot is the lower bound.

    ``lf[l]`` is the frame of leaf ``l`` (in key order) and ``counts[l]`` its
    records. In an ascending run, a key in the same leaf as the previous one
    skips the fence search and searches only to the right of it.
    """
    n = q.shape[0]
    L = lf.shape[0]
    li = np.empty(n, np.intp)
    pos = np.empty(n, np.int64)
    found = np.zeros(n, np.bool_)
    for i in range(n):
        start = 0
        if i > 0 and acmp(q, i - 1, q, i, mode) <= 0 and (
                li[i - 1] == L - 1 or acmp(fence, li[i - 1] + 1, q, i, mode) > 0):
            l = li[i - 1]  # ascending batch, same leaf: search right of the previous key
            start = pos[i - 1]
        else:
            l = _leaf(fence, L, q, i, mode)
        f = lf[l]
        c = counts[l]
        p = _bound_from(K, f, start, c, q, i, False, mode)
        li[i] = l
        pos[i] = p
        found[i] = p < c and kcmp(K, f, p, q, i, mode) == 0
    return li, pos, found


@jit
def _move(frames: Any, f: int, off: int, size: int, s0: int, d0: int, m: int) -> None:
    """Move records ``[s0, s0 + m)`` of frame ``f`` to ``[d0, d0 + m)``; the ranges may
    overlap (memmove semantics: a slice assignment does not guarantee it)."""
    if m <= 0 or s0 == d0:
        return
    move_bytes(frames[f], off + d0 * size, off + s0 * size, m * size)


@jit
def merge_into_leaves(frames: Any, lf: Any, counts: Any, li: Any, pos: Any, found: Any,
                      ko: int, ks: int, vo: int, vs: int, kb: Any, vb: Any) -> None:
    """Write distinct ascending keys into leaves that have room for them, in place.

    Key ``i`` (bytes ``kb[i]``, value bytes ``vb[i]``) goes to leaf ``li[i]`` at
    lower-bound slot ``pos[i]``: it overwrites the value there when ``found[i]``,
    else it is inserted. Each leaf is merged from its end backwards, so every
    record moves once. ``counts`` is updated; the caller made the frames
    writable and rewrites the leaves' header counts and fences.
    """
    n = li.shape[0]
    b = n
    while b > 0:
        a = b - 1
        l = li[a]
        while a > 0 and li[a - 1] == l:
            a -= 1
        f = lf[l]
        c = counts[l]
        ins = 0
        for i in range(a, b):
            if not found[i]:
                ins += 1
        src = c - 1   # last old slot not yet moved
        dst = c + ins - 1
        for i in range(b - 1, a - 1, -1):
            p = pos[i]
            # old records at slots >= p (or > p when found) move right by the inserts left
            top = p if found[i] else p - 1
            m = src - top
            if m > 0:
                if dst != src:
                    _move(frames, f, ko, ks, top + 1, dst - m + 1, m)
                    _move(frames, f, vo, vs, top + 1, dst - m + 1, m)
                src -= m
                dst -= m
            if found[i]:
                # the old record at p stays (its key), its value is replaced
                if dst != src:
                    move_bytes(frames[f], ko + dst * ks, ko + src * ks, ks)
                src -= 1
            else:
                copy_bytes(frames[f, ko + dst * ks:ko + (dst + 1) * ks], kb[i])
            copy_bytes(frames[f, vo + dst * vs:vo + (dst + 1) * vs], vb[i])
            dst -= 1
        counts[l] = c + ins
        b = a


@jit
def span(K: Any, lf: Any, counts: Any, fence: Any, qlo: Any, has_lo: bool, lo_right: bool,
         qhi: Any, has_hi: bool, hi_right: bool, mode: int) -> Any:
    """Records between two bounds: ``(leaf a, slot p0, leaf b, end slot p1, n)``.

    The lower bound ``qlo[0]`` excludes keys ``< qlo`` (``<= qlo`` with
    ``lo_right``); the upper bound excludes keys ``>= qhi`` (``> qhi`` with
    ``hi_right``); a missing bound is open. The records are leaf ``a`` from
    ``p0``, the leaves between, and leaf ``b`` up to ``p1`` (normalized: ``p0`` is
    a record of ``a``, ``p1 > 0``). An empty range gives ``n == 0``.
    """
    L = lf.shape[0]
    a = 0
    p0 = 0
    b = L - 1
    p1 = counts[L - 1]
    if has_lo:
        a = _leaf(fence, L, qlo, 0, mode)
        p0 = _bound(K, lf[a], counts[a], qlo, 0, lo_right, mode)
    if has_hi:
        b = _leaf(fence, L, qhi, 0, mode)
        p1 = _bound(K, lf[b], counts[b], qhi, 0, hi_right, mode)
    while a < b and p0 >= counts[a]:
        a += 1
        p0 = 0
    while b > a and p1 == 0:
        b -= 1
        p1 = counts[b]
    if b < a or (a == b and p1 <= p0):
        return a, 0, a, 0, 0
    n = p1 - p0
    for l in range(a, b):
        n += counts[l]
    return a, p0, b, p1, n
