"""The PySpark-native entry point: a stateful operator as a streaming transformation.

>>> out = sguard.spark.stateful(df, key="k", operator=RunningAggregate(value="v"),
...                             state_uri="file:///tmp/agg-state", num_partitions=4)  # doctest: +SKIP

`stateful` returns ``df.repartition(P, key).mapInArrow(fn, schema)``: any
sink works (Spark's file sink is exactly-once by itself; a replayed batch
produces the same rows, so ``foreachBatch`` sinks keyed by batch id are
idempotent too). The state of each partition lives in an mmm page pool on the
executor's local disk or ``/dev/shm``, is checkpointed asynchronously to
`state_uri` and restored exactly once after any failure
(`sguard.spark.runtime`). Spark's own ``checkpointLocation`` keeps the
offsets and commits; use the same one on every restart.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import Any

import pyarrow as pa

from ioservice import StorageRoot, open_root
from sguard.spark.checkpointing import CheckpointConfig
from sguard.spark.errors import NotStreamingError, OperatorMismatchError, SchemaChangedError
from sguard.keygroups import check_key_groups, default_key_groups
from sguard.spark.keygroups import with_key_groups
from sguard.spark.keys import key_columns, key_spec
from sguard.spark.operators import SIDE_COLUMN, Operator, WindowJoin
from mmm.pagecache import BudgetError, is_memory_fs
from sguard.spark.budget import PYSPARK_MEMORY, QUERY_OPTION, MemoryBudget
from sguard.spark.placement import default_local_dir, disk_local_dir, root_key
from sguard.spark.rescaling import pending_repartition, repartition_at_startup
from sguard.spark.runtime import FaultPlan, RuntimeConfig, task_function
from sguard.statelayout import (OperatorLayout, read_layout, schema_from_layout, schema_to_json,
                                write_layout)

logger = logging.getLogger(__name__)

__all__ = ["stateful", "stream_join", "local_session", "schema_to_json", "schema_from_layout"]

STATE_SCHEMA_VERSION = 1


def _describe(schema: pa.Schema) -> dict[str, str]:
    return {f.name: str(f.type) for f in schema}


def _check_layout(old: OperatorLayout, new: OperatorLayout, uri: str) -> None:
    if old.operator != new.operator:
        raise OperatorMismatchError(
            f"state URI {uri} holds the state of operator {old.operator!r} "
            f"(name {old.name!r}), not {new.operator!r}; use another state URI")
    if old.name != new.name:
        raise OperatorMismatchError(f"state URI {uri} holds operator name {old.name!r}, not "
                                    f"{new.name!r}")
    if old.key != new.key:
        raise SchemaChangedError(f"state URI {uri} is keyed on column {old.key!r}, the stream "
                                 f"now on {new.key!r}")
    if old.schema.get("input") != new.schema.get("input"):
        was, now = old.schema.get("input", {}), new.schema["input"]
        diff = sorted(set(was.items()) ^ set(now.items()))
        raise SchemaChangedError(
            f"the stream's schema changed since the state at {uri} was written: "
            f"was {was}, now {now} (differs in {diff}); use a new state URI, or restore the "
            f"old schema")
    if old.schema.get("params") != new.schema.get("params"):
        raise SchemaChangedError(
            f"operator {old.operator!r} parameters changed since the state at {uri} was "
            f"written: was {old.schema.get('params')}, now {new.schema.get('params')}")


def _repartition(spark: Any, root: StorageRoot, layout: OperatorLayout, num_partitions: int,
                 **kw: Any) -> OperatorLayout:
    """Repartition the state at start-up (`sguard.spark.rescaling`: the layout is committed,
    each new partition's first task composes its checkpoint); one log line."""
    res = repartition_at_startup(spark, root, layout, num_partitions, state_key=root_key(root),
                                 **kw)
    new = read_layout(root)
    assert new is not None and new.num_partitions == num_partitions
    logger.warning("state at %s repartitioned from %d to %d partitions at start-up "
                   "(generation %d, whole key groups moved; each new partition composes "
                   "its first checkpoint in its first task) in %.2f s", root.uri,
                   res.from_partitions, res.num_partitions, res.generation, res.seconds)
    return new


def _sweep(root: StorageRoot) -> None:
    """Delete old generations' checkpoints no live one references (best effort)."""
    from sguard.rescale import sweep_old_generations
    try:
        sweep_old_generations(root)
    except Exception as exc:  # noqa: BLE001 - cleaning never stops a query
        logger.warning("state at %s: cleaning old generations failed: %s", root.uri, exc)


def stateful(df: Any, key: str | list[str], operator: Operator, state_uri: str,
             num_partitions: int | None = None, *, name: str | None = None,
             checkpoint: CheckpointConfig | None = None, local_dir: str | None = None,
             page_bytes: int = 1 << 16, capacity_bytes: int = 1 << 30,
             storage_options: dict[str, Any] | None = None, lock_timeout_s: float = 600.0,
             metrics: bool = True, faults: FaultPlan | None = None,
             key_groups: int | None = None, memory_budget: str | int | None = None) -> Any:
    """Apply a stateful `operator` per `key` to a streaming DataFrame.

    Parameters
    ----------
    df : pyspark.sql.DataFrame
        A streaming DataFrame (``spark.readStream...``) over a replayable source.
    key : str or list of str
        The key column, or the columns of a composite key
        (``["tenant", "user"]``): strings, binary, booleans, dates, timestamps
        or integers (`sguard.spark.keys`). Null keys form their own group, as
        in Spark's ``groupBy``, except in ``key="k"`` on an integer column
        (stored directly as its value; use ``key=["k"]`` for nullable ones).
        Each row's key group ``pmod(hash(key...), K)`` is computed by Spark, and the
        rows are shuffled to the partition that owns it (`sguard.spark.keygroups`).
    operator : Operator
        E.g. ``RunningAggregate(value="v")``.
    state_uri : str
        Where checkpoints, the input log and metrics go: ``file:///...`` (or a
        local path), ``s3://bucket/prefix``, ``hdfs://host:port/path``.
    num_partitions : int, optional
        State partitions P (default: the existing state's, else
        ``spark.sql.shuffle.partitions``). When it differs from the existing
        state's, the state is repartitioned, whole key groups at a time: the driver
        commits the new layout before the query starts and each new partition's first
        task composes its first checkpoint from the old one's pages
        (`sguard.spark.rescaling`; one log line says so), and the query continues
        exactly once. An interrupted repartition is completed by calling again with
        the same value.
    name : str, optional
        The operator's name (default: its kind).
    checkpoint : CheckpointConfig, optional
        Checkpoint policy (default: every 4 batches, keep 2).
    local_dir : str, optional
        Where executors keep the live state (default ``/dev/shm/sguard-<uid>``; with a
        memory budget, Spark's first local directory on a disk).
    page_bytes, capacity_bytes : int
        Page size and the per-partition pool capacity (a sparse file).
    storage_options : dict, optional
        Keyword arguments of `ioservice.open_root` (e.g. ``s3_endpoint``).
    lock_timeout_s : float
        How long a task waits for a partition's lock.
    metrics : bool
        Write per batch and partition metrics under ``<state_uri>/metrics``.
    faults : FaultPlan, optional
        Injected failures (tests and the demo).
    key_groups : int, optional
        K, the number of key groups (Flink's "max parallelism"): fixed when the state
        URI is created (default 8 x `num_partitions`,
        `sguard.keygroups.default_key_groups`), the most partitions the state can ever
        be repartitioned into. Each key group's state lives in its own pages, so a
        repartition moves whole key groups and never a row (`sguard.rescale`).
    memory_budget : str or int, optional
        The memory each executor's partitions may keep resident, together
        (`sguard.spark.budget`): a Spark size (``"512m"``, ``"4g"``; an int is bytes) or
        ``"auto"`` (half the executor's memory). Default: the session's
        ``sguard.memoryBudget``, else ``spark.executor.pyspark.memory``, else no budget
        (every page in memory). With a budget the pools are files on a local disk and the
        pages beyond the budget are evicted to them after every batch; a batch that writes
        more pages than its partition's share fails with
        `mmm.pagecache.WorkingSetTooLargeError` (restart with a larger budget).

    Returns
    -------
    pyspark.sql.DataFrame
        The streaming output (`Operator.output_schema`).

    Raises
    ------
    NotStreamingError
        If `df` is not streaming.
    UnsupportedKeyTypeError, SchemaChangedError, OperatorMismatchError
        If the input or the existing state does not fit (nothing is written).
    sguard.rescale.RescaleError, InputLogGapError
        If a repartition at start-up is refused (the old partitioning is still
        the state).
    ioservice.RootNotWritableError, ioservice.StorageUnreachableError
        If the state URI cannot be written.
    mmm.pagecache.BudgetError
        If the memory budget is not a size (naming ``memory_budget``,
        ``sguard.memoryBudget`` or ``spark.executor.pyspark.memory``), or `local_dir` is
        on a memory file system while a budget applies.
    """
    from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

    if not getattr(df, "isStreaming", False):
        raise NotStreamingError("sguard.spark.stateful needs a streaming DataFrame "
                                "(spark.readStream...); this one is a batch DataFrame")
    if not isinstance(operator, Operator):
        raise TypeError(f"operator must be an sguard.spark Operator, got "
                        f"{type(operator).__name__}")
    if key_groups is not None:
        check_key_groups(key_groups, 1 if num_partitions is None else num_partitions)
    cols = key_columns(key)
    key = key if isinstance(key, str) else cols
    budget, local_dir = _budget_and_dir(df.sparkSession, memory_budget, local_dir)
    df = operator.prepare_input(df, key)
    in_schema = to_arrow_schema(df.schema, timezone="UTC")
    in_schema = pa.schema([f.with_nullable(True) for f in in_schema])
    spec = key_spec(in_schema, key)
    operator.check_input(in_schema, key)
    out_schema = operator.output_schema(in_schema, key)
    opts = dict(storage_options or {})
    root = open_root(state_uri, **opts)
    root.check_writable()
    existing = read_layout(root)
    explicit_p = num_partitions
    if num_partitions is None:
        num_partitions = (existing.num_partitions if existing is not None else
                          int(df.sparkSession.conf.get("spark.sql.shuffle.partitions")))
    if not isinstance(num_partitions, int) or isinstance(num_partitions, bool) \
            or num_partitions < 1:
        raise ValueError(f"num_partitions must be an integer >= 1, got {num_partitions!r}")
    if key_groups is not None and existing is not None and key_groups != existing.key_groups:
        raise OperatorMismatchError(
            f"the state at {root.uri} has {existing.key_groups} key groups, fixed when it was "
            f"created; key_groups={key_groups} cannot change it (omit key_groups)")
    layout = OperatorLayout(
        operator=operator.kind, name=name or operator.kind, key=key,
        num_partitions=num_partitions,
        key_groups=(existing.key_groups if existing is not None else
                    key_groups if key_groups is not None else default_key_groups(num_partitions)),
        schema={"input": _describe(in_schema), "params": operator.params()},
        schema_version=STATE_SCHEMA_VERSION,
        generation=existing.generation if existing is not None else 0,
        extra={"arrow_schema": schema_to_json(in_schema), "keys": spec.describe()})
    if existing is not None:
        evolved = None
        reconcile = getattr(operator, "reconcile", None)
        if reconcile is not None and existing.operator == operator.kind:
            # parameters that may evolve between runs (a processor's state schemas)
            evolved = reconcile(existing.schema.get("params") or {})
            layout = dataclasses.replace(layout, schema={**layout.schema, "params": evolved})
        was = existing
        if evolved is not None:
            existing = dataclasses.replace(existing,
                                           schema={**existing.schema, "params": evolved})
        _check_layout(existing, layout, root.uri)
        if evolved is not None and evolved != was.schema.get("params"):
            write_layout(root, existing)
            logger.warning("state at %s: state variable schemas evolved (%s)", root.uri,
                           operator.kind)
        if num_partitions != existing.num_partitions:
            # no sweep: the old generation holds the sources until every new partition
            # has composed (a later start-up's sweep deletes what is left then)
            existing = _repartition(df.sparkSession, root, existing, num_partitions,
                                    local_dir=local_dir, storage_options=opts, lock_timeout_s=lock_timeout_s)
        else:
            if explicit_p is None and (pending := pending_repartition(root)) is not None:
                logger.warning("state at %s: a repartition to %d partitions was interrupted; "
                               "the query runs with the committed %d (pass num_partitions=%d "
                               "to complete it)", root.uri, pending, existing.num_partitions,
                               pending)
            if existing.generation > 0:  # what an earlier sweep could not delete
                _sweep(root)
        layout = existing
    else:
        write_layout(root, layout)
    cfg = RuntimeConfig(state_uri=state_uri, state_key=root_key(root), layout=layout, operator=operator, key=key,
                        input_schema=in_schema, output_schema=out_schema,
                        local_dir=local_dir, page_bytes=page_bytes,
                        capacity_bytes=capacity_bytes, memory_budget=budget,
                        checkpoint=checkpoint or CheckpointConfig(),
                        storage_options=opts, lock_timeout_s=lock_timeout_s, metrics=metrics,
                        faults=faults)
    routed = with_key_groups(df, cols, layout.key_groups, layout.num_partitions)
    return routed.mapInArrow(task_function(cfg), from_arrow_schema(out_schema))


def _budget_and_dir(spark: Any, keyword: str | int | None, local_dir: str | None
                    ) -> tuple[MemoryBudget | None, str]:
    """The query's memory budget (`MemoryBudget.for_query`) and its live state's local
    root: the one given, else /dev/shm (or a disk when it lacks room) without a budget and
    a disk with one.

    Raises
    ------
    BudgetError
        If the budget is not a size, or a budget applies and `local_dir` is on tmpfs.
    """
    option = spark.conf.get(QUERY_OPTION, None)
    pyspark_memory = spark.sparkContext.getConf().get(PYSPARK_MEMORY, None)
    budget = MemoryBudget.for_query(keyword, option, pyspark_memory)
    if budget is None:
        return None, local_dir or default_local_dir()
    if local_dir is None:
        return budget, disk_local_dir()
    if is_memory_fs(local_dir):
        raise BudgetError(f"local_dir {local_dir} is on a memory file system; a memory "
                          f"budget (from {budget.source}) needs the live state on a disk: "
                          f"give a local_dir on a disk, or omit it")
    return budget, local_dir


def stream_join(left: Any, right: Any, key: str | list[str], time: str, value: str, window: Any,
                state_uri: str, *, lateness: Any = 0, **kwargs: Any) -> Any:
    """The windowed stream join of two streaming DataFrames (`WindowJoin`).

    Both inputs need the columns `key` (one or several), `time` and `value` (same
    types). The output has ``<key columns>, left_<time>, left_<value>, right_<time>,
    right_<value>``
    for every pair with equal keys and times at most `window` apart.
    Other keyword arguments go to `stateful`.
    """
    from pyspark.sql import functions as F

    cols = [*key_columns(key), time, value]
    for side, d in (("left", left), ("right", right)):
        missing = [c for c in cols if c not in d.columns]
        if missing:
            raise SchemaChangedError(f"{side} input lacks column(s) {missing}")
    lt = {f.name: f.dataType for f in left.schema.fields}
    rt = {f.name: f.dataType for f in right.schema.fields}
    for c in cols:
        if lt[c] != rt[c]:
            raise SchemaChangedError(f"column {c!r} is {lt[c].simpleString()} on the left and "
                                     f"{rt[c].simpleString()} on the right")
    both = (left.select(*cols, F.lit(0).cast("byte").alias(SIDE_COLUMN))
            .unionByName(right.select(*cols, F.lit(1).cast("byte").alias(SIDE_COLUMN))))
    return stateful(both, key, WindowJoin(time=time, window=window, value=value,
                                          lateness=lateness), state_uri, **kwargs)


def local_session(master: str = "local[2]", app_name: str = "sguard", *,
                  shuffle_partitions: int = 2, conf: dict[str, str] | None = None) -> Any:
    """A local SparkSession set up for sguard (PYSPARK_PYTHON = this interpreter).

    Python workers run ``PYSPARK_PYTHON`` (default ``python3`` on the PATH); it
    is set to `sys.executable` so workers import pyarrow and sguard from this
    environment. Workers are forked by `sguard.spark.daemon`, so each starts with
    sguard imported and its compiled kernels loaded (pass
    ``conf={"spark.python.daemon.module": "pyspark.daemon"}`` for PySpark's own).
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if master.startswith("local-cluster"):
        import pyspark
        os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
    b = (SparkSession.builder.master(master).appName(app_name)
         .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
         .config("spark.python.worker.faulthandler.enabled", "true")
         # a loaded host: a Python worker's sockets to the JVM (e.g. a transformWithState
         # state server) wait up to 2 minutes instead of 15 s before the query fails
         .config("spark.python.authenticate.socketTimeout", "120s")
         # workers forked with sguard and its kernels loaded (`sguard.spark.daemon`)
         .config("spark.python.daemon.module", "sguard.spark.daemon"))
    if master.startswith("local-cluster"):
        b = b.config("spark.executor.memory", "768m")
    for k, v in (conf or {}).items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    got = spark.sparkContext.master
    if got != master:
        raise ValueError(f"an active SparkSession already runs master {got!r}, not {master!r}: "
                         f"stop it first (spark.stop()) or use it directly")
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def layout_json(layout: OperatorLayout) -> str:
    """The layout as pretty JSON (for status)."""
    return json.dumps(json.loads(layout.to_json()), indent=1)
