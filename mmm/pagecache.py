"""PageCache: a resident-memory budget over a pool whose frames live in a file on disk.

Design. The compiled kernels address pages as rows of one flat array (``pool.frames``)
through the page tables; they must stay as fast when every page is resident as without
a cache. So the cache does not move pages between frames: the pool is a `PagePool`
backed by a file on a real disk (not tmpfs), mapped shared, and the operating system
brings a page in when a kernel touches it. The cache bounds how much of that file stays
in memory.

What "resident" means. A page of a shared file mapping is a page of the file's page
cache, whether this process has it mapped (then it counts in the process's RSS, as
``RssFile``) or only cached (then a memory cgroup still charges it). The cache counts
both: `resident_bytes` is the frames' bytes in the page cache (``mincore`` on the
mapping, which reports page-cache residency for a file this process may write), an
upper bound of the pool's share of the process's RSS (`mapped_bytes`, read from
``/proc/self/pagemap``) and what a memory cgroup charges for the pool's frames. The
pool's header, state table, page tables, undo log and Python objects are outside the
budget (about 16 bytes per page).

* `enforce` (called between batches: `sguard.spark.budget` calls it after every batch
  of a partition) counts the resident bytes of the frames in use (``mincore``, 1 byte
  per 4 KiB of the frames up to the pool's high-water mark); above the budget it evicts
  frames down to `LOW_WATER` of it. Eviction of a run of frames is three system calls:
  ``madvise(MADV_DONTNEED)`` unmaps them from this process (for a shared file mapping
  the page's dirty bit moves to the page cache: no byte is lost),
  ``sync_file_range`` writes the dirty ones to the file and waits, and
  ``posix_fadvise(DONTNEED)`` drops the now clean, unmapped copies from the page cache.
  `enforce` then measures again and evicts the next-coldest frames if the kernel kept
  any page (one it could not drop at once: `over_budget_after_enforce` counts the
  calls that still ended above the budget after `MAX_ROUNDS` rounds). The mapping is
  ``MADV_RANDOM``: a fault reads the page touched, no readahead.
* Victims by recency and frequency: each frame has the enforcement round at which it
  was last seen coming into memory (a fault since the previous round), announced for a
  batch (`will_use`) or touched by a structure (`touch`), and the number of batches
  that did so; the oldest go first, a frame used in ``n`` batches counting as
  ``HIT_WEIGHT * log2(1 + n)`` rounds younger. Without `will_use` or `touch` the only
  use seen is the refault (CLOCK whose reference bit is the refault). `cold` lets a
  structure push frames it knows are done with (a window's expired pages) to the front.
* `will_use` before a batch (its frames, e.g. `mmm.HashMap.frames_for` of its keys)
  evicts the coldest other frames to make room and reads the missing ones in together.
* Copy-on-write, rollback, snapshots, incremental checkpoints and local recovery
  (`PagePool.attach` of the same file) see the same bytes whether a frame is resident
  or not: nothing else changes. A page evicted while a checkpoint writes it is read
  back from the file by the writer.
* A batch whose pages cannot fit: the frames that came into memory during one batch
  are a lower bound of its working set; when they exceed the budget `enforce` (with
  ``check=True``) evicts and then raises `WorkingSetTooLargeError` naming the
  partition, its state size and the budget.
* Per-frame bookkeeping (recency, residency) covers the frames up to the highest one
  the pool has handed out since the cache began, grown by doubling: a pool of 16 GiB
  capacity that uses 100 MB costs 100 MB / 4 KiB * 13 bytes.

Notes
-----
The budget holds when `enforce` returns: between two calls (during a batch) the
kernels fault pages in as they touch them, so the peak is the budget plus one batch's
working set. A page durable in a checkpoint but dirty in memory is still written to
the local file when evicted (the file is the pool's backing store); a page not written
since its last eviction costs no write.
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
from mmm.pool import FREE, LIVE, PagePool

__all__ = ["PageCache", "WorkingSetTooLargeError", "BudgetError", "is_memory_fs",
           "LOW_WATER", "MAX_ROUNDS", "HIT_WEIGHT", "OS_PAGE", "FOLIO_WINDOW_BYTES"]

OS_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
LOW_WATER = 0.85
"""`enforce` evicts down to this fraction of the budget (so it does not run every batch)."""
MAX_ROUNDS = 4
HIT_WEIGHT = 20.0
"""Rounds of recency a frame gains per doubling of the batches that used it: a page many
batches use (a hot key's) outlives pages used once (the tail's) that came in a little
later (LRU weighted by frequency; with Zipf keys ~20% fewer misses than plain LRU)."""
"""Eviction rounds `enforce` tries before it leaves the resident bytes above the budget."""
_MADV_RANDOM = 1
_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_SYNC_RANGE = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | WRITE | WAIT_AFTER
_SYNC_START = 2  # SYNC_FILE_RANGE_WRITE: start writing the dirty pages, no wait
_MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}
_MIN_TRACKED = 1024  # frames of bookkeeping allocated at first
FOLIO_WINDOW_BYTES = 2 << 20
"""The aligned span `enforce` drops around a page the kernel kept (the largest page-cache
folio of a file on x86-64)."""


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
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.mincore.restype = ctypes.c_int
    lib.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_uint]
    lib.sync_file_range.restype = ctypes.c_int
    try:
        lib.syscall.restype = ctypes.c_long
    except AttributeError:  # pragma: no cover - every glibc has syscall(2)
        pass
    return lib


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_NR_PROCESS_MADVISE = {"x86_64": 440, "aarch64": 440}.get(os.uname().machine)
_PIDFD_SELF = -10000  # the calling process (Linux 6.13+ lets it advise itself anything)
_IOV_MAX = 1024
_batched_unmap = [_NR_PROCESS_MADVISE is not None]  # cleared when the kernel refuses


def _unmap_runs(base: int, runs: "list[tuple[int, int]]", pb: int,
                advice: int = _MADV_DONTNEED) -> bool:
    """``MADV_DONTNEED`` (or ``advice``) on every run of frames in as few system calls as
    the kernel allows (``process_madvise`` on this process, up to 1024 runs a call, one
    TLB flush); False when the kernel refuses it (older than 6.13): the caller advises
    run by run."""
    if not _batched_unmap[0] or _NR_PROCESS_MADVISE is None:
        return False
    lib, nr = _lib(), _NR_PROCESS_MADVISE
    for i in range(0, len(runs), _IOV_MAX):
        part = runs[i:i + _IOV_MAX]
        iov = (_Iovec * len(part))(*[_Iovec(base + a * pb, (b - a) * pb) for a, b in part])
        want = sum(b - a for a, b in part) * pb
        got = lib.syscall(ctypes.c_long(nr), ctypes.c_int(_PIDFD_SELF),
                          iov, ctypes.c_size_t(len(part)), ctypes.c_int(advice),
                          ctypes.c_uint(0))
        if got != want:  # refused, or stopped part-way: madvise is idempotent, redo per run
            if got < 0 and i == 0:
                _batched_unmap[0] = False
            return False
    return True


_LIBC: Any = None


def _lib() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = _libc()
    return _LIBC


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


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
        file system, mapped shared.
    budget_bytes : int
        Resident bytes the pool's frames may hold after `enforce`; at least two pages.
    name : str
        What errors call the partition (e.g. ``"aggregate/partition 3"``).
    allow_memory_fs : bool
        Accept a pool file on tmpfs (evicting there frees nothing).

    Raises
    ------
    BudgetError
        If the pool is not file-backed, is mapped copy-on-write, lives on a memory file
        system, its pages are smaller than the OS page, or the budget holds fewer than
        two pages.
    """

    def __init__(self, pool: PagePool, budget_bytes: int, name: str = "partition", *,
                 allow_memory_fs: bool = False) -> None:
        if pool.path is None:
            raise BudgetError(f"{name}: a memory budget needs a pool backed by a file on "
                              f"disk; this pool is anonymous memory")
        if getattr(pool._raw, "mode", None) not in ("r+", "w+"):
            raise BudgetError(f"{name}: pool file {pool.path} is mapped copy-on-write; "
                              f"evicting its pages would lose their changes")
        if not allow_memory_fs and is_memory_fs(pool.path):
            raise BudgetError(f"{name}: pool file {pool.path} is on a memory file system; "
                              f"a memory budget needs it on a disk (e.g. spark.local.dir)")
        if pool.page_bytes % OS_PAGE:
            raise BudgetError(f"{name}: page_bytes={pool.page_bytes} is not a multiple of "
                              f"the OS page ({OS_PAGE} bytes)")
        self.pool = pool
        self.name = name
        self.budget_bytes = 0
        self.set_budget(budget_bytes)
        self._base = int(pool.frames.ctypes.data)
        self._off0 = pool.frames_offset
        self._fd = os.open(pool.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._closer = weakref.finalize(self, os.close, self._fd)
        # no readahead: a fault brings in the page touched, not its neighbours
        if _lib().madvise(self._base, pool.n_frames * pool.page_bytes, _MADV_RANDOM) != 0:
            raise _os_error(f"{name}: madvise(MADV_RANDOM) of pool file {pool.path}")
        self._per_frame = pool.page_bytes // OS_PAGE
        self._hw = 0  # frames [0, _hw) are the ones ever handed out since the cache began
        self._seen = np.zeros(0, dtype=np.int64)  # round each frame was last seen coming in
        self._hits = np.zeros(0, dtype=np.uint32)  # batches that used each frame (as known)
        self._was = np.zeros(0, dtype=bool)  # resident after the last round
        self._vec = np.zeros(0, dtype=np.uint8)
        hw = self._track(int(pool._watermark))
        self._was[:hw] = self._resident(hw) > 0  # in memory before: not a batch's doing
        self.round = 1
        self.evicted_frames = 0
        self.evictions = 0
        self.peak_resident_bytes = 0
        self.last_working_set_bytes = 0
        self.over_budget_after_enforce = 0

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

    def close(self) -> None:
        """Close the descriptor the cache holds (the pool stays as it is)."""
        self._closer()

    # -- bookkeeping ----------------------------------------------------------------------
    def _track(self, end: int) -> int:
        """Cover frames [0, end) (and every frame handed out so far); returns the count."""
        end = min(self.pool.n_frames, max(self._hw, end, int(self.pool._watermark)))
        if end > len(self._seen):
            cap = min(self.pool.n_frames, max(end, 2 * len(self._seen), _MIN_TRACKED))
            seen = np.zeros(cap, dtype=np.int64)
            seen[:len(self._seen)] = self._seen
            was = np.zeros(cap, dtype=bool)
            was[:len(self._was)] = self._was
            hits = np.zeros(cap, dtype=np.uint32)
            hits[:len(self._hits)] = self._hits
            self._seen, self._was, self._hits = seen, was, hits
            self._vec = np.zeros(cap * self._per_frame, dtype=np.uint8)
        self._hw = end
        return end

    def _frames_arg(self, frames: npt.ArrayLike, what: str) -> npt.NDArray[np.int64]:
        fr = np.asarray(frames, dtype=np.int64).reshape(-1)
        if len(fr) and (int(fr.min()) < 0 or int(fr.max()) >= self.pool.n_frames):
            raise ValueError(f"{self.name}: {what}: frames must lie in [0, "
                             f"{self.pool.n_frames}); got {int(fr.min())}..{int(fr.max())}")
        if len(fr):
            self._track(int(fr.max()) + 1)
        return fr

    # -- residency ----------------------------------------------------------------------
    def resident(self) -> npt.NDArray[np.int64]:
        """Resident OS pages of each frame handed out so far (``mincore``: page-cache
        residency; O(frames * page_bytes / 4 KiB), no faults)."""
        return self._resident(self._track(0))

    def _resident(self, hw: int) -> npt.NDArray[np.int64]:
        n = hw * self._per_frame
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        vec = self._vec[:n]
        if _lib().mincore(self._base, hw * self.pool.page_bytes, vec.ctypes.data) != 0:
            raise _os_error(f"{self.name}: mincore over pool file {self.pool.path}")
        per = (vec & 1).astype(np.int64)
        if self._per_frame == 1:
            return per
        out: npt.NDArray[np.int64] = per.reshape(hw, self._per_frame).sum(axis=1)
        return out

    def resident_bytes(self) -> int:
        """Bytes of the pool's frames in memory now (page cache: mapped or not)."""
        return int(self.resident().sum()) * OS_PAGE

    def mapped_bytes(self) -> int:
        """Bytes of the pool's frames mapped into this process now: the pool's share of
        its RSS (present bits of ``/proc/self/pagemap``; at most `resident_bytes`).

        Raises
        ------
        OSError
            Where ``/proc/self/pagemap`` cannot be read.
        """
        hw = self._track(0)
        n = hw * self._per_frame
        if n == 0:
            return 0
        want = n * 8
        raw = bytearray()
        off = self._base // OS_PAGE * 8
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            while len(raw) < want:
                chunk = os.pread(fd, want - len(raw), off + len(raw))
                if not chunk:
                    break
                raw += chunk
        finally:
            os.close(fd)
        entries = np.frombuffer(bytes(raw), dtype="<u8")
        return int(np.count_nonzero(entries >> np.uint64(63))) * OS_PAGE

    def stats(self) -> dict[str, int]:
        """``resident_bytes`` (frames in memory, `resident_bytes`), ``evicted_bytes``
        (used frames' bytes not in memory), ``state_bytes`` (used frames: the live pages
        and the older copies a snapshot still holds), ``live_bytes`` (the live pages
        alone: the state a checkpoint holds), ``budget_bytes`` and the eviction
        counters."""
        hw = self._track(0)
        res = self._resident(hw)
        used = self.pool.state[:hw] != FREE
        live_b = int(np.count_nonzero(self.pool.state[:hw] == LIVE)) * self.pool.page_bytes
        pb = self.pool.page_bytes
        state_b = int(self.pool.used_frames) * pb
        resident_used = int(res[used].sum()) * OS_PAGE
        return {"resident_bytes": int(res.sum()) * OS_PAGE,
                "evicted_bytes": max(0, state_b - resident_used),
                "state_bytes": state_b, "live_bytes": live_b,
                "budget_bytes": self.budget_bytes,
                "evicted_frames_total": self.evicted_frames, "evictions": self.evictions,
                "peak_resident_bytes": self.peak_resident_bytes,
                "over_budget_after_enforce": self.over_budget_after_enforce}

    # -- hints ----------------------------------------------------------------------------
    def touch(self, frames: npt.ArrayLike) -> None:
        """Mark frames as just used (they are evicted last).

        Raises
        ------
        ValueError
            If a frame lies outside the pool; nothing is marked.
        """
        fr = np.unique(self._frames_arg(frames, "touch"))
        self._seen[fr] = self.round
        self._hits[fr] += 1

    def cold(self, frames: npt.ArrayLike) -> None:
        """Mark frames as done with (evicted first).

        Raises
        ------
        ValueError
            If a frame lies outside the pool; nothing is marked.
        """
        fr = self._frames_arg(frames, "cold")
        self._seen[fr] = 0
        self._hits[fr] = 0

    def will_use(self, frames: npt.ArrayLike, make_room: bool = True) -> int:
        """Announce the frames the next batch uses (e.g. `mmm.HashMap.frames_for` of its
        keys): they are marked used (evicted last, like the frames that come into memory
        during a batch) and those not in memory after the last `enforce` (or evicted
        since) are read in together (``MADV_WILLNEED`` on every run of consecutive
        frames, in one ``process_madvise`` where the kernel allows it, else
        ``posix_fadvise(WILLNEED)`` per run: the reads overlap instead of waiting one
        fault at a time). With ``make_room``,
        the coldest frames the batch does not use are evicted first, so that the frames
        in memory plus those read stay within the budget: the batch then runs within it
        (up to the pages it adds) and the next `enforce` has little or nothing to evict.
        It reads no more frames than the budget then holds (the rest fault in when
        touched). Returns the frames read ahead. Changes no byte of any page; the frames
        read count as the batch's working set at the next `enforce`.

        Raises
        ------
        ValueError
            If a frame lies outside the pool; nothing is marked, evicted or read.
        OSError
            As `evict`.
        """
        fr = np.unique(self._frames_arg(frames, "will_use"))
        if len(fr) == 0:
            return 0
        self._seen[fr] = self.round + 1  # the round the next `enforce` opens
        self._hits[fr] += 1
        out = fr[~self._was[fr]]
        if len(out) == 0:
            return 0
        pb = self.pool.page_bytes
        cap = self.budget_bytes // pb  # frames the budget holds
        hw = self._hw
        if make_room:
            was = self._was[:hw].copy()
            was[fr] = False  # the batch's own frames stay
            cand = np.flatnonzero(was)
            excess = int(np.count_nonzero(self._was[:hw])) + len(out) - cap
            if excess > 0 and len(cand):
                order = self._coldest_first(cand)
                self.evict(order[:excess])
        room = cap - int(np.count_nonzero(self._was[:hw]))
        out = out[:max(0, room)]
        if len(out) == 0:
            return 0
        brk = np.flatnonzero(np.diff(out) != 1) + 1
        firsts = out[np.concatenate(([0], brk))].tolist()
        ends = (out[np.concatenate((brk - 1, [len(out) - 1]))] + 1).tolist()
        runs = list(zip(firsts, ends))
        # MADV_WILLNEED of a file mapping reads the file's pages in (as fadvise does),
        # all runs in one or a few system calls
        if not _unmap_runs(self._base, runs, pb, _MADV_WILLNEED):
            off0, fd = self._off0, self._fd
            advise, willneed = os.posix_fadvise, os.POSIX_FADV_WILLNEED
            for a, b in runs:
                advise(fd, off0 + a * pb, (b - a) * pb, willneed)
        return len(out)

    # -- eviction -------------------------------------------------------------------------
    def _coldest_first(self, cand: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``cand`` in eviction order: by the round each was last used, a frame used in
        ``n`` batches counting as used ``HIT_WEIGHT * log2(1 + n)`` rounds later (ties:
        lower frame first)."""
        key = self._seen[cand] + HIT_WEIGHT * np.log2(1.0 + self._hits[cand])
        out: npt.NDArray[np.int64] = cand[np.argsort(key, kind="stable")]
        return out

    def evict(self, frames: npt.ArrayLike) -> int:
        """Write back and drop these frames from memory; returns how many runs of
        consecutive frames it took (three system calls each).

        Raises
        ------
        ValueError
            If a frame lies outside the pool; nothing is evicted.
        OSError
            If the kernel refuses to unmap or write a run (the error names the frames and
            the file); no byte is lost (the pages stay in the page cache).
        """
        fr = np.unique(self._frames_arg(frames, "evict"))
        if len(fr) == 0:
            return 0
        brk = np.flatnonzero(np.diff(fr) != 1) + 1
        starts = np.concatenate(([0], brk))
        ends = np.concatenate((brk, [len(fr)]))
        pb, lib = self.pool.page_bytes, _lib()
        runs = list(zip(fr[starts].tolist(), (fr[ends - 1] + 1).tolist()))
        # out of this process's page tables (dirty bits to the pages)
        if not _unmap_runs(self._base, runs, pb):
            for a, b in runs:
                if lib.madvise(self._base + a * pb, (b - a) * pb, _MADV_DONTNEED) != 0:
                    raise _os_error(f"{self.name}: unmapping frames {a}..{b - 1} of pool "
                                    f"file {self.pool.path}")
        # dirty pages to the file: every run's writes are started first (the device works
        # on them together), then each run is written again and waited for (a no-op for a
        # run already clean; it writes a page that was already being written back and got
        # dirty again before its write was started)
        for a, b in runs:
            if lib.sync_file_range(self._fd, self._off0 + a * pb, (b - a) * pb,
                                   _SYNC_START) != 0:
                raise _os_error(f"{self.name}: writing frames {a}..{b - 1} to pool file "
                                f"{self.pool.path}")
        for a, b in runs:
            if lib.sync_file_range(self._fd, self._off0 + a * pb, (b - a) * pb,
                                   _SYNC_RANGE) != 0:
                raise _os_error(f"{self.name}: writing frames {a}..{b - 1} to pool file "
                                f"{self.pool.path}")
        for a, b in runs:  # the clean, unmapped copies out of the page cache
            os.posix_fadvise(self._fd, self._off0 + a * pb, (b - a) * pb,
                             os.POSIX_FADV_DONTNEED)
        self.evicted_frames += len(fr)
        self.evictions += 1
        self._was[fr] = False
        return len(runs)

    def _evict_windows(self, frames: npt.NDArray[np.int64]) -> None:
        """Write back and drop the `FOLIO_WINDOW_BYTES`-aligned windows of the pool file
        around ``frames`` (header and neighbouring frames included: the mapping is
        shared, so no byte is lost; they come back when next touched)."""
        pb, lib, w = self.pool.page_bytes, _lib(), FOLIO_WINDOW_BYTES
        total = self._off0 + self.pool.n_frames * pb
        raw = self._base - self._off0  # where the mapping (file offset 0) begins
        for off in np.unique((self._off0 + frames * pb) // w * w).tolist():
            n = min(w, total - off)
            if lib.madvise(raw + off, n, _MADV_DONTNEED) != 0:
                raise _os_error(f"{self.name}: unmapping bytes {off}..{off + n - 1} of pool "
                                f"file {self.pool.path}")
            if lib.sync_file_range(self._fd, off, n, _SYNC_RANGE) != 0:
                raise _os_error(f"{self.name}: writing bytes {off}..{off + n - 1} to pool "
                                f"file {self.pool.path}")
            os.posix_fadvise(self._fd, off, n, os.POSIX_FADV_DONTNEED)

    def enforce(self, check: bool = False, written_since: int | None = None) -> int:
        """Bring the resident bytes back within the budget (to `LOW_WATER` of it when
        over); returns the frames evicted. With ``check``, raise after evicting when the
        frames that came into memory since the last call exceed the budget.

        With ``written_since`` (a value of the pool's clock), the working set
        (`last_working_set_bytes`) counts only the frames that came into memory and were
        written since the clock had that value (their header's version is at least it):
        the pages a batch wrote, not those another reader of the pool (an asynchronous
        checkpoint writer, a recovery) brought in meanwhile. Still a lower bound of the
        batch's working set. Reads only the headers of frames already in memory.

        Runtime: one ``mincore`` over the frames in use, plus one more per eviction round.

        Raises
        ------
        WorkingSetTooLargeError
            With ``check``, if the last batch's pages could not fit in the budget.
        OSError
            As `evict`.
        """
        hw = self._track(0)
        res = self._resident(hw)
        now = res > 0
        came = now & ~self._was[:hw]
        self.round += 1
        seen = self._seen[:hw]
        self._hits[:hw][came & (seen != self.round)] += 1  # not announced by will_use
        seen[came] = self.round
        resident_b = int(res.sum()) * OS_PAGE
        self.peak_resident_bytes = max(self.peak_resident_bytes, resident_b)
        pb = self.pool.page_bytes
        if written_since is None:
            ws = int(np.count_nonzero(came)) * pb
        else:
            cf = np.flatnonzero(came)
            ws = int(np.count_nonzero(
                self.pool.headers["version"][cf] >= written_since)) * pb
        self.last_working_set_bytes = ws
        n_out = 0
        if resident_b > self.budget_bytes:
            target = int(self.budget_bytes * LOW_WATER)
            for _ in range(MAX_ROUNDS):
                cand = np.flatnonzero(now)
                order = self._coldest_first(cand)
                over = resident_b - target
                k = int(np.searchsorted(np.cumsum(res[order] * OS_PAGE), over)) + 1
                victims = order[:k]
                self.evict(victims)
                n_out += len(victims)
                res = self._resident(hw)  # what the kernel really let go
                now = res > 0
                resident_b = int(res.sum()) * OS_PAGE
                if resident_b <= target:
                    break
                stuck = victims[now[victims]]
                if len(stuck):
                    # kept by the kernel: part of a larger page-cache folio (one made before
                    # the mapping was MADV_RANDOM, or by another mapping of the file) that
                    # reaches past the victims; evict the aligned windows around them
                    self._evict_windows(stuck)
                    res = self._resident(hw)
                    now = res > 0
                    resident_b = int(res.sum()) * OS_PAGE
                    if resident_b <= target:
                        break
                    # still kept (in use elsewhere): the next-coldest frames instead
                    seen[stuck[now[stuck]]] = self.round
            if resident_b > self.budget_bytes:
                self.over_budget_after_enforce += 1
        self._was[:hw] = now
        if check and ws > self.budget_bytes:
            state = self.pool.used_frames * pb
            raise WorkingSetTooLargeError(
                f"{self.name}: one batch touched {ws} bytes of pages, more than its memory "
                f"budget of {self.budget_bytes} bytes (state {state} bytes); raise the "
                f"budget (sguard.spark.budget) or split the partition", self.name, state, ws,
                self.budget_bytes)
        return n_out

    def unmap(self) -> None:
        """Unmap every frame handed out from this process (``MADV_DONTNEED``; for a shared
        file mapping no byte is lost and nothing leaves the page cache): another process
        mapping the same file can then evict them (a page mapped here stays in memory
        whatever another process advises). The next touch here is a minor fault.

        Raises
        ------
        OSError
            If the kernel refuses.
        """
        hw = self._track(0)
        if hw and _lib().madvise(self._base, hw * self.pool.page_bytes, _MADV_DONTNEED) != 0:
            raise _os_error(f"{self.name}: unmapping the frames of pool file {self.pool.path}")

    def evict_all(self) -> int:
        """Drop every frame from memory (after writing it back); returns frames evicted."""
        hw = self._track(0)
        fr = np.flatnonzero(self._resident(hw) > 0)
        self.evict(fr)
        stuck = np.flatnonzero(self._resident(hw) > 0)
        if len(stuck):  # in larger folios (see `enforce`)
            self._evict_windows(stuck)
        self._was[:hw] = self._resident(hw) > 0
        return len(fr)
