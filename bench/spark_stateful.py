"""sguard in Spark against Spark's own stateful paths, in the same run (issue 9).

Workload (`bench._spark_variants`): deterministic parquet files, one 100k-row
micro-batch per file (``maxFilesPerTrigger=1``), int64 ``key`` uniform over 10k or
100k distinct keys and an int64 ``ts``; the running per-key count / min(ts) /
max(ts); ``local[2]``, 2 shuffle partitions, a ``noop`` sink,
``trigger(availableNow=True)``, Python workers on this interpreter.

Variants, run in one SparkSession, interleaved (forward order on even
repetitions, reversed on odd ones) to spread the drift of this shared machine:

* ``sql``      JVM ``groupBy(key).agg(count, min, max)``, HDFS-backed state store, update mode
* ``aipws``    ``applyInPandasWithState`` (HDFS-backed state store)
* ``tws``      ``transformWithState``, row API (``StatefulProcessor``, ``ValueState``),
               RocksDB state store with changelog checkpointing
* ``ceiling``  ``repartition(P, key).mapInArrow`` over a dense numpy array per partition in
               ``/dev/shm``, no checkpoints: the best this pipeline shape can do
* ``sguard``   `sguard.spark.stateful` with a running aggregate, state in mmm pools under
               ``/dev/shm``, asynchronous checkpoints to a ``file://`` state URI

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
  the critical path for durability and rollback: the checkpoint's prepare pause (a batch
  without a checkpoint counts 0) + the rollback point (snapshot, ``base.npy``, marker) +
  the wait for the input-log write; mean per batch, the worse of the two key counts;
  ``prepare_ms_per_batch_*`` is the prepare pause alone. Spark's counterpart is
  ``spark_commit_ms_per_partition_*`` (``commitTimeMs`` per partition);
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
VARIANTS = ("sql", "aipws", "tws", "ceiling", "sguard")
PYTHON_APIS = ("aipws", "tws")
KEYS = (10_000, 100_000)
PARTITIONS = 2
DEFAULT_OUT = Path(__file__).resolve().parent / "out"
LABEL = {"sql": "JVM SQL groupBy (HDFS store)", "aipws": "applyInPandasWithState",
         "tws": "transformWithState (RocksDB)", "ceiling": "dense numpy ceiling",
         "sguard": "sguard"}
SHORT = {"sql": "JVM SQL groupBy\n(HDFS store)", "aipws": "applyInPandas\nWithState",
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
    a = p.parse_args(argv)
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
    fast_batches = a.batches or (5 if a.quick else 12)
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
    return {"reps": reps, "batches": batches, "skipped": skipped, "partitions": PARTITIONS,
            "rows_per_batch": _rows_per_batch()}


def _rows_per_batch() -> int:
    from bench._spark_variants import ROWS_PER_BATCH
    return ROWS_PER_BATCH


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, file=sys.stderr, flush=True)


# -- one run ------------------------------------------------------------------------------------
def one_run(spark: Any, work: Path, variant: str, n_keys: int, n_batches: int, tag: str
            ) -> dict[str, Any]:
    from bench import _spark_variants as V

    run_dir = work / "runs" / tag
    run_dir.mkdir(parents=True)
    src = V.source(spark, V.input_dir(work / "input", n_keys, n_batches))
    extra: dict[str, Any] = {}
    if variant == "sguard":
        from bench import _spark_sguard as S

        sdf, mode, ctx = S.build(spark, src, n_keys, PARTITIONS, run_dir)
    else:
        sdf, mode = V.build(spark, variant, src, n_keys, PARTITIONS, run_dir / "state")
        ctx = None
    r = V.run_query(spark, sdf, mode, run_dir / "checkpoint", f"{variant}_{tag}")
    rows = V.batch_rows(r["progress"], PARTITIONS)
    if variant == "ceiling":
        _merge_task_metrics(rows, run_dir / "state" / "metrics.jsonl")
    elif variant == "sguard":
        from bench import _spark_sguard as S

        extra = S.collect(ctx, rows)
    shutil.rmtree(run_dir, ignore_errors=True)
    if len(rows) != n_batches:
        raise RuntimeError(f"{variant}: expected {n_batches} micro-batches with input, "
                           f"Spark ran {len(rows)}")
    return {"variant": variant, "keys": n_keys, "batches": rows, "wall_s": r["wall_s"], **extra}


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
              "task_total_ms"):
        v = mean_of(f)
        if v is not None:
            breakdown[f] = v
    ck = [c for r in runs for c in r.get("checkpoints", [])]
    return {"runs": len(runs), "measured_batches": len(bs),
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
                  recovery: dict[str, Any] | None) -> dict[str, Any]:
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
    if recovery is not None:
        s["recovery_s_100k"] = recovery.get("recovery_s")
        s["recovery_replay_batches"] = recovery.get("replay_batches")
        s["recovery_replay_rows"] = recovery.get("replay_rows")
    targets: dict[str, tuple[str, float]] = {
               "ratio_vs_best_python_10k": (">=", 5), "ratio_vs_best_python_100k": (">=", 5),
               "ratio_vs_sql_10k": (">=", 1), "ratio_vs_sql_100k": (">=", 1),
               "ratio_vs_ceiling_10k": (">=", 0.9), "ratio_vs_ceiling_100k": (">=", 0.9),
               "state_ms_per_partition_100k": ("<=", 10),
               "checkpoint_ms_on_critical_path": ("<=", 5), "rollback_ms_1m_keys": ("<=", 1),
               "rollback_file_ms_1m_keys": ("<=", 1)}
    missed: dict[str, str] = {}
    for f, (op, t) in targets.items():
        val = s.get(f)
        if not isinstance(val, (int, float)):
            missed[f] = "not measured"
        elif (op == ">=" and val < t) or (op == "<=" and val > t):
            missed[f] = f"{val:.3g} vs target {op} {t}"
    s["targets_missed"] = missed
    return s


# -- plot ---------------------------------------------------------------------------------------
def plot(per: dict[int, dict[str, dict[str, Any]]], path: Path) -> None:
    """Throughput per variant (log scale) and, per key count, the per-batch breakdown of
    the variants that share the pipeline's cost scale (linear; the Python APIs' batch
    times are in the labels)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(per)
    fig, axes = plt.subplots(1, 1 + len(keys), figsize=(6 + 4.5 * len(keys), 5),
                             gridspec_kw={"width_ratios": [1.5] + [1] * len(keys)})
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
             ("checkpoint", "checkpoint / state commit on critical path (per partition)")]
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def _run(a: argparse.Namespace, pl: dict[str, Any], work: Path, t_start: float) -> int:
    from bench import _spark_micro as M
    from bench import _spark_variants as V

    log("rollback on mmm: 1M keys, 50k-row batch ...")
    micro: dict[str, Any] = {"rollback": M.rollback_1m_keys(repeats=5 if a.quick else 15)}
    rb = micro["rollback"]
    log(f"  in memory: rollback {rb['rollback_ms']['median']:.3f} ms + index rebuild "
        f"{rb['first_access_after_ms']['median']:.3f} ms")
    if "sguard" in a.variants:
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
    n_files = max(n for v in a.variants for n in pl["batches"][v].values())
    for k in a.keys:
        V.write_files(work / "input", k, n_files)
    spark = V.spark_session(work / "spark-local", PARTITIONS)
    log("warm-up (JVM, Python workers; discarded) ...")
    for v in ("sql", "ceiling"):
        try:
            one_run(spark, work, v, a.keys[0], 2, f"warmup-{v}")
        except Exception as e:  # noqa: BLE001 - the measured runs report failures
            log(f"  warm-up {v} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {k: {v: [] for v in a.variants}
                                                         for k in a.keys}
    errors: dict[str, str] = {}
    recovery = None
    try:
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
                        errors[f"{v}_{k}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                        log(f"[{k // 1000}k keys] rep {rep + 1} {v}: FAILED {errors[f'{v}_{k}']}")
                        if os.environ.get("SGUARD_BENCH_DEBUG"):
                            traceback.print_exc()
                        continue
                    runs[k][v].append(r)
                    log(f"[{k // 1000}k keys] rep {rep + 1}/{pl['reps'][v][k]} {v:8s} "
                        f"{len(r['batches'])} batches, {run_rate(r) / 1e3:8.1f}k rows/s, "
                        f"p50 {np.median([b['duration_ms'] for b in measured(r)]):.0f} ms")
        if "sguard" in a.variants and 100_000 in a.keys:
            from bench import _spark_sguard as S

            log("sguard recovery after losing the local state (100k keys) ...")
            try:
                recovery = S.recovery(spark, work, 100_000, PARTITIONS)
                log(f"  recovery {recovery.get('recovery_s')} s, replay "
                    f"{recovery.get('replay_batches')} batch(es)")
            except Exception as e:  # noqa: BLE001
                errors["sguard_recovery"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                log(f"  recovery FAILED {errors['sguard_recovery']}")
                if os.environ.get("SGUARD_BENCH_DEBUG"):
                    traceback.print_exc()
    finally:
        spark.stop()
    per = {k: {v: summarize_variant(rs) for v, rs in runs[k].items() if rs} for k in a.keys}
    summary = build_summary(per, micro, recovery)
    for k in a.keys:  # sguard over each baseline within the same repetition (adjacent runs)
        for base in ("sql", "ceiling"):
            pairs = [run_rate(x) / run_rate(y) for x, y in zip(runs[k].get("sguard", []),
                                                                runs[k].get(base, []))]
            if pairs:
                summary[f"ratio_vs_{base}_{k // 1000}k_per_rep"] = pairs
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
                    "recovery": recovery,
                    "runs": {str(k): {v: runs[k][v] for v in runs[k]} for k in runs}},
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "platform": platform.platform(), "loadavg_end": os.getloadavg()},
           "elapsed_s": time.perf_counter() - t_start,
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = a.out / f"{NAME}.json"
    path.write_text(json.dumps(doc, indent=2, default=_jsonable))
    plot(per, a.out / f"{NAME}.png")
    print(json.dumps(summary, indent=2, default=_jsonable))
    print(f"wrote {path} and {a.out / (NAME + '.png')} in {doc['elapsed_s']:.0f} s")
    return 0


def _jsonable(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
