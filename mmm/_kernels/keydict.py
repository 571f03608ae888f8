"""Compiled kernels of `mmm.structures.keydict.KeyDict` (numba).

Page layouts (see the KeyDict module docstring); every address below is a
byte offset into the flat uint8 view of the pool, ``frame * page_bytes +
HDR + ...``::

    record (32 B, id-indexed)  [hash u64][data 20 B][lenf u32]
        lenf 0: free (data[0:8] = next free id + 1), 0xFFFFFFFF: the null
        key, else key length + 1; a key of up to 20 bytes sits in ``data``,
        a longer one in a chain of chunks whose first chunk + 1 is data[0:8]
    chunk (64 B)               [data 56 B][next chunk + 1 (0: end) i64]
    index slot (32 B)          [hash u64][id + 1 i64 (0: empty, -1: deleted)][key 15 B][len u8]
        a key of up to 15 bytes is copied into its slot (len byte: its length), so
        finding it reads one cache line; a longer key has len byte 0xFF, its length
        (u32) at byte 24 and, beyond 20 bytes, its first chunk + 1 at byte 16
        (compared along the chunks without reading the record)
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
from mmm._kernels.hashmap import _mix as _hashmap_mix
from mmm._kernels.hashmap import _prefetch

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
SLOT = 32         # index slot bytes
SLOT_INLINE = 15  # key bytes copied into the index slot
SLOT_LONG = 0xFF  # slot length byte of a longer key

# control words (int64, after the control page's header)
C_HIGH, C_LIVE, C_FREEID, C_CBUMP, C_FREECH, C_NULL, C_USED, C_TOMBS, C_IGEN, C_IPAGES = range(10)
N_CTL = 10

# geo: page_bytes, records/page, chunks/page, slots/page, index slots, hash mask, epoch,
# control seq, index load limit (used slots), record pages, chunk pages, and the `magic`
# of records/page, chunks/page, slots/page
(G_PB, G_RPP, G_CPP, G_SPP, G_CAP, G_MASK, G_EPOCH, G_CSEQ, G_LIMIT, G_NRP, G_NCP, G_MR, G_MC,
 G_MS) = range(14)

DONE, NEED_CLONE, NEED_PAGE_REC, NEED_PAGE_CHUNK, NEED_GROW = 0, 1, 2, 3, 4
MODE_LOOKUP, MODE_INTERN = 0, 1

_K1 = np.uint64(0x9E3779B97F4A7C15)
_SEED = np.uint64(0x243F6A8885A308D3)


def _ptr(builder: Any, addr: Any, bits: int) -> Any:
    return builder.inttoptr(addr, ir.IntType(bits).as_pointer())


def _load_impl(typingctx: Any, addr: Any) -> Any:
    """Unaligned little-endian uint64 load from byte address ``addr`` (no check: the
    caller guarantees the 8 bytes are readable)."""
    sig = types.uint64(types.int64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.load(_ptr(builder, args[0], 64), align=1)
    return sig, codegen


def _load8_impl(typingctx: Any, addr: Any) -> Any:
    """The byte at address ``addr``, as a uint64."""
    sig = types.uint64(types.int64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.zext(builder.load(_ptr(builder, args[0], 8), align=1), ir.IntType(64))
    return sig, codegen


def _store_impl(typingctx: Any, addr: Any, w: Any) -> Any:
    """Unaligned uint64 store of ``w`` to byte address ``addr``."""
    sig = types.void(types.int64, types.uint64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        builder.store(args[1], _ptr(builder, args[0], 64), align=1)
        return context.get_dummy_value()
    return sig, codegen


def _store8_impl(typingctx: Any, addr: Any, w: Any) -> Any:
    """Store the low byte of ``w`` to byte address ``addr``."""
    sig = types.void(types.int64, types.uint64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        builder.store(builder.trunc(args[1], ir.IntType(8)), _ptr(builder, args[0], 8), align=1)
        return context.get_dummy_value()
    return sig, codegen


def _mulhi_impl(typingctx: Any, a: Any, b: Any) -> Any:
    """The high 64 bits of the 128-bit product of uint64 ``a`` and ``b``."""
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        i128 = ir.IntType(128)
        prod = builder.mul(builder.zext(args[0], i128), builder.zext(args[1], i128))
        return builder.trunc(builder.lshr(prod, ir.Constant(i128, 64)), ir.IntType(64))
    return sig, codegen


_mulhi: Any = intrinsic(_mulhi_impl)


def magic(d: int) -> int:
    """``ceil(2**64 / d)`` as an int64 bit pattern: `_div` by ``d`` (2 <= d < 2**16) is then
    exact for dividends below 2**48 (the error ``m * d - 2**64 < d`` stays below one)."""
    m = -(-(1 << 64) // d)
    return m - (1 << 64) if m >= 1 << 63 else m


@numba.njit(inline="always", cache=True, nogil=True)
def _div(x: Any, m: Any) -> Any:
    """``x // d`` for ``0 <= x < 2**48`` given ``m = magic(d)``: no division instruction
    (a 64-bit division costs tens of cycles, several per row)."""
    return np.int64(_mulhi(np.uint64(x), np.uint64(m)))


# The helpers below take raw byte addresses (``arr.ctypes.data`` + offset), never arrays:
# a numba call that takes arrays costs reference counting per call, even inlined.
_ld: Any = intrinsic(_load_impl)
_ld8: Any = intrinsic(_load8_impl)
_st: Any = intrinsic(_store_impl)
_st8: Any = intrinsic(_store8_impl)
_mix: Any = _hashmap_mix  # splitmix64 finalizer, shared with the hash map's kernels


@_scalar
def _tail_mask(rem: Any) -> Any:
    """Low ``rem`` bytes set (1 <= rem <= 8)."""
    if rem >= 8:
        return np.uint64(0xFFFFFFFFFFFFFFFF)
    return (np.uint64(1) << np.uint64(8 * rem)) - np.uint64(1)


@_scalar
def _word(db: Any, p: Any, rem: Any, dlen: Any) -> Any:
    """The ``min(rem, 8)`` bytes at offset ``p`` of the data buffer at address ``db``
    (``dlen`` bytes long) as a zero-padded uint64, never reading past its end."""
    if p + 8 <= dlen:
        w = _ld(db + p)
        if rem < 8:
            w &= _tail_mask(rem)
        return w
    w = np.uint64(0)
    for t in range(min(rem, 8)):
        w |= _ld8(db + p + t) << np.uint64(8 * t)
    return w


@_scalar
def _hash(db: Any, a: Any, L: Any, dlen: Any, mask: Any) -> Any:
    h = _SEED ^ (np.uint64(L) * _K1)
    j = 0
    while j < L:
        w = _word(db, a + j, L - j, dlen)
        h = (h ^ w) * _K1
        h ^= h >> np.uint64(29)
        j += 8
    return _mix(h) & mask


@_scalar
def _eq_bytes(pa: Any, db: Any, a: Any, n: Any, dlen: Any) -> Any:
    """The ``n`` bytes at address ``pa`` (a record or chunk: readable up to 8 bytes past
    ``n`` rounded up) equal ``data[a:a+n]``."""
    j = 0
    while j < n:
        rem = n - j
        w = _word(db, a + j, rem, dlen)
        v = _ld(pa + j)
        if rem < 8:
            v &= _tail_mask(rem)
        if v != w:
            return False
        j += 8
    return True


@_scalar
def _put_bytes(pa: Any, db: Any, a: Any, n: Any, dlen: Any) -> None:
    """Copy ``data[a:a+n]`` to address ``pa`` (writes exactly ``n`` bytes)."""
    j = 0
    while j + 8 <= n:
        _st(pa + j, _word(db, a + j, 8, dlen))
        j += 8
    while j < n:
        _st8(pa + j, _ld8(db + a + j))
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
    db = np.int64(data.ctypes.data)
    m = np.uint64(mask)
    for i in range(n):
        a = np.int64(offs[i])
        out[i] = _hash(db, a, np.int64(offs[i + 1]) - a, dlen, m)
    return out


CHUNK_ROWS = 32  # rows hashed and prefetched ahead: enough misses in flight


@jit
def intern_rows(mode: Any, i0: Any, db: Any, dlen: Any, offs: Any, valid: Any, has_valid: Any,
                pool: Any, fseq: Any, mod: Any, pins: Any, rseqs: Any, cseqs: Any, iseqs: Any,
                geo: Any, out: Any, scratch: Any, state: Any) -> Any:
    """Look up (``MODE_LOOKUP``) or intern (``MODE_INTERN``) rows ``i0..n-1`` in input order.

    The keys' bytes are at address ``db`` (``dlen`` bytes, kept alive by the caller:
    an address rather than an array, so read-only and writable buffers share one
    compiled kernel). ``out[i]`` gets each row's id (-1: absent, lookup only). ``state`` = [row, arg]:
    on return the row the kernel stopped at and the page seq (``NEED_CLONE``) or the
    chunks still missing (``NEED_PAGE_CHUNK``). ``scratch`` holds at least the chunk
    count of the longest key. Returns a status code.

    Rows go in chunks of `CHUNK_ROWS`: hash each row and prefetch its home index slot,
    then prefetch the record the home slot names when its hash matches, then probe,
    compare and insert in input order.
    """
    pb = geo[G_PB]
    RPP = geo[G_RPP]
    MR = geo[G_MR]
    CPP = geo[G_CPP]
    MC = geo[G_MC]
    SPP = geo[G_SPP]
    MS = geo[G_MS]
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
    pbase = np.int64(pool.ctypes.data)
    n = out.shape[0]
    cb = (fseq[cseq] * pb + HDR) >> 3
    CH = CHUNK_ROWS
    hs = np.empty(CH, np.uint64)
    homes = np.empty(CH, np.int64)
    hit = np.zeros(CH, np.bool_)
    c0 = i0
    while c0 < n:
        c1 = min(c0 + CH, n)
        for i in range(c0, c1):  # hash, prefetch the home slot
            if has_valid and not valid[i]:
                continue
            a = np.int64(offs[i])
            h = _hash(db, a, np.int64(offs[i + 1]) - a, dlen, mask)
            g = _home(h, cap)
            hs[i - c0] = h
            homes[i - c0] = g
            p = _div(g, MS)
            _prefetch(pool, fseq[iseqs[p]] * pb + HDR + (g - p * SPP) * SLOT)
        for i in range(c0, c1):  # a short key in its home slot is found here; for a long
            hit[i - c0] = False  # one, prefetch the record the home slot names
            if has_valid and not valid[i]:
                continue
            g = homes[i - c0]
            p = _div(g, MS)
            sa = fseq[iseqs[p]] * pb + HDR + (g - p * SPP) * SLOT
            v = i64[(sa >> 3) + 1]
            if v <= 0 or u64[sa >> 3] != hs[i - c0]:
                continue
            lb = pool[sa + 31]
            if lb != SLOT_LONG:
                a = np.int64(offs[i])
                L = np.int64(offs[i + 1]) - a
                if np.int64(lb) == L and _eq_bytes(pbase + sa + 16, db, a, L, dlen):
                    out[i] = v - 1  # an existing key does not move while the batch runs
                    hit[i - c0] = True
            else:
                head = i64[(sa + 16) >> 3]
                if head > 0:  # a key of more than 20 bytes: its first chunk
                    c = head - 1
                    _prefetch(pool, fseq[cseqs[_div(c, MC)]] * pb + HDR +
                              (c - _div(c, MC) * CPP) * CHUNK)
                else:
                    rid = v - 1
                    _prefetch(pool, fseq[rseqs[_div(rid, MR)]] * pb + HDR +
                              (rid - _div(rid, MR) * RPP) * REC)
        for i in range(c0, c1):
            if hit[i - c0]:
                continue
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
                h = hs[i - c0]
                g = homes[i - c0]
                p = _div(g, MS)
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
                    elif u64[sa >> 3] == h and pool[sa + 31] != SLOT_LONG:
                        if np.int64(pool[sa + 31]) == L and _eq_bytes(pbase + sa + 16, db, a, L,
                                                                    dlen):
                            found = v - 1
                            break
                    elif u64[sa >> 3] == h and L > SLOT_INLINE and \
                            np.int64(u32[(sa + 24) >> 2]) == L:
                        rid = v - 1
                        if L <= INLINE:  # in the record
                            ra = fseq[rseqs[_div(rid, MR)]] * pb + HDR + \
                                (rid - _div(rid, MR) * RPP) * REC
                            eq = _eq_bytes(pbase + ra + 8, db, a, L, dlen)
                        else:  # along the chunk chain, from the slot's first chunk
                            eq = True
                            c = i64[(sa + 16) >> 3] - 1
                            pos = np.int64(0)
                            while pos < L:
                                ca = fseq[cseqs[_div(c, MC)]] * pb + HDR + \
                                    (c - _div(c, MC) * CPP) * CHUNK
                                m = CDATA if L - pos > CDATA else L - pos
                                if not _eq_bytes(pbase + ca, db, a + pos, m, dlen):
                                    eq = False
                                    break
                                pos += m
                                c = i64[(ca + CDATA) >> 3] - 1
                        if eq:
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
            # -- a new key: find every page it writes, un-shared, before writing anything --
            if pins[fseq[cseq]] > 0:
                state[1] = cseq
                return NEED_CLONE
            fh = i64[cb + C_FREEID]
            nid = fh - 1 if fh > 0 else i64[cb + C_HIGH]
            if nid >= nrp * RPP:
                return NEED_PAGE_REC
            rq = rseqs[_div(nid, MR)]
            if pins[fseq[rq]] > 0:
                state[1] = rq
                return NEED_CLONE
            iq = np.int64(-1)
            if not isnull:
                iq = iseqs[_div(ins, MS)]
                if pins[fseq[iq]] > 0:
                    state[1] = iq
                    return NEED_CLONE
            k = np.int64(0)
            rest = np.int64(0)
            c = np.int64(0)
            bump = i64[cb + C_CBUMP]
            if not isnull and L > INLINE:
                k = (L + CDATA - 1) // CDATA
                c = i64[cb + C_FREECH]
                taken = 0
                while taken < k and c > 0:
                    q = cseqs[_div((c - 1), MC)]
                    if pins[fseq[q]] > 0:
                        state[1] = q
                        return NEED_CLONE
                    scratch[taken] = c - 1
                    ca = fseq[q] * pb + HDR + ((c - 1) - _div((c - 1), MC) * CPP) * CHUNK
                    c = i64[(ca + CDATA) >> 3]
                    taken += 1
                rest = k - taken
                if bump + rest > ncp * CPP:
                    state[1] = bump + rest - ncp * CPP
                    return NEED_PAGE_CHUNK
                for r in range(rest):
                    q = cseqs[_div((bump + r), MC)]
                    if pins[fseq[q]] > 0:
                        state[1] = q
                        return NEED_CLONE
                    scratch[taken + r] = bump + r
            # -- write -------------------------------------------------------------------------
            mod[cseq] = epoch
            ra = fseq[rq] * pb + HDR + (nid - _div(nid, MR) * RPP) * REC
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
                    _put_bytes(pbase + ra + 8, db, a, L, dlen)
                else:
                    for t in range(k):
                        cc = scratch[t]
                        q = cseqs[_div(cc, MC)]
                        mod[q] = epoch
                        ca = fseq[q] * pb + HDR + (cc - _div(cc, MC) * CPP) * CHUNK
                        pos = np.int64(t * CDATA)
                        _put_bytes(pbase + ca, db, a + pos, min(CDATA, L - pos), dlen)
                        i64[(ca + CDATA) >> 3] = scratch[t + 1] + 1 if t + 1 < k else 0
                    i64[(ra + 8) >> 3] = scratch[0] + 1
                    i64[cb + C_FREECH] = c
                    i64[cb + C_CBUMP] = bump + rest
                sa = fseq[iq] * pb + HDR + (ins - _div(ins, MS) * SPP) * SLOT
                mod[iq] = epoch
                u64[sa >> 3] = h
                i64[(sa >> 3) + 1] = nid + 1
                u64[(sa + 16) >> 3] = np.uint64(0)
                u64[(sa + 24) >> 3] = np.uint64(0)
                if L <= SLOT_INLINE:
                    _put_bytes(pbase + sa + 16, db, a, L, dlen)
                    pool[sa + 31] = np.uint8(L)
                else:
                    i64[(sa + 16) >> 3] = scratch[0] + 1 if k > 0 else 0
                    u32[(sa + 24) >> 2] = np.uint32(L)
                    pool[sa + 31] = np.uint8(SLOT_LONG)
                if tomb < 0:
                    i64[cb + C_USED] += 1
                else:
                    i64[cb + C_TOMBS] -= 1
            i64[cb + C_LIVE] += 1
            out[i] = nid
        c0 = c1
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
    MR = geo[G_MR]
    CPP = geo[G_CPP]
    MC = geo[G_MC]
    SPP = geo[G_SPP]
    MS = geo[G_MS]
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
        rq = rseqs[_div(rid, MR)]
        ra = fseq[rq] * pb + HDR + (rid - _div(rid, MR) * RPP) * REC
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
                p = _div(g, MS)
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
                    q = cseqs[_div(c, MC)]
                    ca = fseq[q] * pb + HDR + (c - _div(c, MC) * CPP) * CHUNK
                    nxt = i64[(ca + CDATA) >> 3]
                    if nxt == 0:
                        break
                    c = nxt - 1
                tail = c
                q = cseqs[_div(tail, MC)]
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
                sa = fseq[iq] * pb + HDR + (slot - _div(slot, MS) * SPP) * SLOT
                mod[iq] = epoch
                u64[sa >> 3] = np.uint64(0)
                i64[(sa >> 3) + 1] = -1
                u64[(sa + 16) >> 3] = np.uint64(0)
                u64[(sa + 24) >> 3] = np.uint64(0)
                i64[cb + C_TOMBS] += 1
            if tail >= 0:
                q = cseqs[_div(tail, MC)]
                mod[q] = epoch
                ca = fseq[q] * pb + HDR + (tail - _div(tail, MC) * CPP) * CHUNK
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
    MR = geo[G_MR]
    SPP = geo[G_SPP]
    MS = geo[G_MS]
    cap = newseqs.shape[0] * SPP
    u64 = pool.view(np.uint64)
    i64 = pool.view(np.int64)
    u32 = pool.view(np.uint32)
    used = 0
    for rid in range(high):
        ra = fseq[rseqs[_div(rid, MR)]] * pb + HDR + (rid - _div(rid, MR) * RPP) * REC
        lenf = np.int64(u32[(ra + LENF_OFF) >> 2])
        if lenf == 0 or lenf == NULL_LEN:
            continue
        h = u64[ra >> 3]
        g = _home(h, cap)
        while True:
            p = _div(g, MS)
            sa = fseq[newseqs[p]] * pb + HDR + (g - p * SPP) * SLOT
            if i64[(sa >> 3) + 1] == 0:
                u64[sa >> 3] = h
                i64[(sa >> 3) + 1] = rid + 1
                L = lenf - 1
                if L <= SLOT_INLINE:
                    for t in range(L):
                        pool[sa + 16 + t] = pool[ra + 8 + t]
                    pool[sa + 31] = np.uint8(L)
                else:
                    i64[(sa + 16) >> 3] = i64[(ra + 8) >> 3] if L > INLINE else 0
                    u32[(sa + 24) >> 2] = np.uint32(L)
                    pool[sa + 31] = np.uint8(SLOT_LONG)
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
    MR = geo[G_MR]
    u32 = pool.view(np.uint32)
    for i in range(ids.shape[0]):
        rid = ids[i]
        if rid < 0 or rid >= high:
            return i
        ra = fseq[rseqs[_div(rid, MR)]] * pb + HDR + (rid - _div(rid, MR) * RPP) * REC
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
    MR = geo[G_MR]
    CPP = geo[G_CPP]
    MC = geo[G_MC]
    i64 = pool.view(np.int64)
    for i in range(ids.shape[0]):
        rid = ids[i]
        ra = fseq[rseqs[_div(rid, MR)]] * pb + HDR + (rid - _div(rid, MR) * RPP) * REC
        o = offs[i]
        L = offs[i + 1] - o
        if L <= INLINE:
            for t in range(L):
                out[o + t] = pool[ra + 8 + t]
            continue
        c = i64[(ra + 8) >> 3] - 1
        pos = np.int64(0)
        while pos < L:
            ca = fseq[cseqs[_div(c, MC)]] * pb + HDR + (c - _div(c, MC) * CPP) * CHUNK
            m = CDATA if L - pos > CDATA else L - pos
            out[o + pos:o + pos + m] = pool[ca:ca + m]
            pos += m
            c = i64[(ca + CDATA) >> 3] - 1


@jit
def live_mask(pool: Any, fseq: Any, rseqs: Any, geo: Any, high: Any) -> Any:
    """Which ids below ``high`` hold a key (the null key included)."""
    pb = geo[G_PB]
    RPP = geo[G_RPP]
    MR = geo[G_MR]
    u32 = pool.view(np.uint32)
    out = np.zeros(high, np.bool_)
    for rid in range(high):
        ra = fseq[rseqs[_div(rid, MR)]] * pb + HDR + (rid - _div(rid, MR) * RPP) * REC
        out[rid] = u32[(ra + LENF_OFF) >> 2] != 0
    return out


@jit
def scan_offsets(offs: Any, dlen: Any, out: Any) -> Any:
    """Validate Arrow offsets against a data buffer of ``dlen`` bytes in one pass.

    Returns -2 if the first offset is negative or the last past ``dlen``, the index
    of the first decrease, or -1 when valid; ``out[0]`` gets the longest key.
    """
    n = offs.shape[0] - 1
    if np.int64(offs[0]) < 0 or np.int64(offs[n]) > dlen:
        return -2
    longest = np.int64(0)
    for i in range(n):
        L = np.int64(offs[i + 1]) - np.int64(offs[i])
        if L < 0:
            return i
        if L > longest:
            longest = L
    out[0] = longest
    return -1
