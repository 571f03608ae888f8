"""The workload and the Spark-side variants of `bench.spark_stateful`.

Workload: deterministic parquet files, one 100k-row micro-batch per file
(``maxFilesPerTrigger=1``), columns ``key`` (int64, uniform over ``0..K-1``) and
``ts`` (int64, increasing); the same keys as strings or as a composite
``(tenant, user)`` key (`batch_table`, converted when the files are written); the
running per-key count / min(ts) / max(ts); a
``noop`` sink; ``trigger(availableNow=True)``.

Variants (each returns the streaming DataFrame to write, and its output mode):

* ``sql``: ``groupBy(key).agg(count, min, max)``, HDFS-backed state store, update mode;
* ``sql_rocksdb``: the same with the RocksDB state store, changelog checkpointing and
  ``trackTotalNumberOfRows=false`` (`ROCKSDB_CONF`); `state_store_evidence` shows which
  store a run used;
* ``aipws``: ``applyInPandasWithState`` (state store default: HDFS-backed);
* ``tws``: ``transformWithState`` (row API, `StatefulProcessor` + ``ValueState``), RocksDB
  state store with changelog checkpointing;
* ``ceiling``: ``repartition(P, key).mapInArrow`` with a dense numpy array per partition
  in ``/dev/shm`` (memory-mapped ``.npy``), no checkpoints, no exactly-once: the cheapest
  possible state in that pipeline shape;
* ``sguard``: `sguard.spark.stateful` with a `RunningAggregate` (see `bench._spark_sguard`).

The functions that run in Python workers live in this module, which the workers
import (the driver puts the repository on ``PYTHONPATH``).
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROWS_PER_BATCH = 100_000
KEY_KINDS = ("int", "str", "composite")
COMPOSITE_TENANTS = 64  # composite key (tenant, user): tenant = "t%02d" % (k % 64), user = k // 64
HDFS_PROVIDER = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
INPUT_SCHEMA = "key long, ts long"
INPUT_SCHEMAS = {"int": INPUT_SCHEMA, "str": "key string, ts long",
                 "composite": "tenant string, user long, ts long"}
KEY_COLUMNS = {"int": ["key"], "str": ["key"], "composite": ["tenant", "user"]}
ROCKSDB_CONF = {  # Spark SQL's RocksDB state store at its best for this aggregate
    "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
    "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
    # Spark's docs: not tracking the row count saves a read per update
    "spark.sql.streaming.stateStore.rocksdb.trackTotalNumberOfRows": "false",
}
ROCKSDB_RESET = {"spark.sql.streaming.stateStore.providerClass": HDFS_PROVIDER,
                 "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "false",
                 "spark.sql.streaming.stateStore.rocksdb.trackTotalNumberOfRows": "true"}
OUT_SCHEMA = "key long, count long, min_ts long, max_ts long"
AGG_DTYPE = np.dtype([("count", "<i8"), ("min_ts", "<i8"), ("max_ts", "<i8")])


# -- workload ----------------------------------------------------------------------------------
def batch_columns(n_keys: int, batch: int, rows: int = ROWS_PER_BATCH
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The ``key`` and ``ts`` columns of micro-batch ``batch`` (deterministic)."""
    rng = np.random.default_rng([n_keys, batch, 20081])
    keys = rng.integers(0, n_keys, size=rows, dtype=np.int64)
    ts = batch * rows + np.arange(rows, dtype=np.int64)
    return keys, ts


def batch_table(n_keys: int, batch: int, kind: str = "int") -> pa.Table:
    """Micro-batch ``batch`` with its keys as ``kind``: ``int`` (int64 ``key``), ``str``
    (the same keys as decimal strings, ``str(k)``) or ``composite`` (the same keys as
    ``tenant`` = ``"t%02d" % (k % 64)``, ``user`` = ``k // 64``: a bijection, so the
    distinct-key count and every key's rows are the same in all three)."""
    keys, ts = batch_columns(n_keys, batch)
    if kind == "int":
        return pa.table({"key": keys, "ts": ts})
    if kind == "str":
        return pa.table({"key": pa.array(keys.astype(str), pa.string()), "ts": ts})
    if kind == "composite":
        tenants = np.array([f"t{i:02d}" for i in range(COMPOSITE_TENANTS)])
        return pa.table({"tenant": pa.array(tenants[keys % COMPOSITE_TENANTS], pa.string()),
                         "user": keys // COMPOSITE_TENANTS, "ts": ts})
    raise ValueError(f"unknown key kind {kind!r}; choose from {KEY_KINDS}")


def _kdir(root: Path, n_keys: int, kind: str) -> Path:
    return root / (f"k{n_keys}" if kind == "int" else f"k{n_keys}-{kind}")


def write_files(root: Path, n_keys: int, n_batches: int, kind: str = "int") -> Path:
    """``root/k<K>[-kind]/all/batch-XXXXX.parquet`` for batches ``0..n_batches-1`` (kept if
    present), with strictly increasing modification times (the file source's order). The
    key conversion (`batch_table`) happens here, before any timing, for every variant."""
    d = _kdir(root, n_keys, kind) / "all"
    d.mkdir(parents=True, exist_ok=True)
    base = 1_700_000_000
    for b in range(n_batches):
        p = d / f"batch-{b:05d}.parquet"
        if not p.exists():
            tmp = d / f".tmp-{b:05d}.parquet"
            pq.write_table(batch_table(n_keys, b, kind), tmp, compression="snappy")
            os.replace(tmp, p)
        os.utime(p, (base + b, base + b))
    return d


def input_dir(root: Path, n_keys: int, n_batches: int, kind: str = "int") -> Path:
    """A directory holding hard links to the first ``n_batches`` files (a run's whole input)."""
    src = _kdir(root, n_keys, kind) / "all"
    d = _kdir(root, n_keys, kind) / f"first{n_batches}"
    d.mkdir(parents=True, exist_ok=True)
    for b in range(n_batches):
        name = f"batch-{b:05d}.parquet"
        if not (d / name).exists():
            os.link(src / name, d / name)
    return d


# -- Spark session ---------------------------------------------------------------------------------
def spark_session(local_dir: Path, partitions: int = 2, driver_memory: str = "3g",
                  java_options: str | None = None,
                  app: str = "sguard-bench-spark-stateful") -> Any:
    """``local[2]`` with ``partitions`` shuffle partitions, workers on this interpreter,
    forked by `sguard.spark.daemon` (the Python baselines' too: they get its frozen GC);
    ``java_options``: the driver JVM's extra options."""
    import sys

    repo = str(Path(__file__).resolve().parent.parent)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    pp = os.environ.get("PYTHONPATH", "")
    if repo not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = repo + (os.pathsep + pp if pp else "")
    from pyspark.sql import SparkSession

    b = SparkSession.builder
    if java_options:
        b = b.config("spark.driver.extraJavaOptions", java_options)
    spark = (b.master("local[2]").appName(app)
             .config("spark.sql.shuffle.partitions", str(partitions))
             .config("spark.default.parallelism", str(partitions))
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", driver_memory)
             .config("spark.local.dir", str(local_dir))
             .config("spark.sql.streaming.numRecentProgressUpdates", "10000")
             .config("spark.sql.streaming.stateStore.providerClass", HDFS_PROVIDER)
             .config("spark.sql.adaptive.enabled", "false")
             .config("spark.python.worker.reuse", "true")
             # every Python worker (sguard's and the Python baselines') forked by sguard's
             # daemon, as `sguard.spark.local_session` and docs/operating.md advise
             .config("spark.python.daemon.module", "sguard.spark.daemon")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# -- Python-API baselines ----------------------------------------------------------------------------
def aipws_func(key: tuple[Any, ...], pdfs: Iterator[Any], state: Any) -> Iterator[Any]:
    """`applyInPandasWithState`: fold the key's rows into (count, min, max)."""
    import pandas as pd

    if state.exists:
        n, lo, hi = state.get
    else:
        n, lo, hi = 0, None, None
    for pdf in pdfs:
        ts = pdf["ts"]
        n += len(ts)
        a, b = int(ts.min()), int(ts.max())
        lo = a if lo is None or a < lo else lo
        hi = b if hi is None or b > hi else hi
    state.update((n, lo, hi))
    yield pd.DataFrame({"key": [key[0]], "count": [n], "min_ts": [lo], "max_ts": [hi]})


def tws_processor() -> Any:
    """A `StatefulProcessor` for `transformWithState` (row API) keeping one ``ValueState``."""
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class RunningAgg(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.agg = handle.getValueState("agg", "count long, min_ts long, max_ts long")

        def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any
                            ) -> Iterator[Any]:
            if self.agg.exists():
                n, lo, hi = self.agg.get()
            else:
                n, lo, hi = 0, None, None
            for r in rows:
                t = r.ts
                n += 1
                if lo is None or t < lo:
                    lo = t
                if hi is None or t > hi:
                    hi = t
            self.agg.update((n, lo, hi))
            yield Row(key=key[0], count=n, min_ts=lo, max_ts=hi)

        def close(self) -> None:
            pass

    return RunningAgg()


# -- the dense-numpy ceiling ----------------------------------------------------------------------------
class CeilingFn:
    """``mapInArrow`` function: a dense ``(count, min, max)`` array per partition,
    memory-mapped from ``<root>/p<partition>.npy`` (created on first use), updated with
    numpy, the touched keys emitted. Appends ``{"batch", "partition", "rows", "state_ms"}``
    per task to ``<root>/metrics.jsonl``."""

    def __init__(self, root: str, n_keys: int) -> None:
        self.root = root
        self.n_keys = n_keys

    def __call__(self, it: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is None:
            raise RuntimeError("CeilingFn runs inside a Spark task only")
        part = ctx.partitionId()
        batch_id = int(ctx.getLocalProperty("streaming.sql.batchId") or -1)
        batches = list(it)
        t0 = time.perf_counter()
        path = os.path.join(self.root, f"p{part}.npy")
        if not os.path.exists(path):
            arr = np.lib.format.open_memmap(path + ".tmp", mode="w+", dtype=AGG_DTYPE,
                                            shape=(self.n_keys,))
            arr["min_ts"] = np.iinfo(np.int64).max
            arr["max_ts"] = np.iinfo(np.int64).min
            arr.flush()
            del arr
            os.replace(path + ".tmp", path)
        st = np.lib.format.open_memmap(path, mode="r+")
        if batches:
            tbl = pa.Table.from_batches(batches)
            keys = tbl.column("key").to_numpy()
            ts = tbl.column("ts").to_numpy()
        else:
            keys = ts = np.zeros(0, np.int64)
        cnt = np.bincount(keys, minlength=self.n_keys)
        touched = np.flatnonzero(cnt)
        c, lo, hi = st["count"], st["min_ts"], st["max_ts"]
        c += cnt
        np.minimum.at(lo, keys, ts)
        np.maximum.at(hi, keys, ts)
        out = pa.record_batch({"key": touched.astype(np.int64), "count": c[touched],
                               "min_ts": lo[touched], "max_ts": hi[touched]})
        del st, c, lo, hi
        ms = (time.perf_counter() - t0) * 1e3
        with open(os.path.join(self.root, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"batch": batch_id, "partition": part, "rows": int(len(keys)),
                                "state_ms": ms}) + "\n")
        yield out


# -- building the queries -----------------------------------------------------------------------------
def source(spark: Any, path: Path, kind: str = "int") -> Any:
    return (spark.readStream.schema(INPUT_SCHEMAS[kind]).option("maxFilesPerTrigger", 1)
            .parquet(str(path)))


def build(spark: Any, variant: str, df: Any, n_keys: int, partitions: int,
          state_dir: Path, kind: str = "int") -> tuple[Any, str]:
    """The streaming DataFrame of ``variant`` over ``df`` and its output mode."""
    from pyspark.sql import functions as F

    if variant in ("sql", "sql_rocksdb"):
        for k, v in (ROCKSDB_CONF if variant == "sql_rocksdb" else ROCKSDB_RESET).items():
            spark.conf.set(k, v)
        return (df.groupBy(*KEY_COLUMNS[kind]).agg(F.count(F.lit(1)).alias("count"),
                                                   F.min("ts").alias("min_ts"),
                                                   F.max("ts").alias("max_ts")), "update")
    if kind != "int":
        raise ValueError(f"variant {variant!r} runs with integer keys only")
    if variant == "aipws":
        from pyspark.sql.streaming.state import GroupStateTimeout

        spark.conf.set("spark.sql.streaming.stateStore.providerClass", HDFS_PROVIDER)
        return (df.groupBy("key").applyInPandasWithState(
            aipws_func, OUT_SCHEMA, "count long, min_ts long, max_ts long", "update",
            GroupStateTimeout.NoTimeout), "update")
    if variant == "tws":
        spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
        spark.conf.set("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled",
                       "true")
        return (df.groupBy("key").transformWithState(
            tws_processor(), OUT_SCHEMA, "Update", "None"), "update")
    if variant == "ceiling":
        state_dir.mkdir(parents=True, exist_ok=True)
        return (df.repartition(partitions, "key").mapInArrow(
            CeilingFn(str(state_dir), n_keys), OUT_SCHEMA), "append")
    raise ValueError(f"unknown variant {variant!r}")


def run_query(spark: Any, sdf: Any, mode: str, checkpoint: Path, name: str) -> dict[str, Any]:
    """Run ``sdf`` to the noop sink until the input is consumed; the per-batch progress."""
    t0 = time.perf_counter()
    q = (sdf.writeStream.format("noop").outputMode(mode).queryName(name)
         .option("checkpointLocation", str(checkpoint))
         .trigger(availableNow=True).start())
    q.awaitTermination()
    wall = time.perf_counter() - t0
    exc = q.exception()
    if exc is not None:
        raise RuntimeError(f"query {name} failed: {exc}")
    progress = [json.loads(p.json) for p in q.recentProgress]
    for k, v in ROCKSDB_RESET.items():
        spark.conf.set(k, v)
    return {"wall_s": wall, "progress": progress}


def state_store_evidence(progress: list[dict[str, Any]], checkpoint: Path) -> dict[str, Any]:
    """What shows which state store a run used: the state operators' custom metric names
    (RocksDB's start with ``rocksdb``) and the files under ``<checkpoint>/state`` by kind
    (RocksDB with changelog checkpointing writes ``N.changelog`` files and ``.zip``
    snapshots; the HDFS-backed store ``N.delta`` / ``N.snapshot``)."""
    names: set[str] = set()
    for p in progress:
        for o in p.get("stateOperators") or []:
            names.update((o.get("customMetrics") or {}).keys())
    files: dict[str, int] = {}
    sd = checkpoint / "state"
    if sd.is_dir():
        for f in sd.rglob("*"):
            if f.is_file() and not f.name.startswith("."):
                ext = f.suffix or f.name
                files[ext] = files.get(ext, 0) + 1
    rocks = sorted(n for n in names if n.lower().startswith("rocksdb"))
    return {"rocksdb_metrics": len(rocks), "rocksdb_metric_examples": rocks[:4],
            "state_files": files,
            "store": ("rocksdb" if rocks else "hdfs" if files.get(".delta") else "none")
            if names or files else None,
            "changelog_files": files.get(".changelog", 0)}


def batch_rows(progress: list[dict[str, Any]], partitions: int) -> list[dict[str, Any]]:
    """One row per micro-batch that read input: id, rows, duration and its breakdown (ms).

    ``state_ms`` / ``commit_ms`` are Spark's state operator metrics (``allUpdatesTimeMs`` /
    ``commitTimeMs``, summed over tasks by Spark) divided by the number of partitions: the
    mean per partition, i.e. what runs in parallel on the batch's critical path.
    """
    out = []
    for p in progress:
        n = int(p.get("numInputRows", 0))
        if n == 0:
            continue
        d = p.get("durationMs", {})
        ops = p.get("stateOperators") or []
        upd = sum(float(o.get("allUpdatesTimeMs", 0)) + float(o.get("allRemovalsTimeMs", 0))
                  for o in ops)
        com = sum(float(o.get("commitTimeMs", 0)) for o in ops)
        out.append({"batch": int(p["batchId"]), "rows": n,
                    "duration_ms": float(p.get("batchDuration", d.get("triggerExecution", 0))),
                    "trigger_ms": float(d.get("triggerExecution", 0)),
                    "add_batch_ms": float(d.get("addBatch", 0)),
                    "driver_log_ms": float(d.get("walCommit", 0)) + float(d.get("commitOffsets", 0)),
                    "state_ms": upd / partitions if ops else None,
                    "commit_ms": com / partitions if ops else None,
                    "state_rows_total": sum(int(o.get("numRowsTotal", 0)) for o in ops)
                    if ops else None})
    return out
