"""IOService: worker threads that write a snapshot's pages and read them back (paper §5).

Writing: the pages of a checkpoint are split into one contiguous share per
worker; each worker writes its share to one file of the checkpoint directory
(``w000.pages`` ...) in large sequential writes. For each write it gathers up
to ``chunk_bytes`` of frozen pages into a reusable per-thread buffer with
`mmm.Snapshot.copy_pages` (on local storage, pages lying in consecutive frames
are written straight from the frames, `mmm.Snapshot.pages_view`), checksums
them, hands the buffer to the stream
(pyarrow releases the GIL while writing) and marks the pages persisted, which
unpins them in mmm. Completion or failure is reported through a
`concurrent.futures.Future`; on the first failure the other workers stop at
their next write.

Scheduled writing (``write_snapshot(..., scheduler=...)``, `ioservice.scheduling`):
the pages are split into chunks of the scheduler's size, one file each, and a
dispatcher thread starts each chunk when the scheduler grants it and reports it
when written; a failing, dead or hung scheduler makes the rest unscheduled.

Reading: one reader task per page file; each reads runs of contiguous pages
in chunks of ``chunk_bytes`` straight into page frames when the sink is an
`mmm.Loader` (else into a small ring of reusable buffers), verifies every
page's checksum and header PageID against the manifest in one compiled call
without the GIL, and hands the verified pages to the sink (e.g.
`mmm.Loader.add`) as they arrive, in any order. On local files a reader reads
and verifies each chunk in one compiled call (``pread`` of `READ_PIECE_BYTES`
pieces, each checked right after it lands, while it is in the cache; the
kernel's readahead keeps the disk busy meanwhile). Elsewhere, with fewer
readers than CPUs, the read is pipelined: a reader hands each chunk to a
verifier thread and reads the next ones (up to `READ_AHEAD_CHUNKS` ahead) while
it is verified and placed.

Notes
-----
"Persisted" here means the page's bytes have been handed to the storage
stream: the frozen frame is then no longer needed, because a checkpoint whose
write later fails is cancelled and its changed pages are written again by the
next one, never retried from the frozen frames. The checkpoint itself becomes
durable only when its manifest is written, after every file is closed (and
fsynced on local filesystems) and its size checked.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import logging
import os
import threading
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from ioservice._checksum import pread_verify_rows, verify_rows
from ioservice.errors import (
    CheckpointDamagedError,
    CheckpointWriteError,
    IOServiceError,
    StorageNotFoundError,
)
from ioservice.format import Manifest, PageFile, PageTable, page_checksums, page_file_name
from ioservice import faultpoints
from ioservice.fs import StorageRoot
from ioservice.scheduling import ChunkGrant, ScheduledWrite, WriteIntent, WriteScheduler
from mmm.manager import Loader
from mmm.page import HEADER_DTYPE

_HEADER_FIELDS = HEADER_DTYPE.fields
assert _HEADER_FIELDS is not None  # HEADER_DTYPE is a structured dtype
_PAGE_ID_AT: int = _HEADER_FIELDS["page_id"][1]  # byte offset of the PageID in a page header

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_RESCUE_AFTER_S", "IOService", "ReadResult", "WriteResult"]

DEFAULT_CHUNK_BYTES = 4 << 20
"""Bytes per write or read call (a few MiB: small writes collapse when the
operator thread competes for the GIL)."""

DEFAULT_RESCUE_AFTER_S = 0.02
"""Seconds without a page written after which a write of background writers is written
on at normal priority (`IOService`'s ``rescue_after_s``)."""

READ_AHEAD_CHUNKS = 2
"""Chunks a reader thread reads ahead of their verification (`IOService.read_pages`)."""

READ_PIECE_BYTES = 256 << 10
"""Bytes per ``pread`` on local files, each piece verified right after it lands while
it is still in the CPU cache (`IOService.read_pages`; a core's L2 holds a few)."""

ProgressFn = Callable[[int, int], None]


class SnapshotLike(Protocol):
    """What the writer needs of an `mmm.Snapshot`."""

    snapshot_id: int
    page_bytes: int
    page_ids: npt.NDArray[np.uint64]

    def copy_pages(self, indices: npt.ArrayLike, out: npt.NDArray[np.uint8] | None = None
                   ) -> npt.NDArray[np.uint8]: ...

    def mark_persisted(self, indices: npt.ArrayLike) -> None: ...


@dataclass(frozen=True, slots=True, eq=False)
class WriteResult:
    """The files and page-table rows of one completed write (see `IOService.write_snapshot`)."""

    files: tuple[PageFile, ...]
    table: PageTable
    """One row per page written, sorted by page_id; ``file`` indexes `files`."""
    written_bytes: int
    seconds: float
    first_start_s: float = 0.0
    """Seconds from the call to the first chunk's start (the admission wait when scheduled)."""
    scheduled: bool = False
    """Whether a write scheduler admitted the chunks (see `ioservice.scheduling`)."""
    fallback: str | None = None
    """Why some chunks were written unscheduled (scheduler dead, hung or failing), if so."""
    grants: tuple[ChunkGrant, ...] = ()
    """The scheduler's grants, in the order they arrived (placement advice included)."""
    rescued_chunks: int = 0
    """Chunks written at normal priority because the background writers were starved
    (`IOService`'s ``rescue_after_s``)."""


@dataclass(frozen=True, slots=True)
class ReadResult:
    """Totals of one `IOService.read_pages` call."""

    n_pages: int
    read_bytes: int
    seconds: float


class _Stop(Exception):
    """Internal: another worker failed; stop quietly."""


def lower_thread_priority(nice: int, idle: bool = False) -> None:
    """Lower the calling thread's CPU priority by `nice` (Linux: a thread's own nice
    value; a no-op elsewhere, where the call would name the whole process); with
    `idle`, move it to ``SCHED_IDLE`` (Linux): it runs only on a core no other
    thread wants, and a waking thread of normal policy preempts it at once.
    Irreversible for an unprivileged thread, so call it only in threads made for
    background work."""
    if not sys.platform.startswith("linux") or (nice <= 0 and not idle):
        return
    tid = threading.get_native_id()
    try:
        if nice > 0:
            os.setpriority(os.PRIO_PROCESS, tid,
                           min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        if idle:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:  # e.g. a sandbox that forbids it: run at normal priority
        logger.debug("could not lower thread %d's priority: %s", tid, exc)


class IOService:
    """A pool of I/O worker threads for checkpoint writes and recovery reads.

    Parameters
    ----------
    n_workers : int
        A checkpoint is written as (at most) this many files; recovery reads
        with this many threads.
    chunk_bytes : int
        Bytes gathered into one write or read call (rounded down to whole
        pages, at least one page).
    nice : int
        Lower the checkpoint writer threads' CPU priority by this much (0-19; Linux, where
        a thread has a nice value of its own; ignored elsewhere), so that under
        contention the cores go to the threads that process records and
        background checkpoint I/O takes what is left (`lower_thread_priority`).
    idle : bool
        Run the threads that write checkpoints under
        Linux's ``SCHED_IDLE`` policy (the default, True): they use only cores
        no other thread wants, and a thread that wakes up to process records
        preempts them at once, so checkpoints stay out of the operator's
        latency (`bench.chkpt_latency`). On a machine saturated by other work a
        checkpoint written this way waits for idle CPU time, so it can take far
        longer; False shares the cores fairly. Recovery reads always run at
        normal priority (their own threads). Ignored elsewhere.
    write_threads : int, optional
        Threads that write a checkpoint's files at once (each file still holds
        one worker's share: `n_workers` files). Default: one core fewer than
        the machine has (at least 1, at most `n_workers`), so a thread that
        processes records always finds a core no checkpoint writer is in; in
        the kernel's write path a thread is not preempted at once, whatever
        its policy.
    rescue_after_s : float or None
        When the writers run below normal priority (`idle`, `nice`) and a
        write has written no page for this long (default
        `DEFAULT_RESCUE_AFTER_S`), a thread of normal priority writes it on,
        chunk by chunk in file order, while the writers make no progress: on a
        machine saturated by other work a checkpoint then moves at a normal
        thread's pace instead of waiting for idle CPU time. None: never.

    Examples
    --------
    >>> import numpy as np, tempfile, mmm
    >>> from mmm.structures.hashmap import HashMap
    >>> from ioservice.fs import open_root
    >>> pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    >>> m = HashMap.create(pm, "m", key="<u4", value="<i8")
    >>> m.put(np.arange(100, dtype="<u4"), np.arange(100))
    >>> root = open_root(tempfile.mkdtemp())
    >>> with IOService(n_workers=2) as io:
    ...     snap = pm.chkpt()
    ...     res = io.write_snapshot(root, "checkpoint/u-1", snap).result()
    ...     snap.complete()
    >>> len(res.files), len(res.table) == len(snap)
    (2, True)

    Notes
    -----
    Thread safety: any thread may submit work. Callbacks (``on_progress``,
    the future's done-callbacks) run on worker threads.
    """

    def __init__(self, n_workers: int = 4, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 nice: int = 0, idle: bool = True, write_threads: int | None = None,
                 rescue_after_s: float | None = DEFAULT_RESCUE_AFTER_S) -> None:
        if not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be an int >= 1, got {n_workers!r}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ValueError(f"nice must be an int in 0..19, got {nice!r}")
        if not isinstance(idle, bool):
            raise ValueError(f"idle must be a bool, got {idle!r}")
        if write_threads is None:
            write_threads = max(1, min(n_workers, _cpus() - 1))
        elif (isinstance(write_threads, bool) or not isinstance(write_threads, int)
              or not 1 <= write_threads <= n_workers):
            raise ValueError(f"write_threads must be an int in 1..n_workers={n_workers}, "
                             f"got {write_threads!r}")
        if rescue_after_s is not None and (isinstance(rescue_after_s, bool) or not isinstance(
                rescue_after_s, (int, float)) or not rescue_after_s > 0):
            raise ValueError(f"rescue_after_s must be a number > 0 or None, "
                             f"got {rescue_after_s!r}")
        self.n_workers = n_workers
        self.chunk_bytes = chunk_bytes
        # a rescuer only where the writers run below normal priority
        self.rescue_after_s = (None if rescue_after_s is None or not (idle or nice)
                               else float(rescue_after_s))
        self.nice = nice
        self.idle = idle
        self.write_threads = write_threads
        # recovery reads: normal priority (nothing else runs that they could delay)
        self._pool = cf.ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="sguard-io")
        # checkpoint writes: background priority (`nice`, `idle`), `write_threads` at once
        self._write_pool = cf.ThreadPoolExecutor(max_workers=write_threads,
                                                 thread_name_prefix="sguard-io-write",
                                                 initializer=lower_thread_priority,
                                                 initargs=(nice, idle))
        self._local = threading.local()
        self._verify_pool: cf.ThreadPoolExecutor | None = None
        self._verify_lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> IOService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self, wait: bool = True) -> None:
        """Stop the workers (after the queued work when `wait`). Idempotent."""
        self._closed = True
        self._write_pool.shutdown(wait=wait)
        self._pool.shutdown(wait=wait)
        with self._verify_lock:
            verifier = self._verify_pool
        if verifier is not None:  # after the readers, which wait for their verifications
            verifier.shutdown(wait=wait)

    def _buffer(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """This thread's reusable I/O buffer of at least `nbytes`."""
        buf: npt.NDArray[np.uint8] | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            self._local.buf = buf
        return buf

    def _chunk_pages(self, page_bytes: int) -> int:
        return max(1, self.chunk_bytes // page_bytes)

    # ----------------------------------------------------------------------- write
    def write_snapshot(self, root: StorageRoot, directory: str, snap: SnapshotLike,
                       indices: npt.ArrayLike | None = None, *, name: str | None = None,
                       on_progress: ProgressFn | None = None,
                       scheduler: WriteScheduler | None = None,
                       haunit: str = "", file_tag: str | None = None) -> cf.Future[WriteResult]:
        """Write pages of `snap` into `directory`, one file per worker, asynchronously.

        Parameters
        ----------
        root : StorageRoot
            Where to write.
        directory : str
            Directory relative to the root (``checkpoint/<haunit>-<seq>``).
        snap : mmm.Snapshot
            An ACTIVE snapshot; its pages are marked persisted as they are written.
        indices : array of int, optional
            Snapshot page indices to write, ascending (default: all).
        name : str, optional
            Checkpoint name used in error messages (default: `directory`).
        on_progress : callable, optional
            ``on_progress(pages_done, pages_total)``, called from worker threads.
        scheduler : WriteScheduler, optional
            Admit the write chunk by chunk (`ioservice.scheduling`): the pages are
            split into chunks of ``scheduler.chunk_bytes`` (one file each) that
            start only when granted, from a dispatcher thread; on a scheduler
            failure or timeout the rest is written unscheduled (logged).
        haunit : str
            HA unit name told to the scheduler.
        file_tag : str, optional
            Part of every page file name (``w000-<tag>.pages``): a writer that
            tags its files uniquely never touches another writer's files. Files
            are opened create-only where the backend allows it (local).

        Returns
        -------
        concurrent.futures.Future of WriteResult
            Fails with `CheckpointWriteError` naming the checkpoint, file and
            backend. The caller owns the snapshot's lifecycle: it commits a
            manifest and calls ``snap.complete()``, or ``snap.cancel()`` on failure.
            Files written before a failure are left in place (see
            `StorageRoot.open_output_stream`); delete the directory.

        Raises
        ------
        RuntimeError
            If the service was shut down.

        Notes
        -----
        Runtime complexity: O(pages) in numpy and one xxh3 call per page.
        Pages copied: each written page once, into a per-thread buffer.
        """
        if self._closed:
            raise RuntimeError("IOService is shut down")
        idx = np.arange(len(snap.page_ids), dtype=np.int64) if indices is None \
            else np.asarray(indices, dtype=np.int64)
        w = _SnapshotWrite(self, root, directory, snap, idx, name or directory, on_progress,
                           scheduler, file_tag)
        if not w.n_files:
            w.result.set_result(WriteResult((), PageTable.empty(), 0, 0.0))
        elif scheduler is None:
            for k in range(w.n_files):
                w.launch(k)
        else:
            w.dispatch(haunit)
        return w.result

    # ------------------------------------------------------------------------ read
    def read_pages(self, root: StorageRoot, manifest: Manifest,
                   sink: Callable[[npt.NDArray[np.uint8]], None], *, verify: bool = True,
                   on_progress: ProgressFn | None = None) -> ReadResult:
        """Read every page of `manifest` in parallel and hand verified pages to `sink`.

        Parameters
        ----------
        root : StorageRoot
            Where the checkpoint lives.
        manifest : Manifest
            The checkpoint to read (its page table says where each page is).
        sink : callable
            ``sink(pages)`` with a ``(n, page_bytes)`` uint8 array, called from
            worker threads, in any order; the array is a reused buffer, so the
            sink must copy what it keeps before returning (`mmm.Loader.add` does).
            When `sink` is a bound `mmm.Loader.add`, pages are read straight
            into frames the loader reserves (`Loader.reserve`/`commit`): no copy.
        verify : bool
            Check every page's checksum and header PageID (recovery always does).
        on_progress : callable, optional
            ``on_progress(pages_done, pages_total)`` from worker threads.

        Returns
        -------
        ReadResult

        Raises
        ------
        CheckpointDamagedError
            If a file is missing or short, or a page fails its checksum or has
            another PageID than the manifest says; names checkpoint, file, page.
        StorageUnreachableError, StorageIOError
            If the storage fails otherwise.
        Exception
            Whatever `sink` raises (e.g. `mmm.PoolExhaustedError`).

        Notes
        -----
        On the first error the other workers stop at their next chunk and the
        call returns only after all of them have stopped.
        """
        if self._closed:
            raise RuntimeError("IOService is shut down")
        start = time.perf_counter()
        t = manifest.pages
        total = len(t)
        stop = threading.Event()
        lock = threading.Lock()
        done = [0]

        def progress(n: int) -> None:
            with lock:
                done[0] += n
                now = done[0]
            if on_progress is not None:
                on_progress(now, total)

        order = np.lexsort((t.offset, t.file))
        files_sorted = t.file[order]
        bounds = np.flatnonzero(np.diff(files_sorted)) + 1
        groups = np.split(order, bounds) if total else []
        groups.sort(key=len, reverse=True)
        # Readers that cannot keep every core busy hand verification to verifier threads
        # and read on; as many readers as cores already overlap one's verification with
        # the others' reads, and a hand-off per chunk would only add CPU.
        pipelined = min(self.n_workers, len(groups)) < _cpus()
        # Local files: each reader reads and verifies in one compiled call per chunk
        # (`_read_file_local`); elsewhere through the filesystem's streams, pipelined.
        if root._native_local:
            futs = [self._pool.submit(self._read_file_local, root, manifest, g, sink, verify,
                                      stop, progress) for g in groups]
        else:
            futs = [self._pool.submit(self._read_file, root, manifest, g, sink, verify, stop,
                                      progress, pipelined) for g in groups]
        first: BaseException | None = None
        for fut in futs:
            try:
                fut.result()
            except _Stop:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                stop.set()
                if first is None:
                    first = exc
        if first is not None:
            raise first
        secs = time.perf_counter() - start
        return ReadResult(total, total * manifest.page_bytes, secs)

    def _verifier(self) -> cf.ThreadPoolExecutor:
        """The threads that verify and place chunks while the readers read on (lazily made)."""
        with self._verify_lock:
            if self._verify_pool is None:
                self._verify_pool = cf.ThreadPoolExecutor(
                    max_workers=max(2, self.n_workers), thread_name_prefix="sguard-verify")
            return self._verify_pool

    def _ring(self, nbytes: int) -> list[npt.NDArray[np.uint8]]:
        """This reader thread's `READ_AHEAD_CHUNKS` + 1 bounce buffers of `nbytes` (for
        chunks that cannot be read straight into frames)."""
        ring: list[npt.NDArray[np.uint8]] | None = getattr(self._local, "ring", None)
        if ring is None or len(ring[0]) < nbytes:
            ring = [np.empty(nbytes, dtype=np.uint8) for _ in range(READ_AHEAD_CHUNKS + 1)]
            self._local.ring = ring
        return ring

    def _read_file(self, root: StorageRoot, manifest: Manifest, rows: npt.NDArray[np.intp],
                   sink: Callable[[npt.NDArray[np.uint8]], None], verify: bool,
                   stop: threading.Event, progress: Callable[[int], None],
                   pipelined: bool = True) -> None:
        """Read the pages `rows` (all in one file, sorted by offset), pipelined.

        Each chunk goes straight into frames the loader reserves (or into a
        bounce buffer of a ring). When `pipelined`, this (reader) thread only
        reads: each chunk is handed to a verifier thread, which checks checksums
        and PageIDs and commits (places, sinks) it while this thread reads the
        next chunks; at most `READ_AHEAD_CHUNKS` chunks wait for their
        verification. Otherwise this thread verifies each chunk itself. On any failure
        (this thread's or a verifier's) the chunks still in flight are waited
        for, so no thread touches the sink after this returns; a chunk that
        fails, or whose verification starts after `stop`, gives its reserved
        frames back.
        """
        if stop.is_set():
            raise _Stop()
        t, pb, pf, where, per, loader = self._read_setup(root, manifest, rows, sink)
        ring: list[npt.NDArray[np.uint8]] | None = None
        offs = t.offset[rows]
        verifier = self._verifier() if pipelined else None
        pending: collections.deque[cf.Future[None]] = collections.deque()
        n_bounce = 0  # bounce buffers handed out (ring slot = n_bounce % len(ring))

        def settle(fut: cf.Future[None]) -> None:
            try:
                fut.result()
            except BaseException:
                stop.set()  # the other readers stop at their next chunk
                raise

        try:
            f = root.open_input_file(pf.path)
        except StorageNotFoundError as exc:
            raise CheckpointDamagedError(f"{where}: page file is missing") from exc
        try:
            for a, b in _chunks(offs, pb, per, stop):
                n = b - a
                # read straight into page frames when the sink can lend them
                with _reserved(loader, n) as (frames, dest):
                    if dest is not None:
                        target = dest
                    else:
                        if ring is None:
                            ring = self._ring(per * pb)
                        target = ring[n_bounce % len(ring)][:n * pb].reshape(n, pb)
                        n_bounce += 1
                    view = target.reshape(-1).data  # memoryview of the frame bytes
                    off = int(offs[a])
                    try:
                        f.seek(off)
                        got = f.readinto(view)
                    except (OSError, pa.ArrowException) as exc:
                        raise root._translate(exc, "read", pf.path) from exc
                    if got != n * pb:
                        raise CheckpointDamagedError(
                            f"{where}: short file: {got} of {n * pb} bytes at offset {off}")
                args = (target, frames, dest is not None, loader, sink, rows[a:b],
                        offs[a:b], t, verify, stop, where, progress)
                if verifier is None:
                    _settle_chunk(*args)
                    continue
                pending.append(verifier.submit(_settle_chunk, *args))
                # a bounce buffer is reused READ_AHEAD_CHUNKS + 1 chunks later: by then
                # its chunk has been verified and placed
                while len(pending) > READ_AHEAD_CHUNKS:
                    settle(pending.popleft())
            while pending:
                settle(pending.popleft())
        finally:
            # whatever happened, no verifier may touch the sink or frames after we return
            cf.wait(pending)
            f.close()

    def _read_setup(self, root: StorageRoot, manifest: Manifest, rows: npt.NDArray[np.intp],
                    sink: Callable[[npt.NDArray[np.uint8]], None]
                    ) -> tuple[PageTable, int, PageFile, str, int, Loader | None]:
        """What both file readers start from: the page table, page size, the file of
        ``rows``, the error prefix naming it, pages per chunk and the sink's `mmm.Loader`
        (a bound ``Loader.add``: reads go straight into reserved frames) if it is one."""
        t = manifest.pages
        pb = manifest.page_bytes
        pf = manifest.files[int(t.file[rows[0]])]
        where = f"checkpoint {manifest.name}: {pf.path} on {root.backend} root {root.uri}"
        owner = getattr(sink, "__self__", None)
        return t, pb, pf, where, self._chunk_pages(pb), owner if isinstance(owner, Loader) else None

    def _read_file_local(self, root: StorageRoot, manifest: Manifest, rows: npt.NDArray[np.intp],
                         sink: Callable[[npt.NDArray[np.uint8]], None], verify: bool,
                         stop: threading.Event, progress: Callable[[int], None]) -> None:
        """`_read_file` for a local file: read and verify each chunk in one compiled call
        without the GIL (`ioservice._checksum.pread_verify_rows`), `READ_PIECE_BYTES` per
        ``pread``, each piece checked right after it lands, while it is still in the CPU
        cache (verifying whole chunks afterwards reads them back from memory). The kernel's
        readahead keeps the disk busy meanwhile, so no verifier thread is needed.
        """
        if stop.is_set():
            raise _Stop()
        t, pb, pf, where, per, loader = self._read_setup(root, manifest, rows, sink)
        piece = max(1, READ_PIECE_BYTES // pb)
        offs = t.offset[rows]
        ids = t.page_id[rows]
        sums = t.checksum[rows]
        path = root.full_path(pf.path)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError as exc:
            raise CheckpointDamagedError(f"{where}: page file is missing") from exc
        except OSError as exc:
            raise root._translate(exc, "open for reading", pf.path) from exc
        try:
            for a, b in _chunks(offs, pb, per, stop):
                n = b - a
                with _reserved(loader, n) as (frames, dest):
                    target = dest if dest is not None else \
                        self._buffer(per * pb)[:n * pb].reshape(n, pb)
                    off = int(offs[a])
                    done, status, n_bad, i, j = pread_verify_rows(
                        fd, target, off, sums[a:b], ids[a:b], _PAGE_ID_AT, piece, verify)
                    if status < 0:  # pread failed: repeat it here for the error
                        self._pread_rest(fd, target, off, done, root, pf.path, where)
                        if verify:
                            _verify(target, ids[a:b], sums[a:b], offs[a:b], where)
                    elif status == 0:
                        raise CheckpointDamagedError(
                            f"{where}: short file: {done} of {n * pb} bytes at offset {off}")
                    elif verify:
                        _raise_damage(target, ids[a:b], offs[a:b], n_bad, i, j, where)
                _settle_chunk(target, frames, dest is not None, loader, sink, rows[a:b],
                              offs[a:b], t, False, stop, where, progress)
        finally:
            os.close(fd)

    @staticmethod
    def _pread_rest(fd: int, target: npt.NDArray[np.uint8], off: int, done: int,
                    root: StorageRoot, relpath: str, where: str) -> None:
        """Read the rest of `target` from byte `done` on with ``os.preadv`` (after the
        compiled read failed there): raises the storage error, or completes the read."""
        flat = target.reshape(-1)
        while done < len(flat):
            try:
                got = os.preadv(fd, [flat[done:].data], off + done)
            except OSError as exc:
                raise root._translate(exc, "read", relpath) from exc
            if not got:
                raise CheckpointDamagedError(
                    f"{where}: short file: {done} of {len(flat)} bytes at offset {off}")
            done += got


def _cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _chunks(offs: npt.NDArray[np.uint64], pb: int, per: int,
            stop: threading.Event) -> Iterator[tuple[int, int]]:
    """The chunks ``[a, b)`` a file reader reads, in order: at most `per` rows, each a run
    of pages that lie back to back in the file (offsets `offs`, pages of `pb` bytes).
    Raises `_Stop` before a chunk once `stop` is set."""
    breaks = (np.flatnonzero(np.diff(offs) != np.uint64(pb)) + 1).tolist()
    for a0, b0 in zip([0, *breaks], [*breaks, len(offs)]):
        for a in range(a0, b0, per):
            if stop.is_set():
                raise _Stop()
            yield a, min(a + per, b0)


@contextlib.contextmanager
def _reserved(loader: Loader | None, n: int
              ) -> Iterator[tuple[npt.NDArray[np.int64] | None, npt.NDArray[np.uint8] | None]]:
    """``(frames, dest)``: `n` frames the loader lends for a chunk to be read into (``(None,
    None)`` without one), given back if the read (the ``with`` body) fails."""
    frames, dest = loader.reserve(n) if loader is not None else (None, None)
    try:
        yield frames, dest
    except BaseException:
        if frames is not None:
            assert loader is not None  # frames come only from `loader.reserve`
            loader.unreserve(frames)
        raise


def _settle_chunk(target: npt.NDArray[np.uint8], frames: npt.NDArray[np.int64] | None,
                  in_frames: bool, loader: Loader | None,
                  sink: Callable[[npt.NDArray[np.uint8]], None], sel: npt.NDArray[np.intp],
                  offs: npt.NDArray[np.uint64], t: PageTable, verify: bool,
                  stop: threading.Event, where: str, progress: Callable[[int], None]) -> None:
    """Verifier side of `IOService._read_file`: check one chunk read into `target` and
    commit it (frames read into), place it (reserved frames elsewhere) or hand it to
    `sink`; reserved frames go back to the pool on any failure or after `stop`."""
    try:
        if stop.is_set():
            raise _Stop()
        if verify:
            _verify(target, t.page_id[sel], t.checksum[sel], offs, where)
    except BaseException:
        if frames is not None:
            assert loader is not None  # frames come only from `loader.reserve`
            loader.unreserve(frames)
        raise
    if in_frames:
        assert loader is not None and frames is not None  # lent by `reserve`
        loader.commit(frames)
    elif frames is not None:
        assert loader is not None
        loader.place(frames, target)
    else:
        sink(target)
    progress(len(sel))


class _ShareWriter:
    """One file of a checkpoint write, written chunk by chunk by whichever thread calls
    `step` (one at a time, in order: a lock holds the file's cursor).

    A background writer thread calls `step` until it returns False; a thread that
    rescues a starved write (`_SnapshotWrite.rescue`) may call it too, between two of
    the writer's chunks: the chunks still go to the file in order, each exactly once.
    For each chunk it gathers up to ``chunk_bytes`` of frozen pages into a reusable
    buffer with `mmm.Snapshot.copy_pages` (on local storage, pages lying in
    consecutive frames are written straight from the frames, `mmm.Snapshot.pages_view`),
    checksums them (one call without the GIL), hands the buffer to the stream (pyarrow
    releases the GIL while writing) and marks the pages persisted. The thread that
    writes the last chunk closes the file, checks its size and reports the outcome.
    """

    def __init__(self, w: _SnapshotWrite, k: int) -> None:
        self.w, self.k = w, k
        self.share = w.shares[k]
        self.relpath = w.relpath(k)
        self.lock = threading.Lock()
        self.pos = 0
        self.out: Any = None
        self.done = False
        self.sums = np.empty(len(self.share), dtype=np.uint64)
        pb = w.pb
        self.per = w.io._chunk_pages(pb)
        root = w.root
        self.where = f"checkpoint {w.label}: writing {self.relpath} on {root.backend} root {root.uri}"
        # Local writes copy the bytes into the kernel before returning, so pages in
        # consecutive frames are written straight from the (pinned) frames. Other
        # streams may keep a reference to a large buffer after write() returns
        # (S3 background uploads), so they get a private copy.
        self.view_pages = getattr(w.snap, "pages_view", None) if root.backend == "local" else None

    def step(self) -> bool:
        """Write this file's next chunk (opening the file first, closing it after the
        last); False once the file is done or failed (then reported to the write)."""
        self.w.note_thread()
        with self.lock:
            if self.done:
                return False
            try:
                more = self._step()
            except BaseException as exc:  # noqa: BLE001 - reported through the write
                self.done = True
                if self.out is not None:
                    _close_quietly(self.out)
                self.w.finished(self.k, exc)
                return False
            if not more:
                self.done = True
                self.w.finished(self.k, self.sums)
            return more

    def _step(self) -> bool:
        w, snap, pb, per = self.w, self.w.snap, self.w.pb, self.per
        if w.stop.is_set():
            raise _Stop()
        if self.out is None:
            faultpoints.reached("page_file")
            try:
                # a tagged file is the writer's own: never truncate what another wrote there
                self.out = w.root.open_output_stream(
                    self.relpath, exclusive="-" in self.relpath.rsplit("/", 1)[-1])
            except IOServiceError as exc:
                raise CheckpointWriteError(f"{self.where}: {exc}") from exc
        out, s = self.out, self.pos
        if s < len(self.share):
            try:
                part = self.share[s:s + per]
                pages = self.view_pages(part) if self.view_pages is not None else None
                if pages is None:  # the calling thread's reusable buffer
                    buf = w.io._buffer(per * pb).reshape(-1, pb)[:per]
                    pages = snap.copy_pages(part, out=buf)[:len(part)]
                self.sums[s:s + len(part)] = page_checksums(pages)
                if s == 0 and faultpoints.armed("mid_page"):
                    flat = pages.reshape(-1)
                    out.write(flat[:pb // 2])
                    out.flush()
                    faultpoints.reached("mid_page")
                    out.write(flat[pb // 2:])
                else:
                    out.write(pages)
            except (OSError, pa.ArrowException) as exc:
                raise CheckpointWriteError(f"{self.where}: {exc}") from exc
            snap.mark_persisted(part)
            self.pos = s + len(part)
            w.progress(len(part))
            return True
        try:
            out.close()
        except (OSError, pa.ArrowException) as exc:
            raise CheckpointWriteError(f"{self.where}: {exc}") from exc
        self.out = None
        try:
            w.root.sync(self.relpath)
            size = w.root.size_bytes(self.relpath)
        except IOServiceError as exc:
            raise CheckpointWriteError(f"{self.where}: {exc}") from exc
        if size != len(self.share) * pb:
            raise CheckpointWriteError(f"{self.where}: the file has {size} bytes after closing, "
                                       f"expected {len(self.share) * pb} (torn write)")
        return False


class _SnapshotWrite:
    """One `IOService.write_snapshot` call: its shares, their outcomes, and the result.

    The steps, each a method: `launch` starts one share's file (a `_ShareWriter`)
    on a background writer thread; `finished` collects a file's outcome (stopping
    the others on the first failure); `complete` builds the `WriteResult` once every
    share is done; `dispatch` hands the shares to a write scheduler instead of
    starting them all; `rescue` watches a write whose writers run at background
    priority and writes it on at normal priority while they are starved.
    """

    def __init__(self, io: IOService, root: StorageRoot, directory: str, snap: SnapshotLike,
                 idx: npt.NDArray[np.int64], label: str, on_progress: ProgressFn | None,
                 scheduler: WriteScheduler | None, file_tag: str | None) -> None:
        self.io, self.root, self.directory, self.snap = io, root, directory, snap
        self.label, self.on_progress, self.scheduler = label, on_progress, scheduler
        self.file_tag = file_tag
        pb = self.pb = snap.page_bytes
        if scheduler is not None and len(idx):
            n_files = -(-len(idx) // max(1, int(scheduler.chunk_bytes) // pb))
        else:
            n_files = min(io.n_workers, len(idx))
        self.n_files = n_files
        # as np.array_split (the first len % n shares one longer), without its overhead
        q, r = divmod(len(idx), n_files) if n_files else (0, 0)
        cuts = [k * q + min(k, r) for k in range(n_files + 1)]
        self.shares = [idx[cuts[k]:cuts[k + 1]] for k in range(n_files)]
        self.total = len(idx)
        self.result: cf.Future[WriteResult] = cf.Future()
        self.result.set_running_or_notify_cancel()
        self.start = time.perf_counter()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.done = [0, 0]  # finished workers, pages written
        self.outcomes: list[Any] = [None] * n_files
        self.errors: list[BaseException] = []
        self.launched = [False] * n_files
        self.first_start: list[float] = []
        self.sched = _SchedState()
        self.writers: list[_ShareWriter | None] = [None] * n_files
        self.rescued = 0  # chunks written by the rescuer
        self.threads: set[int] = set()  # native ids of the writer threads that took part
        self.boosted: set[int] = set()  # of them, those the rescuer raised to normal priority

    def relpath(self, k: int) -> str:
        return f"{self.directory}/{page_file_name(k, self.file_tag)}"

    def progress(self, n: int) -> None:
        with self.lock:
            self.done[1] += n
            now = self.done[1]
        if self.on_progress is not None:
            self.on_progress(now, self.total)

    def launch(self, k: int) -> bool:
        """Start share ``k`` unless it already started; False if it had."""
        writer = _ShareWriter(self, k)
        with self.lock:
            if self.launched[k]:
                return False
            self.launched[k] = True
            self.writers[k] = writer
            first = not self.first_start
            if first:
                self.first_start.append(time.perf_counter())
        if first and self.io.rescue_after_s is not None:  # (only for background writers)
            threading.Thread(target=self.rescue, name=f"sguard-io-rescue-{self.label}",
                             daemon=True).start()
        self.io._write_pool.submit(_write_all, writer)
        return True

    def note_thread(self) -> None:
        """Record the calling writer thread (the rescuer may raise its priority)."""
        tid = threading.get_native_id()
        if tid not in self.threads:
            with self.lock:
                self.threads.add(tid)

    def boost(self) -> None:
        """Raise the background writer threads of this write to normal priority where
        the system lets this process (a starved thread may hold the file's lock or the
        GIL: raising it is the one way to free them at once); `unboost` after."""
        me = threading.get_native_id()
        with self.lock:
            tids = self.threads - self.boosted - {me}
        for tid in tids:
            if _set_background(tid, False, 0):
                self.boosted.add(tid)

    def unboost(self) -> None:
        for tid in self.boosted:
            _set_background(tid, self.io.idle, self.io.nice)
        self.boosted.clear()

    def rescue(self) -> None:
        try:
            self._rescue()
        finally:
            self.unboost()

    def _rescue(self) -> None:
        """While the write lasts: every `IOService.rescue_after_s` with no page written,
        write on at this thread's (normal) priority, the launched files in order, a
        chunk at a time, until pages come from the writers again or the write is done.

        Background writers yield every core the operator wants, but on a machine
        saturated by other work they may get no CPU time for long, and one preempted
        inside a chunk holds the file's lock (and perhaps the GIL): on a stall this
        first raises the writer threads to normal priority where the system permits
        (`boost`; set back when the write ends), then writes on itself; a
        checkpoint keeps moving at normal threads' share of the CPU."""
        wait_s = self.io.rescue_after_s
        assert wait_s is not None
        seen = -1
        while not self.result.done() and not self.stop.is_set():
            with self.lock:
                now = self.done[1]
            if now != seen:
                seen = now
                time.sleep(wait_s)
                continue
            with self.lock:  # starved: the first launched file not yet done
                todo = [w for w in self.writers if w is not None and not w.done]
            if not todo:
                time.sleep(wait_s)
                continue
            self.boost()
            # a file no writer is in (a writer queued behind another's), else the first
            free = [w for w in todo if not w.lock.locked()]
            if (free or todo)[0].step():
                self.rescued += 1
            with self.lock:
                seen = self.done[1]  # our own chunk: help on only while nothing else moves

    def finished(self, k: int, outcome: npt.NDArray[np.uint64] | BaseException) -> None:
        exc = outcome if isinstance(outcome, BaseException) else None
        if exc is None:  # report before counting, so every report precedes the last
            for g in self.sched.chunk_done(k, self.n_files, self.label):
                self.launch(g.chunk_index)
        with self.lock:
            if exc is not None and not isinstance(exc, _Stop):
                self.errors.append(exc)
                self.stop.set()
            else:
                self.outcomes[k] = outcome if exc is None else None
            self.done[0] += 1
            if self.stop.is_set():  # chunks never granted will not start: count them now
                for j in range(self.n_files):
                    if not self.launched[j]:
                        self.launched[j] = True
                        self.done[0] += 1
            last = self.done[0] == self.n_files
        if last:
            self.complete()

    def complete(self) -> None:
        self.sched.finish()
        if self.errors:
            self.result.set_exception(self.errors[0])
            return
        pb, shares = self.pb, self.shares
        files = tuple(PageFile(self.relpath(k), len(shares[k]) * pb) for k in range(self.n_files))
        ids = np.concatenate([self.snap.page_ids[s] for s in shares])
        file_col = np.concatenate([np.full(len(s), k, np.uint32) for k, s in enumerate(shares)])
        offsets = np.concatenate([np.arange(len(s), dtype=np.uint64) * np.uint64(pb)
                                  for s in shares])
        table = PageTable.concat([PageTable(ids, file_col, offsets, np.concatenate(self.outcomes))])
        secs = time.perf_counter() - self.start
        nbytes = self.total * pb
        logger.debug("wrote %d pages (%d B) of %s in %.3f s", self.total, nbytes, self.label, secs)
        first = self.first_start[0] if self.first_start else self.start
        self.result.set_result(WriteResult(files, table, nbytes, secs, first - self.start,
                                           self.scheduler is not None, self.sched.fallback,
                                           tuple(self.sched.grants), self.rescued))

    def dispatch(self, haunit: str) -> None:
        """Start a dispatcher thread that launches each chunk when the scheduler grants it."""
        scheduler = self.scheduler
        assert scheduler is not None
        intent = WriteIntent(haunit, self.label, self.n_files,
                             max(1, int(scheduler.chunk_bytes) // self.pb) * self.pb,
                             self.total * self.pb)
        threading.Thread(target=_dispatch, name=f"sguard-sched-{self.label}", daemon=True,
                         args=(scheduler, intent, self.sched, self.launch, self.n_launched,
                               self.stop, self.n_files)).start()

    def n_launched(self) -> int:
        """Shares started so far (granted, or fallen back to unscheduled)."""
        with self.lock:
            return sum(self.launched)


def _set_background(tid: int, idle: bool, nice: int) -> bool:
    """Set thread `tid`'s policy: ``SCHED_IDLE`` (`idle`) or normal at `nice` (Linux;
    raising a priority needs the privilege or ``RLIMIT_NICE``). True if applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER,
                              os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:  # not permitted, or the thread is gone
        return False
    return True


def _write_all(writer: _ShareWriter) -> None:
    """A background writer thread's task: write a file to its end (`_ShareWriter`)."""
    while writer.step():
        pass


class _SchedState:
    """A scheduled write's grants, fallback reason and conversation (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ticket: ScheduledWrite | None = None
        self.grants: list[ChunkGrant] = []
        self.fallback: str | None = None
        self.closed = False

    def chunk_done(self, k: int, n_chunks: int, label: str) -> list[ChunkGrant]:
        """Report chunk ``k`` written; returns the valid grants the report brought (recorded)."""
        with self.lock:
            ticket = None if self.fallback is not None or self.closed else self.ticket
        if ticket is None:
            return []
        try:
            got = ticket.chunk_done(k) or ()
        except Exception as exc:  # noqa: BLE001 - the scheduler is advisory
            if self.fall_back(f"reporting chunk {k} failed: {exc!r}"):
                logger.warning("write scheduler unavailable (reporting chunk %d failed: %r); "
                               "writing the remaining chunks unscheduled", k, exc)
            return []
        return self.accept(got, n_chunks, label)

    def accept(self, grants: Sequence[ChunkGrant], n_chunks: int, label: str) -> list[ChunkGrant]:
        """Record the grants of known chunks (warning about others); returns them."""
        ok = []
        for g in grants:
            if 0 <= g.chunk_index < n_chunks:
                ok.append(g)
            else:
                logger.warning("checkpoint %s: scheduler granted unknown chunk %d", label,
                               g.chunk_index)
        with self.lock:
            self.grants.extend(ok)
        return ok

    def fall_back(self, why: str) -> bool:
        """Record the first fallback reason; True if this call recorded it."""
        with self.lock:
            if self.fallback is not None:
                return False
            self.fallback = why
            return True

    def finish(self) -> None:
        with self.lock:
            ticket, self.closed = self.ticket, True
        if ticket is not None:
            try:
                ticket.close()
            except Exception:  # noqa: BLE001
                pass


def _dispatch(scheduler: WriteScheduler, intent: WriteIntent, sched: _SchedState,
              launch: Callable[[int], bool], n_launched: Callable[[], int],
              stop: threading.Event, n_chunks: int) -> None:
    """Dispatcher thread of one scheduled write: start each chunk when granted.

    Never blocks the caller of `IOService.write_snapshot`. On any scheduler
    failure, a scheduler call silent for longer than its poll plus
    `WriteScheduler.timeout_s` (a watchdog thread notices even if the call
    never returns), or no grant for `WriteScheduler.max_wait_s`, every chunk
    not yet started starts now (unscheduled) and a warning is logged.
    """
    busy: list[float | None] = [None]  # monotonic start of the scheduler call in progress
    over = threading.Event()
    poll = max(0.01, min(1.0, float(scheduler.timeout_s)))

    def fall_back(why: str) -> None:
        if sched.fall_back(why):
            logger.warning("checkpoint %s: write scheduler unavailable (%s); writing %d of %d "
                           "chunks unscheduled", intent.name, why, n_chunks - n_launched(),
                           n_chunks)
        for k in range(n_chunks):
            launch(k)
        over.set()

    def watchdog() -> None:
        limit = poll + float(scheduler.timeout_s)
        while not over.wait(limit / 4):  # notices a hung call within 1.25 x limit
            since = busy[0]
            if since is not None and time.monotonic() - since > limit:
                fall_back(f"a scheduler call did not return within {limit:.2f} s")
                return

    threading.Thread(target=watchdog, name=f"sguard-sched-watchdog-{intent.name}",
                     daemon=True).start()
    try:
        _dispatch_loop(scheduler, intent, sched, launch, n_launched, stop, n_chunks, poll,
                       busy, fall_back, over)
    finally:
        over.set()


def _dispatch_loop(scheduler: WriteScheduler, intent: WriteIntent, sched: _SchedState,
                   launch: Callable[[int], bool], n_launched: Callable[[], int],
                   stop: threading.Event, n_chunks: int,
                   poll: float, busy: list[float | None],
                   fall_back: Callable[[str], None], over: threading.Event) -> None:
    t0 = time.monotonic()
    busy[0] = t0
    try:
        ticket = scheduler.begin(intent)
    except Exception as exc:  # noqa: BLE001 - the scheduler is advisory
        fall_back(f"submitting the checkpoint failed: {exc!r}")
        return
    finally:
        busy[0] = None
    with sched.lock:
        sched.ticket = ticket
        closed = sched.closed
    if closed:  # the watchdog fell back and every chunk finished meanwhile
        sched.finish()
        return
    while n_launched() < n_chunks and not stop.is_set() and not over.is_set():
        busy[0] = time.monotonic()
        try:
            grants = ticket.next_grants(poll)
        except Exception as exc:  # noqa: BLE001
            fall_back(f"waiting for grants failed: {exc!r}")
            return
        finally:
            busy[0] = None
        if over.is_set():
            return
        for g in sched.accept(grants, n_chunks, intent.name):
            launch(g.chunk_index)
        if sched.fallback is not None:  # reporting a chunk failed meanwhile
            fall_back(sched.fallback)
            return
        if n_launched() < n_chunks and time.monotonic() - t0 > scheduler.max_wait_s:
            fall_back(f"no grant for the remaining chunks within {scheduler.max_wait_s} s")
            return

def _verify(pages: npt.NDArray[np.uint8], page_ids: npt.NDArray[np.uint64],
            checksums: npt.NDArray[np.uint64], offsets: npt.NDArray[np.uint64], where: str) -> None:
    """Raise CheckpointDamagedError unless every page matches its checksum and PageID
    (one compiled call without the GIL, `ioservice._checksum.verify_rows`)."""
    n_bad, i, j = verify_rows(pages, checksums, page_ids, _PAGE_ID_AT)
    _raise_damage(pages, page_ids, offsets, n_bad, i, j, where)


def _raise_damage(pages: npt.NDArray[np.uint8], page_ids: npt.NDArray[np.uint64],
                  offsets: npt.NDArray[np.uint64], n_bad: int, i: int, j: int,
                  where: str) -> None:
    """Raise CheckpointDamagedError for a verification's outcome (`verify_rows`'s
    ``(rows failing their checksum, first such row, first row whose id differs)``)."""
    if n_bad:
        raise CheckpointDamagedError(
            f"{where}: page {int(page_ids[i]):#x} at offset {int(offsets[i])} fails its "
            f"xxh3_64 checksum ({n_bad} damaged page(s) in this chunk)")
    if j >= 0:
        hdr = int(pages[j, _PAGE_ID_AT:_PAGE_ID_AT + 8].copy().view("<u8")[0])
        raise CheckpointDamagedError(
            f"{where}: the page at offset {int(offsets[j])} has PageID "
            f"{hdr:#x} in its header, the manifest says {int(page_ids[j]):#x}")


def _close_quietly(out: Any) -> None:
    """Close a stream after a failure, ignoring errors."""
    try:
        out.close()
    except (OSError, pa.ArrowException):
        pass
