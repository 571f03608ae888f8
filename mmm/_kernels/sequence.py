"""Compiled kernels of `mmm.structures.sequence` (`PagedList`, `PagedDeque`).

Span reads and writes of records use `mmm._kernels.pages.copy_rows_out` /
`copy_rows_in`; the eviction bound search is here. Field values are compared
like ordered-map keys (`mmm._kernels.ordered.kcmp`): typed for native numeric
fields, as byte rows otherwise.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mmm._kernels import jit
from mmm._kernels.ordered import kcmp

__all__ = ["count_before"]


@jit
def count_before(col: Any, psf: Any, seqs: Any, hs: Any, cnt: Any, q: Any, right: bool,
                 mode: int) -> int:
    """Records at the front whose field is ``< q[0]`` (``<= q[0]`` with ``right``), for a sequence nondecreasing in it.

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
    if lo < n:
        a = 0
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
    return total
