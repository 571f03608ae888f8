"""What runs inside a Spark task: one partition's micro-batch, exactly once.

`task_function` returns the function `sguard.spark.stateful` hands to
``mapInArrow``. For batch ``b`` of partition ``p`` it:

1. takes the partition's lock (`sguard.spark.placement`) and makes sure this
   host owns the partition: its local state carries the current ownership
   epoch, or it claims a new one (`sguard.spark.fencing`), which makes any
   other host's attempt stale, and then never trusts its local state;
2. brings the state to "after b-1" (`sguard.spark.versions.decide`): keep the
   pages this process holds, re-attach the pool file another worker left,
   roll back a wholly or partly applied ``b`` (in memory or in the file), or
   restore from the DFS checkpoint and replay the input log
   (`sguard.spark.recovery`), after composing the partition's first checkpoint
   when a start-up repartition left that to it (`sguard.rescale.compose_loaded`);
3. starts a checkpoint of that state when the policy says so (the prepare
   pause only; `sguard.spark.checkpointing`);
4. takes the rollback point (a snapshot, recorded in ``base.npy``) and marks
   the partition "applying b";
5. writes the input to the input log (an I/O thread, a file of its epoch)
   while the operator applies the batch; with a memory budget
   (`RuntimeConfig.memory_budget`) runs it one key group after another within the
   partition's share (`_BudgetPager`: evicting between key groups, each key group's
   pages read in together), and after it brings the partition's resident pages within its
   share of the executor's budget (`sguard.spark.budget.ExecutorBudget.after_batch`:
   a batch that wrote more pages than that fails here, before "applied", and does
   not count) and unmaps them from this worker; checks that it still owns the
   partition (else `FencedError`: the task fails, its result never counts);
   marks "applied b";
6. writes a metrics record (`sguard.spark.metrics`, asynchronously) and
   returns the output. The lock is released when the task ends, or when the
   checkpoint in flight is durable if that is later.

The runtime keeps, per Python worker process, the partitions it last ran (their
page managers and checkpoint managers), so a partition that stays in the same
worker needs no re-attach. What it keeps is used only while the query definition
is the same (`RuntimeConfig` equality: every task unpickles an equal copy) and,
at each batch, only while the partition's marker is the one this process wrote
and its ownership epoch still owns the partition: a batch run by another worker
(a move, a retry, a rollback, a speculative attempt) or a claim by another host
makes it re-attach or restore. A new definition or generation of the state (a
repartition) retires what the process kept of the old one.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import os
import signal
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ioservice import IOService, Manifest, StorageRoot, open_root
from mmm import PageManager, PoolFileError, Snapshot
from mmm.pagecache import PageCache
from sguard.spark import fencing, inputlog, metrics, watermark
from sguard.spark.budget import ExecutorBudget, MemoryBudget, executor_budget
from sguard.spark import ttl as _ttl
from sguard.spark.checkpointing import CheckpointConfig, PartitionCheckpointer
from sguard.spark.errors import NotStreamingError, StateAheadError
from sguard.spark.columns import KG_COLUMN
from sguard.spark.groupstate import KeyGroupedState, add_key_groups, open_state
from sguard.rescale import compose_loaded
from sguard.spark.recovery import rebuild_partition
from sguard.spark.operators import Operator
from sguard.spark.placement import Marker, PartitionSlot, boot_id, new_token, state_id
from sguard.spark.versions import Action, LocalStateDamaged, attach_at, decide
from sguard.statelayout import PSID_SHIFT, OperatorLayout

logger = logging.getLogger(__name__)

__all__ = ["RuntimeConfig", "Fault", "FaultPlan", "InjectedFault", "task_function",
           "run_partition_batch"]


class InjectedFault(RuntimeError):
    """Raised by a `Fault` of kind ``"raise"`` (tests and the demo only)."""


@dataclass(frozen=True)
class Fault:
    """One injected failure (tests and the demo): fires once, in the first attempt that gets there.

    kind: ``"kill"`` (SIGKILL the Python worker), ``"raise"`` (an exception),
    ``"delete_local"`` (the partition's local state vanishes, as on a lost
    host), ``"kill_in_checkpoint"`` (force a checkpoint and SIGKILL the worker
    while its pages are being written), ``"pause"`` (announce itself as
    ``paused-b<b>-p<p>`` in ``fault_dir`` and sleep until ``resume-b<b>-p<p>``
    appears there, so a test can kill the driver or a server mid-batch).
    point: ``"start"`` (before the batch is applied), ``"mid"`` (after half of
    its rows), ``"end"`` (after all of it, before the output is returned).
    """

    kind: str
    batch: int
    partition: int
    point: str = "mid"


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple[Fault, ...]
    fault_dir: str

    def fire(self, batch: int, partition: int, point: str) -> Fault | None:
        for i, f in enumerate(self.faults):
            if (f.batch, f.partition, f.point) == (batch, partition, point):
                try:
                    fd = os.open(os.path.join(self.fault_dir, f"fired-{i}"),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    continue
                os.write(fd, f"{f.kind} b{batch} p{partition} {point} pid {os.getpid()}\n".encode())
                os.close(fd)
                return f
        return None


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything a task needs (shipped to executors inside the mapInArrow closure)."""

    state_uri: str
    state_key: str
    layout: OperatorLayout
    operator: Operator = field(compare=False)
    """Not compared: an operator has no equality of its own and each task unpickles a new
    copy of it; `instance` stands for it."""
    key: str | list[str]
    input_schema: pa.Schema
    output_schema: pa.Schema
    local_dir: str
    page_bytes: int = 1 << 16
    capacity_bytes: int = 1 << 30
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    storage_options: dict[str, Any] = field(default_factory=dict)
    lock_timeout_s: float = 600.0
    metrics: bool = True
    faults: FaultPlan | None = None
    memory_budget: MemoryBudget | None = None
    """The executor's memory budget over its partitions' pages (`sguard.spark.budget`):
    with one, each partition's pool file (under `local_dir`, on a disk) is under an
    `mmm.pagecache.PageCache` enforced after every batch; None keeps every page in memory."""
    instance: str = ""
    """Which operator object this config was built with: a token drawn once per object
    where the config is built (the driver; `_operator_token`) and carried to every task by
    pickling. Equal configs are one query definition, so a Python worker keeps its
    partitions from task to task (`_runtime`); an operator built anew (perhaps edited)
    gets runtimes of its own."""

    def __post_init__(self) -> None:
        if not self.instance:
            object.__setattr__(self, "instance", _operator_token(self.operator))

    @property
    def sid(self) -> str:
        return state_id(self.state_key, self.layout.name, self.layout.generation)


# ------------------------------------------------------------------------- process state
_TOKENS: "weakref.WeakKeyDictionary[Operator, str]" = weakref.WeakKeyDictionary()
_TOKENS_LOCK = threading.Lock()


def _operator_token(op: Operator) -> str:
    """A token of the operator object `op` (the same for as long as it lives; a new one
    for an operator that cannot be weakly referenced or hashed)."""
    with _TOKENS_LOCK:
        try:
            tok = _TOKENS.get(op)
            if tok is None:
                tok = _TOKENS[op] = uuid.uuid4().hex
        except TypeError:
            tok = uuid.uuid4().hex
    return tok


_LOCK = threading.Lock()
_RUNTIMES: dict[str, "_StateRuntime"] = {}
_IO: IOService | None = None
_BG: cf.ThreadPoolExecutor | None = None


def _io(n: int) -> IOService:
    global _IO
    if _IO is None:
        _IO = IOService(n)
    return _IO


def _bg() -> cf.ThreadPoolExecutor:
    global _BG
    if _BG is None:
        _BG = cf.ThreadPoolExecutor(2, thread_name_prefix="sguard-bg")
    return _BG


@atexit.register
def _shutdown() -> None:  # pragma: no cover - process exit
    for rt in list(_RUNTIMES.values()):
        for part in list(rt.parts.values()):
            try:
                if part.ckpt is not None:
                    part.ckpt.wait(30)
            except Exception:  # noqa: BLE001
                pass
    if _BG is not None:
        _BG.shutdown(wait=True)


class _StateRuntime:
    def __init__(self, cfg: RuntimeConfig) -> None:
        self.cfg = cfg
        self.root: StorageRoot = open_root(cfg.state_uri, **cfg.storage_options)
        self.parts: dict[int, _Partition] = {}

    def partition(self, p: int) -> "_Partition":
        part = self.parts.get(p)
        if part is None:
            part = self.parts[p] = _Partition(self, p)
        return part

    def of_state(self, cfg: RuntimeConfig) -> bool:
        """Whether `cfg` runs the state this runtime ran (any generation, any definition)."""
        return (self.cfg.state_key, self.cfg.layout.name) == (cfg.state_key, cfg.layout.name)

    def retire(self) -> None:
        """Let every partition go that is not running a task now: its checkpoint in flight
        lands, its handles are dropped, its lock released."""
        for part in list(self.parts.values()):
            part.retire()


def _runtime(cfg: RuntimeConfig) -> _StateRuntime:
    """This process's runtime of `cfg`: the one it kept when `cfg` equals its config (the
    same query definition: every partition then checks at each batch that what it holds
    is still the partition's state, `_Partition.run`), else a new one. A new one retires
    the runtimes this process kept of the same state (another definition, or another
    generation after a repartition): what they hold is not to be used again."""
    with _LOCK:
        rt = _RUNTIMES.get(cfg.sid)
        if rt is not None and rt.cfg == cfg:
            return rt
        old = [_RUNTIMES.pop(s) for s, r in list(_RUNTIMES.items())
               if s == cfg.sid or r.of_state(cfg)]
        rt = _RUNTIMES[cfg.sid] = _StateRuntime(cfg)
    for r in old:
        r.retire()
    return rt


class _Partition:
    """One partition as seen by this process."""

    def __init__(self, rt: _StateRuntime, p: int) -> None:
        self.rt, self.cfg, self.p = rt, rt.cfg, p
        self.slot = PartitionSlot(self.cfg.local_dir, self.cfg.sid, p)
        self.haunit = self.cfg.layout.haunit(p)
        self.claim: fencing.Claim | None = None
        self.pm: PageManager | None = None
        self.state: KeyGroupedState | None = None
        self.ckpt: PartitionCheckpointer | None = None
        self.snap: Snapshot | None = None
        self.token: str | None = None
        self.durable = -1
        self.cache: PageCache | None = None
        self.budget_name = (f"{p} of {self.cfg.layout.name!r} (generation "
                            f"{self.cfg.layout.generation}) at {self.cfg.state_uri}")
        self._mu = threading.Lock()
        self._task = False
        self._pending_metrics: list[cf.Future[None]] = []
        self.compose_ms = 0.0

    # -- lock bookkeeping ------------------------------------------------------------------
    def _maybe_release(self) -> None:
        with self._mu:
            if self._task or (self.ckpt is not None and self.ckpt.in_flight is not None):
                return
            self.slot.release()

    def retire(self) -> None:
        """Its runtime was replaced (`_runtime`): drop the handles and let the lock go,
        unless a task is running on it now (it ends as usual)."""
        with self._mu:  # not held while dropping: the checkpoint's callback takes it
            if self._task:
                return
        self._drop()  # waits for the checkpoint in flight
        self._maybe_release()

    # -- state handles -----------------------------------------------------------------------
    def _drop(self) -> None:
        """Forget this process's handles (never writing to the pool file: it may be stale)."""
        if self.ckpt is not None:
            self.ckpt.close()
        if self.cache is not None:
            self._budget().unregister(self.budget_name)
            self.cache.close()
        self.pm = self.state = self.ckpt = self.snap = None
        self.cache = None
        self.token = None

    def _budget(self) -> ExecutorBudget:
        """This executor's budget (`sguard.spark.budget.executor_budget`): its partitions
        report their resident bytes under ``<local_dir>/_budget``."""
        mb = self.cfg.memory_budget
        assert mb is not None
        return executor_budget(os.path.join(self.cfg.local_dir, "_budget"), mb.resolve())

    def _bind(self, pm: PageManager, durable: int, last: int) -> None:
        cfg = self.cfg
        if cfg.memory_budget is not None:  # may raise (a pool on tmpfs): nothing bound yet
            cache = PageCache(pm.pool, max(cfg.memory_budget.resolve(), 2 * pm.pool.page_bytes),
                              name=f"partition {self.budget_name}")
            self._budget().register(self.budget_name, cache)
            self.cache = cache
        self.pm = pm
        self.state = self._open(pm)
        meta = {"operator": cfg.layout.operator, "name": cfg.layout.name,
                "generation": cfg.layout.generation, "partition": self.p,
                "num_partitions": cfg.layout.num_partitions,
                "key_groups": list(cfg.layout.key_group_range(self.p)), "psid_shift": PSID_SHIFT}
        self.ckpt = PartitionCheckpointer(pm, self.rt.root, self.haunit,
                                          cfg.checkpoint, _io(cfg.checkpoint.io_workers), meta,
                                          self._durable, self.claim)
        self.ckpt.seed(durable, last)
        self.durable = durable

    def _open(self, pm: PageManager) -> KeyGroupedState:
        """The operator state of this partition's key groups on `pm`."""
        cfg = self.cfg
        return open_state(cfg.operator, pm, cfg.input_schema, cfg.key,
                          cfg.layout.key_group_range(self.p))

    def _durable(self, batch: int, prev: int, man: Manifest) -> None:
        """On an I/O thread: a checkpoint of the state after `batch` is durable."""
        self.durable = max(self.durable, batch)
        claim = self.claim
        try:
            # only the owner deletes: a stale writer's trim could remove log files the
            # new owner's recovery needs (fencing module docstring)
            if claim is not None and fencing.is_owner(self.rt.root, self.haunit, claim):
                lay = self.cfg.layout
                inputlog.trim(self.rt.root, prev, lay.generation, self.p, lay.num_partitions)
                if prev >= claim.batch - 1:  # the kept checkpoints and their log are ours
                    fencing.collect(self.rt.root, self.haunit, claim)
        except Exception as exc:  # noqa: BLE001 - trimming is best effort
            logger.warning("partition %d: input log trim failed: %s", self.p, exc)
        if self.cfg.metrics:
            try:
                metrics.write_checkpoint_record(self.rt.root, self.p, {
                    "checkpoint_seq": man.seq, "batch": batch, "written_bytes": man.written_bytes,
                    "pages": man.n_pages, "full": man.full})
            except Exception as exc:  # noqa: BLE001
                logger.warning("partition %d: checkpoint metrics failed: %s", self.p, exc)

    def _write_marker(self, status: str, batch: int, base: int | None) -> None:
        self.token = new_token()
        c = self.claim
        started = self.ckpt.last_batch if self.ckpt is not None else -1
        self.slot.write_marker(Marker(self.token, status, batch, base, self.durable, boot_id(),
                                      c.epoch if c else 0, c.token if c else "", started))

    def _restore(self, b: int) -> int:
        """Rebuild "after b-1" from the DFS: the newest checkpoint that the input log can
        take there, plus that log (`sguard.spark.recovery`). Returns the number of batches
        replayed."""
        cfg = self.cfg
        self._drop()
        self.slot.wipe()
        pm = PageManager(cfg.page_bytes, cfg.capacity_bytes, path=self.slot.pool_path)
        self._bind(pm, -1, -1)
        ckpt = self.ckpt
        assert ckpt is not None
        fence = fencing.read_claims(self.rt.root, self.haunit)
        try:
            # a repartition committed lazily (`sguard.spark.rescaling`): the partition's
            # first task composes its first checkpoint from the sources' pages, loading
            # them as it goes (each page read once), then replays as after any restore
            t = time.perf_counter()
            composed, loaded = compose_loaded(ckpt.mgr, self.rt.root, cfg.layout, self.p,
                                              storage_options=cfg.storage_options,
                                              io=_io(cfg.checkpoint.io_workers))
            if composed:
                self.compose_ms = (time.perf_counter() - t) * 1e3
            first = [] if loaded is None else [loaded]

            def restore(before: int | None) -> Manifest | None:
                """The composition just loaded first, then as usual."""
                return first.pop() if before is None and first else ckpt.restore(before)
            got = rebuild_partition(pm, self.rt.root, cfg.layout, self.p, cfg.operator,
                                    cfg.input_schema, b - 1, restore, fence)
        except BaseException:
            self._drop()
            self.slot.wipe()
            raise
        self.state = got.state
        _clock_above_pages(pm)
        ckpt.restored(got.manifest, got.checkpoint_batch)
        self.durable = got.checkpoint_batch
        self._flush()
        self._write_marker("applied", b - 1, None)
        return max(0, b - 1 - got.checkpoint_batch)

    def _own(self, b: int, marker: Marker | None) -> bool:
        """Make sure this host owns the partition for batch `b`; True if it had to claim
        it now (then its local state is not to be trusted: another host may have run
        batches since)."""
        view = fencing.read_claims(self.rt.root, self.haunit)
        if marker is not None and marker.epoch > 0 and view.owns(marker.epoch, marker.claim):
            if self.claim is None or self.claim.epoch != marker.epoch:
                o = view.owner()
                assert o is not None
                self.claim = o
            return False
        self._drop()
        self.claim = fencing.claim(self.rt.root, self.haunit, b)
        return True

    def _flush(self) -> None:
        assert self.pm is not None
        self.pm.flush_structures()  # per-record buffers into pages (no msync: not needed)

    # -- one batch ------------------------------------------------------------------------------
    def run(self, b: int, table: pa.Table) -> pa.Table:
        cfg, slot = self.cfg, self.slot
        t0 = time.perf_counter()
        log_fut: cf.Future[int] | None = None
        with self._mu:
            self._task = True
        try:
            waited = slot.acquire(cfg.lock_timeout_s)
            if _ttl.needs_batch_time(cfg.operator):  # the time an earlier run of b recorded
                table = _ttl.with_batch_time(table, inputlog.recorded_batch_time_ms(
                    self.rt.root, b, cfg.layout.generation, self.p))
            event_time = getattr(cfg.operator, "event_time", None)
            if event_time is not None:  # the query's watermark (`sguard.spark.watermark`)
                table = watermark.stamp(table, self.rt.root, b, event_time[1])
            self._fault(b, "start", table)
            marker = slot.read_marker()
            if self._own(b, marker):
                old = "none" if marker is None else marker.epoch
                action, reason = Action.RESTORE, (f"took the partition over (epoch "
                                                  f"{self.claim.epoch}, local state's {old})")  # type: ignore[union-attr]
            else:
                d = decide(marker, b, self.token if self.pm is not None else None,
                           slot.has_pool(), self.snap is not None)
                action, reason = d.action, d.reason
            replayed = 0
            self.compose_ms = 0.0  # of recovery_ms: composing the first checkpoint
            t_rec = time.perf_counter()
            if action is Action.ROLLBACK_CACHED:
                assert self.pm is not None and self.snap is not None
                self.pm.rollback(self.snap)
                self.snap = None
                self.state = self._open(self.pm)
            elif action in (Action.ATTACH, Action.ROLLBACK_FILE):
                assert marker is not None
                self._drop()
                base = slot.read_base() if action is Action.ROLLBACK_FILE else None
                try:
                    if action is Action.ROLLBACK_FILE and base is None:
                        raise LocalStateDamaged("rollback point missing")
                    pm = attach_at(slot.pool_path, cfg.page_bytes, base)
                    self._bind(pm, marker.durable_batch, marker.started_batch)
                except (LocalStateDamaged, PoolFileError) as exc:
                    action, reason = Action.RESTORE, f"{reason}; local state unusable ({exc})"
                    self._drop()
            if action is Action.RESTORE:
                replayed = self._restore(b)
                if self.durable < 0 and b == 0:
                    action, reason = Action.FRESH, "first batch"
            recovery_ms = (time.perf_counter() - t_rec) * 1e3
            assert self.pm is not None and self.state is not None and self.ckpt is not None
            # 3. checkpoint "after b-1" (committed, since b arrived) when due
            prepare_ms = 0.0
            ck_parts: dict[str, Any] = {}
            t_ck = time.perf_counter()
            forced = self._fault(b, "checkpoint", table)
            if forced:  # die once the pages are written, as the manifest is about to be
                self.ckpt.mgr.root = _KillBeforeManifest(self.ckpt.mgr.root)  # type: ignore[assignment]
            if forced or self.ckpt.due(b - 1):
                pending = self.ckpt.checkpoint(b - 1, force=forced)
                ck_parts = {**self.ckpt.last_call_ms, "checkpoint_base": self.ckpt.base_source}
                if pending is not None:
                    prepare_ms = pending.prepare_s * 1e3
                    pending.add_done_callback(self._checkpoint_landed(self.cache))
                    if forced:
                        pending.exception(60)
                        raise AssertionError("the checkpoint fault did not fire")
            # the whole start of a checkpoint: prepare + adopting a base + page versions
            checkpoint_call_ms = (time.perf_counter() - t_ck) * 1e3
            # 4. rollback point "after b-1"
            t_snap = time.perf_counter()
            if self.snap is not None:
                self.snap.release()
            self.snap = self.pm.chkpt()
            slot.write_base(self.snap.page_ids, self.snap.frames)
            self._write_marker("applying", b, b - 1)
            snapshot_ms = (time.perf_counter() - t_snap) * 1e3
            # 5. log the input (I/O thread) while applying it
            assert self.claim is not None
            log_fut = _bg().submit(inputlog.write_input, self.rt.root, table, b,
                                   cfg.layout.generation, self.p, cfg.layout.num_partitions,
                                   cfg.key, self.claim.epoch)
            t_apply = time.perf_counter()
            if cfg.faults is not None and self._has_fault(b, "mid"):
                self.state.apply(table.slice(0, table.num_rows // 2), b)
                self._flush()
                self._fault(b, "mid", table)  # kill / raise: the next attempt rolls back
                self.pm.rollback(self.snap)     # the fault let us live: undo the half batch
                self.snap = self.pm.chkpt()
                slot.write_base(self.snap.page_ids, self.snap.frames)
                self.state = self._open(self.pm)
            pager = self._pager()
            out = self.state.apply(table, b, pager)
            self._flush()
            apply_ms = (time.perf_counter() - t_apply) * 1e3
            # may raise: b then does not count
            budget_ms, mem = self._after_batch(pager)
            t_log = time.perf_counter()
            log_bytes = log_fut.result()
            log_wait_ms = (time.perf_counter() - t_log) * 1e3
            # still the owner once the input is logged? else this attempt must not count
            fencing.check_owner(self.rt.root, self.haunit, self.claim, f"batch {b}")
            if event_time is not None:  # what this partition saw, for batch b + 1's watermark
                watermark.record(self.rt.root, b, self.p, table, event_time[0])
            self._write_marker("applied", b, b - 1)
            self._fault(b, "end", table)
            out = out.cast(cfg.output_schema) if out.schema != cfg.output_schema else out
            if cfg.metrics:
                self._metrics({
                    "batch": b, "partition": self.p, "rows_in": table.num_rows,
                    "rows_out": out.num_rows, "state_keys": self.state.n_keys(),
                    "state_pages": self.pm.stats()["used_frames"], "apply_ms": apply_ms,
                    "prepare_ms": prepare_ms, "checkpoint_call_ms": checkpoint_call_ms,
                    **ck_parts,
                    "snapshot_ms": snapshot_ms,
                    "log_wait_ms": log_wait_ms, "log_bytes": log_bytes,
                    "total_ms": (time.perf_counter() - t0) * 1e3,
                    "checkpoint_lag": (b - self.durable), "durable_batch": self.durable,
                    "recovery": action.value, "reason": reason, "recovery_ms": recovery_ms,
                    "replayed_batches": replayed, "lock_wait_ms": waited * 1e3,
                    "compose_ms": self.compose_ms, "budget_ms": budget_ms, **mem,
                    **(pager.figures() if pager is not None else {}),
                    "pid": os.getpid()})
            return out
        finally:
            if log_fut is not None and not log_fut.done():
                cf.wait([log_fut])  # a retry must find the log (and its recorded time) final
            with self._mu:
                self._task = False
            self._maybe_release()

    def _checkpoint_landed(self, cache: PageCache | None) -> Callable[[Any], None]:
        """The callback of a checkpoint in flight: with a memory budget, unmap the pages
        its writer faulted in (so the worker running the partition next can evict
        them); then let the lock go when no task runs."""
        def done(_pending: Any) -> None:
            if cache is not None:
                try:
                    cache.unmap()  # the cache holds the pool, hence its mapping
                except OSError as exc:  # only memory stays mapped: never fails a checkpoint
                    logger.warning("partition %d: unmapping after a checkpoint: %s", self.p,
                                   exc)
            self._maybe_release()
        return done

    def _pager(self) -> _BudgetPager | None:
        """With a memory budget: the pager this batch's key groups run under."""
        if self.cache is None or self.pm is None:
            return None
        return _BudgetPager(self._budget(), self.budget_name, self.cache)

    def _after_batch(self, pager: _BudgetPager | None) -> tuple[float, dict[str, int]]:
        """With a memory budget: bring the partition's resident pages within its share
        (`ExecutorBudget.after_batch`; the batch's pages are the frames written since the
        pager last brought them within it), then unmap them from this process so that the worker
        running the partition next can evict them. Returns (ms taken, residency figures
        for the metrics record); (0, {}) without a budget.

        Raises
        ------
        WorkingSetTooLargeError
            If the batch wrote more pages than the partition may keep in memory.
        """
        if self.cache is None or pager is None:
            return 0.0, {}
        t = time.perf_counter()
        eb = self._budget()
        eb.after_batch(self.budget_name, written_since=pager.clock0)
        self.cache.unmap()
        st = self.cache.stats()
        return (time.perf_counter() - t) * 1e3, {
            "resident_bytes": st["resident_bytes"], "evicted_bytes": st["evicted_bytes"],
            "state_bytes": st["state_bytes"], "live_bytes": st["live_bytes"],
            "budget_bytes": st["budget_bytes"],
            "executor_budget_bytes": eb.budget_bytes,
            "evicted_frames": st["evicted_frames_total"],
            "batch_pages_bytes": self.cache.last_working_set_bytes}

    def _metrics(self, rec: dict[str, Any]) -> None:
        done = [f for f in self._pending_metrics if f.done()]
        for f in done:
            self._pending_metrics.remove(f)
        self._pending_metrics.append(_bg().submit(_write_metrics, self.rt.root, rec))

    # -- fault injection (tests and demo) ----------------------------------------------------------
    def _has_fault(self, b: int, point: str) -> bool:
        fp = self.cfg.faults
        return fp is not None and any(
            (f.batch, f.partition, f.point) == (b, self.p, point)
            and not os.path.exists(os.path.join(fp.fault_dir, f"fired-{i}"))
            for i, f in enumerate(fp.faults))

    def _fault(self, b: int, point: str, table: pa.Table) -> bool:
        fp = self.cfg.faults
        if fp is None:
            return False
        f = fp.fire(b, self.p, point)
        if f is None:
            return False
        logger.warning("injected fault %s at batch %d partition %d (%s)", f.kind, b, self.p, point)
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f.kind == "raise":
            raise InjectedFault(f"injected failure at batch {b}, partition {self.p} ({point})")
        if f.kind == "delete_local":
            self._drop()
            self.slot.wipe()
            return False
        if f.kind == "pause":
            paused = os.path.join(fp.fault_dir, f"paused-b{b}-p{self.p}")
            with open(paused + ".tmp", "w") as fh:  # renamed: a watcher never reads it empty
                fh.write(str(os.getpid()))
            os.replace(paused + ".tmp", paused)
            parent = os.getppid()
            resume = os.path.join(fp.fault_dir, f"resume-b{b}-p{self.p}")
            # until resumed (or 10 minutes, a hang guard: a test on a loaded machine may
            # take minutes before it resumes, and must find the task still paused); die
            # with the parent
            for _ in range(12000):
                time.sleep(0.05)
                if os.getppid() != parent:
                    os._exit(1)
                if os.path.exists(resume):
                    break
            return False
        return f.kind == "kill_in_checkpoint"


def _clock_above_pages(pm: PageManager) -> None:
    """Start `pm`'s page clock above the version of every page it holds.

    Pages loaded from a checkpoint (a restore; a first task composing after a repartition)
    keep the versions their writer's pool gave them, which may lie above this pool's
    clock. Every page written from here on then takes a version above every version the
    next checkpoint records (``ckpt.npz``): a worker that re-attaches the pool file takes
    a page for unchanged since that checkpoint only when it is (`sguard.spark.checkpointing`).
    """
    pool = pm.pool
    used = np.flatnonzero(pool.state)  # live pages, and frames snapshots still hold
    if len(used):
        pool.clock = max(int(pool.clock), int(pool.headers["version"][used].max()) + 1)


class _KillBeforeManifest:
    """A StorageRoot proxy that SIGKILLs the process instead of writing a manifest."""

    def __init__(self, root: StorageRoot) -> None:
        self._root = root

    def write_atomic(self, relpath: str, data: Any) -> None:
        if relpath.endswith("manifest.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        self._root.write_atomic(relpath, data)

    def write_new(self, relpath: str, data: Any) -> None:
        if relpath.endswith("manifest.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        self._root.write_new(relpath, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._root, name)


def _write_metrics(root: StorageRoot, rec: dict[str, Any]) -> None:
    try:
        metrics.write_batch_record(root, rec)
    except Exception as exc:  # noqa: BLE001 - metrics never fail a batch
        logger.warning("metrics record failed: %s", exc)


class _BudgetPager:
    """A batch's key groups under a memory budget (`KeyGroupedState.apply`'s pager).

    Before each key group: when the frames the key groups since the partition was last
    brought within its allowance said they read (plus the pages written beyond them),
    and those the next one says it reads, would pass half the allowance, it is brought
    within it now (the other half is room for what a key group writes beyond what it
    said, and for the structures' metadata written at the end of the batch) (`ExecutorBudget.after_batch` of the pages
    written since: one key group's pages more than the allowance raise
    `WorkingSetTooLargeError`); then the key group's frames come in together
    (`ExecutorBudget.before_batch`). So a batch needs one key group's pages at a time
    within the budget, not all of them at once, and its output is the same."""

    def __init__(self, budget: ExecutorBudget, name: str, cache: PageCache) -> None:
        self.eb, self.name, self.cache = budget, name, cache
        self.pool = cache.pool
        self.clock0 = int(self.pool.clock)
        self.read_ahead = 0
        self.announced = 0
        self.rounds = 0

    def before_group(self, frames: Any) -> None:
        n = 0 if frames is None else len(frames)
        # the working set since the last round: the frames announced (read or not) and
        # those written beyond them (new pages: a map grows)
        used = self.announced + int(self.pool.clock) - self.clock0
        if used and used + n > self.cache.budget_bytes // self.pool.page_bytes // 2:
            self.eb.after_batch(self.name, written_since=self.clock0)
            self.clock0 = int(self.pool.clock)
            self.announced = 0
            self.rounds += 1
        if n:
            self.read_ahead += self.eb.before_batch(self.name, frames)
            self.announced += n

    def figures(self) -> dict[str, int]:
        """For the batch's metrics record."""
        return {"read_ahead_frames": self.read_ahead, "budget_rounds_in_batch": self.rounds}


def run_partition_batch(cfg: RuntimeConfig, partition: int, batch: int, table: pa.Table
                        ) -> pa.Table:
    """Apply one batch to one partition (what a task does; also usable without Spark).

    Rows without the key-group column (callers without Spark) get it computed here, with
    the function Spark computes it with on the JVM side (`sguard.keygroups.key_group_of`);
    rows of key groups the partition does not own are refused (`KeyGroupRoutingError`).
    """
    if KG_COLUMN not in table.column_names:
        table = add_key_groups(table, cfg.key, cfg.layout.key_groups)
    return _runtime(cfg).partition(partition).run(batch, table)


def task_function(cfg: RuntimeConfig
                  ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The function for ``mapInArrow``: reads the batch id and partition from the TaskContext."""

    def sguard_stateful(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext
        ctx = TaskContext.get()
        bid = ctx.getLocalProperty("streaming.sql.batchId") if ctx is not None else None
        if ctx is None or bid is None:
            raise NotStreamingError(
                "sguard.spark.stateful ran outside a streaming micro-batch (no "
                "'streaming.sql.batchId'); use it on a streaming DataFrame (readStream)")
        rbs = list(batches)
        table = (pa.Table.from_batches(rbs) if rbs else cfg.input_schema.empty_table())
        if KG_COLUMN in table.column_names:  # routed by key group: keep its column
            kg = table.column(KG_COLUMN).cast(pa.int32())
            rest = table.drop_columns([KG_COLUMN])
            if rest.schema != cfg.input_schema:
                rest = rest.cast(cfg.input_schema)
            table = rest.append_column(pa.field(KG_COLUMN, pa.int32(), nullable=False), kg)
        elif table.schema != cfg.input_schema:
            table = table.cast(cfg.input_schema)
        out = run_partition_batch(cfg, ctx.partitionId(), int(bid), table)
        yield from out.to_batches(max_chunksize=65536)

    return sguard_stateful
