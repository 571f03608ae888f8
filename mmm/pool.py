"""PagePool: fixed-size page frames carved out of one large numpy buffer.

The buffer is either anonymous memory (``np.zeros``: the OS commits pages only
when touched, so a large ``capacity_bytes`` costs nothing up front) or a
memory-mapped file, e.g. under ``/dev/shm``, so that a new process can
re-attach the state a crashed process left behind (`PagePool.attach`).

File layout (also mirrored for anonymous pools)::

    [pool header: one page]  magic, format version, page_bytes, n_frames, reserved_bytes
    [frame state table]      one byte per frame: FREE, LIVE or ORPHAN; padded to pages
    [frames]                 n_frames * page_bytes

Invariants (checked by `_check`):

* a frame is FREE, LIVE (in exactly one page table) or ORPHAN (replaced or
  released while a snapshot still pins it);
* the free stack, the never-used tail and the used frames partition the pool;
* an ORPHAN frame is pinned; it is freed when its last pin goes;
* every frame at or above ``_dirty_end`` holds only zero bytes: it was never
  handed out since the buffer was created. A frame below it may hold stale
  bytes of an earlier use, whatever the free list or the high-water mark say
  (`reset_if_empty` forgets the allocation order, not the bytes), so
  ``allocate(zero=True)`` zeroes it.

Backing store of a file-backed pool. The file is sparse: a page of it takes
room on its file system only when first written, and a write through the
mapping to a page the file system has no room for kills the process with
SIGBUS. So the pool *reserves* the file's blocks (``posix_fallocate``) before
it hands a frame out: the header and state table when the pool is created, the
frames in steps of `RESERVE_STEP_BYTES` as the high-water mark grows (a step is
one system call; on tmpfs it costs about a millisecond per MB, what the first
writes would have cost in page faults anyway), and only the frames asked for
when the file system has less room than a step. An allocation the file system
cannot back raises `PoolSpaceError` (a `PoolExhaustedError`) before anything
changes. The reserved length is kept in the header, so an attach reserves
nothing again (only the used frames of a file from before the field, once).
`free_frames` counts the reserved frames not in use plus the room left on the
file system, so a structure that checks it before a mutation never runs out
halfway (another process filling the same file system at the same moment can
still take that room; the allocation then raises, as when a structure did not
check). Frames are never un-reserved: a file's blocks stay with it until the
file is deleted. Anonymous pools, private (copy-on-write) mappings and file
systems without ``fallocate`` reserve nothing.

Thread safety: allocation, freeing and unpinning take one lock, so I/O
threads may unpin (and thereby free) frames while the operator thread
allocates. Only the operator thread pins.

Pins come in two weights. A *hard* pin (`HARD_PIN`, the default) freezes a
frame's bytes: every writer clones the page first. A *soft* pin (1) only
promises the snapshot the bytes it froze: a compiled kernel may update a record
of a soft-pinned frame in place after appending the record's old bytes to the
pool's *undo log* (`undo`, `undo_data`), and the snapshot's readers overlay the
logged before-images on what they copy (`mmm.Snapshot`). A frame with any hard
pin is never written in place.

The undo log: ``undo[0]`` entries, ``undo[1]`` bytes of ``undo_data`` used,
``undo[2]`` / ``undo[3]`` their capacities, then 4 int64 per entry (frame,
offset in the frame, length, offset in ``undo_data``). Only the operator thread
appends (entry and bytes first, then the count: readers that read the count after
copying a frame see every entry whose write their copy may hold); it is emptied
when a snapshot is taken while none is active (`reset_undo`). When it is full the
kernels clone the page instead.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from mmm.errors import (PageSizeError, PoolExhaustedError, PoolFileError, PoolSpaceError,
                        RollbackPointError)
from mmm.page import (DEFAULT_PAGE_BYTES, HEADER_BYTES, HEADER_DTYPE, MAX_PAGE_BYTES,
                      MIN_PAGE_BYTES, PAGE_MAGIC)

__all__ = ["PagePool", "FREE", "LIVE", "ORPHAN", "HARD_PIN", "UNDO_ENTRIES", "UNDO_BYTES",
           "RESERVE_STEP_BYTES", "fs_free_bytes"]

logger = logging.getLogger(__name__)

FREE, LIVE, ORPHAN = 0, 1, 2
_POOL_MAGIC = b"SGUARDPOOL\x00\x01"
_FORMAT_VERSION = 1
_POOL_HEADER = np.dtype([("magic", "S12"), ("format_version", "<u4"), ("page_bytes", "<u8"),
                         ("n_frames", "<u8"), ("reserved_bytes", "<u8")])
# reserved_bytes: the file's first bytes whose blocks are reserved (0 in files from before
# the field: their attach reserves the used frames once)
_CLOCK_AT = 64
"""Offset in the pool file's header page of the page clock (``<u8``; 0 in files from
before it): the highest version the pool ever gave, so that an attach starts above the
versions of freed frames too (`PagePool.clock`)."""
DEFAULT_CAPACITY_BYTES = 1 << 30
HARD_PIN = 1 << 16
"""The pin weight of a snapshot whose frames no one may write (see the module docstring)."""
UNDO_ENTRIES = 1 << 16
"""Capacity of the undo log in records (a full log makes the kernels clone instead)."""
UNDO_BYTES = 1 << 23
"""Capacity of the undo log's before-image bytes."""
RESERVE_STEP_BYTES = 16 << 20
"""Frames a file-backed pool reserves at a time as it grows (module docstring)."""
_FS_FREE_TTL_S = 0.05  # how long `free_frames` trusts a measured free space
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_FALLOCATE_ERRNOS = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, errno.ENODEV)


def fs_free_bytes(path: str | int) -> int:
    """Bytes an unprivileged user may still write on the file system of ``path`` (a
    path or an open descriptor): ``f_bavail * f_frsize``."""
    st = os.fstatvfs(path) if isinstance(path, int) else os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _space_margin(fd: int) -> int:
    """Room left aside for a file system's own metadata when counting free frames."""
    st = os.fstatvfs(fd)
    return min(1 << 20, st.f_blocks * st.f_frsize // 256)


def check_page_bytes(page_bytes: int) -> int:
    """Validate a page size: a power of two in [4 KiB, 1 MiB].

    Raises
    ------
    PageSizeError
        Otherwise.
    """
    if (not isinstance(page_bytes, (int, np.integer)) or isinstance(page_bytes, bool)
            or page_bytes < MIN_PAGE_BYTES or page_bytes > MAX_PAGE_BYTES
            or page_bytes & (page_bytes - 1)):
        raise PageSizeError(
            f"page_bytes={page_bytes!r}: must be a power of two between {MIN_PAGE_BYTES} "
            f"and {MAX_PAGE_BYTES}")
    return int(page_bytes)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fresh_zeros(n: int, dtype: np.dtype[Any]) -> np.ndarray:
    """``np.zeros(n, dtype)`` in its own anonymous mapping: the OS commits and zeroes
    each page at its first write. Used for the pool's frames and its undo log:

    * ``np.zeros`` of a few MB may come from memory the allocator recycled, which it
      must zero at once: 1-10 ms per pool on this kind of machine, for an undo log most
      pools never write;
    * numpy asks for transparent huge pages on large arrays (``MADV_HUGEPAGE``); where
      the kernel then compacts memory in the page fault (``defrag=madvise``, a common
      default) a first write into a 2 MB region can stall the operator for milliseconds
      (as Redis and others warn). Frames here stay 4 KiB pages; the aggregate of
      `bench.mmm_ops` runs as fast either way (measured, 100k and 1M groups)."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # (Windows)
        return np.zeros(n, dtype)
    # private: a forked child gets its own copy-on-write view, as of np.zeros' memory
    buf = mmap.mmap(-1, max(1, n * dtype.itemsize), flags=mmap.MAP_PRIVATE)
    return np.frombuffer(buf, dtype=dtype, count=n)


def _file_bytes(page_bytes: int, n_frames: int) -> int:
    """Length of a pool file: header page, state table, frames (module docstring)."""
    return page_bytes * (1 + -(-n_frames // page_bytes) + n_frames)


def _check_pool_header(path: str, raw: Any, page_bytes: int) -> int:
    """The frame count of the pool `raw` maps (the whole file at `path`).

    Raises
    ------
    PoolFileError
        If it is not a pool of `page_bytes` pages, or is truncated.
    """
    size = len(raw)
    if size < _POOL_HEADER.itemsize:
        raise PoolFileError(f"pool file {path!r} is too small to be an sguard pool")
    hdr = np.asarray(raw[:_POOL_HEADER.itemsize]).view(_POOL_HEADER)[0]
    if bytes(hdr["magic"]) != _POOL_MAGIC:
        raise PoolFileError(f"pool file {path!r} is not an sguard pool (bad magic)")
    if int(hdr["format_version"]) != _FORMAT_VERSION:
        raise PoolFileError(f"pool file {path!r}: format version {int(hdr['format_version'])}"
                            f" is not {_FORMAT_VERSION}")
    if int(hdr["page_bytes"]) != page_bytes:
        raise PoolFileError(f"pool file {path!r} has page_bytes={int(hdr['page_bytes'])}, "
                            f"not {page_bytes}")
    n_frames = int(hdr["n_frames"])
    if size < _file_bytes(page_bytes, n_frames):
        raise PoolFileError(f"pool file {path!r} is truncated ({size} bytes)")
    return n_frames


def _map_pool_file(path: str, page_bytes: int, mode: Literal["r+", "c"]
                   ) -> tuple["np.memmap[Any, np.dtype[np.uint8]]", int]:
    """Map the whole pool file at `path` (``"r+"`` shared, ``"c"`` copy-on-write), checked:
    ``(mapping, n_frames)``.

    Raises
    ------
    PoolFileError
        If the file is missing, is not a pool of `page_bytes` pages, or is truncated.
    """
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise PoolFileError(f"pool file {path!r}: {exc.strerror}") from None
    if size < _POOL_HEADER.itemsize:
        raise PoolFileError(f"pool file {path!r} is too small to be an sguard pool")
    raw = np.memmap(path, dtype=np.uint8, mode=mode, shape=(size,))
    return raw, _check_pool_header(path, raw, page_bytes)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not in Python's `mmap` module before 3.13


def _populate_headers(pool: "PagePool", frames: npt.NDArray[np.int64]) -> int:
    """`mmm.poolfile.populate_frame_headers` (documented there)."""
    raw = pool._raw
    mm = getattr(raw, "_mmap", None)  # np.memmap keeps its mmap object here
    if mm is None or not len(frames):
        return 0
    start = pool.frames.ctypes.data - raw.ctypes.data
    done = 0
    try:
        for off in (start + np.asarray(frames, dtype=np.int64) * pool.page_bytes).tolist():
            mm.madvise(_MADV_POPULATE_WRITE, off, 4096)
            done += 1
    except (OSError, ValueError, OverflowError, AttributeError):
        return done
    return done


@dataclass(frozen=True)
class _Attach:
    """How `PagePool.attach` opens a file (its keyword arguments)."""
    mapping: Any
    rollback_to: tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]] | None
    populate: bool


class PagePool:
    """A pool of ``n_frames`` page frames of ``page_bytes`` each.

    Parameters
    ----------
    page_bytes : int
        Page size, a power of two between 4 KiB and 1 MiB (default 64 KiB).
    capacity_bytes : int
        Upper bound of the memory the frames may use; ``n_frames`` is
        ``capacity_bytes // page_bytes``. Exceeding it raises `PoolExhaustedError`.
    path : str, optional
        Back the pool by this file (created, or truncated if it exists).
        Use `attach` to open an existing one.

    Raises
    ------
    PageSizeError
        If ``page_bytes`` is not a valid page size.
    ValueError
        If the capacity holds no frame.
    """

    def __init__(self, page_bytes: int = DEFAULT_PAGE_BYTES,
                 capacity_bytes: int = DEFAULT_CAPACITY_BYTES, path: str | None = None,
                 *, _attach: "_Attach | None" = None) -> None:
        self.page_bytes = check_page_bytes(page_bytes)
        n_frames = int(capacity_bytes) // self.page_bytes
        if n_frames < 2 and _attach is None:
            raise ValueError(f"capacity_bytes={capacity_bytes} holds fewer than 2 pages "
                             f"of {self.page_bytes} bytes")
        self.path = path
        self._lock = threading.Lock()
        self._raw: Any  # the buffer: a mapping of the file, or anonymous memory
        if _attach is not None:
            assert path is not None
            if _attach.mapping is None:
                self._raw, self.n_frames = _map_pool_file(path, self.page_bytes, "r+")
            else:
                self._raw = self._adopt_mapping(path, _attach.mapping)
        else:
            self.n_frames = n_frames
            total = self._total_bytes(n_frames)
            if path is None:
                self._raw = _fresh_zeros(total, np.dtype(np.uint8))
            else:
                try:
                    self._raw = np.memmap(path, dtype=np.uint8, mode="w+", shape=(total,))
                except OSError as exc:
                    if exc.errno not in _SPACE_ERRNOS:
                        raise
                    _unlink_quietly(path)
                    raise self._space_error(self.page_bytes, -1, total) from None
        self._bind_views()
        try:
            self._setup_reservation(_attach is not None)
        except BaseException:
            if _attach is None and path is not None:
                _unlink_quietly(path)  # created by this call: nothing left behind
            raise
        if _attach is None:
            hdr = self._raw[:_POOL_HEADER.itemsize].view(_POOL_HEADER)
            hdr[0] = (_POOL_MAGIC, _FORMAT_VERSION, self.page_bytes, n_frames,
                      self._reserved_bytes)
        self.pins = np.zeros(self.n_frames, dtype=np.int32)
        # the undo log of in-place writes to soft-pinned frames (module docstring); the
        # OS commits its memory only as it is written
        self.undo = _fresh_zeros(4 + 4 * UNDO_ENTRIES, np.dtype(np.int64))
        self.undo[2], self.undo[3] = UNDO_ENTRIES, UNDO_BYTES
        self.undo_data = _fresh_zeros(UNDO_BYTES, np.dtype(np.uint8))
        self._undo_total = 0
        self._free: list[int] = []
        self._watermark = 0
        # frames >= _dirty_end were never handed out: zero. An attached file's
        # history is unknown (the process that wrote it may have used and freed
        # frames far above the live ones), so every frame may be dirty.
        self._dirty_end = self.n_frames if _attach is not None else 0
        self._used = 0
        self._clock = self._raw[_CLOCK_AT:_CLOCK_AT + 8].view(np.uint64)
        if _attach is None:
            self.clock = 1
        if _attach is not None:
            if _attach.populate:
                _populate_headers(self, np.flatnonzero(self.state))
            if _attach.rollback_to is not None:
                self._roll_back(*_attach.rollback_to)
            self._rebuild_allocation()
            if self._watermark > self._reserved_end:  # (a rollback revived frames above)
                self._reserve_locked(self._watermark, step=False)

    # -- geometry -----------------------------------------------------------------
    def _state_pages(self, n_frames: int) -> int:
        return -(-n_frames // self.page_bytes)

    def _total_bytes(self, n_frames: int) -> int:
        return _file_bytes(self.page_bytes, n_frames)

    def _bind_views(self) -> None:
        pb = self.page_bytes
        st0 = pb
        fr0 = pb * (1 + self._state_pages(self.n_frames))
        self.state = self._raw[st0:st0 + self.n_frames]
        self.frames = self._raw[fr0:fr0 + self.n_frames * pb].reshape(self.n_frames, pb)
        self.headers = self.frames[:, :HEADER_BYTES].view(HEADER_DTYPE)[:, 0]

    def _meta_bytes(self) -> int:
        return self.page_bytes * (1 + self._state_pages(self.n_frames))

    @property
    def frames_offset(self) -> int:
        """Offset of frame 0 in the pool file (its header and state table come first)."""
        return self._meta_bytes()

    # -- backing store ------------------------------------------------------------
    def _setup_reservation(self, attach: bool) -> None:
        """Open the descriptor reservations go through and reserve what the pool uses
        now: a new pool's header and state table (and a first step when the file system
        has room), an attached one's used frames unless its header says they are."""
        self._fd: int | None = None
        self._reserved_bytes = 0
        self._reserved_end = self.n_frames  # nothing to reserve (anonymous or private)
        self._fs_free: tuple[float, int] = (0.0, 0)  # (expiry, spare frames)
        raw = self._raw
        if self.path is None or getattr(raw, "mode", None) not in ("r+", "w+"):
            return
        fd = os.open(self.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        weakref.finalize(self, os.close, fd)
        self._fd = fd
        meta = self._meta_bytes()
        if attach:
            hdr = raw[:_POOL_HEADER.itemsize].view(_POOL_HEADER)[0]
            self._reserved_bytes = min(int(hdr["reserved_bytes"]),
                                       self._total_bytes(self.n_frames))
            self._reserved_end = max(0, (self._reserved_bytes - meta) // self.page_bytes)
            if self._reserved_bytes < meta:
                self._reserved_end = 0
            used = np.flatnonzero(self.state)
            top = int(used[-1]) + 1 if len(used) else 0
            if self._reserved_bytes < meta or top > self._reserved_end:
                self._reserve_locked(top, step=False)
        else:
            self._reserved_end = 0
            self._reserve_locked(0)

    def _reserve_locked(self, end: int, step: bool = True) -> None:
        """Reserve the file's blocks up to frame ``end`` (with the header and state
        table), a step further when ``step`` and the file system has room for it.

        Raises
        ------
        PoolSpaceError
            If the file system cannot back frame ``end - 1``; nothing changed.
        """
        fd, pb = self._fd, self.page_bytes
        assert fd is not None
        meta = self._meta_bytes()
        cur = self._reserved_bytes
        need_end = meta + end * pb
        if need_end <= cur:
            return
        targets = [need_end]
        if step:
            step_frames = max(1, RESERVE_STEP_BYTES // pb)
            step_end = meta + min(self.n_frames, max(end, self._reserved_end + step_frames)) * pb
            if step_end > need_end and fs_free_bytes(fd) - _space_margin(fd) >= step_end - cur:
                targets.insert(0, step_end)
        for target in targets:
            try:
                os.posix_fallocate(fd, cur, target - cur)
            except OSError as exc:
                if exc.errno in _NO_FALLOCATE_ERRNOS:
                    logger.warning("pool file %s: the file system cannot reserve blocks "
                                   "(%s); frames are not reserved before use",
                                   self.path, exc.strerror)
                    self._reserved_end = self.n_frames
                    self._fd = None
                    return
                if exc.errno not in _SPACE_ERRNOS:
                    raise
                if target != need_end:
                    continue  # the step did not fit: only what is needed now
                self._fs_free = (0.0, 0)
                raise self._space_error(pb, end, target - cur) from None
            self._reserved_bytes = target
            self._reserved_end = (target - meta) // pb
            self._raw[:_POOL_HEADER.itemsize].view(_POOL_HEADER)["reserved_bytes"] = target
            self._fs_free = (0.0, 0)
            return

    def _space_error(self, pb: int, end: int, needed: int) -> PoolSpaceError:
        path = str(self.path)
        directory = os.path.dirname(os.path.abspath(path))
        try:
            free = fs_free_bytes(directory)
        except OSError:
            free = 0
        what = (f"the file needs {needed} more bytes" if end < 0 else
                f"frame {end - 1} needs {needed} more bytes reserved")
        return PoolSpaceError(
            f"no space for the page pool in {directory}: {what}, the file system has "
            f"{free} bytes free (pool file {path}, capacity {self.n_frames * pb} bytes, "
            f"{getattr(self, '_used', 0)} page(s) of {pb} bytes in use); free space there "
            f"or put the pool in a directory with room", directory, needed, free)

    def _spare_frames(self) -> int:
        """Frames the file system still has room for (measured at most every
        `_FS_FREE_TTL_S`)."""
        expiry, spare = self._fs_free
        now = time.monotonic()
        if now < expiry:
            return spare
        fd = self._fd
        if fd is None:
            return self.n_frames
        try:
            spare = max(0, fs_free_bytes(fd) - _space_margin(fd)) // self.page_bytes
        except OSError:
            spare = 0
        self._fs_free = (now + _FS_FREE_TTL_S, spare)
        return spare

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the pool file whose blocks are reserved (0 for an anonymous pool)."""
        return self._reserved_bytes

    def _adopt_mapping(self, path: str, mapping: Any) -> Any:
        """Check a caller's mapping of the file at `path` (`attach`'s ``mapping``)."""
        if not isinstance(mapping, np.memmap) or mapping.dtype != np.uint8 or mapping.ndim != 1:
            raise TypeError(f"mapping of pool file {path!r}: a 1-D uint8 numpy.memmap of the "
                            f"whole file (PagePool.map_file), got {type(mapping).__name__}")
        mapped = getattr(mapping, "filename", None)
        if mapped is not None and os.path.realpath(mapped) != os.path.realpath(path):
            raise ValueError(f"mapping of pool file {path!r} maps another file, {mapped!r}")
        if not mapping.flags.writeable:
            raise ValueError(f"mapping of pool file {path!r} is read-only: map it shared or "
                             f"copy-on-write (PagePool.map_file)")
        self.n_frames = _check_pool_header(path, mapping, self.page_bytes)
        return mapping

    @classmethod
    def map_file(cls, path: str, page_bytes: int = DEFAULT_PAGE_BYTES, *,
                 private: bool = False) -> "np.memmap[Any, np.dtype[np.uint8]]":
        """Map the whole pool file at `path`, checked as `attach` checks it, for `attach`'s
        ``mapping``: shared (writes reach the file) or, with `private`, copy-on-write
        (writes stay in this process's memory; the file is left as it is).

        A process that attaches the same file again and again (a worker given a
        partition back) keeps this mapping and hands it to each `attach`: no new
        ``mmap``, and no page faults on the frames it touched before. It must itself
        make sure the file was not replaced in between (its device, inode and size).

        Raises
        ------
        PoolFileError
            If the file is missing, is not a pool of `page_bytes` pages, or is truncated.
        PageSizeError
            If `page_bytes` is not a valid page size.
        """
        raw, _n = _map_pool_file(path, check_page_bytes(page_bytes), "c" if private else "r+")
        return raw

    @classmethod
    def attach(cls, path: str, page_bytes: int = DEFAULT_PAGE_BYTES, *,
               mapping: "np.memmap[Any, np.dtype[np.uint8]] | None" = None,
               rollback_to: tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]] | None = None,
               populate: bool = False) -> "PagePool":
        """Open the pool file a previous (possibly crashed) process left behind.

        Parameters
        ----------
        path : str
            The pool file.
        page_bytes : int
            Its page size.
        mapping : numpy.memmap, optional
            A mapping of the whole file at `path` (`map_file`, or the one an earlier
            attach of this process got from it) to attach through instead of mapping
            the file anew. A private (copy-on-write) mapping keeps every write of the
            attach and of the pool in this process and reserves nothing in the file.
        rollback_to : (page_ids, frames), optional
            A page table recorded earlier (a snapshot's ``page_ids`` and ``frames``):
            those frames become exactly the live ones, and every other frame in use
            (pages cloned or created since, frames an unreleased snapshot kept) is
            freed. Only the one-byte state table is written; page bytes (headers
            too) are untouched, and `allocate` zeroes the
            freed frames when it hands them out. O(frames).
        populate : bool
            Map the header page of every used frame up front before reading them
            (`mmm.poolfile.populate_frame_headers`): cheaper than the page fault each
            would take in a freshly mapped file, useless in a mapping already used.

        Raises
        ------
        PoolFileError
            If the file is missing, is not a pool, or has another page size.
        RollbackPointError
            If `rollback_to` names frames outside the pool or frames that no longer
            hold its pages (a `PoolFileError`); the file is left as it was.
        TypeError, ValueError
            If `mapping` is not a writable uint8 memmap of the file at `path`, or
            `rollback_to`'s arrays differ in length.
        """
        return cls(page_bytes, 0, path, _attach=_Attach(mapping, rollback_to, populate))

    def _roll_back(self, page_ids: npt.NDArray[np.uint64],
                   frames: npt.NDArray[np.int64]) -> None:
        """Make exactly `frames` (holding `page_ids`) the live frames (`attach`)."""
        page_ids = np.asarray(page_ids).reshape(-1)
        frames = np.asarray(frames).reshape(-1)
        if len(page_ids) != len(frames):
            raise ValueError(f"rollback_to: {len(page_ids)} page ids for {len(frames)} frames")
        frames = frames.astype(np.int64, copy=False)
        h = self.headers
        if len(frames) and (frames.min() < 0 or frames.max() >= self.n_frames):
            raise RollbackPointError(
                f"pool file {self.path!r}: the page table to roll back to names frames "
                f"outside the pool's {self.n_frames}")
        # a frame freed since the table was recorded is FREE in the state table (the
        # frame keeps its old header: freeing writes the state table only); one handed
        # out again holds another page id, or is a newer copy of the same page (the
        # table's own frames are pinned until it is replaced, so not reused under it)
        if not (np.all(self.state[frames] != FREE)
                and np.all(h["magic"][frames] == PAGE_MAGIC)
                and np.array_equal(h["page_id"][frames], page_ids)):
            raise RollbackPointError(
                f"pool file {self.path!r}: the frames of the page table to roll back to no "
                f"longer hold its pages")
        keep = np.zeros(self.n_frames, dtype=bool)
        keep[frames] = True
        drop = np.flatnonzero((self.state != FREE) & ~keep)
        self.state[drop] = FREE
        self.state[frames] = LIVE

    def _rebuild_allocation(self) -> None:
        state = self.state
        orphans = np.flatnonzero(state == ORPHAN)
        state[orphans] = FREE  # snapshots died with the process that held them
        live = np.flatnonzero(state == LIVE)
        self._used = len(live)
        self._watermark = int(live.max()) + 1 if len(live) else 0
        used = np.zeros(self._watermark, dtype=bool)
        used[live] = True
        self._free = np.flatnonzero(~used).tolist()[::-1]
        # above every version the file's pools ever gave (the persisted clock: a page id
        # freed since a checkpoint must not get its recorded version again, as incremental
        # checkpoints after a re-attach compare (page id, version) with the record) and
        # above the live pages' (files from before the persisted clock)
        top = int(self.headers["version"][live].max()) + 1 if len(live) else 1
        self.clock = max(self.clock, top)

    # -- allocation ---------------------------------------------------------------
    @property
    def used_frames(self) -> int:
        """Frames not free (live or orphaned)."""
        return self._used

    @property
    def free_frames(self) -> int:
        """Frames available to `allocate`: within the capacity and, for a file-backed
        pool, reserved or with room on the file system (module docstring)."""
        remaining = self.n_frames - self._used
        if self._fd is None:
            return remaining
        ahead = len(self._free) + self._reserved_end - self._watermark
        if ahead >= remaining:
            return remaining
        return min(remaining, ahead + self._spare_frames())

    def allocate(self, n: int = 1, *, zero: bool = True) -> np.ndarray:
        """Take ``n`` free frames; they are marked LIVE and zeroed.

        A frame handed out with ``zero=True`` is all zero bytes whatever its
        history: recycled from the free list, reused below an old high-water
        mark after `reset_if_empty`, or inherited from another process's pool
        file (`attach`). Only frames never handed out since the buffer was
        created are known to be zero already and are not written.

        ``zero=False`` skips zeroing, for callers that overwrite the whole
        frame at once (a copy-on-write clone, a page being loaded): their
        bytes are then undefined until written.

        Raises
        ------
        PoolExhaustedError
            If fewer than ``n`` frames are free; nothing is allocated.
        PoolSpaceError
            If the pool file's file system has no room for them; nothing is allocated.
        """
        with self._lock:
            if n > self.n_frames - self._used:
                raise PoolExhaustedError(
                    f"page pool exhausted: {n} page(s) of {self.page_bytes} bytes requested, "
                    f"{self.n_frames - self._used} of {self.n_frames} free "
                    f"(capacity {self.n_frames * self.page_bytes} bytes)")
            take = min(n, len(self._free))
            if self._watermark + n - take > self._reserved_end:
                self._reserve_locked(self._watermark + n - take)  # may raise: nothing changed
            if take == n:  # all recycled: the common case, one numpy call
                out = np.array(self._free[len(self._free) - take:], dtype=np.int64)
            else:
                out = np.empty(n, dtype=np.int64)
                out[:take] = self._free[len(self._free) - take:]
            del self._free[len(self._free) - take:]
            rest = n - take
            fresh0 = self._watermark
            if rest:
                out[take:] = np.arange(fresh0, fresh0 + rest)
                self._watermark += rest
            # fresh frames below _dirty_end were used before a reset or by another process
            stale_end = min(fresh0 + rest, self._dirty_end)
            self._dirty_end = max(self._dirty_end, self._watermark)
            self._used += n
            self.state[out] = LIVE
        if zero:  # outside the lock: these frames are ours alone now
            if take:
                self.frames[out[:take]] = 0  # recycled (always below _dirty_end)
            if stale_end > fresh0:
                self.frames[fresh0:stale_end] = 0
        return out

    def reserve_frames(self, n: int) -> None:
        """Reserve backing for the next ``n`` allocations, so that `free_frames` is at
        least ``n`` when the capacity allows it (a no-op when it does not, or when the
        pool reserves nothing).

        Raises
        ------
        PoolSpaceError
            If the pool file's file system has no room for them; nothing changed.
        """
        with self._lock:
            if self._fd is None or n > self.n_frames - self._used:
                return
            rest = n - min(n, len(self._free))
            if self._watermark + rest > self._reserved_end:
                self._reserve_locked(self._watermark + rest)

    def allocate1(self) -> int:
        """Scalar ``allocate(1, zero=False)``: one frame whose bytes the caller
        overwrites at once (a copy-on-write clone of one page).

        Raises
        ------
        PoolExhaustedError
            If no frame is free; nothing is allocated.
        PoolSpaceError
            If the pool file's file system has no room for it; nothing is allocated.
        """
        with self._lock:
            if self._used >= self.n_frames:
                raise PoolExhaustedError(
                    f"page pool exhausted: 1 page(s) of {self.page_bytes} bytes requested, "
                    f"0 of {self.n_frames} free (capacity {self.n_frames * self.page_bytes} "
                    f"bytes)")
            if self._free:
                frame = self._free.pop()
            else:
                if self._watermark >= self._reserved_end:
                    self._reserve_locked(self._watermark + 1)  # may raise: nothing changed
                frame = self._watermark
                self._watermark += 1
                self._dirty_end = max(self._dirty_end, self._watermark)
            self._used += 1
            self.state[frame] = LIVE
        return frame

    def orphan1(self, frame: int) -> None:
        """Scalar `orphan`: one frame replaced by its clone."""
        with self._lock:
            if self.pins[frame] > 0:
                self.state[frame] = ORPHAN
            else:
                self._release_locked(np.array([frame], dtype=np.int64))

    def free(self, frames: np.ndarray) -> None:
        """Return LIVE frames to the pool; pinned ones become ORPHAN until unpinned."""
        frames = np.asarray(frames, dtype=np.int64).reshape(-1)
        with self._lock:
            pinned = self.pins[frames] > 0
            if not pinned.any():  # no snapshot holds them: the common case
                self._release_locked(frames)
                return
            self.state[frames[pinned]] = ORPHAN
            self._release_locked(frames[~pinned])

    def _release_locked(self, frames: np.ndarray) -> None:
        if len(frames) == 0:
            return
        # the state table only: the frame's own bytes (its header too) are not touched,
        # so freeing a frame a page cache evicted reads nothing back from disk
        self.state[frames] = FREE
        self._used -= len(frames)
        if self._used == 0:  # the pool is empty: as `reset_if_empty` (no free list to build)
            self._free = []
            self._watermark = 0
        else:
            self._free.extend(frames.tolist())

    def orphan(self, frames: np.ndarray) -> None:
        """Mark pinned frames as no longer live (replaced by a clone)."""
        with self._lock:
            pinned = self.pins[frames] > 0
            self.state[frames[pinned]] = ORPHAN
            self._release_locked(frames[~pinned])

    def pin(self, frames: np.ndarray, weight: int = HARD_PIN) -> None:
        """Pin distinct frames for a snapshot (operator thread only): ``weight``
        `HARD_PIN` freezes their bytes, 1 lets kernels write them in place through the
        undo log (module docstring)."""
        with self._lock:
            self.pins[frames] += weight

    def unpin(self, frames: np.ndarray, weight: int = HARD_PIN) -> None:
        """Drop one pin of ``weight`` from each of distinct frames; orphans whose last
        pin goes are freed."""
        frames = np.asarray(frames, dtype=np.int64).reshape(-1)
        with self._lock:
            self.pins[frames] -= weight
            done = frames[(self.pins[frames] == 0) & (self.state[frames] == ORPHAN)]
            if len(done):
                self._release_locked(np.unique(done))

    def reset_undo(self) -> int:
        """Empty the undo log (operator thread, when no snapshot is active: no reader
        needs an entry); returns the log's position, where a new snapshot starts."""
        self._undo_total += int(self.undo[0])
        self.undo[0] = 0
        self.undo[1] = 0
        return 0

    @property
    def undo_records(self) -> int:
        """Values written in place into soft-pinned frames so far (undo log records)."""
        return self._undo_total + int(self.undo[0])

    def reset_if_empty(self) -> bool:
        """When no frame is in use, forget the free list: later allocations are
        consecutive from frame 0 (already touched memory). Returns whether it reset.

        The frames keep their bytes; `allocate` zeroes the ones it hands out
        with ``zero=True`` (every frame below the highest one ever used)."""
        with self._lock:
            if self._used:
                return False
            self._free = []
            self._watermark = 0
            return True

    @property
    def clock(self) -> int:
        """The page clock: the version the last new page or clone was given.

        It lives in the pool file's header page, so it survives the process: a pool
        attached to the file starts where the last writer left off, above every version
        given in the file, freed pages' included (a page's (id, version) pair names one
        content for as long as the file lives)."""
        return int(self._clock[0])

    @clock.setter
    def clock(self, value: int) -> None:
        self._clock[0] = value

    def tick(self) -> int:
        """Advance and return the pool clock (page versions)."""
        self.clock += 1
        return self.clock

    def flush(self) -> None:
        """Write a file-backed pool's dirty pages to its file (no-op in memory)."""
        if isinstance(self._raw, np.memmap):
            self._raw.flush()

    def stats(self) -> dict[str, int]:
        """Frame counts: total, used, free, pinned, orphan; and bytes."""
        with self._lock:
            wm = self._watermark
            return {
                "page_bytes": self.page_bytes,
                "n_frames": self.n_frames,
                "used_frames": self._used,
                "free_frames": self.n_frames - self._used,
                "pinned_frames": int(np.count_nonzero(self.pins[:wm])),
                "orphan_frames": int(np.count_nonzero(self.state[:wm] == ORPHAN)),
                "used_bytes": self._used * self.page_bytes,
                "capacity_bytes": self.n_frames * self.page_bytes,
            }

    def _check(self) -> None:
        """Assert every pool invariant (O(frames))."""
        wm = self._watermark
        assert np.all(self.state[wm:] == FREE)
        free = np.asarray(self._free, dtype=np.int64)
        assert len(np.unique(free)) == len(free), "duplicate frame in free list"
        assert np.all(free < wm)
        assert np.all(self.state[free] == FREE), "free-listed frame not FREE"
        assert np.count_nonzero(self.state[:wm] != FREE) == self._used
        assert len(free) + self._used == wm
        orphans = self.state[:wm] == ORPHAN
        assert np.all(self.pins[:wm][orphans] > 0), "orphan frame without pin"
        assert np.all(self.pins >= 0)
        assert wm <= self._dirty_end <= self.n_frames
        assert wm <= self._reserved_end <= self.n_frames
