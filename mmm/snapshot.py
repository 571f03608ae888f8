"""Copy-on-write snapshots: the "checkpoint request" of the paper (§4.4).

`PageManager.chkpt` freezes pages by *pinning* their frames: it copies the
page table of each chosen page set (O(pages), independent of the bytes) and
returns a `Snapshot`. While a frame is pinned the operator never writes it:
the write barrier (`PageManager.writable`) clones it first. I/O threads read
the pinned frames and call `Snapshot.mark_persisted`, which unpins them:
unchanged pages become writable in place again, replaced ones are freed.

Staging (copy-out) takes the operator thread off the copy path: right after
the freeze, `plan_staging` names the pages a checkpoint will write, and a
background thread (`stage_planned`) copies them, chunk by chunk and without the
GIL, into a buffer the snapshot owns, then unpins their frames at once. The
operator then writes those pages in place: it clones only the pages it meets
before the copier got to them. Readers (`page`, `pages_view`, `copy_pages`)
read a staged page from the buffer, and wait for a planned page until it is
staged; so no reader ever holds a frame the copier may unpin. A staged page is
no longer a rollback point.

In-place snapshots (``PageManager.chkpt(in_place=True)``, what a checkpoint
writer takes): the frames are pinned softly, so the compiled kernels update a
record of such a frame in place after logging its old bytes (`mmm.pool`'s undo
log) instead of cloning the whole page. The readers copy a frame and then lay
the before-images logged since the freeze over the copy (`apply_undo`), so they
see the frozen bytes; `page` returns such a copy and `pages_view` declines
unstaged pages. An in-place snapshot is not a rollback point.

Lifecycle (`SnapshotState`): ACTIVE -> COMPLETED (`complete`: the checkpoint
is durable, e.g. its manifest is written; pages not yet marked persisted, such
as unchanged pages an incremental checkpoint references, are unpinned), CANCELLED (`cancel`: a failed checkpoint), RELEASED
(`release`, or consumed by `PageManager.rollback`). Only a COMPLETED snapshot
advances the base that later snapshots' ``changed`` flags are relative to, so
the pages of a cancelled checkpoint are written by the next one. A snapshot that is not ACTIVE refuses further use.
"""
from __future__ import annotations

import enum
import threading
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from mmm._kernels.pages import apply_undo, gather_frames
from mmm.errors import SnapshotStateError
from mmm.pool import HARD_PIN, PagePool

__all__ = ["Snapshot", "SnapshotState", "SnapshotOwner"]

SnapshotState = enum.Enum("SnapshotState", "ACTIVE COMPLETED CANCELLED RELEASED")

STAGE_CHUNK_BYTES = 1 << 20
"""Bytes `Snapshot.stage_planned` copies per kernel call (between two unpinnings)."""


class SnapshotOwner(Protocol):
    """What a snapshot needs from the page manager that took it (`mmm.PageManager`).

    The dependency is one way: the manager imports this module, never the reverse.
    """

    page_bytes: int
    pool: PagePool

    def _snapshot_done(self, snap: "Snapshot") -> None:
        """Called once when the snapshot leaves the ACTIVE state."""

    def _stage_buffer(self, rows: int) -> npt.NDArray[np.uint8]:
        """A ``(>= rows, page_bytes)`` buffer for staged pages (a spare one when it has one)."""

    def _stage_buffer_done(self, buf: npt.NDArray[np.uint8]) -> None:
        """Take back a staging buffer no snapshot uses any more (to reuse it)."""


class Snapshot:
    """A frozen, consistent set of pages of one page manager.

    Attributes
    ----------
    snapshot_id : int
        Increasing per page manager.
    page_bytes : int
        Size of every page.
    page_ids : ndarray of uint64
        PageID of each frozen page (super pages included), sorted.
    changed : ndarray of bool
        True where the page changed since the previous completed snapshot of
        its page set (or was never in one): what an incremental checkpoint writes.
    psids : tuple of int
        The page sets the snapshot covers.
    structures : dict
        ``name -> psid`` of the structures it covers.
    in_place : bool
        Whether kernels may update its frames in place through the undo log
        (module docstring); the frames are then pinned with weight 1, else
        `mmm.pool.HARD_PIN`.
    """

    def __init__(self, pm: SnapshotOwner, snapshot_id: int, psids: tuple[int, ...],
                 page_ids: npt.NDArray[np.uint64], frames: npt.NDArray[np.int64],
                 changed: npt.NDArray[np.bool_], structures: dict[str, int],
                 in_place: bool = False, log_start: int = 0) -> None:
        self._pm = pm
        self.in_place = in_place
        self._weight = 1 if in_place else HARD_PIN
        self._log0 = log_start  # the undo log's entries from here on are this snapshot's
        self.snapshot_id = snapshot_id
        self.page_bytes = pm.page_bytes
        self.psids = psids
        self.page_ids = page_ids
        self._frames = frames
        self.changed = changed
        self.structures = structures
        self.covers_all = False
        self._persisted = np.zeros(len(page_ids), dtype=bool)
        self._n_persisted = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # staging: the buffer row of each staged page (-1: read its frame), the pages a
        # stager will copy (readers wait for them), the plan in order, rows handed out
        self._row = np.full(len(page_ids), -1, dtype=np.int64)
        self._planned = np.zeros(len(page_ids), dtype=bool)
        self._plan = np.zeros(0, dtype=np.int64)
        self._staged: npt.NDArray[np.uint8] | None = None
        self._n_staged = 0
        self.state = SnapshotState.ACTIVE

    # -- introspection --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.page_ids)

    @property
    def frames(self) -> npt.NDArray[np.int64]:
        """Frame of each frozen page, aligned with `page_ids` (a read-only view).

        Together with `page_ids` this is the snapshot's page table: what a rollback
        point records to find its pages in a pool file again (`PageManager.rollback`
        in memory). The frames hold the frozen bytes while the snapshot is ACTIVE and
        not `in_place`; staged pages' frames may already be reused (`n_staged`).
        """
        view = self._frames.view()
        view.flags.writeable = False
        return view

    @property
    def nbytes(self) -> int:
        """Bytes of all frozen pages."""
        return len(self.page_ids) * self.page_bytes

    @property
    def n_changed(self) -> int:
        """Pages an incremental checkpoint must write."""
        return int(np.count_nonzero(self.changed))

    @property
    def persisted(self) -> npt.NDArray[np.bool_]:
        """Copy of the per-page persisted flags."""
        with self._lock:
            return self._persisted.copy()

    @property
    def n_staged(self) -> int:
        """Pages copied out by `stage_planned` (their frames unpinned)."""
        return self._n_staged

    def __repr__(self) -> str:
        return (f"<Snapshot {self.snapshot_id} {self.state.name} pages={len(self)} "
                f"changed={self.n_changed} persisted={self._n_persisted} "
                f"staged={self._n_staged}>")

    def _require_active(self, what: str) -> None:
        if self.state is not SnapshotState.ACTIVE:
            raise SnapshotStateError(
                f"snapshot {self.snapshot_id} is {self.state.name}: cannot {what}")

    # -- reading frozen pages (any thread) -------------------------------------------
    def page(self, i: int) -> npt.NDArray[np.uint8]:
        """Read-only view of frozen page ``i`` (valid until it is marked persisted).

        Raises
        ------
        SnapshotStateError
            If the snapshot is not ACTIVE or the page was already persisted
            (its frame may have been reused).
        """
        self._require_active(f"read page {i}")
        self._wait_staged(np.array([i], dtype=np.int64))
        if self._persisted[i]:
            raise SnapshotStateError(
                f"snapshot {self.snapshot_id}: page {int(self.page_ids[i]):#x} was already "
                f"persisted and released")
        row = int(self._row[i])
        if row >= 0 and self._staged is not None:
            src = self._staged[row]
        elif self.in_place:
            src = self.copy_pages([i])[0]
        else:
            src = self._pm.pool.frames[self._frames[i]]
        view: npt.NDArray[np.uint8] = src.view()
        view.flags.writeable = False
        return view

    def pages_view(self, indices: npt.ArrayLike) -> npt.NDArray[np.uint8] | None:
        """Read-only ``(n, page_bytes)`` view of frozen pages ``indices`` when their
        frames are consecutive in the pool, else None (then use `copy_pages`).

        Lets an I/O thread hand pages to a synchronous write without gathering
        them first. The view is valid until the pages are marked persisted
        (their frames may then be written or reused). Pages copied: 0.

        Raises
        ------
        SnapshotStateError
            As `page`.
        """
        self._require_active("view pages")
        idx = np.asarray(indices, dtype=np.int64)
        if not len(idx):
            return None
        self._wait_staged(idx)
        self._check_unpersisted(idx)
        rows = self._row[idx]
        if rows[0] >= 0 and self._staged is not None:  # staged: consecutive rows?
            src, fr = self._staged, rows
            if (rows < 0).any():
                return None
        else:
            src, fr = self._pm.pool.frames, self._frames[idx]
            if (rows >= 0).any() or self.in_place:  # in place: frames may change
                return None
        f0 = int(fr[0])
        if int(fr[-1]) - f0 != len(fr) - 1 or (len(fr) > 2 and not np.all(np.diff(fr) == 1)):
            return None
        view: npt.NDArray[np.uint8] = src[f0:f0 + len(fr)].view()
        view.flags.writeable = False
        return view

    def copy_pages(self, indices: npt.ArrayLike, out: npt.NDArray[np.uint8] | None = None
                   ) -> npt.NDArray[np.uint8]:
        """Gather frozen pages ``indices`` into one contiguous ``(n, page_bytes)`` buffer.

        This is the I/O threads' way to turn scattered pages into one large
        sequential write. Pages copied: ``len(indices)``.

        Raises
        ------
        SnapshotStateError
            As `page`.
        """
        self._require_active("copy pages")
        idx = np.asarray(indices, dtype=np.int64)
        self._wait_staged(idx)
        self._check_unpersisted(idx)
        if out is None:
            out = np.empty((len(idx), self.page_bytes), dtype=np.uint8)
        rows = self._row[idx]
        staged = rows >= 0
        # compiled gathers that hold no GIL: the operator thread runs while an I/O
        # thread copies (numpy's fancy indexing would hold it for the whole copy)
        if not staged.any():
            gather_frames(self._pm.pool.frames, self._frames[idx], out,
                          np.arange(len(idx), dtype=np.int64))
        else:
            assert self._staged is not None
            dst = np.arange(len(idx), dtype=np.int64)
            gather_frames(self._staged, rows[staged], out, dst[staged])
            gather_frames(self._pm.pool.frames, self._frames[idx[~staged]], out, dst[~staged])
        if self.in_place and not staged.all():
            self._undo(self._frames[idx], out, np.arange(len(idx), dtype=np.int64))
        return out

    def _undo(self, frames: npt.NDArray[np.int64], out: npt.NDArray[np.uint8],
              rows: npt.NDArray[np.int64]) -> None:
        """Lay the before-images logged since the freeze over ``out[rows]``, copies of
        ``frames`` made before this call."""
        pool = self._pm.pool
        if pool.undo[0] > self._log0:
            apply_undo(pool.undo, pool.undo_data, self._log0, frames,
                       np.argsort(frames, kind="stable"), out, rows)

    def _check_unpersisted(self, idx: npt.NDArray[np.int64]) -> None:
        if self._persisted[idx].any():
            bad = idx[self._persisted[idx]][0]
            raise SnapshotStateError(
                f"snapshot {self.snapshot_id}: page {int(self.page_ids[bad]):#x} was already "
                f"persisted and released")

    # -- staging (copy-out; see the module docstring) -------------------------------------
    def plan_staging(self, indices: npt.ArrayLike) -> int:
        """Announce that `stage_planned` will copy pages ``indices`` out (in this order).

        Call it before any reader can read those pages (e.g. before handing the
        snapshot to I/O threads), then run `stage_planned` (in a background
        thread): from now on a reader of a planned page waits until it is staged
        (or the stager gave up on it). Pages already persisted, staged or planned
        are left out. Returns the number of pages planned. Pages copied: 0.

        Raises
        ------
        SnapshotStateError
            If the snapshot is not ACTIVE.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        with self._lock:
            self._require_active("plan staging")
            fresh = ~self._persisted[idx] & (self._row[idx] < 0) & ~self._planned[idx]
            idx = idx[fresh]
            _, first = np.unique(idx, return_index=True)
            idx = idx[np.sort(first)]
            self._planned[idx] = True
            self._plan = np.concatenate([self._plan, idx])
            return len(idx)

    def stage_planned(self, chunk_bytes: int | None = None) -> int:
        """Copy the planned pages into the snapshot's buffer and unpin their frames.

        Any thread (one at a time); the copy of each chunk of ``chunk_bytes``
        (default `STAGE_CHUNK_BYTES`) holds no GIL, and the chunk's frames are unpinned (the operator may
        write them in place again) as soon as it is copied. Stops early, leaving
        the rest to be read from their (still pinned) frames, when the snapshot
        leaves the ACTIVE state or on any error. Returns the pages staged.
        Extra memory: the staged pages' bytes, until the snapshot is finished.
        """
        with self._lock:
            plan, self._plan = self._plan, np.zeros(0, dtype=np.int64)
            if self._staged is None and len(plan):
                # one row per page of the snapshot at most: untouched rows cost no memory;
                # the page manager's spare one has its memory mapped already (no page faults)
                self._staged = self._pm._stage_buffer(len(self.page_ids))
            buf = self._staged
            start = self._n_staged
        per = max(1, (chunk_bytes or STAGE_CHUNK_BYTES) // self.page_bytes)
        done = 0
        try:
            for s in range(0, len(plan), per):
                part = plan[s:s + per]
                rows = np.arange(start + done, start + done + len(part), dtype=np.int64)
                gather_frames(self._pm.pool.frames, self._frames[part], buf, rows)
                if self.in_place and buf is not None:  # before the frames are unpinned
                    self._undo(self._frames[part], buf, rows)  # (module docstring)
                with self._cond:
                    if self.state is not SnapshotState.ACTIVE:
                        break
                    self._row[part] = rows
                    self._planned[part] = False
                    self._n_staged += len(part)
                    self._pm.pool.unpin(self._frames[part], self._weight)
                    self._cond.notify_all()
                done += len(part)
        finally:
            with self._cond:  # whatever was not staged is read from its frame
                self._planned[plan] = False
                self._cond.notify_all()
        return done

    def _wait_staged(self, idx: npt.NDArray[np.int64]) -> None:
        if not self._planned[idx].any():
            return
        with self._cond:
            while self.state is SnapshotState.ACTIVE and self._planned[idx].any():
                self._cond.wait()
            self._require_active("read pages")

    # -- lifecycle ----------------------------------------------------------------------
    def mark_persisted(self, indices: npt.ArrayLike) -> None:
        """Record that pages ``indices`` are durable: unpin them (thread-safe).

        The operator may then write those pages in place again; frames that
        only this snapshot still held are freed. The snapshot stays ACTIVE
        until `complete` (or `cancel`): only a completed snapshot becomes the
        base of the next snapshot's ``changed`` flags.
        """
        idx = np.unique(np.asarray(indices, dtype=np.int64))
        with self._lock:
            self._require_active("mark pages persisted")
            idx = idx[~self._persisted[idx]]
            self._persisted[idx] = True
            self._n_persisted += len(idx)
            self._pm.pool.unpin(self._frames[idx[self._row[idx] < 0]],  # staged: unpinned
                                self._weight)

    def complete(self) -> None:
        """Declare the snapshot durable (e.g. an incremental checkpoint that
        references unchanged pages written earlier): unpin the rest."""
        with self._lock:
            self._require_active("complete")
            self._unpin_rest()
            self._finish(SnapshotState.COMPLETED)

    def cancel(self) -> None:
        """Abandon a failed checkpoint: unpin every page. The pages it would have
        written stay "changed" for the next snapshot."""
        with self._lock:
            self._require_active("cancel")
            self._unpin_rest()
            self._finish(SnapshotState.CANCELLED)

    def release(self) -> None:
        """Drop a snapshot kept only as a rollback point. Idempotent."""
        with self._lock:
            if self.state is not SnapshotState.ACTIVE:
                return
            self._unpin_rest()
            self._finish(SnapshotState.RELEASED)

    def _unpin_rest(self) -> None:
        rest = np.flatnonzero(~self._persisted)
        self._persisted[rest] = True
        self._n_persisted = len(self.page_ids)
        self._pm.pool.unpin(self._frames[rest[self._row[rest] < 0]], self._weight)

    def _finish(self, state: Any) -> None:
        self.state = state
        buf, self._staged = self._staged, None
        self._cond.notify_all()
        self._pm._snapshot_done(self)
        if buf is not None and state is SnapshotState.COMPLETED:
            # every write read its pages before the checkpoint completed; after a
            # cancel a failed write may still be reading, so that buffer is dropped
            self._pm._stage_buffer_done(buf)
