"""Compiled kernels of `mmm.structures.hashmap.HashMap` (numba).

The kernels work on the page pool as one flat uint8 array (viewed inside as
the integer and float types they need) and on the page table arrays of the
map. Page layout (see the HashMap module
docstring)::

    [header 64 B][ctrl: S bytes, padded to 8][keys: S keys, padded to 8][values: S values]

Keys arrive as ``kw``, a ``(n, W)`` uint64 array: each key's canonical bytes
zero-padded to whole words (the hash input), and ``kb``, the same bytes as a
``(n, 8 W)`` uint8 view (for comparing and copying).

Hot loops are written out in one function per kernel: a numba call (even an
inlined one) that takes arrays costs reference counting per call, more than a
probe. Only scalar helpers are separate functions.

Copy-on-write: a kernel never writes a frame whose pin count is non-zero.
When a row needs such a page, the kernel stops *before writing anything for
that row* and returns ``NEED_CLONE`` with the page's sequence number; the
caller un-shares it (``PageManager.writable``) and calls again from that row.
The same goes for a row that needs a new overflow page (``NEED_PAGE``) or a
split (``NEED_SPLIT``): between two calls the map is a valid map holding the
rows before the one returned. Every page a kernel writes gets its
modification epoch stamped (``mod[seq] = epoch``), as the write barrier does.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import numba
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped,unused-ignore]
from numba.core import cgutils, types
from numba.cpython.unsafe.numbers import trailing_zeros as _tz
from numba.extending import intrinsic

from mmm._kernels import cacheable, jit

__all__ = ["hash_keys", "rows", "rechain", "crowded", "DONE", "NEED_CLONE", "NEED_PAGE",
           "NEED_SPLIT", "MODE_GET", "MODE_UPSERT", "MODE_DELETE", "OP_CODES", "DTYPE_CODES"]

F = TypeVar("F", bound=Callable[..., Any])


def _scalar(fn: F) -> F:
    """A scalar helper, compiled into its callers."""
    out: F = numba.njit(inline="always", cache=cacheable(fn), nogil=True)(fn)  # type: ignore[assignment]
    return out


HDR = 64
OFF_FLAGS, OFF_COUNT, OFF_START, OFF_NEXT, OFF_AUX0 = 6, 24, 28, 40, 48
NIL = np.uint64(0xFFFFFFFFFFFFFFFF)

DONE, NEED_CLONE, NEED_PAGE, NEED_SPLIT = 0, 1, 2, 3
MODE_GET, MODE_UPSERT, MODE_DELETE = 0, 1, 2
COUNT, SUM, MIN, MAX, LAST, FIRST = 0, 1, 2, 3, 4, 5
OP_CODES = {"count": COUNT, "sum": SUM, "min": MIN, "max": MAX, "last": LAST, "first": FIRST}
I1, I2, I4, I8, U1, U2, U4, U8, F4, F8, BYTES = range(11)
DTYPE_CODES = {"i1": I1, "i2": I2, "i4": I4, "i8": I8, "u1": U1, "u2": U2, "u4": U4,
               "u8": U8, "f4": F4, "f8": F8, "b1": U1}
L_INT, L_UINT, L_FLOAT, L_BYTES = 0, 1, 2, 3


@_scalar
def _mix(x: Any) -> Any:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@_scalar
def _bucket(h: Any, nbk: Any, lvl: Any) -> Any:
    b = np.int64(h & np.uint64((1 << (lvl + 1)) - 1))
    if b >= nbk:
        b -= np.int64(1) << lvl
    return b


@_scalar
def _home(h: Any, nb: Any) -> Any:
    return np.int64(((h >> np.uint64(32)) * np.uint64(nb)) >> np.uint64(32))


@_scalar
def _step(h: Any, nb: Any) -> Any:
    if nb == 1:
        return np.int64(0)
    h2 = _mix(h ^ np.uint64(0x5851F42D4C957F2D))
    return 1 + np.int64(((h2 >> np.uint64(40)) * np.uint64(nb - 1)) >> np.uint64(24))


@_scalar
def _tag(h: Any) -> Any:
    return np.uint8(((h >> np.uint64(24)) & np.uint64(0x7F)) | np.uint64(0x80))


@_scalar
def _sext(v: Any, size: Any) -> Any:
    """Sign-extend the low ``size`` bytes of uint64 ``v``."""
    sh = np.uint64(64 - 8 * size)
    return np.int64(v << sh) >> np.int64(64 - 8 * size)


def _prefetch_impl(typingctx: Any, arr: Any, idx: Any) -> Any:
    """``llvm.prefetch`` of ``arr[idx]`` (read, keep in all cache levels): a hint, no effect
    on results."""
    sig = types.void(arr, idx)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(  # type: ignore[no-untyped-call]
            context, builder, aryty, ary, [args[1]])
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return sig, codegen


_prefetch: Any = intrinsic(_prefetch_impl)
trailing_zeros: Any = _tz  # count of trailing zero bits (an LLVM intrinsic)
CHUNK = 32  # rows per pass: enough misses in flight to hide the memory latency
ONES = np.uint64(0x0101010101010101)
LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)


@_scalar
def _zero_bytes(x: Any) -> Any:
    """0x80 in each byte of uint64 ``x`` that is zero, 0 elsewhere (exact: no borrows)."""
    return ~(((x & LOW7) + LOW7) | x | LOW7)


@jit
def hash_keys(kw: Any) -> Any:
    """splitmix64 hash of each key row of ``kw`` (uint64 words)."""
    n = kw.shape[0]
    out = np.empty(n, np.uint64)
    for i in range(n):
        h = _mix(kw[i, 0])
        for j in range(1, kw.shape[1]):
            h = _mix(h ^ kw[i, j])
        out[i] = h
    return out


@jit
def rows(mode: Any, i0: Any, kw: Any, kb: Any, pool: Any, fseq: Any, next_of: Any,
         bucket_seq: Any, last_seq: Any, pins: Any, mod: Any, geo: Any, ops: Any, codes: Any,
         offs: Any, sizes: Any, lanes: Any, lidx: Any, aligned: Any, IC: Any, UC: Any, FC: Any,
         BC: Any, out: Any, found: Any, state: Any) -> Any:
    """Look up (``MODE_GET``), upsert (``MODE_UPSERT``) or delete (``MODE_DELETE``)
    rows ``i0..n-1`` in input order; writes stop early with a request.

    ``pool`` is the flat uint8 view of every frame. ``geo`` = (n_buckets,
    level, S, G, n_groups, key_off, val_off, key_size, val_size, page_bytes,
    max_fill, split_limit, epoch). ``state`` = [len, row, arg]: the map's
    length (updated), and on return the row the kernel stopped at and the page
    seq (``NEED_CLONE``) or bucket (``NEED_PAGE``). ``out`` (``(n, val_size)``
    uint8, or 0 rows) receives each row's value: after the row was applied
    (upsert) or as found (get). ``found`` (get, delete) is set per row. The
    combine spec (upsert) is ``ops``... ``aligned``, one entry per value field
    it writes; ``IC``/``UC``/``FC`` (``(k, n)``: int64, uint64, float64) and
    ``BC`` (``(n, bytes)``) are the input lanes. Returns a status code.
    """
    nbk, lvl, S, G, nb, ko, vo, ks, vs, pb, max_fill, limit, epoch = (
        geo[0], geo[1], geo[2], geo[3], geo[4], geo[5], geo[6], geo[7], geo[8], geo[9],
        geo[10], geo[11], geo[12])
    u8 = pool
    i8a = pool.view(np.int8)
    u16 = pool.view(np.uint16)
    i16 = pool.view(np.int16)
    u32 = pool.view(np.uint32)
    i32 = pool.view(np.int32)
    u64 = pool.view(np.uint64)
    i64 = pool.view(np.int64)
    f32 = pool.view(np.float32)
    f64 = pool.view(np.float64)
    sc_u64 = np.zeros(1, np.uint64)
    sc_f64 = sc_u64.view(np.float64)
    sc_u32 = np.zeros(1, np.uint32)
    sc_f32 = sc_u32.view(np.float32)
    n = kw.shape[0]
    W = kw.shape[1]
    nops = ops.shape[0]
    want = out.shape[0] > 0
    swar = G == 16
    CH = CHUNK
    hs = np.empty(CH, np.uint64)   # per row of the chunk: hash,
    bk = np.empty(CH, np.int64)    # bucket,
    q0s = np.empty(CH, np.int64)   # primary page,
    homes = np.empty(CH, np.int64)  # home group,
    cand = np.empty(CH, np.int64)  # the home group's first tag match in the primary page (-1),
    vas = np.empty(CH, np.int64)   # the value's address once applied,
    isnew = np.empty(CH, np.bool_)  # and whether the row inserted its key
    HIGH = np.uint64(0x8080808080808080)
    code_out = DONE
    c0 = i0
    while c0 < n:
        c1 = min(c0 + CH, n)
        # -- pass 1: hash each row, prefetch its home group's ctrl bytes -------------------------
        for i in range(c0, c1):
            h = _mix(kw[i, 0])
            for j in range(1, W):
                h = _mix(h ^ kw[i, j])
            b = _bucket(h, nbk, lvl)
            q = bucket_seq[b]
            gp = _home(h, nb)
            hs[i - c0] = h
            bk[i - c0] = b
            q0s[i - c0] = q
            homes[i - c0] = gp
            _prefetch(u8, fseq[q] * pb + HDR + gp * G)
        # -- pass 2: match the tag in the home group (its ctrl line is in flight or in cache),
        # prefetch the key and value of the first match, or of the first free slot (an insert)
        for i in range(c0, c1):
            cand[i - c0] = -1
            if not swar:
                continue
            h = hs[i - c0]
            bp = fseq[q0s[i - c0]] * pb
            gp = homes[i - c0]
            cp = (bp + HDR + gp * G) >> 3
            rep = np.uint64(_tag(h)) * ONES
            w = u64[cp]
            m = _zero_bytes(w ^ rep)
            off = 0
            if m == 0:
                w = u64[cp + 1]
                m = _zero_bytes(w ^ rep)
                off = 8
            if m != 0:
                sp = gp * G + off + (np.int64(trailing_zeros(m)) >> 3)
                cand[i - c0] = sp
            elif mode == MODE_UPSERT:
                m = ~u64[cp] & HIGH
                off = 0
                if m == 0:
                    m = ~u64[cp + 1] & HIGH
                    off = 8
                if m == 0:
                    continue
                sp = gp * G + off + (np.int64(trailing_zeros(m)) >> 3)
            else:
                continue
            _prefetch(u8, bp + ko + sp * ks)
            if ks & (ks - 1) != 0:  # a key may straddle two cache lines
                _prefetch(u8, bp + ko + sp * ks + ks - 1)
            if mode != MODE_DELETE:
                _prefetch(u8, bp + vo + sp * vs)
                _prefetch(u8, bp + vo + sp * vs + vs - 1)  # and a value
        # -- pass 3: probe, in input order; insert new keys; get / delete act here -------------
        stop = c1
        for i in range(c0, c1):
            h = hs[i - c0]
            b = bk[i - c0]
            tag = _tag(h)
            rep = np.uint64(tag) * ONES
            home = homes[i - c0]
            step = np.int64(-1)  # computed when a probe leaves the home group
            k0 = kw[i, 0]
            fq = np.int64(-1)
            s = np.int64(-1)
            sl = cand[i - c0]
            if sl >= 0:  # the candidate first: most keys sit there
                q = q0s[i - c0]
                base = fseq[q] * pb
                if u8[base + HDR + sl] == tag:
                    ka = base + ko + sl * ks
                    if ks == 4:
                        eq = np.uint64(u32[ka >> 2]) == k0
                    elif ks == 8:
                        eq = u64[ka >> 3] == k0
                    elif ks == 2:
                        eq = np.uint64(u16[ka >> 1]) == k0
                    elif ks == 1:
                        eq = np.uint64(u8[ka]) == k0
                    else:
                        eq = True
                        for t in range(ks):
                            if u8[ka + t] != kb[i, t]:
                                eq = False
                                break
                    if eq:
                        s = sl
                        fq = q
            q = bucket_seq[b] if s < 0 else np.int64(-1)
            while q >= 0:
                base = fseq[q] * pb
                g = home
                for _ in range(nb):
                    cg = base + HDR + g * G
                    empty = False
                    if swar:  # 16 ctrl bytes as two words: tag matches and EMPTY bytes at once
                        for half in range(2):
                            w = u64[(cg >> 3) + half]
                            if _zero_bytes(w) != 0:
                                empty = True
                            m = _zero_bytes(w ^ rep)
                            while m != 0:
                                sl = g * G + 8 * half + (np.int64(trailing_zeros(m)) >> 3)
                                ka = base + ko + sl * ks
                                if ks == 4:
                                    eq = np.uint64(u32[ka >> 2]) == k0
                                elif ks == 8:
                                    eq = u64[ka >> 3] == k0
                                elif ks == 2:
                                    eq = np.uint64(u16[ka >> 1]) == k0
                                elif ks == 1:
                                    eq = np.uint64(u8[ka]) == k0
                                else:
                                    eq = True
                                    for t in range(ks):
                                        if u8[ka + t] != kb[i, t]:
                                            eq = False
                                            break
                                if eq:
                                    s = sl
                                    break
                                m &= m - np.uint64(1)
                            if s >= 0:
                                break
                    else:
                        for j in range(G):
                            c = u8[cg + j]
                            if c == tag:
                                sl = g * G + j
                                ka = base + ko + sl * ks
                                eq = True
                                for t in range(ks):
                                    if u8[ka + t] != kb[i, t]:
                                        eq = False
                                        break
                                if eq:
                                    s = sl
                                    break
                            elif c == 0:
                                empty = True
                    if s >= 0 or empty:
                        break
                    if step < 0:
                        step = _step(h, nb)
                    g += step
                    if g >= nb:
                        g -= nb
                if s >= 0:
                    fq = q
                    break
                q = next_of[q]
            # -- act --------------------------------------------------------------------------
            if mode == MODE_GET:
                if fq >= 0:
                    found[i] = True
                    if want:
                        va = fseq[fq] * pb + vo + s * vs
                        for t in range(vs):
                            out[i, t] = u8[va + t]
                else:
                    found[i] = False
                continue
            if mode == MODE_DELETE:
                if fq < 0:
                    found[i] = False
                    continue
                f = fseq[fq]
                if pins[f] > 0:
                    state[1] = i
                    state[2] = fq
                    return NEED_CLONE
                mod[fq] = epoch
                base = f * pb
                u8[base + HDR + s] = 1
                a = (base + OFF_COUNT) >> 2
                u32[a] = np.uint32(np.int64(u32[a]) - 1)
                state[0] -= 1
                found[i] = True
                continue
            # upsert: find or insert; a request stops the chunk before this row
            if fq >= 0:
                f = fseq[fq]
                if pins[f] > 0:
                    state[2] = fq
                    code_out = NEED_CLONE
                    stop = i
                    break
                mod[fq] = epoch
                base = f * pb
                new = False
            else:
                if state[0] + 1 > limit:
                    code_out = NEED_SPLIT
                    stop = i
                    break
                q = last_seq[b]
                f = fseq[q]
                base = f * pb
                if np.int64(u32[(base + OFF_START) >> 2]) >= max_fill:
                    state[2] = b
                    code_out = NEED_PAGE
                    stop = i
                    break
                if pins[f] > 0:
                    state[2] = q
                    code_out = NEED_CLONE
                    stop = i
                    break
                mod[q] = epoch
                g = home
                s = np.int64(-1)
                for _ in range(nb):  # the first free (EMPTY or TOMB) slot on the probe sequence
                    cg = base + HDR + g * G
                    for j in range(G):
                        if u8[cg + j] < 0x80:
                            s = g * G + j
                            break
                    if s >= 0:
                        break
                    if step < 0:
                        step = _step(h, nb)
                    g += step
                    if g >= nb:
                        g -= nb
                was_empty = u8[base + HDR + s] == 0
                u8[base + HDR + s] = tag
                ka = base + ko + s * ks
                if ks == 4:
                    u32[ka >> 2] = np.uint32(k0)
                elif ks == 8:
                    u64[ka >> 3] = k0
                else:
                    for t in range(ks):
                        u8[ka + t] = kb[i, t]
                va = base + vo + s * vs
                if vs & 7 == 0:  # values are 8-aligned then (vo and pages are)
                    for t in range(vs >> 3):
                        u64[(va >> 3) + t] = 0
                else:
                    for t in range(vs):
                        u8[va + t] = 0
                a = (base + OFF_COUNT) >> 2
                u32[a] = np.uint32(np.int64(u32[a]) + 1)
                if was_empty:
                    a = (base + OFF_START) >> 2
                    u32[a] = np.uint32(np.int64(u32[a]) + 1)
                state[0] += 1
                new = True
            va = base + vo + s * vs
            vas[i - c0] = va
            isnew[i - c0] = new
            if want:  # fields the spec does not write; the combine fills in the others
                for t in range(vs):
                    out[i, t] = u8[va + t]
        if mode != MODE_UPSERT:
            c0 = c1
            continue
        # -- pass 4: combine rows c0..stop-1, one value field at a time (the op and the field's
        # type are fixed for a whole loop: common cases have their own loops) --------------------
        kn = stop - c0
        for j in range(nops):
            op = ops[j]
            off = offs[j]
            code = codes[j]
            al = aligned[j]
            lane = lanes[j]
            c = lidx[j]
            size = sizes[j]
            if lane == L_INT and al and code == I8:
                if op == COUNT:
                    for k in range(kn):
                        a = (vas[k] + off) >> 3
                        i64[a] = 1 if isnew[k] else i64[a] + 1
                        if want:
                            for t in range(8):
                                out[c0 + k, off + t] = u8[8 * a + t]
                elif op == SUM:
                    for k in range(kn):
                        a = (vas[k] + off) >> 3
                        x = IC[c, c0 + k]
                        i64[a] = x if isnew[k] else i64[a] + x
                        if want:
                            for t in range(8):
                                out[c0 + k, off + t] = u8[8 * a + t]
                elif op == MIN:
                    for k in range(kn):
                        a = (vas[k] + off) >> 3
                        x = IC[c, c0 + k]
                        if isnew[k] or x < i64[a]:
                            i64[a] = x
                        if want:
                            for t in range(8):
                                out[c0 + k, off + t] = u8[8 * a + t]
                elif op == MAX:
                    for k in range(kn):
                        a = (vas[k] + off) >> 3
                        x = IC[c, c0 + k]
                        if isnew[k] or x > i64[a]:
                            i64[a] = x
                        if want:
                            for t in range(8):
                                out[c0 + k, off + t] = u8[8 * a + t]
                else:  # LAST, FIRST
                    for k in range(kn):
                        a = (vas[k] + off) >> 3
                        if isnew[k] or op == LAST:
                            i64[a] = IC[c, c0 + k]
                        if want:
                            for t in range(8):
                                out[c0 + k, off + t] = u8[8 * a + t]
                continue
            if lane == L_FLOAT and al and code == F8:
                for k in range(kn):
                    a = (vas[k] + off) >> 3
                    y = 1.0 if op == COUNT else FC[c, c0 + k]
                    if isnew[k] or op == LAST:
                        f64[a] = y
                    elif op == COUNT or op == SUM:
                        f64[a] = f64[a] + y
                    elif op == MIN or op == MAX:
                        old_f = f64[a]  # NaN stays (np.minimum / np.maximum semantics)
                        if old_f == old_f and not (y == y and ((op == MIN and y >= old_f)
                                                               or (op == MAX and y <= old_f))):
                            f64[a] = y
                    if want:
                        for t in range(8):
                            out[c0 + k, off + t] = u8[8 * a + t]
                continue
            for k in range(kn):  # any field: the general case
                i = c0 + k
                new = isnew[k]
                a = vas[k] + off
                if lane == L_INT:
                    x = np.int64(1) if op == COUNT else IC[c, i]
                    write = new or op == LAST
                    if not write and op != FIRST:
                        if al:
                            if code == I8:
                                old = i64[a >> 3]
                            elif code == I4:
                                old = np.int64(i32[a >> 2])
                            elif code == U4:
                                old = np.int64(u32[a >> 2])
                            elif code == I2:
                                old = np.int64(i16[a >> 1])
                            elif code == U2:
                                old = np.int64(u16[a >> 1])
                            elif code == I1:
                                old = np.int64(i8a[a])
                            else:
                                old = np.int64(u8[a])
                        else:
                            raw = np.uint64(0)
                            for t in range(size):
                                raw |= np.uint64(u8[a + t]) << np.uint64(8 * t)
                            if code == I8 or code == I4 or code == I2 or code == I1:
                                old = _sext(raw, size)
                            else:
                                old = np.int64(raw)
                        if op == COUNT or op == SUM:
                            x = old + x
                            write = True
                        elif op == MIN:
                            write = x < old
                        else:  # MAX
                            write = x > old
                    if write:
                        if al:
                            if code == I8:
                                i64[a >> 3] = x
                            elif code == I4:
                                i32[a >> 2] = np.int32(x)
                            elif code == U4:
                                u32[a >> 2] = np.uint32(x)
                            elif code == I2:
                                i16[a >> 1] = np.int16(x)
                            elif code == U2:
                                u16[a >> 1] = np.uint16(x)
                            elif code == I1:
                                i8a[a] = np.int8(x)
                            else:
                                u8[a] = np.uint8(x)
                        else:
                            raw = np.uint64(x)
                            for t in range(size):
                                u8[a + t] = np.uint8((raw >> np.uint64(8 * t)) & np.uint64(0xFF))
                elif lane == L_FLOAT:
                    y = 1.0 if op == COUNT else FC[c, i]
                    write = new or op == LAST
                    if not write and op != FIRST:
                        if al:
                            old_f = f64[a >> 3] if code == F8 else np.float64(f32[a >> 2])
                        else:
                            raw = np.uint64(0)
                            for t in range(size):
                                raw |= np.uint64(u8[a + t]) << np.uint64(8 * t)
                            if code == F8:
                                sc_u64[0] = raw
                                old_f = sc_f64[0]
                            else:
                                sc_u32[0] = np.uint32(raw)
                                old_f = np.float64(sc_f32[0])
                        if op == COUNT or op == SUM:
                            y = old_f + y
                            write = True
                        else:  # NaN stays (np.minimum / np.maximum semantics)
                            write = old_f == old_f and not (
                                y == y and ((op == MIN and y >= old_f)
                                            or (op == MAX and y <= old_f)))
                    if write:
                        if al:
                            if code == F8:
                                f64[a >> 3] = y
                            else:
                                f32[a >> 2] = np.float32(y)
                        else:
                            if code == F8:
                                sc_f64[0] = y
                                raw = sc_u64[0]
                            else:
                                sc_f32[0] = np.float32(y)
                                raw = np.uint64(sc_u32[0])
                            for t in range(size):
                                u8[a + t] = np.uint8((raw >> np.uint64(8 * t)) & np.uint64(0xFF))
                elif lane == L_UINT:
                    xu = np.uint64(1) if op == COUNT else UC[c, i]
                    write = new or op == LAST
                    if not write and op != FIRST:
                        if al:
                            old_u = u64[a >> 3]
                        else:
                            old_u = np.uint64(0)
                            for t in range(8):
                                old_u |= np.uint64(u8[a + t]) << np.uint64(8 * t)
                        if op == COUNT or op == SUM:
                            xu = old_u + xu
                            write = True
                        elif op == MIN:
                            write = xu < old_u
                        else:
                            write = xu > old_u
                    if write:
                        if al:
                            u64[a >> 3] = xu
                        else:
                            for t in range(8):
                                u8[a + t] = np.uint8((xu >> np.uint64(8 * t)) & np.uint64(0xFF))
                else:  # bytes: first / last copy; min / max compare lexicographically
                    write = new or op == LAST
                    if not write and (op == MIN or op == MAX):
                        cmp = 0
                        for t in range(size):
                            xb = BC[i, c + t]
                            yb = u8[a + t]
                            if xb != yb:
                                cmp = -1 if xb < yb else 1
                                break
                        write = (op == MIN and cmp < 0) or (op == MAX and cmp > 0)
                    if write:
                        for t in range(size):
                            u8[a + t] = BC[i, c + t]
                if want:
                    for t in range(size):
                        out[i, off + t] = u8[a + t]
        if code_out != DONE:
            state[1] = stop
            return code_out
        c0 = c1
    state[1] = n
    return DONE


@jit
def rechain(pages: Any, targets: Any, primaries: Any, pool: Any, fseq: Any, next_of: Any,
            bucket_seq: Any, last_seq: Any, geo: Any, psid: Any, kwbuf: Any, kbuf: Any,
            vbuf: Any, spare_out: Any) -> Any:
    """Rewrite the records of the chains in ``pages`` into the ``targets`` buckets.

    Splits (a bucket into itself and its image), merges (the last bucket into
    its buddy) and compactions (tombstones out) are all this one pass: every
    record of ``pages`` (all writable, all pages of the source chains) is
    gathered into ``kwbuf``/``kbuf`` (uint64 words, zeroed, and their uint8
    view) and ``vbuf``, the pages are reset, and each record is placed again
    into the chain of its bucket under ``geo`` (new bucket count and level).
    Bucket ``targets[t]`` starts at page ``primaries[t]``; the other pages are
    reused as overflow pages in order. Updates ``next_of``, ``bucket_seq``,
    ``last_seq``. Returns ``(used, n_spare)``: the first ``used`` of the
    ``n_spare`` pages written to ``spare_out`` were reused, the caller releases
    the rest; ``used`` is -1 if pages ran out (cannot happen when the caller
    supplies whole source chains: a split needs at most one page more than its
    chain had, its image's new primary page).
    """
    nbk, lvl, S, G, nb, ko, vo, ks, vs, pb, max_fill = (geo[0], geo[1], geo[2], geo[3],
                                                        geo[4], geo[5], geo[6], geo[7],
                                                        geo[8], geo[9], geo[10])
    u8 = pool
    u16 = pool.view(np.uint16)
    u32 = pool.view(np.uint32)
    u64 = pool.view(np.uint64)
    vw = vs & 7 == 0  # whole words: values are 8-aligned then (vo and pages are)
    vwb = vbuf.reshape(-1).view(np.uint64) if vw else np.zeros(0, np.uint64)
    nvw = vs >> 3
    m = 0
    for p in range(pages.shape[0]):
        base = fseq[pages[p]] * pb
        for s in range(S):
            if u8[base + HDR + s] >= 0x80:
                ka = base + ko + s * ks
                if ks == 4:
                    kwbuf[m, 0] = np.uint64(u32[ka >> 2])
                elif ks == 8:
                    kwbuf[m, 0] = u64[ka >> 3]
                else:
                    for j in range(ks):
                        kbuf[m, j] = u8[ka + j]
                va = base + vo + s * vs
                if vw:
                    for j in range(nvw):
                        vwb[m * nvw + j] = u64[(va >> 3) + j]
                else:
                    for j in range(vs):
                        vbuf[m, j] = u8[va + j]
                m += 1
    spare = np.empty(pages.shape[0], np.int64)
    n_spare = 0
    for p in range(pages.shape[0]):
        q = pages[p]
        base = fseq[q] * pb
        for s in range(S):
            u8[base + HDR + s] = 0
        u32[(base + OFF_COUNT) >> 2] = 0
        u32[(base + OFF_START) >> 2] = 0
        u64[(base + OFF_NEXT) >> 3] = NIL
        u16[(base + OFF_FLAGS) >> 1] = 0
        next_of[q] = -1
        is_primary = False
        for t in range(primaries.shape[0]):
            if primaries[t] == q:
                is_primary = True
        if not is_primary:
            spare[n_spare] = q
            n_spare += 1
    for t in range(targets.shape[0]):
        q = primaries[t]
        base = fseq[q] * pb
        u16[(base + OFF_FLAGS) >> 1] = 1
        u64[(base + OFF_AUX0) >> 3] = np.uint64(targets[t])
        bucket_seq[targets[t]] = q
        last_seq[targets[t]] = q
    used = 0
    W = kwbuf.shape[1]
    for r in range(m):
        h = _mix(kwbuf[r, 0])
        for j in range(1, W):
            h = _mix(h ^ kwbuf[r, j])
        b = _bucket(h, nbk, lvl)
        q = last_seq[b]
        base = fseq[q] * pb
        if np.int64(u32[(base + OFF_START) >> 2]) >= max_fill:
            if used >= n_spare:
                return -1, n_spare
            nq = spare[used]
            used += 1
            nbase = fseq[nq] * pb
            u16[(nbase + OFF_FLAGS) >> 1] = 0
            u64[(nbase + OFF_AUX0) >> 3] = np.uint64(b)
            u64[(base + OFF_NEXT) >> 3] = (np.uint64(psid) << np.uint64(32)) | np.uint64(nq)
            next_of[q] = nq
            last_seq[b] = nq
            base = nbase
        g = _home(h, nb)
        step = np.int64(-1)
        slot = np.int64(-1)
        for _ in range(nb):
            c0 = base + HDR + g * G
            if G == 16:  # the first EMPTY byte of the group's two ctrl words
                for half in range(2):
                    e = _zero_bytes(u64[(c0 >> 3) + half])
                    if e != 0:
                        slot = g * G + 8 * half + (np.int64(trailing_zeros(e)) >> 3)
                        break
            else:
                for j in range(G):
                    if u8[c0 + j] == 0:
                        slot = g * G + j
                        break
            if slot >= 0:
                break
            if step < 0:
                step = _step(h, nb)
            g += step
            if g >= nb:
                g -= nb
        u8[base + HDR + slot] = _tag(h)
        ka = base + ko + slot * ks
        if ks == 4:
            u32[ka >> 2] = np.uint32(kwbuf[r, 0])
        elif ks == 8:
            u64[ka >> 3] = kwbuf[r, 0]
        else:
            for j in range(ks):
                u8[ka + j] = kbuf[r, j]
        va = base + vo + slot * vs
        if vw:
            for j in range(nvw):
                u64[(va >> 3) + j] = vwb[r * nvw + j]
        else:
            for j in range(vs):
                u8[va + j] = vbuf[r, j]
        a = (base + OFF_COUNT) >> 2
        u32[a] = np.uint32(np.int64(u32[a]) + 1)
        a = (base + OFF_START) >> 2
        u32[a] = np.uint32(np.int64(u32[a]) + 1)
    for t in range(n_spare):
        spare_out[t] = spare[t]
    return used, n_spare


@jit
def crowded(buckets: Any, bucket_seq: Any, next_of: Any, fseq: Any, pool: Any, pb: Any,
            limit: Any) -> Any:
    """The buckets of ``buckets`` whose chains hold more than ``limit`` tombstones.

    A page's tombstones are its used slots (header ``start``) minus its live
    records (``count``); a bucket's are the sum over its chain (``bucket_seq``,
    ``next_of``, ``fseq`` = page table frames). One pass, no allocation per bucket.
    """
    u32 = pool.view(np.uint32)
    out = np.empty(len(buckets), np.int64)
    m = 0
    for i in range(len(buckets)):
        b = buckets[i]
        q = bucket_seq[b]
        tomb = np.int64(0)
        while q >= 0:
            base = fseq[q] * pb
            tomb += np.int64(u32[(base + OFF_START) >> 2]) - np.int64(u32[(base + OFF_COUNT) >> 2])
            q = next_of[q]
        if tomb > limit:
            out[m] = b
            m += 1
    return out[:m]
