"""Background un-sharing of frozen pages right after a snapshot (the "precopy").

Page-granular copy-on-write done by the operator thread makes the first batches
after a checkpoint slow: every page they touch is still pinned, and each one is
cloned on the spot. `PageManager.chkpt` with ``precopy=True`` starts a
`Precopy` job instead: a background thread copies the snapshot's pinned pages,
most recently written first, into fresh frames ("shadows") with a compiled
``nogil`` kernel, in chunks, at memory bandwidth. The operator thread then
*adopts* ready shadows in bulk (`PageManager.adopt_precopied`): the page table
points to the shadow, the frozen frame becomes an orphan that the I/O thread
frees once it is written. A page the operator meets before its shadow is ready
is cloned as before.

Why a shadow is exact
---------------------
A shadow of snapshot page ``i`` (frozen frame ``F``) is adopted only when, at
adoption time, (a) the snapshot has not yet released page ``i`` (not marked
persisted, not completed, cancelled or released) and (b) the page table still
maps that page to ``F``. The job starts after the snapshot pinned ``F`` and the
copy starts after that, so by (a) ``F`` was pinned from before the copy began
until the adoption: the write barrier never writes a pinned frame in place and
a pinned frame is never freed, so ``F``'s bytes did not change and the shadow
equals them. By (b) those bytes are the live page's. The check and the switch
run on the operator thread, the only thread that writes pages or page tables;
a page the I/O thread releases right after the check is still correct (its
frame is orphaned and freed by `PagePool.orphan`'s own pin check).

Only the copier thread writes a shadow before it is published, and only the
operator thread once it is adopted; a shadow is published (under the job's
lock, after the kernel returned) only once all its bytes are copied.

Frames: the copier takes a chunk of frames only while the pool keeps enough
free frames for the operator to clone every page not yet copied, so it never
makes a mutation fail that would have succeeded without it.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from mmm._kernels.pages import precopy_frames
from mmm.errors import PoolExhaustedError
from mmm.page import HEADER_BYTES, HEADER_DTYPE
from mmm.pool import LIVE
from mmm.snapshot import Snapshot, SnapshotState

__all__ = ["Precopy", "CHUNK_BYTES"]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Bytes copied per kernel call (between two publications)."""

_VERSION_AT: int = HEADER_DTYPE.fields["version"][1]  # type: ignore[index]


def copy_frames(frames: npt.NDArray[np.uint8], src: npt.NDArray[np.int64],
                dst: npt.NDArray[np.int64]) -> None:
    """Copy frozen frames into shadows without the GIL; a shadow's header version is 0
    until it is adopted (`mmm._kernels.pages.precopy_frames`)."""
    precopy_frames(frames, src, dst, HEADER_BYTES, _VERSION_AT)

_executor: cf.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_jobs: "weakref.WeakSet[Precopy]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's threads: a new copier thread for new
    jobs, and every job already started is over (its copy in flight, if any, is lost:
    those frames stay allocated, as a crashed clone's would)."""
    global _executor, _executor_lock
    _executor = None
    _executor_lock = threading.Lock()
    for job in list(_jobs):
        job._lock = threading.Lock()
        job._stop = True
        job._outstanding -= job._inflight
        job._inflight = 0
        job.done.set()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _pool() -> cf.ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = cf.ThreadPoolExecutor(1, thread_name_prefix="mmm-precopy")
        return _executor


class Precopy:
    """One background copy job for one snapshot (created by `PageManager.chkpt`).

    Attributes
    ----------
    copied : int
        Pages copied into shadows so far.
    adopted : int
        Shadows the operator adopted.
    discarded : int
        Shadows freed unused (the page was written, cloned or released first).
    """

    def __init__(self, pm: Any, snap: Snapshot, mods: npt.NDArray[np.int64]) -> None:
        self._pm = pm
        self.snap = snap
        self._mods = mods
        self._lock = threading.Lock()
        self._pending: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = []
        self._outstanding = 0  # frames held by the job (copying or published), not adopted
        self._inflight = 0  # of them, frames being copied (not yet published)
        self._stop = False
        self.copied = 0
        self.adopted = 0
        self.discarded = 0
        self.copy_s = 0.0
        # operator-thread side: the shadow frame of each snapshot page, -1 if none ready
        self.shadow_of = np.full(len(snap), -1, dtype=np.int64)
        self.n_ready = 0
        self.done = threading.Event()
        _jobs.add(self)
        _pool().submit(self._run)

    # -- copier thread ------------------------------------------------------------------
    def _order(self) -> npt.NDArray[np.int64]:
        """Snapshot page indices to copy: most recently written first (hottest first)."""
        return np.argsort(-self._mods, kind="stable")

    def _run(self) -> None:
        try:
            self._copy_all()
        except BaseException:  # noqa: BLE001 - the operator then clones pages itself
            logger.exception("background copy of snapshot %d failed", self.snap.snapshot_id)
        finally:
            self.done.set()

    def _copy_all(self) -> None:
        snap, pool = self.snap, self._pm.pool
        order = self._order()
        per = max(1, CHUNK_BYTES // snap.page_bytes)
        t0 = time.perf_counter()
        for s in range(0, len(order), per):
            if self._stop or snap.state is not SnapshotState.ACTIVE:
                break
            idx = order[s:s + per]
            src = snap._frames[idx]
            # racy filters (checked again at adoption): still pinned by the snapshot and
            # not yet replaced by a clone
            keep = ~snap._persisted[idx] & (pool.state[src] == LIVE)
            idx, src = idx[keep], src[keep]
            if not len(idx):
                continue
            remaining = len(order) - s
            if pool.free_frames < len(idx) + remaining + 16:
                break  # leave the frames to the operator's own clones
            try:
                dst = pool.allocate(len(idx), zero=False)
            except PoolExhaustedError:
                break
            with self._lock:
                self._outstanding += len(dst)
                self._inflight = len(dst)
            try:
                copy_frames(pool.frames, src, dst)
            except BaseException:
                pool.free(dst)
                with self._lock:
                    self._outstanding -= len(dst)
                    self._inflight = 0
                raise
            with self._lock:
                self._inflight = 0
                self._pending.append((idx, dst))
                self.copied += len(dst)
        self.copy_s = time.perf_counter() - t0

    # -- operator thread ------------------------------------------------------------------
    def take(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Pop the published shadows: ``(snapshot page indices, shadow frames)``."""
        with self._lock:
            chunks, self._pending = self._pending, []
        if not chunks:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if len(chunks) == 1:
            return chunks[0]
        return (np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks]))

    def drain(self) -> None:
        """Move published shadows into `shadow_of` (operator thread)."""
        idx, dst = self.take()
        if len(idx):
            self.shadow_of[idx] = dst
            self.n_ready += len(idx)

    def span(self, psid: int) -> tuple[int, int]:
        """Snapshot page indices ``[lo, hi)`` of page set ``psid`` (page_ids are sorted)."""
        ids = self.snap.page_ids
        lo = int(np.searchsorted(ids, np.uint64(psid) << np.uint64(32)))
        hi = int(np.searchsorted(ids, np.uint64(psid + 1) << np.uint64(32)))
        return lo, hi

    def indices(self, psid: int, seqs: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Snapshot page indices of pages ``seqs`` of ``psid`` that have a ready shadow."""
        ids = self.snap.page_ids
        want = (np.uint64(psid) << np.uint64(32)) | seqs.astype(np.uint64)
        i: npt.NDArray[np.int64] = np.minimum(np.searchsorted(ids, want), len(ids) - 1)
        i = i[ids[i] == want]
        out: npt.NDArray[np.int64] = i[self.shadow_of[i] >= 0]
        return out

    def settled(self, n: int) -> None:
        """``n`` shadows left the job (adopted or freed)."""
        with self._lock:
            self._outstanding -= n

    @property
    def outstanding(self) -> int:
        """Frames the job holds that no page table references (for `PageManager._check`)."""
        with self._lock:
            return self._outstanding

    @property
    def finished(self) -> bool:
        """The copier stopped and every shadow it made was adopted or freed."""
        return self.done.is_set() and self.outstanding == 0

    def stop(self, wait: bool = True) -> None:
        """Ask the copier to stop after its current chunk (and wait for it)."""
        self._stop = True
        if wait:
            self.done.wait()

    def stats(self) -> dict[str, Any]:
        return {"copied": self.copied, "adopted": self.adopted, "discarded": self.discarded,
                "copy_s": self.copy_s}
