"""The downtime of a Spark streaming query restarted with another partition count.

Used by `bench.rescale` (``restart_downtime_s``). A real query
(``local[2]``, a parquet file source with one file per micro-batch, the
running aggregate, a ``noop`` sink) first builds a state of about
``state_mb`` MB (``~70`` bytes per key) in 2 partitions (their local state where
the runtime keeps it by default: under /dev/shm when writable), then is stopped and
restarted, one new small file waiting each time, in this order per cycle:

* 2 -> 2: the baseline, the same restart without a partition change (the
  partitions re-attach their local state);
* 2 -> 4: scale out; `sguard.spark.stateful` commits the new layout before the
  query starts (`sguard.spark.rescaling`: the driver reads the sources' manifest
  headers and writes the layout with a record of the sources; no Spark job),
  then each new partition's first task composes its first checkpoint from
  references to its key groups' pages (after reading them once to verify),
  restores those pages and replays the logged rows its key groups missed;
* 4 -> 4 and 4 -> 2: the same at 4 partitions, and scale in (one cycle: 4 -> 4
  only, the baseline at the new count: ``restart_downtime_ratio_vs_unchanged_at_4``).

Downtime = from ``query.stop()`` to the first batch committed after the restart
(``processAllAvailable`` returns). Reported per restart with its parts: the
stop, the ``stateful`` call (which includes the start-up repartition; its
own seconds in ``repartition_s``, its parts in ``repartition_parts_s``: the wait for
the old partitions' local locks, the repartition, and its plan / compose (none left to
the driver: 0) / commit), and start to commit (query start, the tasks' compose +
restore + replay + the batch). Between two
restarts three more small batches run, so every generation has checkpoints.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import numpy as np

MB = 1 << 20
BYTES_PER_KEY = 70  # RunningAggregate's hash map, measured (64 KiB pages)
TICK_ROWS = 20_000
BUILD_ROWS = 2_000_000


def _write(path: Path, keys: np.ndarray, seq: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(seq)
    t = pa.table({"k": keys.astype(np.int64), "v": rng.integers(-500, 500, len(keys))})
    tmp = path.parent.parent / f".{path.name}"
    pq.write_table(t, tmp)
    os.utime(tmp, (1_700_000_000 + seq, 1_700_000_000 + seq))  # the source orders by mtime
    os.replace(tmp, path)  # appears whole (the rename keeps the mtime)


def _state_bytes(uri: str) -> int:
    from ioservice import list_checkpoints, open_root, read_manifest
    from sguard.statelayout import read_layout
    root = open_root(uri, create=False)
    lay = read_layout(root)
    assert lay is not None
    total = 0
    for p in range(lay.num_partitions):
        infos = [c for c in list_checkpoints(root, lay.haunit(p)) if c.has_manifest]
        if infos:
            total += read_manifest(root, infos[-1].name).state_bytes
    return total


class _Query:
    """The restarted query's world: its live input directory, Spark session and state URIs.

    `feed` writes one input file (the source takes one per micro-batch), `start`
    starts the query at ``P`` partitions; the session is ``local[2]``.
    """

    def __init__(self, state_mb: float, scratch: str, key_groups: int | None) -> None:
        import sguard.spark as ss
        work = Path(scratch) / "spark-restart"
        self.live = work / "input"
        self.live.mkdir(parents=True)
        (work / "stage").mkdir()
        self.uri, self.ckpt = str(work / "state"), str(work / "ckpt")
        self.n_keys = max(10_000, int(state_mb * MB / BYTES_PER_KEY))
        self.key_groups = key_groups
        self.seq = 0
        self.rng = np.random.default_rng(42)
        self.spark = ss.local_session("local[2]", "sguard-bench-restart", shuffle_partitions=2)
        self.capacity = max(1 << 30, int(4 * self.n_keys * BYTES_PER_KEY))
        self.op = ss.RunningAggregate(value="v")
        self.cfg = ss.CheckpointConfig(every_n_batches=2)
        # the partitions' local state where the runtime keeps it by default (/dev/shm when
        # writable: `default_local_dir`), in a directory of its own that `run` deletes
        from sguard.spark.placement import default_local_dir
        self.local = tempfile.mkdtemp(prefix="sguard-bench-restart-",
                                      dir=os.path.dirname(default_local_dir()))

    def feed(self, keys: np.ndarray) -> None:
        """One input file of ``keys`` (the next in the source's order)."""
        _write(self.live / f"part-{self.seq:06d}.parquet", keys, self.seq)
        self.seq += 1

    def tick(self) -> None:
        """One small batch of random keys."""
        self.feed(self.rng.integers(0, self.n_keys, TICK_ROWS))

    def start(self, P: int) -> tuple[Any, float]:
        """Start the query at ``P`` partitions: (the query, seconds in `stateful`)."""
        import sguard.spark as ss
        t = time.perf_counter()
        df = (self.spark.readStream.schema("k long, v long").option("maxFilesPerTrigger", 1)
              .parquet(str(self.live)))
        out = ss.stateful(df, "k", self.op, self.uri, P, local_dir=self.local,
                          checkpoint=self.cfg, capacity_bytes=self.capacity, metrics=True,
                          key_groups=self.key_groups)
        api_s = time.perf_counter() - t
        return (out.writeStream.format("noop").option("checkpointLocation", self.ckpt).start(),
                api_s)

    def build(self) -> Any:
        """Every key once, then a few small batches, at 2 partitions: the running query."""
        perm = np.random.default_rng(7).permutation(self.n_keys)
        for i in range(0, self.n_keys, BUILD_ROWS):
            self.feed(perm[i:i + BUILD_ROWS])
        for _ in range(3):
            self.tick()
        q, _ = self.start(2)
        q.processAllAvailable()
        return q

    def first_batch_metrics(self, batch: int, partitions: int) -> list[dict[str, Any]]:
        """The metrics records of ``batch`` (waits up to 5 s for all ``partitions``:
        metrics are written asynchronously)."""
        from ioservice import open_root
        from sguard.spark.metrics import read_metrics
        recs: list[dict[str, Any]] = []
        for _ in range(50):
            recs = [r for r in read_metrics(open_root(self.uri, create=False))[0]
                    if r["batch"] == batch]
            if len(recs) >= partitions:
                break
            time.sleep(0.1)
        return recs


@contextlib.contextmanager
def _startup_repartitions() -> Iterator[list[Any]]:
    """Collect what each start-up repartition (`sguard.spark.api.repartition_at_startup`)
    reports while inside; the original function back on leaving."""
    import sguard.spark.api as api
    startup = api.repartition_at_startup
    rescales: list[Any] = []

    def recorded(*a: Any, **kw: Any) -> Any:
        res = startup(*a, **kw)
        rescales.append(res)
        return res

    api.repartition_at_startup = recorded
    try:
        yield rescales
    finally:
        api.repartition_at_startup = startup


def _tree_cpu_s() -> float:
    """CPU seconds (user + system, reaped children included) of this process and all its
    descendants (the JVM, PySpark's daemon and Python workers): from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields after the name: state ppid ...; utime stime cutime cstime are 14-17 (1-based)
        stats[int(d)] = (int(rest[1]), sum(int(x) for x in rest[11:15]) / tick)
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        kids.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo.extend(kids.get(pid, []))
    return total


def measure_restart(qry: _Query, q: Any, P: int, P2: int, rescales: list[Any]
                    ) -> tuple[Any, dict[str, Any]]:
    """Stop the running query ``q`` (at ``P``) and restart it at ``P2``: (new query, row).

    Downtime: ``stop()`` to the first batch committed after the restart, minus the
    untimed write of that batch's input file; with its parts (stop, the `stateful`
    call and its start-up repartition, start to commit) and the first batch's tasks.
    """
    c0 = _tree_cpu_s()
    t0 = time.perf_counter()
    q.stop()
    t1 = time.perf_counter()
    qry.tick()  # the batch the restarted query runs first
    t2 = time.perf_counter()
    rescales.clear()
    q, api_s = qry.start(P2)
    q.processAllAvailable()
    t3 = time.perf_counter()
    cpu_s = _tree_cpu_s() - c0  # the input file's write included (small, the same each time)
    b = int(q.lastProgress["batchId"])
    recs = qry.first_batch_metrics(b, P2)
    row = {"from": P, "to": P2, "downtime_s": (t3 - t0) - (t2 - t1),
           "cpu_s": cpu_s, "load1": os.getloadavg()[0], "stop_s": t1 - t0,
           "stateful_s": api_s, "start_to_commit_s": t3 - t2 - api_s,
           "repartition_s": sum(r.seconds for r in rescales),
           "repartition_parts_s": [{"wait_s": r.wait_s, "job_s": r.repartition_s,
                                    **r.phases_s} for r in rescales],
           "first_batch": b,
           "recovery": sorted({r["recovery"] for r in recs}),
           "recovery_ms_max": max((r["recovery_ms"] for r in recs), default=0.0),
           "compose_ms_max": max((r.get("compose_ms", 0.0) for r in recs), default=0.0),
           "replayed_batches_max": max((r["replayed_batches"] for r in recs), default=0),
           "task_ms_max": max((r["total_ms"] for r in recs), default=0.0)}
    return q, row


def _log_restart(log: Callable[[str], None], row: dict[str, Any]) -> None:
    log(f"spark restart {row['from']} -> {row['to']}: downtime {row['downtime_s']:.2f} s (stop "
        f"{row['stop_s']:.2f}, stateful {row['stateful_s']:.2f} of which repartition "
        f"{row['repartition_s']:.2f}, start to commit "
        f"{row['start_to_commit_s']:.2f}; first batch {row['recovery']}, recovery "
        f"{row['recovery_ms_max']:.0f} ms (compose {row['compose_ms_max']:.0f}), "
        f"{row['replayed_batches_max']} batch(es) "
        f"replayed; CPU {row['cpu_s']:.2f} s, load {row['load1']:.1f})")


def run(state_mb: float, scratch: str, cycles: int = 1,
        log: Callable[[str], None] = print, key_groups: int | None = None) -> dict[str, Any]:
    """Build the state, then restart the query ``2 -> 2, 2 -> 4, 4 -> 4`` (one cycle) or
    ``2 -> 2, 2 -> 4, 4 -> 4, 4 -> 2`` (two cycles), repeated for more; returns the
    measurements.
    `key_groups`: the state's K (default: `stateful`'s)."""
    qry = _Query(state_mb, scratch, key_groups)
    data: dict[str, Any] = {"keys": qry.n_keys, "key_groups": key_groups, "restarts": []}
    with _startup_repartitions() as rescales:
        try:
            t = time.perf_counter()
            q = qry.build()
            data["build_s"] = time.perf_counter() - t
            data["spark_trivial_job_s"] = _trivial_jobs(qry.spark, 4)
            log(f"a trivial 4-task Spark job (a start-up repartition job's least cost): "
                f"{data['spark_trivial_job_s']:.2f} s (median of 3)")
            P = 2
            plan = [2, 4] + ([4, 2] if cycles > 1 else [4]) + [2, 4, 4, 2] * max(0, cycles - 2)
            for P2 in plan:
                for _ in range(3):  # a few batches: the generation gets its checkpoints
                    qry.tick()
                q.processAllAvailable()
                data.setdefault("state_bytes", _state_bytes(qry.uri))
                q, row = measure_restart(qry, q, P, P2, rescales)
                data["restarts"].append(row)
                _log_restart(log, row)
                P = P2
            q.stop()
        finally:
            qry.spark.stop()
            shutil.rmtree(qry.local, ignore_errors=True)
    return data


def _trivial_jobs(spark: Any, n: int, repeats: int = 3) -> float:
    """Median seconds of a Spark job of `n` SQL Python tasks that do nothing (``mapInArrow``
    over ``range(n)``, as the repartition job's), on the query's warm session."""
    def same(batches: Any) -> Any:
        yield from batches
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        spark.range(0, n, 1, n).mapInArrow(same, "id long").collect()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """The summary fields `bench.rescale` reports (medians over the restarts of a kind)."""
    def med(f: int, t: int, key: str) -> float | None:
        xs = [r[key] for r in data["restarts"] if (r["from"], r["to"]) == (f, t)]
        return float(np.median(xs)) if xs else None

    out = {
        "restart_downtime_s": med(2, 4, "downtime_s"),
        "restart_stateful_call_s": med(2, 4, "stateful_s"),
        "restart_repartition_s": med(2, 4, "repartition_s"),
        "restart_start_to_commit_s": med(2, 4, "start_to_commit_s"),
        "restart_start_to_commit_same_p_s": med(2, 2, "start_to_commit_s"),
        "restart_downtime_same_p_s": med(2, 2, "downtime_s"),
        "restart_cpu_s": med(2, 4, "cpu_s"),
        "restart_cpu_same_p_s": med(2, 2, "cpu_s"),
        "restart_cpu_4to4_s": med(4, 4, "cpu_s"),
        "restart_downtime_4to2_s": med(4, 2, "downtime_s"),
        "restart_state_mb": data.get("state_bytes", 0) / MB,
        "restart_first_batch_task_ms": med(2, 4, "task_ms_max"),
        "restart_first_batch_task_ms_same_p": med(2, 2, "task_ms_max"),
        "restart_recovery_ms": med(2, 4, "recovery_ms_max"),
        "restart_compose_ms": med(2, 4, "compose_ms_max"),
        "restart_start_to_commit_4to4_s": med(4, 4, "start_to_commit_s"),
        "spark_trivial_job_s": data.get("spark_trivial_job_s"),
    }
    out["restart_downtime_4to4_s"] = med(4, 4, "downtime_s")
    if out["restart_downtime_s"] and out["restart_downtime_4to4_s"]:
        # the same restart unchanged at the *new* count: separates what the rescale costs
        # from what running 4 partitions in 2 waves on 2 cores costs every batch
        out["restart_downtime_ratio_vs_unchanged_at_4"] = (out["restart_downtime_s"]
                                                           / out["restart_downtime_4to4_s"])
    if out["restart_cpu_s"] and out["restart_cpu_same_p_s"]:
        # the CPU the restarts cost (process tree): less sensitive to the machine's load
        out["restart_cpu_ratio_vs_unchanged"] = out["restart_cpu_s"] / out["restart_cpu_same_p_s"]
    if out["restart_downtime_s"] and out["restart_downtime_same_p_s"]:
        out["restart_downtime_ratio_vs_unchanged"] = (out["restart_downtime_s"]
                                                      / out["restart_downtime_same_p_s"])
        # each 2 -> 4 over the 2 -> 2 just before it: the spread behind the medians
        rs = data["restarts"]
        out["restart_downtime_ratio_vs_unchanged_each"] = [
            b["downtime_s"] / a["downtime_s"] for a, b in zip(rs, rs[1:])
            if (a["from"], a["to"], b["from"], b["to"]) == (2, 2, 2, 4)]
    return out


if __name__ == "__main__":  # a quick look: python -m bench._spark_restart [MB]
    import json
    import sys
    import tempfile
    d = tempfile.mkdtemp(prefix="bench-spark-restart-")
    try:
        res = run(float(sys.argv[1]) if len(sys.argv) > 1 else 16, d,
                  int(sys.argv[2]) if len(sys.argv) > 2 else 1,
                  key_groups=int(sys.argv[3]) if len(sys.argv) > 3 else None)
        print(json.dumps(summarize(res), indent=1))
    finally:
        shutil.rmtree(d, ignore_errors=True)
