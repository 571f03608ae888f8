"""``big_state --spark``: the running aggregate in Spark with its state about 4x the
executor's memory budget, each query in its own driver process inside a memory cgroup.

Variants, one driver process each (``local[2]``, 2 shuffle partitions, the JVM heap
committed at start: ``-Xms`` = ``-Xmx`` with ``AlwaysPreTouch``, so that it counts in the
base and does not grow into the limit):

* ``sguard_memory``: `sguard.spark.stateful` with a `RunningAggregate`, no budget (every
  page in memory under /dev/shm), no limit: the reference;
* ``sguard_budget``: the same with ``memory_budget`` = the budget, pools on ``--dir`` (a
  disk), 4 KiB pages, inside the cgroup;
* ``rocksdb_sql``: Spark SQL's ``groupBy(key).agg(count, min, max)`` on the RocksDB state
  store (changelog checkpointing, ``trackTotalNumberOfRows=false``, and
  ``boundedMemoryUsage`` with ``maxMemoryUsageMB`` = the budget), inside the cgroup.

The limit is the same formula for both limited variants: the cgroup's usage after the
session started and ran a warm-up query (batches as large as the run's, over 2,000 keys),
plus 1.1x the budget plus 64 MB;
each reports its base, limit, peak and OOM kills. Input (parquet, written before any
timing): batches of 200,000 rows that insert every key once (consecutive ranges),
then 6 (``--quick``) or 12 batches of 100,000 rows, keys uniform over the keys. Throughput:
rows of the timed batches over the sum of their ``batchDuration``. After the run (the
cgroup's figures taken and its limit lifted) the sguard variants' state is read back (`sguard.spark.state.read_local_state`) and its
total count checked against the rows sent (exactly once).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MB = 1 << 20
HEAP = "768m"
VARIANTS = ("sguard_memory", "sguard_budget", "rocksdb_sql")


def write_input(d: Path, keys: int, build: int, batches: int, rows: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    d.mkdir(parents=True, exist_ok=True)
    per = -(-keys // build)
    tabs = [np.arange(i * per, min(keys, (i + 1) * per), dtype=np.int64) for i in range(build)]
    rng = np.random.default_rng(11)
    tabs += [rng.integers(0, keys, rows, dtype=np.int64) for _ in range(batches)]
    ts = 0
    for b, k in enumerate(tabs):
        t = pa.table({"key": k, "ts": np.arange(ts, ts + len(k), dtype=np.int64)})
        ts += len(k)
        pq.write_table(t, d / f"batch-{b:05d}.parquet")
        os.utime(d / f"batch-{b:05d}.parquet", (1_700_000_000 + b, 1_700_000_000 + b))
    return d


def _session(local: Path) -> Any:
    from bench._spark_variants import spark_session
    return spark_session(local, 2, driver_memory=HEAP,
                         java_options=f"-Xms{HEAP} -XX:+AlwaysPreTouch",
                         app="sguard-bench-big-state")


def _query(spark: Any, variant: str, src: Path, run: Path, budget_mb: int) -> tuple[Any, str]:
    df = (spark.readStream.schema("key long, ts long").option("maxFilesPerTrigger", 1)
          .parquet(str(src)))
    if variant == "rocksdb_sql":
        from pyspark.sql import functions as F
        for k, v in {
                "spark.sql.streaming.stateStore.providerClass":
                    "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
                "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
                "spark.sql.streaming.stateStore.rocksdb.trackTotalNumberOfRows": "false",
                "spark.sql.streaming.stateStore.rocksdb.boundedMemoryUsage": "true",
                "spark.sql.streaming.stateStore.rocksdb.maxMemoryUsageMB": str(budget_mb),
        }.items():
            spark.conf.set(k, v)
        return (df.groupBy("key").agg(F.count(F.lit(1)).alias("count"),
                                      F.min("ts").alias("min_ts"),
                                      F.max("ts").alias("max_ts")), "update")
    import sguard.spark as ss
    kw: dict[str, Any] = {}
    if variant == "sguard_budget":
        kw = {"memory_budget": f"{budget_mb}m", "page_bytes": 4096}
    out = ss.stateful(df, key="key", operator=ss.RunningAggregate("ts", ("count", "min", "max")),
                      state_uri=(run / "state").as_uri(), num_partitions=2,
                      local_dir=str(run / "local"), **kw)
    return out, "append"


def _run(spark: Any, variant: str, src: Path, run: Path, budget_mb: int, name: str
         ) -> list[dict[str, Any]]:
    sdf, mode = _query(spark, variant, src, run, budget_mb)
    q = (sdf.writeStream.format("noop").outputMode(mode).queryName(name)
         .option("checkpointLocation", str(run / "checkpoint"))
         .trigger(availableNow=True).start())
    q.awaitTermination()
    if q.exception() is not None:
        raise RuntimeError(f"{variant}: {str(q.exception()).splitlines()[0][:400]}")
    return [json.loads(p.json) for p in q.recentProgress if p.numInputRows]


def driver(a: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process (the parent put it in the cgroup)."""
    work = Path(a.work)
    run = Path(tempfile.mkdtemp(prefix=f"{a.variant}-", dir=a.dir))
    try:
        spark = _session(run / "spark-local")
        _run(spark, a.variant, work / "warm", run / "warm", a.budget_mb, "warm")
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()  # the parent set the limit
        t0 = time.perf_counter()
        prog = _run(spark, a.variant, work / "input", run / "main", a.budget_mb, "main")
        wall = time.perf_counter() - t0
        timed = prog[a.build_batches:]
        rows = sum(int(p["numInputRows"]) for p in timed)
        ms = sum(float(p["batchDuration"]) for p in timed)
        out: dict[str, Any] = {
            "variant": a.variant, "wall_s": wall, "batches": len(prog),
            "build_s": sum(float(p["batchDuration"]) for p in prog[:a.build_batches]) / 1e3,
            "timed_rows": rows, "timed_s": ms / 1e3, "rows_per_s": rows / (ms / 1e3),
            "batch_ms": [float(p["batchDuration"]) for p in prog]}
        print(json.dumps(out), flush=True)
        sys.stdin.readline()  # the parent took the cgroup's figures and lifted its limit
        if a.variant.startswith("sguard"):
            from ioservice import open_root
            from sguard.spark.metrics import read_metrics
            from sguard.spark.state import read_local_state
            recs, _ = read_metrics(open_root(str(run / "main" / "state")))
            last = max(r["batch"] for r in recs)
            tail = [r for r in recs if r["batch"] == last]
            pb = 4096 if a.variant == "sguard_budget" else 1 << 16  # the runtime's default
            out["state_bytes"] = sum(int(r.get("state_bytes", r["state_pages"] * pb))
                                     for r in tail)
            # the live pages (without the copies the rollback point holds): the state
            out["live_bytes"] = sum(int(r.get("live_bytes", 0)) for r in tail)
            out["evicted_bytes"] = sum(int(r.get("evicted_bytes", 0)) for r in tail)
            out["resident_bytes"] = sum(int(r.get("resident_bytes", 0)) for r in tail)
            out["budget_rounds"] = sum(int(r.get("budget_rounds_in_batch", 0)) for r in recs)
            t, _ = read_local_state(str(run / "main" / "state"), local_dir=str(run / "main" / "local"))
            sent = sum(int(p["numInputRows"]) for p in prog)
            got = int(np.asarray(t.column("count")).sum())
            out["exactly_once"] = {"keys": t.num_rows, "count_total": got, "rows_sent": sent,
                                   "ok": got == sent and t.num_rows == a.keys}
        spark.stop()
        return out
    finally:
        shutil.rmtree(run, ignore_errors=True)


def run_variant(a: argparse.Namespace, variant: str, limit: bool) -> dict[str, Any]:
    from bench.big_state import LimitedChild
    cmd = ["bench._big_state_spark", "--driver", variant, "--work", str(a.work),
           "--dir", a.dir, "--budget-mb", str(a.budget_mb), "--keys", str(a.keys),
           "--build-batches", str(a.build_batches)]
    with LimitedChild(cmd, "sguard-big-state-spark", limit) as c:
        first = c.read() or {"variant": variant,
                             "failed": f"exit {c.wait()} before the warm-up ended"}
        if "failed" in first:
            return first
        res: dict[str, Any] = {}
        if c.limited:
            res["base_bytes"] = base = c.usage()
            c.limit(int(base + 1.1 * a.budget_mb * MB + 64 * MB))
        c.say("go")
        got = c.read()  # the run's figures
        if limit:
            res["limit"] = c.report()
            c.limit(-1)  # the exactly-once check reads the whole state: not under the limit
        if got is not None and "failed" not in got:
            c.say("check")
            got = c.read()  # with the check's outcome
        rc = c.wait()
        res.update(got or {"variant": variant, "failed": f"exit {rc}"})
        return res


def spark_main(a: argparse.Namespace) -> dict[str, Any]:
    """Every variant, in order; returns ``{"rows": ..., "summary": ...}``."""
    a.budget_mb = a.budget_mb or (32 if a.quick else 64)
    # ~64 bytes of live 4 KiB pages per key (count, min, max and the key at the map's
    # load, 8 key groups per partition): 4x the budget
    a.keys = a.keys or int(4 * a.budget_mb * MB / 64)
    per_build = 200_000
    a.build_batches = -(-a.keys // per_build)
    batches = 6 if a.quick else 12
    a.work = Path(tempfile.mkdtemp(prefix="big-state-spark-", dir=a.dir))
    try:
        # the warm-up's batches are as large as the run's (Arrow buffers, kernels for
        # those sizes: memory that is not state belongs to the base), over few keys
        write_input(a.work / "warm", 2000, 1, 2, per_build)
        write_input(a.work / "input", a.keys, a.build_batches, batches, 100_000)
        rows = {v: run_variant(a, v, limit=v != "sguard_memory") for v in VARIANTS}
    finally:
        shutil.rmtree(a.work, ignore_errors=True)

    def rate(v: str) -> float | None:
        r = rows[v].get("rows_per_s")
        return float(r) if r else None

    def ratio(x: float | None, y: float | None) -> float | None:
        return None if x is None or not y else x / y
    sb = rows["sguard_budget"]
    peaks = [(r["limit"]["peak_bytes"] - r["base_bytes"]) / (a.budget_mb * MB)
             for r in (rows["sguard_budget"], rows["rocksdb_sql"])
             if "base_bytes" in r and r.get("limit", {}).get("peak_bytes")]
    summary = {
        "big_state_ratio_vs_rocksdb_sql_uniform": ratio(rate("sguard_budget"),
                                                        rate("rocksdb_sql")),
        "spark_budget_over_in_memory_uniform": ratio(rate("sguard_budget"),
                                                     rate("sguard_memory")),
        "spark_rows_per_s": {v: rate(v) for v in VARIANTS},
        # the live pages over the budget (the pool also holds the rollback point's copies)
        "spark_state_over_budget": (sb["live_bytes"] / (a.budget_mb * MB)
                                    if sb.get("live_bytes") else None),
        "spark_pool_over_budget": (sb["state_bytes"] / (a.budget_mb * MB)
                                   if "state_bytes" in sb else None),
        "spark_exactly_once": {v: rows[v].get("exactly_once", {}).get("ok")
                               for v in ("sguard_memory", "sguard_budget")},
        "spark_peak_over_budget_sguard": peaks[0] if peaks else None,
        "spark_oom_kills": {v: rows[v].get("limit", {}).get("oom_kills")
                            for v in ("sguard_budget", "rocksdb_sql")},
        "spark_budget_mb": a.budget_mb, "spark_keys": a.keys}
    return {"rows": rows, "summary": summary}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver", choices=VARIANTS, dest="variant", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--budget-mb", type=int, required=True)
    ap.add_argument("--keys", type=int, required=True)
    ap.add_argument("--build-batches", type=int, required=True)
    a = ap.parse_args()
    try:
        print(json.dumps(driver(a)), flush=True)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as a failed run
        print(json.dumps({"variant": a.variant, "failed": f"{type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:400] if str(exc) else ''}"}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
