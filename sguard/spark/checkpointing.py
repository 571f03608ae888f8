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
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ioservice import (CheckpointManager, CheckpointPolicy, IOService, Manifest,
                       PendingCheckpoint, StorageRoot, list_checkpoints, read_manifest)
from mmm import PageManager

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
    """

    def __init__(self, pm: PageManager, root: StorageRoot, haunit: str, config: CheckpointConfig,
                 io: IOService, meta: dict[str, Any],
                 on_durable: Callable[[int, int, Manifest], None]) -> None:
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
        self.mgr = CheckpointManager(
            pm, root, haunit, io=io, check_root=False, on_done=self._done,
            policy=CheckpointPolicy(keep=config.keep, full_every=config.full_every), **kwargs)
        self._lock = threading.Lock()
        self.last: dict[str, Any] = {}

    def seed(self, durable_batch: int, last_batch: int) -> None:
        """Start the policy from what is already durable (after a restore or re-attach)."""
        self.durable_batch = durable_batch
        self.last_batch = last_batch

    def restore(self) -> Manifest | None:
        """Load the latest restorable checkpoint into the page manager (None: there is none)."""
        man = self.mgr.restore()
        if man is not None:
            b = int(man.user_meta.get("batch_id", -1))
            self.durable_batch = self.last_batch = b
        return man

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
        p = self.mgr.checkpoint(user_meta={**self.meta, "batch_id": state_batch},
                                full=True if force else None)
        self._last_t = time.monotonic()
        self.last_batch = state_batch
        if p is None:  # nothing changed since the previous one: it covers this batch too
            self.durable_batch = max(self.durable_batch, state_batch)
        return p

    def _done(self, man: Manifest) -> None:
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
