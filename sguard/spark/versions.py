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
  worker) rolls back in the pool *file* while attaching it (`attach_at`, through
  `mmm.PagePool.attach`'s ``rollback_to``): the recorded frames become the live
  ones and every other frame is freed. Only the one-byte state table is written;
  dropped frames keep their bytes and the pool zeroes whatever it hands out later.
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

from mmm import PageManager, PagePool, RollbackPointError
from mmm.poolfile import mapped_n_frames
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


def _mapping(path: str, page_bytes: int, copy_on_write: bool) -> tuple[Any, bool]:
    """A mapping of the pool file at `path` to attach through and whether it is new.

    The process's kept shared mapping of `path` when it still maps this very file (same
    device, inode and size) and a pool of `page_bytes` pages, else a new one
    (`PagePool.map_file`), kept for the next attach; with `copy_on_write` a private
    mapping of its own, never kept (and never populated: a reader touches few frames).

    A worker keeps its shared mapping of each pool file it attached, so getting a
    partition back costs no ``mmap`` and no page faults on the frames it touched
    before: under Spark's ``local[2]`` partitions alternate between the two Python
    workers every batch. A new mapping has the header page of every used frame
    populated by the attach (cheaper than a page fault on each).

    Raises
    ------
    mmm.PoolFileError
        If the file is not a pool of `page_bytes` pages.
    """
    if copy_on_write:
        return PagePool.map_file(path, page_bytes, private=True), False
    try:
        st = os.stat(path)
    except OSError:
        st = None
    with _MAPS_LOCK:
        _sweep_locked()
        hit = _MAPS.get(path)
        if (st is not None and hit is not None
                and hit[0] == (st.st_dev, st.st_ino, st.st_size)
                and mapped_n_frames(hit[1], page_bytes) is not None):
            return hit[1], False
        raw = PagePool.map_file(path, page_bytes)
        if st is not None:
            _MAPS[path] = ((st.st_dev, st.st_ino, st.st_size), raw)
        return raw, True


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
    raw, fresh = _mapping(path, page_bytes, copy_on_write)
    try:
        pool = PagePool.attach(path, page_bytes, mapping=raw, rollback_to=base, populate=fresh)
    except RollbackPointError as exc:
        raise LocalStateDamaged(str(exc)) from None
    return PageManager.over(pool)
