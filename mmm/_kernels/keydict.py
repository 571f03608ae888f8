"""Compiled kernels of `mmm.structures.keydict.KeyDict` (numba).

Page layouts (see the KeyDict module docstring); every address below is a
byte offset into the flat uint8 view of the pool, ``frame * page_bytes +
HDR + ...``::

    record (32 B, id-indexed)  [hash u64][data 20 B][lenf u32]
        lenf 0: free (data[0:8] = next free id + 1), 0xFFFFFFFF: the null
        key, else key length + 1; a key of up to 20 bytes sits in ``data``,
        a longer one in a chain of chunks whose first chunk + 1 is data[0:8]
    chunk (64 B)               [data 56 B][next chunk + 1 (0: end) i64]
    index slot (16 B)          [hash u64][id + 1 i64 (0: empty, -1: deleted)]
    control (int64 words)      see the C_* constants

Keys arrive in Arrow layout: ``data`` (uint8) and ``offs`` (int32 or int64,
``n + 1`` entries, any start). The hash is a word-at-a-time multiply-xorshift
over the key's bytes finished by splitmix64, ANDed with the dictionary's
``mask`` (all ones; tests force collisions with a narrow mask). Equal hashes
are resolved by comparing bytes.

Copy-on-write: a kernel never writes a frame whose pin count is non-zero. For
each row it first works out every page the row will write (index slot,
record, chunks, control page) and returns ``NEED_CLONE`` with the first pinned
one *before writing anything for that row*; likewise ``NEED_PAGE_REC`` /
``NEED_PAGE_CHUNK`` when the record or chunk pages are too few, and
``NEED_GROW`` when the index would pass its load limit. Between two calls
the dictionary is valid and holds the rows before the one returned. Every
page a kernel writes gets its modification epoch stamped, as the write
barrier does.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import numba
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped,unused-ignore]
from numba.core import cgutils, types
from numba.extending import intrinsic

from mmm._kernels import cacheable, jit

__all__ = ["intern_rows", "remove_rows", "rebuild_index", "key_lengths", "gather_keys",
           "live_mask", "hash_keys", "DONE", "NEED_CLONE", "NEED_PAGE_REC", "NEED_PAGE_CHUNK",
           "NEED_GROW", "MODE_LOOKUP", "MODE_INTERN"]

F = TypeVar("F", bound=Callable[..., Any])


def _scalar(fn: F) -> F:
    """A scalar helper, compiled into its callers."""
    out: F = numba.njit(inline="always", cache=cacheable(fn), nogil=True)(fn)  # type: ignore[assignment]
    return out


HDR = 64
REC = 32          # record bytes
INLINE = 20       # key bytes kept in the record
LENF_OFF = 28     # record: lenf (u32)
NULL_LEN = 0xFFFFFFFF
CHUNK = 64        # chunk bytes
CDATA = 56        # key bytes per chunk
SLOT = 16         # index slot bytes

# control words (int64, after the control page's header)
C_HIGH, C_LIVE, C_FREEID, C_CBUMP, C_FREECH, C_NULL, C_USED, C_TOMBS, C_IGEN, C_IPAGES = range(10)
N_CTL = 10

# geo: page_bytes, records/page, chunks/page, slots/page, index slots, hash mask, epoch,
# control seq, index load limit (used slots), record pages, chunk pages
G_PB, G_RPP, G_CPP, G_SPP, G_CAP, G_MASK, G_EPOCH, G_CSEQ, G_LIMIT, G_NRP, G_NCP = range(11)

DONE, NEED_CLONE, NEED_PAGE_REC, NEED_PAGE_CHUNK, NEED_GROW = 0, 1, 2, 3, 4
MODE_LOOKUP, MODE_INTERN = 0, 1

_K1 = np.uint64(0x9E3779B97F4A7C15)
_SEED = np.uint64(0x243F6A8885A308D3)


def _load_impl(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Unaligned little-endian uint64 load of ``arr[idx:idx + 8]`` (uint8 array; no bounds
    check: the caller guarantees the 8 bytes lie inside the array)."""
    sig = types.uint64(arr, idx)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(  # type: ignore[no-untyped-call]
            context, builder, aryty, ary, [args[1]])
        p64 = builder.bitcast(ptr, ir.IntType(64).as_pointer())
        return builder.load(p64, align=1)
    return sig, codegen


_ld: Any = intrinsic(_load_impl)


@_scalar
def _mix(x: Any) -> Any:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@_scalar
def _tail_mask(rem: Any) -> Any:
    """Low ``rem`` bytes set (1 <= rem <= 8)."""
    if rem >= 8:
        return np.uint64(0xFFFFFFFFFFFFFFFF)
    return (np.uint64(1) << np.uint64(8 * rem)) - np.uint64(1)


@_scalar
def _word(data: Any, p: Any, rem: Any, dlen: Any) -> Any:
    """The ``min(rem, 8)`` bytes at ``data[p:]`` as a zero-padded uint64, never reading
    past ``dlen``."""
    if p + 8 <= dlen:
        w = _ld(data, p)
        if rem < 8:
            w &= _tail_mask(rem)
        return w
    w = np.uint64(0)
    for t in range(min(rem, 8)):
        w |= np.uint64(data[p + t]) << np.uint64(8 * t)
    return w


@_scalar
def _hash(data: Any, a: Any, L: Any, dlen: Any, mask: Any) -> Any:
    h = _SEED ^ (np.uint64(L) * _K1)
    j = 0
    while j < L:
        w = _word(data, a + j, L - j, dlen)
        h = (h ^ w) * _K1
        h ^= h >> np.uint64(29)
        j += 8
    return _mix(h) & mask


@_scalar
def _eq_bytes(pool: Any, p: Any, data: Any, a: Any, n: Any, dlen: Any) -> Any:
    """``pool[p:p+n] == data[a:a+n]``; the pool side may be read up to 8 bytes past
    ``p + n`` rounded up (inside the record or chunk)."""
    j = 0
    while j < n:
        rem = n - j
        w = _word(data, a + j, rem, dlen)
        v = _ld(pool, p + j)
        if rem < 8:
            v &= _tail_mask(rem)
        if v != w:
            return False
        j += 8
    return True


@_scalar
def _key_eq(pool: Any, u32: Any, i64: Any, ra: Any, data: Any, a: Any, L: Any, dlen: Any,
            pb: Any, fseq: Any, cseqs: Any, CPP: Any) -> Any:
    """Whether the key of the record at ``ra`` equals ``data[a:a+L]``."""
    if np.int64(u32[(ra + LENF_OFF) >> 2]) != L + 1:
        return False
    if L <= INLINE:
        return _eq_bytes(pool, ra + 8, data, a, L, dlen)
    c = i64[(ra + 8) >> 3] - 1
    pos = 0
    while pos < L:
        ca = fseq[cseqs[c // CPP]] * pb + HDR + (c % CPP) * CHUNK
        m = min(CDATA, L - pos)
        if not _eq_bytes(pool, ca, data, a + pos, m, dlen):
            return False
        pos += m
        c = i64[(ca + CDATA) >> 3] - 1
    return True


@_scalar
def _put_bytes(pool: Any, u64: Any, p: Any, data: Any, a: Any, n: Any, dlen: Any) -> None:
    """Copy ``data[a:a+n]`` to ``pool[p:]`` (``p`` 8-aligned; writes exactly ``n`` bytes)."""
    j = 0
    while j + 8 <= n:
        u64[(p + j) >> 3] = _word(data, a + j, 8, dlen)
        j += 8
    while j < n:
        pool[p + j] = data[a + j]
        j += 1


@_scalar
def _home(h: Any, cap: Any) -> Any:
    return np.int64(((h >> np.uint64(32)) * np.uint64(cap)) >> np.uint64(32))


@jit
def hash_keys(data: Any, offs: Any, mask: Any) -> Any:
    """The dictionary hash of each key (tests and checks)."""
    n = offs.shape[0] - 1
    out = np.empty(n, np.uint64)
    dlen = data.shape[0]
    m = np.uint64(mask)
    for i in range(n):
        a = np.int64(offs[i])
        out[i] = _hash(data, a, np.int64(offs[i + 1]) - a, dlen, m)
    return out


@jit
def intern_rows(mode: Any, i0: Any, data: Any, offs: Any, valid: Any, has_valid: Any,
                pool: Any, fseq: Any, mod: Any, pins: Any, rseqs: Any, cseqs: Any, iseqs: Any,
                geo: Any, out: Any, scratch: Any, state: Any) -> Any:
    """Look up (``MODE_LOOKUP``) or intern (``MODE_INTERN``) rows ``i0..n-1`` in input order.

    ``out[i]`` gets each row's id (-1: absent, lookup only). ``state`` = [row, arg]:
    on return the row the kernel stopped at and the page seq (``NEED_CLONE``) or the
    chunks still missing (``NEED_PAGE_CHUNK``). ``scratch`` holds at least the chunk
    count of the longest key. Returns a status code.
    """
    pb = geo[G_PB]
    RPP = geo[G_RPP]
    CPP = geo[G_CPP]
    SPP = geo[G_SPP]
    cap = geo[G_CAP]
    mask = np.uint64(geo[G_MASK])
    epoch = geo[G_EPOCH]
    cseq = geo[G_CSEQ]
    limit = geo[G_LIMIT]
    nrp = geo[G_NRP]
    ncp = geo[G_NCP]
    u64 = pool.view(np.uint64)
    i64 = pool.view(np.int64)
    u32 = pool.view(np.uint32)
    n = out.shape[0]
    dlen = data.shape[0]
    cb = (fseq[cseq] * pb + HDR) >> 3
    for i in range(i0, n):
        state[0] = i
        isnull = has_valid and not valid[i]
        a = np.int64(offs[i])
        L = np.int64(offs[i + 1]) - a
        h = np.uint64(0)
        ins = np.int64(-1)
        tomb = np.int64(-1)
        if isnull:
            nid = i64[cb + C_NULL]
            if nid > 0 or mode == MODE_LOOKUP:
                out[i] = nid - 1
                continue
        else:
            h = _hash(data, a, L, dlen, mask)
            g = _home(h, cap)
            p = g // SPP
            s = g - p * SPP
            found = np.int64(-1)
            while True:
                sa = fseq[iseqs[p]] * pb + HDR + s * SLOT
                v = i64[(sa >> 3) + 1]
                if v == 0:
                    break
                if v < 0:
                    if tomb < 0:
                        tomb = g
                elif u64[sa >> 3] == h:
                    rid = v - 1
                    ra = fseq[rseqs[rid // RPP]] * pb + HDR + (rid % RPP) * REC
                    if _key_eq(pool, u32, i64, ra, data, a, L, dlen, pb, fseq, cseqs, CPP):
                        found = rid
                        break
                g += 1
                s += 1
                if g == cap:
                    g = 0
                    p = 0
                    s = 0
                elif s == SPP:
                    p += 1
                    s = 0
            if found >= 0 or mode == MODE_LOOKUP:
                out[i] = found
                continue
            ins = g if tomb < 0 else tomb
            if tomb < 0 and i64[cb + C_USED] + 1 > limit:
                return NEED_GROW
        # -- a new key: find every page it writes, un-shared, before writing anything --------
        if pins[fseq[cseq]] > 0:
            state[1] = cseq
            return NEED_CLONE
        fh = i64[cb + C_FREEID]
        nid = fh - 1 if fh > 0 else i64[cb + C_HIGH]
        if nid >= nrp * RPP:
            return NEED_PAGE_REC
        rq = rseqs[nid // RPP]
        if pins[fseq[rq]] > 0:
            state[1] = rq
            return NEED_CLONE
        iq = np.int64(-1)
        if not isnull:
            iq = iseqs[ins // SPP]
            if pins[fseq[iq]] > 0:
                state[1] = iq
                return NEED_CLONE
        k = 0
        rest = 0
        c = np.int64(0)
        bump = i64[cb + C_CBUMP]
        if not isnull and L > INLINE:
            k = (L + CDATA - 1) // CDATA
            c = i64[cb + C_FREECH]
            taken = 0
            while taken < k and c > 0:
                q = cseqs[(c - 1) // CPP]
                if pins[fseq[q]] > 0:
                    state[1] = q
                    return NEED_CLONE
                scratch[taken] = c - 1
                ca = fseq[q] * pb + HDR + ((c - 1) % CPP) * CHUNK
                c = i64[(ca + CDATA) >> 3]
                taken += 1
            rest = k - taken
            if bump + rest > ncp * CPP:
                state[1] = bump + rest - ncp * CPP
                return NEED_PAGE_CHUNK
            for r in range(rest):
                q = cseqs[(bump + r) // CPP]
                if pins[fseq[q]] > 0:
                    state[1] = q
                    return NEED_CLONE
                scratch[taken + r] = bump + r
        # -- write ---------------------------------------------------------------------------
        mod[cseq] = epoch
        ra = fseq[rq] * pb + HDR + (nid % RPP) * REC
        if fh > 0:
            i64[cb + C_FREEID] = i64[(ra + 8) >> 3]
        else:
            i64[cb + C_HIGH] += 1
        mod[rq] = epoch
        u64[(ra + 8) >> 3] = np.uint64(0)
        u64[(ra + 16) >> 3] = np.uint64(0)
        u32[(ra + 24) >> 2] = np.uint32(0)
        if isnull:
            u64[ra >> 3] = np.uint64(0)
            u32[(ra + LENF_OFF) >> 2] = np.uint32(NULL_LEN)
            i64[cb + C_NULL] = nid + 1
        else:
            u64[ra >> 3] = h
            u32[(ra + LENF_OFF) >> 2] = np.uint32(L + 1)
            if k == 0:
                _put_bytes(pool, u64, ra + 8, data, a, L, dlen)
            else:
                for t in range(k):
                    cc = scratch[t]
                    q = cseqs[cc // CPP]
                    mod[q] = epoch
                    ca = fseq[q] * pb + HDR + (cc % CPP) * CHUNK
                    pos = t * CDATA
                    _put_bytes(pool, u64, ca, data, a + pos, min(CDATA, L - pos), dlen)
                    i64[(ca + CDATA) >> 3] = scratch[t + 1] + 1 if t + 1 < k else 0
                i64[(ra + 8) >> 3] = scratch[0] + 1
                i64[cb + C_FREECH] = c
                i64[cb + C_CBUMP] = bump + rest
            sa = fseq[iq] * pb + HDR + (ins % SPP) * SLOT
            mod[iq] = epoch
            u64[sa >> 3] = h
            i64[(sa >> 3) + 1] = nid + 1
            if tomb < 0:
                i64[cb + C_USED] += 1
            else:
                i64[cb + C_TOMBS] -= 1
        i64[cb + C_LIVE] += 1
        out[i] = nid
    state[0] = n
    return DONE


@jit
def remove_rows(i0: Any, ids: Any, pool: Any, fseq: Any, mod: Any, pins: Any, rseqs: Any,
                cseqs: Any, iseqs: Any, geo: Any, state: Any) -> Any:
    """Forget the keys of ``ids[i0:]`` (live and distinct: the caller checked): their
    index slots become deleted, their records join the free id list (so the next new key
    takes the last id removed) and their chunks the free chunk list.
    ``state`` = [row, page seq of ``NEED_CLONE``]."""
    pb = geo[G_PB]
    RPP = geo[G_RPP]
    CPP = geo[G_CPP]
    SPP = geo[G_SPP]
    cap = geo[G_CAP]
    epoch = geo[G_EPOCH]
    cseq = geo[G_CSEQ]
    u64 = pool.view(np.uint64)
    i64 = pool.view(np.int64)
    u32 = pool.view(np.uint32)
    cb = (fseq[cseq] * pb + HDR) >> 3
    for i in range(i0, ids.shape[0]):
        state[0] = i
        rid = ids[i]
        rq = rseqs[rid // RPP]
        ra = fseq[rq] * pb + HDR + (rid % RPP) * REC
        lenf = np.int64(u32[(ra + LENF_OFF) >> 2])
        if pins[fseq[cseq]] > 0:
            state[1] = cseq
            return NEED_CLONE
        if pins[fseq[rq]] > 0:
            state[1] = rq
            return NEED_CLONE
        isnull = lenf == NULL_LEN
        iq = np.int64(-1)
        slot = np.int64(-1)
        tail = np.int64(-1)
        if not isnull:
            h = u64[ra >> 3]
            g = _home(h, cap)
            while True:
                p = g // SPP
                sa = fseq[iseqs[p]] * pb + HDR + (g - p * SPP) * SLOT
                v = i64[(sa >> 3) + 1]
                if v == rid + 1:
                    slot = g
                    iq = iseqs[p]
                    break
                if v == 0:
                    break  # not reachable: the caller checked the id is live
                g += 1
                if g == cap:
                    g = 0
            if iq >= 0 and pins[fseq[iq]] > 0:
                state[1] = iq
                return NEED_CLONE
            L = lenf - 1
            if L > INLINE:
                c = i64[(ra + 8) >> 3] - 1
                while True:
                    q = cseqs[c // CPP]
                    ca = fseq[q] * pb + HDR + (c % CPP) * CHUNK
                    nxt = i64[(ca + CDATA) >> 3]
                    if nxt == 0:
                        break
                    c = nxt - 1
                tail = c
                q = cseqs[tail // CPP]
                if pins[fseq[q]] > 0:
                    state[1] = q
                    return NEED_CLONE
        # -- write ---------------------------------------------------------------------------
        mod[cseq] = epoch
        mod[rq] = epoch
        if isnull:
            i64[cb + C_NULL] = 0
        else:
            if slot >= 0:
                sa = fseq[iq] * pb + HDR + (slot % SPP) * SLOT
                mod[iq] = epoch
                u64[sa >> 3] = np.uint64(0)
                i64[(sa >> 3) + 1] = -1
                i64[cb + C_TOMBS] += 1
            if tail >= 0:
                q = cseqs[tail // CPP]
                mod[q] = epoch
                ca = fseq[q] * pb + HDR + (tail % CPP) * CHUNK
                i64[(ca + CDATA) >> 3] = i64[cb + C_FREECH]
                i64[cb + C_FREECH] = i64[(ra + 8) >> 3]
        u64[ra >> 3] = np.uint64(0)
        i64[(ra + 8) >> 3] = i64[cb + C_FREEID]
        u64[(ra + 16) >> 3] = np.uint64(0)
        u32[(ra + 24) >> 2] = np.uint32(0)
        u32[(ra + LENF_OFF) >> 2] = np.uint32(0)
        i64[cb + C_FREEID] = rid + 1
        i64[cb + C_LIVE] -= 1
    state[0] = ids.shape[0]
    return DONE


@jit
def rebuild_index(pool: Any, fseq: Any, rseqs: Any, newseqs: Any, high: Any, geo: Any
                  ) -> Any:
    """Insert every live non-null record, in id order, into the empty index of pages
    ``newseqs`` (``geo``'s slots per page; ``len(newseqs) * SPP`` slots). Returns the
    slots used."""
    pb = geo[G_PB]
    RPP = geo[G_RPP]
    SPP = geo[G_SPP]
    cap = newseqs.shape[0] * SPP
    u64 = pool.view(np.uint64)
    i64 = pool.view(np.int64)
    u32 = pool.view(np.uint32)
    used = 0
    for rid in range(high):
        ra = fseq[rseqs[rid // RPP]] * pb + HDR + (rid % RPP) * REC
        lenf = np.int64(u32[(ra + LENF_OFF) >> 2])
        if lenf == 0 or lenf == NULL_LEN:
            continue
        h = u64[ra >> 3]
        g = _home(h, cap)
        while True:
            p = g // SPP
            sa = fseq[newseqs[p]] * pb + HDR + (g - p * SPP) * SLOT
            if i64[(sa >> 3) + 1] == 0:
                u64[sa >> 3] = h
                i64[(sa >> 3) + 1] = rid + 1
                used += 1
                break
            g += 1
            if g == cap:
                g = 0
    return used


@jit
def key_lengths(ids: Any, pool: Any, fseq: Any, rseqs: Any, geo: Any, high: Any,
                lens: Any) -> Any:
    """``lens[i]``: the key length of ``ids[i]`` (-1 for the null key). Returns the
    index of the first id that is not live, or -1."""
    pb = geo[G_PB]
    RPP = geo[G_RPP]
    u32 = pool.view(np.uint32)
    for i in range(ids.shape[0]):
        rid = ids[i]
        if rid < 0 or rid >= high:
            return i
        ra = fseq[rseqs[rid // RPP]] * pb + HDR + (rid % RPP) * REC
        lenf = np.int64(u32[(ra + LENF_OFF) >> 2])
        if lenf == 0:
            return i
        lens[i] = -1 if lenf == NULL_LEN else lenf - 1
    return -1


@jit
def gather_keys(ids: Any, pool: Any, fseq: Any, rseqs: Any, cseqs: Any, geo: Any,
                offs: Any, out: Any) -> None:
    """Copy the keys of live ``ids`` to ``out`` at ``offs`` (from `key_lengths`)."""
    pb = geo[G_PB]
    RPP = geo[G_RPP]
    CPP = geo[G_CPP]
    i64 = pool.view(np.int64)
    for i in range(ids.shape[0]):
        rid = ids[i]
        ra = fseq[rseqs[rid // RPP]] * pb + HDR + (rid % RPP) * REC
        o = offs[i]
        L = offs[i + 1] - o
        if L <= INLINE:
            for t in range(L):
                out[o + t] = pool[ra + 8 + t]
            continue
        c = i64[(ra + 8) >> 3] - 1
        pos = 0
        while pos < L:
            ca = fseq[cseqs[c // CPP]] * pb + HDR + (c % CPP) * CHUNK
            m = min(CDATA, L - pos)
            out[o + pos:o + pos + m] = pool[ca:ca + m]
            pos += m
            c = i64[(ca + CDATA) >> 3] - 1


@jit
def live_mask(pool: Any, fseq: Any, rseqs: Any, geo: Any, high: Any) -> Any:
    """Which ids below ``high`` hold a key (the null key included)."""
    pb = geo[G_PB]
    RPP = geo[G_RPP]
    u32 = pool.view(np.uint32)
    out = np.zeros(high, np.bool_)
    for rid in range(high):
        ra = fseq[rseqs[rid // RPP]] * pb + HDR + (rid % RPP) * REC
        out[rid] = u32[(ra + LENF_OFF) >> 2] != 0
    return out
