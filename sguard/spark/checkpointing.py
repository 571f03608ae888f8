"""Asynchronous, incremental, policy-driven checkpoints of one partition's state.

Each partition is one HA unit (`sguard.statelayout.haunit_name`) checkpointed
through `ioservice.CheckpointManager` to the state URI. A checkpoint is taken
at the *start* of batch ``b``, of the state after ``b - 1``: the arrival of
``b`` proves that Spark committed ``b - 1``, so a durable checkpoint never
holds a batch Spark could still replay, and the manifest's ``batch_id`` is
exact. Only the prepare step (an mmm snapshot: O(pages), no bytes copied) runs
on the batch's critical path; pages are written by I/O threads while the
batch proceeds. When the write is durable, the input log of the batches the
previous checkpoint covers is trimmed (`sguard.spark.inputlog.trim`).

The policy: a checkpoint when `CheckpointConfig.every_n_batches` batches or
`CheckpointConfig.interval_s` seconds passed since the partition's last one
(either; None disables that rule), skipped when nothing changed; the last
`CheckpointConfig.keep` checkpoints are kept; a full one at least every
`CheckpointConfig.full_every`.

Incremental across re-attaches. A partition moves between Python workers; the
worker that gets it re-attaches the pool file with a fresh page manager and
checkpoint manager, which know neither the last checkpoint nor which pages
changed since. So when a checkpoint is durable, its page ids and the
``version`` each page's header had in it are recorded next to the pool file
(``ckpt.npz``, `record_path`, with the pool file's device and inode). The
first checkpoint of a worker that holds no checkpoint of its own adopts the
latest committed one as its base when the record names exactly it (same
name, same page ids) and the pool file is the one recorded; a page is then
"unchanged" only when its header still carries the recorded version and the
worker has not written it. That is exact because, after a checkpoint's
snapshot, every write to a page clones it first (the runtime keeps its
rollback snapshot of "after b-1" while applying b, so every page is pinned),
and a clone takes a version above every one the pool file ever held
(`mmm.PagePool.clock` is kept in the file): a page's version only grows,
even across a free and a new allocation of its page id, and a rollback in
the file only returns pages to versions they had.
A restore replays batches in place, so it deletes the record with the rest of
the local state (`sguard.spark.placement.PartitionSlot.wipe`). Any mismatch,
and any error reading the record, means a full checkpoint, as before.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ioservice import (CheckpointManager, CheckpointPolicy, IOService, Manifest,
                       PendingCheckpoint, StorageRoot, list_checkpoints, read_manifest)
import numpy as np
import numpy.typing as npt

from mmm import PageManager
from sguard.spark import fencing
from sguard.spark.placement import record_path

logger = logging.getLogger(__name__)

__all__ = ["CheckpointConfig", "PartitionCheckpointer", "latest_checkpoint_batch"]


@dataclass(frozen=True)
class CheckpointConfig:
    """When and how partitions are checkpointed.

    Attributes
    ----------
    every_n_batches : int or None
        Checkpoint a partition every this many batches (default 4).
    interval_s : float or None
        ... or when this many seconds passed since its last checkpoint.
    keep : int
        Restorable checkpoints kept per partition (>= 2, so a damaged latest
        one falls back to the previous one whose input is still logged).
    full_every : int
        A full checkpoint at least every this many (the others are incremental).
    io_workers : int
        I/O threads per Python worker process (shared by its partitions).
    scheduler : object, optional
        Passed through to `ioservice.CheckpointManager` as ``scheduler=`` when
        that manager accepts one (a DFS write scheduler, e.g. peace's
        coordinator); ignored otherwise.
    """

    every_n_batches: int | None = 4
    interval_s: float | None = None
    keep: int = 2
    full_every: int = 8
    io_workers: int = 2
    scheduler: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.every_n_batches is not None and self.every_n_batches < 1:
            raise ValueError(f"every_n_batches must be >= 1 or None, got {self.every_n_batches}")
        if self.interval_s is not None and self.interval_s < 0:
            raise ValueError(f"interval_s must be >= 0 or None, got {self.interval_s}")
        if self.keep < 2:
            raise ValueError(f"keep must be >= 2 (the input log relies on the previous "
                             f"checkpoint), got {self.keep}")
        if self.full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {self.full_every}")
        if self.io_workers < 1:
            raise ValueError(f"io_workers must be >= 1, got {self.io_workers}")


def _page_versions(pm: PageManager) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Page ids and header versions of every live page."""
    ids, vers = [], []
    h = pm.pool.headers
    for psid, ps in pm.page_sets():
        seqs = ps.seqs()
        ids.append((np.uint64(psid) << np.uint64(32)) | seqs.astype(np.uint64))
        vers.append(h["version"][ps.frames[seqs]])
    if not ids:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    return np.concatenate(ids), np.concatenate(vers).astype(np.uint64)


def latest_checkpoint_batch(root: StorageRoot, haunit: str) -> int:
    """The ``batch_id`` of the latest committed checkpoint of `haunit` (-1: none)."""
    infos = [c for c in list_checkpoints(root, haunit) if c.has_manifest]
    for c in reversed(infos):
        try:
            return int(read_manifest(root, c.name).user_meta.get("batch_id", -1))
        except Exception:  # noqa: BLE001 - a damaged one: look further back
            continue
    return -1


class PartitionCheckpointer:
    """The checkpoint manager of one partition in one process.

    Parameters
    ----------
    pm, root, haunit
        The partition's pages, the state root and its HA unit name.
    config
        The policy.
    io
        The process's shared `IOService`.
    meta
        The ``user_meta`` fields every manifest carries (operator, name,
        generation, partition, num_partitions); ``batch_id`` is added.
    on_durable
        ``on_durable(batch_id, previous_batch_id, manifest)`` on an I/O thread
        when a checkpoint is durable.
    claim
        The ownership claim this writer holds (`sguard.spark.fencing`): its
        checkpoints take sequence numbers of its epoch only, are written
        create-only with tagged page files, are refused (`FencedError`) once
        another claim owns the partition, and a fenced writer deletes nothing.
    """

    def __init__(self, pm: PageManager, root: StorageRoot, haunit: str, config: CheckpointConfig,
                 io: IOService, meta: dict[str, Any],
                 on_durable: Callable[[int, int, Manifest], None],
                 claim: fencing.Claim | None = None) -> None:
        self.config = config
        self.meta = dict(meta)
        self._on_durable = on_durable
        self.durable_batch = -1
        self.last_batch = -1
        self._last_t = time.monotonic()
        kwargs: dict[str, Any] = {}
        if config.scheduler is not None:
            if isinstance(config.scheduler, str):
                import sguard.scheduling  # noqa: F401  (registers peace:// in this worker)
            kwargs["scheduler"] = config.scheduler
        if claim is not None:
            kwargs.update(
                seq_range=fencing.seq_range(claim.epoch), exclusive=True,
                before_commit=lambda p: fencing.check_owner(root, haunit, claim,
                                                            f"checkpoint {p.name}"),
                may_delete=lambda: fencing.is_owner(root, haunit, claim))
        self.claim = claim
        self.mgr = CheckpointManager(
            pm, root, haunit, io=io, check_root=False, on_done=self._done,
            policy=CheckpointPolicy(keep=config.keep, full_every=config.full_every), **kwargs)
        self._lock = threading.Lock()
        self.last: dict[str, Any] = {}
        self._pm = pm
        self._root, self._haunit = root, haunit
        self._record = record_path(pm.pool.path) if pm.pool.path is not None else None
        self._adopt = False
        self._versions: dict[int, tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]] = {}
        #: how the last checkpoint's base was found: "own", "adopted", or why none was
        self.base_source = "none"
        self.last_call_ms: dict[str, float] = {}

    def seed(self, durable_batch: int, last_batch: int) -> None:
        """Start the policy from what is already durable (after a restore or re-attach).

        Until this manager has a checkpoint of its own, its next checkpoint may adopt the
        recorded latest one as its base (``durable_batch`` may lag behind it: the marker
        is written before an asynchronous checkpoint ends)."""
        self.durable_batch = durable_batch
        self.last_batch = last_batch
        self._adopt = self.mgr.base is None and self._record is not None

    def restore(self, before_seq: int | None = None) -> Manifest | None:
        """Load the latest restorable checkpoint (below `before_seq`, if given) into the
        page manager (None: there is none)."""
        man = self.mgr.restore(before_seq=before_seq)
        if man is not None:
            b = int(man.user_meta.get("batch_id", -1))
            self.durable_batch = self.last_batch = b
        return man

    def restored(self, man: Manifest | None, batch: int) -> None:
        """Recovery settled on `man` (None: the empty state) holding the state after
        `batch`: it is the base of the next checkpoint and the policy starts there."""
        self.mgr.adopt_base(man)
        self.durable_batch = self.last_batch = batch

    def due(self, state_batch: int) -> bool:
        """Whether the policy asks for a checkpoint of the state after `state_batch`."""
        if self.mgr.in_flight is not None or state_batch <= self.last_batch:
            return False
        c = self.config
        return ((c.every_n_batches is not None and state_batch - self.last_batch
                 >= c.every_n_batches)
                or (c.interval_s is not None and time.monotonic() - self._last_t >= c.interval_s))

    def checkpoint(self, state_batch: int, force: bool = False) -> PendingCheckpoint | None:
        """Start a checkpoint of the state after `state_batch` (steps 1-2 here); `force`
        writes one even when nothing changed."""
        t0 = time.perf_counter()
        if self._adopt and not force and self.mgr.base is None:
            self._adopt = False
            self.base_source = self._adopt_recorded_base()
        elif self.mgr.base is not None:
            self.base_source = "own"
        t1 = time.perf_counter()
        p = self.mgr.checkpoint(user_meta={**self.meta, "batch_id": state_batch},
                                full=True if force else None)
        t2 = time.perf_counter()
        if p is not None and self._record is not None:
            # nothing was written since the snapshot: the live headers are its versions
            self._versions[p.seq] = _page_versions(self._pm)
        #: the last call's parts on the caller's thread (ms), for the metrics records
        self.last_call_ms = {"adopt_ms": (t1 - t0) * 1e3, "manager_ms": (t2 - t1) * 1e3,
                             "versions_ms": (time.perf_counter() - t2) * 1e3}
        self._last_t = time.monotonic()
        self.last_batch = state_batch
        if p is None:  # nothing changed since the previous one: it covers this batch too
            self.durable_batch = max(self.durable_batch, state_batch)
        return p

    def _adopt_recorded_base(self) -> str:
        """Make the latest committed checkpoint the base of the next one when the record
        proves which live pages it holds unchanged; returns what happened (for metrics)."""
        assert self._record is not None and self._pm.pool.path is not None
        try:
            with np.load(self._record, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                ids, vers = z["page_id"], z["version"]
            st = os.stat(self._pm.pool.path)
            if [st.st_dev, st.st_ino] != meta["pool"]:
                return "record of another pool file"
            # the manager listed the HA unit's checkpoint directories when it was made
            # (under the partition's lock): the record's must be the newest of them
            if int(meta["seq"]) != self.mgr.last_seq:
                return "record is not of the latest checkpoint"
            man = read_manifest(self._root, meta["name"])
            if man.seq != int(meta["seq"]):
                return "record and manifest disagree"
            if not np.array_equal(np.sort(ids), np.sort(man.pages.page_id)):
                return "record and manifest name other pages"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"no usable record ({type(exc).__name__})"
        except Exception as exc:  # noqa: BLE001 - storage errors: a full checkpoint instead
            logger.warning("checkpoint base of %s not adopted: %s", self._haunit, exc)
            return f"no usable record ({type(exc).__name__})"
        pm = self._pm
        order = np.argsort(ids)
        ids, vers = ids[order], vers[order]
        for psid, ps in pm.page_sets():
            seqs = ps.seqs()
            pid = (np.uint64(psid) << np.uint64(32)) | seqs.astype(np.uint64)
            pos = np.minimum(np.searchsorted(ids, pid), max(len(ids) - 1, 0))
            same = ((ids[pos] == pid) & (vers[pos] == pm.pool.headers["version"][ps.frames[seqs]])
                    if len(ids) else np.zeros(len(seqs), bool))
            ps.durable_epoch = 0
            # unchanged: recorded version and not written here; written pages keep their epoch
            ps.mod[seqs] = np.where(same & (ps.mod[seqs] <= 0), 0,
                                    np.maximum(ps.mod[seqs], pm.epoch))
        self.mgr.adopt_base(man)  # the manager's base and the page manager's notion of
        return "adopted"          # "unchanged" agree (module doc)

    def _write_record(self, man: Manifest) -> None:
        """Record the durable checkpoint's page versions next to the pool file."""
        got = self._versions.pop(man.seq, None)
        for s in [s for s in list(self._versions) if s < man.seq]:
            self._versions.pop(s, None)
        if got is None or self._record is None or self._pm.pool.path is None:
            return
        ids, vers = got
        st = os.stat(self._pm.pool.path)
        meta = json.dumps({"name": man.name, "seq": man.seq,
                           "pool": [st.st_dev, st.st_ino]}).encode()
        tmp = f"{self._record}.{os.getpid()}.tmp.npz"
        np.savez(tmp, page_id=ids, version=vers, meta=np.frombuffer(meta, np.uint8))
        os.replace(tmp, self._record)

    def _done(self, man: Manifest) -> None:
        try:
            self._write_record(man)
        except OSError as exc:  # the next attach then starts with a full checkpoint
            logger.warning("checkpoint record of %s failed: %s", self._haunit, exc)
        b = int(man.user_meta.get("batch_id", -1))
        with self._lock:
            prev, self.durable_batch = self.durable_batch, max(self.durable_batch, b)
            self.last = {"seq": man.seq, "batch_id": b, "written_bytes": man.written_bytes,
                         "full": man.full, "pages": man.n_pages}
        self._on_durable(b, prev, man)

    @property
    def in_flight(self) -> PendingCheckpoint | None:
        return self.mgr.in_flight

    def wait(self, timeout_s: float | None = None) -> None:
        self.mgr.wait(timeout_s)

    def close(self) -> None:
        """Wait for the checkpoint in flight (the shared IOService stays up)."""
        self.mgr.close()
