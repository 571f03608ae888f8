"""Reading a stateful operator's state back (tests, ``sguard spark status``, tools).

`read_local_state` reads each partition's live state from the executors'
local directory (this host) through a *private* copy-on-write mapping of the
pool file, so the file, including the rollback point a replay may still need,
is never modified. `read_durable_state` rebuilds it from the state URI alone
(`read_partition_state` per partition): the newest checkpoint that rebuilds
each partition plus the input log after it, the same way the runtime recovers
(`sguard.spark.reader` reads the state after a given batch).
"""
from __future__ import annotations

import warnings
from typing import Any

import pyarrow as pa

from ioservice import DamagedCheckpointWarning, StorageRoot, list_checkpoints, open_root
from mmm import PageManager
from mmm.poolfile import file_page_bytes
from sguard.spark import fencing, inputlog
from sguard.spark.checkpointing import latest_checkpoint_batch
from sguard.spark.groupstate import open_state
from sguard.spark.operators import operator_from_params
from sguard.spark.placement import PartitionSlot, default_local_dir, root_key, state_id
from sguard.spark.recovery import checkpoint_restorer, rebuild_partition
from sguard.spark.versions import attach_at
from sguard.statelayout import OperatorLayout, read_layout, schema_from_layout

__all__ = ["read_local_state", "read_durable_state", "read_partition_state", "load_layout"]


def load_layout(state_uri: str, storage_options: dict[str, Any] | None = None
                ) -> OperatorLayout:
    """The layout document under `state_uri`.

    Raises
    ------
    FileNotFoundError
        If there is no sguard state there.
    """
    root = open_root(state_uri, create=False, **(storage_options or {}))
    lay = read_layout(root)
    if lay is None:
        raise FileNotFoundError(f"no sguard operator state at {root.uri} "
                                f"(no sguard-operator.json)")
    return lay


def read_local_state(state_uri: str, *, local_dir: str | None = None,
                     storage_options: dict[str, Any] | None = None,
                     lock_timeout_s: float = 60.0) -> tuple[pa.Table, dict[int, int]]:
    """The live state of every partition on this host: ``(table, {partition: batch})``.

    ``batch`` is the last batch fully applied to the partition (a partly applied
    one is read at its rollback point).

    Raises
    ------
    FileNotFoundError
        If a partition has no local state on this host.
    """
    lay = load_layout(state_uri, storage_options)
    op = operator_from_params(lay.operator, lay.schema["params"])
    schema = schema_from_layout(lay)
    sid = state_id(root_key(open_root(state_uri, create=False, **(storage_options or {}))),
                   lay.name, lay.generation)
    parts, batches = [], {}
    for p in range(lay.num_partitions):
        slot = PartitionSlot(local_dir or default_local_dir(), sid, p)
        slot.acquire(lock_timeout_s)
        try:
            m = slot.read_marker()
            if m is None or not slot.has_pool():
                raise FileNotFoundError(f"partition {p}: no local state in {slot.dir}")
            base = slot.read_base() if m.status == "applying" else None
            page_bytes = file_page_bytes(slot.pool_path)
            if page_bytes is None:
                raise FileNotFoundError(f"partition {p}: {slot.pool_path} is not a pool file")
            pm = attach_at(slot.pool_path, page_bytes, base, copy_on_write=True)
            parts.append(open_state(op, pm, schema, lay.key, lay.key_group_range(p)).dump())
            batches[p] = m.batch if m.status == "applied" else m.batch - 1
        finally:
            slot.release()
    return _concat(parts), batches


def read_durable_state(state_uri: str, *, upto_batch: int | None = None,
                       storage_options: dict[str, Any] | None = None
                       ) -> tuple[pa.Table, dict[int, int]]:
    """The state rebuilt from the state URI alone (checkpoints plus input log).

    Replays each partition's log up to `upto_batch` (default: the last batch
    logged for it) from the checkpoint actually restored: a damaged newest
    checkpoint falls back to an older one and a longer replay
    (`read_partition_state`). Returns ``(table, {partition: batch})``.

    Raises
    ------
    UnrecoverableStateError
        If no checkpoint and log rebuild a partition.
    """
    root = open_root(state_uri, create=False, **(storage_options or {}))
    lay = load_layout(state_uri, storage_options)
    parts, batches = [], {}
    for p in range(lay.num_partitions):
        t, last = read_partition_state(root, lay, p, upto_batch)
        parts.append(t)
        batches[p] = last
    return _concat(parts), batches


def read_partition_state(root: StorageRoot, layout: OperatorLayout, partition: int,
                         upto_batch: int | None = None) -> tuple[pa.Table, int]:
    """One partition's state rebuilt from `root`: ``(rows, last batch)``.

    The state after `upto_batch` (default: the last batch the partition's input
    log holds a valid file for, or its checkpoint's batch when none is newer):
    the newest checkpoint that loads and whose log reaches that batch, plus the
    replay of that log (`sguard.spark.recovery`). Files a fenced (stale) owner
    wrote are ignored (`sguard.spark.fencing`).

    Raises
    ------
    UnrecoverableStateError
        If no checkpoint and log rebuild it.
    """
    from sguard.rescale import pending_manifest
    op = operator_from_params(layout.operator, layout.schema["params"])
    schema = schema_from_layout(layout)
    hu = layout.haunit(partition)
    fence = fencing.read_claims(root, hu)
    if upto_batch is None:
        logged = inputlog.valid_batches(root, layout.generation, partition, fence)
        upto = max(max(logged, default=-1), latest_checkpoint_batch(root, hu))
        if layout.generation > 0:  # a repartition's partitions replay the older log too
            upto = max(upto, inputlog.newest_older_generation_batch(root, layout.generation))
    else:
        upto = upto_batch
    # a partition a lazy repartition left uncomposed: its composition, read where it lies
    pend = pending_manifest(root, layout, partition)
    pm = PageManager(pend.page_bytes if pend is not None else _checkpoint_page_bytes(root, hu),
                     1 << 30)

    restore_fn = checkpoint_restorer(pm, root, layout, partition, pend)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamagedCheckpointWarning)  # logged by ioservice
        got = rebuild_partition(pm, root, layout, partition, op, schema, upto, restore_fn,
                                fence, ahead="skip")
    return got.state.dump(), got.last_batch


def _checkpoint_page_bytes(root: Any, haunit: str) -> int:
    """The page size of the HA unit's latest readable checkpoint (64 KiB without one)."""
    from ioservice import list_checkpoints, read_manifest
    for c in reversed([c for c in list_checkpoints(root, haunit) if c.has_manifest]):
        try:
            return int(read_manifest(root, c.name).page_bytes)
        except Exception:  # noqa: BLE001 - a damaged one: restore looks further back too
            continue
    return 1 << 16


def _concat(parts: list[pa.Table]) -> pa.Table:
    t = pa.concat_tables(parts)
    if t.num_rows == 0:
        return t
    return t.sort_by([(c, "ascending") for c in t.column_names])
