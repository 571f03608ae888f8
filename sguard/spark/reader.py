"""Reading an operator's durable state as a Spark DataFrame (`read_state`).

The state at batch ``b`` of partition ``p`` is rebuilt the way recovery
rebuilds it: the newest checkpoint of ``p`` at or below ``b`` is restored
into a *private*, in-memory page manager and the partition's input log is
replayed up to ``b``. `read_state` runs that as a Spark job, one task per
state partition (``spark.range(P, numPartitions=P).mapInArrow(...)``), so
the state is never collected on the driver; only the choice of ``b``
(a listing of checkpoints and input-log files) runs there.

Read-only, so it can run beside the query that owns the state URI: it never
takes a partition lock, never touches the executors' local state, and never
writes or deletes anything under the state URI. The query keeps
checkpointing and trimming its input log meanwhile; a partition whose
checkpoint or log files vanish under a read is read again from the newer
ones (a few times), and a batch that is no longer available is an error
naming it.

Rows are the operator's `OperatorState.dump` rows plus ``partition_id``
(int32): one row per key for `RunningAggregate`, per key and open window for
`WindowAggregate` (``window_start, window_end, key, count, sum, min, max``),
and for `WindowJoin` the buffered input rows of both sides (``side`` 0 =
left, 1 = right, ``k``, ``t`` in the time column's units, ``v``): a join's
state is its buffers, not a value per key.

Which batches are *durable*: for each partition, the batches whose state can
be rebuilt from what the state URI holds (a checkpoint at or below the batch
plus the logged input of every batch after it); `available_batches` is the
intersection over partitions, and the default is its newest batch. A batch
one partition logged while another has not yet is not durable: the default
never mixes batches across partitions.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ioservice import StorageRoot, list_checkpoints, open_root, read_manifest
from mmm import PageManager
from sguard.spark import fencing, inputlog
from sguard.spark.errors import InputLogGapError, SparkStateError
from sguard.spark.operators import operator_from_params
from sguard.spark.recovery import checkpoint_restorer, rebuild_partition
from sguard.spark.state import load_layout
from sguard.statelayout import OperatorLayout, schema_from_layout

__all__ = ["read_state", "read_partition_at", "available_batches", "state_schema",
           "BatchNotAvailableError", "PARTITION_COLUMN"]

PARTITION_COLUMN = "partition_id"
_RETRIES = 4


class BatchNotAvailableError(SparkStateError, LookupError):
    """The requested batch's state cannot be rebuilt from the state URI."""


@dataclass(frozen=True)
class _Point:
    """A place replay can start from: the state after `batch` (a checkpoint, or empty)."""

    batch: int
    seq: int | None
    """The checkpoint's sequence number; None for the empty state before batch 0."""


_PENDING_SEQ = -1
"""The `_Point.seq` of a partition's composition a lazy repartition left to its first task
(`sguard.rescale.pending_manifest`), read through the sources."""


def _points(root: StorageRoot, layout: OperatorLayout, partition: int) -> list[_Point]:
    """Restorable starting points of a partition, oldest first."""
    from sguard.rescale import pending_manifest
    pend = pending_manifest(root, layout, partition)
    if pend is not None:  # no checkpoint of its own yet: its sources are its one point
        return [_Point(int(pend.user_meta.get("batch_id", -1)), _PENDING_SEQ)]
    out = [] if layout.generation > 0 else [_Point(-1, None)]
    for c in list_checkpoints(root, layout.haunit(partition)):
        if not c.has_manifest:
            continue
        try:
            b = int(read_manifest(root, c.name).user_meta.get("batch_id", -1))
        except Exception:  # noqa: BLE001 - a damaged or vanished one: not a starting point
            continue
        out.append(_Point(b, c.seq))
    return sorted(out, key=lambda x: (x.batch, x.seq if x.seq is not None else -1))


def _logged(root: StorageRoot, layout: OperatorLayout, batches: list[int]) -> dict[int, set[int]]:
    """``{batch: partitions whose input of it can be read}`` for this generation."""
    out: dict[int, set[int]] = {}
    g = layout.generation
    for b in batches:
        names = [e.name for e in root.list_dir(inputlog.batch_dir(b), allow_not_found=True)
                 if not e.is_dir]
        gens = {n: int(m.group("gen")) for n in names if (m := inputlog._FILE_RE.match(n))}
        own = {int(inputlog._FILE_RE.match(n).group("part"))  # type: ignore[union-attr]
               for n, gg in gens.items() if gg == g}
        if own:  # this generation ran the batch: each partition's own file, or not yet
            out[b] = own
        elif any(gg < g for gg in gens.values()):  # logged before a repartition: all of them
            out[b] = set(range(layout.num_partitions))
        else:
            out[b] = set()
    return out


def _partition_range(points: list[_Point], logged: dict[int, set[int]], p: int
                     ) -> tuple[int, int] | None:
    """``(oldest, newest)`` batch whose state partition `p` can be rebuilt (every batch in
    between too), or None."""
    covered: set[int] = set()
    for pt in points:
        b = pt.batch
        while p in logged.get(b + 1, ()):
            b += 1
        covered.update(range(max(pt.batch, 0), b + 1))
    if not covered:
        return None
    hi = lo = max(covered)
    while lo - 1 in covered:
        lo -= 1
    return lo, hi


def available_batches(state_uri: str | StorageRoot, *,
                      storage_options: dict[str, Any] | None = None) -> tuple[int, int]:
    """``(oldest, newest)`` batch id whose state every partition can be rebuilt at.

    Runtime complexity: one listing of the checkpoints and of each logged
    batch's directory, one manifest read per checkpoint.

    Raises
    ------
    FileNotFoundError
        If there is no sguard state at `state_uri`.
    BatchNotAvailableError
        If no batch is durable for every partition yet.
    """
    root = (state_uri if isinstance(state_uri, StorageRoot)
            else open_root(state_uri, create=False, **(storage_options or {})))
    layout = _layout(root)
    return _available(root, layout)


def _available(root: StorageRoot, layout: OperatorLayout) -> tuple[int, int]:
    logged = _logged(root, layout, inputlog.logged_batches(root))
    los, his = [], []
    for p in range(layout.num_partitions):
        r = _partition_range(_points(root, layout, p), logged, p)
        if r is None:
            raise BatchNotAvailableError(
                f"state at {root.uri}: partition {p} has no durable batch yet (no checkpoint "
                f"and no logged input it can be rebuilt from)")
        los.append(r[0])
        his.append(r[1])
    lo, hi = max(los), min(his)
    if lo > hi:
        raise BatchNotAvailableError(
            f"state at {root.uri}: no batch is durable for every partition (partitions' "
            f"ranges {list(zip(los, his))})")
    return lo, hi


def _layout(root: StorageRoot) -> OperatorLayout:
    from sguard.statelayout import read_layout
    lay = read_layout(root)
    if lay is None:
        raise FileNotFoundError(f"no sguard operator state at {root.uri} "
                                f"(no sguard-operator.json)")
    return lay


def _check_batch(batch_id: Any, rng: tuple[int, int], uri: str) -> int:
    if not isinstance(batch_id, int) or isinstance(batch_id, bool):
        raise TypeError(f"batch_id must be an integer or None, got {batch_id!r}")
    if not rng[0] <= batch_id <= rng[1]:
        raise BatchNotAvailableError(
            f"batch {batch_id} is not available in the state at {uri}: durable batches for "
            f"every partition are {rng[0]}..{rng[1]}")
    return batch_id


def _dump(state: Any, view: tuple[str | None, bool]) -> pa.Table:
    """An operator state's rows: `dump`, or a processor's variable (``view[0]``) or timers
    (``view[1]``)."""
    var, timers = view
    if var is None and not timers:
        return state.dump()
    if not hasattr(state, "dump_var") and not hasattr(state, "dump_each"):
        raise ValueError("state_var= and timers= read a processor's state "
                         "(sguard.spark.transform_with_state); this state URI holds another "
                         "operator's")
    fn = (lambda s: s.dump_timers()) if timers else (lambda s: s.dump_var(var))
    return state.dump_each(fn) if hasattr(state, "dump_each") else fn(state)  # type: ignore


def state_schema(layout: OperatorLayout, view: tuple[str | None, bool] = (None, False)
                 ) -> pa.Schema:
    """The schema of `read_state`'s rows: the operator's dump schema plus ``partition_id``."""
    from sguard.spark.api import schema_from_layout
    op = operator_from_params(layout.operator, layout.schema["params"])
    pm = PageManager(1 << 12, 1 << 24)
    try:
        dump = _dump(op.open(pm, schema_from_layout(layout), layout.key), view).schema
    finally:
        pm.close()
    return dump.append(pa.field(PARTITION_COLUMN, pa.int32(), nullable=False))


def _page_bytes(root: StorageRoot, seq: int | None, layout: OperatorLayout,
                partition: int) -> int:
    if seq is None:
        return 1 << 16
    for c in list_checkpoints(root, layout.haunit(partition)):
        if c.seq == seq and c.has_manifest:
            return int(read_manifest(root, c.name).page_bytes)
    raise FileNotFoundError(f"checkpoint {seq} of {layout.haunit(partition)} vanished")


def _read_once(root: StorageRoot, layout: OperatorLayout, partition: int, batch: int,
               view: tuple[str | None, bool] = (None, False), processor: Any = None
               ) -> pa.Table:
    """The newest checkpoint at or below `batch` that loads and whose log reaches it, plus
    the replay (`sguard.spark.recovery`, as the runtime recovers; a stale owner's files
    are ignored)."""
    from ioservice import DamagedCheckpointWarning
    hu = layout.haunit(partition)
    pts = [pt for pt in _points(root, layout, partition) if pt.batch <= batch]
    if not pts:
        raise BatchNotAvailableError(
            f"batch {batch}: partition {partition} has no checkpoint at or below it in "
            f"{root.uri} (older checkpoints were deleted)")
    pend = None
    if pts[-1].seq == _PENDING_SEQ:
        from sguard.rescale import pending_manifest
        pend = pending_manifest(root, layout, partition)
        if pend is None:  # composed meanwhile: list again
            raise FileNotFoundError(f"partition {partition} composed while being read")
    pm = PageManager(pend.page_bytes if pend is not None else
                     _page_bytes(root, pts[-1].seq, layout, partition), 1 << 30)

    restore_fn = checkpoint_restorer(pm, root, layout, partition, pend)

    op = operator_from_params(layout.operator, layout.schema["params"])
    if hasattr(op, "processor"):  # a processor's log replays through the processor itself
        op.processor = processor
        if processor is None and pts[-1].batch != batch:
            raise BatchNotAvailableError(
                f"batch {batch}: partition {partition}'s newest checkpoint at or below it holds "
                f"batch {pts[-1].batch}; reaching {batch} replays the input log through the "
                f"processor: pass processor= (an instance of the query's processor class)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamagedCheckpointWarning)  # logged by ioservice
        got = rebuild_partition(pm, root, layout, partition, op, schema_from_layout(layout),
                                batch, restore_fn, fencing.read_claims(root, hu), ahead="skip")
    t = _dump(got.state, view)
    return t.append_column(pa.field(PARTITION_COLUMN, pa.int32(), nullable=False),
                           pa.array([partition] * t.num_rows, pa.int32()))


def read_partition_at(root: StorageRoot, layout: OperatorLayout, partition: int,
                      batch: int, view: tuple[str | None, bool] = (None, False),
                      processor: Any = None) -> pa.Table:
    """One partition's state after `batch`, with ``partition_id`` (what a task of
    `read_state` computes; usable without Spark).

    Restores the newest checkpoint at or below `batch` into a private page
    manager and replays the input log after it. Files deleted by the running
    query meanwhile (a newer checkpoint made them obsolete) make it start over,
    up to a few times.

    Raises
    ------
    BatchNotAvailableError
        If the checkpoint or input the batch needs is gone (or never was).
    """
    last: Exception | None = None
    for attempt in range(_RETRIES):
        try:
            return _read_once(root, layout, partition, batch, view, processor)
        except BatchNotAvailableError:
            raise
        except (InputLogGapError, FileNotFoundError) as exc:
            last = exc  # a checkpoint or log file removed under us: list again
            time.sleep(0.05 * (attempt + 1))
    raise BatchNotAvailableError(
        f"batch {batch}: partition {partition}'s state could not be rebuilt from {root.uri} "
        f"(its checkpoint or input log kept changing or is gone): {last}") from last


def read_state(spark: Any, state_uri: str, batch_id: int | None = None, *,
               storage_options: dict[str, Any] | None = None, state_var: str | None = None,
               timers: bool = False, processor: Any = None) -> Any:
    """The operator state under `state_uri` as a DataFrame, one Spark task per partition.

    Parameters
    ----------
    spark : pyspark.sql.SparkSession
    state_uri : str
        The state URI the query was started with (``stateful(..., state_uri=)``).
    batch_id : int, optional
        The batch whose state to read (the state *after* it); default: the
        newest batch durable for every partition (`available_batches`).
    storage_options : dict, optional
        Keyword arguments of `ioservice.open_root` (e.g. ``s3_endpoint``).
    state_var : str, optional
        A processor's state variable (`sguard.spark.transform_with_state`), as Spark's
        ``statestore`` source reads one with ``stateVarName``: the key columns, then
        ``value`` (a value state; one row per element of a list state) or
        ``user_map_key`` and ``user_map_value`` (a map state), and
        ``expiration_timestamp_ms`` for a variable with a TTL.
    timers : bool
        A processor's registered timers: the key columns and ``expiration_timestamp_ms``.
    processor : StatefulProcessor, optional
        An instance of the query's processor class: needed to read a processor's state at
        a batch after its newest checkpoint (the input log is replayed through it).

    Returns
    -------
    pyspark.sql.DataFrame
        The operator's dump rows (see the module docstring) plus
        ``partition_id``. The batch read is chosen when this is called; the
        DataFrame is computed lazily, like any other (``cache()`` it to read
        it twice).

    Raises
    ------
    FileNotFoundError
        If there is no sguard state at `state_uri`.
    BatchNotAvailableError
        If `batch_id` is outside the durable range (the message names both),
        or nothing is durable yet.
    TypeError
        If `batch_id` is not an integer.

    Examples
    --------
    >>> ss.read_state(spark, "file:///tmp/agg-state").orderBy("k").show()  # doctest: +SKIP
    """
    from pyspark.sql.pandas.types import from_arrow_schema

    if batch_id is not None and (not isinstance(batch_id, int) or isinstance(batch_id, bool)):
        raise TypeError(f"batch_id must be an integer or None, got {batch_id!r}")
    opts = dict(storage_options or {})
    root = open_root(state_uri, create=False, **opts)
    layout = load_layout(state_uri, opts)
    rng = _available(root, layout)
    batch = rng[1] if batch_id is None else _check_batch(batch_id, rng, root.uri)
    view = (state_var, bool(timers))
    schema = state_schema(layout, view)
    n = layout.num_partitions
    uri, lay_json = state_uri, layout.to_json()

    def read_partitions(batches: Any) -> Any:
        from sguard.statelayout import OperatorLayout as _L
        r = open_root(uri, create=False, **opts)
        lay = _L.from_json(lay_json)
        for rb in batches:
            for p in rb.column(0).to_pylist():
                t = read_partition_at(r, lay, int(p), batch, view, processor)
                if t.schema != schema:
                    t = t.cast(schema)
                yield from t.to_batches(max_chunksize=65536)

    return spark.range(n, numPartitions=n).mapInArrow(read_partitions, from_arrow_schema(schema))
