"""Repartitioning a query's state at start-up, when its partition count changed.

`sguard.spark.stateful` calls `repartition_at_startup` on the driver, before
the query starts, when it is given a ``num_partitions`` different from the
stored state's. Two steps, each restartable:

1. **wait for the old partitions on this host**: the local locks of the old
   generation's partitions (local mode, or an executor on the driver's host)
   are taken, so a checkpoint that a stopped query's Python worker still has
   in flight lands before its HA unit is read;
2. **commit lazily** (`sguard.rescale.repartition` with ``lazy=True``): the
   driver validates the sources' newest checkpoints (their manifest headers) and
   commits the new layout (generation ``g + 1``, ``P'`` partitions) with a
   record of the sources (``extra["compose_from"]``: each old partition's newest
   checkpoint and its older fallbacks). No Spark job runs: the first task of each
   new partition, finding no checkpoint in its HA unit, composes its first
   checkpoint from its key groups' pages in those sources, reading (to verify)
   only them (`sguard.rescale.compose_if_pending`, the same `compose_target` a
   repartition job's task runs), then restores it as after any failure. The
   sources may be at different batches: each key group's position travels in
   the new checkpoint, and the new partitions replay exactly the logged rows
   their key groups missed (`sguard.rescale.KeyGroupPositions`). A task killed
   while composing is retried and composes again (composing is idempotent: the
   manifest is written last, create-only, and deterministic). The old generation
   is swept only once every new partition has composed; readers see an
   uncomposed partition through its sources (`sguard.rescale.pending_manifest`);
   a later repartition composes the missing partitions first (a Spark job).

``sguard state repartition`` composes every target as a Spark job before it
commits (`repartition_job`: one task per target partition, `spark_runner`), after
composing, by the same kind of job, the partitions a lazy commit left uncomposed
(`sguard.rescale.complete_pending` with the Spark runner; with the current count
that is all it does).

A crash before the commit leaves the old generation the state, so rerunning the
query with the same ``num_partitions`` completes the work. Afterwards the old
generation's local files on this host are deleted.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ioservice import StorageRoot
from ioservice.errors import StorageNotFoundError
from sguard.spark.placement import PartitionSlot, state_id
from sguard.statelayout import OperatorLayout, read_layout

logger = logging.getLogger(__name__)

__all__ = ["StartupRescale", "RepartitionJobError", "repartition_at_startup",
           "pending_repartition", "spark_runner", "repartition_job"]


class RepartitionJobError(RuntimeError):
    """The repartition's Spark job failed (after Spark's task retries); the old generation
    is still the state, and a rerun completes the work."""


@dataclass(frozen=True)
class StartupRescale:
    """What `repartition_at_startup` did (seconds per step)."""

    from_partitions: int
    num_partitions: int
    generation: int
    wait_s: float = 0.0
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


def _compose_doc(text: str) -> str:
    """One target partition's task description (JSON) -> its result (JSON)."""
    import json as _json
    from sguard.rescale import TargetTask, compose_target
    d = _json.loads(text)
    d["storage_options"] = tuple((k, v) for k, v in d["storage_options"])
    d["sources"] = tuple(d["sources"])
    d["older"] = tuple(tuple(x) for x in d.get("older", ()))
    return _json.dumps(compose_target(TargetTask(**d)))


def spark_runner(spark: Any) -> Callable[[Sequence[Any]], list[dict[str, Any]]]:
    """A `sguard.rescale.repartition` ``run=``: one Spark task per target partition, on the
    executors; the driver sends each task its description (a few hundred bytes) and gets
    back three counters and the composed checkpoint's file list (O(files), never a page
    table), so its memory does not grow with the state.

    The tasks are SQL Python tasks (``mapInArrow`` over ``range(n)`` in n partitions: task
    i composes target i), not RDD ones: PySpark keeps separate Python worker pools for
    the two, and the SQL pool is the one the query's own tasks keep warm (sguard
    imported), so a start-up repartition does not wait for cold workers.
    """
    from dataclasses import asdict

    def run(tasks: Sequence[Any]) -> list[dict[str, Any]]:
        docs = [json.dumps(asdict(t)) for t in tasks]

        def compose(batches: Any) -> Any:
            import pyarrow as pa
            ids, out = [], []
            for b in batches:
                for i in b.column(0).to_pylist():
                    ids.append(i)
                    out.append(_compose_doc(docs[i]))
            yield pa.RecordBatch.from_pydict({"id": pa.array(ids, pa.int64()),
                                              "result": pa.array(out, pa.string())})

        df = spark.range(0, len(docs), 1, len(docs))
        try:
            rows = df.mapInArrow(compose, "id long, result string").collect()
        except Exception as exc:  # noqa: BLE001 - Py4J / PySpark wrap the task's error
            lines = [ln for ln in str(exc).splitlines() if "Error" in ln]
            raise RepartitionJobError(f"the repartition job failed: "
                                      f"{(lines[-1] if lines else str(exc))[:500]}") from None
        got = {int(r["id"]): r["result"] for r in rows}
        return [json.loads(got[i]) for i in range(len(docs))]
    return run


def repartition_job(spark: Any, root: StorageRoot, num_partitions: int, *,
                    storage_options: dict[str, Any] | None = None, force: bool = False,
                    verify: bool = True, say: Callable[[str], None] | None = None) -> Any:
    """`sguard.rescale.repartition` as a Spark job (`spark_runner`)."""
    from sguard import rescale
    return rescale.repartition(root, num_partitions, force=force, verify=verify,
                               run=spark_runner(spark), storage_options=storage_options,
                               on_progress=say)


def repartition_at_startup(spark: Any, root: StorageRoot, layout: OperatorLayout,
                           num_partitions: int, *, state_key: str, local_dir: str,
                           storage_options: dict[str, Any] | None = None,
                           lock_timeout_s: float = 600.0,
                           say: Callable[[str], None] | None = None) -> StartupRescale:
    """Repartition the state of `layout` under `root` into `num_partitions` (see the module
    docstring); returns what was done.

    Raises
    ------
    sguard.rescale.RescaleError
        The state cannot be repartitioned (e.g. leftovers not made by a
        repartition); the old generation is still the state.
    """
    t0 = time.perf_counter()
    old_sid = state_id(state_key, layout.name, layout.generation)
    slots = [PartitionSlot(local_dir, old_sid, p) for p in range(layout.num_partitions)]
    slots = [s for s in slots if os.path.isdir(s.dir)]
    try:
        for s in slots:  # a stopped query's worker may still be writing a checkpoint
            s.acquire(lock_timeout_s)
        t1 = time.perf_counter()
        # committed lazily: no Spark job here, each new partition's first task composes
        # its first checkpoint (`sguard.rescale.compose_if_pending`); partitions an
        # earlier lazy repartition left uncomposed are composed first, as a Spark job
        from sguard import rescale
        res = rescale.repartition(root, num_partitions, run=spark_runner(spark),
                                  storage_options=storage_options, on_progress=say, lazy=True)
        t2 = time.perf_counter()
        for s in slots:  # the old generation's local state is dead now
            s.wipe()
    finally:
        for s in slots:
            s.release()
    return StartupRescale(layout.num_partitions, num_partitions, res.generation,
                          wait_s=t1 - t0, repartition_s=t2 - t1,
                          seconds=time.perf_counter() - t0, phases_s=dict(res.phases_s))
