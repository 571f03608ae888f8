"""Reading a stateful operator's state back (tests, ``sguard spark status``, tools).

`read_local_state` reads each partition's live state from the executors'
local directory (this host) through a *private* copy-on-write mapping of the
pool file, so the file, including the rollback point a replay may still need,
is never modified. `read_durable_state` rebuilds it from the state URI alone:
the latest checkpoint of each partition plus the input log.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ioservice import open_root
from mmm import PageManager, PagePool
from sguard.spark import inputlog
from sguard.spark.api import schema_from_layout
from sguard.spark.checkpointing import latest_checkpoint_batch
from sguard.spark.operators import operator_from_params
from sguard.spark.placement import PartitionSlot, default_local_dir, root_key, state_id
from sguard.spark.versions import _RollbackPool
from sguard.statelayout import OperatorLayout, read_layout

__all__ = ["read_local_state", "read_durable_state", "load_layout"]


class _PrivateRollbackPool(_RollbackPool):
    def _open_file(self, path: str) -> Any:
        PagePool._open_file(self, path)  # validates the file (never the shared cached mapping)
        import os
        return np.memmap(path, dtype=np.uint8, mode="c", shape=(os.path.getsize(path),))


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
            pool: Any = _PrivateRollbackPool.__new__(_PrivateRollbackPool)
            pool._keep = base
            PagePool.__init__(pool, 1 << 16, 0, slot.pool_path, _attach=True)
            pm = PageManager(_pool=pool)
            parts.append(op.open(pm, schema, lay.key).dump())
            batches[p] = m.batch if m.status == "applied" else m.batch - 1
        finally:
            slot.release()
    return _concat(parts), batches


def read_durable_state(state_uri: str, *, upto_batch: int | None = None,
                       storage_options: dict[str, Any] | None = None
                       ) -> tuple[pa.Table, dict[int, int]]:
    """The state rebuilt from the state URI alone (checkpoints plus input log).

    Replays each partition's log up to `upto_batch` (default: the last batch
    logged for it). Returns ``(table, {partition: batch})``.
    """
    root = open_root(state_uri, create=False, **(storage_options or {}))
    lay = load_layout(state_uri, storage_options)
    op = operator_from_params(lay.operator, lay.schema["params"])
    schema = schema_from_layout(lay)
    from ioservice import restore
    parts, batches = [], {}
    logged = inputlog.logged_batches(root)
    for p in range(lay.num_partitions):
        hu = lay.haunit(p)
        c = latest_checkpoint_batch(root, hu)
        pm = PageManager(_checkpoint_page_bytes(root, hu), 1 << 30)
        positions = None
        if c >= 0 or lay.generation > 0:  # a repartitioned checkpoint may be at batch -1
            try:
                man = restore(pm, root, hu)
            except FileNotFoundError:
                man = None
            if man is not None and man.user_meta.get("sources"):
                from sguard.rescale import ReplayPositions  # keys at different batches
                positions = ReplayPositions.from_user_meta(man.user_meta)
        st = op.open(pm, schema, lay.key)
        last = upto_batch if upto_batch is not None else max(
            [b for b in logged if root.exists(inputlog.log_path(b, lay.generation, p))],
            default=c)
        for b in range(c + 1, last + 1):
            t = inputlog.read_input(root, b, lay.generation, p, lay.num_partitions, lay.key)
            if positions is not None:
                t = t.filter(pa.array(positions.needs(inputlog.key_table(t, lay.key), b)))
            st.apply(t, b)
        parts.append(st.dump())
        batches[p] = last
    return _concat(parts), batches


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
