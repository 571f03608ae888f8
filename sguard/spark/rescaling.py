"""Repartitioning a query's state at start-up, when its partition count changed.

`sguard.spark.stateful` calls `repartition_at_startup` on the driver, before
the query starts, when it is given a ``num_partitions`` different from the
stored state's. Three steps, each restartable:

1. **wait for the old partitions on this host**: the local locks of the old
   generation's partitions (local mode, or an executor on the driver's host)
   are taken, so a checkpoint that a stopped query's Python worker still has
   in flight lands before its HA unit is read;
2. **align the sources** (`align_sources`), for operators with per-partition
   state that a repartition merges (a watermark: their routing rules
   ``replicate`` a structure, `sguard.rescale.DEFAULT_ROUTING`). Each
   partition's newest durable checkpoint may be at another batch
   (checkpoints are asynchronous and may fail or be lost), while the merged
   watermark is the maximum over the sources: replaying a lagging key's rows
   behind it would drop them as late. So every partition is restored, replays
   its own input log up to ``T`` and is checkpointed at ``T`` (an ordinary
   checkpoint of its HA unit, what the runtime itself does after a failure).
   ``T`` is the batch before the newest logged one: Spark started that one, so
   it committed ``T``; the new partitions then replay at most one batch. For
   the other operators (per-key state only) the sources stay where they are:
   `sguard.rescale` records each key's replay position and the new
   partitions replay exactly the rows their keys missed;
3. **repartition** (`sguard.rescale.repartition`): the aligned checkpoints
   are split by key into the partitions of the next generation; writing the
   layout document commits it. The new partitions restore from them when the
   query runs their first batch and replay the logged input after ``T`` (the
   batches nobody checkpointed, filtered to their keys,
   `sguard.spark.inputlog.read_input`).

``sguard state repartition`` runs steps 2 and 3 too (`align_offline`).

A crash anywhere leaves the old generation the state (step 2 only adds
checkpoints of the same state, step 3 commits last), so rerunning the query
with the same ``num_partitions`` completes the work. Afterwards the old
generation's local files on this host are deleted.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from ioservice import (CheckpointManager, CheckpointPolicy, IOService, StorageRoot,
                       list_checkpoints, read_manifest)
from ioservice.errors import StorageNotFoundError
from mmm import PageManager
from sguard.spark import inputlog
from sguard.spark import fencing
from sguard.spark.checkpointing import latest_checkpoint_batch
from sguard.spark.recovery import rebuild_partition
from sguard.spark.operators import Operator
from sguard.spark.placement import PartitionSlot, state_id
from sguard.statelayout import OperatorLayout, read_layout, schema_from_layout

logger = logging.getLogger(__name__)

__all__ = ["StartupRescale", "repartition_at_startup", "align_sources", "align_offline",
           "needs_alignment", "pending_repartition"]


@dataclass(frozen=True)
class StartupRescale:
    """What `repartition_at_startup` did (seconds per step)."""

    from_partitions: int
    num_partitions: int
    generation: int
    batch: int
    """The batch every source was aligned to (-1: none, or not aligned)."""
    aligned: dict[int, int] = field(default_factory=dict)
    """Source partitions brought forward: ``{partition: batches replayed}``."""
    wait_s: float = 0.0
    align_s: float = 0.0
    repartition_s: float = 0.0
    seconds: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)


def pending_repartition(root: StorageRoot) -> int | None:
    """The partition count of an interrupted repartition under `root` (None: none pending)."""
    from sguard.rescale import MARKER_FILE
    try:
        doc = json.loads(root.read_bytes(MARKER_FILE))
    except (StorageNotFoundError, ValueError):
        return None
    lay = read_layout(root)
    if not isinstance(doc, dict) or lay is None \
            or int(doc.get("to_generation", -1)) <= lay.generation:
        return None  # a committed run's leftover marker
    n = doc.get("num_partitions")
    return int(n) if isinstance(n, int) else None


def needs_alignment(layout: OperatorLayout) -> bool:
    """Whether a repartition merges per-partition state (a ``replicate`` routing rule)."""
    from sguard.rescale import DEFAULT_ROUTING
    table = layout.extra.get("routing")
    if not isinstance(table, dict):
        table = DEFAULT_ROUTING.get(layout.operator, {})
    return any(isinstance(r, dict) and "replicate" in r for r in table.values())


def align_sources(root: StorageRoot, layout: OperatorLayout, operator: Operator,
                  schema: pa.Schema, *, page_bytes: int, capacity_bytes: int, keep: int = 2,
                  io: IOService | None = None) -> tuple[int, dict[int, int]]:
    """Bring every partition's durable checkpoint to one batch ``T``: the batch before
    the newest one in the input log (committed by Spark, since it started the next),
    or the newest checkpoint's if later.

    Returns ``(T, {partition: batches replayed})`` (-1: no checkpoint and no log).

    Raises
    ------
    sguard.spark.errors.InputLogGapError
        If a partition's input log does not reach ``T`` (nothing written for
        that partition).
    """
    P = layout.num_partitions
    at = {p: latest_checkpoint_batch(root, layout.haunit(p)) for p in range(P)}
    logged = inputlog.logged_batches(root)
    T = max(max(at.values()), logged[-1] - 1 if logged else -1)
    done: dict[int, int] = {}
    own = io is None
    io = io or IOService(2)
    try:
        for p, c in sorted(at.items()):
            if c == T:
                continue
            infos = [i for i in list_checkpoints(root, layout.haunit(p)) if i.has_manifest]
            pb = read_manifest(root, infos[-1].name).page_bytes if infos else page_bytes
            pm = PageManager(pb, capacity_bytes)
            hu = layout.haunit(p)
            claim = fencing.claim(root, hu, T + 1)  # any writer still around is stale now
            mgr = CheckpointManager(pm, root, hu, io=io, check_root=False,
                                    policy=CheckpointPolicy(keep=keep, full_every=8),
                                    seq_range=fencing.seq_range(claim.epoch), exclusive=True)
            try:
                got = rebuild_partition(pm, root, layout, p, operator, schema, T,
                                        lambda before: mgr.restore(before_seq=before),
                                        fencing.read_claims(root, hu))
                man, c = got.manifest, got.checkpoint_batch
                mgr.adopt_base(man)
                pm._flush_structures()
                meta = {"operator": layout.operator, "name": layout.name,
                        "generation": layout.generation, "partition": p, "num_partitions": P,
                        "batch_id": T}
                pending = mgr.checkpoint(meta, full=True if man is None else None)
                if pending is not None:
                    pending.result()
                done[p] = T - c
            finally:
                mgr.close()
    finally:
        if own:
            io.shutdown()
    return T, done


def align_offline(root: StorageRoot, *, capacity_bytes: int = 1 << 30,
                  keep: int = 2) -> tuple[int, dict[int, int]] | None:
    """`align_sources` for ``sguard state repartition``: the operator and its input
    schema come from the layout document. None when the operator does not need it (or
    is a custom operator this process does not know: `register_operator`)."""
    from sguard.spark.operators import operator_from_params
    layout = read_layout(root)
    if layout is None or not needs_alignment(layout) or "arrow_schema" not in layout.extra:
        return None
    try:
        op = operator_from_params(layout.operator, layout.schema.get("params", {}))
    except (ValueError, TypeError):
        return None
    return align_sources(root, layout, op, schema_from_layout(layout), page_bytes=1 << 16,
                         capacity_bytes=capacity_bytes, keep=keep)


def repartition_at_startup(root: StorageRoot, layout: OperatorLayout, operator: Operator,
                           schema: pa.Schema, num_partitions: int, *, state_key: str,
                           local_dir: str, page_bytes: int, capacity_bytes: int,
                           keep: int = 2, lock_timeout_s: float = 600.0,
                           say: Callable[[str], None] | None = None) -> StartupRescale:
    """Repartition the state of `layout` under `root` into `num_partitions` (see the module
    docstring); returns what was done.

    Raises
    ------
    sguard.rescale.RescaleError
        The state cannot be repartitioned (e.g. leftovers not made by a
        repartition); the old generation is still the state.
    sguard.spark.errors.InputLogGapError
        A lagging partition cannot be brought forward.
    """
    from sguard import rescale

    t0 = time.perf_counter()
    say = say or (lambda msg: None)
    old_sid = state_id(state_key, layout.name, layout.generation)
    slots = [PartitionSlot(local_dir, old_sid, p) for p in range(layout.num_partitions)]
    slots = [s for s in slots if os.path.isdir(s.dir)]
    try:
        for s in slots:  # a stopped query's worker may still be writing a checkpoint
            s.acquire(lock_timeout_s)
        t1 = time.perf_counter()
        T, aligned = -1, dict[int, int]()
        if needs_alignment(layout):
            T, aligned = align_sources(root, layout, operator, schema, page_bytes=page_bytes,
                                       capacity_bytes=capacity_bytes, keep=keep)
        if aligned:
            say(f"brought partition(s) {sorted(aligned)} forward to batch {T} "
                f"({sum(aligned.values())} batch(es) replayed from the input log)")
        t2 = time.perf_counter()
        res = rescale.repartition(root, num_partitions, on_progress=say)
        t3 = time.perf_counter()
        for s in slots:  # the old generation's local state is dead now
            s.wipe()
    finally:
        for s in slots:
            s.release()
    return StartupRescale(layout.num_partitions, num_partitions, res.generation, T, aligned,
                          wait_s=t1 - t0, align_s=t2 - t1, repartition_s=t3 - t2,
                          seconds=time.perf_counter() - t0, phases_s=dict(res.phases_s))
