"""sguard in Spark against Spark's own stateful paths, in the same run (issue 9).

Workload (`bench._spark_variants`): deterministic parquet files, one 100k-row
micro-batch per file (``maxFilesPerTrigger=1``), int64 ``key`` uniform over 10k or
100k distinct keys and an int64 ``ts``; the running per-key count / min(ts) /
max(ts); ``local[2]``, 2 shuffle partitions, a ``noop`` sink,
``trigger(availableNow=True)``, Python workers on this interpreter.

Variants, run in one SparkSession, interleaved (forward order on even
repetitions, reversed on odd ones) to spread the drift of this shared machine:

* ``sql``      JVM ``groupBy(key).agg(count, min, max)``, HDFS-backed state store, update mode
* ``sql_rocksdb`` the same with the RocksDB state store provider, changelog checkpointing and
               ``trackTotalNumberOfRows=false`` (Spark's advice for speed); each run checks
               it really used RocksDB (``rocksdb*`` state operator metrics, ``.changelog``
               files under the checkpoint's ``state/``: ``sql_rocksdb_store_check_*``)
* ``aipws``    ``applyInPandasWithState`` (HDFS-backed state store)
* ``tws``      ``transformWithState``, row API (``StatefulProcessor``, ``ValueState``),
               RocksDB state store with changelog checkpointing
* ``ceiling``  ``repartition(P, key).mapInArrow`` over a dense numpy array per partition in
               ``/dev/shm``, no checkpoints: the best this pipeline shape can do
* ``sguard``   `sguard.spark.stateful` with a running aggregate, state in mmm pools under
               ``/dev/shm``, asynchronous checkpoints to a ``file://`` state URI

Two more sets of runs (``--extras``), at the largest key count:

* ``keys``: the same aggregate with the same keys as strings (``str(k)``) and as a
  composite key (``tenant`` string, ``user`` int64), ``sql``, ``sql_rocksdb`` and
  ``sguard`` interleaved
  over the same parquet input (the conversion is in the files, outside every timing);
  skipped with "not run: string keys not available" while `sguard.spark.stateful`
  refuses such keys;
* ``p99`` (issue 19): sguard with a checkpoint at the start of every batch
  (``CheckpointConfig(every_n_batches=1)``) and the same query without checkpoints
  (``CheckpointConfig(every_n_batches=None, interval_s=None)``), interleaved,
  ``--p99-batches`` batches per run.

Every run starts from an empty checkpoint location. Its first micro-batch is a
warm-up (JIT, Python workers, plan) and is left out of rows/s and latency. The
Python APIs are slow at 100k keys, so they run fewer batches (``params.batches``).

Reported per variant and key count: rows/s (rows of the measured batches over
the sum of their ``batchDuration``; median over repetitions, with min/max), p50 /
p99 batch latency (``batchDuration``) over all measured batches, and the mean
per-batch breakdown: Spark's state operator metrics (``allUpdatesTimeMs``,
``commitTimeMs``, per partition) for the Spark variants, the operator's own per-task
timings for ``ceiling`` and ``sguard`` (for ``sguard`` also "placement": bringing the
state to "after b-1", i.e. re-attaching the pool file another Python worker left, a
rollback or a restore), and the rest of the batch as "Spark".

Summary fields (issue 9), with the sguard variant's definitions:

* ``ratio_vs_best_python_{10k,100k}`` (target >= 5): sguard rows/s over the better of
  ``aipws`` and ``tws``; ``ratio_vs_sql_*`` (>= 1); ``ratio_vs_ceiling_*`` (goal >= 0.9);
* ``state_ms_per_partition_100k`` (<= 10): median over measured batches of the mean over
  partitions of the runtime's ``apply_ms`` (the operator's work on a ~50k-row partition,
  inside Spark, with the other partition's task, the JVM and this machine's other load on
  the same 2 cores). ``..._direct`` is the same operator code on the same rows without
  Spark (`bench._spark_micro.state_work_direct`), ``..._direct_after_attach`` after a
  re-attach of the pool file in a fresh page manager (what a task pays when Spark gave
  the partition to another Python worker);
* ``checkpoint_ms_on_critical_path`` (<= 5): per batch, everything the runtime does on
  the critical path for durability and rollback, in the *slowest* partition
  (`bench._spark_sguard.critical_path_ms`): the wait for the partition's lock (held by the
  previous worker until its checkpoint in flight is durable) + starting a checkpoint
  (prepare pause, adopting a recorded base, reading the page versions: the runtime's
  ``checkpoint_call_ms``; 0 in batches without one) + the rollback point (snapshot,
  ``base.npy``, marker) + the wait for the input-log write; mean per measured batch, the
  worse of the two key counts (``..._max``: the worst batch). Quick runs time one
  checkpoint (batch 4 of 6) and the batch after it, full runs three (batches 4, 8, 12 of
  16): ``checkpoints_timed_*``. ``lock_wait_ms`` is the lock-wait part (slowest
  partition, mean per batch, worse key count), ``prepare_ms_per_batch_*`` the prepare
  pause and ``start_beyond_prepare_ms_per_batch_*`` the rest of starting a checkpoint
  (``adopt_ms_per_batch_*``, ``manager_call_ms_per_batch_*`` with the prepare pause
  inside it, ``versions_ms_per_batch_*``: each the slowest partition's). Spark's counterpart is
  ``spark_commit_ms_per_partition_*`` (``commitTimeMs`` per partition);
* ``ratio_vs_sql_rocksdb_{10k,100k}`` (>= 1): sguard over ``sql_rocksdb``;
  ``ratio_vs_best_sql_*`` over the faster of the two Spark SQL stores;
* ``ratio_vs_sql_str_100k`` (>= 1.2), ``ratio_vs_sql_composite_100k``: sguard over Spark SQL
  (HDFS store) with string / composite keys (``ratio_vs_sql_rocksdb_str_100k``,
  ``ratio_vs_best_sql_str_100k``... beside them); ``state_ms_per_partition_100k_str`` the
  string-key state work (as ``state_ms_per_partition_100k``) and
  ``str_state_work_over_int`` (<= 2) its ratio to the integer path's in the same run;
  ``str_state_work_over_int_direct`` (<= 1.5) / ``composite_...`` the same without Spark
  (`bench._spark_micro.state_work_interleaved`: one warmed state per key kind, rounds that
  apply the next batch to each kind back to back, order reversed every other round; the
  best apply over the int path's best, ``..._rounds`` the per-round ratios' min, median, max);
* ``spark_batch_p99_ratio_ckpt_every_batch`` (<= 1.2, issue 19): p99 of ``batchDuration``
  over the measured batches (pooled over repetitions) with a checkpoint every batch over
  the p99 without checkpoints; p50 / mean / max beside it;
* ``rollback_ms_1m_keys`` (<= 1): in memory, `mmm.PageManager.rollback` of one 50k-row
  batch on a 1M-key `HashMap` plus the first access after it (the lazy index rebuild);
  ``rollback_file_ms_1m_keys``: the runtime's other path, another Python worker rolling
  back in the pool file while attaching it (`sguard.spark.versions.attach_at`) plus the
  first access, when that worker still maps the file (it held the partition before, as
  under ``local[2]``); ``rollback_file_cold_ms_1m_keys`` the same in a worker mapping the
  file for the first time (a new worker after a crash);
* ``checkpoints_incremental_{10k,100k}``: how many of the sguard runs' checkpoints were
  incremental (each run's first one is full);
* ``recovery_s_100k``: restore plus replay after the executor's local state is lost
  (slowest partition), with ``recovery_replay_batches`` / ``recovery_replay_rows``
  (`bench._spark_sguard.recovery`);
* ``targets_missed``: each target missed, by how much.

Run: ``python -m bench.spark_stateful [--quick] [--out DIR]``; writes
``DIR/spark_stateful.json`` and ``DIR/spark_stateful.png`` (default ``bench/out``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

NAME = "spark_stateful"
VARIANTS = ("sql", "sql_rocksdb", "aipws", "tws", "ceiling", "sguard")
KEY_VARIANTS = ("sql", "sql_rocksdb", "sguard")  # the string / composite key runs
EXTRAS = ("keys", "p99")
PYTHON_APIS = ("aipws", "tws")
KEYS = (10_000, 100_000)
PARTITIONS = 2
DEFAULT_OUT = Path(__file__).resolve().parent / "out"
LABEL = {"sql": "JVM SQL groupBy (HDFS store)",
         "sql_rocksdb": "JVM SQL groupBy (RocksDB store, changelog)",
         "aipws": "applyInPandasWithState",
         "tws": "transformWithState (RocksDB)", "ceiling": "dense numpy ceiling",
         "sguard": "sguard"}
SHORT = {"sql": "JVM SQL groupBy\n(HDFS store)", "sql_rocksdb": "JVM SQL groupBy\n(RocksDB)",
         "aipws": "applyInPandas\nWithState",
         "tws": "transformWith\nState (RocksDB)", "ceiling": "dense numpy\nceiling",
         "sguard": "sguard"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and validate the arguments (one-line errors, exit code 2)."""
    p = _Parser(prog="python -m bench.spark_stateful",
                description="sguard's Spark operator against Spark's stateful APIs (issue 9).")
    p.add_argument("--quick", action="store_true",
                   help="fewer batches and repetitions (a few minutes on 2 cores)")
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help="directory for spark_stateful.json/.png (default bench/out)")
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions of the fast variants (sql, ceiling, sguard)")
    p.add_argument("--batches", type=int, default=None,
                   help="micro-batches per run of the fast variants (>= 2: the first is warm-up)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--keys", default=",".join(str(k) for k in KEYS),
                   help="comma-separated distinct-key counts (default 10000,100000)")
    p.add_argument("--extras", default=",".join(EXTRAS),
                   help="comma-separated subset of keys (string and composite keys at the "
                        "largest key count), p99 (checkpoint every batch vs none); '' for none")
    p.add_argument("--p99-batches", type=int, default=None,
                   help="micro-batches per run of the p99 pair (default 16 quick, 40 full)")
    a = p.parse_args(argv)
    xs = [x.strip() for x in a.extras.split(",") if x.strip()]
    badx = [x for x in xs if x not in EXTRAS]
    if badx:
        p.error(f"--extras: unknown {','.join(badx)}; choose from {','.join(EXTRAS)}")
    a.extras = [x for x in EXTRAS if x in xs]
    if a.p99_batches is not None and not 4 <= a.p99_batches <= 1000:
        p.error(f"--p99-batches must be between 4 and 1000, got {a.p99_batches}")
    if a.reps is not None and not 1 <= a.reps <= 50:
        p.error(f"--reps must be between 1 and 50, got {a.reps}")
    if a.batches is not None and not 2 <= a.batches <= 500:
        p.error(f"--batches must be between 2 and 500 (the first is warm-up), got {a.batches}")
    vs = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in vs if v not in VARIANTS]
    if not vs or bad:
        p.error(f"--variants: unknown variant(s) {','.join(bad) or '(none given)'}; "
                f"choose from {','.join(VARIANTS)}")
    a.variants = [v for v in VARIANTS if v in vs]
    try:
        ks = sorted({int(k) for k in a.keys.split(",") if k.strip()})
    except ValueError:
        p.error(f"--keys must be comma-separated integers, got {a.keys!r}")
    if not ks or any(not 100 <= k <= 10_000_000 for k in ks):
        p.error(f"--keys must be between 100 and 10000000, got {a.keys!r}")
    a.keys = ks
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {a.out!r} exists and is not a directory")
    parent = next((q for q in [out, *out.parents] if q.exists()), None)
    if parent is None or not os.access(parent, os.W_OK):
        p.error(f"--out {a.out!r} is not writable")
    a.out = out
    return a


def plan(a: argparse.Namespace) -> dict[str, Any]:
    """Repetitions and batches per (variant, keys)."""
    # the default policy checkpoints at the start of batches 4, 8, 12, ...: a quick run
    # times one checkpoint and the batch after it, a full run three and the batches after
    fast_batches = a.batches or (6 if a.quick else 16)
    fast_reps = a.reps or (2 if a.quick else 3)
    reps: dict[str, dict[int, int]] = {}
    batches: dict[str, dict[int, int]] = {}
    skipped: dict[str, str] = {}
    for v in a.variants:
        reps[v], batches[v] = {}, {}
        for k in a.keys:
            big = k >= 50_000
            if v in PYTHON_APIS:  # slow per key: capped batches and repetitions (in the JSON)
                if a.quick and big and v == "aipws":
                    skipped[f"{v}_{k}"] = ("--quick skips applyInPandasWithState at this key "
                                           "count (1-2 min per batch here); the full run has it")
                    continue
                batches[v][k] = min(fast_batches, 2 if a.quick else 2 if big else 4)
                reps[v][k] = 1 if (a.quick or big or v == "aipws") else min(fast_reps, 2)
            else:
                batches[v][k], reps[v][k] = fast_batches, fast_reps
    big = max(a.keys)
    key_runs = ({"keys": big, "kinds": ["str", "composite"], "variants": list(KEY_VARIANTS),
                 "batches": fast_batches, "reps": fast_reps} if "keys" in a.extras else None)
    p99 = ({"keys": big, "batches": a.p99_batches or (16 if a.quick else 40),
            "reps": fast_reps, "variants": ["sguard_ckpt_every_batch", "sguard_no_ckpt"]}
           if "p99" in a.extras else None)
    return {"reps": reps, "batches": batches, "skipped": skipped, "partitions": PARTITIONS,
            "rows_per_batch": _rows_per_batch(), "key_runs": key_runs, "p99": p99}


def _rows_per_batch() -> int:
    from bench._spark_variants import ROWS_PER_BATCH
    return ROWS_PER_BATCH


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, file=sys.stderr, flush=True)


# -- one run ------------------------------------------------------------------------------------
def one_run(spark: Any, work: Path, variant: str, n_keys: int, n_batches: int, tag: str,
            kind: str = "int", checkpoint_every: int | None = None) -> dict[str, Any]:
    """One query from an empty checkpoint location over the first ``n_batches`` files of
    the ``kind``-keyed input. ``checkpoint_every`` (sguard only): the policy's
    ``every_n_batches`` (`bench._spark_sguard.NO_CHECKPOINTS`: none); default the
    runtime's default policy."""
    from bench import _spark_variants as V

    run_dir = work / "runs" / tag
    run_dir.mkdir(parents=True)
    src = V.source(spark, V.input_dir(work / "input", n_keys, n_batches, kind), kind)
    extra: dict[str, Any] = {}
    if variant == "sguard":
        from bench import _spark_sguard as S

        sdf, mode, ctx = S.build(spark, src, n_keys, PARTITIONS, run_dir, kind,
                                 S.CHECKPOINT_EVERY if checkpoint_every is None
                                 else checkpoint_every)
    else:
        sdf, mode = V.build(spark, variant, src, n_keys, PARTITIONS, run_dir / "state", kind)
        ctx = None
    r = V.run_query(spark, sdf, mode, run_dir / "checkpoint", f"{variant}_{tag}")
    rows = V.batch_rows(r["progress"], PARTITIONS)
    if variant == "ceiling":
        _merge_task_metrics(rows, run_dir / "state" / "metrics.jsonl")
    elif variant == "sguard":
        from bench import _spark_sguard as S

        extra = S.collect(ctx, rows)
    elif variant in ("sql", "sql_rocksdb", "tws"):
        extra = {"state_store": V.state_store_evidence(r["progress"], run_dir / "checkpoint")}
    shutil.rmtree(run_dir, ignore_errors=True)
    if len(rows) != n_batches:
        raise RuntimeError(f"{variant}: expected {n_batches} micro-batches with input, "
                           f"Spark ran {len(rows)}")
    return {"variant": variant, "keys": n_keys, "kind": kind, "batches": rows,
            "wall_s": r["wall_s"], **extra}


def _merge_task_metrics(rows: list[dict[str, Any]], path: Path) -> None:
    """Per batch: the mean over partitions of the tasks' own ``state_ms``."""
    per: dict[int, list[float]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            m = json.loads(line)
            per.setdefault(int(m["batch"]), []).append(float(m["state_ms"]))
    for r in rows:
        xs = per.get(r["batch"])
        r["state_ms"] = float(np.mean(xs)) if xs else None
        r["commit_ms"] = 0.0


# -- aggregation ----------------------------------------------------------------------------------
def measured(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The batches after the first (warm-up) one."""
    bs: list[dict[str, Any]] = run["batches"][1:]
    return bs


def run_rate(run: dict[str, Any]) -> float:
    bs = measured(run)
    ms = sum(b["duration_ms"] for b in bs)
    return sum(b["rows"] for b in bs) / (ms / 1e3) if ms > 0 else float("nan")


def summarize_variant(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [run_rate(r) for r in runs]
    bs = [b for r in runs for b in measured(r)]
    dur = np.array([b["duration_ms"] for b in bs], float)

    def mean_of(field: str) -> float | None:
        xs = [b[field] for b in bs if b.get(field) is not None]
        return float(np.mean(xs)) if xs else None

    def median_of(field: str) -> float | None:
        xs = [b[field] for b in bs if b.get(field) is not None]
        return float(np.median(xs)) if xs else None

    state, commit = mean_of("state_ms"), mean_of("commit_ms")
    d = float(dur.mean())
    attach = mean_of("attach_ms")  # sguard: bringing the state to "after b-1" (re-attach...)
    spark_rest = d - (state or 0.0) - (commit or 0.0) - (attach or 0.0)
    breakdown: dict[str, float | None] = {
        "batch": d, "spark": spark_rest, "state": state, "checkpoint": commit, "placement": attach,
        "add_batch": mean_of("add_batch_ms"), "driver_offset_commit_logs": mean_of("driver_log_ms")}
    for f in ("prepare_ms", "snapshot_ms", "log_wait_ms", "state_ms_max",
              "task_total_ms", "lock_wait_ms", "checkpoint_start_ms", "start_beyond_prepare_ms",
              "adopt_ms", "manager_ms", "versions_ms",
              "commit_ms_mean_over_partitions", "attach_ms_max", "task_total_ms_max"):
        v = mean_of(f)
        if v is not None:
            breakdown[f] = v
    ck = [c for r in runs for c in r.get("checkpoints", [])]
    commits = [b["commit_ms"] for b in bs if b.get("commit_ms") is not None]
    stores = [r["state_store"] for r in runs if "state_store" in r]
    extra: dict[str, Any] = {}
    if commits:
        extra["checkpoint_ms_max"] = float(np.max(commits))
    if any("checkpoint_started" in b for b in bs):
        extra["measured_batches_with_checkpoint"] = sum(1 for b in bs
                                                        if b.get("checkpoint_started"))
    if stores:
        extra["state_store"] = stores
    bases = [x for b in bs for x in b.get("checkpoint_base", [])]
    if bases:
        extra["checkpoint_bases"] = {x: bases.count(x) for x in sorted(set(bases))}
    return {**extra, "runs": len(runs), "measured_batches": len(bs),
           "checkpoints": len(ck), "checkpoints_incremental": sum(1 for c in ck if not c["full"]),
           "rows_per_s": float(np.median(rates)), "rows_per_s_min": float(np.min(rates)),
           "rows_per_s_max": float(np.max(rates)), "rows_per_s_runs": rates,
           "latency_p50_ms": float(np.percentile(dur, 50)),
           "latency_p99_ms": float(np.percentile(dur, 99)),
           "breakdown_ms": breakdown,
           "state_ms_median": median_of("state_ms"), "checkpoint_ms_median": median_of("commit_ms")}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else a / b


def build_summary(per: dict[int, dict[str, dict[str, Any]]], micro: dict[str, Any],
                  recovery: dict[str, Any] | None,
                  keyper: dict[str, dict[str, dict[str, Any]]] | None = None,
                  key_runs_note: str | None = None, big: int = 100_000,
                  p99: dict[str, Any] | None = None) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for k, vs in per.items():
        tag = f"{k // 1000}k"
        rate = {v: d["rows_per_s"] for v, d in vs.items() if "rows_per_s" in d}
        for v, r in rate.items():
            s[f"rows_per_s_{v}_{tag}"] = r
        py = [rate[v] for v in PYTHON_APIS if v in rate]
        best = max(py) if py else None
        s[f"best_python_{tag}"] = next((v for v in PYTHON_APIS if rate.get(v) == best), None)
        sg = rate.get("sguard")
        s[f"ratio_vs_best_python_{tag}"] = _ratio(sg, best)
        s[f"ratio_vs_sql_{tag}"] = _ratio(sg, rate.get("sql"))
        s[f"ratio_vs_sql_rocksdb_{tag}"] = _ratio(sg, rate.get("sql_rocksdb"))
        sqls = [rate[v] for v in ("sql", "sql_rocksdb") if v in rate]
        s[f"ratio_vs_best_sql_{tag}"] = _ratio(sg, max(sqls) if sqls else None)
        if "sql_rocksdb" in vs and vs["sql_rocksdb"].get("state_store"):
            st = vs["sql_rocksdb"]["state_store"]
            s[f"sql_rocksdb_store_check_{tag}"] = (
                f"{sum(1 for x in st if x['store'] == 'rocksdb')} of {len(st)} runs used "
                f"RocksDB ({min(x['rocksdb_metrics'] for x in st)}+ rocksdb* state metrics, "
                f"{min(x['changelog_files'] for x in st)}+ .changelog files)")
        s[f"ratio_vs_ceiling_{tag}"] = _ratio(sg, rate.get("ceiling"))
        s[f"ceiling_vs_sql_{tag}"] = _ratio(rate.get("ceiling"), rate.get("sql"))
        if "sguard" in vs and "breakdown_ms" in vs["sguard"]:
            bd = vs["sguard"]["breakdown_ms"]
            s[f"state_ms_per_partition_{tag}"] = vs["sguard"]["state_ms_median"]
            s[f"state_ms_per_partition_{tag}_mean"] = bd.get("state")
            s[f"prepare_ms_per_batch_{tag}"] = bd.get("prepare_ms")
            s[f"rollback_point_ms_per_batch_{tag}"] = bd.get("snapshot_ms")
            s[f"checkpoint_ms_on_critical_path_{tag}"] = bd.get("checkpoint")
            s[f"checkpoint_ms_on_critical_path_{tag}_median"] = vs["sguard"]["checkpoint_ms_median"]
            s[f"checkpoint_ms_on_critical_path_{tag}_max"] = vs["sguard"].get("checkpoint_ms_max")
            s[f"lock_wait_ms_{tag}"] = bd.get("lock_wait_ms")
            s[f"checkpoint_start_ms_per_batch_{tag}"] = bd.get("checkpoint_start_ms")
            s[f"start_beyond_prepare_ms_per_batch_{tag}"] = bd.get("start_beyond_prepare_ms")
            s[f"adopt_ms_per_batch_{tag}"] = bd.get("adopt_ms")
            s[f"manager_call_ms_per_batch_{tag}"] = bd.get("manager_ms")
            s[f"versions_ms_per_batch_{tag}"] = bd.get("versions_ms")
            s[f"checkpoint_bases_{tag}"] = vs["sguard"].get("checkpoint_bases")
            s[f"log_wait_ms_per_batch_{tag}"] = bd.get("log_wait_ms")
            s[f"checkpoints_timed_{tag}"] = vs["sguard"].get("measured_batches_with_checkpoint")
            s[f"attach_ms_per_batch_{tag}"] = bd.get("placement")
            # after the first of a run, checkpoints should be incremental although every
            # batch re-attaches the partition in the other Python worker
            s[f"checkpoints_incremental_{tag}"] = (f"{vs['sguard']['checkpoints_incremental']}"
                                                   f" of {vs['sguard']['checkpoints']}")
        for v in ("sql", "tws", "aipws"):
            if v in vs and "breakdown_ms" in vs[v]:
                s[f"spark_commit_ms_per_partition_{v}_{tag}"] = vs[v]["breakdown_ms"]["checkpoint"]
    cps = [s[f"checkpoint_ms_on_critical_path_{k // 1000}k"] for k in per
           if s.get(f"checkpoint_ms_on_critical_path_{k // 1000}k") is not None]
    s["checkpoint_ms_on_critical_path"] = max(cps) if cps else None
    lws = [s[f"lock_wait_ms_{k // 1000}k"] for k in per
           if s.get(f"lock_wait_ms_{k // 1000}k") is not None]
    s["lock_wait_ms"] = max(lws) if lws else None
    btag = f"{big // 1000}k"
    if keyper is not None or key_runs_note is not None:
        _key_summary(s, keyper or {}, key_runs_note, per.get(big, {}), btag)
    if p99 is not None:
        s.update(p99)
    rb = micro["rollback"]
    s["rollback_ms_1m_keys"] = rb["rollback_plus_rebuild_ms"]["median"]
    s["rollback_call_ms_1m_keys"] = rb["rollback_ms"]["median"]
    if "rollback_file" in micro:
        s["rollback_file_ms_1m_keys"] = micro["rollback_file"]["warm"]["total_ms"]["median"]
        s["rollback_file_cold_ms_1m_keys"] = micro["rollback_file"]["cold"]["total_ms"]["median"]
    if "state_direct" in micro:
        sd = micro["state_direct"]
        s["state_ms_per_partition_100k_direct"] = sd["kept_ms"]["median"]
        s["state_ms_per_partition_100k_direct_after_attach"] = (
            sd["attach_ms"]["median"] + sd["apply_after_attach_ms"]["median"])
        for kind in ("str", "composite"):
            sk = micro.get(f"state_direct_{kind}")
            if sk is None:
                continue
            if "kept_ms" not in sk:
                s[f"state_ms_per_partition_100k_{kind}_direct"] = f"not run: {sk.get('error')}"
                continue
            s[f"state_ms_per_partition_100k_{kind}_direct"] = sk["kept_ms"]["median"]
            inter = micro.get("state_interleaved")
            if inter is not None:  # back-to-back applies, interleaved rounds: the steady one
                oi = inter["over_int"][kind]
                s[f"{kind}_state_work_over_int_direct"] = inter["over_int_of_best"][kind]
                s[f"{kind}_state_work_over_int_direct_rounds"] = [oi["min"], oi["median"],
                                                                  oi["max"]]
                s["state_ms_per_partition_100k_int_direct_interleaved"] = \
                    inter["ms"]["int"]["median"]
    if recovery is not None:
        s["recovery_s_100k"] = recovery.get("recovery_s")
        s["recovery_replay_batches"] = recovery.get("replay_batches")
        s["recovery_replay_rows"] = recovery.get("replay_rows")
    targets: dict[str, tuple[str, float]] = {
               "ratio_vs_best_python_10k": (">=", 5), "ratio_vs_best_python_100k": (">=", 5),
               "ratio_vs_sql_10k": (">=", 1), "ratio_vs_sql_100k": (">=", 1),
               "ratio_vs_sql_rocksdb_10k": (">=", 1), "ratio_vs_sql_rocksdb_100k": (">=", 1),
               "ratio_vs_sql_str_100k": (">=", 1.2), "str_state_work_over_int": ("<=", 2),
               "str_state_work_over_int_direct": ("<=", 1.5),
               "spark_batch_p99_ratio_ckpt_every_batch": ("<=", 1.2),
               "ratio_vs_ceiling_10k": (">=", 0.9), "ratio_vs_ceiling_100k": (">=", 0.9),
               "state_ms_per_partition_100k": ("<=", 10),
               "checkpoint_ms_on_critical_path": ("<=", 5), "rollback_ms_1m_keys": ("<=", 1),
               "rollback_file_ms_1m_keys": ("<=", 1)}
    missed: dict[str, str] = {}
    for f, (op, t) in targets.items():
        val = s.get(f)
        if isinstance(val, str):
            missed[f] = val
        elif not isinstance(val, (int, float)):
            missed[f] = "not measured"
        elif (op == ">=" and val < t) or (op == "<=" and val > t):
            missed[f] = f"{val:.3g} vs target {op} {t}"
    s["targets_missed"] = missed
    return s


def _key_summary(s: dict[str, Any], keyper: dict[str, dict[str, dict[str, Any]]],
                 note: str | None, intper: dict[str, dict[str, Any]], btag: str) -> None:
    """String / composite key fields (``note``: why they did not run)."""
    for kind in ("str", "composite"):
        vs = keyper.get(kind, {})
        sg, sql, rdb = vs.get("sguard"), vs.get("sql"), vs.get("sql_rocksdb")
        if sg is None or sql is None:
            why = note or f"not run: {kind} keys failed (see errors)"
            s[f"ratio_vs_sql_{kind}_{btag}"] = why
            s[f"state_ms_per_partition_{btag}_{kind}"] = why
            continue
        s[f"rows_per_s_sguard_{kind}_{btag}"] = sg["rows_per_s"]
        s[f"rows_per_s_sql_{kind}_{btag}"] = sql["rows_per_s"]
        s[f"ratio_vs_sql_{kind}_{btag}"] = _ratio(sg["rows_per_s"], sql["rows_per_s"])
        if rdb is not None:
            s[f"rows_per_s_sql_rocksdb_{kind}_{btag}"] = rdb["rows_per_s"]
            s[f"ratio_vs_sql_rocksdb_{kind}_{btag}"] = _ratio(sg["rows_per_s"],
                                                               rdb["rows_per_s"])
            s[f"ratio_vs_best_sql_{kind}_{btag}"] = _ratio(
                sg["rows_per_s"], max(sql["rows_per_s"], rdb["rows_per_s"]))
        s[f"state_ms_per_partition_{btag}_{kind}"] = sg["state_ms_median"]
        s[f"checkpoint_ms_on_critical_path_{btag}_{kind}"] = sg["breakdown_ms"].get("checkpoint")
        s[f"sguard_{kind}_over_int_rows_per_s_{btag}"] = _ratio(
            sg["rows_per_s"], intper.get("sguard", {}).get("rows_per_s"))
        s[f"sql_{kind}_over_int_rows_per_s_{btag}"] = _ratio(
            sql["rows_per_s"], intper.get("sql", {}).get("rows_per_s"))
    st = s.get(f"state_ms_per_partition_{btag}_str")
    s["str_state_work_over_int"] = (
        _ratio(st, intper.get("sguard", {}).get("state_ms_median"))
        if isinstance(st, (int, float)) else st)


def p99_fields(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """``spark_batch_p99_ratio_ckpt_every_batch`` and its parts: the p99 (and p50, mean)
    of the measured batches' ``batchDuration`` with a checkpoint every batch over the
    same query without checkpoints, pooled over the repetitions."""
    out: dict[str, Any] = {}
    d = {v: np.array([b["duration_ms"] for r in rs for b in measured(r)], float)
         for v, rs in runs.items() if rs}
    on, off = d.get("sguard_ckpt_every_batch"), d.get("sguard_no_ckpt")
    if on is None or off is None or not len(on) or not len(off):
        out["spark_batch_p99_ratio_ckpt_every_batch"] = "not measured"
        return out
    for name, x in (("ckpt_every_batch", on), ("no_ckpt", off)):
        out[f"spark_batch_p99_ms_{name}"] = float(np.percentile(x, 99))
        out[f"spark_batch_p50_ms_{name}"] = float(np.percentile(x, 50))
        out[f"spark_batch_mean_ms_{name}"] = float(x.mean())
        out[f"spark_batch_max_ms_{name}"] = float(x.max())
    out["spark_batch_p99_ratio_ckpt_every_batch"] = float(np.percentile(on, 99)
                                                          / np.percentile(off, 99))
    out["spark_batch_p50_ratio_ckpt_every_batch"] = float(np.percentile(on, 50)
                                                          / np.percentile(off, 50))
    out["spark_batch_mean_ratio_ckpt_every_batch"] = float(on.mean() / off.mean())
    out["spark_batch_p99_batches_per_variant"] = int(min(len(on), len(off)))
    bs = [b for r in runs["sguard_ckpt_every_batch"] for b in measured(r)]
    out["spark_batch_p99_checkpoints_started"] = (
        f"{sum(1 for b in bs if b.get('checkpoint_started'))} of {len(bs)} measured batches")
    out["spark_batch_p99_no_ckpt_checkpoints"] = sum(len(r.get("checkpoints", []))
                                                      for r in runs["sguard_no_ckpt"])
    cp = [b["commit_ms"] for b in bs if b.get("commit_ms") is not None]
    lw = [b["lock_wait_ms"] for b in bs if b.get("lock_wait_ms") is not None]
    if cp:
        out["checkpoint_ms_on_critical_path_every_batch"] = float(np.mean(cp))
        out["lock_wait_ms_every_batch"] = float(np.mean(lw)) if lw else None
    return out


# -- plot ---------------------------------------------------------------------------------------
def plot(per: dict[int, dict[str, dict[str, Any]]], path: Path,
         keyper: dict[str, dict[str, dict[str, Any]]] | None = None, big: int = 100_000,
         p99runs: dict[str, list[dict[str, Any]]] | None = None) -> None:
    """Top row: throughput per variant (log scale) and, per key count, the per-batch
    breakdown of the variants that share the pipeline's cost scale (linear; the Python
    APIs' batch times are in the labels). Bottom row: integer vs string vs composite keys
    (rows/s, sguard and Spark SQL) and the batch durations with a checkpoint every batch
    and without checkpoints (sorted, slowest first)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(per)
    fig, grid = plt.subplots(2, 1 + len(keys), figsize=(6 + 4.5 * len(keys), 10),
                             gridspec_kw={"width_ratios": [1.5] + [1] * len(keys)},
                             squeeze=False)
    axes = grid[0]
    ax1 = axes[0]
    vs = [v for v in VARIANTS if any(v in per[k] for k in keys)]
    w = 0.8 / max(1, len(keys))
    for i, k in enumerate(keys):
        x = np.arange(len(vs)) + i * w
        med = [per[k].get(v, {}).get("rows_per_s", np.nan) for v in vs]
        lo = [m - per[k].get(v, {}).get("rows_per_s_min", m) for v, m in zip(vs, med)]
        hi = [per[k].get(v, {}).get("rows_per_s_max", m) - m for v, m in zip(vs, med)]
        ax1.bar(x, med, w, yerr=[np.nan_to_num(lo), np.nan_to_num(hi)], capsize=3,
                label=f"{k // 1000}k keys")
    ax1.set_xticks(np.arange(len(vs)) + w * (len(keys) - 1) / 2)
    ax1.set_xticklabels([SHORT[v] for v in vs], fontsize=7)
    ax1.set_yscale("log")
    ax1.set_ylabel("rows/s (median of runs; bars: min-max)")
    ax1.set_title("Throughput: local[2], 2 partitions, 100k-row batches", fontsize=9)
    ax1.legend(fontsize=8)
    parts = [("spark", "Spark: stages, shuffle, Arrow, offset/commit logs"),
             ("placement", "state placement: re-attach / rollback (per partition)"),
             ("state", "state work (per partition)"),
             ("checkpoint", "checkpoint on critical path (sguard: slowest partition's lock "
                            "wait + start + rollback point + log wait; Spark: commitTimeMs "
                            "per partition)")]
    for ax, k in zip(axes[1:], keys):
        vk = [v for v in VARIANTS if v in per[k] and v not in PYTHON_APIS]
        bottom = np.zeros(len(vk))
        for f, lab in parts:
            vals = np.array([per[k][v]["breakdown_ms"].get(f) or 0.0 for v in vk])
            ax.bar(np.arange(len(vk)), vals, 0.6, bottom=bottom, label=lab)
            bottom += vals
        ax.set_xticks(np.arange(len(vk)))
        ax.set_xticklabels([SHORT[v] for v in vk], fontsize=7)
        ax.set_ylabel("ms per micro-batch (mean of measured batches)")
        py = ", ".join(f"{v} {per[k][v]['breakdown_ms']['batch'] / 1e3:.1f} s"
                       for v in PYTHON_APIS if v in per[k])
        ax.set_title(f"Per-batch breakdown, {k // 1000}k keys" + (f"\n(Python APIs per batch: {py})"
                                                                  if py else ""), fontsize=9)
        ax.legend(fontsize=6, loc="lower right")
    _plot_extras(grid[1], per.get(big, {}), keyper or {}, big, p99runs or {})
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_extras(axes: Any, intper: dict[str, dict[str, Any]],
                 keyper: dict[str, dict[str, dict[str, Any]]], big: int,
                 p99runs: dict[str, list[dict[str, Any]]]) -> None:
    for ax in axes[2:]:
        ax.axis("off")
    ax = axes[0]
    kinds = [("int", intper)] + [(k, keyper[k]) for k in ("str", "composite") if k in keyper]
    for i, v in enumerate(KEY_VARIANTS):
        vals = [d.get(v, {}).get("rows_per_s", np.nan) for _, d in kinds]
        ax.bar(np.arange(len(kinds)) + i * 0.27, vals, 0.27, label=LABEL[v])
    ax.set_xticks(np.arange(len(kinds)) + 0.27)
    ax.set_xticklabels([f"{k} key" for k, _ in kinds], fontsize=8)
    ax.set_ylabel("rows/s (median of runs)")
    ax.set_title(f"Key types, {big // 1000}k keys (missing bar: not run)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    for v, rs in p99runs.items():
        d = np.sort([b["duration_ms"] for r in rs for b in measured(r)])[::-1]
        if len(d):
            ax.plot(np.arange(1, len(d) + 1), d, marker=".",
                    label=f"{v} (p99 {np.percentile(d, 99):.0f} ms)")
    ax.set_xlabel("batches, slowest first")
    ax.set_ylabel("batchDuration (ms)")
    ax.set_title(f"sguard, checkpoint every batch vs none, {big // 1000}k keys", fontsize=9)
    if p99runs:
        ax.legend(fontsize=7)


# -- main -----------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    pl = plan(a)
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="sguard-bench-spark-",
                                 dir=str(shm) if shm.is_dir() and os.access(shm, os.W_OK)
                                 else None))
    t_start = time.perf_counter()
    try:
        return _run(a, pl, work, t_start)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _failed(errors: dict[str, str], key: str, e: BaseException) -> str:
    """Keep a failed run's error under ``key`` (its first line, 300 characters at most)
    and return it; with ``SGUARD_BENCH_DEBUG`` set, print the traceback too."""
    errors[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if os.environ.get("SGUARD_BENCH_DEBUG"):
        traceback.print_exc()
    return errors[key]


def _log_run(where: str, rep: int, reps: int, variant: str, r: dict[str, Any],
             extra: str = "") -> None:
    """One line for a measured run: its rate and median batch duration."""
    log(f"{where} rep {rep + 1}/{reps} {variant:8s} {extra}{run_rate(r) / 1e3:8.1f}k rows/s, "
        f"p50 {np.median([b['duration_ms'] for b in measured(r)]):.0f} ms")


def measure_micro(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The state work without Spark: rollback on mmm, and (with sguard) in the pool file
    and the per-batch state work, so the Spark numbers can be read against them."""
    from bench import _spark_micro as M

    log("rollback on mmm: 1M keys, 50k-row batch ...")
    micro: dict[str, Any] = {"rollback": M.rollback_1m_keys(repeats=5 if a.quick else 15)}
    rb = micro["rollback"]
    log(f"  in memory: rollback {rb['rollback_ms']['median']:.3f} ms + index rebuild "
        f"{rb['first_access_after_ms']['median']:.3f} ms")
    if "sguard" not in a.variants:
        return micro
    try:
        micro["rollback_file"] = M.rollback_file_1m_keys(repeats=3 if a.quick else 7,
                                                         local_dir=str(work))
        rf = micro["rollback_file"]
        log(f"  in the pool file (another worker): {rf['warm']['total_ms']['median']:.3f} ms"
            f" (file mapped before), {rf['cold']['total_ms']['median']:.3f} ms (first map)")
        log("sguard state work without Spark (100k keys, one partition) ...")
        micro["state_direct"] = M.state_work_direct(repeats=3 if a.quick else 7,
                                                    local_dir=str(work))
        sd = micro["state_direct"]
        log(f"  kept {sd['kept_ms']['median']:.1f} ms, re-attached "
            f"{sd['attach_ms']['median']:.1f} + {sd['apply_after_attach_ms']['median']:.1f} ms")
    except Exception as e:  # noqa: BLE001 - reported, the Spark runs go on
        log(f"  FAILED {type(e).__name__}: {e}")
    if "keys" in a.extras:
        log("sguard state work without Spark, int / str / composite keys interleaved ...")
        try:
            inter = M.state_work_interleaved(repeats=9 if a.quick else 21, local_dir=str(work))
            micro["state_interleaved"] = inter
            for kind in ("str", "composite"):
                micro[f"state_direct_{kind}"] = {"kept_ms": inter["ms"][kind]}
            log("  " + ", ".join(f"{k} {v['median']:.1f} ms" for k, v in inter["ms"].items())
                + "; over int " + ", ".join(f"{k} {v:.2f}"
                                            for k, v in inter["over_int_of_best"].items()))
        except Exception as e:  # noqa: BLE001
            for kind in ("str", "composite"):
                micro[f"state_direct_{kind}"] = {
                    "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            log(f"  not run: {micro['state_direct_str']['error']}")
    return micro


def write_inputs(a: argparse.Namespace, pl: dict[str, Any], work: Path) -> None:
    """The parquet input every variant reads: the same files for all sides, written (and
    any key conversion done) before anything is timed."""
    from bench import _spark_variants as V

    n_files = max(n for v in a.variants for n in pl["batches"][v].values())
    kr, pp = pl["key_runs"], pl["p99"]
    for k in a.keys:
        V.write_files(work / "input", k, max(n_files, pp["batches"] if pp and k == pp["keys"]
                                             else 0))
    if kr is not None:  # the key conversions happen here, untimed, for both sides
        for kind in kr["kinds"]:
            V.write_files(work / "input", kr["keys"], kr["batches"], kind)


def warm_up(spark: Any, work: Path, a: argparse.Namespace) -> None:
    """Untimed runs of the SQL and ceiling queries: the JVM and the Python workers warmed
    before the first measured run, whichever variant comes first."""
    log("warm-up (JVM, Python workers; discarded) ...")
    for v in ("sql", "ceiling"):
        try:
            one_run(spark, work, v, a.keys[0], 2, f"warmup-{v}")
        except Exception as e:  # noqa: BLE001 - the measured runs report failures
            log(f"  warm-up {v} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def measure_variants(spark: Any, work: Path, a: argparse.Namespace, pl: dict[str, Any],
                     errors: dict[str, str]) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """Every variant at every key count, interleaved: forward on even repetitions and
    reversed on odd, so sguard and its baselines run next to each other in time on the
    same session and input. A variant that fails is reported in ``errors`` and skipped."""
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {k: {v: [] for v in a.variants}
                                                         for k in a.keys}
    for k in a.keys:
        max_reps = max(pl["reps"][v].get(k, 0) for v in a.variants)
        for rep in range(max_reps):
            order = list(a.variants) if rep % 2 == 0 else list(reversed(a.variants))
            for v in order:
                if rep >= pl["reps"][v].get(k, 0) or f"{v}_{k}" in errors:
                    continue
                tag = f"k{k}-r{rep}-{v}"
                try:
                    r = one_run(spark, work, v, k, pl["batches"][v][k], tag)
                except Exception as e:  # noqa: BLE001 - a baseline that fails is reported
                    log(f"[{k // 1000}k keys] rep {rep + 1} {v}: FAILED "
                        f"{_failed(errors, f'{v}_{k}', e)}")
                    continue
                runs[k][v].append(r)
                _log_run(f"[{k // 1000}k keys]", rep, pl["reps"][v][k], v, r,
                         f"{len(r['batches'])} batches, ")
    return runs


def measure_recovery(spark: Any, work: Path, errors: dict[str, str]) -> dict[str, Any] | None:
    """sguard's recovery after losing the local state (100k keys), on the same session."""
    from bench import _spark_sguard as S

    log("sguard recovery after losing the local state (100k keys) ...")
    try:
        recovery: dict[str, Any] = S.recovery(spark, work, 100_000, PARTITIONS)
        log(f"  recovery {recovery.get('recovery_s')} s, replay "
            f"{recovery.get('replay_batches')} batch(es)")
        return recovery
    except Exception as e:  # noqa: BLE001
        log(f"  recovery FAILED {_failed(errors, 'sguard_recovery', e)}")
        return None


def summarize_all(a: argparse.Namespace, kr: dict[str, Any] | None, pp: dict[str, Any] | None,
                  runs: dict[int, dict[str, list[dict[str, Any]]]], micro: dict[str, Any],
                  recovery: dict[str, Any] | None,
                  keyruns: dict[str, dict[str, list[dict[str, Any]]]], key_note: str | None,
                  p99runs: dict[str, list[dict[str, Any]]]
                  ) -> tuple[dict[str, Any], dict[int, Any], dict[str, Any] | None, dict[str, Any]]:
    """Per-variant statistics and the summary: ``(summary, per, keyper, p99per)``.

    Besides `build_summary`'s ratios of medians, sguard over each baseline within
    the same repetition (adjacent runs), per key count.
    """
    per = {k: {v: summarize_variant(rs) for v, rs in runs[k].items() if rs} for k in a.keys}
    keyper = ({kind: {v: summarize_variant(rs) for v, rs in vr.items() if rs}
               for kind, vr in keyruns.items()} if kr is not None else None)
    p99per = ({v: summarize_variant(rs) for v, rs in p99runs.items() if rs}
              if pp is not None else {})
    summary = build_summary(per, micro, recovery, keyper, key_note,
                            kr["keys"] if kr else max(a.keys),
                            p99_fields(p99runs) if pp is not None else None)
    for k in a.keys:  # sguard over each baseline within the same repetition (adjacent runs)
        for base in ("sql", "ceiling"):
            pairs = [run_rate(x) / run_rate(y) for x, y in zip(runs[k].get("sguard", []),
                                                                runs[k].get(base, []))]
            if pairs:
                summary[f"ratio_vs_{base}_{k // 1000}k_per_rep"] = pairs
    return summary, per, keyper, p99per


def _run(a: argparse.Namespace, pl: dict[str, Any], work: Path, t_start: float) -> int:
    """Micro-benchmarks; inputs; warm-up; the variants, key kinds, p99 and recovery phases on
    one Spark session; then the summary, ``<out>/spark_stateful.json`` and the PNG."""
    from bench import _spark_variants as V

    micro = measure_micro(a, work)
    write_inputs(a, pl, work)
    kr, pp = pl["key_runs"], pl["p99"]
    spark = V.spark_session(work / "spark-local", PARTITIONS)
    warm_up(spark, work, a)
    errors: dict[str, str] = {}
    recovery = None
    keyruns: dict[str, dict[str, list[dict[str, Any]]]] = {}
    key_note: str | None = None
    p99runs: dict[str, list[dict[str, Any]]] = {}
    try:
        runs = measure_variants(spark, work, a, pl, errors)
        if kr is not None:
            keyruns, key_note = _key_phase(spark, work, kr, errors)
        if pp is not None:
            p99runs = _p99_phase(spark, work, pp, errors)
        if "sguard" in a.variants and 100_000 in a.keys:
            recovery = measure_recovery(spark, work, errors)
    finally:
        spark.stop()
    summary, per, keyper, p99per = summarize_all(a, kr, pp, runs, micro, recovery, keyruns,
                                                 key_note, p99runs)
    summary["errors"] = errors
    doc = {"summary": summary,
           "params": {"quick": a.quick, "master": "local[2]", **pl,
                      "python_api_batches_capped": "applyInPandasWithState and "
                      "transformWithState run fewer micro-batches and repetitions (see "
                      "batches/reps) because they are slow per key; their rates are over "
                      "the same 100k-row batches",
                      "warmup": "the first micro-batch of every run is excluded",
                      "rows_per_s": "rows of the measured batches / sum of their batchDuration",
                      "interleaving": "variants forward on even repetitions, reversed on odd"},
           "data": {"per_keys": {str(k): per[k] for k in per}, "micro": micro,
                    "recovery": recovery, "key_kinds": keyper, "key_runs": keyruns,
                    "p99": p99per, "p99_runs": p99runs,
                    "runs": {str(k): {v: runs[k][v] for v in runs[k]} for k in runs}},
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "platform": platform.platform(), "loadavg_end": os.getloadavg()},
           "elapsed_s": time.perf_counter() - t_start,
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = a.out / f"{NAME}.json"
    path.write_text(json.dumps(doc, indent=2, default=_jsonable))
    plot(per, a.out / f"{NAME}.png", keyper, kr["keys"] if kr else max(a.keys), p99runs)
    print(json.dumps(summary, indent=2, default=_jsonable))
    print(f"wrote {path} and {a.out / (NAME + '.png')} in {doc['elapsed_s']:.0f} s")
    return 0


def _key_phase(spark: Any, work: Path, kr: dict[str, Any], errors: dict[str, str]
               ) -> tuple[dict[str, dict[str, list[dict[str, Any]]]], str | None]:
    """String and composite keys: Spark SQL and sguard, interleaved, over the same input
    (the keys converted in the parquet files). Returns the runs and, when sguard refuses
    such keys, the note that says so."""
    from bench import _spark_sguard as S

    k = kr["keys"]
    out: dict[str, dict[str, list[dict[str, Any]]]] = {kind: {v: [] for v in kr["variants"]}
                                                        for kind in kr["kinds"]}
    note: str | None = None
    unsupported: set[str] = set()
    for kind in kr["kinds"]:  # does sguard take these keys? (building the query tells)
        probe = work / "runs" / f"probe-{kind}"
        try:
            from bench import _spark_variants as V

            S.build(spark, V.source(spark, V.input_dir(work / "input", k, kr["batches"], kind),
                                    kind), k, PARTITIONS, probe, kind)
        except S.KeysNotSupported as e:
            unsupported.add(kind)
            note = "not run: string keys not available"
            errors[f"sguard_{kind}_{k}"] = f"{note} ({e})"
            log(f"[{k // 1000}k {kind} keys] {errors[f'sguard_{kind}_{k}']}; its baselines "
                f"are skipped too")
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    for rep in range(kr["reps"]):
        for kind in [x for x in kr["kinds"] if x not in unsupported]:
            order = kr["variants"] if rep % 2 == 0 else list(reversed(kr["variants"]))
            for v in order:
                if f"{v}_{kind}_{k}" in errors or kind in unsupported:
                    continue
                tag = f"k{k}-{kind}-r{rep}-{v}"
                try:
                    r = one_run(spark, work, v, k, kr["batches"], tag, kind=kind)
                except S.KeysNotSupported as e:
                    unsupported.add(kind)
                    note = "not run: string keys not available"
                    errors[f"sguard_{kind}_{k}"] = f"{note} ({e})"
                    log(f"[{k // 1000}k {kind} keys] sguard: {errors[f'sguard_{kind}_{k}']}")
                    shutil.rmtree(work / "runs" / tag, ignore_errors=True)
                    continue
                except Exception as e:  # noqa: BLE001
                    log(f"[{k // 1000}k {kind} keys] {v}: FAILED "
                        f"{_failed(errors, f'{v}_{kind}_{k}', e)}")
                    continue
                out[kind][v].append(r)
                _log_run(f"[{k // 1000}k {kind} keys]", rep, kr["reps"], v, r)
    if note is not None and len(unsupported) < len(kr["kinds"]):
        note = None  # one kind ran: the other's error says why it did not
    return out, note


def _p99_phase(spark: Any, work: Path, pp: dict[str, Any], errors: dict[str, str]
               ) -> dict[str, list[dict[str, Any]]]:
    """sguard with a checkpoint at the start of every batch and the same query without
    checkpoints (`bench._spark_sguard.NO_CHECKPOINTS`), interleaved (issue 19)."""
    from bench import _spark_sguard as S

    every = {"sguard_ckpt_every_batch": 1, "sguard_no_ckpt": S.NO_CHECKPOINTS}
    k = pp["keys"]
    out: dict[str, list[dict[str, Any]]] = {v: [] for v in pp["variants"]}
    for rep in range(pp["reps"]):
        order = pp["variants"] if rep % 2 == 0 else list(reversed(pp["variants"]))
        for v in order:
            if f"{v}_{k}" in errors:
                continue
            try:
                r = one_run(spark, work, "sguard", k, pp["batches"], f"k{k}-p99-r{rep}-{v}",
                            checkpoint_every=every[v])
            except Exception as e:  # noqa: BLE001
                log(f"[{k // 1000}k p99] {v}: FAILED {_failed(errors, f'{v}_{k}', e)}")
                continue
            out[v].append(r)
            d = [b["duration_ms"] for b in measured(r)]
            log(f"[{k // 1000}k p99] rep {rep + 1}/{pp['reps']} {v:24s} "
                f"p50 {np.median(d):.0f} ms, max {max(d):.0f} ms, "
                f"{len(r.get('checkpoints', []))} checkpoints durable")
    return out


def _jsonable(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
