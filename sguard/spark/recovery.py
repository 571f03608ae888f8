"""Rebuilding one partition's state from the state URI: a checkpoint plus the input log.

Used by the runtime when a partition has no usable local state
(`sguard.spark.runtime`) and by the readers (`sguard.spark.state`), so both
rebuild the same state the same way.

Recovery never gives up early. It tries, newest first, every checkpoint that
loads (`ioservice.restore` already skips damaged ones) and replays the input
log from the batch that checkpoint holds; if the log cannot take it to the
target batch (a file missing, unreadable, or only a stale owner's), it falls
back to the next older checkpoint, which needs a longer log; and for
generation 0, finally to the empty state with the whole log. Only when none of
these rebuilds the partition does it raise `UnrecoverableStateError`, naming
each way it tried and why it failed. The replay always starts from the batch
of the checkpoint actually loaded.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from ioservice import CheckpointNotFoundError, IOServiceError, Manifest, StorageRoot
from mmm import PageManager
from sguard.spark import inputlog
from sguard.spark.errors import InputLogGapError, StateAheadError, UnrecoverableStateError
from sguard.spark.fencing import FenceView
from sguard.rescale import KeyGroupPositions
from sguard.spark.groupstate import KeyGroupedState, key_group_column, open_state
from sguard.spark.operators import Operator, OperatorState
from sguard.statelayout import OperatorLayout

logger = logging.getLogger(__name__)

__all__ = ["Rebuilt", "checkpoint_restorer", "rebuild_partition"]

#: ``restore(before_seq)`` loads the newest restorable checkpoint with a smaller sequence
#: number (all when None) into the page manager and returns it, or returns None when there
#: is none (the page manager untouched), or raises CheckpointNotFoundError when every one
#: is damaged (the page manager then empty).
RestoreFn = Callable[[int | None], Manifest | None]


@dataclass
class Rebuilt:
    """The outcome of `rebuild_partition`."""

    state: KeyGroupedState
    manifest: Manifest | None
    """The checkpoint the state was rebuilt from (None: from the empty state)."""
    checkpoint_batch: int
    """The batch that checkpoint holds the state after (-1: the empty state)."""
    last_batch: int
    """The last batch replayed (``checkpoint_batch`` when none was)."""
    passed_over: list[str] = field(default_factory=list)
    """Newer ways that failed, and why (for logs and metrics)."""

    @property
    def replayed(self) -> int:
        return self.last_batch - self.checkpoint_batch


def checkpoint_restorer(pm: PageManager, root: StorageRoot, layout: OperatorLayout,
                        partition: int, pending: Manifest | None = None) -> RestoreFn:
    """The ``restore_fn`` of `rebuild_partition` for a reader: the newest checkpoint of
    `partition`'s HA unit below a sequence number (None: there is none), or, for a
    partition a lazy repartition left uncomposed, its `pending` composition
    (`sguard.rescale.pending_manifest`) read where its pages lie, nothing older. A
    damaged source page there falls back to that source's older checkpoint, as the
    partition's first task does when it composes (`sguard.rescale.load_pending`); the
    composition returned then holds the older positions, so the replay is the longer
    one. A source with no undamaged checkpoint left is `CheckpointNotFoundError`."""
    from ioservice import list_checkpoints, restore
    from sguard.rescale import RescaleError, load_pending
    haunit = layout.haunit(partition)

    def restore_fn(before: int | None) -> Manifest | None:
        if pending is not None:
            if before is not None:
                return None
            try:
                return load_pending(pm, root, layout, partition, pending=pending)
            except RescaleError as exc:
                raise CheckpointNotFoundError(f"partition {partition}'s composition: {exc}"
                                              ) from exc
        if not any(c.has_manifest and (before is None or c.seq < before)
                   for c in list_checkpoints(root, haunit)):
            return None
        return restore(pm, root, haunit, before_seq=before)
    return restore_fn


def rebuild_partition(pm: PageManager, root: StorageRoot, layout: OperatorLayout,
                      partition: int, operator: Operator, schema: pa.Schema,
                      upto_batch: int, restore: RestoreFn, fence: FenceView | None, *,
                      ahead: str = "raise") -> Rebuilt:
    """Rebuild `partition`'s state after `upto_batch` into `pm` (module docstring).

    Parameters
    ----------
    ahead : ``"raise"`` or ``"skip"``
        What to do with a checkpoint beyond `upto_batch`: raise `StateAheadError`
        (the runtime: the state URI belongs to another query) or pass it over
        (a reader asking for an earlier batch).

    Raises
    ------
    StateAheadError
        See `ahead`.
    UnrecoverableStateError
        If no checkpoint and log rebuild the state.
    StorageUnreachableError
        Storage errors other than damage are not fallen back on.
    """
    tried: list[str] = []
    before: int | None = None
    while True:
        try:
            man = restore(before)
        except CheckpointNotFoundError as exc:
            tried.append(f"every checkpoint{'' if before is None else f' below seq {before}'} "
                         f"is damaged ({exc})")
            man = None
        if man is None:
            pm.begin_load().abort()  # the empty state (undo a failed candidate's replay)
            if layout.generation > 0:
                raise _unrecoverable(root, layout, partition, upto_batch, tried + [
                    "the empty state is no starting point after a repartitioning"])
            c = -1
        else:
            c = int(man.user_meta.get("batch_id", -1))
            if c > upto_batch:
                if ahead == "raise":
                    raise StateAheadError(
                        f"partition {partition}: the durable state at {root.uri} includes "
                        f"batch {c}, but Spark is about to run batch {upto_batch + 1}: this "
                        f"state URI belongs to another query (another checkpointLocation); "
                        f"use a fresh state URI or the query's own checkpointLocation")
                tried.append(f"checkpoint {man.name} holds batch {c}, beyond {upto_batch}")
                before = man.seq
                continue
        state = open_state(operator, pm, schema, layout.key, layout.key_group_range(partition))
        what = "the empty state" if man is None else f"checkpoint {man.name} (batch {c})"
        try:
            _replay(root, layout, partition, state, man, c, upto_batch, fence)
        except (InputLogGapError, pa.ArrowInvalid, IOServiceError) as exc:
            if isinstance(exc, IOServiceError) and not _is_damage(exc):
                raise
            tried.append(f"{what} plus the input log: {exc}")
            if man is None:
                raise _unrecoverable(root, layout, partition, upto_batch, tried) from exc
            logger.warning("partition %d: %s cannot be replayed to batch %d (%s); trying an "
                           "older checkpoint", partition, what, upto_batch, exc)
            before = man.seq
            continue
        if tried:
            logger.warning("partition %d rebuilt from %s after passing over: %s", partition,
                           what, "; ".join(tried))
        return Rebuilt(state, man, c, max(c, upto_batch), tried)


def _replay(root: StorageRoot, layout: OperatorLayout, partition: int, state: OperatorState,
            man: Manifest | None, c: int, upto: int, fence: FenceView | None) -> None:
    positions = None
    if man is not None and man.user_meta.get("kg_batches"):
        # a repartitioned checkpoint: its key groups came from source partitions that were
        # at different batches, so each logged row is applied only if its key group missed it
        positions = KeyGroupPositions.from_user_meta(man.user_meta)
    for x in range(c + 1, upto + 1):
        t = inputlog.read_input(root, x, layout.generation, partition, layout.num_partitions,
                                layout.key, fence, key_groups=layout.key_groups)
        if positions is not None:
            t = t.filter(pa.array(positions.needs(key_group_column(t), x)))
        state.apply(t, x)


def _is_damage(exc: IOServiceError) -> bool:
    from ioservice import StorageNotFoundError
    from ioservice.errors import CheckpointDamagedError
    return isinstance(exc, (StorageNotFoundError, CheckpointDamagedError))


def _unrecoverable(root: StorageRoot, layout: OperatorLayout, partition: int, upto: int,
                   tried: list[str]) -> UnrecoverableStateError:
    return UnrecoverableStateError(
        f"partition {partition} of {layout.name!r} at {root.uri} cannot be rebuilt to batch "
        f"{upto}: no checkpoint plus input log reaches it. Tried, newest first: "
        + "; ".join(tried))
