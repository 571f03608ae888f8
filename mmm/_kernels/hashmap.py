"""Compiled kernels of `mmm.structures.hashmap.HashMap` (numba).

The kernels work on the page pool as flat typed views (``TV``: the same bytes
as int8, int16, int32, int64, uint8, uint16, uint32, uint64, float32, float64)
and on the page table arrays of the map. Page layout (see the HashMap module
docstring)::

    [header 64 B][ctrl: S bytes, padded to 8][keys: S keys, padded to 8][values: S values]

Keys arrive as ``kw``, a ``(n, W)`` uint64 array: each key's canonical bytes
zero-padded to whole words (the hash input), and ``kb``, the same bytes as a
``(n, 8 W)`` uint8 view (for comparing and copying).

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

import numpy as np

from mmm._kernels import jit

__all__ = ["hash_keys", "upsert_rows", "lookup_rows", "delete_rows", "rechain",
           "DONE", "NEED_CLONE", "NEED_PAGE", "NEED_SPLIT", "OP_CODES", "DTYPE_CODES"]

HDR = 64
OFF_FLAGS, OFF_COUNT, OFF_START, OFF_NEXT, OFF_AUX0 = 6, 24, 28, 40, 48
NIL = np.uint64(0xFFFFFFFFFFFFFFFF)

DONE, NEED_CLONE, NEED_PAGE, NEED_SPLIT = 0, 1, 2, 3
COUNT, SUM, MIN, MAX, LAST, FIRST = 0, 1, 2, 3, 4, 5
OP_CODES = {"count": COUNT, "sum": SUM, "min": MIN, "max": MAX, "last": LAST, "first": FIRST}
I1, I2, I4, I8, U1, U2, U4, U8, F4, F8, BYTES = range(11)
DTYPE_CODES = {"i1": I1, "i2": I2, "i4": I4, "i8": I8, "u1": U1, "u2": U2, "u4": U4,
               "u8": U8, "f4": F4, "f8": F8, "b1": U1}
L_INT, L_UINT, L_FLOAT, L_BYTES = 0, 1, 2, 3


# -- hashing and addressing ---------------------------------------------------------------
@jit
def _mix(x: np.uint64) -> np.uint64:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@jit
def _hash_row(kw, i):  # type: ignore[no-untyped-def]
    h = _mix(kw[i, 0])
    for j in range(1, kw.shape[1]):
        h = _mix(h ^ kw[i, j])
    return h


@jit
def hash_keys(kw):  # type: ignore[no-untyped-def]
    """splitmix64 hash of each key row of ``kw`` (uint64 words)."""
    n = kw.shape[0]
    out = np.empty(n, np.uint64)
    for i in range(n):
        out[i] = _hash_row(kw, i)
    return out


@jit
def _bucket(h, nbk, lvl):  # type: ignore[no-untyped-def]
    b = np.int64(h & np.uint64((1 << (lvl + 1)) - 1))
    if b >= nbk:
        b -= np.int64(1) << lvl
    return b


@jit
def _home(h, nb):  # type: ignore[no-untyped-def]
    return np.int64(((h >> np.uint64(32)) * np.uint64(nb)) >> np.uint64(32))


@jit
def _step(h, nb):  # type: ignore[no-untyped-def]
    if nb == 1:
        return np.int64(0)
    h2 = _mix(h ^ np.uint64(0x5851F42D4C957F2D))
    return 1 + np.int64(((h2 >> np.uint64(40)) * np.uint64(nb - 1)) >> np.uint64(24))


@jit
def _tag(h):  # type: ignore[no-untyped-def]
    return np.uint8(((h >> np.uint64(24)) & np.uint64(0x7F)) | np.uint64(0x80))


# -- header fields -----------------------------------------------------------------------------
@jit
def _count(TV, base):  # type: ignore[no-untyped-def]
    return np.int64(TV[6][(base + OFF_COUNT) >> 2])


@jit
def _fill(TV, base):  # type: ignore[no-untyped-def]
    return np.int64(TV[6][(base + OFF_START) >> 2])


@jit
def _add_count(TV, base, d_count, d_fill):  # type: ignore[no-untyped-def]
    a = (base + OFF_COUNT) >> 2
    TV[6][a] = np.uint32(np.int64(TV[6][a]) + d_count)
    a = (base + OFF_START) >> 2
    TV[6][a] = np.uint32(np.int64(TV[6][a]) + d_fill)


# -- keys ------------------------------------------------------------------------------------------
@jit
def _key_eq(TV, addr, kw, kb, i, ks):  # type: ignore[no-untyped-def]
    if ks == 8:
        return TV[7][addr >> 3] == kw[i, 0]
    if ks == 4:
        return np.uint64(TV[6][addr >> 2]) == kw[i, 0]
    if ks == 2:
        return np.uint64(TV[5][addr >> 1]) == kw[i, 0]
    if ks == 1:
        return np.uint64(TV[4][addr]) == kw[i, 0]
    u8 = TV[4]
    for j in range(ks):
        if u8[addr + j] != kb[i, j]:
            return False
    return True


@jit
def _probe(TV, kw, kb, i, h, ks, fseq, next_of, q, S, G, nb, ko, pb):  # type: ignore[no-untyped-def]
    """(seq, slot) of key ``i`` in the chain starting at page ``q``, (-1, -1) if absent."""
    tag = _tag(h)
    home = _home(h, nb)
    step = _step(h, nb)
    u8 = TV[4]
    while q >= 0:
        base = fseq[q] * pb
        g = home
        for _ in range(nb):
            empty = False
            c0 = base + HDR + g * G
            for j in range(G):
                c = u8[c0 + j]
                if c == tag:
                    s = g * G + j
                    if _key_eq(TV, base + ko + s * ks, kw, kb, i, ks):
                        return q, s
                elif c == 0:
                    empty = True
            if empty:
                break
            g += step
            if g >= nb:
                g -= nb
        q = next_of[q]
    return np.int64(-1), np.int64(-1)


@jit
def _free_slot(TV, base, h, G, nb):  # type: ignore[no-untyped-def]
    """First free (EMPTY or TOMB) slot on key ``h``'s probe sequence in the page at ``base``."""
    home = _home(h, nb)
    step = _step(h, nb)
    u8 = TV[4]
    g = home
    for _ in range(nb):
        c0 = base + HDR + g * G
        for j in range(G):
            if u8[c0 + j] < 0x80:
                return g * G + j
        g += step
        if g >= nb:
            g -= nb
    return np.int64(-1)


# -- typed field access ------------------------------------------------------------------------------
_SIZES = (1, 2, 4, 8, 1, 2, 4, 8, 4, 8)


@jit
def _raw(TV, a, size):  # type: ignore[no-untyped-def]
    u8 = TV[4]
    v = np.uint64(0)
    for b in range(size):
        v |= np.uint64(u8[a + b]) << np.uint64(8 * b)
    return v


@jit
def _put_raw(TV, a, size, v):  # type: ignore[no-untyped-def]
    u8 = TV[4]
    for b in range(size):
        u8[a + b] = np.uint8((v >> np.uint64(8 * b)) & np.uint64(0xFF))


@jit
def _ld_i(TV, a, code, al):  # type: ignore[no-untyped-def]
    if al:
        if code == I8:
            return TV[3][a >> 3]
        if code == I4:
            return np.int64(TV[2][a >> 2])
        if code == U4:
            return np.int64(TV[6][a >> 2])
        if code == I2:
            return np.int64(TV[1][a >> 1])
        if code == U2:
            return np.int64(TV[5][a >> 1])
        if code == I1:
            return np.int64(TV[0][a])
        return np.int64(TV[4][a])
    if code == I8:
        return np.int64(_raw(TV, a, 8))
    if code == I4:
        return np.int64(np.int32(np.uint32(_raw(TV, a, 4))))
    if code == U4:
        return np.int64(_raw(TV, a, 4))
    if code == I2:
        return np.int64(np.int16(np.uint16(_raw(TV, a, 2))))
    if code == U2:
        return np.int64(_raw(TV, a, 2))
    if code == I1:
        return np.int64(TV[0][a])
    return np.int64(TV[4][a])


@jit
def _st_i(TV, a, code, al, v):  # type: ignore[no-untyped-def]
    if al:
        if code == I8:
            TV[3][a >> 3] = v
        elif code == I4:
            TV[2][a >> 2] = np.int32(v)
        elif code == U4:
            TV[6][a >> 2] = np.uint32(v)
        elif code == I2:
            TV[1][a >> 1] = np.int16(v)
        elif code == U2:
            TV[5][a >> 1] = np.uint16(v)
        elif code == I1:
            TV[0][a] = np.int8(v)
        else:
            TV[4][a] = np.uint8(v)
        return
    size = 8 if code == I8 else 4 if (code == I4 or code == U4) else \
        2 if (code == I2 or code == U2) else 1
    _put_raw(TV, a, size, np.uint64(v))


@jit
def _ld_u(TV, a, al):  # type: ignore[no-untyped-def]
    if al:
        return TV[7][a >> 3]
    return _raw(TV, a, 8)


@jit
def _st_u(TV, a, al, v):  # type: ignore[no-untyped-def]
    if al:
        TV[7][a >> 3] = v
    else:
        _put_raw(TV, a, 8, v)


@jit
def _ld_f(TV, SC, a, code, al):  # type: ignore[no-untyped-def]
    if code == F8:
        if al:
            return TV[9][a >> 3]
        SC[0][0] = _raw(TV, a, 8)
        return SC[1][0]
    if al:
        return np.float64(TV[8][a >> 2])
    SC[2][0] = np.uint32(_raw(TV, a, 4))
    return np.float64(SC[3][0])


@jit
def _st_f(TV, SC, a, code, al, v):  # type: ignore[no-untyped-def]
    if code == F8:
        if al:
            TV[9][a >> 3] = v
        else:
            SC[1][0] = v
            _put_raw(TV, a, 8, SC[0][0])
    else:
        if al:
            TV[8][a >> 2] = np.float32(v)
        else:
            SC[3][0] = np.float32(v)
            _put_raw(TV, a, 4, np.uint64(SC[2][0]))


@jit
def _bytes_cmp(TV, a, BC, i, boff, size):  # type: ignore[no-untyped-def]
    """Sign of (input bytes) - (stored bytes), lexicographic over unsigned bytes."""
    u8 = TV[4]
    for b in range(size):
        x = BC[i, boff + b]
        y = u8[a + b]
        if x != y:
            return -1 if x < y else 1
    return 0


@jit
def _bytes_set(TV, a, BC, i, boff, size):  # type: ignore[no-untyped-def]
    u8 = TV[4]
    for b in range(size):
        u8[a + b] = BC[i, boff + b]


@jit
def _combine(TV, SC, va, new, i, ops, codes, offs, sizes, lanes, lidx, aligned,
             IC, UC, FC, BC):  # type: ignore[no-untyped-def]
    """Apply input row ``i`` to the value record at ``va`` (``new``: just inserted)."""
    for j in range(ops.shape[0]):
        op = ops[j]
        a = va + offs[j]
        code = codes[j]
        al = aligned[j]
        lane = lanes[j]
        c = lidx[j]
        if lane == L_INT:
            x = np.int64(1) if op == COUNT else IC[c, i]
            if new:
                _st_i(TV, a, code, al, x)
            elif op == COUNT or op == SUM:
                _st_i(TV, a, code, al, _ld_i(TV, a, code, al) + x)
            elif op == MIN:
                if x < _ld_i(TV, a, code, al):
                    _st_i(TV, a, code, al, x)
            elif op == MAX:
                if x > _ld_i(TV, a, code, al):
                    _st_i(TV, a, code, al, x)
            elif op == LAST:
                _st_i(TV, a, code, al, x)
        elif lane == L_FLOAT:
            y = 1.0 if op == COUNT else FC[c, i]
            if new:
                _st_f(TV, SC, a, code, al, y)
            elif op == COUNT or op == SUM:
                _st_f(TV, SC, a, code, al, _ld_f(TV, SC, a, code, al) + y)
            elif op == MIN or op == MAX:
                old = _ld_f(TV, SC, a, code, al)
                if old == old:  # NaN stays NaN (np.minimum / np.maximum semantics)
                    if y != y or (op == MIN and y < old) or (op == MAX and y > old):
                        _st_f(TV, SC, a, code, al, y)
            elif op == LAST:
                _st_f(TV, SC, a, code, al, y)
        elif lane == L_UINT:
            u = np.uint64(1) if op == COUNT else UC[c, i]
            if new:
                _st_u(TV, a, al, u)
            elif op == COUNT or op == SUM:
                _st_u(TV, a, al, _ld_u(TV, a, al) + u)
            elif op == MIN:
                if u < _ld_u(TV, a, al):
                    _st_u(TV, a, al, u)
            elif op == MAX:
                if u > _ld_u(TV, a, al):
                    _st_u(TV, a, al, u)
            elif op == LAST:
                _st_u(TV, a, al, u)
        else:  # bytes: first / last copy, min / max compare lexicographically
            size = sizes[j]
            if new or op == LAST:
                _bytes_set(TV, a, BC, i, c, size)
            elif op == MIN:
                if _bytes_cmp(TV, a, BC, i, c, size) < 0:
                    _bytes_set(TV, a, BC, i, c, size)
            elif op == MAX:
                if _bytes_cmp(TV, a, BC, i, c, size) > 0:
                    _bytes_set(TV, a, BC, i, c, size)


# -- batch kernels --------------------------------------------------------------------------------
@jit
def upsert_rows(i0, kw, kb, TV, SC, fseq, next_of, bucket_seq, last_seq, pins, mod, geo,
                ops, codes, offs, sizes, lanes, lidx, aligned, IC, UC, FC, BC,
                out, state):  # type: ignore[no-untyped-def]
    """Upsert rows ``i0..n-1`` in input order; stop early with a request.

    ``geo`` = (n_buckets, level, S, G, n_groups, key_off, val_off, key_size,
    val_size, page_bytes, max_fill, split_limit, epoch). ``state`` = [len,
    row, arg]: the map's length (updated), and on return the row the kernel
    stopped at and the page seq (``NEED_CLONE``) or bucket (``NEED_PAGE``).
    ``out`` (``(n, val_size)`` uint8, or 0 rows) receives each row's value
    right after the row was applied. Returns a status code.
    """
    nbk, lvl, S, G, nb, ko, vo, ks, vs, pb, max_fill, limit, epoch = (
        geo[0], geo[1], geo[2], geo[3], geo[4], geo[5], geo[6], geo[7], geo[8], geo[9],
        geo[10], geo[11], geo[12])
    n = kw.shape[0]
    want = out.shape[0] > 0
    u8 = TV[4]
    for i in range(i0, n):
        h = _hash_row(kw, i)
        b = _bucket(h, nbk, lvl)
        q, s = _probe(TV, kw, kb, i, h, ks, fseq, next_of, bucket_seq[b], S, G, nb, ko, pb)
        if q >= 0:
            f = fseq[q]
            if pins[f] > 0:
                state[1] = i
                state[2] = q
                return NEED_CLONE
            mod[q] = epoch
            base = f * pb
            new = False
        else:
            if state[0] + 1 > limit:
                state[1] = i
                return NEED_SPLIT
            q = last_seq[b]
            f = fseq[q]
            base = f * pb
            if _fill(TV, base) >= max_fill:
                state[1] = i
                state[2] = b
                return NEED_PAGE
            if pins[f] > 0:
                state[1] = i
                state[2] = q
                return NEED_CLONE
            mod[q] = epoch
            s = _free_slot(TV, base, h, G, nb)
            was_empty = u8[base + HDR + s] == 0
            u8[base + HDR + s] = _tag(h)
            ka = base + ko + s * ks
            for j in range(ks):
                u8[ka + j] = kb[i, j]
            va = base + vo + s * vs
            for j in range(vs):
                u8[va + j] = 0
            _add_count(TV, base, 1, 1 if was_empty else 0)
            state[0] += 1
            new = True
        va = base + vo + s * vs
        _combine(TV, SC, va, new, i, ops, codes, offs, sizes, lanes, lidx, aligned,
                 IC, UC, FC, BC)
        if want:
            for j in range(vs):
                out[i, j] = u8[va + j]
    state[1] = n
    return DONE


@jit
def lookup_rows(kw, kb, TV, fseq, next_of, bucket_seq, geo, out, found):  # type: ignore[no-untyped-def]
    """Find each key; copy its value bytes into ``out`` (if it has rows) and set ``found``."""
    nbk, lvl, S, G, nb, ko, vo, ks, vs, pb = (geo[0], geo[1], geo[2], geo[3], geo[4],
                                              geo[5], geo[6], geo[7], geo[8], geo[9])
    want = out.shape[0] > 0
    u8 = TV[4]
    for i in range(kw.shape[0]):
        h = _hash_row(kw, i)
        b = _bucket(h, nbk, lvl)
        q, s = _probe(TV, kw, kb, i, h, ks, fseq, next_of, bucket_seq[b], S, G, nb, ko, pb)
        if q >= 0:
            found[i] = True
            if want:
                va = fseq[q] * pb + vo + s * vs
                for j in range(vs):
                    out[i, j] = u8[va + j]
        else:
            found[i] = False


@jit
def delete_rows(i0, kw, kb, TV, fseq, next_of, bucket_seq, pins, mod, geo, found,
                state):  # type: ignore[no-untyped-def]
    """Delete distinct keys ``i0..n-1`` (tombstones); stop with ``NEED_CLONE`` like
    `upsert_rows`. ``state`` = [len, row, arg]."""
    nbk, lvl, S, G, nb, ko, ks, pb, epoch = (geo[0], geo[1], geo[2], geo[3], geo[4],
                                             geo[5], geo[7], geo[9], geo[12])
    u8 = TV[4]
    n = kw.shape[0]
    for i in range(i0, n):
        h = _hash_row(kw, i)
        b = _bucket(h, nbk, lvl)
        q, s = _probe(TV, kw, kb, i, h, ks, fseq, next_of, bucket_seq[b], S, G, nb, ko, pb)
        if q < 0:
            found[i] = False
            continue
        f = fseq[q]
        if pins[f] > 0:
            state[1] = i
            state[2] = q
            return NEED_CLONE
        mod[q] = epoch
        base = f * pb
        u8[base + HDR + s] = 1
        _add_count(TV, base, -1, 0)
        state[0] -= 1
        found[i] = True
    state[1] = n
    return DONE


@jit
def rechain(pages, targets, primaries, TV, fseq, next_of, bucket_seq, last_seq, geo,
            psid, kwbuf, kbuf, vbuf, spare_out):  # type: ignore[no-untyped-def]
    """Rewrite the records of the chains in ``pages`` into the ``targets`` buckets.

    Splits (a bucket into itself and its image), merges (the last bucket into
    its buddy) and compactions (tombstones out) are all this one pass: every
    record of ``pages`` (all writable, all pages of the source chains) is
    gathered into ``kbuf``/``vbuf``, the pages are reset, and each record is
    placed again into the chain of its bucket under ``geo`` (new bucket count
    and level). Bucket ``targets[t]`` starts at page ``primaries[t]``; the
    other pages of ``pages`` are reused as overflow pages in order.
    ``kwbuf``/``kbuf`` (uint64 words and their uint8 view) and ``vbuf`` are
    scratch rows for the records. Updates ``next_of``, ``bucket_seq``,
    ``last_seq``. Returns ``(used, n_spare)``: the first ``used`` of the
    ``n_spare`` pages written to ``spare_out`` were reused as overflow pages,
    the caller releases the rest; ``used`` is -1 if pages ran out (cannot
    happen when the caller supplies the whole source chains: a split needs at
    most one page more than its chain had, its image's new primary page).
    """
    nbk, lvl, S, G, nb, ko, vo, ks, vs, pb, max_fill = (geo[0], geo[1], geo[2], geo[3],
                                                        geo[4], geo[5], geo[6], geo[7],
                                                        geo[8], geo[9], geo[10])
    u8 = TV[4]
    m = 0
    for p in range(pages.shape[0]):
        base = fseq[pages[p]] * pb
        for s in range(S):
            if u8[base + HDR + s] >= 0x80:
                ka = base + ko + s * ks
                for j in range(ks):
                    kbuf[m, j] = u8[ka + j]
                va = base + vo + s * vs
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
        TV[6][(base + OFF_COUNT) >> 2] = 0
        TV[6][(base + OFF_START) >> 2] = 0
        TV[7][(base + OFF_NEXT) >> 3] = NIL
        TV[5][(base + OFF_FLAGS) >> 1] = 0
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
        TV[5][(base + OFF_FLAGS) >> 1] = 1
        TV[7][(base + OFF_AUX0) >> 3] = np.uint64(targets[t])
        TV[7][(base + OFF_NEXT) >> 3] = NIL
        next_of[q] = -1
        bucket_seq[targets[t]] = q
        last_seq[targets[t]] = q
    used = 0
    for r in range(m):
        h = _hash_row(kwbuf, r)
        b = _bucket(h, nbk, lvl)
        q = last_seq[b]
        base = fseq[q] * pb
        if _fill(TV, base) >= max_fill:
            if used >= n_spare:
                return -1, n_spare
            nq = spare[used]
            used += 1
            nbase = fseq[nq] * pb
            TV[5][(nbase + OFF_FLAGS) >> 1] = 0
            TV[7][(nbase + OFF_AUX0) >> 3] = np.uint64(b)
            TV[7][(base + OFF_NEXT) >> 3] = (np.uint64(psid) << np.uint64(32)) | np.uint64(nq)
            next_of[q] = nq
            last_seq[b] = nq
            q = nq
            base = nbase
        s = _free_slot(TV, base, h, G, nb)
        u8[base + HDR + s] = _tag(h)
        ka = base + ko + s * ks
        for j in range(ks):
            u8[ka + j] = kbuf[r, j]
        va = base + vo + s * vs
        for j in range(vs):
            u8[va + j] = vbuf[r, j]
        _add_count(TV, base, 1, 1)
    for t in range(n_spare):
        spare_out[t] = spare[t]
    return used, n_spare
