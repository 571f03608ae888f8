"""Compiled kernels of the page manager and of the structures' lazy rebuild.

* `group_pages`: the page-table rebuild after a load or a re-attach — PageIDs
  of the loaded frames, sorted, are checked for duplicates (or deduplicated by
  version: a crash during copy-on-write leaves two frames with one PageID) and
  cut into page sets in one pass.
* `chain_order`: the order of a page set's pages along their ``next`` links
  (the doubly linked leaves of an `OrderedMap`, the pages of a sequence),
  checked to be one chain from the single head.
* `apply_undo`: a snapshot's view of pages copied out of soft-pinned frames: the
  undo log's before-images laid over the copies (`mmm.pool`).
* `copy_rows_out` / `copy_rows_in`: byte copies of record runs between page
  frames and a flat buffer, the span reads and writes of every structure;
  `copy_bytes` / `move_bytes`, the byte copies every kernel uses (a numba slice
  assignment copies through a temporary).

Kernels never raise for bad data: they return a status the caller turns into a
`PageFormatError` naming the page at fault.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mmm._kernels import jit

__all__ = ["group_pages", "chain_order", "copy_bytes", "move_bytes", "copy_rows_out",
           "copy_rows_in", "copy_frames", "gather_frames", "apply_undo"]

_NIL = np.uint64(0xFFFFFFFFFFFFFFFF)
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


@jit
def group_pages(ids: Any, versions: Any, order: Any, dedupe: bool) -> Any:
    """Cut loaded frames into page sets.

    ``order`` sorts ``ids`` (PageIDs of the frames, in frame order). Returns
    ``(keep, lose, set_starts, dup)``: ``keep`` the positions (into ``ids``) of
    the frames kept, sorted by PageID; ``lose`` the positions of older copies
    of a repeated PageID (with ``dedupe``; the newest ``version`` wins); and
    ``set_starts`` the boundaries in ``keep`` of each page set (one more entry
    than sets). Without ``dedupe`` a repeated PageID is reported in ``dup``
    (its position, else -1) and nothing else is computed.
    """
    n = order.shape[0]
    keep = np.empty(n, np.int64)
    lose = np.empty(n, np.int64)
    starts = np.empty(n + 1, np.int64)
    nk = 0
    nl = 0
    ns = 0
    i = 0
    while i < n:
        j = i + 1
        cur = ids[order[i]]
        while j < n and ids[order[j]] == cur:
            j += 1
        if j - i > 1 and not dedupe:
            return keep[:0], lose[:0], starts[:0], order[i]
        best = order[i]
        for t in range(i + 1, j):
            o = order[t]
            if versions[o] > versions[best]:
                lose[nl] = best
                best = o
            else:
                lose[nl] = o
            nl += 1
        if nk == 0 or (ids[keep[nk - 1]] >> _SHIFT) != (cur >> _SHIFT):
            starts[ns] = nk
            ns += 1
        keep[nk] = best
        nk += 1
        i = j
    starts[ns] = nk
    ns += 1
    return keep[:nk], lose[:nl], starts[:ns], -1


@jit
def chain_order(seqs: Any, prev: Any, nxt: Any) -> Any:
    """Order of pages ``seqs`` along their ``next`` links (PageIDs, NIL at the tail).

    Returns ``(order, heads, visited)``: ``heads`` counts the pages whose
    ``prev`` is NIL; the chain is valid when ``heads == 1`` and ``visited ==
    len(seqs)`` (every page once, the last one's ``next`` NIL). Otherwise
    ``order[:visited]`` is the prefix walked before the chain broke.
    """
    n = seqs.shape[0]
    order = np.empty(n, np.int64)
    if n == 0:
        return order, 0, 0
    top = 0
    for i in range(n):
        if seqs[i] > top:
            top = seqs[i]
    where = np.full(top + 1, -1, np.int64)
    for i in range(n):
        where[seqs[i]] = i
    heads = 0
    head = -1
    for i in range(n):
        if prev[i] == _NIL:
            heads += 1
            head = i
    if heads != 1:
        return order, heads, 0
    seen = np.zeros(n, np.bool_)
    cur = head
    k = 0
    while True:
        if seen[cur]:
            return order, heads, k
        seen[cur] = True
        order[k] = seqs[cur]
        k += 1
        nx = nxt[cur]
        if nx == _NIL:
            break
        s = np.int64(nx & _LOW32)
        if k == n or s > top or where[s] < 0:
            return order, heads, k
        cur = where[s]
    return order, heads, k


@jit
def copy_bytes(dst: Any, src: Any) -> None:
    """``dst[:] = src`` for two 1-D arrays of one length that do not overlap. A loop, not
    a slice assignment: numba copies an assigned slice through a temporary (it cannot
    rule out overlap), 10-15x slower than this loop, which LLVM turns into a memcpy."""
    for k in range(src.shape[0]):
        dst[k] = src[k]


@jit
def move_bytes(row: Any, dst: int, src: int, nb: int) -> None:
    """``row[dst:dst + nb] = row[src:src + nb]`` with memmove semantics (the ranges may
    overlap): copied in the direction that reads each byte before it is overwritten."""
    d = row[dst:dst + nb]
    s = row[src:src + nb]
    if dst > src:
        for k in range(nb - 1, -1, -1):
            d[k] = s[k]
    else:
        for k in range(nb):
            d[k] = s[k]


@jit
def copy_rows_out(frames: Any, fr: Any, first: Any, count: Any, off: Any, size: Any,
                  out: Any) -> None:
    """Copy ``count[j]`` records of ``size`` bytes from slot ``first[j]`` of frame
    ``fr[j]`` (record area at byte ``off``) to the flat byte buffer ``out``, in order."""
    o = 0
    for j in range(fr.shape[0]):
        nb = count[j] * size
        a = off + first[j] * size
        copy_bytes(out[o:o + nb], frames[fr[j], a:a + nb])
        o += nb


@jit
def copy_rows_in(frames: Any, fr: Any, first: Any, count: Any, off: Any, size: Any,
                 src: Any) -> None:
    """Inverse of `copy_rows_out`: write the flat buffer ``src`` into the frames
    (which the caller made writable)."""
    o = 0
    for j in range(fr.shape[0]):
        nb = count[j] * size
        a = off + first[j] * size
        copy_bytes(frames[fr[j], a:a + nb], src[o:o + nb])
        o += nb


@jit
def copy_frames(frames: Any, src: Any, dst: Any) -> None:
    """Copy whole frames: ``frames[dst[j]] = frames[src[j]]`` (no GIL held: bulk
    copy-on-write)."""
    w = frames.shape[1]
    for j in range(src.shape[0]):
        d, s = dst[j], src[j]
        for k in range(w):  # an explicit loop: a slice assignment copies through a
            frames[d, k] = frames[s, k]  # temporary, about 3x slower


@jit
def gather_frames(frames: Any, src: Any, out: Any, rows: Any) -> None:
    """Copy whole frames out of the pool: ``out[rows[j]] = frames[src[j]]`` (no GIL
    held: the staging copy of `mmm.Snapshot.stage_planned`)."""
    w = frames.shape[1]
    for j in range(src.shape[0]):
        d, s = rows[j], src[j]
        for k in range(w):  # an explicit loop (see `copy_frames`)
            out[d, k] = frames[s, k]


@jit
def apply_undo(undo: Any, data: Any, start: Any, frames: Any, order: Any, out: Any,
               rows: Any) -> int:
    """Lay the undo log's before-images (entries ``start`` .. the log's count, newest
    first, so the oldest image of a byte wins) over copied pages: ``out[rows[j]]`` is a
    copy of frame ``frames[j]``; ``order`` sorts ``frames``. Returns the entries applied.

    The caller copies the frames *before* this reads the log's count: an in-place write
    its copy may hold was logged before it was made (`mmm.pool`)."""
    n = undo[0]
    m = frames.shape[0]
    applied = 0
    for e in range(n - 1, start - 1, -1):
        b = 4 + 4 * e
        f = undo[b]
        lo, hi = 0, m  # binary search of f in frames (sorted by order)
        while lo < hi:
            mid = (lo + hi) // 2
            if frames[order[mid]] < f:
                lo = mid + 1
            else:
                hi = mid
        while lo < m and frames[order[lo]] == f:
            r = rows[order[lo]]
            off, ln, at = undo[b + 1], undo[b + 2], undo[b + 3]
            for k in range(ln):
                out[r, off + k] = data[at + k]
            applied += 1
            lo += 1
    return applied
