"""Versions of a partition's state by (batch id, partition), and rollback.

A partition about to apply batch ``b`` must hold exactly the state after
``b - 1``. Spark replays at most the last uncommitted batch, with the same id
and rows, and a retried task sees whatever the failed attempt wrote, so the
runtime keeps one rollback point: before applying ``b`` it takes an mmm
copy-on-write snapshot ("after b-1", O(pages), no bytes copied) and records
its page table in the partition's ``base.npy``; the batch's writes go to
clones of the pages it touches. Then:

* the same process rolls back in memory (`mmm.PageManager.rollback`): the page
  table points at the frozen frames again, the clones are freed, O(pages
  touched) work plus an O(pages) table copy;
* another process (the failed one died, or Spark gave the retry to another
  worker) rolls back in the pool *file* before attaching it (`attach_at`):
  the recorded frames become the live ones and every other frame is freed.
  The frozen frames are intact because a snapshot's frames are never written
  in place and are only freed when the snapshot is released, which happens
  only once the next batch arrives (that is, once ``b`` is committed).

`decide` turns the marker left by the previous writer and the batch to apply
into one of the actions of `Action`.
"""
from __future__ import annotations

import enum
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from mmm import PageManager, PagePool
from mmm.page import PAGE_MAGIC
from mmm.pool import FREE, LIVE
from mmm.poolfile import mapped_n_frames, populate_frame_headers
from sguard.spark.placement import Marker, boot_id

__all__ = ["Action", "Decision", "decide", "attach_at", "forget_mappings", "LocalStateDamaged"]


class Action(enum.Enum):
    USE_CACHED = "cached"          # this process wrote last: its pages are the state after b-1
    ATTACH = "attached"            # another process wrote last; its state is after b-1
    ROLLBACK_CACHED = "rolled_back"   # b was (partly) applied here: roll back in memory
    ROLLBACK_FILE = "rolled_back_file"  # b was (partly) applied by another process
    RESTORE = "restored"           # no usable local state: DFS checkpoint plus input log
    FRESH = "fresh"                # the first batch of a new state: nothing to restore


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


class LocalStateDamaged(Exception):
    """The local pool or rollback point is not what the marker says (restore from the DFS)."""


def decide(marker: Marker | None, batch: int, cached_token: str | None, has_pool: bool,
           cached_can_rollback: bool) -> Decision:
    """What to do before applying `batch`, given the partition's local marker.

    ``cached_token`` is the token of the marker this process last wrote (None
    when it holds no state for the partition); ``cached_can_rollback`` whether
    it still holds its in-memory rollback snapshot.
    """
    if marker is None or not has_pool:
        return Decision(Action.RESTORE, "no local state")
    if marker.boot_id != boot_id():
        return Decision(Action.RESTORE, "local state from before a reboot")
    mine = cached_token is not None and cached_token == marker.token
    if marker.status == "applied" and marker.batch == batch - 1:
        return Decision(Action.USE_CACHED if mine else Action.ATTACH,
                        f"local state is after batch {batch - 1}")
    if marker.batch == batch and marker.status in ("applied", "applying"):
        if marker.base_batch != batch - 1:
            return Decision(Action.RESTORE, f"batch {batch} was {marker.status} but the rollback "
                                            f"point is after {marker.base_batch}")
        how = "wholly" if marker.status == "applied" else "partly"
        if mine and cached_can_rollback:
            return Decision(Action.ROLLBACK_CACHED, f"batch {batch} was {how} applied here")
        return Decision(Action.ROLLBACK_FILE, f"batch {batch} was {how} applied by another attempt")
    return Decision(Action.RESTORE, f"local state is at batch {marker.batch} ({marker.status}), "
                                    f"stale for batch {batch}")


class _RollbackPool(PagePool):
    """A pool attach that first makes exactly the given frames the live ones.

    With a rollback point (``_keep``: its page ids and frames), every other used
    frame (the pages the interrupted batch cloned or allocated) is dropped: its
    header's magic is cleared and it becomes FREE; without one, the ORPHAN
    frames a dead snapshot left are freed by `PagePool._rebuild_allocation`.
    Nothing else is written: dropped frames keep their bytes, and
    `PagePool.attach` treats every frame of an attached file as possibly dirty,
    so ``allocate(zero=True)`` zeroes whatever it hands out (a clone or a loaded
    page is overwritten whole). The work is O(frames) over the one-byte state
    table plus one header field per dropped frame; no page bytes are touched.

    A worker keeps its shared mapping of each pool file it attached (`_MAPS`,
    keyed by path and checked against the file's device, inode and size), so
    getting a partition back costs no ``mmap`` and no page faults on the frames
    it touched before: under Spark's ``local[2]`` partitions alternate between
    the two Python workers every batch.
    """

    _keep: tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]] | None = None
    _fresh_map = False
    _copy_on_write = False

    def _open_file(self, path: str) -> Any:
        """The process's existing shared mapping of `path` when it still maps this very
        file (same device, inode and size), else a new one (validated by `PagePool`);
        with ``_copy_on_write`` a private mapping of its own, never kept."""
        if self._copy_on_write:
            super()._open_file(path)  # validates the file
            return np.memmap(path, dtype=np.uint8, mode="c", shape=(os.path.getsize(path),))
        try:
            st = os.stat(path)
        except OSError:
            st = None
        with _MAPS_LOCK:
            _sweep_locked()
            hit = _MAPS.get(path)
            if st is not None and hit is not None and hit[0] == (st.st_dev, st.st_ino,
                                                                 st.st_size):
                raw = hit[1]
                n_frames = mapped_n_frames(raw, self.page_bytes)
                if n_frames is not None:
                    self.n_frames = n_frames
                    self._fresh_map = False
                    return raw
            raw = super()._open_file(path)
            self._fresh_map = True
            if st is not None:
                _MAPS[path] = ((st.st_dev, st.st_ino, st.st_size), raw)
            return raw

    def _rebuild_allocation(self) -> None:
        if self._fresh_map:
            _populate(self)
        if self._keep is not None:
            h = self.headers
            page_ids, frames = self._keep
            if len(frames) and (frames.min() < 0 or frames.max() >= self.n_frames):
                raise LocalStateDamaged("rollback point names frames outside the pool")
            if not (np.all(h["magic"][frames] == PAGE_MAGIC)
                    and np.array_equal(h["page_id"][frames], page_ids)):
                raise LocalStateDamaged("rollback point's frames no longer hold its pages")
            keep = np.zeros(self.n_frames, dtype=bool)
            keep[frames] = True
            drop = np.flatnonzero((self.state != FREE) & ~keep)
            h["magic"][drop] = 0
            self.state[drop] = FREE
            self.state[frames] = LIVE
        super()._rebuild_allocation()


# path -> ((st_dev, st_ino, st_size), the shared mapping): a worker that gets a partition
# back keeps its page-table entries for the frames it touched before (no page faults, no mmap)
_MAPS: dict[str, tuple[tuple[int, int, int], Any]] = {}
_MAPS_LOCK = threading.Lock()


def _sweep_locked() -> None:
    """Forget mappings of files that were deleted or replaced (their memory is freed once
    no page manager maps them)."""
    for p, (ident, _raw) in list(_MAPS.items()):
        try:
            st = os.stat(p)
        except OSError:
            del _MAPS[p]
            continue
        if (st.st_dev, st.st_ino, st.st_size) != ident:
            del _MAPS[p]


def _populate(pool: PagePool) -> None:
    """Map the header page of every used frame of a freshly mapped pool file up front
    (`mmm.poolfile.populate_frame_headers`): cheaper than the page fault the attach would
    take on each."""
    populate_frame_headers(pool, np.flatnonzero(pool.state))


def forget_mappings() -> None:
    """Drop the cached mappings (the next attach maps the file afresh, as a new process)."""
    with _MAPS_LOCK:
        _MAPS.clear()


def attach_at(path: str, page_bytes: int,
              base: tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]] | None, *,
              copy_on_write: bool = False) -> PageManager:
    """Attach the pool file at `path`; with `base`, roll it back to that page table first.

    With `copy_on_write` the file is mapped privately: the rollback and every later
    write stay in this process's memory and the file is left exactly as it was (for a
    reader of another process's live state).

    Raises
    ------
    LocalStateDamaged
        If the rollback point does not match the file.
    mmm.PoolFileError
        If the file is not a pool of `page_bytes` pages.
    """
    pool: Any = _RollbackPool.__new__(_RollbackPool)
    pool._keep = base
    pool._copy_on_write = copy_on_write
    PagePool.__init__(pool, page_bytes, 0, path, _attach=True)
    return PageManager(_pool=pool)
