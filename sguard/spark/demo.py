"""``sguard spark demo``: the main job on the embedded default (local Spark, local files).

1. Generates a stream of parquet files (one micro-batch each: a string key ``user``,
   a value, an event time).
2. Starts a Spark driver (a child process) running two stateful streaming
   queries with parquet file sinks: a running count/sum/min/max per key and a
   tumbling event-time window aggregate, with their state in mmm pages.
3. Injects failures while it runs: a Python worker SIGKILLed mid-batch (Spark
   retries the task under ``local[2,4]``), an exception in one partition after
   the other partition applied the batch, an executor's local state deleted
   (restored from the DFS checkpoint plus the input log), and finally the
   driver itself SIGKILLed mid-batch.
4. Restarts the driver from the queries' ``checkpointLocation`` and lets it
   finish, then runs the same queries failure-free on fresh state.
5. Checks that the sinks' rows and the final states are equal row for row, prints
   what happened (batches, rows/s, checkpoint lag, recovery times) and ends
   with a verdict: exit 0 when equal, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["add_arguments", "run_demo", "driver_main"]

WINDOW_S = 10  # event-time window length, seconds
QUERIES = ("running", "windowed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", help="directory for input, state and output (default: a new "
                   "temporary directory, deleted afterwards unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--batches", type=int, default=10, help="micro-batches (default 10, >= 8)")
    p.add_argument("--rows", type=int, default=20_000, help="rows per batch (default 20000)")
    p.add_argument("--keys", type=int, default=5_000, help="distinct keys (default 5000)")
    p.add_argument("--partitions", type=int, default=2, help="state partitions (default 2)")
    p.add_argument("--seed", type=int, default=7, help="input seed (default 7)")


def validate(args: argparse.Namespace) -> str | None:
    """A usage error message, or None."""
    if args.batches < 8 or args.batches > 10_000:
        return f"--batches must be between 8 and 10000, got {args.batches}"
    if args.rows < 10 or args.rows > 10_000_000:
        return f"--rows must be between 10 and 10000000, got {args.rows}"
    if args.keys < 1 or args.keys > 100_000_000:
        return f"--keys must be between 1 and 100000000, got {args.keys}"
    if args.partitions < 2 or args.partitions > 64:
        return f"--partitions must be between 2 and 64, got {args.partitions}"
    if args.workdir is not None and os.path.exists(args.workdir) and os.listdir(args.workdir):
        return f"--workdir {args.workdir} exists and is not empty"
    return None


def generate(inp: Path, batches: int, rows: int, keys: int, seed: int) -> None:
    """Deterministic input: batch i holds event times in [i*WINDOW_S, (i+1)*WINDOW_S) s."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    inp.mkdir(parents=True)
    for i in range(batches):
        rng = np.random.default_rng([seed, i])
        ts = (i * WINDOW_S * 1_000_000 + rng.integers(0, WINDOW_S * 1_000_000, rows)
              ).astype("datetime64[us]")
        user = np.char.add("user-", rng.integers(0, keys, rows).astype(str))  # a string key
        t = pa.table({"user": pa.array(user, pa.string()),
                      "v": rng.integers(-1000, 1000, rows, dtype=np.int64),
                      "ts": pa.array(ts, pa.timestamp("us", tz="UTC"))})
        f = inp / f"part-{i:05d}.parquet"
        pq.write_table(t, f)
        os.utime(f, (1_700_000_000 + i, 1_700_000_000 + i))  # the file source orders by mtime


# ------------------------------------------------------------------------------ the driver
def _queries(spark: Any, work: Path, tag: str, partitions: int, faults: Any,
             rows: int) -> list[Any]:
    import sguard.spark as ss
    df = (spark.readStream.schema("user string, v long, ts timestamp")
          .option("maxFilesPerTrigger", 1).parquet(str(work / "input")))
    ops = {"running": ss.RunningAggregate(value="v"),
           "windowed": ss.WindowAggregate(time="ts", window=WINDOW_S, value="v")}
    out = []
    for qn in QUERIES:
        res = ss.stateful(df, "user", ops[qn], str(work / tag / qn / "state"), partitions,
                          checkpoint=ss.CheckpointConfig(every_n_batches=3),
                          local_dir=str(work / tag / qn / "local"),
                          faults=faults if qn == "running" else None)
        q = (res.writeStream.format("parquet").queryName(f"{tag}_{qn}")
             .option("path", str(work / tag / qn / "out"))
             .option("checkpointLocation", str(work / tag / qn / "spark-checkpoint"))
             .start())
        out.append(q)
    return out


def _wait(queries: list[Any], batches: int, label: str) -> float:
    """Wait until every query committed all batches, printing progress; returns seconds."""
    t0 = time.monotonic()
    last = -2
    while True:
        done = []
        for q in queries:
            if q.exception() is not None:
                raise RuntimeError(f"query {q.name} failed: {q.exception()}")
            p = q.lastProgress
            done.append(-1 if p is None else int(p["batchId"]))
        low = min(done)
        if low != last:
            print(f"[driver] {label}: batch {low + 1}/{batches} committed "
                  f"({time.monotonic() - t0:.1f} s)", flush=True)
            last = low
        if all(q.status.get("isDataAvailable") is False and not q.status.get("isTriggerActive")
               for q in queries) and low >= batches - 1:
            return time.monotonic() - t0
        time.sleep(0.5)


def driver_main(argv: list[str]) -> int:
    """The Spark driver of the demo (a child process): ``phase1`` or ``phase2``."""
    import sguard.spark as ss
    phase, work, batches, rows, partitions = (argv[0], Path(argv[1]), int(argv[2]),
                                              int(argv[3]), int(argv[4]))
    t0 = time.monotonic()
    spark = ss.local_session("local[2,4]", f"sguard-demo-{phase}",
                             shuffle_partitions=partitions)
    print(f"[driver] Spark started in {time.monotonic() - t0:.1f} s", flush=True)
    if phase == "phase1":
        faults = ss.FaultPlan((
            ss.Fault("kill", 2, 0, "mid"),           # a Python worker dies mid-batch
            ss.Fault("raise", 3, 1, "mid"),          # one partition fails after the other applied
            ss.Fault("delete_local", 5, 0, "start"),  # the executor's local state is lost
            ss.Fault("pause", 6, 1, "mid"),          # the parent SIGKILLs the driver here
        ), str(work / "faults"))
        qs = _queries(spark, work, "run", partitions, faults, rows)
        _wait(qs, batches, "phase 1")  # killed before it returns
        return 0
    # phase 2: restart from the checkpointLocation, finish; then the failure-free reference
    t1 = time.monotonic()
    qs = _queries(spark, work, "run", partitions, None, rows)
    resumed = _wait(qs, batches, "restarted")
    for q in qs:
        q.stop()
    first = _first_batch_after_restart(work)
    qs = _queries(spark, work, "reference", partitions, None, rows)
    ref_s = _wait(qs, batches, "failure-free reference")
    for q in qs:
        q.stop()
    result: dict[str, Any] = {"restart_to_end_s": resumed, "reference_s": ref_s,
                              "driver_restart_s": time.monotonic() - t1 - ref_s - resumed,
                              "first_batch_after_restart": first, "queries": {}}
    for qn in QUERIES:
        result["queries"][qn] = _compare(spark, work, qn)
    (work / "result.json").write_text(json.dumps(result, indent=1))
    spark.stop()
    return 0


def _first_batch_after_restart(work: Path) -> int | None:
    meta = work / "run" / "running" / "spark-checkpoint" / "commits"
    return len(list(meta.iterdir())) if meta.exists() else None


def _compare(spark: Any, work: Path, qn: str) -> dict[str, Any]:
    from sguard.spark.state import read_local_state

    def rows(tag: str) -> list[Any]:
        df = spark.read.parquet(str(work / tag / qn / "out"))
        return sorted(tuple(r) for r in df.collect())

    got, want = rows("run"), rows("reference")
    st_got, b_got = read_local_state(str(work / "run" / qn / "state"),
                                     local_dir=str(work / "run" / qn / "local"))
    st_want, b_want = read_local_state(str(work / "reference" / qn / "state"),
                                       local_dir=str(work / "reference" / qn / "local"))
    return {"output_rows": len(got), "reference_rows": len(want), "output_equal": got == want,
            "state_rows": st_got.num_rows, "state_equal": st_got.equals(st_want),
            "state_batches": b_got, "reference_batches": b_want}


# ------------------------------------------------------------------------------ the parent
def _spawn(args: list[str], log: Any) -> subprocess.Popen[str]:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "sguard.spark.demo", *args],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                            start_new_session=True)


def _relay(proc: subprocess.Popen[str], until: Path | None, timeout_s: float) -> str:
    """Print the child's progress lines until it exits or `until` appears; returns why."""
    import queue
    import threading
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def pump(f: Any) -> None:
        for ln in f:
            lines.put(ln.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, args=(proc.stdout,), daemon=True).start()
    t0 = time.monotonic()
    eof = False
    while True:
        try:
            ln = lines.get(timeout=0.2)
            if ln is None:
                eof = True
            else:
                print(f"  {ln}", flush=True)
                continue
        except queue.Empty:
            pass
        if until is not None and until.exists():
            return "paused"
        if eof and proc.poll() is not None:
            return "exited"
        if eof:
            proc.wait()
            return "exited"
        if time.monotonic() - t0 > timeout_s:
            return "timeout"


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo (see module docstring); returns the exit code (0: PASS)."""
    own = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="sguard-spark-demo-") if own else args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    (work / "faults").mkdir()
    log = open(work / "spark.log", "w")
    t_start = time.monotonic()
    verdict = 1
    try:
        print(f"sguard spark demo: {args.batches} batches x {args.rows} rows, {args.keys} keys, "
              f"{args.partitions} partitions; work dir {work}", flush=True)
        generate(work / "input", args.batches, args.rows, args.keys, args.seed)
        common = [str(work), str(args.batches), str(args.rows), str(args.partitions)]
        print("phase 1: driver with injected failures (worker kill at batch 2, exception at "
              "batch 3, local state lost at batch 5, driver SIGKILL at batch 6)", flush=True)
        d1 = _spawn(["phase1", *common], log)
        why = _relay(d1, work / "faults" / "paused-b6-p1", 900)
        if why != "paused":
            print(f"FAIL: phase-1 driver {why} before reaching batch 6 (see {work}/spark.log)")
            d1.kill()
            return 1
        t_kill = time.monotonic()
        os.killpg(d1.pid, signal.SIGKILL)
        d1.wait()
        print("  ** driver SIGKILLed mid-batch 6 (JVM, Python workers and all) **", flush=True)
        print("phase 2: restart from the checkpointLocation, finish, then a failure-free "
              "reference run", flush=True)
        d2 = _spawn(["phase2", *common], log)
        why = _relay(d2, None, 1800)
        if why != "exited" or d2.returncode != 0:
            print(f"FAIL: phase-2 driver {why} (exit {d2.returncode}); see {work}/spark.log")
            if d2.poll() is None:
                os.killpg(d2.pid, signal.SIGKILL)
            return 1
        res = json.loads((work / "result.json").read_text())
        verdict = _report(work, res, args, time.monotonic() - t_start, time.monotonic() - t_kill)
        return verdict
    finally:
        log.close()
        if own and not args.keep and verdict == 0:
            shutil.rmtree(work, ignore_errors=True)
        elif own:
            print(f"(work directory kept: {work})")


def _report(work: Path, res: dict[str, Any], args: argparse.Namespace, total_s: float,
            since_kill_s: float) -> int:
    from ioservice import open_root
    from sguard.spark.metrics import read_metrics, summarize
    ok = True
    rows_total = args.batches * args.rows
    print("\nresults")
    print(f"  input: {args.batches} batches, {rows_total} rows")
    fired = sorted(p.read_text().strip() for p in (work / "faults").glob("fired-*"))
    print(f"  failures injected: {len(fired) + 1}")
    for f in fired:
        print(f"    - {f}")
    print("    - driver SIGKILL (process group) during batch 6")
    print(f"  reference run (failure-free): {res['reference_s']:.1f} s, "
          f"{2 * rows_total / max(res['reference_s'], 1e-9):,.0f} rows/s over both queries")
    print(f"  driver restart to all batches committed: {since_kill_s - res['reference_s']:.1f} s")
    for qn, r in res["queries"].items():
        s = summarize(*read_metrics(open_root(str(work / "run" / qn / "state"))))
        good = r["output_equal"] and r["state_equal"] and r["output_rows"] > 0
        ok &= good
        print(f"  [{qn}] sink rows {r['output_rows']} (reference {r['reference_rows']}): "
              f"{'equal' if r['output_equal'] else 'DIFFERENT'}; final state "
              f"{r['state_rows']} rows: {'equal' if r['state_equal'] else 'DIFFERENT'}")
        print(f"    batches {s['batches']}, checkpoints {s['checkpoints']} "
              f"({s['checkpoint_bytes'] / 1e6:.1f} MB), checkpoint lag max "
              f"{s['checkpoint_lag_max']} batches, prepare pause mean "
              f"{s['prepare_ms_mean']:.2f} ms, partition re-attaches {s['reattached']}")
        for ev in s["recoveries"]:
            print(f"    recovery: batch {ev['batch']} partition {ev['partition']}: "
                  f"{ev['recovery']} in {ev['recovery_ms']:.1f} ms "
                  f"(replayed {ev['replayed_batches']} batches) - {ev['reason']}")
    print(f"  total demo time {total_s:.0f} s")
    print(f"\nVERDICT: {'PASS' if ok else 'FAIL'} - output and state after failures "
          f"{'equal' if ok else 'differ from'} the failure-free run")
    return 0 if ok else 1


if __name__ == "__main__":  # the driver child
    sys.exit(driver_main(sys.argv[1:]))
