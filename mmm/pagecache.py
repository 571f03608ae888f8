"""PageCache: a resident-memory budget over a pool whose frames live in a file on disk.

Design. The compiled kernels address pages as rows of one flat array (``pool.frames``)
through the page tables; they must stay as fast when every page is resident as without
a cache. So the cache does not move pages between frames: the pool is a `PagePool`
backed by a file on a real disk (not tmpfs), mapped shared, and the operating system
brings a page in when a kernel touches it. The cache bounds how much of that mapping
stays resident:

* `enforce` (called between batches: `sguard.spark.budget` calls it after every batch
  of a partition) counts the resident bytes of the frames (``mincore``, ~0.1 ms per
  GiB of pool); above the budget it evicts frames down to `LOW_WATER` of it:
  ``msync`` writes the victims' dirty bytes to the file (a clean page writes nothing),
  then ``madvise(MADV_PAGEOUT)`` drops them from memory and ``posix_fadvise(DONTNEED)``
  the file's cached copy (the mapping is ``MADV_RANDOM``: a fault reads one page, no
  readahead).
* Victims by recency: each frame has the enforcement round at which it was last seen
  coming into memory (a fault since the previous round) or last touched by a structure
  (`touch`); the oldest go first (CLOCK whose reference bit is the refault). `cold`
  lets a structure push frames it knows are done with (a window's expired pages) to
  the front.
* Copy-on-write, rollback, snapshots, incremental checkpoints and local recovery
  (`PagePool.attach` of the same file) see the same bytes whether a frame is resident
  or not: nothing else changes. A page evicted while a checkpoint writes it is read
  back from the file by the writer.
* A batch whose pages cannot fit: the frames that came into memory during one batch
  are a lower bound of its working set; when they exceed the budget `enforce` (with
  ``check=True``) evicts and then raises `WorkingSetTooLargeError` naming the
  partition, its state size and the budget.

What the budget covers: the frames' resident bytes. Page tables, the undo log and
Python objects are outside it (small next to the pages: ~16 bytes per page).

A page durable in a checkpoint but dirty in memory is still written to the local file
when evicted (the file is the pool's backing store); a page not written since its last
eviction costs no write.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from mmm.errors import MmmError
from mmm.pool import PagePool

__all__ = ["PageCache", "WorkingSetTooLargeError", "BudgetError", "is_memory_fs",
           "LOW_WATER", "OS_PAGE"]

OS_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
LOW_WATER = 0.85
"""`enforce` evicts down to this fraction of the budget (so it does not run every batch)."""
_MS_SYNC = 4
_MADV_PAGEOUT = 21
_MADV_RANDOM = 1
_MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}


class BudgetError(MmmError, ValueError):
    """A memory budget or pool a page cache cannot use (in memory, or an invalid size)."""


class WorkingSetTooLargeError(MmmError, MemoryError):
    """One batch of a partition touched more pages than its memory budget holds."""

    def __init__(self, message: str, partition: str, state_bytes: int, working_set_bytes: int,
                 budget_bytes: int) -> None:
        super().__init__(message)
        self.partition = partition
        self.state_bytes = state_bytes
        self.working_set_bytes = working_set_bytes
        self.budget_bytes = budget_bytes


def _libc() -> Any:
    lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    for name in ("madvise", "msync"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        getattr(lib, name).restype = ctypes.c_int
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.mincore.restype = ctypes.c_int
    return lib


_LIBC: Any = None


def _lib() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = _libc()
    return _LIBC


def is_memory_fs(path: str) -> bool:
    """Whether ``path`` lies on a memory file system (tmpfs, ramfs): the longest mount
    point of ``/proc/mounts`` that contains it. False where that file does not exist."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        return False
    return fstype in _MEMORY_FS


class PageCache:
    """A resident-memory budget over a file-backed `PagePool` (module docstring).

    Parameters
    ----------
    pool : PagePool
        A pool backed by a file (``PagePool(path=...)`` or `PagePool.attach`) on a disk
        file system.
    budget_bytes : int
        Resident bytes the pool's frames may hold after `enforce`; at least two pages.
    name : str
        What errors call the partition (e.g. ``"aggregate/partition 3"``).
    allow_memory_fs : bool
        Accept a pool file on tmpfs (tests only: evicting there frees nothing).

    Raises
    ------
    BudgetError
        If the pool is not file-backed, lives on a memory file system, or the budget
        holds fewer than two pages.
    """

    def __init__(self, pool: PagePool, budget_bytes: int, name: str = "partition", *,
                 allow_memory_fs: bool = False) -> None:
        if pool.path is None:
            raise BudgetError(f"{name}: a memory budget needs a pool backed by a file on "
                              f"disk; this pool is anonymous memory")
        if not allow_memory_fs and is_memory_fs(pool.path):
            raise BudgetError(f"{name}: pool file {pool.path} is on a memory file system; "
                              f"a memory budget needs it on a disk (e.g. spark.local.dir)")
        self.pool = pool
        self.name = name
        self._base = int(pool.frames.ctypes.data)
        self._off0 = pool.frames_offset
        self._fd = os.open(pool.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        weakref.finalize(self, os.close, self._fd)
        # no readahead: a fault brings in the page touched, not its neighbours
        _lib().madvise(self._base, pool.n_frames * pool.page_bytes, _MADV_RANDOM)
        self._span = pool.n_frames * pool.page_bytes
        self._per_frame = max(1, pool.page_bytes // OS_PAGE)
        self._vec = np.zeros(-(-self._span // OS_PAGE), dtype=np.uint8)
        self.seen = np.zeros(pool.n_frames, dtype=np.int64)  # round last seen coming in
        self._was = np.zeros(pool.n_frames, dtype=bool)  # resident after the last round
        self.round = 1
        self.budget_bytes = 0
        self.set_budget(budget_bytes)
        self.evicted_frames = 0
        self.evictions = 0
        self.peak_resident_bytes = 0
        self.last_working_set_bytes = 0

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget (a shared executor budget rebalances with this).

        Raises
        ------
        BudgetError
            If it holds fewer than two pages; the budget is unchanged.
        """
        if int(budget_bytes) < 2 * self.pool.page_bytes:
            raise BudgetError(f"{self.name}: budget {int(budget_bytes)} bytes holds fewer "
                              f"than 2 pages of {self.pool.page_bytes} bytes")
        self.budget_bytes = int(budget_bytes)

    # -- residency ----------------------------------------------------------------------
    def resident(self) -> npt.NDArray[np.int64]:
        """Resident OS pages per frame (``mincore``; O(pool bytes / 4 KiB), no faults)."""
        if _lib().mincore(self._base, self._span, self._vec.ctypes.data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore: {os.strerror(err)}")
        per = self._vec[: self.pool.n_frames * self._per_frame] & 1
        out: npt.NDArray[np.int64] = per.reshape(self.pool.n_frames, self._per_frame).sum(
            axis=1, dtype=np.int64)
        return out

    def resident_bytes(self) -> int:
        """Bytes of the pool's frames in memory now."""
        return int(self.resident().sum()) * OS_PAGE

    def stats(self) -> dict[str, int]:
        """``resident_bytes``, ``evicted_bytes`` (used frames not in memory), ``state_bytes``
        (used frames), ``budget_bytes``, eviction counters."""
        res = self.resident()
        used = int(self.pool.used_frames)
        resident_b = int(res.sum()) * OS_PAGE
        state_b = used * self.pool.page_bytes
        return {"resident_bytes": resident_b, "evicted_bytes": max(0, state_b - resident_b),
                "state_bytes": state_b, "budget_bytes": self.budget_bytes,
                "evicted_frames_total": self.evicted_frames, "evictions": self.evictions,
                "peak_resident_bytes": self.peak_resident_bytes}

    # -- hints ----------------------------------------------------------------------------
    def touch(self, frames: npt.ArrayLike) -> None:
        """Mark frames as just used (they are evicted last)."""
        self.seen[np.asarray(frames, dtype=np.int64)] = self.round

    def cold(self, frames: npt.ArrayLike) -> None:
        """Mark frames as done with (evicted first)."""
        self.seen[np.asarray(frames, dtype=np.int64)] = 0

    # -- eviction -------------------------------------------------------------------------
    def evict(self, frames: npt.ArrayLike) -> int:
        """Write back and drop these frames from memory; returns how many runs of
        consecutive frames it took (two system calls each)."""
        fr = np.unique(np.asarray(frames, dtype=np.int64))
        if len(fr) == 0:
            return 0
        brk = np.flatnonzero(np.diff(fr) != 1) + 1
        starts = np.concatenate(([0], brk))
        ends = np.concatenate((brk, [len(fr)]))
        pb, lib = self.pool.page_bytes, _lib()
        for a, b in zip(fr[starts].tolist(), (fr[ends - 1] + 1).tolist()):
            addr, n = self._base + a * pb, (b - a) * pb
            if lib.msync(addr, n, _MS_SYNC) != 0 or lib.madvise(addr, n, _MADV_PAGEOUT) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"{self.name}: evicting frames {a}..{b - 1}: "
                                   f"{os.strerror(err)}")
            # and the file's cached copy of pages this process did not map (fault-around)
            os.posix_fadvise(self._fd, self._off0 + a * pb, n, os.POSIX_FADV_DONTNEED)
        self.evicted_frames += len(fr)
        self.evictions += 1
        self._was[fr] = False
        return len(starts)

    def enforce(self, check: bool = False) -> int:
        """Bring the resident bytes back within the budget (to `LOW_WATER` of it when
        over); returns the frames evicted. With ``check``, raise after evicting when the
        frames that came into memory since the last call exceed the budget.

        Raises
        ------
        WorkingSetTooLargeError
            With ``check``, if the last batch's pages could not fit in the budget.
        """
        res = self.resident()
        now = res > 0
        came = now & ~self._was
        self.round += 1
        self.seen[came] = self.round
        resident_b = int(res.sum()) * OS_PAGE
        self.peak_resident_bytes = max(self.peak_resident_bytes, resident_b)
        pb = self.pool.page_bytes
        ws = int(np.count_nonzero(came)) * pb
        self.last_working_set_bytes = ws
        n_out = 0
        if resident_b > self.budget_bytes:
            target = int(self.budget_bytes * LOW_WATER)
            cand = np.flatnonzero(now)
            order = cand[np.argsort(self.seen[cand], kind="stable")]
            sizes = res[order] * OS_PAGE
            over = resident_b - target
            k = int(np.searchsorted(np.cumsum(sizes), over)) + 1
            victims = order[:k]
            self.evict(victims)
            now[victims] = False
            n_out = len(victims)
        self._was = now
        if check and ws > self.budget_bytes:
            state = self.pool.used_frames * pb
            raise WorkingSetTooLargeError(
                f"{self.name}: one batch touched {ws} bytes of pages, more than its memory "
                f"budget of {self.budget_bytes} bytes (state {state} bytes); raise the "
                f"budget (sguard.spark.budget) or split the partition", self.name, state, ws,
                self.budget_bytes)
        return n_out

    def evict_all(self) -> int:
        """Drop every used frame from memory (after writing it back); returns frames."""
        fr = np.flatnonzero(self.resident() > 0)
        self.evict(fr)
        return len(fr)
