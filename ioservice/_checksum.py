"""Page checksums in one compiled call: xxh3_64 of every row of a page array.

The checkpoint format stores the xxh3_64 of each page (`ioservice.format`).
Hashing page by page from Python costs a call per page and holds the GIL for
each one (python-xxhash releases it only around large inputs), so reader and
writer threads serialized on it. Here one numba kernel (``nogil``) walks the
rows and calls xxHash's own ``XXH3_64bits`` C function, the one python-xxhash
is built from (its extension module exports the xxHash API), so the digests
are xxhash's by construction, not a re-implementation that could drift.

The kernel reaches the C function through a symbol registered with llvmlite
(`llvmlite.binding.add_symbol`) under a private name before any kernel is
compiled or loaded from numba's cache, so the cached machine code links to
this process's copy of the function.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash
import xxhash._xxhash as _xxhash_ext
from llvmlite import binding as _llvm
from numba import types as _nbt

from mmm import jit

__all__ = ["pread_verify_rows", "verify_rows", "xxh3_rows"]

_SYMBOL = "sguard_ioservice_xxh3_64bits"


def _register() -> None:
    """Register xxHash's ``XXH3_64bits`` with llvmlite under `_SYMBOL`.

    Raises
    ------
    ImportError
        If the installed python-xxhash does not export ``XXH3_64bits``.
    """
    try:
        lib = ctypes.CDLL(_xxhash_ext.__file__)
        # the runtime-dispatched variant (AVX2/AVX-512 when the CPU has them, same
        # digests) when this build has it; else the one compiled for the baseline ISA
        fn = getattr(lib, "XXH3_64bits_dispatch", None) or lib.XXH3_64bits
    except (OSError, AttributeError) as exc:
        raise ImportError(f"ioservice needs python-xxhash's XXH3_64bits C function, which "
                          f"xxhash {xxhash.VERSION} at {_xxhash_ext.__file__} does not export "
                          f"({exc})") from None
    addr = ctypes.cast(fn, ctypes.c_void_p).value
    assert addr is not None
    _llvm.add_symbol(_SYMBOL, addr)


_register()
_PREAD_SYMBOL = "sguard_ioservice_pread"


def _register_pread() -> None:
    """Register the C library's ``pread`` with llvmlite under `_PREAD_SYMBOL`."""
    addr = ctypes.cast(ctypes.CDLL(None, use_errno=True).pread, ctypes.c_void_p).value
    assert addr is not None
    _llvm.add_symbol(_PREAD_SYMBOL, addr)


_register_pread()
# ssize_t pread(int fd, void *buf, size_t count, off_t offset)
_pread = _nbt.ExternalFunction(_PREAD_SYMBOL, _nbt.intp(_nbt.intc, _nbt.uintp, _nbt.uintp,
                                                         _nbt.int64))
# uint64 XXH3_64bits(const void* input, size_t length): a pointer travels as a
# machine word, so the address is passed as uintp.
_xxh3_64bits = _nbt.ExternalFunction(_SYMBOL, _nbt.uint64(_nbt.uintp, _nbt.uintp))


@jit
def _rows_kernel(pages: Any, out: Any) -> None:  # pragma: no cover - compiled
    n, pb = pages.shape
    base = pages.ctypes.data
    for i in range(n):
        out[i] = _xxh3_64bits(base + i * pb, pb)


def xxh3_rows(pages: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    """xxh3_64 of each row of a 2-D uint8 array (made C-contiguous if it is not).

    Runtime complexity: O(bytes), about 20 GB/s, without the GIL.
    """
    if pages.ndim != 2 or pages.dtype != np.uint8:
        raise ValueError(f"expected a 2-D uint8 array of pages, got {pages.ndim}-D "
                         f"{pages.dtype}")
    rows = np.ascontiguousarray(pages)
    out = np.empty(len(rows), dtype=np.uint64)
    if len(rows):
        _rows_kernel(rows, out)
    return out


@jit
def _verify_kernel(pages: Any, sums: Any, ids: Any, id_at: int) -> Any:  # pragma: no cover
    n, pb = pages.shape
    base = pages.ctypes.data
    n_bad = 0
    first_sum = -1
    first_id = -1
    for i in range(n):
        if _xxh3_64bits(base + i * pb, pb) != sums[i]:
            n_bad += 1
            if first_sum < 0:
                first_sum = i
        if first_id < 0:  # the header was just hashed: its PageID is in the cache
            got = np.uint64(0)
            for b in range(8):  # little-endian u64 at id_at, whatever its alignment
                got |= np.uint64(pages[i, id_at + b]) << np.uint64(8 * b)
            if got != ids[i]:
                first_id = i
    return n_bad, first_sum, first_id


def verify_rows(pages: npt.NDArray[np.uint8], sums: npt.NDArray[np.uint64],
                ids: npt.NDArray[np.uint64], id_at: int) -> tuple[int, int, int]:
    """Check each row of a C-contiguous ``(n, page_bytes)`` uint8 array against its
    expected xxh3_64 (`sums`) and the little-endian uint64 at byte `id_at` against
    `ids`, in one compiled call without the GIL.

    Returns ``(rows failing their checksum, first such row, first row whose id
    differs)``, -1 for none. Runtime complexity: O(bytes).
    """
    if pages.ndim != 2 or pages.dtype != np.uint8 or not pages.flags.c_contiguous:
        raise ValueError(f"expected a C-contiguous 2-D uint8 array of pages, got "
                         f"{pages.ndim}-D {pages.dtype}")
    if not (len(sums) == len(ids) == len(pages)) or not 0 <= id_at <= pages.shape[1] - 8:
        raise ValueError(f"{len(pages)} pages of {pages.shape[1]} bytes, {len(sums)} checksums, "
                         f"{len(ids)} ids, id at byte {id_at}")
    if not len(pages):
        return 0, -1, -1
    n_bad, first_sum, first_id = _verify_kernel(pages, np.asarray(sums, np.uint64),
                                                np.asarray(ids, np.uint64), id_at)
    return int(n_bad), int(first_sum), int(first_id)


@jit
def _pread_verify_kernel(fd: int, pages: Any, offset: int, sums: Any, ids: Any, id_at: int,
                         sub: int, verify: bool) -> Any:  # pragma: no cover - compiled
    n, pb = pages.shape
    base = pages.ctypes.data
    n_bad = 0
    first_sum = -1
    first_id = -1
    i = 0
    while i < n:
        m = min(sub, n - i)
        want = m * pb
        got = 0
        while got < want:
            r = _pread(np.intc(fd), base + i * pb + got, want - got,  # type: ignore[call-overload]
                       offset + i * pb + got)
            if r <= 0:  # 0: end of file; < 0: an error, which the caller reproduces
                return i * pb + got, r, n_bad, first_sum, first_id
            got += r
        if verify:  # these pages were just read: they are still in this core's cache
            for j in range(i, i + m):
                if _xxh3_64bits(base + j * pb, pb) != sums[j]:
                    n_bad += 1
                    if first_sum < 0:
                        first_sum = j
                if first_id < 0:
                    v = np.uint64(0)
                    for b in range(8):
                        v |= np.uint64(pages[j, id_at + b]) << np.uint64(8 * b)
                    if v != ids[j]:
                        first_id = j
            if n_bad or first_id >= 0:  # the chunk is rejected: read no further
                return n * pb, 1, n_bad, first_sum, first_id
        i += m
    return n * pb, 1, n_bad, first_sum, first_id


def pread_verify_rows(fd: int, pages: npt.NDArray[np.uint8], offset: int,
                      sums: npt.NDArray[np.uint64], ids: npt.NDArray[np.uint64], id_at: int,
                      sub_pages: int, verify: bool = True) -> tuple[int, int, int, int, int]:
    """Read ``len(pages)`` consecutive pages of file descriptor `fd` from byte `offset`
    into the C-contiguous ``(n, page_bytes)`` uint8 array `pages` and, when `verify`,
    check each against `sums` and `ids` as `verify_rows` does: all in one compiled call
    without the GIL, `sub_pages` pages per ``pread`` and each piece checked right
    after it lands, while it is still in the CPU cache.

    Returns ``(bytes read, status, rows failing their checksum, first such row, first
    row whose id differs)``: status 1 when every byte was read (or damage was found,
    which stops the read), 0 when the file ended after ``bytes read`` bytes, < 0 when
    ``pread`` failed there (the caller repeats that read to get the error).
    Runtime complexity: O(bytes).
    """
    if pages.ndim != 2 or pages.dtype != np.uint8 or not pages.flags.c_contiguous \
            or not pages.flags.writeable:
        raise ValueError(f"expected a writable C-contiguous 2-D uint8 array of pages, got "
                         f"{pages.ndim}-D {pages.dtype}")
    if not (len(sums) == len(ids) == len(pages)) or not 0 <= id_at <= pages.shape[1] - 8 \
            or sub_pages < 1 or offset < 0:
        raise ValueError(f"{len(pages)} pages of {pages.shape[1]} bytes, {len(sums)} checksums, "
                         f"{len(ids)} ids, id at byte {id_at}, {sub_pages} pages per read, "
                         f"offset {offset}")
    if not len(pages):
        return 0, 1, 0, -1, -1
    done, status, n_bad, first_sum, first_id = _pread_verify_kernel(
        fd, pages, offset, np.asarray(sums, np.uint64), np.asarray(ids, np.uint64), id_at,
        sub_pages, verify)
    return int(done), int(status), int(n_bad), int(first_sum), int(first_id)


_B64_LUT = np.full(256, 255, dtype=np.uint8)
_B64_LUT[np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/",
                       np.uint8)] = np.arange(64, dtype=np.uint8)


@jit
def _b64_kernel(src: Any, lut: Any, out: Any) -> int:  # pragma: no cover - compiled
    n = len(src)
    pad = 0
    if n and src[n - 1] == 61:  # '='
        pad = 2 if n > 1 and src[n - 2] == 61 else 1
    full = n // 4 if pad == 0 else n // 4 - 1  # the quads without padding
    o = 0
    for q in range(full):  # one check per quad: a character outside the alphabet has bit 7
        i = 4 * q
        a = lut[src[i]]
        b = lut[src[i + 1]]
        c = lut[src[i + 2]]
        d = lut[src[i + 3]]
        if (a | b | c | d) & 0x80:
            for k in range(4):
                if lut[src[i + k]] == 255:
                    return -1 - (i + k)
        acc = (np.uint32(a) << 18) | (np.uint32(b) << 12) | (np.uint32(c) << 6) | np.uint32(d)
        out[o] = (acc >> 16) & 0xFF
        out[o + 1] = (acc >> 8) & 0xFF
        out[o + 2] = acc & 0xFF
        o += 3
    if 4 * full < n:  # the last quad, with its padding
        i = 4 * full
        acc = np.uint32(0)
        for k in range(4):
            v = np.uint8(0)
            if i + k < n - pad:
                v = lut[src[i + k]]
                if v == 255:
                    return -1 - (i + k)
            acc = (acc << 6) | np.uint32(v)
        for k in range(3):
            if o < len(out):
                out[o] = (acc >> (16 - 8 * k)) & 0xFF
                o += 1
    return o


def b64decode_strict(text: str) -> bytes:
    """``base64.b64decode(text, validate=True)`` for text whose length is a multiple
    of 4, in one compiled pass (several times faster than `binascii` on the megabytes of
    a large manifest's page table): every character in the standard alphabet, ``=``
    only as the last one or two.

    Raises
    ------
    ValueError
        On any other text, naming the first character at fault.
    """
    try:
        src = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    except UnicodeEncodeError:
        raise ValueError("base64 text holds a non-ASCII character") from None
    n = len(src)
    if n % 4:
        raise ValueError(f"base64 text of {n} characters (not a multiple of 4)")
    pad = 0
    if n and src[-1] == 61:
        pad = 2 if n > 1 and src[-2] == 61 else 1
    out = np.empty(n // 4 * 3 - pad, dtype=np.uint8)
    got = _b64_kernel(src, _B64_LUT, out)
    if got < 0:
        raise ValueError(f"base64 text has {text[-1 - got]!r} at character {-1 - got}")
    return out.tobytes()
