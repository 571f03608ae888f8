"""Compiled kernels of `mmm.structures.hashmap.HashMap` (numba).

The kernels work on the page pool as one flat uint8 array (viewed inside as
the integer and float types they need) and on the page table arrays of the
map. Page layouts (see the HashMap module docstring): version 1 keeps each kind of
bytes in its own region, version 2 (new maps) keeps a probe group's bytes together::

    1: [header 64 B][ctrl: S bytes, padded to 8][keys: S keys, padded to 8][values: S values]
    2: [header 64 B][group 0][group 1]...  group = [16 ctrl][16 records: key (pad) value]

Every kernel addresses a slot through the map's *layout tuple* ``lay`` = (ctrl offset,
ctrl group stride, key offset, key group stride, key slot stride, value offset, value
group stride, value slot stride): slot ``s`` of group ``s >> 4`` (position ``s & 15``;
a page of fewer than 16 slots is one group) has its ctrl byte at ``lay[0] + (s >> 4) *
lay[1] + (s & 15)``, its key at ``lay[2] + (s >> 4) * lay[3] + (s & 15) * lay[4]`` and
its value likewise from ``lay[5]``; one code path serves both versions.

Keys arrive as ``kw``, a ``(n, W)`` uint64 array: each key's canonical bytes
zero-padded to whole words (the hash input), and ``kb``, the same bytes as a
``(n, 8 W)`` uint8 view (for comparing and copying).

A kernel is a few named steps. A numba call (even an inlined one) that takes
arrays costs reference counting per call, more than a probe: so a step that
runs once per chunk of rows may take arrays, and a step that runs per row, per
page or per slot takes only scalars and byte addresses (``arr.ctypes.data`` +
offset, read and written through the ``_ld_*`` / ``_st_*`` intrinsics) and is
inlined into its caller.

An address is valid only while its array is: a kernel takes addresses only of its
*arguments* (the caller holds them for the whole call), never of an array it
allocates itself. numba frees a local array right after its last use *as an array*,
so the address of ``sc = np.empty(...)`` taken once before a loop dangles inside the
loop: another thread's allocation (the kernels release the GIL) takes that memory,
and its bytes and the kernel's per-row scratch overwrite each other (a segfault, or a
wrong result). Scratch memory therefore comes from the caller (``rows``' ``scratch``);
``tests/mmm/test_kernel_addresses.py`` checks the rule on this module's source.

Copy-on-write: a kernel never writes a frame whose pin count is non-zero,
with one exception: the value of a key already in a page that only in-place
snapshots pin (soft pins, `mmm.pool`) is updated in place, after its old bytes
are appended to the pool's undo log (`_log_before`), which the snapshot's
readers lay over their copies. When a row needs any other pinned page (or the
log is full), the kernel stops *before writing anything for that row* and
returns ``NEED_CLONE`` with the page's sequence number; the caller un-shares it
(``PageManager.writable``) and calls again from that row.
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

from mmm._kernels import jit
from mmm.pool import HARD_PIN  # a pin count at or above it: no write in place

__all__ = ["hash_keys", "rows", "rechain", "crowded", "SCRATCH", "DONE", "NEED_CLONE",
           "NEED_PAGE", "NEED_SPLIT", "MODE_GET", "MODE_UPSERT", "MODE_DELETE", "MODE_EXPIRE",
           "OP_CODES", "DTYPE_CODES"]

F = TypeVar("F", bound=Callable[..., Any])


def _scalar(fn: F) -> F:
    """A scalar function, compiled into its callers. Not cached on disk itself: its
    callers' cached code holds it, and a disk cache costs each such function about 1 ms
    at import (the cache's locator and index)."""
    out: F = numba.njit(inline="always", nogil=True)(fn)  # type: ignore[assignment]
    return out


HDR = 64
OFF_FLAGS, OFF_COUNT, OFF_START, OFF_NEXT, OFF_AUX0 = 6, 24, 28, 40, 48
NIL = np.uint64(0xFFFFFFFFFFFFFFFF)

DONE, NEED_CLONE, NEED_PAGE, NEED_SPLIT = 0, 1, 2, 3
MODE_GET, MODE_UPSERT, MODE_DELETE, MODE_EXPIRE = 0, 1, 2, 3
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
    """Linear hashing's bucket of hash ``h`` among ``nbk`` buckets at level ``lvl``
    (branch-free: whether a hash falls past the split pointer is a coin toss)."""
    b = np.int64(h & np.uint64((1 << (lvl + 1)) - 1))
    return b - (np.int64(b >= nbk) << lvl)


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


LAY = 13  # the layout tuple's first entry in ``geo`` (`rows`, `rechain`)


@_scalar
def _lay_at(G: Any, at: Any) -> Any:
    """The layout tuple (module docstring) stored as 8 int64 at address ``G + 8 * at``."""
    return (_ld_i64(G + 8 * at), _ld_i64(G + 8 * at + 8), _ld_i64(G + 8 * at + 16),
            _ld_i64(G + 8 * at + 24), _ld_i64(G + 8 * at + 32), _ld_i64(G + 8 * at + 40),
            _ld_i64(G + 8 * at + 48), _ld_i64(G + 8 * at + 56))


@_scalar
def _ca(base: Any, s: Any, lay: Any) -> Any:
    """Address of slot ``s``'s ctrl byte in the page at address ``base``."""
    return base + lay[0] + (s >> 4) * lay[1] + (s & 15)


@_scalar
def _cga(base: Any, g: Any, lay: Any) -> Any:
    """Address of group ``g``'s ctrl bytes in the page at address ``base``."""
    return base + lay[0] + g * lay[1]


@_scalar
def _ka(base: Any, s: Any, lay: Any) -> Any:
    """Address of slot ``s``'s key in the page at address ``base``."""
    return base + lay[2] + (s >> 4) * lay[3] + (s & 15) * lay[4]


@_scalar
def _va(base: Any, s: Any, lay: Any) -> Any:
    """Address of slot ``s``'s value in the page at address ``base``."""
    return base + lay[5] + (s >> 4) * lay[6] + (s & 15) * lay[7]


def _emit_prefetch(builder: Any, ptr: Any) -> None:
    """Emit ``llvm.prefetch(ptr, read, high locality, data cache)``."""
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
    fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, fnty, "llvm.prefetch.p0")
    builder.call(fn, [ptr, i32(0), i32(3), i32(1)])


def _prefetch_impl(typingctx: Any, arr: Any, idx: Any) -> Any:
    """``llvm.prefetch`` of ``arr[idx]`` (read, keep in all cache levels): a hint, no effect
    on results."""
    sig = types.void(arr, idx)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(  # type: ignore[no-untyped-call]
            context, builder, aryty, ary, [args[1]])
        _emit_prefetch(builder, ptr)
        return context.get_dummy_value()
    return sig, codegen


_prefetch: Any = intrinsic(_prefetch_impl)
trailing_zeros: Any = _tz  # count of trailing zero bits (an LLVM intrinsic)
CHUNK = 32  # rows per pass: enough misses in flight to hide the memory latency
ONES = np.uint64(0x0101010101010101)
LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
HIGH = np.uint64(0x8080808080808080)


# Raw memory access. The step helpers below take byte *addresses* (``arr.ctypes.data`` +
# offset) and scalars, never arrays: a numba call that takes arrays costs reference counting
# per call even when inlined, more than a probe. Loads and stores are unaligned-safe.


def _load_of(ty: Any, name: str) -> Any:
    """An intrinsic ``name(addr)``: the ``ty`` value at byte address ``addr``."""
    def impl(typingctx: Any, addr: Any) -> Any:
        sig = ty(types.int64)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ptr = builder.inttoptr(args[0], context.get_value_type(ty).as_pointer())
            return builder.load(ptr, align=1)
        return sig, codegen
    impl.__name__ = impl.__qualname__ = name
    return intrinsic(impl)


def _store_of(ty: Any, name: str) -> Any:
    """An intrinsic ``name(addr, v)``: store ``v`` as a ``ty`` at byte address ``addr``."""
    def impl(typingctx: Any, addr: Any, v: Any) -> Any:
        sig = types.void(types.int64, ty)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ptr = builder.inttoptr(args[0], context.get_value_type(ty).as_pointer())
            builder.store(args[1], ptr, align=1)
            return context.get_dummy_value()
        return sig, codegen
    impl.__name__ = impl.__qualname__ = name
    return intrinsic(impl)


_ld_u8, _ld_u16, _ld_u32, _ld_u64 = (_load_of(t, f"_ld_{n}") for t, n in (
    (types.uint8, "u8"), (types.uint16, "u16"), (types.uint32, "u32"), (types.uint64, "u64")))
_ld_i8, _ld_i16, _ld_i32, _ld_i64 = (_load_of(t, f"_ld_{n}") for t, n in (
    (types.int8, "i8"), (types.int16, "i16"), (types.int32, "i32"), (types.int64, "i64")))
_ld_f32, _ld_f64 = (_load_of(t, f"_ld_{n}") for t, n in (
    (types.float32, "f32"), (types.float64, "f64")))
_st_u8, _st_u16, _st_u32, _st_u64 = (_store_of(t, f"_st_{n}") for t, n in (
    (types.uint8, "u8"), (types.uint16, "u16"), (types.uint32, "u32"), (types.uint64, "u64")))
_st_i8, _st_i16, _st_i32, _st_i64 = (_store_of(t, f"_st_{n}") for t, n in (
    (types.int8, "i8"), (types.int16, "i16"), (types.int32, "i32"), (types.int64, "i64")))
_st_f32, _st_f64 = (_store_of(t, f"_st_{n}") for t, n in (
    (types.float32, "f32"), (types.float64, "f64")))


def _prefetch_at_impl(typingctx: Any, addr: Any) -> Any:
    """``llvm.prefetch`` of byte address ``addr`` (a hint, no effect on results)."""
    sig = types.void(types.int64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        _emit_prefetch(builder, ptr)
        return context.get_dummy_value()
    return sig, codegen


_prefetch_at: Any = intrinsic(_prefetch_at_impl)


def _fence_impl(typingctx: Any) -> Any:
    """A release fence: no earlier store moves past a later one (the undo log's order;
    on x86 it only stops the compiler)."""
    sig = types.void()

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        builder.fence("release")
        return context.get_dummy_value()
    return sig, codegen


_fence: Any = intrinsic(_fence_impl)


@_scalar
def _addr(a: Any) -> Any:
    """The address of array ``a``'s data."""
    return np.int64(a.ctypes.data)


@_scalar
def _zero_bytes(x: Any) -> Any:
    """0x80 in each byte of uint64 ``x`` that is zero, 0 elsewhere (exact: no borrows)."""
    return ~(((x & LOW7) + LOW7) | x | LOW7)


@_scalar
def _hash_at(p: Any, W: Any) -> Any:
    """splitmix64 hash of the ``W`` uint64 words at address ``p``."""
    h = _mix(_ld_u64(p))
    for j in range(1, W):
        h = _mix(h ^ _ld_u64(p + 8 * j))
    return h


@_scalar
def _copy(dst: Any, src: Any, n: Any) -> None:
    """Copy ``n`` bytes from address ``src`` to address ``dst`` (no overlap)."""
    j = 0
    while j + 8 <= n:
        _st_u64(dst + j, _ld_u64(src + j))
        j += 8
    if j + 4 <= n:
        _st_u32(dst + j, _ld_u32(src + j))
        j += 4
    while j < n:
        _st_u8(dst + j, _ld_u8(src + j))
        j += 1


@_scalar
def _zero(dst: Any, n: Any) -> None:
    """Zero ``n`` bytes at address ``dst``."""
    j = 0
    while j + 8 <= n:
        _st_u64(dst + j, np.uint64(0))
        j += 8
    while j < n:
        _st_u8(dst + j, np.uint8(0))
        j += 1


@_scalar
def _add_u32(a: Any, d: Any) -> None:
    """Add ``d`` to the uint32 at address ``a`` (a page header counter)."""
    _st_u32(a, np.uint32(np.int64(_ld_u32(a)) + d))


@_scalar
def _bytes_eq(a: Any, b: Any, n: Any) -> Any:
    """The ``n`` bytes at addresses ``a`` and ``b`` are equal."""
    j = 0
    while j + 8 <= n:
        if _ld_u64(a + j) != _ld_u64(b + j):
            return False
        j += 8
    while j < n:
        if _ld_u8(a + j) != _ld_u8(b + j):
            return False
        j += 1
    return True


@_scalar
def _key_eq(ka: Any, ks: Any, k0: Any, kp: Any) -> Any:
    """The stored key at address ``ka`` equals the input key: its first word ``k0`` (zero
    padded), its bytes at address ``kp``."""
    if ks == 8:
        return _ld_u64(ka) == k0
    if ks == 4:
        return np.uint64(_ld_u32(ka)) == k0
    if ks == 2:
        return np.uint64(_ld_u16(ka)) == k0
    if ks == 1:
        return np.uint64(_ld_u8(ka)) == k0
    return _bytes_eq(ka, kp, ks)


@_scalar
def _next_group(g: Any, step: Any, h: Any, nb: Any) -> Any:
    """The group after ``g`` on the probe sequence of hash ``h``; ``step`` is -1 until the
    probe first leaves its home group. Returns ``(g, step)``."""
    if step < 0:
        step = _step(h, nb)
    g += step
    if g >= nb:
        g -= nb
    return g, step


@_scalar
def _group_match(cg: Any, tag: Any) -> Any:
    """The offset of the first ctrl byte equal to ``tag`` in the 16-byte group at address
    ``cg``, or -1."""
    rep = np.uint64(tag) * ONES  # branch-free: which half matches is a coin toss
    t0 = np.int64(trailing_zeros(_zero_bytes(_ld_u64(cg) ^ rep)))  # 64: no match
    t1 = np.int64(trailing_zeros(_zero_bytes(_ld_u64(cg + 8) ^ rep)))
    j = (t0 >> 3) if t0 < 64 else 8 + (t1 >> 3)
    return j if j < 16 else np.int64(-1)


@_scalar
def _group_free(cg: Any, G: Any) -> Any:
    """The offset of the first free (EMPTY or TOMB: below 0x80) ctrl byte of the group at
    address ``cg``, or -1."""
    if G == 16:
        m = ~_ld_u64(cg) & HIGH
        if m != 0:
            return np.int64(trailing_zeros(m)) >> 3
        m = ~_ld_u64(cg + 8) & HIGH
        if m != 0:
            return 8 + (np.int64(trailing_zeros(m)) >> 3)
        return np.int64(-1)
    for j in range(G):
        if _ld_u8(cg + j) < 0x80:
            return np.int64(j)
    return np.int64(-1)


@_scalar
def _probe_group(cg: Any, s0: Any, G: Any, tag: Any, ka0: Any, krs: Any, ks: Any, k0: Any,
                 kp: Any) -> Any:
    """The slot of the key in the group of ctrl bytes at address ``cg`` (slots ``s0`` on,
    the group's keys from address ``ka0``, ``krs`` bytes apart), or -1 if the group has an
    EMPTY slot (the key is not in the page), or -2 (the probe goes on)."""
    empty = False
    if G == 16:  # 16 ctrl bytes as two words: tag matches and EMPTY bytes at once
        rep = np.uint64(tag) * ONES
        for half in range(2):
            w = _ld_u64(cg + 8 * half)
            if _zero_bytes(w) != 0:
                empty = True
            m = _zero_bytes(w ^ rep)
            while m != 0:
                at = 8 * half + (np.int64(trailing_zeros(m)) >> 3)
                if _key_eq(ka0 + at * krs, ks, k0, kp):
                    return s0 + at
                m &= m - np.uint64(1)
    else:
        for j in range(G):
            c = _ld_u8(cg + j)
            if c == tag:
                if _key_eq(ka0 + j * krs, ks, k0, kp):
                    return s0 + j
            elif c == 0:
                empty = True
    return np.int64(-1) if empty else np.int64(-2)


@_scalar
def _find_in_page(base: Any, home: Any, h: Any, G: Any, nb: Any, lay: Any, ks: Any,
                  k0: Any, kp: Any) -> Any:
    """The slot of the key (hash ``h``) in the page at address ``base``, or -1."""
    tag = _tag(h)
    g = home
    step = np.int64(-1)
    for _ in range(nb):
        s = _probe_group(_cga(base, g, lay), g * G, G, tag, _ka(base, g * G, lay), lay[4],
                         ks, k0, kp)
        if s != -2:
            return s
        g, step = _next_group(g, step, h, nb)
    return np.int64(-1)


@_scalar
def _first_free(base: Any, home: Any, h: Any, G: Any, nb: Any, lay: Any) -> Any:
    """The first free slot on the probe sequence of hash ``h`` in the page at address
    ``base``, or -1."""
    g = home
    step = np.int64(-1)
    for _ in range(nb):
        j = _group_free(_cga(base, g, lay), G)
        if j >= 0:
            return g * G + j
        g, step = _next_group(g, step, h, nb)
    return np.int64(-1)


@_scalar
def _slot_holds(base: Any, sl: Any, tag: Any, lay: Any, ks: Any, k0: Any, kp: Any) -> Any:
    """Slot ``sl`` of the page at address ``base`` holds the key."""
    return _ld_u8(_ca(base, sl, lay)) == tag and _key_eq(_ka(base, sl, lay), ks, k0, kp)


@_scalar
def _insert(base: Any, home: Any, h: Any, G: Any, nb: Any, lay: Any, ks: Any,
            vs: Any, kp: Any) -> Any:
    """Put the key (bytes at address ``kp``, hash ``h``) with a zero value into the first
    free slot of the page at address ``base``; returns the slot."""
    s = _first_free(base, home, h, G, nb, lay)
    cp = _ca(base, s, lay)
    was_empty = _ld_u8(cp) == 0
    _st_u8(cp, _tag(h))
    _copy(_ka(base, s, lay), kp, ks)
    _zero(_va(base, s, lay), vs)
    _add_u32(base + OFF_COUNT, 1)
    if was_empty:
        _add_u32(base + OFF_START, 1)
    return s


@_scalar
def _tombstone(base: Any, s: Any, lay: Any) -> None:
    """Delete the record in slot ``s`` of the page at address ``base``."""
    _st_u8(_ca(base, s, lay), np.uint8(1))
    _add_u32(base + OFF_COUNT, -1)


@jit
def hash_keys(kw: Any) -> Any:
    """splitmix64 hash of each key row of ``kw`` (uint64 words)."""
    n = kw.shape[0]
    out = np.empty(n, np.uint64)
    K = _addr(kw)
    for i in range(n):
        out[i] = _hash_at(K + i * kw.strides[0], kw.shape[1])
    return out


# -- rows: its passes over a chunk of rows. They take addresses too (arrays would cost
# reference counting per call): ``GEO`` (int64 geo), ``SC`` (the chunk's scratch rows, see
# `_sc`), ``P`` the pool, ``FS``/``NX``/``BS``/``LS``/``MD`` page tables (int64), ``PN`` pins
# (int32), ``ST`` state (int64), ``K``/``KB``/``O`` key words, key bytes, out rows (with their
# row strides ``kst``/``kbst``/``ost``; ``O`` is 0 when no values are wanted). ---------------

SC_HASH, SC_BUCKET, SC_PAGE, SC_HOME, SC_CAND, SC_VALUE, SC_NEW = range(7)  # scratch rows
SCRATCH = 7 * CHUNK
"""int64 entries of the scratch `rows` takes from its caller (see the module docstring on
why no kernel takes the address of an array it allocated)."""


@_scalar
def _sc(SC: Any, field: Any, r: Any) -> Any:
    """Address of row ``r``'s ``field`` (an ``SC_*`` constant) in the scratch at ``SC``: per
    row of the chunk its hash, bucket, primary page, home group, the home group's first tag
    match in the primary page (-1), the value's address once applied, and whether the row
    inserted its key."""
    return SC + 8 * (field * CHUNK + r)


@_scalar
def _i64(T: Any, i: Any) -> Any:
    """Entry ``i`` of the int64 table at address ``T``."""
    return _ld_i64(T + 8 * i)


@_scalar
def _page(P: Any, FS: Any, q: Any, pb: Any) -> Any:
    """Address of page seq ``q``."""
    return P + _i64(FS, q) * pb


@_scalar
def _hash_chunk(c0: Any, c1: Any, GEO: Any, SC: Any, P: Any, FS: Any, BS: Any, K: Any,
                kst: Any, W: Any) -> None:
    """Pass 1: hash each row, note its bucket, primary page and home group, and prefetch the
    home group's ctrl bytes."""
    nbk, lvl, nb, pb = _i64(GEO, 0), _i64(GEO, 1), _i64(GEO, 4), _i64(GEO, 9)
    lay = _lay_at(GEO, LAY)
    for i in range(c0, c1):
        r = i - c0
        h = _hash_at(K + i * kst, W)
        b = _bucket(h, nbk, lvl)
        q = _i64(BS, b)
        gp = _home(h, nb)
        _st_u64(_sc(SC, SC_HASH, r), h)
        _st_i64(_sc(SC, SC_BUCKET, r), b)
        _st_i64(_sc(SC, SC_PAGE, r), q)
        _st_i64(_sc(SC, SC_HOME, r), gp)
        _prefetch_at(_cga(_page(P, FS, q, pb), gp, lay))


@_scalar
def _prefetch_slot(mode: Any, base: Any, sp: Any, ks: Any, vs: Any, lay: Any) -> None:
    """Prefetch the key and value (not for a delete) of slot ``sp`` of the page at ``base``
    (the lines they span; in layout 2 they are mostly one)."""
    ka = _ka(base, sp, lay)
    _prefetch_at(ka)
    if (ka ^ (ka + ks - 1)) >= 64:  # a key straddling two cache lines
        _prefetch_at(ka + ks - 1)
    if mode != MODE_DELETE:
        va = _va(base, sp, lay)
        if (va ^ ka) >= 64:
            _prefetch_at(va)
        if ((va + vs - 1) ^ ka) >= 64:
            _prefetch_at(va + vs - 1)


@_scalar
def _match_chunk(mode: Any, c0: Any, c1: Any, GEO: Any, SC: Any, P: Any, FS: Any) -> None:
    """Pass 2: match the tag in the home group (its ctrl line is in flight or in cache),
    and prefetch the key and value of the first match, or of the first free slot (an
    insert)."""
    G, ks, vs, pb = _i64(GEO, 3), _i64(GEO, 7), _i64(GEO, 8), _i64(GEO, 9)
    lay = _lay_at(GEO, LAY)
    for r in range(c1 - c0):
        _st_i64(_sc(SC, SC_CAND, r), -1)
        if G != 16:
            continue
        base = _page(P, FS, _i64(_sc(SC, SC_PAGE, r), 0), pb)
        home = _i64(_sc(SC, SC_HOME, r), 0)
        cg = _cga(base, home, lay)
        j = _group_match(cg, _tag(_ld_u64(_sc(SC, SC_HASH, r))))
        if j >= 0:
            _st_i64(_sc(SC, SC_CAND, r), home * G + j)
        elif mode == MODE_UPSERT:
            j = _group_free(cg, G)
            if j >= 0:  # probably a new key: its page's fill count is read and written
                _prefetch_at(base)
        if j >= 0:
            _prefetch_slot(mode, base, home * G + j, ks, vs, lay)


@_scalar
def _find(r: Any, k0: Any, kp: Any, GEO: Any, SC: Any, P: Any, FS: Any, NX: Any,
          BS: Any, lay: Any) -> Any:
    """Find row ``r``'s key (first word ``k0``, bytes at ``kp``): its candidate slot first
    (most keys sit there), then along its bucket's chain. Returns ``(page seq, slot)``,
    page -1 if absent."""
    G, nb, ks, pb = _i64(GEO, 3), _i64(GEO, 4), _i64(GEO, 7), _i64(GEO, 9)
    h = _ld_u64(_sc(SC, SC_HASH, r))
    s = _i64(_sc(SC, SC_CAND, r), 0)
    q = _i64(_sc(SC, SC_PAGE, r), 0)
    if s >= 0 and _slot_holds(_page(P, FS, q, pb), s, _tag(h), lay, ks, k0, kp):
        return q, s
    q = _i64(BS, _i64(_sc(SC, SC_BUCKET, r), 0))
    home = _i64(_sc(SC, SC_HOME, r), 0)
    while q >= 0:
        s = _find_in_page(_page(P, FS, q, pb), home, h, G, nb, lay, ks, k0, kp)
        if s >= 0:
            return q, s
        q = _i64(NX, q)
    return np.int64(-1), np.int64(-1)


@_scalar
def _insert_row(r: Any, kp: Any, GEO: Any, SC: Any, P: Any, FS: Any, LS: Any, PN: Any,
                ST: Any, lay: Any) -> Any:
    """Insert row ``r``'s key (bytes at ``kp``) into the last page of its chain. Returns
    ``(status, page seq, slot)``; a status other than ``DONE`` wrote nothing."""
    G, nb, ks, vs, pb = _i64(GEO, 3), _i64(GEO, 4), _i64(GEO, 7), _i64(GEO, 8), _i64(GEO, 9)
    if _i64(ST, 0) + 1 > _i64(GEO, 11):
        return NEED_SPLIT, np.int64(-1), np.int64(-1)
    b = _i64(_sc(SC, SC_BUCKET, r), 0)
    q = _i64(LS, b)
    base = _page(P, FS, q, pb)
    if np.int64(_ld_u32(base + OFF_START)) >= _i64(GEO, 10):
        _st_i64(ST + 16, b)
        return NEED_PAGE, np.int64(-1), np.int64(-1)
    if _ld_i32(PN + 4 * _i64(FS, q)) > 0:
        _st_i64(ST + 16, q)
        return NEED_CLONE, np.int64(-1), np.int64(-1)
    home = _i64(_sc(SC, SC_HOME, r), 0)
    s = _insert(base, home, _ld_u64(_sc(SC, SC_HASH, r)), G, nb, lay, ks, vs, kp)
    _st_i64(ST, _i64(ST, 0) + 1)
    return DONE, q, s


@_scalar
def _log_before(U: Any, UD: Any, f: Any, off: Any, nb: Any, P: Any, pb: Any) -> Any:
    """Append the ``nb`` bytes at ``off`` of frame ``f`` to the undo log (`mmm.pool`: table
    at ``U``, bytes at ``UD``) before they are written in place: record and bytes first,
    then the count, then (after the return) the write. False when the log is full."""
    n, used = _ld_i64(U), _ld_i64(U + 8)
    if n >= _ld_i64(U + 16) or used + nb > _ld_i64(U + 24):
        return False
    e = U + 8 * (4 + 4 * n)
    _st_i64(e, f)
    _st_i64(e + 8, off)
    _st_i64(e + 16, nb)
    _st_i64(e + 24, used)
    _copy(UD + used, P + f * pb + off, nb)
    _st_i64(U + 8, used + nb)
    _fence()
    _st_i64(U, n + 1)
    _fence()
    return True


@_scalar
def _apply_chunk(mode: Any, c0: Any, c1: Any, GEO: Any, SC: Any, P: Any, FS: Any, NX: Any,
                 BS: Any, LS: Any, PN: Any, MD: Any, ST: Any, FOUND: Any, K: Any, kst: Any,
                 KB: Any, kbst: Any, O: Any, ost: Any, U: Any, UD: Any, cof: Any,
                 cbnd: Any) -> Any:
    """Pass 3: find each row's key, in input order; insert new keys (noting each row's value
    address); get / delete act here, and expire (a delete of the keys whose int64 value field
    at offset ``cof`` is at most ``cbnd``; a key above it counts as absent). Returns
    ``(status, row stopped at)``."""
    vs, pb, epoch = _i64(GEO, 8), _i64(GEO, 9), _i64(GEO, 12)
    lay = _lay_at(GEO, LAY)
    for i in range(c0, c1):
        r = i - c0
        kp = KB + i * kbst
        fq, s = _find(r, _ld_u64(K + i * kst), kp, GEO, SC, P, FS, NX, BS, lay)
        if mode == MODE_EXPIRE and fq >= 0 and \
                _ld_i64(_va(_page(P, FS, fq, pb), s, lay) + cof) > cbnd:
            fq = np.int64(-1)  # live: kept, and its page is not written
        if mode == MODE_GET:
            _st_u8(FOUND + i, np.uint8(fq >= 0))
            if fq >= 0 and O != 0:
                _copy(O + i * ost, _va(_page(P, FS, fq, pb), s, lay), vs)
            continue
        if fq >= 0:
            pn = _ld_i32(PN + 4 * _i64(FS, fq))
            if pn > 0 and (mode != MODE_UPSERT or pn >= HARD_PIN or not _log_before(
                    U, UD, _i64(FS, fq), _va(0, s, lay), vs, P, pb)):
                _st_i64(ST + 16, fq)
                return NEED_CLONE, i
        if mode == MODE_DELETE or mode == MODE_EXPIRE:
            _st_u8(FOUND + i, np.uint8(fq >= 0))
            if fq >= 0:
                _st_i64(MD + 8 * fq, epoch)
                _tombstone(_page(P, FS, fq, pb), s, lay)
                _st_i64(ST, _i64(ST, 0) - 1)
            continue
        new = fq < 0  # upsert
        if new:
            code, fq, s = _insert_row(r, kp, GEO, SC, P, FS, LS, PN, ST, lay)
            if code != DONE:
                return code, i
        _st_i64(MD + 8 * fq, epoch)
        va = _va(_page(P, FS, fq, pb), s, lay)
        _st_i64(_sc(SC, SC_VALUE, r), va)
        _st_i64(_sc(SC, SC_NEW, r), np.int64(new))
        if O != 0:  # fields the spec does not write; the combine fills in the others
            _copy(O + i * ost, va, vs)
    return DONE, c1


@_scalar
def _int_row(a: Any, code: Any, op: Any, new: Any, x: Any) -> None:
    """Combine int64 ``x`` into the integer field (type ``code``) at address ``a``."""
    write = new or op == LAST
    if not write and op != FIRST:
        if code == I8:
            old = _ld_i64(a)
        elif code == I4:
            old = np.int64(_ld_i32(a))
        elif code == U4:
            old = np.int64(_ld_u32(a))
        elif code == I2:
            old = np.int64(_ld_i16(a))
        elif code == U2:
            old = np.int64(_ld_u16(a))
        elif code == I1:
            old = np.int64(_ld_i8(a))
        else:
            old = np.int64(_ld_u8(a))
        if op == COUNT or op == SUM:
            x = old + x
            write = True
        elif op == MIN:
            write = x < old
        else:  # MAX
            write = x > old
    if write:
        if code == I8:
            _st_i64(a, x)
        elif code == I4:
            _st_i32(a, np.int32(x))
        elif code == U4:
            _st_u32(a, np.uint32(x))
        elif code == I2:
            _st_i16(a, np.int16(x))
        elif code == U2:
            _st_u16(a, np.uint16(x))
        elif code == I1:
            _st_i8(a, np.int8(x))
        else:
            _st_u8(a, np.uint8(x))


@_scalar
def _float_row(a: Any, code: Any, op: Any, new: Any, y: Any) -> None:
    """Combine float64 ``y`` into the float field (``F8`` or ``F4``) at address ``a``."""
    write = new or op == LAST
    if not write and op != FIRST:
        old = _ld_f64(a) if code == F8 else np.float64(_ld_f32(a))
        if op == COUNT or op == SUM:
            y = old + y
            write = True
        else:  # NaN stays (np.minimum / np.maximum semantics)
            write = old == old and not (
                y == y and ((op == MIN and y >= old) or (op == MAX and y <= old)))
    if write:
        if code == F8:
            _st_f64(a, y)
        else:
            _st_f32(a, np.float32(y))


@_scalar
def _uint_row(a: Any, op: Any, new: Any, x: Any) -> None:
    """Combine uint64 ``x`` into the uint64 field at address ``a``."""
    write = new or op == LAST
    if not write and op != FIRST:
        old = _ld_u64(a)
        if op == COUNT or op == SUM:
            x = old + x
            write = True
        elif op == MIN:
            write = x < old
        else:
            write = x > old
    if write:
        _st_u64(a, x)


@_scalar
def _bytes_row(a: Any, xp: Any, size: Any, op: Any, new: Any) -> None:
    """Combine the ``size`` bytes at address ``xp`` into the bytes field at address ``a``:
    first / last copy; min / max compare lexicographically."""
    write = new or op == LAST
    if not write and (op == MIN or op == MAX):
        cmp = 0
        for t in range(size):
            xb = _ld_u8(xp + t)
            yb = _ld_u8(a + t)
            if xb != yb:
                cmp = -1 if xb < yb else 1
                break
        write = (op == MIN and cmp < 0) or (op == MAX and cmp > 0)
    if write:
        _copy(a, xp, size)


@_scalar
def _combine_i8(op: Any, off: Any, xs: Any, xst: Any, c0: Any, kn: Any, SC: Any, O: Any,
                ost: Any) -> None:
    """`_combine_field` for an int64 field, the common case: one loop per op."""
    if op == COUNT or op == SUM:
        for k in range(kn):
            a = _i64(_sc(SC, SC_VALUE, k), 0) + off
            x = np.int64(1) if op == COUNT else _ld_i64(xs + (c0 + k) * xst)
            _st_i64(a, x if _i64(_sc(SC, SC_NEW, k), 0) != 0 else _ld_i64(a) + x)
            if O != 0:
                _st_i64(O + (c0 + k) * ost + off, _ld_i64(a))
    elif op == MIN or op == MAX:  # branch-free: whether a row moves the bound is random
        for k in range(kn):
            a = _i64(_sc(SC, SC_VALUE, k), 0) + off
            x = _ld_i64(xs + (c0 + k) * xst)
            old = _ld_i64(a)
            v = min(x, old) if op == MIN else max(x, old)
            _st_i64(a, x if _i64(_sc(SC, SC_NEW, k), 0) != 0 else v)
            if O != 0:
                _st_i64(O + (c0 + k) * ost + off, _ld_i64(a))
    else:  # LAST, FIRST
        for k in range(kn):
            a = _i64(_sc(SC, SC_VALUE, k), 0) + off
            if _i64(_sc(SC, SC_NEW, k), 0) != 0 or op == LAST:
                _st_i64(a, _ld_i64(xs + (c0 + k) * xst))
            if O != 0:
                _st_i64(O + (c0 + k) * ost + off, _ld_i64(a))


@_scalar
def _combine_field(op: Any, code: Any, off: Any, size: Any, lane: Any, xs: Any, xst: Any,
                   c0: Any, kn: Any, SC: Any, O: Any, ost: Any) -> None:
    """Pass 4: combine rows ``c0..c0+kn-1`` into one value field (at ``off``, ``size``
    bytes, type ``code``, input ``lane``; the op and the type are fixed for the whole loop).
    Row ``i``'s input is at ``xs + i * xst``."""
    for k in range(kn):
        i = c0 + k
        a = _i64(_sc(SC, SC_VALUE, k), 0) + off
        new = _i64(_sc(SC, SC_NEW, k), 0) != 0
        if lane == L_INT:
            _int_row(a, code, op, new, np.int64(1) if op == COUNT else _ld_i64(xs + i * xst))
        elif lane == L_FLOAT:
            _float_row(a, code, op, new, 1.0 if op == COUNT else _ld_f64(xs + i * xst))
        elif lane == L_UINT:
            _uint_row(a, op, new, np.uint64(1) if op == COUNT else _ld_u64(xs + i * xst))
        else:
            _bytes_row(a, xs + i * xst, size, op, new)
        if O != 0:
            _copy(O + i * ost + off, a, size)


@_scalar
def _lane_input(lane: Any, c: Any, IC: Any, UC: Any, FC: Any, BC: Any) -> Any:
    """``(address, stride)`` of the inputs of lane ``lane``, index ``c``."""
    if lane == L_INT:
        return _addr(IC) + c * IC.strides[0], IC.strides[1]
    if lane == L_FLOAT:
        return _addr(FC) + c * FC.strides[0], FC.strides[1]
    if lane == L_UINT:
        return _addr(UC) + c * UC.strides[0], UC.strides[1]
    return _addr(BC) + c, BC.strides[0]


@_scalar
def _check_tables(fseq: Any, next_of: Any, bucket_seq: Any, last_seq: Any, pins: Any,
                  mod: Any, geo: Any, state: Any, found: Any, kw: Any, kb: Any,
                  out: Any, scratch: Any) -> None:
    """`rows` reads these through their addresses: the tables must be contiguous int64
    (pins int32, found bool), and rows contiguous."""
    for t in (fseq, next_of, bucket_seq, last_seq, mod, geo, state, scratch):
        if t.itemsize != 8 or (t.shape[0] > 1 and t.strides[0] != 8):
            raise TypeError("hashmap.rows: page tables, geo, state and scratch must be "
                            "contiguous int64")
    if geo.shape[0] < LAY + 8 or state.shape[0] < 3 or scratch.shape[0] < SCRATCH:
        raise ValueError("hashmap.rows: geo needs 21 entries, state 3, scratch SCRATCH = 7 * CHUNK")
    if (pins.itemsize != 4 or (pins.shape[0] > 1 and pins.strides[0] != 4)
            or found.itemsize != 1 or (found.shape[0] > 1 and found.strides[0] != 1)):
        raise TypeError("hashmap.rows: pins must be contiguous int32, found bool")
    if ((kw.shape[0] > 1 and kw.strides[0] != 8 * kw.shape[1])
            or (kb.shape[0] > 1 and kb.strides[0] != kb.shape[1])
            or (out.shape[0] > 1 and out.strides[0] != out.shape[1])):
        raise TypeError("hashmap.rows: key words, key bytes and out must be C-contiguous")


@jit
def rows(mode: Any, i0: Any, kw: Any, kb: Any, pool: Any, fseq: Any, next_of: Any,
         bucket_seq: Any, last_seq: Any, pins: Any, undo: Any, undo_data: Any, mod: Any,
         geo: Any, ops: Any, codes: Any, offs: Any, sizes: Any, lanes: Any, lidx: Any,
         aligned: Any, IC: Any, UC: Any, FC: Any, BC: Any, out: Any, found: Any, scratch: Any,
         state: Any) -> Any:
    """Look up (``MODE_GET``), upsert (``MODE_UPSERT``) or delete (``MODE_DELETE``)
    rows ``i0..n-1`` in input order; writes stop early with a request.

    ``pool`` is the flat uint8 view of every frame; ``pins``, ``undo`` and ``undo_data``
    are the pool's pin counts and undo log (`mmm.pool`). ``geo`` = (n_buckets,
    level, S, G, n_groups, key_off, val_off, key_size, val_size, page_bytes,
    max_fill, split_limit, epoch, then the layout tuple). ``state`` = [len, row, arg]: the map's
    length (updated), and on return the row the kernel stopped at and the page
    seq (``NEED_CLONE``) or bucket (``NEED_PAGE``). ``out`` (``(n, val_size)``
    uint8, or 0 rows) receives each row's value: after the row was applied
    (upsert) or as found (get). ``found`` (get, delete) is set per row. The
    combine spec (upsert) is ``ops``... ``aligned``, one entry per value field
    it writes (``aligned`` is not needed: loads and stores are unaligned-safe);
    ``IC``/``UC``/``FC`` (``(k, n)``: int64, uint64, float64) and ``BC``
    (``(n, bytes)``) are the input lanes. ``scratch`` is the caller's contiguous
    int64 array of at least `SCRATCH` entries, the kernel's per-chunk rows (`_sc`).
    ``MODE_EXPIRE`` deletes only the keys whose int64 value field at byte offset
    ``offs[0]`` is at most ``IC[0, 0]`` (``found``: deleted); a key above it is left
    as it is, its page unwritten.
    Returns a status code.

    Rows go in chunks of `CHUNK`, in four passes (each a function): hash and
    prefetch, match tags and prefetch, find / insert / act, combine the values.
    """
    _check_tables(fseq, next_of, bucket_seq, last_seq, pins, mod, geo, state, found, kw, kb,
                  out, scratch)
    if undo.shape[0] < 4 or (undo.shape[0] > 1 and undo.strides[0] != 8) or \
            undo.itemsize != 8 or undo_data.itemsize != 1:
        raise TypeError("hashmap.rows: the undo log must be contiguous int64, its bytes uint8")
    n = kw.shape[0]
    nops = ops.shape[0]
    xs = np.empty(nops, np.int64)  # each value field's input address and row stride
    xst = np.empty(nops, np.int64)
    for j in range(nops):
        xs[j], xst[j] = _lane_input(lanes[j], lidx[j], IC, UC, FC, BC)
    SC, GEO, P, FS, ST = _addr(scratch), _addr(geo), _addr(pool), _addr(fseq), _addr(state)
    O = _addr(out) if out.shape[0] > 0 else 0
    cof, cbnd = np.int64(0), np.int64(0)
    if mode == MODE_EXPIRE:
        cof, cbnd = np.int64(offs[0]), np.int64(IC[0, 0])
    c0 = i0
    while c0 < n:
        c1 = min(c0 + CHUNK, n)
        _hash_chunk(c0, c1, GEO, SC, P, FS, _addr(bucket_seq), _addr(kw), kw.strides[0],
                    kw.shape[1])
        _match_chunk(mode, c0, c1, GEO, SC, P, FS)
        code, stop = _apply_chunk(mode, c0, c1, GEO, SC, P, FS, _addr(next_of),
                                  _addr(bucket_seq), _addr(last_seq), _addr(pins), _addr(mod),
                                  ST, _addr(found), _addr(kw), kw.strides[0], _addr(kb),
                                  kb.strides[0], O, out.strides[0], _addr(undo),
                                  _addr(undo_data), cof, cbnd)
        if mode == MODE_UPSERT:
            for j in range(nops):
                if lanes[j] == L_INT and codes[j] == I8:
                    _combine_i8(ops[j], offs[j], xs[j], xst[j], c0, stop - c0, SC, O,
                                out.strides[0])
                    continue
                _combine_field(ops[j], codes[j], offs[j], sizes[j], lanes[j], xs[j], xst[j],
                               c0, stop - c0, SC, O, out.strides[0])
        if code != DONE:
            state[1] = stop
            return code
        c0 = c1
    state[1] = n
    return DONE


# -- rechain: its steps ----------------------------------------------------------------------

@_scalar
def _gather(pages: Any, pool: Any, fseq: Any, geo: Any, kbuf: Any, vbuf: Any) -> Any:
    """Copy the key and value of every record of ``pages`` into rows of ``kbuf`` and
    ``vbuf``; returns the count."""
    S, ks, vs, pb = geo[2], geo[7], geo[8], geo[9]
    lay = _lay_at(_addr(geo), LAY)
    P = _addr(pool)
    m = 0
    for p in range(pages.shape[0]):
        base = P + fseq[pages[p]] * pb
        for s in range(S):
            if _ld_u8(_ca(base, s, lay)) >= 0x80:
                _copy(_addr(kbuf) + m * kbuf.strides[0], _ka(base, s, lay), ks)
                _copy(_addr(vbuf) + m * vbuf.strides[0], _va(base, s, lay), vs)
                m += 1
    return m


@_scalar
def _reset_page(base: Any, S: Any, lay: Any) -> None:
    """Empty the page at address ``base``: no records, no next page, not a primary."""
    for g in range((S + 15) >> 4):  # every group's ctrl bytes EMPTY
        _zero(_cga(base, g, lay), min(16, S - 16 * g))
    _st_u32(base + OFF_COUNT, np.uint32(0))
    _st_u32(base + OFF_START, np.uint32(0))
    _st_u64(base + OFF_NEXT, NIL)
    _st_u16(base + OFF_FLAGS, np.uint16(0))


@_scalar
def _reset(pages: Any, primaries: Any, pool: Any, fseq: Any, next_of: Any, geo: Any,
           spare: Any) -> Any:
    """Empty ``pages``; the ones not in ``primaries`` go to ``spare``. Returns their count."""
    P = _addr(pool)
    lay = _lay_at(_addr(geo), LAY)
    n_spare = 0
    for p in range(pages.shape[0]):
        q = pages[p]
        _reset_page(P + fseq[q] * geo[9], geo[2], lay)
        next_of[q] = -1
        is_primary = False
        for t in range(primaries.shape[0]):
            if primaries[t] == q:
                is_primary = True
        if not is_primary:
            spare[n_spare] = q
            n_spare += 1
    return n_spare


@_scalar
def _start_chains(targets: Any, primaries: Any, pool: Any, fseq: Any, bucket_seq: Any,
                  last_seq: Any, pb: Any) -> None:
    """Make page ``primaries[t]`` the (only) page of bucket ``targets[t]``."""
    P = _addr(pool)
    for t in range(targets.shape[0]):
        q = primaries[t]
        base = P + fseq[q] * pb
        _st_u16(base + OFF_FLAGS, np.uint16(1))
        _st_u64(base + OFF_AUX0, np.uint64(targets[t]))
        bucket_seq[targets[t]] = q
        last_seq[targets[t]] = q


@_scalar
def _link(base: Any, nbase: Any, nq: Any, b: Any, psid: Any) -> None:
    """Chain the page at address ``nbase`` (seq ``nq``) of bucket ``b`` after the page at
    address ``base``."""
    _st_u16(nbase + OFF_FLAGS, np.uint16(0))
    _st_u64(nbase + OFF_AUX0, np.uint64(b))
    _st_u64(base + OFF_NEXT, (np.uint64(psid) << np.uint64(32)) | np.uint64(nq))


@_scalar
def _place(m: Any, pool: Any, fseq: Any, next_of: Any, last_seq: Any, geo: Any, psid: Any,
           kwbuf: Any, kbuf: Any, vbuf: Any, spare: Any, n_spare: Any) -> Any:
    """Put gathered records ``0..m-1`` into the last page of their bucket's chain, taking a
    page of ``spare`` when that is full. Returns how many it took, -1 if they ran out."""
    nbk, lvl, G, nb, ks, vs, pb, max_fill = (geo[0], geo[1], geo[3], geo[4], geo[7], geo[8],
                                             geo[9], geo[10])
    lay = _lay_at(_addr(geo), LAY)
    P = _addr(pool)
    used = 0
    for r in range(m):
        h = _hash_at(_addr(kwbuf) + r * kwbuf.strides[0], kwbuf.shape[1])
        b = _bucket(h, nbk, lvl)
        q = last_seq[b]
        base = P + fseq[q] * pb
        if np.int64(_ld_u32(base + OFF_START)) >= max_fill:
            if used >= n_spare:
                return -1
            nq = spare[used]
            used += 1
            nbase = P + fseq[nq] * pb
            _link(base, nbase, nq, b, psid)
            next_of[q] = nq
            last_seq[b] = nq
            base = nbase
        s = _first_free(base, _home(h, nb), h, G, nb, lay)  # no tombstones: the first EMPTY
        _st_u8(_ca(base, s, lay), _tag(h))
        _copy(_ka(base, s, lay), _addr(kbuf) + r * kbuf.strides[0], ks)
        _copy(_va(base, s, lay), _addr(vbuf) + r * vbuf.strides[0], vs)
        _add_u32(base + OFF_COUNT, 1)
        _add_u32(base + OFF_START, 1)
    return used


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
    m = _gather(pages, pool, fseq, geo, kbuf, vbuf)
    spare = np.empty(pages.shape[0], np.int64)
    n_spare = _reset(pages, primaries, pool, fseq, next_of, geo, spare)
    _start_chains(targets, primaries, pool, fseq, bucket_seq, last_seq, geo[9])
    used = _place(m, pool, fseq, next_of, last_seq, geo, psid, kwbuf, kbuf, vbuf, spare,
                  n_spare)
    if used < 0:
        return -1, n_spare
    spare_out[:n_spare] = spare[:n_spare]
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
