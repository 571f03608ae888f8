"""Compiled kernels of `mmm.structures.sequence` (`PagedList`, `PagedDeque`).

Span reads and writes of records use `mmm._kernels.pages.copy_rows_out` /
`copy_rows_in`; the eviction bound search and the page writes of an append
(`append_rows`) are here. Field values are compared
like ordered-map keys (`mmm._kernels.ordered.kcmp`): typed for native numeric
fields, as byte rows otherwise.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mmm._kernels import jit
from mmm._kernels.pages import copy_bytes
from mmm._kernels.ordered import kcmp

__all__ = ["count_before", "append_rows"]


@jit
def count_before(col: Any, psf: Any, seqs: Any, hs: Any, cnt: Any, q: Any, right: bool,
                 mode: int) -> Any:
    """Records at the front whose field is ``< q[0]`` (``<= q[0]`` with ``right``), for a
    sequence nondecreasing in it: ``(total, page, k)``, the first record kept being record
    ``k`` of list position ``page`` (``page == len(seqs)``: none is kept).

    ``col[frame, slot]`` is the field; the pages in order are ``seqs`` (their
    frames ``psf[seqs]``, first slots ``hs[frame]``, counts ``cnt``). A binary
    search over the pages' last records, then one within the boundary page.
    """
    n = seqs.shape[0]
    lo = 0
    hi = n
    while lo < hi:  # first page whose last record is >= q
        mid = (lo + hi) >> 1
        fm = psf[seqs[mid]]
        d = kcmp(col, fm, np.int64(hs[fm]) + cnt[mid] - 1, q, 0, mode) if cnt[mid] else -1
        if d < 0 or (right and d == 0):
            lo = mid + 1
        else:
            hi = mid
    total = 0
    for p in range(lo):
        total += cnt[p]
    a = 0
    if lo < n:
        b = cnt[lo]
        f = psf[seqs[lo]]
        s0 = np.int64(hs[f])
        while a < b:
            mid = (a + b) >> 1
            d = kcmp(col, f, s0 + mid, q, 0, mode)
            if d < 0 or (right and d == 0):
                a = mid + 1
            else:
                b = mid
        total += a
    return total, lo, a


@jit
def append_rows(frames: Any, hc: Any, hp: Any, hn: Any, tail: int, tail_seq: int, at: int,
                m: int, fn: Any, new: Any, counts: Any, top: Any, off: int, size: int,
                src: Any) -> None:
    """The page writes of appending the flat records ``src`` (``size`` bytes each): the
    first ``m`` into frame ``tail`` (writable) from slot ``at`` on, its count raised by
    ``m``; the rest into the new frames ``fn`` (pages ``new``, ``counts[j]`` records
    each from slot 0, the rest of the frame after them zeroed: they were allocated
    unzeroed), linked after page ``tail_seq`` (-1: none) by PageIDs ``top | seq``.
    ``hc``/``hp``/``hn`` are the pool's header count / prev / next."""
    o = 0
    if m > 0:
        nb = m * size
        a = off + at * size
        copy_bytes(frames[tail, a:a + nb], src[0:nb])
        hc[tail] += m
        o = nb
    k = fn.shape[0]
    for j in range(k):
        f = fn[j]
        nb = counts[j] * size
        copy_bytes(frames[f, off:off + nb], src[o:o + nb])
        rest = frames[f, off + nb:]
        for t in range(rest.shape[0]):  # (a 1-D loop: LLVM makes it a memset)
            rest[t] = 0
        o += nb
        hc[f] = counts[j]
        if j > 0:
            hp[f] = top | np.uint64(new[j - 1])
        elif tail_seq >= 0:
            hp[f] = top | np.uint64(tail_seq)
        if j + 1 < k:
            hn[f] = top | np.uint64(new[j + 1])
    if k > 0 and tail_seq >= 0:
        hn[tail] = top | np.uint64(new[0])
