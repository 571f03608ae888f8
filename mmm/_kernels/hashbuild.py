"""Compiled bulk build of `mmm.structures.hashmap.HashMap` pages from distinct keys (numba).

`HashMap.load_distinct` fills an empty map with ``n`` keys known to be distinct
in two passes instead of ``n`` upserts (which split buckets again and again as
the map grows and probe pages in random order):

1. `plan`: hash every key (the map's splitmix64 over the key's words), find its
   bucket under the *final* number of buckets (chosen so that the map is at
   most at ``MAX_LOAD``: no split is ever needed) and counting-sort the rows by
   bucket;
2. `place`: bucket after bucket, put each row into the first EMPTY slot of its
   probe sequence in the last page of the bucket's chain, starting an overflow
   page when that page holds ``max_fill`` rows -- exactly where an upsert into
   a map of that geometry would put it -- and write the page headers (flags,
   bucket, next link, count and fill).

A bucket's pages are written while they are in cache, one after another, so
the build runs at memory speed. Keys must be distinct: `place` probes the
bucket's pages for an equal key before each insert (the pages are hot, so this
costs little) and stops at the first repeated key, reporting it.

The hash, bucket, probe and tag helpers and the header offsets are those of
`mmm._kernels.hashmap`, so a built map is read, updated and checked by the
ordinary kernels. The kernels only write pages the caller has just allocated
(fresh frames no snapshot can pin).

`gather_full` is the way back: every FULL slot's key and value copied out of
the pages in one pass (`HashMap.items`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mmm._kernels import jit
from mmm._kernels.hashmap import (NIL, OFF_AUX0, OFF_COUNT, OFF_FLAGS, OFF_NEXT, OFF_START,
                                  _bucket, _ca, _cga, _home, _ka, _mix, _step, _tag, _va)

__all__ = ["plan", "place", "gather_full", "DONE", "DUPLICATE"]

DONE, DUPLICATE = 0, 1


@jit
def plan(kw: Any, vb: Any, vw: Any, nbk: Any, lvl: Any) -> Any:
    """Hash the key words ``kw`` (``(n, W)`` uint64) and sort the rows by bucket.

    Returns ``(h, order, starts, kws, vbs)``: the hashes, keys and values
    (``vb``: ``(n, value_size)`` uint8 rows; ``vw``: the same as uint64 words
    when the value size is a multiple of 8, else empty) in bucket order
    (stable: input order within a bucket), ``order[r]`` the input row of
    sorted row ``r``, and bucket ``b``'s rows at ``starts[b]:starts[b + 1]``.
    Rows are scattered to their sorted place as they are read (sequential
    reads; the later pass over the pages then reads its input in order).
    """
    n = kw.shape[0]
    W = kw.shape[1]
    vs = vb.shape[1]
    words = vw.shape[0] == n and n > 0
    nvw = vw.shape[1]
    h = np.empty(n, np.uint64)
    bk = np.empty(n, np.int64)
    starts = np.zeros(nbk + 1, np.int64)
    for i in range(n):
        x = _mix(kw[i, 0])
        for j in range(1, W):
            x = _mix(x ^ kw[i, j])
        h[i] = x
        b = _bucket(x, nbk, lvl)
        bk[i] = b
        starts[b + 1] += 1
    for b in range(nbk):
        starts[b + 1] += starts[b]
    fill = starts[:nbk].copy()
    order = np.empty(n, np.int64)
    hs = np.empty(n, np.uint64)
    kws = np.empty((n, W), np.uint64)
    vbs = np.empty((n, vs), np.uint8)
    vws = vbs.reshape(-1).view(np.uint64) if words else np.empty(0, np.uint64)
    for i in range(n):
        b = bk[i]
        r = fill[b]
        fill[b] = r + 1
        order[r] = i
        hs[r] = h[i]
        for j in range(W):
            kws[r, j] = kw[i, j]
        if words:
            for j in range(nvw):
                vws[r * nvw + j] = vw[i, j]
        else:
            for j in range(vs):
                vbs[r, j] = vb[i, j]
    return hs, order, starts, kws, vbs


@jit
def place(pool: Any, frames: Any, first_page: Any, starts: Any, order: Any, h: Any,
          kw: Any, kb: Any, vb: Any, vw: Any, geo: Any, psid: Any, seqs: Any,
          state: Any) -> Any:
    """Write the rows (sorted by bucket, as `plan` returns them) into their buckets' pages.

    ``pool`` is the flat uint8 view of every frame, ``frames``/``seqs`` the
    frame and page sequence number of each allocated page, bucket ``b`` owning
    pages ``first_page[b]:first_page[b + 1]`` of them (its primary page first;
    the caller sized each chain as ``max(1, ceil(rows / max_fill))``).
    ``kw``/``kb`` are the keys as ``(n, W)`` uint64 words (zero-padded) and as
    their uint8 view, ``vb`` the values as ``(n, value_size)`` uint8 rows and
    ``vw`` the same as uint64 words when the value size is a multiple of 8
    (else empty); ``geo``
    = (n_buckets, S, G, n_groups, key_off, val_off, key_size, val_size,
    page_bytes, max_fill, then the map's layout tuple: `mmm._kernels.hashmap`). Returns `DONE`, or `DUPLICATE` with ``state[0]``
    the input row (``order`` maps sorted rows to input rows) whose key an
    earlier row already had.
    """
    nbk, G, nb, ks, vs, pb, max_fill = (geo[0], geo[2], geo[3], geo[6], geo[7], geo[8],
                                        geo[9])
    lay = (geo[10], geo[11], geo[12], geo[13], geo[14], geo[15], geo[16], geo[17])
    u8 = pool
    u16 = pool.view(np.uint16)
    u32 = pool.view(np.uint32)
    u64 = pool.view(np.uint64)
    k_words = ks % 8 == 0
    v_words = vs % 8 == 0
    kwn = ks // 8
    vwn = vs // 8
    for b in range(nbk):
        p0 = first_page[b]
        p1 = first_page[b + 1]
        for p in range(p0, p1):  # headers of the chain
            base = frames[p] * pb
            u16[(base + OFF_FLAGS) >> 1] = np.uint16(1 if p == p0 else 0)
            u64[(base + OFF_AUX0) >> 3] = np.uint64(b)
            if p + 1 < p1:
                u64[(base + OFF_NEXT) >> 3] = (np.uint64(psid) << np.uint64(32)) \
                    | np.uint64(seqs[p + 1])
            else:
                u64[(base + OFF_NEXT) >> 3] = NIL
        cur = p0
        in_cur = 0
        for i in range(starts[b], starts[b + 1]):
            x = h[i]
            tag = _tag(x)
            home = _home(x, nb)
            step = _step(x, nb)
            if in_cur >= max_fill:
                cur += 1
                in_cur = 0
            # probe the chain's pages for an equal key; in the last page the probe ends at
            # the group holding the first EMPTY slot of the sequence, where the row goes
            slot = np.int64(-1)
            for p in range(p0, cur + 1):
                base = frames[p] * pb
                g = home
                for _ in range(nb):
                    c0 = _cga(base, g, lay)
                    empty = -1
                    for j in range(G):
                        c = u8[c0 + j]
                        if c == tag:
                            ka = _ka(base, g * G + j, lay)
                            eq = True
                            if ks == 8:
                                eq = u64[ka >> 3] == kw[i, 0]
                            else:
                                for t in range(ks):
                                    if u8[ka + t] != kb[i, t]:
                                        eq = False
                                        break
                            if eq:
                                state[0] = order[i]
                                return DUPLICATE
                        elif c == 0 and empty < 0:
                            empty = j
                    if empty >= 0:
                        if p == cur:
                            slot = g * G + empty
                        break
                    g += step
                    if g >= nb:
                        g -= nb
            base = frames[cur] * pb
            u8[_ca(base, slot, lay)] = tag
            ka = _ka(base, slot, lay)
            if k_words:
                for t in range(kwn):
                    u64[(ka >> 3) + t] = kw[i, t]
            else:
                for t in range(ks):
                    u8[ka + t] = kb[i, t]
            va = _va(base, slot, lay)
            if v_words:
                for t in range(vwn):
                    u64[(va >> 3) + t] = vw[i, t]
            else:
                for t in range(vs):
                    u8[va + t] = vb[i, t]
            in_cur += 1
            a = (base + OFF_COUNT) >> 2
            u32[a] = np.uint32(in_cur)
            a = (base + OFF_START) >> 2
            u32[a] = np.uint32(in_cur)
    return DONE


@jit
def gather_full(pool: Any, frames: Any, starts: Any, geo: Any, kout: Any, vout: Any,
                kw: Any, vw: Any) -> None:
    """Copy the key and value of every FULL slot of ``frames`` into ``kout``/``vout``.

    Frame ``frames[p]``'s rows go to ``kout[starts[p]:starts[p + 1]]`` (its
    header count's share), in slot order: the storage order `HashMap.items`
    returns. ``geo`` = (S, key_off, val_off, key_size, val_size, page_bytes, then the
    map's layout tuple);
    ``kout``/``vout`` are ``(n, key_size)`` / ``(n, value_size)`` uint8, and
    ``kw``/``vw`` the same buffers flat as uint64 when the key size is 8 / the
    value size a multiple of 8 (else empty).
    """
    S, ks, vs, pb = geo[0], geo[3], geo[4], geo[5]
    lay = (geo[6], geo[7], geo[8], geo[9], geo[10], geo[11], geo[12], geo[13])
    u8 = pool
    u64 = pool.view(np.uint64)
    k8 = ks == 8
    vwords = vs % 8 == 0
    nvw = vs // 8
    for p in range(frames.shape[0]):
        base = frames[p] * pb
        r = starts[p]
        for s in range(S):
            if u8[_ca(base, s, lay)] >= 0x80:
                ka = _ka(base, s, lay)
                va = _va(base, s, lay)
                if k8:
                    kw[r] = u64[ka >> 3]
                else:
                    for t in range(ks):
                        kout[r, t] = u8[ka + t]
                if vwords:
                    for t in range(nvw):
                        vw[r * nvw + t] = u64[(va >> 3) + t]
                else:
                    for t in range(vs):
                        vout[r, t] = u8[va + t]
                r += 1
