"""Unchanged PySpark ``StatefulProcessor`` classes on sguard state against Spark's own
``transformWithStateInPandas`` / ``transformWithState``, in the same run and session.

Processors (`bench._processors`, one class each, used by both sides):

* ``value``: `CountProcessor` (pandas) / `CountRowProcessor` (Row): a running count in a
  ``ValueState`` with TTL, ``time_mode="ProcessingTime"``, output mode ``Update``;
* ``list``: `BufferProcessor` (pandas): a ``ListState`` buffer flushed by an event-time
  timer, ``time_mode="EventTime"`` over ``withWatermark("ts", "5 seconds")``, ``Append``;
* ``map``: `DedupProcessor` (pandas): a ``MapState`` de-duplicator, ``time_mode="None"``,
  ``Append``.

Variants, ``<side>_<flavour>_<processor>``:

* ``spark_pandas_{value,list,map}``: ``df.groupBy("k").transformWithStateInPandas(...)``;
* ``spark_row_value``: ``df.groupBy("k").transformWithState(...)``;
* ``sguard_pandas_{value,list,map}``: `sguard.spark.transform_with_state_in_pandas` with
  the same processor class and arguments, 2 partitions, state URI ``file://`` under the
  run's scratch directory (``/dev/shm`` when writable), checkpoints every 4 batches;
* ``sguard_row_value``: `sguard.spark.transform_with_state`;
* ``sguard_vectorized_value``: the vectorized count (`bench._processors.
  vectorized_count_processor`), run only when ``sguard.spark.VectorizedProcessor`` exists
  and that function returns a processor; otherwise reported missing, with the reason.

Spark runs in its best configuration for these APIs: the RocksDB state store with
changelog checkpointing (and ``trackTotalNumberOfRows=false``, Spark's advice for speed:
`bench._spark_variants.ROCKSDB_CONF`), set on the session for every query; every Spark
run checks that RocksDB was really used (``rocksdb*`` state operator metrics and
``.changelog`` files under the checkpoint's ``state/``): summary
``spark_rocksdb_store_check_<variant>_<keys>``.

Workload: deterministic parquet files written before anything is timed, one micro-batch
per file (``maxFilesPerTrigger=1``): ``k`` long uniform over 10k or 100k keys, ``v`` long,
``id`` long (0..7, so ids repeat per key and the de-duplicator drops most rows once the
state is warm), ``ts`` timestamp (each batch spans 10 s of event time after the
previous one's). Both sides read the same files; the pandas / Row conversions happen
inside each side's operator, timed on both sides alike. ``local[2]``, 2 shuffle
partitions, a ``noop`` sink, ``trigger(availableNow=True)``; one SparkSession
(`sguard.spark.local_session`: Python workers forked by `sguard.spark.daemon`, the
baselines' too) for all variants.

Timing: rows/s of a run = input rows of its measured micro-batches / the sum of their
``batchDuration`` (query.recentProgress), the first micro-batch (JIT, Python workers, plan,
the key set filling) excluded. The session sets
``spark.sql.streaming.noDataMicroBatches.enabled=false``: sguard's output is a plain
streaming DataFrame for which Spark runs no batches without input, so both sides fire due
timers in the batches with input only (it changes nothing in Spark's batches with input;
batches without input would not be counted on either side). Spark's Python APIs take seconds per batch at
100k keys, so the Spark variants run fewer batches and repetitions than sguard's
(``params.batches`` / ``params.reps``): the batches are the same files, so every rate is
over the same rows per batch, only over fewer batches. Variants run interleaved (forward
order on even repetitions, reversed on odd); reported per variant: the median over
repetitions with min/max and every run's rate, p50 / p99 batch latency.

Summary:

* ``processor_ratio_vs_spark_pandas_{value,list,map}_{10k,100k}`` (goal >= 10 at 100k):
  sguard pandas rows/s over Spark's ``transformWithStateInPandas`` on the same processor;
* ``processor_ratio_vs_spark_row_value_{10k,100k}`` (>= 10 at 100k): the Row flavour;
* ``vectorized_ratio_vs_spark_pandas_value_{10k,100k}`` (>= 50 at 100k): the vectorized
  count over Spark's pandas count (``null`` with ``vectorized_missing`` saying why);
* ``checkpoint_ms_on_critical_path`` (<= 5): per batch, the runtime's durability and
  rollback work on the critical path in the *slowest* partition (lock wait + checkpoint
  start + rollback point + input-log wait, from ``<state_uri>/metrics/``:
  `bench._spark_sguard.critical_path_ms`, as `bench.spark_stateful` computes it), mean over
  the measured batches, the worst sguard variant and key count (per variant:
  ``checkpoint_ms_on_critical_path_<variant>_<keys>``, ``..._max`` the worst batch);
* ``agreement``: each processor run by both sides over the same small input (1000 keys,
  4 batches) with the outputs collected: whether the multisets of output rows are equal
  (the de-duplicator's as ``(k, id)``: the row order within a key is each side's own);
* ``targets_missed``, ``errors``, ``load`` (``uptime`` before and after).

Run: ``python -m bench.spark_processors [--quick] [--variants ...] [--out DIR]``; writes
``DIR/spark_processors.json`` and ``DIR/spark_processors.png`` (default ``bench/out``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import _harness

NAME = "spark_processors"
PROCESSORS = ("value", "list", "map")
VARIANTS = ("spark_pandas_value", "spark_pandas_list", "spark_pandas_map", "spark_row_value",
            "sguard_pandas_value", "sguard_pandas_list", "sguard_pandas_map",
            "sguard_row_value", "sguard_vectorized_value")
BASELINE = {"sguard_pandas_value": "spark_pandas_value", "sguard_pandas_list": "spark_pandas_list",
            "sguard_pandas_map": "spark_pandas_map", "sguard_row_value": "spark_row_value",
            "sguard_vectorized_value": "spark_pandas_value"}
KEYS = (10_000, 100_000)
PARTITIONS = 2
ID_SPACE = 8
BATCH_SPAN_MS = 10_000
T0_MS = 1_700_000_000_000
CHECKPOINT_EVERY = 4
TARGETS = {"processor_ratio_vs_spark_pandas_value_100k": (">=", 10),
           "processor_ratio_vs_spark_pandas_list_100k": (">=", 10),
           "processor_ratio_vs_spark_pandas_map_100k": (">=", 10),
           "processor_ratio_vs_spark_row_value_100k": (">=", 10),
           "vectorized_ratio_vs_spark_pandas_value_100k": (">=", 50),
           "checkpoint_ms_on_critical_path": ("<=", 5)}


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, file=sys.stderr, flush=True)


def load() -> str:
    """``uptime``'s load averages (what else ran on this shared machine)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# -- arguments and plan ---------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.spark_processors",
                                 description="StatefulProcessor classes on sguard against "
                                             "Spark's transformWithState(InPandas).")
    ap.add_argument("--quick", action="store_true",
                    help="fewer rows, batches and repetitions (a few minutes on 2 cores)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny: 1000 keys, 2k-row batches, 3 batches, 1 repetition (a check "
                         "that every variant runs, not a measurement)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--keys", default=None,
                    help="comma-separated distinct-key counts (default 10000,100000)")
    ap.add_argument("--rows-per-batch", type=int, default=None,
                    help="input rows per micro-batch (default 100000; --quick 20000)")
    ap.add_argument("--batches", type=int, default=None,
                    help="micro-batches per sguard run (>= 2, the first is warm-up; default "
                         "12, --quick 6)")
    ap.add_argument("--reps", type=int, default=None,
                    help="repetitions of the sguard variants (default 3, --quick 2)")
    ap.add_argument("--no-agreement", action="store_true",
                    help="skip the output agreement check of Spark and sguard")
    ap.add_argument("--agreement-only", action="store_true",
                    help="only the output agreement check (no timed runs)")
    a = _harness.parse_args(ap, argv)
    vs = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in vs if v not in VARIANTS]
    if not vs or bad:
        ap.error(f"--variants: unknown variant(s) {','.join(bad) or '(none given)'}; "
                 f"choose from {','.join(VARIANTS)}")
    a.variants = [v for v in VARIANTS if v in vs]
    try:
        ks = sorted({int(k) for k in (a.keys or "").split(",") if k.strip()})
    except ValueError:
        ap.error(f"--keys must be comma-separated integers, got {a.keys!r}")
    a.keys = ks or ([1000] if a.smoke else list(KEYS))
    if any(not 100 <= k <= 10_000_000 for k in a.keys):
        ap.error(f"--keys must be between 100 and 10000000, got {a.keys}")
    if a.batches is not None and a.batches < 2:
        ap.error("--batches must be >= 2 (the first is warm-up)")
    return a


def plan(a: argparse.Namespace) -> dict[str, Any]:
    """Rows per batch, and batches and repetitions per (variant, keys)."""
    if a.smoke:
        rows, sg_batches, sg_reps = a.rows_per_batch or 2_000, a.batches or 3, a.reps or 1
    elif a.quick:
        rows, sg_batches, sg_reps = a.rows_per_batch or 20_000, a.batches or 6, a.reps or 2
    else:
        rows, sg_batches, sg_reps = a.rows_per_batch or 100_000, a.batches or 12, a.reps or 3
    batches: dict[str, dict[int, int]] = {}
    reps: dict[str, dict[int, int]] = {}
    for v in a.variants:
        batches[v], reps[v] = {}, {}
        for k in a.keys:
            if v.startswith("sguard"):
                batches[v][k], reps[v][k] = sg_batches, sg_reps
                continue
            # Spark's Python APIs cost seconds per batch at 100k keys: fewer batches
            big = k >= 50_000
            if a.smoke:
                b, r = sg_batches, 1
            elif a.quick:
                b, r = (2 if big else 3), 1
            else:
                b, r = (3 if big else 4), (1 if big else 2)
            if v == "spark_pandas_list":
                b = max(b, 3)  # the buffer's first flushes come in the third batch
            batches[v][k], reps[v][k] = min(b, sg_batches), r
    return {"rows_per_batch": rows, "batches": batches, "reps": reps,
            "partitions": PARTITIONS, "checkpoint_every": CHECKPOINT_EVERY}


# -- input --------------------------------------------------------------------------------------------
def batch_table(n_keys: int, batch: int, rows: int) -> Any:
    """Micro-batch ``batch`` (deterministic): ``k``, ``v``, ``id``, ``ts`` (ms timestamps
    spread over the batch's 10 s of event time)."""
    import pyarrow as pa

    rng = np.random.default_rng([n_keys, batch, rows, 31])
    k = rng.integers(0, n_keys, size=rows, dtype=np.int64)
    v = rng.integers(0, 1000, size=rows, dtype=np.int64)
    ids = rng.integers(0, ID_SPACE, size=rows, dtype=np.int64)
    ts = T0_MS + batch * BATCH_SPAN_MS + np.arange(rows, dtype=np.int64) * BATCH_SPAN_MS // rows
    return pa.table({"k": k, "v": v, "id": ids,
                     "ts": pa.array(ts, pa.timestamp("ms"))})


INPUT_SCHEMA = "k long, v long, id long, ts timestamp"


def write_files(root: Path, n_keys: int, rows: int, n_batches: int) -> Path:
    """``root/k<K>-r<rows>/all/batch-XXXXX.parquet`` with increasing modification times."""
    import pyarrow.parquet as pq

    d = root / f"k{n_keys}-r{rows}" / "all"
    d.mkdir(parents=True, exist_ok=True)
    for b in range(n_batches):
        p = d / f"batch-{b:05d}.parquet"
        if not p.exists():
            tmp = d / f".tmp-{b:05d}.parquet"
            pq.write_table(batch_table(n_keys, b, rows), tmp, compression="snappy")
            os.replace(tmp, p)
        os.utime(p, (1_700_000_000 + b, 1_700_000_000 + b))
    return d


def input_dir(root: Path, n_keys: int, rows: int, n_batches: int) -> Path:
    """Hard links to the first ``n_batches`` files: a run's whole input."""
    src = root / f"k{n_keys}-r{rows}" / "all"
    d = root / f"k{n_keys}-r{rows}" / f"first{n_batches}"
    d.mkdir(parents=True, exist_ok=True)
    for b in range(n_batches):
        name = f"batch-{b:05d}.parquet"
        if not (d / name).exists():
            os.link(src / name, d / name)
    return d


# -- building the queries -------------------------------------------------------------------------
def _processor(variant: str) -> tuple[Any, str, str, str]:
    """``(processor instance, output schema, output mode, time mode)`` of a variant."""
    from bench import _processors as P

    proc = variant.rsplit("_", 1)[1]
    if proc == "value":
        cls = P.CountRowProcessor if "_row_" in variant else P.CountProcessor
        return cls(), P.COUNT_SCHEMA, "Update", "ProcessingTime"
    if proc == "list":
        return P.BufferProcessor(), P.BUFFER_SCHEMA, "Append", "EventTime"
    return P.DedupProcessor(), P.DEDUP_SCHEMA, "Append", "None"


def source(spark: Any, path: Path, variant: str) -> Any:
    from bench import _processors as P

    df = (spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1)
          .parquet(str(path)))
    if variant.endswith("_list"):
        df = df.withWatermark("ts", P.WATERMARK_DELAY)
    return df


class VariantMissing(RuntimeError):
    """A variant that cannot run in this checkout (reported with the reason, not an error)."""


def build_spark(df: Any, variant: str) -> tuple[Any, str]:
    proc, schema, mode, tmode = _processor(variant)
    g = df.groupBy("k")
    if "_pandas_" in variant:
        return g.transformWithStateInPandas(proc, schema, mode, tmode), mode
    return g.transformWithState(proc, schema, mode, tmode), mode


def _sguard_kwargs(run_dir: Path) -> dict[str, Any]:
    import sguard.spark as ss

    (run_dir / "state").mkdir(parents=True, exist_ok=True)
    return {"state_uri": (run_dir / "state").as_uri(), "num_partitions": PARTITIONS,
            "local_dir": str(run_dir / "local"),
            "checkpoint": ss.CheckpointConfig(every_n_batches=CHECKPOINT_EVERY)}


def build_sguard(df: Any, variant: str, run_dir: Path) -> tuple[Any, str]:
    import sguard.spark as ss

    fn_name = ("transform_with_state_in_pandas" if "_pandas_" in variant
               else "transform_with_state")
    fn = getattr(ss, fn_name, None)
    if fn is None:
        raise VariantMissing(f"sguard.spark.{fn_name} does not exist in this checkout")
    proc, schema, mode, tmode = _processor(variant)
    kw = _sguard_kwargs(run_dir)
    sdf = fn(df, "k", proc, schema, mode, tmode, kw.pop("state_uri"), kw.pop("num_partitions"),
             **kw)
    return sdf, mode


def vectorized_missing() -> str | None:
    """Why the vectorized variant cannot run here, or None when it can."""
    import sguard.spark as ss

    from bench import _processors as P

    if not hasattr(ss, "VectorizedProcessor"):
        return "sguard.spark.VectorizedProcessor does not exist in this checkout"
    if P.vectorized_count_processor() is None:
        return "bench._processors.vectorized_count_processor is not written yet"
    if not hasattr(ss, "transform_with_state"):
        return "sguard.spark.transform_with_state does not exist in this checkout"
    return None


def build_sguard_vectorized(df: Any, run_dir: Path) -> tuple[Any, str]:
    """The vectorized count through `sguard.spark.transform_with_state`, with the count's
    arguments (adapt here if the vectorized form takes another entry point)."""
    import sguard.spark as ss

    from bench import _processors as P

    why = vectorized_missing()
    if why is not None:
        raise VariantMissing(why)
    kw = _sguard_kwargs(run_dir)
    sdf = ss.transform_with_state(df, "k", P.vectorized_count_processor(), P.COUNT_SCHEMA,
                                  "Update", "ProcessingTime", kw.pop("state_uri"),
                                  kw.pop("num_partitions"), **kw)
    return sdf, "Update"


def build(df: Any, variant: str, run_dir: Path) -> tuple[Any, str]:
    if variant == "sguard_vectorized_value":
        return build_sguard_vectorized(df, run_dir)
    if variant.startswith("sguard_"):
        return build_sguard(df, variant, run_dir)
    return build_spark(df, variant)


# -- one run ------------------------------------------------------------------------------------------
def run_query(sdf: Any, mode: str, checkpoint: Path, name: str, n_batches: int,
              sink: Any = None) -> dict[str, Any]:
    """Run ``sdf`` to the noop sink (or ``foreachBatch(sink)``) until its ``n_batches``
    input files are consumed; the per-batch progress.

    ``trigger(availableNow=True)`` ends the query once the input is consumed and the
    batches without input it needs (timers due) have run, except for Spark's
    transformWithState in ``ProcessingTime`` mode, which runs a batch without input after
    another for ever: the query is stopped once every file was read and a batch without
    input has run (such batches are not counted on either side)."""
    w = sdf.writeStream.outputMode(mode.lower()).queryName(name)
    w = w.foreachBatch(sink) if sink is not None else w.format("noop")
    t0 = time.perf_counter()
    q = (w.option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    stopped = False
    while not q.awaitTermination(0.2):
        ps = q.recentProgress
        if sum(1 for p in ps if p.numInputRows > 0) >= n_batches and ps[-1].numInputRows == 0:
            q.stop()
            stopped = True
            break
    wall = time.perf_counter() - t0
    exc = q.exception()
    if exc is not None and not stopped:
        raise RuntimeError(f"query {name} failed: {exc}")
    return {"wall_s": wall, "progress": [json.loads(p.json) for p in q.recentProgress],
            "stopped": stopped}


def one_run(spark: Any, work: Path, variant: str, n_keys: int, rows: int, n_batches: int,
            tag: str) -> dict[str, Any]:
    """One query from an empty checkpoint location over the first ``n_batches`` files."""
    from bench import _spark_sguard as S
    from bench import _spark_variants as V

    run_dir = work / "runs" / tag
    run_dir.mkdir(parents=True)
    try:
        df = source(spark, input_dir(work / "input", n_keys, rows, n_batches), variant)
        sdf, mode = build(df, variant, run_dir)
        r = run_query(sdf, mode, run_dir / "checkpoint", f"{variant}_{tag}".replace("-", "_"),
                      n_batches)
        out = V.batch_rows(r["progress"], PARTITIONS)
        extra: dict[str, Any] = {}
        if variant.startswith("sguard"):
            extra = S.collect({"run_dir": run_dir, "partitions": PARTITIONS}, out)
        else:
            extra = {"state_store": V.state_store_evidence(r["progress"],
                                                           run_dir / "checkpoint")}
        extra["batches_without_input"] = sum(1 for p in r["progress"]
                                             if int(p.get("numInputRows", 0)) == 0)
        extra["rows_out"] = sum(int(p.get("sink", {}).get("numOutputRows", 0) or 0)
                                for p in r["progress"])
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if len(out) != n_batches:
        raise RuntimeError(f"{variant}: expected {n_batches} micro-batches with input, "
                           f"Spark ran {len(out)}")
    return {"variant": variant, "keys": n_keys, "batches": out, "wall_s": r["wall_s"], **extra}


RETRY_ON = "Python worker failed to connect back"
"""Spark gives a Python worker it starts on its own (transformWithState's driver-side
worker) 10 s to connect; on a loaded machine the start can take longer."""


def run_retrying(spark: Any, work: Path, variant: str, n_keys: int, rows: int,
                 n_batches: int, tag: str, tries: int = 3) -> dict[str, Any]:
    """`one_run`, run again (from an empty checkpoint) when Spark timed out waiting for a
    Python worker to start; the retries are counted in the run's ``retries``."""
    for i in range(tries):
        try:
            r = one_run(spark, work, variant, n_keys, rows, n_batches, f"{tag}-t{i}")
            r["retries"] = i
            return r
        except Exception as e:  # noqa: BLE001 - only the worker start timeout is retried
            if RETRY_ON not in str(e) or i == tries - 1:
                raise
            log(f"  {variant}: {RETRY_ON} (a loaded machine); again")
    raise AssertionError("unreachable")


# -- agreement ------------------------------------------------------------------------------------------
AGREE_KEYS, AGREE_ROWS, AGREE_BATCHES = 1000, 5000, 4


def agreement(spark: Any, work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Each processor on both sides over the same small input, outputs compared as
    multisets of rows (the count's rows carry the running count, so batch boundaries
    matter and are the same files on both sides). Only the batches that read input are
    compared (Spark runs none here, see `session`). The de-duplicator's rows are compared
    as ``(k, id)``: which of a key's rows with a new id comes first in a batch is up to
    each side's row order."""
    out: dict[str, Any] = {}
    write_files(work / "input", AGREE_KEYS, AGREE_ROWS, AGREE_BATCHES)
    pairs = [(sg, BASELINE[sg]) for sg in ("sguard_pandas_value", "sguard_pandas_list",
                                           "sguard_pandas_map", "sguard_row_value")
             if sg in a.variants or BASELINE[sg] in a.variants]
    for sg, sp in pairs:
        # the de-duplicator emits the first row of a new id, and which row of a key comes
        # first within a batch is up to each side: (k, id) is compared, not v
        width = 2 if sg.endswith("_map") else 3
        got: dict[str, Any] = {}
        for v in (sp, sg):
            rows: list[tuple[Any, ...]] = []

            def sink(bdf: Any, bid: int, rows: list[tuple[Any, ...]] = rows) -> None:
                if bid < AGREE_BATCHES:  # batches with input (after them: timers only)
                    rows.extend(tuple(r)[:width] for r in bdf.collect())

            run_dir = work / "runs" / f"agree-{v}"
            run_dir.mkdir(parents=True)
            try:
                df = source(spark, input_dir(work / "input", AGREE_KEYS, AGREE_ROWS,
                                             AGREE_BATCHES), v)
                sdf, mode = build(df, v, run_dir)
                run_query(sdf, mode, run_dir / "checkpoint", f"agree_{v}", AGREE_BATCHES,
                          sink=sink)
                got[v] = Counter(rows)
            except Exception as e:  # noqa: BLE001 - reported
                got[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                if os.environ.get("SGUARD_BENCH_DEBUG"):
                    traceback.print_exc()
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)
        a_, b_ = got[sp], got[sg]
        if isinstance(a_, str) or isinstance(b_, str):
            out[sg] = {"agree": None, "spark": a_ if isinstance(a_, str) else
                       f"{sum(a_.values())} rows", "sguard": b_ if isinstance(b_, str) else
                       f"{sum(b_.values())} rows"}
        else:
            only_spark, only_sguard = a_ - b_, b_ - a_
            out[sg] = {"agree": not only_spark and not only_sguard,
                       "rows_spark": sum(a_.values()), "rows_sguard": sum(b_.values()),
                       "only_spark": sum(only_spark.values()),
                       "only_sguard": sum(only_sguard.values()),
                       "examples_only_spark": [list(map(str, r)) for r in
                                               list(only_spark)[:3]],
                       "examples_only_sguard": [list(map(str, r)) for r in
                                                list(only_sguard)[:3]]}
        log(f"agreement {sg} vs {sp}: {out[sg]}")
    return out


# -- aggregation -----------------------------------------------------------------------------------------
def summarize(a: argparse.Namespace, runs: dict[int, dict[str, list[dict[str, Any]]]],
              errors: dict[str, str], missing: dict[str, str]) -> tuple[dict[str, Any],
                                                                        dict[int, Any]]:
    from bench.spark_stateful import _ratio, summarize_variant

    per = {k: {v: summarize_variant(rs) for v, rs in runs[k].items() if rs} for k in a.keys}
    s: dict[str, Any] = {}
    cps: list[float] = []
    for k, vs in per.items():
        tag = f"{k // 1000}k" if k >= 1000 else str(k)
        rate = {v: d["rows_per_s"] for v, d in vs.items()}
        for v, d in vs.items():
            s[f"rows_per_s_{v}_{tag}"] = d["rows_per_s"]
            s[f"rows_per_s_{v}_{tag}_min_max"] = [d["rows_per_s_min"], d["rows_per_s_max"]]
        for sg, sp in BASELINE.items():
            if sg == "sguard_vectorized_value":
                field = f"vectorized_ratio_vs_spark_pandas_value_{tag}"
            else:
                field = f"processor_ratio_vs_{sp}_{tag}"
            if sg not in a.variants and sp not in a.variants:
                continue
            r = _ratio(rate.get(sg), rate.get(sp))
            s[field] = r
            if r is None:
                why = missing.get(sg) or errors.get(f"{sg}_{k}") or errors.get(f"{sp}_{k}")
                if why:
                    s[field + "_why_null"] = why
        for v, d in vs.items():
            st = d.get("state_store")
            if st:
                s[f"spark_rocksdb_store_check_{v}_{tag}"] = (
                    f"{sum(1 for x in st if x['store'] == 'rocksdb')} of {len(st)} runs used "
                    f"RocksDB ({min(x['rocksdb_metrics'] for x in st)}+ rocksdb* state "
                    f"metrics, {min(x['changelog_files'] for x in st)}+ .changelog files)")
            if v.startswith("sguard") and d["breakdown_ms"].get("checkpoint") is not None:
                c = d["breakdown_ms"]["checkpoint"]
                s[f"checkpoint_ms_on_critical_path_{v}_{tag}"] = c
                s[f"checkpoint_ms_on_critical_path_{v}_{tag}_max"] = d.get("checkpoint_ms_max")
                s[f"checkpoints_timed_{v}_{tag}"] = d.get("measured_batches_with_checkpoint")
                cps.append(c)
    s["checkpoint_ms_on_critical_path"] = max(cps) if cps else None
    if "sguard_vectorized_value" in missing:
        s["vectorized_missing"] = missing["sguard_vectorized_value"]
    missed: dict[str, str] = {}
    for f, (op, t) in TARGETS.items():
        val = s.get(f)
        if not isinstance(val, (int, float)):
            missed[f] = "not measured" + (f": {s[f + '_why_null']}" if f + "_why_null" in s
                                          else "")
        elif (op == ">=" and val < t) or (op == "<=" and val > t):
            missed[f] = f"{val:.3g} vs target {op} {t}"
    s["targets_missed"] = missed
    return s, per


# -- plot -------------------------------------------------------------------------------------------------
def plot(per: dict[int, dict[str, dict[str, Any]]], path: Path) -> None:
    """Rows/s per variant and key count (log scale, median with min-max bars); the sguard
    variants' mean per-batch breakdown (Spark, state work, checkpoint on the critical
    path)."""
    plt, _ = _harness.figure(NAME)
    keys = sorted(per)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5),
                                   gridspec_kw={"width_ratios": [1.6, 1]})
    vs = [v for v in VARIANTS if any(v in per[k] for k in keys)]
    w = 0.8 / max(1, len(keys))
    for i, k in enumerate(keys):
        x = np.arange(len(vs)) + i * w
        med = np.array([per[k].get(v, {}).get("rows_per_s", np.nan) for v in vs])
        lo = np.array([per[k].get(v, {}).get("rows_per_s_min", np.nan) for v in vs])
        hi = np.array([per[k].get(v, {}).get("rows_per_s_max", np.nan) for v in vs])
        ax1.bar(x, med, w, yerr=[np.nan_to_num(med - lo), np.nan_to_num(hi - med)],
                capsize=3, label=f"{k // 1000}k keys" if k >= 1000 else f"{k} keys")
    ax1.set_xticks(np.arange(len(vs)) + w * (len(keys) - 1) / 2)
    ax1.set_xticklabels([v.replace("_", "\n", 1) for v in vs], fontsize=7)
    ax1.set_yscale("log")
    ax1.set_ylabel("rows/s (median of runs; bars: min-max)")
    ax1.set_title("StatefulProcessor throughput: Spark (RocksDB + changelog) vs sguard,\n"
                  "local[2], 2 partitions, same input files", fontsize=9)
    ax1.legend(fontsize=8)
    sg = [(k, v) for k in keys for v in VARIANTS if v.startswith("sguard") and v in per[k]]
    bottom = np.zeros(len(sg))
    for f, lab in (("spark", "rest of the batch (Spark, Python worker, processor)"),
                   ("placement", "state placement (per partition)"),
                   ("state", "runtime state work (per partition)"),
                   ("checkpoint", "checkpoint on critical path (slowest partition)")):
        vals = np.array([per[k][v]["breakdown_ms"].get(f) or 0.0 for k, v in sg])
        ax2.bar(np.arange(len(sg)), vals, 0.6, bottom=bottom, label=lab)
        bottom += vals
    ax2.set_xticks(np.arange(len(sg)))
    ax2.set_xticklabels([f"{v.replace('sguard_', '')}\n{k // 1000}k" for k, v in sg],
                        fontsize=7)
    ax2.set_ylabel("ms per micro-batch (mean of measured batches)")
    ax2.set_title("sguard: per-batch breakdown", fontsize=9)
    if sg:
        ax2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main -------------------------------------------------------------------------------------------------
def session(work: Path) -> Any:
    """`sguard.spark.local_session` with Spark's best store for these APIs (RocksDB with
    changelog checkpointing) and the bench's settings; workers import this repository."""
    from bench import _spark_variants as V
    from sguard.spark import local_session

    repo = str(Path(__file__).resolve().parent.parent)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    pp = os.environ.get("PYTHONPATH", "")
    if repo not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = repo + (os.pathsep + pp if pp else "")
    conf = {"spark.default.parallelism": str(PARTITIONS),
            "spark.driver.memory": "3g",
            "spark.local.dir": str(work / "spark-local"),
            "spark.sql.streaming.numRecentProgressUpdates": "10000",
            "spark.sql.adaptive.enabled": "false",
            "spark.python.worker.reuse": "true",
            # batches without input run no timers: Spark fires due timers in the batches
            # with input as sguard does (it never runs batches without input), and a
            # ProcessingTime query under availableNow ends (counted on neither side)
            "spark.sql.streaming.noDataMicroBatches.enabled": "false",
            **V.ROCKSDB_CONF}
    return local_session("local[2]", "sguard-bench-spark-processors",
                         shuffle_partitions=PARTITIONS, conf=conf)


def measure(spark: Any, work: Path, a: argparse.Namespace, pl: dict[str, Any],
            errors: dict[str, str], missing: dict[str, str]
            ) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """Every variant at every key count, interleaved (forward on even repetitions,
    reversed on odd); a failing variant is reported in ``errors`` and not run again."""
    from bench.spark_stateful import measured, run_rate

    rows = pl["rows_per_batch"]
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {k: {v: [] for v in a.variants}
                                                         for k in a.keys}
    for k in a.keys:
        kt = f"{k // 1000}k" if k >= 1000 else str(k)
        for rep in range(max(pl["reps"][v][k] for v in a.variants)):
            order = list(a.variants) if rep % 2 == 0 else list(reversed(a.variants))
            for v in order:
                if rep >= pl["reps"][v][k] or f"{v}_{k}" in errors or v in missing:
                    continue
                try:
                    r = run_retrying(spark, work, v, k, rows, pl["batches"][v][k],
                                     f"k{k}-r{rep}-{v}")
                except VariantMissing as e:
                    missing[v] = str(e)
                    log(f"{v}: missing: {e}")
                    continue
                except Exception as e:  # noqa: BLE001 - reported, the others go on
                    errors[f"{v}_{k}"] = f"{type(e).__name__}: {str(e)[:1500]}"
                    log(f"[{kt} keys] rep {rep + 1} {v}: FAILED {errors[f'{v}_{k}'][:300]}")
                    if os.environ.get("SGUARD_BENCH_DEBUG"):
                        traceback.print_exc()
                    continue
                r["load"] = load()
                runs[k][v].append(r)
                ms = [b["duration_ms"] for b in measured(r)]
                log(f"[{kt} keys] rep {rep + 1}/{pl['reps'][v][k]} {v:24s} "
                    f"{run_rate(r) / 1e3:8.1f}k rows/s, {len(ms)} measured batches, p50 "
                    f"{np.median(ms):.0f} ms; {r['load'].split('load average:')[-1].strip()}")
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    pl = plan(a)
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="sguard-bench-processors-",
                                 dir=str(shm) if shm.is_dir() and os.access(shm, os.W_OK)
                                 else None))
    t0 = time.perf_counter()
    load_start = load()
    log(f"plan: {json.dumps(pl)}; {load_start}")
    errors: dict[str, str] = {}
    missing: dict[str, str] = {}
    agree: dict[str, Any] = {}
    try:
        for k in ([] if a.agreement_only else a.keys):  # the input, before any timing
            write_files(work / "input", k, pl["rows_per_batch"],
                        max(pl["batches"][v][k] for v in a.variants))
        if "sguard_vectorized_value" in a.variants:
            why = vectorized_missing()
            if why is not None:
                missing["sguard_vectorized_value"] = why
                log(f"sguard_vectorized_value: missing: {why}")
        spark = session(work)
        try:
            log("warm-up (JVM, Python workers; discarded) ..." if not a.agreement_only
                else "agreement only: no warm-up, no timed runs")
            wk = min(a.keys)
            write_files(work / "input", wk, 2_000, 2)
            for v in ([next((v for v in a.variants if v.startswith("spark_")), None)]
                      + [next((v for v in a.variants if v.startswith("sguard_")
                               and v not in missing), None)]):
                if v is None or a.agreement_only:
                    continue
                try:
                    run_retrying(spark, work, v, wk, 2_000, 2, f"warmup-{v}")
                except Exception as e:  # noqa: BLE001 - the measured runs report failures
                    log(f"  warm-up {v} failed: {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]}")
            runs = ({k: {v: [] for v in a.variants} for k in a.keys} if a.agreement_only
                    else measure(spark, work, a, pl, errors, missing))
            if not a.no_agreement and any(v.startswith("sguard") and v not in missing
                                          for v in a.variants):
                log("agreement: each processor on both sides, 1000 keys, 4 batches ...")
                agree = agreement(spark, work, a)
        finally:
            spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary, per = summarize(a, runs, errors, missing)
    if agree:
        summary["agreement"] = {sg: d.get("agree") for sg, d in agree.items()}
    summary["errors"] = errors
    summary["load"] = {"start": load_start, "end": load()}
    params = {"quick": a.quick, "smoke": a.smoke, "master": "local[2]", **pl,
              "keys": a.keys, "variants": a.variants,
              "rows_per_s": "input rows of the measured batches / the sum of their "
                            "batchDuration (query.recentProgress); the first micro-batch of "
                            "every run is excluded, and batches without input on both sides",
              "batches_note": "Spark's Python APIs run fewer micro-batches and repetitions "
                              "than sguard (see batches / reps): the same files, so the same "
                              "rows per batch, over fewer batches",
              "spark_conf": "RocksDB state store, changelog checkpointing, "
                            "trackTotalNumberOfRows=false (bench._spark_variants.ROCKSDB_CONF)",
              "sguard_conf": f"2 partitions, checkpoint every {CHECKPOINT_EVERY} batches, "
                             "state URI and local state under /dev/shm",
              "interleaving": "variants forward on even repetitions, reversed on odd",
              "processors": {"value": "CountProcessor / CountRowProcessor: ValueState with "
                                      "TTL, ProcessingTime, Update",
                             "list": "BufferProcessor: ListState, event-time timer, "
                                     "EventTime (withWatermark ts 5 s), Append",
                             "map": "DedupProcessor: MapState, time mode None, Append"}}
    data = {"per_keys": {str(k): per[k] for k in per}, "agreement": agree,
            "runs": {str(k): runs[k] for k in runs}, "elapsed_s": time.perf_counter() - t0}
    path = _harness.write_result(NAME, summary, json.loads(json.dumps(data, default=_jsonable)),
                                 params)
    _, png = _harness.figure(NAME)
    plot(per, png)
    print(json.dumps(summary, indent=2, default=_jsonable))
    print(f"wrote {path} and {png} in {time.perf_counter() - t0:.0f} s")
    return 0


def _jsonable(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
