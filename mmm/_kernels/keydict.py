"""Compiled kernels of `mmm.structures.keydict.KeyDict` (numba).

Page layouts (see the KeyDict module docstring); every address below is a
byte offset into the flat uint8 view of the pool, ``frame * page_bytes +
HDR + ...``::

    record (32 B, id-indexed)  [hash u64][data 20 B][lenf u32]
        lenf 0: free (data[0:8] = next free id + 1), 0xFFFFFFFF: the null
        key, else key length + 1; a key of up to 20 bytes sits in ``data``,
        a longer one in a chain of chunks whose first chunk + 1 is data[0:8]
    chunk (64 B)               [data 56 B][next chunk + 1 (0: end) i64]
    index slot (8 B, u64)      [id + 1: bits 0-31 (0: empty, 0xFFFFFFFF: deleted)]
                               [the hash's low 32 bits: bits 32-63]
        a probe reads a slot's record (full hash, length, bytes) only when the slot's
        32 hash bits match: a different key almost never costs a record read, and
        eight slots share a cache line (format 2; format 1's 32-byte slots, which
        copied keys of up to 15 bytes into the slot, are rebuilt into these on first use)
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
from mmm._kernels.pages import copy_bytes
from mmm._kernels.hashmap import _addr, _ld_i32, _ld_i64, _ld_u32, _prefetch_at, _st_i64, _st_u32
from mmm._kernels.hashmap import _mix as _hashmap_mix

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
SLOT = 8          # index slot bytes (format 2)
SLOT_V1 = 32      # index slot bytes of format 1
TOMB = 0xFFFFFFFF  # the id field of a deleted slot
MAX_IDS = 0xFFFFFFFE  # ids are below this (id + 1 fits the slot's 32-bit field)
LO32 = np.uint64(0xFFFFFFFF)

# control words (int64, after the control page's header)
(C_HIGH, C_LIVE, C_FREEID, C_CBUMP, C_FREECH, C_NULL, C_USED, C_TOMBS, C_IGEN, C_IPAGES,
 C_SLOTB) = range(11)
N_CTL = 11
"""``C_SLOTB``: the index's slot bytes, `SLOT`; 0 in format 1 (32-byte slots, no such word)."""

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


def _i64_impl(typingctx: Any, t: Any, i: Any) -> Any:
    """Entry ``i`` of the int64 table at address ``t`` (an intrinsic, as `_div`)."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        addr = builder.add(args[0], builder.mul(args[1], ir.Constant(ir.IntType(64), 8)))
        return builder.load(_ptr(builder, addr, 64), align=1)
    return sig, codegen


_i64: Any = intrinsic(_i64_impl)


def magic(d: int) -> int:
    """``ceil(2**64 / d)`` as an int64 bit pattern: `_div` by ``d`` (2 <= d < 2**16) is then
    exact for dividends below 2**48 (the error ``m * d - 2**64 < d`` stays below one)."""
    m = -(-(1 << 64) // d)
    return m - (1 << 64) if m >= 1 << 63 else m


def _div_impl(typingctx: Any, x: Any, m: Any) -> Any:
    """``x // d`` for ``0 <= x < 2**48`` given ``m = magic(d)``: no division instruction
    (a 64-bit division costs tens of cycles, several per row). An intrinsic, as the
    helpers called at many sites are: numba inlines an ``inline="always"`` function by
    copying its IR at every call site, which costs compile time."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        i128 = ir.IntType(128)
        prod = builder.mul(builder.zext(args[0], i128), builder.zext(args[1], i128))
        return builder.trunc(builder.lshr(prod, ir.Constant(i128, 64)), ir.IntType(64))
    return sig, codegen


_div: Any = intrinsic(_div_impl)


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
    db = _addr(data)
    m = np.uint64(mask)
    for i in range(n):
        a = np.int64(offs[i])
        out[i] = _hash(db, a, np.int64(offs[i + 1]) - a, dlen, m)
    return out


CHUNK_ROWS = 32  # rows hashed and prefetched ahead: enough misses in flight

# -- intern_rows: its steps. They take only scalars, tuples and addresses (an array argument
# costs reference counting per call, even inlined): ``g`` the geo entries as a tuple
# (``g[G_PB]``...), ``T`` the addresses of the tables (``T[T_*]``: the pool, the page tables,
# mod, pins (int32), the control words), ``X`` the input rows (``X[X_*]``: the keys' bytes
# and their length, the offsets and their width, the valid mask (0: none)), ``SC`` the
# caller's scratch: per row of a chunk its hash, home slot and whether pass 2 found it
# (`_sc`), then the chunk numbers of a new key (`_chunks_of`). The per-row steps are
# inlined (``inline="always"``: a compiled call per new key, measured, made interning new
# keys 10-25% slower); the three passes, run once per chunk of rows, are compiled functions
# of their own: a call per chunk costs nothing measurable, they compile once for both
# offset widths, and numba copies an inlined function's IR at every level it is inlined
# through (compile time). ------------------------------------------------------------------
T_POOL, T_FSEQ, T_RSEQS, T_CSEQS, T_ISEQS, T_MOD, T_PINS, T_CTL = range(8)
X_DATA, X_DLEN, X_OFFS, X_OW, X_VALID = range(5)
SC_HASH, SC_HOME, SC_HIT = range(3)  # scratch rows
SCRATCH = 3 * CHUNK_ROWS
"""int64 entries of the scratch `intern_rows` takes before a new key's chunk numbers (see
the hash map kernels' docstring on why no kernel takes the address of an array it
allocated)."""


@_scalar
def _sc(SC: Any, field: Any, r: Any) -> Any:
    """Address of row ``r``'s ``field`` (an ``SC_*`` constant) in the scratch at ``SC``."""
    return SC + 8 * (field * CHUNK_ROWS + r)


@_scalar
def _chunks_of(SC: Any) -> Any:
    """Address of the new key's chunk numbers in the scratch at ``SC``."""
    return SC + 8 * SCRATCH


@_scalar
def _key(X: Any, i: Any) -> Any:
    """``(start, length)`` of row ``i``'s key in the data."""
    if X[X_OW] == 4:
        a = np.int64(_ld_i32(X[X_OFFS] + 4 * i))
        return a, np.int64(_ld_i32(X[X_OFFS] + 4 * i + 4)) - a
    a = _ld_i64(X[X_OFFS] + 8 * i)
    return a, _ld_i64(X[X_OFFS] + 8 * i + 8) - a


@_scalar
def _is_null(X: Any, i: Any) -> Any:
    """Row ``i`` is the null key."""
    return X[X_VALID] != 0 and _ld8(X[X_VALID] + i) == 0


@_scalar
def _ctl_add(ctl: Any, w: Any, d: Any) -> None:
    """Add ``d`` to control word ``w`` (the words at address ``ctl``)."""
    _st_i64(ctl + 8 * w, _ld_i64(ctl + 8 * w) + d)


@_scalar
def _page_at(T: Any, g: Any, q: Any) -> Any:
    """Address of the data (past the header) of page seq ``q``."""
    return T[T_POOL] + _i64(T[T_FSEQ], q) * g[G_PB] + HDR


@_scalar
def _pinned(T: Any, q: Any) -> Any:
    """A snapshot shares page seq ``q``: the kernel must not write it."""
    return _ld_i32(T[T_PINS] + 4 * _i64(T[T_FSEQ], q)) > 0


@_scalar
def _stamp(T: Any, g: Any, q: Any) -> None:
    """Page seq ``q`` was written at this epoch."""
    _st_i64(T[T_MOD] + 8 * q, g[G_EPOCH])


@_scalar
def _slot_seq(T: Any, g: Any, s: Any) -> Any:
    return _i64(T[T_ISEQS], _div(s, g[G_MS]))


@_scalar
def _rec_seq(T: Any, g: Any, rid: Any) -> Any:
    return _i64(T[T_RSEQS], _div(rid, g[G_MR]))


@_scalar
def _chunk_seq(T: Any, g: Any, c: Any) -> Any:
    return _i64(T[T_CSEQS], _div(c, g[G_MC]))


@_scalar
def _slot_at(T: Any, g: Any, s: Any) -> Any:
    """Address of index slot ``s``."""
    return _page_at(T, g, _slot_seq(T, g, s)) + (s - _div(s, g[G_MS]) * g[G_SPP]) * SLOT


@_scalar
def _rec_at(T: Any, g: Any, rid: Any) -> Any:
    """Address of record ``rid``."""
    return _page_at(T, g, _rec_seq(T, g, rid)) + (rid - _div(rid, g[G_MR]) * g[G_RPP]) * REC


@_scalar
def _chunk_at(T: Any, g: Any, c: Any) -> Any:
    """Address of chunk ``c``."""
    return _page_at(T, g, _chunk_seq(T, g, c)) + (c - _div(c, g[G_MC]) * g[G_CPP]) * CHUNK


@_scalar
def _chain_eq(T: Any, g: Any, c: Any, db: Any, a: Any, L: Any, dlen: Any) -> Any:
    """The ``L`` bytes along the chunk chain from chunk ``c`` equal ``data[a:a+L]``."""
    pos = np.int64(0)
    while pos < L:
        ca = _chunk_at(T, g, c)
        m = CDATA if L - pos > CDATA else L - pos
        if not _eq_bytes(ca, db, a + pos, m, dlen):
            return False
        pos += m
        c = _ld_i64(ca + CDATA) - 1
    return True


@_scalar
def _slot_word(h: Any, tag: Any) -> Any:
    """The slot of id ``tag - 1`` with hash ``h``."""
    return ((h & LO32) << np.uint64(32)) | np.uint64(tag)


@_scalar
def _rec_holds(ra: Any, h: Any, db: Any, a: Any, L: Any, dlen: Any, T: Any, g: Any) -> Any:
    """The live record at address ``ra`` holds the key ``data[a:a+L]`` (hash ``h``):
    compared in the record (up to 20 bytes) or along the chunks."""
    if _ld(ra) != h or np.int64(_ld_u32(ra + LENF_OFF)) != L + 1:
        return False
    if L <= INLINE:
        return _eq_bytes(ra + 8, db, a, L, dlen)
    return _chain_eq(T, g, _ld_i64(ra + 8) - 1, db, a, L, dlen)


@_scalar
def _slot_holds(w: Any, h: Any, db: Any, a: Any, L: Any, dlen: Any, T: Any, g: Any) -> Any:
    """The live index slot ``w`` holds the key ``data[a:a+L]`` (hash ``h``)."""
    if (w >> np.uint64(32)) != (h & LO32):
        return False
    return _rec_holds(_rec_at(T, g, np.int64(w & LO32) - 1), h, db, a, L, dlen, T, g)


@_scalar
def _next_slot(s: Any, p: Any, k: Any, cap: Any, SPP: Any) -> Any:
    """The slot after slot ``s`` (slot ``k`` of index page ``p``), wrapping at ``cap``."""
    if s + 1 == cap:
        return np.int64(0), np.int64(0), np.int64(0)
    if k + 1 == SPP:
        return s + 1, p + 1, np.int64(0)
    return s + 1, p, k + 1


@_scalar
def _probe(h: Any, home: Any, db: Any, a: Any, L: Any, dlen: Any, T: Any, g: Any) -> Any:
    """Find the key ``data[a:a+L]`` (hash ``h``) by linear probing from slot ``home``.
    Returns ``(id or -1, the slot the probe stopped at, the first deleted slot or -1)``."""
    s = home
    p = _div(s, g[G_MS])
    k = s - p * g[G_SPP]
    tomb = np.int64(-1)
    while True:
        w = _ld(_page_at(T, g, _i64(T[T_ISEQS], p)) + k * SLOT)
        v = np.int64(w & LO32)
        if v == 0:
            return np.int64(-1), s, tomb
        if v == TOMB:
            if tomb < 0:
                tomb = s
        elif _slot_holds(w, h, db, a, L, dlen, T, g):
            return v - 1, s, tomb
        s, p, k = _next_slot(s, p, k, g[G_CAP], g[G_SPP])


@_scalar
def _writable(isnull: Any, s: Any, T: Any, g: Any) -> Any:
    """The id a new key takes, once the pages it writes (control, record, index slot ``s``)
    are writable: ``(DONE, id)``, else ``(NEED_CLONE, the first shared page)`` or
    ``(NEED_PAGE_REC, 0)``."""
    if _pinned(T, g[G_CSEQ]):
        return NEED_CLONE, g[G_CSEQ]
    fh = _i64(T[T_CTL], C_FREEID)
    nid = fh - 1 if fh > 0 else _i64(T[T_CTL], C_HIGH)
    if nid >= g[G_NRP] * g[G_RPP]:
        return NEED_PAGE_REC, np.int64(0)
    if _pinned(T, _rec_seq(T, g, nid)):
        return NEED_CLONE, _rec_seq(T, g, nid)
    if not isnull and _pinned(T, _slot_seq(T, g, s)):
        return NEED_CLONE, _slot_seq(T, g, s)
    return DONE, nid


@_scalar
def _take_chunks(k: Any, T: Any, g: Any, SCR: Any) -> Any:
    """Note ``k`` writable chunks for a new key in the scratch: off the free list first, then
    fresh ones. Returns ``(status, arg, the free list's new head + 1, fresh chunks)``; arg is
    the shared page (``NEED_CLONE``) or the chunks missing (``NEED_PAGE_CHUNK``)."""
    c = _i64(T[T_CTL], C_FREECH)
    taken = 0
    while taken < k and c > 0:
        if _pinned(T, _chunk_seq(T, g, c - 1)):
            return NEED_CLONE, _chunk_seq(T, g, c - 1), c, np.int64(0)
        _st_i64(SCR + 8 * taken, c - 1)
        c = _ld_i64(_chunk_at(T, g, c - 1) + CDATA)
        taken += 1
    rest = k - taken
    bump = _i64(T[T_CTL], C_CBUMP)
    room = g[G_NCP] * g[G_CPP]
    if bump + rest > room:
        return NEED_PAGE_CHUNK, bump + rest - room, c, rest
    for r in range(rest):
        if _pinned(T, _chunk_seq(T, g, bump + r)):
            return NEED_CLONE, _chunk_seq(T, g, bump + r), c, rest
        _st_i64(SCR + 8 * (taken + r), bump + r)
    return DONE, np.int64(0), c, rest


@_scalar
def _put_record(nid: Any, isnull: Any, h: Any, L: Any, k: Any, db: Any, a: Any, dlen: Any,
                T: Any, g: Any, SCR: Any) -> None:
    """Write record ``nid`` of a new key (taking it off the free list or the high mark): its
    hash and length, and its bytes (up to 20) or its first chunk."""
    ctl = T[T_CTL]
    ra = _rec_at(T, g, nid)
    if _i64(ctl, C_FREEID) > 0:
        _st_i64(ctl + 8 * C_FREEID, _ld_i64(ra + 8))
    else:
        _ctl_add(ctl, C_HIGH, 1)
    _stamp(T, g, _rec_seq(T, g, nid))
    _st(ra + 8, np.uint64(0))
    _st(ra + 16, np.uint64(0))
    _st_u32(ra + 24, np.uint32(0))
    if isnull:
        _st(ra, np.uint64(0))
        _st_u32(ra + LENF_OFF, np.uint32(NULL_LEN))
        _st_i64(ctl + 8 * C_NULL, nid + 1)
        return
    _st(ra, h)
    _st_u32(ra + LENF_OFF, np.uint32(L + 1))
    if k == 0:
        _put_bytes(ra + 8, db, a, L, dlen)
    else:
        _st_i64(ra + 8, _i64(SCR, 0) + 1)


@_scalar
def _put_chunks(k: Any, db: Any, a: Any, L: Any, dlen: Any, T: Any, g: Any, SCR: Any) -> None:
    """Copy the key ``data[a:a+L]`` into its ``k`` chunks (numbered in the scratch), chained
    in order."""
    for t in range(k):
        cc = _i64(SCR, t)
        _stamp(T, g, _chunk_seq(T, g, cc))
        ca = _chunk_at(T, g, cc)
        pos = t * CDATA
        _put_bytes(ca, db, a + pos, min(CDATA, L - pos), dlen)
        _st_i64(ca + CDATA, _i64(SCR, t + 1) + 1 if t + 1 < k else np.int64(0))


@_scalar
def _put_slot(s: Any, nid: Any, h: Any, L: Any, k: Any, tomb: Any, db: Any, a: Any,
              dlen: Any, T: Any, g: Any, SCR: Any) -> None:
    """Write index slot ``s`` (a deleted one if ``tomb`` >= 0) of new key ``nid``: its id
    and 32 bits of its hash."""
    _stamp(T, g, _slot_seq(T, g, s))
    _st(_slot_at(T, g, s), _slot_word(h, nid + 1))
    if tomb < 0:
        _ctl_add(T[T_CTL], C_USED, 1)
    else:
        _ctl_add(T[T_CTL], C_TOMBS, -1)


@_scalar
def _add_key(isnull: Any, h: Any, s: Any, tomb: Any, db: Any, a: Any, L: Any, dlen: Any,
             T: Any, g: Any, SCR: Any) -> Any:
    """Give a new key (``data[a:a+L]`` or the null key) the next id, in index slot ``s``.
    First finds every page it writes, writable, and stops before writing anything if one is
    not. Returns ``(DONE, id)`` or ``(status, arg)``."""
    code, nid = _writable(isnull, s, T, g)
    if code != DONE:
        return code, nid
    k = np.int64(0) if isnull or L <= INLINE else (L + CDATA - 1) // CDATA
    c = np.int64(0)
    rest = np.int64(0)
    if k > 0:
        code, arg, c, rest = _take_chunks(k, T, g, SCR)
        if code != DONE:
            return code, arg
    _stamp(T, g, g[G_CSEQ])
    _put_record(nid, isnull, h, L, k, db, a, dlen, T, g, SCR)
    if k > 0:
        _put_chunks(k, db, a, L, dlen, T, g, SCR)
        _st_i64(T[T_CTL] + 8 * C_FREECH, c)
        _ctl_add(T[T_CTL], C_CBUMP, rest)
    if not isnull:
        _put_slot(s, nid, h, L, k, tomb, db, a, dlen, T, g, SCR)
    _ctl_add(T[T_CTL], C_LIVE, 1)
    return DONE, nid


@jit
def _hash_chunk(c0: Any, c1: Any, X: Any, SC: Any, T: Any, g: Any) -> None:
    """Pass 1: hash each row's key, note its home slot and prefetch it."""
    mask = np.uint64(g[G_MASK])
    for i in range(c0, c1):
        if _is_null(X, i):
            continue
        a, L = _key(X, i)
        h = _hash(X[X_DATA], a, L, X[X_DLEN], mask)
        s = _home(h, g[G_CAP])
        _st(_sc(SC, SC_HASH, i - c0), h)
        _st_i64(_sc(SC, SC_HOME, i - c0), s)
        _prefetch_at(_slot_at(T, g, s))


@jit
def _peek_chunk(c0: Any, c1: Any, X: Any, SC: Any, T: Any, g: Any) -> None:
    """Pass 2: when the home slot's hash bits match, note its id + 1 as the row's candidate
    (``SC_HIT``) and prefetch its record."""
    for i in range(c0, c1):
        _st_i64(_sc(SC, SC_HIT, i - c0), 0)
        if _is_null(X, i):
            continue
        w = _ld(_slot_at(T, g, _i64(_sc(SC, SC_HOME, i - c0), 0)))
        v = np.int64(w & LO32)
        if v == 0 or v == TOMB or (w >> np.uint64(32)) != (_ld(_sc(SC, SC_HASH, i - c0)) & LO32):
            continue
        _st_i64(_sc(SC, SC_HIT, i - c0), v)
        _prefetch_at(_rec_at(T, g, v - 1))


@jit
def _match_chunk(c0: Any, c1: Any, X: Any, OUT: Any, SC: Any, T: Any, g: Any) -> None:
    """Pass 3: a candidate whose record holds the row's key of up to 20 bytes is found here
    (``out``; ``SC_HIT`` -1); for a longer key whose hash and length match, prefetch its
    first chunk (pass 4 compares it)."""
    for i in range(c0, c1):
        v = _i64(_sc(SC, SC_HIT, i - c0), 0)
        if v <= 0:
            continue
        ra = _rec_at(T, g, v - 1)
        a, L = _key(X, i)
        if L > INLINE:
            if _ld(ra) == _ld(_sc(SC, SC_HASH, i - c0)) and \
                    np.int64(_ld_u32(ra + LENF_OFF)) == L + 1:
                _prefetch_at(_chunk_at(T, g, _ld_i64(ra + 8) - 1))
            continue
        if _rec_holds(ra, _ld(_sc(SC, SC_HASH, i - c0)), X[X_DATA], a, L, X[X_DLEN], T, g):
            _st_i64(OUT + 8 * i, v - 1)  # an existing key does not move while the batch runs
            _st_i64(_sc(SC, SC_HIT, i - c0), -1)


@jit
def _apply_chunk(mode: Any, c0: Any, c1: Any, X: Any, OUT: Any, ST: Any, SC: Any, T: Any,
                 g: Any) -> Any:
    """Pass 3, in input order: find each row's key not found yet; intern a new one. Returns
    a status (``state`` at ``ST`` = [row, arg] as `intern_rows`)."""
    db, dlen = X[X_DATA], X[X_DLEN]
    for i in range(c0, c1):
        if _i64(_sc(SC, SC_HIT, i - c0), 0) < 0:
            continue
        _st_i64(ST, i)
        isnull = _is_null(X, i)
        a, L = _key(X, i)
        h = np.uint64(0)
        s = np.int64(-1)
        tomb = np.int64(-1)
        if isnull:
            nid = _i64(T[T_CTL], C_NULL)
            if nid > 0 or mode == MODE_LOOKUP:
                _st_i64(OUT + 8 * i, nid - 1)
                continue
        else:
            h = _ld(_sc(SC, SC_HASH, i - c0))
            found, s, tomb = _probe(h, _i64(_sc(SC, SC_HOME, i - c0), 0), db, a, L, dlen, T, g)
            if found >= 0 or mode == MODE_LOOKUP:
                _st_i64(OUT + 8 * i, found)
                continue
            if tomb >= 0:
                s = tomb
            elif _i64(T[T_CTL], C_USED) + 1 > g[G_LIMIT]:
                return NEED_GROW
        code, arg = _add_key(isnull, h, s, tomb, db, a, L, dlen, T, g, _chunks_of(SC))
        if code != DONE:
            if code == NEED_CLONE or code == NEED_PAGE_CHUNK:
                _st_i64(ST + 8, arg)
            return code
        _st_i64(OUT + 8 * i, arg)
    return DONE


@_scalar
def _is_table(t: Any, itemsize: Any) -> Any:
    """``t`` is a contiguous table of ``itemsize``-byte entries (the steps read it by
    address)."""
    return t.itemsize == itemsize and (t.shape[0] < 2 or t.strides[0] == itemsize)


@_scalar
def _check_tables(offs: Any, valid: Any, fseq: Any, mod: Any, pins: Any, rseqs: Any,
                  cseqs: Any, iseqs: Any, geo: Any, out: Any, scratch: Any, state: Any) -> None:
    """`intern_rows` reads these through their addresses: contiguous int64 (pins int32,
    offsets int32 or int64, valid bool)."""
    if not (_is_table(fseq, 8) and _is_table(mod, 8) and _is_table(rseqs, 8)
            and _is_table(cseqs, 8) and _is_table(iseqs, 8) and _is_table(geo, 8)
            and _is_table(out, 8) and _is_table(scratch, 8) and _is_table(state, 8)
            and _is_table(pins, 4) and _is_table(valid, 1)
            and (_is_table(offs, 4) or _is_table(offs, 8))):
        raise TypeError("keydict.intern_rows: page tables, mod, geo, out, scratch and state "
                        "must be contiguous int64, pins int32, offsets int32 or int64, valid "
                        "bool")
    if geo.shape[0] < 14 or state.shape[0] < 2 or scratch.shape[0] < SCRATCH + 1:
        raise ValueError("keydict.intern_rows: geo needs 14 entries, state 2, scratch "
                         "SCRATCH + the chunk count of the longest key")
    if offs.shape[0] < out.shape[0] + 1:
        raise ValueError("keydict.intern_rows: offsets need an entry per row and one more")


@_scalar
def _geo_of(geo: Any) -> Any:
    """The ``G_*`` entries of ``geo`` as a tuple (values the steps keep in registers)."""
    return (geo[0], geo[1], geo[2], geo[3], geo[4], geo[5], geo[6], geo[7], geo[8], geo[9],
            geo[10], geo[11], geo[12], geo[13])


@jit
def intern_rows(mode: Any, i0: Any, db: Any, dlen: Any, offs: Any, valid: Any, has_valid: Any,
                pool: Any, fseq: Any, mod: Any, pins: Any, rseqs: Any, cseqs: Any, iseqs: Any,
                geo: Any, out: Any, scratch: Any, state: Any) -> Any:
    """Look up (``MODE_LOOKUP``) or intern (``MODE_INTERN``) rows ``i0..n-1`` in input order.

    The keys' bytes are at address ``db`` (``dlen`` bytes, kept alive by the caller:
    an address rather than an array, so read-only and writable buffers share one
    compiled kernel). ``out[i]`` gets each row's id (-1: absent, lookup only). ``state`` = [row, arg]:
    on return the row the kernel stopped at and the page seq (``NEED_CLONE``) or the
    chunks still missing (``NEED_PAGE_CHUNK``). ``scratch`` (contiguous int64) holds
    `SCRATCH` entries and then at least the chunk count of the longest key. Returns a
    status code.

    Rows go in chunks of `CHUNK_ROWS`, in four passes (each a function): hash each row and
    prefetch its home index slot; prefetch the record the home slot names when its hash
    bits match; find a key of up to 20 bytes in that record, or prefetch a longer one's
    first chunk; then probe, compare and intern in input order.
    """
    _check_tables(offs, valid, fseq, mod, pins, rseqs, cseqs, iseqs, geo, out, scratch, state)
    g = _geo_of(geo)
    P, FS = _addr(pool), _addr(fseq)
    ctl = P + _ld_i64(FS + 8 * g[G_CSEQ]) * g[G_PB] + HDR
    T = (P, FS, _addr(rseqs), _addr(cseqs), _addr(iseqs), _addr(mod), _addr(pins), ctl)
    X = (db, dlen, _addr(offs), np.int64(offs.itemsize), _addr(valid) if has_valid else 0)
    OUT, SC, ST = _addr(out), _addr(scratch), _addr(state)
    n = out.shape[0]
    c0 = i0
    while c0 < n:
        c1 = min(c0 + CHUNK_ROWS, n)
        _hash_chunk(c0, c1, X, SC, T, g)
        _peek_chunk(c0, c1, X, SC, T, g)
        _match_chunk(c0, c1, X, OUT, SC, T, g)
        code = _apply_chunk(mode, c0, c1, X, OUT, ST, SC, T, g)
        if code != DONE:
            return code
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
                v = np.int64(u64[sa >> 3] & LO32)
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
                u64[sa >> 3] = np.uint64(TOMB)
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
            if u64[sa >> 3] == 0:
                u64[sa >> 3] = _slot_word(h, rid + 1)
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
            copy_bytes(out[o + pos:o + pos + m], pool[ca:ca + m])
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


@jit
def relink_free(pool: Any, fseq: Any, pins: Any, mod: Any, seqs: Any, per_page: Any,
                m: Any, item: Any, next_off: Any, pb: Any, epoch: Any, cseq: Any, word: Any,
                limit: Any) -> Any:
    """Drop the entries ``>= limit`` from a free list (of records: ``item`` 32, next at byte 8;
    or of chunks: 64, at byte `CDATA`; the entries of pages ``seqs``, ``per_page`` a page,
    ``m = magic(per_page)``), keeping the others' order. The list's head + 1 is control
    word ``word`` of the control page ``cseq``; each link holds the next entry + 1 (0: end).
    Writes only links that change. Returns -1 when done, else the seq of a shared page it
    must write first (then call again: the walk restarts and finds the done part as is)."""
    i64 = pool.view(np.int64)
    ca = fseq[cseq] * pb + HDR + 8 * word  # the link being walked: the head first
    lq = cseq
    f = i64[ca >> 3]
    while f > 0:
        e = f - 1
        q = seqs[_div(e, m)]
        ea = fseq[q] * pb + HDR + (e - _div(e, m) * per_page) * item + next_off
        nxt = i64[ea >> 3]
        if e >= limit:  # unlink: the link at ca skips it
            if pins[fseq[lq]] > 0:
                return lq
            mod[lq] = epoch
            i64[ca >> 3] = nxt
        else:
            ca = ea
            lq = q
        f = nxt
    return -1


@jit
def free_chunk_marks(pool: Any, fseq: Any, cseqs: Any, geo: Any, head: Any, bump: Any) -> Any:
    """Which of the chunks below ``bump`` are on the free list starting at ``head`` (+ 1)."""
    pb = geo[G_PB]
    CPP = geo[G_CPP]
    MC = geo[G_MC]
    i64 = pool.view(np.int64)
    out = np.zeros(bump, np.bool_)
    f = head
    while f > 0:
        c = f - 1
        out[c] = True
        ca = fseq[cseqs[_div(c, MC)]] * pb + HDR + (c - _div(c, MC) * CPP) * CHUNK
        f = i64[(ca + CDATA) >> 3]
    return out
