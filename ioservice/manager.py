"""CheckpointManager: the checkpoint lifecycle of one HA unit (paper §3, §4.4).

A checkpoint takes the five steps of the paper:

1. *notify inputs* — ``on_start(seq)`` (e.g. HAInput operators); it may return
   input positions / other JSON-able data, stored in the manifest's ``user_meta``;
2. *prepare* — `mmm.PageManager.chkpt`: the only pause, O(pages), no bytes copied;
3. *write* — the changed pages go to storage through `IOService`, asynchronously,
   while the operator keeps running;
4. *record* — the manifest is written last (atomically: the checkpoint now
   exists), the snapshot completed, then ``on_record(manifest)`` tells a
   coordinator or catalog;
5. *notify inputs* — ``on_done(manifest)``, e.g. so upstream logs are trimmed up to
   the input positions of ``manifest.user_meta``.

Steps 1-2 run in the caller's thread (the HA unit is paused); steps 3-5 run on
I/O worker threads. At most one checkpoint per HA unit is in flight.

Policies (`CheckpointPolicy`, S4): `maybe_checkpoint` takes one when
``interval_s`` passed or ``every_n_tuples`` tuples were processed since the
last one; a checkpoint is skipped when nothing changed since the previous one.
Checkpoints are incremental (only pages changed since the previous one are
written; the others are referenced where they lie), with a full checkpoint at
least every ``full_every`` checkpoints to bound the chain. Retention keeps the
last ``keep`` restorable checkpoints and deletes every file no remaining
manifest references (and leftovers of failed checkpoints).

A failed write cancels its checkpoint: ``snap.cancel()`` makes every page
writable again, no manifest is written, the partial files are deleted
(best effort), ``on_failed(seq, exc)`` is called, and the previous checkpoint
stays valid. Its changed pages are written by the next checkpoint.

Invariants: one writer per HA unit and root at a time; this manager is the
only one that completes snapshots of its page manager (the manager's *base*
manifest and the page manager's notion of "unchanged" must agree;
`adopt_base` is the one way to tell it otherwise).

Composed checkpoints (`CheckpointManager.compose`): a new checkpoint of this
HA unit made of page-table rows of other checkpoints (typically other HA
units'), chosen by psid ranges. It writes no page, only a manifest
(`ioservice.format`, version 3) that references the sources' page files where
they lie. It then is the base of the next incremental checkpoint, which
writes only the changed pages and references the rest, foreign files
included. Retention only ever deletes this HA unit's own directories, and
none that another HA unit's kept manifest references (`sweep_unreferenced`
collects dead HA units' directories once nothing references them).

Several writers over time (fencing, e.g. `sguard.spark.fencing`): a writer
that may overlap with others passes ``exclusive=True`` and a ``seq_range``
of its own. Its checkpoint names then never collide with another writer's,
its page files carry a unique tag and are opened create-only where the
backend allows it, its manifests are created, never replaced
(`StorageRoot.write_new`); ``before_commit`` lets it refuse its own commit
once it has lost ownership, and ``may_delete`` stops it from deleting
anything (retention, a failed checkpoint's files) when it is no longer the
owner. Retention only ever deletes checkpoints with a smaller sequence number
than the writer's newest, so a writer with a lower range never deletes a
higher one's.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ioservice.errors import (
    CheckpointError,
    CheckpointInProgressError,
    CheckpointWriteError,
    CompositionConflictError,
    CompositionError,
    DuplicatePagesError,
    IOServiceError,
    ManifestError,
    OverlappingRangesError,
    PageSizeMismatchError,
    StorageExistsError,
    StorageNotFoundError,
)
from ioservice import faultpoints
from ioservice.format import (MANIFEST_NAME, Manifest, PageFile, PageTable, check_psid_ranges,
                               checkpoint_dir, checkpoint_name, parse_checkpoint_name, psid_mask)
from ioservice.fs import StorageRoot, open_root, validate_name
from ioservice.recovery import (CheckpointInfo, _check_files, list_checkpoints, read_manifest,
                                restore)
from ioservice.scheduling import ChunkGrant, WriteScheduler, resolve_scheduler
from ioservice.service import IOService, WriteResult, lower_thread_priority
from mmm.manager import PageManager
from mmm.snapshot import Snapshot, SnapshotState

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "CheckpointPolicy", "CheckpointState", "PendingCheckpoint",
           "sweep_unreferenced"]

_SEQ_LIMIT = 10 ** 18  # checkpoint names carry at most 18 digits
CheckpointState = enum.Enum("CheckpointState", "WRITING COMMITTED FAILED")


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """When to checkpoint and what to keep.

    Attributes
    ----------
    interval_s : float or None
        `CheckpointManager.maybe_checkpoint` checkpoints when this many seconds
        passed since the previous checkpoint started.
    every_n_tuples : int or None
        ... or when this many tuples were reported since then.
    skip_unchanged : bool
        Skip a checkpoint whose state equals the previous checkpoint's.
    full_every : int
        A full checkpoint at least every this many checkpoints (1: always full).
    keep : int or None
        Restorable checkpoints kept (None: keep everything).
    stage_mb : float
        Right after the freeze, a background thread copies up to this many MB
        of the pages the checkpoint writes out of the pool into a buffer and
        unpins their frames (`mmm.Snapshot.stage_planned`), so the operator
        writes them in place instead of cloning them; the I/O threads write
        from that buffer. 0 (the default) turns it off: with `in_place` the
        operator clones few pages anyway, and the copy would be one more
        background thread beside the writers, which on a small machine costs
        the operator latency (`bench.chkpt_latency`, docs/mmm-ioservice.md).
        Extra memory: at most this much per checkpoint in flight, until it is written.
    in_place : bool
        Freeze with ``PageManager.chkpt(in_place=True)``: until a page is staged
        or written, the operator updates a value of a key already in it in place,
        logging the value's old bytes, instead of cloning the whole page; the
        writers read the frozen bytes all the same (`mmm.snapshot`). False: every
        write to a frozen page clones it.
    """

    interval_s: float | None = None
    every_n_tuples: int | None = None
    skip_unchanged: bool = True
    full_every: int = 8
    keep: int | None = 3
    stage_mb: float = 0.0
    in_place: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.in_place, bool):
            raise ValueError(f"in_place must be a bool, got {self.in_place!r}")
        if (isinstance(self.stage_mb, bool) or not isinstance(self.stage_mb, (int, float))
                or not self.stage_mb >= 0):
            raise ValueError(f"stage_mb must be a number >= 0, got {self.stage_mb!r}")
        if self.interval_s is not None and self.interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {self.interval_s}")
        if self.every_n_tuples is not None and self.every_n_tuples < 1:
            raise ValueError(f"every_n_tuples must be >= 1, got {self.every_n_tuples}")
        if self.full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {self.full_every}")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {self.keep}")


class PendingCheckpoint:
    """A checkpoint being written; becomes COMMITTED (with its `Manifest`) or FAILED.

    Attributes
    ----------
    seq, name : int, str
        Sequence number and ``<haunit>-<seq>``.
    full : bool
        Whether every page is written (no references to earlier checkpoints).
    n_pages : int
        Pages in the checkpoint.
    n_pages_written : int
        Pages this checkpoint writes (the changed ones, for an incremental one);
        -1 until the manager's background thread has chosen them, right after
        the pause.
    prepare_s : float
        Duration of the pause (steps 1-2: the freeze; which pages to write is
        worked out after it, off the caller's thread).
    scheduled : bool
        Whether a write scheduler admitted its chunks (`ioservice.scheduling`).
    fallback : str or None
        Set once committed: why (part of) it was written unscheduled, if so.
    grants : tuple of ChunkGrant
        Set once committed: the scheduler's grants (placement advice included).
    admission_s, write_s : float
        Set once committed: wait before the first chunk started; start of the
        write step to its last page file closed.
    """

    def __init__(self, seq: int, name: str, full: bool, n_pages: int, n_pages_written: int,
                 prepare_s: float) -> None:
        self.seq = seq
        self.name = name
        self.full = full
        self.n_pages = n_pages
        self.n_pages_written = n_pages_written
        self.prepare_s = prepare_s
        self.scheduled = False
        self.fallback: str | None = None
        self.grants: tuple[ChunkGrant, ...] = ()
        self.admission_s = 0.0
        self.write_s = 0.0
        self.state = CheckpointState.WRITING
        self.future: cf.Future[Manifest] = cf.Future()
        self.future.set_running_or_notify_cancel()

    def __repr__(self) -> str:
        return (f"<PendingCheckpoint {self.name} {self.state.name} "
                f"{'full' if self.full else 'incremental'} pages={self.n_pages} "
                f"written={self.n_pages_written}>")

    def done(self) -> bool:
        """True once COMMITTED or FAILED."""
        return self.future.done()

    def result(self, timeout_s: float | None = None) -> Manifest:
        """Wait for the checkpoint and return its manifest.

        Raises
        ------
        CheckpointWriteError
            If it failed (it was cancelled; it does not exist).
        TimeoutError
            If it is still being written after `timeout_s`.
        """
        return self.future.result(timeout_s)

    def exception(self, timeout_s: float | None = None) -> BaseException | None:
        """Wait; return the failure or None."""
        return self.future.exception(timeout_s)

    def add_done_callback(self, fn: Callable[[PendingCheckpoint], None]) -> None:
        """Call ``fn(self)`` when done (on an I/O thread, or now if already done)."""
        self.future.add_done_callback(lambda _f: fn(self))


class CheckpointManager:
    """Checkpoints and recovery of one HA unit's page manager (see module docstring).

    Parameters
    ----------
    pm : mmm.PageManager
        The HA unit's pages.
    root : StorageRoot or str
        Storage root, or a URI for `ioservice.fs.open_root`.
    haunit : str
        HA unit name (a portable directory name, see `ioservice.fs.validate_name`).
    policy : CheckpointPolicy
        When to checkpoint, how often a full one, what to keep.
    io : IOService, optional
        Shared I/O workers; default: a private service of `n_workers` threads,
        shut down by `close`.
    n_workers : int
        Workers (= files per checkpoint) of the private service.
    on_start : callable, optional
        Step 1: ``on_start(seq) -> Mapping | None``, called during the pause;
        a returned mapping is merged into the manifest's ``user_meta``.
    on_record : callable, optional
        Step 4: ``on_record(manifest)`` after the manifest is durable
        (coordinator / catalog). Errors are logged; the checkpoint stays.
    on_done : callable, optional
        Step 5: ``on_done(manifest)`` after the record step and retention.
    on_failed : callable, optional
        ``on_failed(seq, exc)`` when a checkpoint was cancelled.
    scheduler : WriteScheduler or str, optional
        Admit each checkpoint's chunks through a write scheduler
        (`ioservice.scheduling`), e.g. ``"peace://127.0.0.1:7000"`` once
        ``sguard.scheduling`` is imported. Default None: unscheduled writes.
        A dead or hung scheduler never blocks `checkpoint`; the write falls back
        to unscheduled after the scheduler's timeout (logged, counted in
        ``schedule_counters["unscheduled_fallbacks"]``).
    check_root : bool
        Probe that the root is writable now (a clear error early).
    seq_range : (int, int), optional
        Draw sequence numbers from ``[lo, hi)`` only (above any checkpoint
        already there in that range): a writer with a range of its own never
        picks another writer's checkpoint name. Default: above every existing one.
    exclusive : bool
        Write as one of several writers over time: page files get a unique tag
        per checkpoint and are opened create-only where possible, manifests
        are created only, never replaced (see the module docstring).
    before_commit : callable, optional
        ``before_commit(pending)`` on the I/O thread once every page file is
        written, right before the manifest: raising cancels the checkpoint
        (the exception is what its future fails with).
    may_delete : callable, optional
        ``may_delete() -> bool``, asked before this manager deletes anything
        (retention, the files of a failed checkpoint); False skips it.
    clock : callable
        Monotonic time source for ``interval_s`` (tests inject one).

    Raises
    ------
    InvalidNameError
        If `haunit` is not a valid name.
    UnsupportedURIError, InvalidURIError
        For a bad URI.
    UnknownSchedulerError
        For a scheduler URI whose scheme is not registered.
    RootNotWritableError, StorageUnreachableError
        If the root cannot be written or reached.

    Examples
    --------
    >>> import numpy as np, tempfile, mmm
    >>> from mmm.structures.hashmap import HashMap
    >>> pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    >>> counts = HashMap.create(pm, "counts", key="<u4", value=[("n", "<i8")])
    >>> counts.upsert(np.array([1, 2, 1], "<u4"), combine={"n": "count"})
    >>> uri = tempfile.mkdtemp()
    >>> with CheckpointManager(pm, uri, "agg0") as mgr:
    ...     man = mgr.checkpoint(user_meta={"offset": 3}).result()
    >>> man.name, man.user_meta["offset"]
    ('agg0-1', 3)
    >>> pm2 = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    >>> with CheckpointManager(pm2, uri, "agg0") as mgr2:
    ...     _ = mgr2.restore()
    >>> int(HashMap.create(pm2, "counts", key="<u4", value=[("n", "<i8")])[1]["n"])
    2
    """

    def __init__(self, pm: PageManager, root: StorageRoot | str, haunit: str, *,
                 policy: CheckpointPolicy | None = None, io: IOService | None = None,
                 n_workers: int = 4,
                 on_start: Callable[[int], Mapping[str, Any] | None] | None = None,
                 on_record: Callable[[Manifest], None] | None = None,
                 on_done: Callable[[Manifest], None] | None = None,
                 on_failed: Callable[[int, BaseException], None] | None = None,
                 scheduler: WriteScheduler | str | None = None,
                 check_root: bool = True,
                 seq_range: tuple[int, int] | None = None,
                 exclusive: bool = False,
                 before_commit: Callable[[PendingCheckpoint], None] | None = None,
                 may_delete: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.haunit = validate_name(haunit)
        self.scheduler = resolve_scheduler(scheduler)
        self.root = open_root(root) if isinstance(root, str) else root
        if check_root:
            self.root.check_writable()
        self.pm = pm
        self.policy = policy or CheckpointPolicy()
        self._own_io = io is None
        self.io = io or IOService(n_workers)
        self.on_start, self.on_record, self.on_done, self.on_failed = \
            on_start, on_record, on_done, on_failed
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: PendingCheckpoint | None = None
        self._stager: cf.ThreadPoolExecutor | None = None  # made on first use
        self._base: Manifest | None = None
        self._base_partial = False  # the base is a selection (partial restore): never skip
        self._manifests: dict[str, Manifest] = {}
        # other HA units' manifests: name -> paths into this unit's directories they reference
        self._foreign_cache: dict[str, frozenset[str]] = {}
        if seq_range is not None:
            lo, hi = (int(seq_range[0]), int(seq_range[1]))
            if not 0 <= lo < hi or hi > _SEQ_LIMIT:
                raise ValueError(f"seq_range must be 0 <= lo < hi <= {_SEQ_LIMIT}, got {seq_range!r}")
            self._seq_range = (lo, hi)
        else:
            self._seq_range = (0, _SEQ_LIMIT)
        self.exclusive = exclusive
        self.before_commit, self.may_delete = before_commit, may_delete
        self._next_seq = self._seq_after(list_checkpoints(self.root, self.haunit))
        self._last_start = clock()
        self._tuples = 0
        self.counters = {"committed": 0, "failed": 0, "skipped": 0, "retention_deleted": 0,
                         "pages_staged": 0}
        #: committed checkpoints written through the scheduler, and those that fell back
        self.schedule_counters = {"scheduled": 0, "unscheduled_fallbacks": 0}
        self._closed = False

    def __repr__(self) -> str:
        return f"<CheckpointManager {self.haunit!r} on {self.root.uri} next_seq={self._next_seq}>"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _seq_after(self, existing: list[CheckpointInfo]) -> int:
        """The next sequence number: in this manager's range, above any there already."""
        lo, hi = self._seq_range
        seqs = [c.seq for c in existing if lo <= c.seq < hi]
        return max(max(seqs, default=0) + 1, lo if lo > 0 else 1, getattr(self, "_next_seq", 0))

    # ------------------------------------------------------------------ status
    @property
    def base(self) -> Manifest | None:
        """The latest committed (or restored) checkpoint: the base of the next one."""
        return self._base

    @property
    def last_seq(self) -> int:
        """The highest sequence number this manager has seen or used in its range
        (0: none): a checkpoint it listed when created, restored, or started."""
        return self._next_seq - 1

    def adopt_base(self, manifest: Manifest | None) -> None:
        """Make `manifest` the base of the next incremental checkpoint (None: no base, the
        next checkpoint is full).

        For a page manager that holds exactly the state of a committed
        checkpoint without having restored it through this manager (e.g. a
        pool file re-attached by another process): the caller must already
        have told the page manager which pages are unchanged since that
        checkpoint (their ``mod`` stamps), because the next checkpoint writes
        only changed pages and references the others in `manifest`'s files.

        Raises
        ------
        CheckpointInProgressError
            If a checkpoint is in flight (nothing changes).
        ValueError
            If `manifest` is of another HA unit or page size (nothing changes).
        """
        if manifest is None:
            with self._lock:
                if self.in_flight is not None:
                    raise CheckpointInProgressError(
                        f"HA unit {self.haunit!r}: cannot drop the base while checkpoint "
                        f"{self._pending.name} is in flight")  # type: ignore[union-attr]
                self._base = None
                self._base_partial = False
            return
        if manifest.haunit != self.haunit:
            raise ValueError(f"cannot adopt checkpoint {manifest.name} of HA unit "
                             f"{manifest.haunit!r} as a base of {self.haunit!r}")
        if manifest.page_bytes != self.pm.page_bytes:
            raise ValueError(f"cannot adopt checkpoint {manifest.name}: {manifest.page_bytes}-byte "
                             f"pages, the page manager uses {self.pm.page_bytes}-byte pages")
        with self._lock:
            if self.in_flight is not None:
                raise CheckpointInProgressError(
                    f"HA unit {self.haunit!r}: cannot adopt {manifest.name} as a base while "
                    f"checkpoint {self._pending.name} is in flight")  # type: ignore[union-attr]
            self._base = manifest
            self._base_partial = False
            self._manifests[manifest.name] = manifest
            if self._seq_range[0] <= manifest.seq < self._seq_range[1]:
                self._next_seq = max(self._next_seq, manifest.seq + 1)

    @property
    def in_flight(self) -> PendingCheckpoint | None:
        """The checkpoint being written, if any."""
        p = self._pending
        return p if p is not None and not p.done() else None

    def wait(self, timeout_s: float | None = None) -> PendingCheckpoint | None:
        """Wait until no checkpoint is in flight; return the last one started (done).

        Raises
        ------
        TimeoutError
            If a checkpoint is still being written after `timeout_s`.
        """
        p = self._pending
        if p is not None:
            try:
                p.future.exception(timeout_s)
            except cf.TimeoutError:
                raise TimeoutError(f"checkpoint {p.name} still in flight after {timeout_s} s") \
                    from None
        return p

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the checkpoint in flight, then stop a private IOService. Idempotent."""
        if self._closed:
            return
        self.wait(timeout_s)
        self._closed = True
        if self._stager is not None:
            self._stager.shutdown(wait=True)
        if self._own_io:
            self.io.shutdown()

    def _stage(self, snap: Any, write_idx: npt.NDArray[np.int64]) -> None:
        """Plan the staging of the first `CheckpointPolicy.stage_mb` of the pages to write
        and start the copier (`mmm.Snapshot.stage_planned`) before any writer reads them."""
        if not self.policy.stage_mb or not len(write_idx) or not hasattr(snap, "plan_staging"):
            return
        n = int(self.policy.stage_mb * (1 << 20)) // snap.page_bytes
        if not snap.plan_staging(write_idx[:n]):
            return
        self._background().submit(snap.stage_planned).add_done_callback(self._staged)

    def _staged(self, fut: cf.Future[int]) -> None:
        exc = fut.exception()
        if exc is not None:  # the pages it did not copy are written from their frames
            logger.warning("HA unit %s: staging stopped early: %s", self.haunit, exc)

    # ----------------------------------------------------------------- recovery
    def restore(self, *, before_seq: int | None = None,
                psid_ranges: Sequence[tuple[int, int]] | None = None) -> Manifest | None:
        """Load the latest restorable checkpoint into the page manager (`recovery.restore`);
        with `before_seq`, the latest one with a smaller sequence number; with
        `psid_ranges`, only the pages whose psid lies in those half-open ranges
        (a partial restore: only their bytes are read; the returned manifest is
        the selection, `Manifest.select_psids`, and the next checkpoint is never
        skipped as unchanged, since the page manager no longer holds the whole
        checkpoint).

        Returns
        -------
        Manifest or None
            The checkpoint loaded (it becomes the base of the next incremental
            checkpoint), or None if the HA unit has no checkpoint at all (the
            page manager is left untouched: a fresh start).

        Raises
        ------
        CheckpointInProgressError
            If a checkpoint is in flight.
        CheckpointNotFoundError
            If checkpoints exist but every one is damaged.
        ValueError
            If `psid_ranges` is malformed or overlaps (nothing is read).
        StorageUnreachableError
        """
        if psid_ranges is not None:
            psid_ranges = check_psid_ranges(psid_ranges, "psid_ranges")
        if self.in_flight is not None:
            raise CheckpointInProgressError(f"HA unit {self.haunit!r}: cannot restore while "
                                            f"checkpoint {self._pending.name} is in flight")  # type: ignore[union-attr]
        existing = list_checkpoints(self.root, self.haunit)
        self._next_seq = self._seq_after(existing)
        if not any(c.has_manifest and (before_seq is None or c.seq < before_seq)
                   for c in existing):
            return None
        man = restore(self.pm, self.root, self.haunit, io=self.io, before_seq=before_seq,
                      psid_ranges=psid_ranges)
        self._base = man
        self._base_partial = psid_ranges is not None
        if psid_ranges is None:  # retention reads the whole manifest, never a selection
            self._manifests[man.name] = man
        self._last_start = self._clock()
        self._tuples = 0
        return man

    # ----------------------------------------------------------------- compose
    def compose(self, parts: Sequence[tuple[Manifest, Sequence[tuple[int, int]]]],
                user_meta: Mapping[str, Any] | None = None) -> Manifest:
        """Write a *composed* checkpoint of this HA unit: exactly the page-table rows
        of the `parts`' checkpoints whose psid lies in each part's ranges.

        The new checkpoint references the source checkpoints' page files where
        they lie (usually other HA units' directories): no page byte is read or
        written, only its manifest (`ioservice.format`, version 3, field
        ``composed_from``), which is created, never replaced
        (`StorageRoot.write_new`), with a sequence number from this manager's
        ``seq_range``; ``before_commit`` is asked first, as for a checkpoint
        (the other hooks are not called). Its structures are the sources'
        structures whose psid is selected; its ``depth`` is the deepest source's;
        its ``snapshot_id`` the largest source's.

        Idempotent: when this HA unit's newest checkpoint already is the same
        composition (`Manifest.same_content`: same rows, files, structures,
        ``user_meta`` and sources), that one is returned and nothing is written,
        so a retried task (an executor killed after the manifest was written)
        succeeds. Any other existing checkpoint of this HA unit is a conflict.

        Afterwards the composed checkpoint is this manager's base, as with
        `adopt_base`: the next checkpoint writes only the pages changed since it
        and references the others where they lie. So the page manager must hold
        exactly that state then: call `restore` (which loads it: it is the newest
        checkpoint) before changing state and checkpointing.

        Parameters
        ----------
        parts : sequence of (Manifest, sequence of (int, int))
            Each source checkpoint (read from this manager's root, e.g. with
            `ioservice.recovery.read_manifest`) and the half-open psid ranges
            ``[lo, hi)`` taken from it. Ranges may not overlap, in one part or
            across parts, so no page is taken twice.
        user_meta : mapping, optional
            JSON-able data stored in the manifest.

        Returns
        -------
        Manifest
            The composed checkpoint (the existing one for a rerun).

        Raises
        ------
        CompositionError
            For malformed `parts` or ranges, no part, or two parts holding
            structures of one name with different psids;
            `OverlappingRangesError` for ranges that overlap;
            `DuplicatePagesError` for a PageID taken from two parts;
            `PageSizeMismatchError` when a source's page size is not the page
            manager's.
        CompositionConflictError
            If this HA unit already has a checkpoint that is not this
            composition (also one created concurrently under the same name).
        CheckpointDamagedError
            If a page file the composition references is missing or short.
        CheckpointInProgressError
            If a checkpoint is in flight.
        CheckpointError
            If the manager is closed, the sequence range is used up, or
            ``before_commit`` refused (its exception is raised as is).
        CheckpointWriteError
            If writing the manifest failed.
        TypeError
            If `user_meta` is not JSON-able.

        In every error case nothing was written.

        Notes
        -----
        Runtime complexity: O(pages of the parts) vectorized, one listing of
        the root, a listing of each referenced directory, and one small write.
        The sources' writers must not run retention meanwhile (in a repartition
        they are aligned and stopped): a file retention deletes between the
        check and the write would leave the composition damaged (restore then
        reports it as such).
        """
        if self._closed:
            raise CheckpointError(f"checkpoint manager of HA unit {self.haunit!r} is closed")
        meta = dict(user_meta or {})
        _check_json(meta, f"composition into {self.haunit!r}")
        table, files, structures, sources, depth, snapshot_id = _compose_rows(
            parts, self.pm.page_bytes, self.haunit)
        with self._lock:
            if self.in_flight is not None:
                raise CheckpointInProgressError(
                    f"HA unit {self.haunit!r}: cannot compose while checkpoint "
                    f"{self._pending.name} is in flight")  # type: ignore[union-attr]
            existing = list_checkpoints(self.root, self.haunit)
            self._next_seq = self._seq_after(existing)
            seq = self._next_seq
            if seq >= self._seq_range[1]:
                raise CheckpointError(f"HA unit {self.haunit!r}: sequence range "
                                      f"{self._seq_range} is used up")
            man = Manifest(haunit=self.haunit, seq=seq, snapshot_id=snapshot_id,
                           page_bytes=self.pm.page_bytes, full=False, depth=depth, base=None,
                           files=files, pages=table, structures=structures, user_meta=meta,
                           composed_from=sources)
            man.validate(f"composition {man.name}")
            with_manifest = [c for c in existing if c.has_manifest]
            if with_manifest:
                found = self._same_or_conflict(with_manifest[-1].name, man)
                self._adopt_composed(found)
                return found
            _check_files(self.root, man)
            pending = PendingCheckpoint(seq, man.name, False, man.n_pages, 0, 0.0)
            if self.before_commit is not None:
                self.before_commit(pending)
            try:
                self.root.write_new(man.manifest_path, man.to_json())
            except StorageExistsError:  # a concurrent attempt took the name first
                found = self._same_or_conflict(man.name, man)
                self._adopt_composed(found)
                return found
            except IOServiceError as exc:
                raise CheckpointWriteError(f"composed checkpoint {man.name}: writing its "
                                           f"manifest failed: {exc}") from exc
            self._adopt_composed(man)
        logger.info("composed checkpoint %s: %d pages from %s, on %s", man.name, man.n_pages,
                    ", ".join(sources), self.root.uri)
        return man

    def _same_or_conflict(self, name: str, want: Manifest) -> Manifest:
        """The manifest of checkpoint `name` if it is the composition `want`; else raise."""
        try:
            have = read_manifest(self.root, name)
        except (ManifestError, StorageNotFoundError) as exc:
            raise CompositionConflictError(
                f"cannot compose into HA unit {self.haunit!r}: its checkpoint {name} exists "
                f"and cannot be read ({exc})") from exc
        if not (have.composed and have.same_content(want)):
            what = (f"composed from {', '.join(have.composed_from)}" if have.composed
                    else "not composed")
            raise CompositionConflictError(
                f"cannot compose into HA unit {self.haunit!r} on {self.root.uri}: it already has "
                f"checkpoint {name} ({what}), which is not this composition of "
                f"{', '.join(want.composed_from)}")
        return have

    def _adopt_composed(self, man: Manifest) -> None:
        self._base = man
        self._base_partial = False
        self._manifests[man.name] = man
        if self._seq_range[0] <= man.seq < self._seq_range[1]:
            self._next_seq = max(self._next_seq, man.seq + 1)

    # ------------------------------------------------------------------ policy
    def maybe_checkpoint(self, n_tuples: int = 0, user_meta: Mapping[str, Any] | None = None
                         ) -> PendingCheckpoint | None:
        """Count `n_tuples` processed tuples and checkpoint if the policy says so.

        Returns None when no checkpoint is due, one is in flight, or nothing
        changed. Call it from the operator's thread between batches.

        Raises
        ------
        See `checkpoint`.
        """
        self._tuples += n_tuples
        if self.in_flight is not None:
            return None
        pol = self.policy
        due = ((pol.interval_s is not None and self._clock() - self._last_start >= pol.interval_s)
               or (pol.every_n_tuples is not None and self._tuples >= pol.every_n_tuples))
        if not due:
            return None
        return self.checkpoint(user_meta)

    # -------------------------------------------------------------- checkpoint
    def checkpoint(self, user_meta: Mapping[str, Any] | None = None, *,
                   full: bool | None = None) -> PendingCheckpoint | None:
        """Take a checkpoint now: steps 1-2 here, steps 3-5 asynchronously.

        Parameters
        ----------
        user_meta : mapping, optional
            JSON-able data stored in the manifest (e.g. input positions).
        full : bool, optional
            Force a full (True) or allow an incremental (False) checkpoint;
            default: full when there is no base or `CheckpointPolicy.full_every`
            is reached.

        Returns
        -------
        PendingCheckpoint or None
            None when skipped because nothing changed since the base checkpoint.

        Raises
        ------
        CheckpointInProgressError
            If a checkpoint of this HA unit is in flight.
        CheckpointError
            If the manager is closed.
        TypeError
            If `user_meta` is not JSON-able (nothing is checkpointed).

        Notes
        -----
        Runtime complexity of the pause: O(pages) (`PageManager.chkpt`: the
        page tables copied and the frames pinned). Which pages to write (an
        incremental checkpoint references the unchanged ones), their staging
        and the hand-over to the I/O service follow on the manager's background
        thread. Pages copied during the pause: 0.
        """
        if self._closed:
            raise CheckpointError(f"checkpoint manager of HA unit {self.haunit!r} is closed")
        with self._lock:
            if self.in_flight is not None:
                raise CheckpointInProgressError(
                    f"HA unit {self.haunit!r}: checkpoint {self._pending.name} is still in "  # type: ignore[union-attr]
                    f"flight (at most one per HA unit)")
            t0 = time.perf_counter()
            self._last_start = self._clock()
            self._tuples = 0
            snap = self.pm.chkpt(in_place=self.policy.in_place)  # step 2
            base = self._base
            if (self.policy.skip_unchanged and full is not True and base is not None
                    and not self._base_partial and snap.n_changed == 0 and np.array_equal(snap.page_ids, base.pages.page_id)
                    and dict(snap.structures) == dict(base.structures)):
                snap.cancel()
                self.counters["skipped"] += 1
                logger.debug("HA unit %s: nothing changed since %s, checkpoint skipped",
                             self.haunit, base.name)
                return None
            seq = self._next_seq
            if seq >= self._seq_range[1]:
                snap.cancel()
                raise CheckpointError(f"HA unit {self.haunit!r}: sequence range "
                                      f"{self._seq_range} is used up")
            name = checkpoint_name(self.haunit, seq)
            try:
                meta = dict(user_meta or {})
                if self.on_start is not None:                                 # step 1
                    meta.update(self.on_start(seq) or {})
                _check_json(meta, name)
            except BaseException:
                snap.cancel()
                raise
            self._next_seq += 1
            if full is None:
                full = base is None or base.depth + 1 >= self.policy.full_every
            # which pages to write is worked out off the operator's thread (`_plan_and_write`)
            pending = PendingCheckpoint(seq, name, bool(full or base is None), len(snap), -1,
                                        time.perf_counter() - t0)
            pending.scheduled = self.scheduler is not None
            self._pending = pending
        self._background().submit(self._plan_and_write, pending, snap, base, meta)
        return pending

    def _background(self) -> cf.ThreadPoolExecutor:
        """The manager's own background thread (lazily; the I/O service's nice, never
        ``SCHED_IDLE``): plans each checkpoint's write, then runs its stager (`_stage`).
        Writers wait for the pages planned for staging and nothing can raise a
        starved stager, so on a saturated machine a ``SCHED_IDLE`` one would hold up
        the whole checkpoint; planning is a few numpy calls."""
        if self._stager is None:
            self._stager = cf.ThreadPoolExecutor(
                1, thread_name_prefix=f"sguard-stage-{self.haunit}",
                initializer=lower_thread_priority, initargs=(self.io.nice, False))
        return self._stager

    def _plan_and_write(self, pending: PendingCheckpoint, snap: Snapshot, base: Manifest | None,
                        meta: dict[str, Any]) -> None:
        """Step 3, on the background thread right after the freeze: the pages to write
        (all for a full checkpoint; else the changed ones and those `base` lacks, the
        rest referenced in `base` and unpinned at once), their staging, and the write
        handed to the I/O service; a failure here fails the checkpoint (`_finish`)."""
        ref_rows: npt.NDArray[np.intp] = np.zeros(0, np.intp)
        fut: cf.Future[WriteResult]
        try:
            if pending.full or base is None:
                write_idx = np.arange(len(snap), dtype=np.int64)
            else:
                rows = base.pages.lookup(snap.page_ids)
                refer = ~snap.changed & (rows >= 0)
                write_idx = np.flatnonzero(~refer)
                ref_rows = rows[refer]
                snap.mark_persisted(np.flatnonzero(refer))  # durable in earlier checkpoints
            pending.n_pages_written = len(write_idx)
            self._stage(snap, write_idx)
            tag = uuid.uuid4().hex[:12] if self.exclusive else None
            fut = self.io.write_snapshot(self.root, checkpoint_dir(pending.name), snap,
                                         write_idx, name=pending.name, scheduler=self.scheduler,
                                         haunit=self.haunit, file_tag=tag)
        except BaseException as exc:  # noqa: BLE001 - reported through the checkpoint
            fut = cf.Future()
            fut.set_exception(exc)
        fut.add_done_callback(
            lambda f: self._finish(pending, snap, base, ref_rows, meta, f))

    # ---------------------------------------------------------- steps 4 and 5
    def _finish(self, pending: PendingCheckpoint, snap: Snapshot, base: Manifest | None,
                ref_rows: npt.NDArray[np.intp], meta: dict[str, Any],
                fut: cf.Future[WriteResult]) -> None:
        """On an I/O thread: commit the manifest, or cancel the checkpoint."""
        try:
            res = fut.result()
            pending.fallback, pending.grants = res.fallback, res.grants
            pending.admission_s, pending.write_s = res.first_start_s, res.seconds
            if res.scheduled:
                self.schedule_counters["scheduled"] += 1
                if res.fallback is not None:
                    self.schedule_counters["unscheduled_fallbacks"] += 1
            man = self._manifest(pending, snap, base, ref_rows, meta, res)
            if self.before_commit is not None:
                self.before_commit(pending)
            faultpoints.reached("manifest")
            try:
                if self.exclusive:                                            # step 4
                    self.root.write_new(man.manifest_path, man.to_json())
                else:
                    self.root.write_atomic(man.manifest_path, man.to_json())
            except IOServiceError as exc:
                raise CheckpointWriteError(f"checkpoint {pending.name}: writing its manifest "
                                           f"failed: {exc}") from exc
            staged = snap.n_staged  # final: every page written was staged or read pinned
            snap.complete()
        except BaseException as exc:  # noqa: BLE001 - reported through the future
            self._cancel(pending, snap, exc)
            return
        self._base = man
        self._base_partial = False
        self._manifests[man.name] = man
        self.counters["committed"] += 1
        self.counters["pages_staged"] += staged
        logger.info("checkpoint %s committed: %d pages, %d written (%d B) to %s", man.name,
                    man.n_pages, pending.n_pages_written, man.written_bytes, self.root.uri)
        if self.on_record is not None:
            _call_hook(self.on_record, man, "on_record")
        try:
            self._retain()
        except Exception as exc:  # noqa: BLE001 - retention is best effort
            logger.warning("HA unit %s: retention after %s failed: %s", self.haunit, man.name, exc)
        if self.on_done is not None:                                          # step 5
            _call_hook(self.on_done, man, "on_done")
        pending.state = CheckpointState.COMMITTED
        pending.future.set_result(man)

    def _manifest(self, pending: PendingCheckpoint, snap: Snapshot, base: Manifest | None,
                  ref_rows: npt.NDArray[np.intp], meta: dict[str, Any],
                  res: WriteResult) -> Manifest:
        """Build the manifest: rows written now plus rows referenced in `base`."""
        if base is None or not len(ref_rows):
            files: tuple[PageFile, ...] = res.files
            table = res.table
        else:
            ref = base.pages.take(ref_rows)
            used = np.unique(ref.file)
            remap = np.full(len(base.files), -1, dtype=np.int64)
            remap[used] = np.arange(len(used))
            ref = PageTable(ref.page_id, remap[ref.file].astype(np.uint32), ref.offset,
                            ref.checksum)
            own = PageTable(res.table.page_id, res.table.file + np.uint32(len(used)),
                            res.table.offset, res.table.checksum)
            files = tuple(base.files[i] for i in used.tolist()) + res.files
            table = PageTable.concat([ref, own])
        return Manifest(haunit=self.haunit, seq=pending.seq, snapshot_id=snap.snapshot_id,
                        page_bytes=snap.page_bytes, full=pending.full,
                        depth=0 if pending.full or base is None else base.depth + 1,
                        base=None if pending.full or base is None else base.name,
                        files=files, pages=table, structures=dict(snap.structures),
                        user_meta=meta)

    def _cancel(self, pending: PendingCheckpoint, snap: Snapshot, exc: BaseException) -> None:
        """Cancel a failed checkpoint: unpin pages, delete its files, report."""
        if snap.state is SnapshotState.ACTIVE:
            snap.cancel()
        try:
            if self._may_delete():
                self.root.delete_dir(checkpoint_dir(pending.name), missing_ok=True)
        except Exception as del_exc:  # noqa: BLE001 - best effort
            logger.warning("checkpoint %s: could not delete its partial files: %s",
                           pending.name, del_exc)
        self.counters["failed"] += 1
        logger.warning("checkpoint %s of HA unit %s failed and was cancelled: %s",
                       pending.name, self.haunit, exc)
        if not isinstance(exc, CheckpointError):
            wrapped: BaseException = CheckpointWriteError(
                f"checkpoint {pending.name} of HA unit {self.haunit!r} on {self.root.backend} "
                f"root {self.root.uri} failed: {exc!r}")
            wrapped.__cause__ = exc
            exc = wrapped
        if self.on_failed is not None:
            try:
                self.on_failed(pending.seq, exc)
            except Exception as hook_exc:  # noqa: BLE001
                logger.warning("on_failed hook raised: %s", hook_exc)
        pending.state = CheckpointState.FAILED
        pending.future.set_exception(exc)

    # -------------------------------------------------------------- retention
    def _may_delete(self) -> bool:
        if self.may_delete is None:
            return True
        try:
            return bool(self.may_delete())
        except Exception as exc:  # noqa: BLE001 - when in doubt, delete nothing
            logger.warning("HA unit %s: may_delete raised, deleting nothing: %s", self.haunit, exc)
            return False

    def _retain(self) -> None:
        """Keep the last `policy.keep` restorable checkpoints; delete unreferenced files.

        Only this HA unit's own directories are touched, and none of their files
        that a manifest of another HA unit references (a composed checkpoint and
        its successors reference the directories they were composed from)."""
        if not self._may_delete():
            return
        keep_n = self.policy.keep
        everything = list_checkpoints(self.root)
        infos = [c for c in everything if c.haunit == self.haunit]
        current = self._base.seq if self._base is not None else 0
        committed = [c for c in infos if c.has_manifest and c.seq <= current]
        kept = committed if keep_n is None else committed[-keep_n:]
        kept_names = {c.name for c in kept}
        referenced: set[str] = set()
        for c in kept:
            man = self._manifests.get(c.name)
            if man is None:
                man = read_manifest(self.root, c.name)
                self._manifests[c.name] = man
            referenced.update(f.path for f in man.files)
        for name in [n for n in self._manifests if n not in kept_names]:
            del self._manifests[name]
        doomed = [c for c in infos if c.name not in kept_names and c.seq < current]
        if doomed:
            referenced |= self._foreign_references(everything)
        for c in doomed:
            if c.has_manifest:  # expired: it stops being restorable first
                self.root.delete_file(f"{c.directory}/manifest.json", missing_ok=True)
            needed = any(p.startswith(c.directory + "/") for p in referenced)
            if not needed:
                self.root.delete_dir(c.directory, missing_ok=True)
                self.counters["retention_deleted"] += 1
                continue
            for e in self.root.list_dir(c.directory, allow_not_found=True):
                if not e.is_dir and e.relpath not in referenced:
                    self.root.delete_file(e.relpath, missing_ok=True)

    def _foreign_references(self, everything: list[CheckpointInfo]) -> set[str]:
        """Paths of this HA unit's files that a manifest of another HA unit references.

        Manifests never change, so each one is read once per manager (then only
        the paths into this unit's directories are remembered). A damaged or
        vanished manifest protects nothing (it cannot be restored)."""
        out: set[str] = set()
        names = set()
        for c in everything:
            if c.haunit == self.haunit or not c.has_manifest:
                continue
            names.add(c.name)
            paths = self._foreign_cache.get(c.name)
            if paths is None:
                try:
                    man = read_manifest(self.root, c.name)
                except (ManifestError, StorageNotFoundError) as exc:
                    logger.info("HA unit %s: retention ignores unreadable manifest of %s: %s",
                                self.haunit, c.name, exc)
                    paths = frozenset()
                else:
                    paths = frozenset(f.path for f in man.files
                                      if _haunit_of(f.checkpoint) == self.haunit)
                self._foreign_cache[c.name] = paths
            out |= paths
        for gone in [n for n in self._foreign_cache if n not in names]:
            del self._foreign_cache[gone]
        return out


def sweep_unreferenced(root: StorageRoot | str, dead_haunits: Iterable[str],
                       live_haunits: Iterable[str], *,
                       live_files: Iterable[str] | None = None) -> list[str]:
    """Delete what dead HA units left that no live HA unit's checkpoint needs.

    For a state whose HA units were replaced (e.g. the old generation of a
    repartition, whose composed successors reference its page files). Every
    manifest of a live HA unit on `root` protects the files it references.
    In each checkpoint directory of a dead HA unit:

    - nothing referenced: its manifest is deleted first (it stops being a
      checkpoint), then every file ioservice writes there (page files
      ``w<k>[-<tag>].pages``, ``manifest.json``, temp files ``.tmp-*``), then the
      directory if that left it empty. Leftovers of failed checkpoints (no
      manifest) go the same way.
    - some files referenced: its manifest and unreferenced page files are
      deleted; the referenced ones stay (an "expired, data kept" directory).

    Nothing else is touched: not live units' directories, not other units',
    not a file that ioservice does not write.

    Parameters
    ----------
    root : StorageRoot or str
        The storage root (or a URI for `ioservice.fs.open_root`).
    dead_haunits : iterable of str
        HA units whose writers are gone for good (no writer may run again).
    live_haunits : iterable of str
        HA units whose checkpoints must stay restorable.
    live_files : iterable of str, optional
        Every file the live units' checkpoints reference, when the caller knows it
        (e.g. it just wrote those checkpoints: `sguard.rescale` has its tasks return
        their manifests' file lists); then no live manifest is read, so memory stays
        O(files) and not O(pages). Default: read every live manifest.

    Returns
    -------
    list of str
        Relative paths deleted (files; and directories removed), sorted.

    Raises
    ------
    InvalidNameError
        If a name is not a valid HA-unit name.
    ValueError
        If an HA unit is both dead and live (nothing is deleted).
    CheckpointDamagedError
        If a live unit's manifest cannot be read (nothing is deleted: what it
        references is unknown).
    StorageUnreachableError, StorageIOError

    Notes
    -----
    Runs while no live writer composes from a dead unit. Cost: one listing,
    one read per live manifest, one delete per file.
    """
    root = open_root(root) if isinstance(root, str) else root
    dead = {validate_name(h) for h in dead_haunits}
    live = {validate_name(h) for h in live_haunits}
    both = sorted(dead & live)
    if both:
        raise ValueError(f"HA unit(s) {', '.join(both)} are both dead and live")
    everything = list_checkpoints(root)
    referenced: set[str] = set(live_files) if live_files is not None else set()
    for c in everything if live_files is None else ():
        if c.haunit in live and c.has_manifest:
            try:
                man = read_manifest(root, c.name)
            except StorageNotFoundError:  # its own retention removed it meanwhile
                continue
            referenced.update(f.path for f in man.files)
    deleted: list[str] = []
    for c in everything:
        if c.haunit not in dead:
            continue
        mpath = f"{c.directory}/{MANIFEST_NAME}"
        if c.has_manifest:
            root.delete_file(mpath, missing_ok=True)
            deleted.append(mpath)
        left = 0
        for e in root.list_dir(c.directory, allow_not_found=True):
            if e.is_dir or e.relpath in referenced or not _ours(e.name):
                left += 1
                continue
            root.delete_file(e.relpath, missing_ok=True)
            deleted.append(e.relpath)
        if not left:
            root.delete_dir(c.directory, missing_ok=True)
            deleted.append(c.directory)
    return sorted(deleted)


_OURS = re.compile(r"^(w[0-9]{3,}(-[A-Za-z0-9_.]{1,64})?\.pages|manifest\.json|\.tmp-.*)$")


def _ours(name: str) -> bool:
    """Whether ioservice writes files of this name into a checkpoint directory."""
    return _OURS.match(name) is not None


def _haunit_of(checkpoint: str) -> str | None:
    parsed = parse_checkpoint_name(checkpoint)
    return parsed[0] if parsed is not None else None


def composed_manifest(parts: Sequence[tuple[Manifest, Sequence[tuple[int, int]]]],
                      page_bytes: int, haunit: str, *, seq: int = 0,
                      user_meta: Mapping[str, Any] | None = None) -> Manifest:
    """The manifest `CheckpointManager.compose` would write for `parts`, built in memory
    and never written: a reader that must see a composition not made yet loads its pages
    with `IOService.read_pages`. Raises what `compose` raises for bad `parts`; touches no
    storage."""
    meta = dict(user_meta or {})
    _check_json(meta, f"composition into {haunit!r}")
    table, files, structures, sources, depth, snapshot_id = _compose_rows(parts, page_bytes,
                                                                          haunit)
    man = Manifest(haunit=haunit, seq=seq, snapshot_id=snapshot_id, page_bytes=page_bytes,
                   full=False, depth=depth, base=None, files=files, pages=table,
                   structures=structures, user_meta=meta, composed_from=sources)
    man.validate(f"composition {man.name}")
    return man


def _compose_rows(parts: Sequence[tuple[Manifest, Sequence[tuple[int, int]]]], page_bytes: int,
                  haunit: str) -> tuple[PageTable, tuple[PageFile, ...], dict[str, int],
                                        tuple[str, ...], int, int]:
    """The rows of a composition (see `CheckpointManager.compose`): its page table, files
    (sorted by path), structures, source names, depth and snapshot id. Raises
    `CompositionError` (or a subclass) for any bad input; touches no storage."""
    where = f"composition into {haunit!r}"
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence) or not parts:
        raise CompositionError(f"{where}: parts must be a non-empty sequence of "
                               f"(Manifest, psid ranges), got {parts!r:.80}")
    all_ranges: list[tuple[int, int, int]] = []
    checked: list[tuple[Manifest, list[tuple[int, int]]]] = []
    for i, part in enumerate(parts):
        try:
            src, ranges = part
        except (TypeError, ValueError):
            raise CompositionError(f"{where}: part {i} is not a (Manifest, psid ranges) "
                                   f"pair") from None
        if not isinstance(src, Manifest):
            raise CompositionError(f"{where}: part {i} has a {type(src).__name__}, "
                                   f"not a Manifest")
        try:
            rs = check_psid_ranges(ranges, f"{where}: ranges of part {i} ({src.name})")
        except ValueError as exc:
            cls = OverlappingRangesError if "overlap" in str(exc) else CompositionError
            raise cls(str(exc)) from None
        if src.page_bytes != page_bytes:
            raise PageSizeMismatchError(
                f"{where}: part {i} ({src.name}) holds {src.page_bytes}-byte pages; the page "
                f"manager uses {page_bytes}-byte pages")
        if src.haunit == haunit:
            raise CompositionError(f"{where}: part {i} ({src.name}) is a checkpoint of the "
                                   f"HA unit composed into")
        checked.append((src, rs))
        all_ranges.extend((lo, hi, i) for lo, hi in rs)
    all_ranges.sort()
    for (lo0, hi0, i0), (lo1, hi1, i1) in zip(all_ranges, all_ranges[1:]):
        if lo1 < hi0:
            raise OverlappingRangesError(
                f"{where}: psid range [{lo0}, {hi0}) of part {i0} ({checked[i0][0].name}) "
                f"overlaps [{lo1}, {hi1}) of part {i1} ({checked[i1][0].name})")
    # rows and files of each part; files deduplicated by path across parts
    path_index: dict[str, int] = {}
    files: list[PageFile] = []
    tables: list[PageTable] = []
    structures: dict[str, int] = {}
    for i, (src, rs) in enumerate(checked):
        sub = src.pages.take(np.flatnonzero(psid_mask(src.pages.page_id, rs)))
        remap = np.zeros(len(src.files), dtype=np.uint32)
        for k in np.unique(sub.file).tolist():
            f = src.files[k]
            j = path_index.get(f.path)
            if j is None:
                j = path_index[f.path] = len(files)
                files.append(f)
            elif files[j].size_bytes != f.size_bytes:
                raise CompositionError(
                    f"{where}: page file {f.path} has {f.size_bytes} bytes in {src.name} but "
                    f"{files[j].size_bytes} in another part's checkpoint")
            remap[k] = j
        tables.append(PageTable(sub.page_id, remap[sub.file], sub.offset, sub.checksum))
        for name, psid in src.structures.items():
            if not any(lo <= int(psid) < hi for lo, hi in rs):
                continue
            if structures.setdefault(name, int(psid)) != int(psid):
                raise CompositionError(f"{where}: structure {name!r} has page set "
                                       f"{structures[name]} in one part and {psid} in part "
                                       f"{i} ({src.name})")
    table = PageTable.concat(tables)
    dup = np.flatnonzero(table.page_id[1:] == table.page_id[:-1])
    if len(dup):  # unreachable with disjoint psid ranges; kept as a guard
        raise DuplicatePagesError(f"{where}: page {int(table.page_id[dup[0]]):#x} is taken "
                                  f"from two parts")
    # files sorted by path: a rerun builds the same manifest whatever the part order
    order = sorted(range(len(files)), key=lambda k: files[k].path)
    rank = np.empty(max(len(files), 1), dtype=np.uint32)
    rank[order] = np.arange(len(order), dtype=np.uint32)
    table = PageTable(table.page_id, rank[table.file] if len(table) else table.file,
                      table.offset, table.checksum)
    sources = tuple(sorted({src.name for src, _ in checked}))
    depth = max(src.depth for src, _ in checked)
    snapshot_id = max(src.snapshot_id for src, _ in checked)
    return (table, tuple(files[k] for k in order), dict(sorted(structures.items())), sources,
            depth, snapshot_id)


def _check_json(meta: dict[str, Any], name: str) -> None:
    """Raise TypeError unless `meta` is JSON-able."""
    if not meta:
        return
    import json
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"checkpoint {name}: user_meta is not JSON-able: {exc}") from None


def _call_hook(fn: Callable[[Manifest], None], man: Manifest, what: str) -> None:
    """Call a hook; log (not raise) its failure: the checkpoint is already durable."""
    try:
        fn(man)
    except Exception as exc:  # noqa: BLE001
        logger.warning("checkpoint %s: %s hook raised: %s", man.name, what, exc)
