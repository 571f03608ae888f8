"""Repartitioning and parallel recovery of key-grouped state (issues 12 and 20).

Builds a `sguard.spark.RunningAggregate` state (value ``v``, int64 keys) of
about ``--state-mb`` MB in 2 partitions with K = ``--key-groups`` key groups
under a ``file://`` state URI, exactly as the Spark runtime lays it out: each
key group's ``HashMap`` in its namespace (`sguard.spark.groupstate.namespace`,
PSIDs in the key group's block), filled with one bulk
`mmm.HashMap.load_distinct` per key group (every key seen once), each
partition's page manager checkpointed with `ioservice.CheckpointManager` under
its HA unit with the ``user_meta`` the runtime writes (``key_groups``,
``psid_shift``, ``batch_id``...) and the layout document written with
`sguard.statelayout.write_layout`. Then, in the same run:

* **copy** (the baseline): the state's checkpoint files copied by one thread
  per partition, the least a repartition that moved the bytes would do: read
  into a user-space buffer, written, fsynced (checkpoints are durable); page
  cache warm, as for the repartition that reads the same files right after;
* **repartition 2 -> 4 and 4 -> 2** (`sguard.rescale.repartition`, default
  executor: one thread per target partition), with ``verify=True`` (the
  default: each target reads and checksums its key groups' pages once, then
  composes its checkpoint from references to them; no page byte is written)
  and with ``verify=False`` (manifests only). ``repartition_ratio_vs_copy`` is
  copy seconds / repartition seconds, the copy measured right before each
  repartition, median over repeats and both directions (spread in
  ``..._min_max``); ``repartition_ratio_vs_copy_no_verify`` the same without
  verify; ``verify_read_over_state`` the bytes verify read over the state's
  bytes (1.0: each page read once);
* **parallel recovery** of one partition holding the whole state (the state
  repartitioned to 1): restored *as 1* (`ioservice.restore`) by one process,
  or *as 4 pieces* by 4 processes (`sguard.rescale.restore_piece`: each reads
  only its quarter of the key groups' pages), each then opening the operator
  state on its key groups (`sguard.spark.groupstate.open_state`) and replaying
  ``--replay-rows`` logged rows (as 4: each piece keeps the rows of its key
  groups, by the logged ``_sguard_kg`` column, as the runtime does). Processes
  are started and their imports and kernels warmed before timing; all start at
  a barrier; time = the slowest process. ``recovery_speedup_4_over_1`` is as-1
  seconds / as-4 seconds (median over repeats), ``..._restore_only`` the same
  without replay. The keys recovered are checked (pieces sum to the whole).
  Each worker's CPU time (``time.process_time``) is reported too, since the
  wall clock of a shared machine mostly measures its load:
  ``recovery_cpu_overhead_4_over_1`` (the 4 pieces' CPU over the whole's: the
  work the split adds) and ``recovery_speedup_4_over_1_cpu_bound_2_cores``
  (as-1 CPU / max(as-4 CPU / 2, the slowest piece's CPU): the speedup 2 idle
  cores would give);
* **driver memory** of a repartition run as a Spark job
  (`sguard.spark.rescaling.repartition_job`, a ``local[2]`` session) in a fresh
  driver process: the growth of the driver Python process's resident set
  (sampled every 2 ms from ``/proc/self/statm``) over its size right before
  the call, peak of a few calls, for the bench's state (``driver_peak_mb``)
  and for a small state (``driver_peak_mb_small_state``, ``--small-state-mb``):
  equal within noise when the driver does not hold state. Also
  ``tracemalloc``'s peak of Python allocations during the call. (In local mode
  the tasks run in PySpark worker processes and the JVM is shared by driver
  and executors, so neither is counted.)
* **restart downtime** (`bench._spark_restart`): a real Spark streaming query
  with ``--state-mb`` of state (at most ``--restart-mb-quick`` with
  ``--quick``) stopped and restarted with 4 partitions instead of 2 (the
  start-up repartition commits the layout on the driver and each new
  partition's first task composes its checkpoint: no Spark job), from
  ``stop()`` to the first batch committed after the restart, against the same
  restart without a partition change: ``restart_downtime_s``,
  ``restart_downtime_ratio_vs_unchanged`` (medians of the 2 restarts of each
  kind in ``2 -> 2, 2 -> 4, 4 -> 4, 4 -> 2, 2 -> 2, 2 -> 4, 4 -> 4, 4 -> 2``,
  ``--quick`` included: one restart of each varies by +-0.1 s); with its parts
  (``restart_repartition_s``: the driver's commit;
  ``restart_first_batch_task_ms`` against ``..._same_p``: the first batch's
  slowest task, compose, restore and replay included) and
  ``spark_trivial_job_s``, a job of 4 SQL Python tasks that do nothing on the
  same warm session: what a separate start-up repartition job would cost at
  least.

Run: ``python -m bench.rescale [--quick] [--state-mb N] [--out DIR]``; writes
``DIR/rescale.json`` (``summary``) and ``DIR/rescale.png``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import _harness

MB = 1 << 20
PAGE = 1 << 16
NAME = "agg"
FIELDS = [("count", "<i8"), ("sum", "<i8"), ("min", "<i8"), ("max", "<i8")]
"""`RunningAggregate(value="v")`'s map value on an int64 value column."""
BYTES_PER_KEY = 72  # RunningAggregate's map per key at 64 KiB pages, measured (~84 at 1M keys)
BATCH_ROWS = 100_000  # rows per logged batch replayed


def _op() -> Any:
    from sguard.spark import RunningAggregate
    return RunningAggregate(value="v")


def _schema() -> Any:
    import pyarrow as pa
    return pa.schema([("k", pa.int64()), ("v", pa.int64())])


def _keys(n: int) -> np.ndarray:
    return np.random.default_rng(0).permutation(n).astype(np.int64) * 7919 + 13


def build(uri: str, state_bytes: int, partitions: int, key_groups: int) -> dict[str, Any]:
    """A RunningAggregate state of about `state_bytes` in `partitions` partitions of
    `key_groups` key groups, checkpointed as the runtime does (module docstring).

    Every key is seen once (count 1, sum = min = max = its value), the state an
    upsert of one row per key leaves; built with `mmm.HashMap.load_distinct`
    per key group (the same pages, minutes faster at 1 GB).
    """
    from ioservice import CheckpointManager, open_root
    from mmm import HashMap, PageManager
    from sguard.keygroups import key_group_of
    from sguard.spark.groupstate import namespace
    from sguard.statelayout import PSID_SHIFT, OperatorLayout, schema_to_json, write_layout

    op = _op()
    root = open_root(uri)
    layout = OperatorLayout(operator=op.kind, name=NAME, schema={"params": op.params()},
                            num_partitions=partitions, key="k", key_groups=key_groups,
                            extra={"arrow_schema": schema_to_json(_schema())})
    write_layout(root, layout)
    n = int(state_bytes / BYTES_PER_KEY)
    keys = _keys(n)
    kg = key_group_of(keys, key_groups)
    order = np.argsort(kg, kind="stable")
    skeys = keys[order]
    bounds = np.searchsorted(kg[order], np.arange(key_groups + 1))
    del kg, order, keys
    total = pages = 0
    for p in range(partitions):
        lo, hi = layout.key_group_range(p)
        share = int(bounds[hi] - bounds[lo])
        pm = PageManager(PAGE, capacity_bytes=3 * share * BYTES_PER_KEY + 64 * MB)
        for g in range(lo, hi):
            k = skeys[bounds[g]:bounds[g + 1]]
            v = np.zeros(len(k), FIELDS)
            x = k % 1000
            v["count"], v["sum"], v["min"], v["max"] = 1, x, x, x
            HashMap.create(namespace(pm, g), "aggregate", "<i8", FIELDS).load_distinct(k, v)
        meta = {"operator": layout.operator, "name": layout.name, "generation": 0,
                "partition": p, "num_partitions": partitions, "key_groups": [lo, hi],
                "psid_shift": PSID_SHIFT, "batch_id": 9}
        with CheckpointManager(pm, root, layout.haunit(p)) as mgr:
            pending = mgr.checkpoint(meta)
            assert pending is not None
            man = pending.result()
        total += man.state_bytes
        pages += man.n_pages
        pm.close()
    return {"keys": n, "state_bytes": total, "pages": pages}


# -- baseline: a durable parallel copy ---------------------------------------------------------------
def _state_dirs(uri: str) -> list[Path]:
    """The built state's checkpoint directories (generation 0: every later generation's
    composed checkpoints reference their page files)."""
    return sorted(p for p in Path(uri, "checkpoint").iterdir() if f"{NAME}.g0.p" in p.name)


def copy_files(uri: str, dest: str) -> tuple[float, int]:
    """Copy the state's checkpoint files, one thread per partition: (seconds, bytes).

    Does what a repartition that moved the bytes must at least do: read each file
    into a user-space buffer, write it out and make it durable (fsync the file and
    its directory, as checkpoints are).
    """
    dirs = _state_dirs(uri)
    shutil.rmtree(dest, ignore_errors=True)

    def one(d: Path) -> int:
        out = Path(dest, d.name)
        out.mkdir(parents=True)
        n = 0
        buf = bytearray(4 * MB)
        view = memoryview(buf)
        for f in d.iterdir():
            with open(f, "rb", buffering=0) as src, open(out / f.name, "wb", buffering=0) as dst:
                while (got := src.readinto(buf)):
                    dst.write(view[:got])
                    n += got
                os.fsync(dst.fileno())
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return n

    t = time.perf_counter()
    with ThreadPoolExecutor(len(dirs)) as ex:
        n = sum(ex.map(one, dirs))
    return time.perf_counter() - t, n


# -- parallel recovery workers ---------------------------------------------------------------------
def _warm(barrier: Any = None) -> int:
    """Imports and kernels (checkpoint, restore, partial restore, open, apply: inserts,
    updates, bucket splits) loaded before timing, on a small state of its own; then
    waits at `barrier` (so that each pool process runs one)."""
    import pyarrow as pa
    from sguard.rescale import restore_piece
    from sguard.spark.groupstate import add_key_groups, open_state
    from ioservice import open_root, restore
    from mmm import PageManager
    from sguard.statelayout import read_layout
    d = tempfile.mkdtemp(prefix="bench-rescale-warm-")
    try:
        uri = os.path.join(d, "state")
        info = build(uri, 4 * MB, 1, 8)
        root = open_root(uri)
        lay = read_layout(root)
        assert lay is not None
        t = add_key_groups(pa.table({"k": _keys(1000), "v": np.ones(1000, np.int64)}), "k", 8)
        pm = PageManager(PAGE, 256 * MB)
        restore(pm, root, lay.haunit(0))
        st = open_state(_op(), pm, _schema(), "k", (0, 8))
        for i, x in enumerate(_replay_log(2 * BATCH_ROWS, info["keys"], 8)):
            st.apply(x, 10 + i)
        pm.close()
        pm = PageManager(PAGE, 64 * MB)
        (lo, hi), _ = restore_piece(root, 0, 2, 1, pm)
        kg = t.column("_sguard_kg").to_numpy()
        open_state(_op(), pm, _schema(), "k", (lo, hi)).apply(
            t.filter(pa.array((kg >= lo) & (kg < hi))), 10)
        pm.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if barrier is not None:
        barrier.wait()
    return os.getpid()


def _replay_log(rows: int, n_keys: int, key_groups: int) -> list[Any]:
    """The logged batches replayed: existing and new keys, with their `_sguard_kg`."""
    import pyarrow as pa
    from sguard.spark.groupstate import add_key_groups
    rng = np.random.default_rng(1)
    out = []
    for i in range(0, rows, BATCH_ROWS):
        m = min(BATCH_ROWS, rows - i)
        k = rng.integers(0, n_keys + n_keys // 10, m).astype(np.int64) * 7919 + 13
        out.append(add_key_groups(pa.table({"k": k, "v": rng.integers(-500, 500, m)}), "k",
                                  key_groups))
    return out


def _recover(args: tuple[str, int, int, int, int, Any]) -> dict[str, Any]:
    """One recovery worker: wall-clock start / restored / end, keys before and after."""
    uri, pieces, piece, rows, n_keys, barrier = args
    import pyarrow as pa
    from ioservice import open_root, restore
    from mmm import PageManager
    from sguard.rescale import restore_piece
    from sguard.spark.groupstate import open_state
    from sguard.statelayout import read_layout
    root = open_root(uri)
    layout = read_layout(root)
    assert layout is not None and layout.num_partitions == 1
    log = _replay_log(rows, n_keys, layout.key_groups)
    pm = PageManager(PAGE, 4 << 30)
    barrier.wait()
    t0 = time.time()
    c0 = time.process_time()
    if pieces == 1:
        restore(pm, root, layout.haunit(0))
        lo, hi = layout.key_group_range(0)
    else:
        (lo, hi), _ = restore_piece(root, 0, pieces, piece, pm)
    st = open_state(_op(), pm, _schema(), "k", (lo, hi))
    keys0 = st.n_keys()
    t1 = time.time()
    c1 = time.process_time()
    replayed = 0
    for b, t in enumerate(log):
        if pieces > 1:
            kg = t.column("_sguard_kg").to_numpy()
            t = t.filter(pa.array((kg >= lo) & (kg < hi)))
        replayed += t.num_rows
        st.apply(t, 10 + b)
    t2 = time.time()
    c2 = time.process_time()
    out = {"t0": t0, "t1": t1, "t2": t2, "keys_restored": keys0, "keys_after": st.n_keys(),
           "rows_replayed": replayed, "cpu_restore_s": c1 - c0, "cpu_replay_s": c2 - c1,
           "cpu_s": c2 - c0}
    pm.close()
    return out


def recovery(uri: str, pieces: int, rows: int, n_keys: int, pool: ProcessPoolExecutor,
             manager: Any) -> dict[str, Any]:
    barrier = manager.Barrier(pieces)
    res = list(pool.map(_recover, [(uri, pieces, j, rows, n_keys, barrier)
                                   for j in range(pieces)]))
    start = min(r["t0"] for r in res)
    return {"restore_s": max(r["t1"] for r in res) - start,
            "total_s": max(r["t2"] for r in res) - start,
            "restore_s_each": [r["t1"] - r["t0"] for r in res],
            "cpu_s_each": [r["cpu_s"] for r in res],
            "cpu_restore_s_each": [r["cpu_restore_s"] for r in res],
            "cpu_s_sum": sum(r["cpu_s"] for r in res),
            "cpu_s_max": max(r["cpu_s"] for r in res),
            "keys_restored": sum(r["keys_restored"] for r in res),
            "keys_after": sum(r["keys_after"] for r in res),
            "rows_replayed": sum(r["rows_replayed"] for r in res)}


# -- driver memory of the repartition as a Spark job ------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def driver_probe(uris: Sequence[str], rounds: int) -> dict[str, Any]:
    """In a fresh driver process: `repartition_job` on each state URI of `uris` (``local[2]``),
    `rounds` times each after a warm-up, with the driver's RSS growth and tracemalloc peak."""
    import tracemalloc
    import sguard.spark as ss
    from ioservice import open_root
    from sguard.spark.rescaling import repartition_job
    from sguard.statelayout import read_layout

    spark = ss.local_session("local[2]", "sguard-bench-driver-mem", shuffle_partitions=2)
    out: dict[str, Any] = {"rss_start_mb": _rss() / MB, "calls": []}

    def call(uri: str) -> dict[str, Any]:
        root = open_root(uri, create=False)
        lay = read_layout(root)
        assert lay is not None
        to = 4 if lay.num_partitions != 4 else 2
        peak = [0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _rss())
                time.sleep(0.002)

        tracemalloc.start()
        tracemalloc.reset_peak()
        base = _rss()
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        t = time.perf_counter()
        res = repartition_job(spark, root, to)
        s = time.perf_counter() - t
        stop.set()
        th.join()
        _, tpeak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return {"uri": uri, "from": lay.num_partitions, "to": to, "seconds": s,
                "rss_before_mb": base / MB, "rss_growth_mb": (max(peak[0], _rss()) - base) / MB,
                "tracemalloc_peak_mb": tpeak / MB, "state_bytes": res.state_bytes,
                "bytes_read": res.bytes_read}

    try:
        out["cold_call"] = call(uris[0])  # warm-up: py4j, the workers' first imports
        for _ in range(rounds):
            for u in uris:
                out["calls"].append(call(u))
        out["rss_end_mb"] = _rss() / MB
    finally:
        spark.stop()
    return out


def driver_memory(uris: Sequence[str], rounds: int) -> dict[str, Any]:
    """`driver_probe` in a fresh interpreter (its RSS is the driver's alone)."""
    code = ("import json, sys; from bench.rescale import driver_probe; "
            "print('RESULT ' + json.dumps(driver_probe(sys.argv[2:], int(sys.argv[1]))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent)] + [p for p in os.environ.get(
            "PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-c", code, str(rounds), *uris], capture_output=True,
                       text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"driver memory probe failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# -- the phases of a run --------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """The parsed arguments and what ``--quick`` chooses."""
    args: argparse.Namespace
    state_mb: int
    key_groups: int
    repeats: int
    replay_rows: int
    warm: int
    """Untimed warm-up rounds before the repeats (0 with ``--quick``)."""


def parse_plan(argv: Sequence[str] | None) -> Plan:
    """Parse the command line (module docstring) and fill in the defaults of a `Plan`."""
    ap = argparse.ArgumentParser(prog="python -m bench.rescale", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="one repeat, fewer replayed rows, a small Spark restart (CI)")
    ap.add_argument("--state-mb", type=int, default=136, help="state size (default 136)")
    ap.add_argument("--key-groups", type=int, default=128, help="K (default 128)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats (default 3; quick 1)")
    ap.add_argument("--replay-rows", type=int, default=None,
                    help="rows replayed after a recovery (default 4M; quick 1M)")
    ap.add_argument("--small-state-mb", type=int, default=8,
                    help="the small state of the driver memory comparison (default 8)")
    ap.add_argument("--restart-mb-quick", type=int, default=32,
                    help="the Spark restart's state with --quick (default 32)")
    ap.add_argument("--no-spark", action="store_true",
                    help="skip the Spark parts (driver memory, restart downtime)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = _harness.parse_args(ap, argv)  # adds --out (default bench/out)
    return Plan(args=args, state_mb=args.state_mb, key_groups=args.key_groups,
                repeats=args.repeats or (1 if args.quick else 3),
                replay_rows=args.replay_rows if args.replay_rows is not None else
                (1_000_000 if args.quick else 4_000_000),
                warm=0 if args.quick else 1)


def build_state(plan: Plan, uri: str) -> dict[str, Any]:
    """The bench's state in 2 partitions (`build`), with the seconds it took."""
    t = time.perf_counter()
    info = build(uri, plan.state_mb * MB, 2, plan.key_groups)
    info = dict(info, seconds=time.perf_counter() - t)
    print(f"built {info['state_bytes'] / MB:.0f} MB of state ({info['keys']} keys, "
          f"{info['pages']} pages, K={plan.key_groups}) in {info['seconds']:.1f} s", flush=True)
    return info


def measure_repartition(plan: Plan, uri: str, scratch: str) -> list[dict[str, Any]]:
    """Repartition 2 -> 4 and 4 -> 2, with and without verify, each against a copy.

    The baseline (`copy_files`) is measured right before each repartition, so
    every ratio compares two runs moments apart under the same load and page
    cache. Returns one row per timed repartition (warm-up rounds dropped).
    """
    from sguard.rescale import repartition
    runs: list[dict[str, Any]] = []
    steps = [(4, True), (2, True), (4, False), (2, False)]
    for r in range(plan.repeats + plan.warm):  # the first round is a warm-up (not with --quick)
        for P2, verify in steps:
            copy_s, nbytes = copy_files(uri, os.path.join(scratch, "copy"))
            res = repartition(uri, P2, verify=verify)
            row: dict[str, Any] = {
                "round": r, "from": res.from_partitions, "to": P2, "verify": verify,
                "copy_s": copy_s, "copy_bytes": nbytes, "copy_gb_s": nbytes / copy_s / 1e9,
                "repartition_s": res.seconds, "bytes_read": res.bytes_read,
                "state_bytes": res.state_bytes, "pages": res.pages,
                "phases_s": res.phases_s, "ratio_vs_copy": copy_s / res.seconds}
            if r >= plan.warm:
                runs.append(row)
            ph = res.phases_s
            print(f"round {r} {res.from_partitions}->{P2} verify={verify!s:5}: "
                  f"{res.seconds:6.3f} s, copy {copy_s:5.2f} s "
                  f"({row['copy_gb_s']:.2f} GB/s), ratio {row['ratio_vs_copy']:.2f} "
                  f"[" + " ".join(f"{k[:-2]} {v:.3f}" for k, v in ph.items())
                  + f"; read {res.bytes_read / MB:.0f} MB]", flush=True)
    shutil.rmtree(os.path.join(scratch, "copy"), ignore_errors=True)
    return runs


def measure_recovery(plan: Plan, uri: str, n_keys: int) -> dict[str, list[dict[str, Any]]]:
    """Recovery of the state repartitioned to 1 partition: as 1 process and as 4 pieces.

    Both run in the same warmed pool of 4 processes, with and without replay,
    alternating within each round; each recovery must restore every key built,
    and as 1 and as 4 must end with the same keys. Returns the runs per
    ``as{k}_replay{rows}`` (warm-up rounds dropped).
    """
    from sguard.rescale import repartition
    repartition(uri, 1)
    rec: dict[str, list[dict[str, Any]]] = {}
    ctx = mp.get_context("forkserver")
    with ctx.Manager() as manager, ProcessPoolExecutor(4, mp_context=ctx) as pool:
        warm_barrier = manager.Barrier(4)
        pids = set(pool.map(_warm, [warm_barrier] * 4))
        assert len(pids) == 4, pids  # every pool process warmed
        for rnd in range(plan.repeats + plan.warm):
            for replay in (0, plan.replay_rows):
                for k in (1, 4):
                    out = recovery(uri, k, replay, n_keys, pool, manager)
                    print(f"round {rnd} recovery as {k} (replay {replay} rows): restore "
                          f"{out['restore_s']:.2f} s, total {out['total_s']:.2f} s, keys "
                          f"{out['keys_restored']} -> {out['keys_after']}; CPU s: sum "
                          f"{out['cpu_s_sum']:.2f}, slowest piece {out['cpu_s_max']:.2f}"
                          f" (restore " + " ".join(f"{x:.2f}" for x in
                                                   out["cpu_restore_s_each"])
                          + f"); load {os.getloadavg()[0]:.1f}", flush=True)
                    if out["keys_restored"] != n_keys:
                        raise AssertionError(f"recovered {out['keys_restored']} keys as "
                                             f"{k}, built {n_keys}")
                    if rnd >= plan.warm:
                        rec.setdefault(f"as{k}_replay{replay}", []).append(out)
    for key in rec:  # as 1 and as 4 end with the same keys
        if len({x["keys_after"] for x in rec[key]}
               | {x["keys_after"] for x in rec[key.replace("as4", "as1")]}) != 1:
            raise AssertionError(f"recovery {key}: keys differ between as 1 and as 4")
    return rec


def measure_driver_memory(plan: Plan, uri: str, scratch: str, info: dict[str, Any],
                          data: dict[str, Any]) -> dict[str, Any]:
    """The driver's memory running `repartition_job` on the bench's state and a small one.

    Both states go through the same fresh driver process (`driver_memory`); equal
    peaks mean the driver does not hold state. Stores the raw calls in
    ``data["driver_memory"]``; returns the summary fields.
    """
    small = os.path.join(scratch, "small")
    build(small, plan.args.small_state_mb * MB, 2, plan.key_groups)
    t = time.perf_counter()
    data["driver_memory"] = dm = driver_memory([small, uri], 1 if plan.args.quick else 2)
    print(f"driver memory ({time.perf_counter() - t:.0f} s): " + ", ".join(
        f"{c['from']}->{c['to']} {c['state_bytes'] / MB:.0f} MB: +"
        f"{c['rss_growth_mb']:.1f} MB RSS, tracemalloc {c['tracemalloc_peak_mb']:.1f}"
        f" MB, {c['seconds']:.2f} s" for c in dm["calls"]), flush=True)
    shutil.rmtree(small, ignore_errors=True)
    return driver_memory_summary(dm, uri, small, info["state_bytes"])


def driver_memory_summary(dm: dict[str, Any], uri: str, small: str, state_bytes: int
                          ) -> dict[str, Any]:
    """The summary fields of `driver_memory`'s calls on the bench's state ``uri`` and the
    small one: the peaks over the calls (after the cold call) and the job's seconds."""
    calls = dm["calls"]

    def peak(u: str, f: str) -> float:
        return float(max(c[f] for c in calls if c["uri"] == u))
    return {
        "driver_peak_mb": peak(uri, "rss_growth_mb"),
        "driver_peak_mb_small_state": peak(small, "rss_growth_mb"),
        "driver_tracemalloc_peak_mb": peak(uri, "tracemalloc_peak_mb"),
        "driver_tracemalloc_peak_mb_small_state": peak(small, "tracemalloc_peak_mb"),
        "driver_state_mb": state_bytes / MB,
        "driver_small_state_mb": float(max(c["state_bytes"] for c in calls
                                           if c["uri"] == small)) / MB,
        "repartition_job_s": float(np.median([c["seconds"] for c in calls
                                              if c["uri"] == uri])),
        "repartition_job_cold_s": dm["cold_call"]["seconds"],
    }


def measure_spark(plan: Plan, uri: str, scratch: str, info: dict[str, Any],
                  data: dict[str, Any]) -> dict[str, Any]:
    """The Spark parts (skipped with ``--no-spark``): driver memory, then restart downtime.

    The restart (`bench._spark_restart`) measures a real query restarted with 4
    partitions against the same restart without a partition change, in one run.
    """
    if plan.args.no_spark:
        return {}
    spark_summary = measure_driver_memory(plan, uri, scratch, info, data)
    from bench import _spark_restart  # a real Spark query restarted with 4 partitions
    data["spark_restart"] = _spark_restart.run(
        min(plan.state_mb, plan.args.restart_mb_quick) if plan.args.quick else plan.state_mb,
        scratch, cycles=3, key_groups=plan.key_groups)
    spark_summary.update(_spark_restart.summarize(data["spark_restart"]))
    return spark_summary


def repartition_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repartition against its copy baseline: medians over repeats and both directions."""
    vr = [x for x in runs if x["verify"]]
    nv = [x for x in runs if not x["verify"]]
    ratios = [x["ratio_vs_copy"] for x in vr]
    return {
        "repartition_ratio_vs_copy": float(np.median(ratios)),
        "repartition_ratio_vs_copy_min_max": [float(min(ratios)), float(max(ratios))],
        "repartition_ratio_vs_copy_no_verify": float(np.median(
            [x["ratio_vs_copy"] for x in nv])),
        "repartition_2to4_s": float(np.median([x["repartition_s"] for x in vr
                                               if x["to"] == 4])),
        "repartition_4to2_s": float(np.median([x["repartition_s"] for x in vr
                                               if x["to"] == 2])),
        "repartition_no_verify_s": float(np.median([x["repartition_s"] for x in nv])),
        "copy_s": float(np.median([x["copy_s"] for x in vr])),
        "copy_gb_s": float(np.median([x["copy_gb_s"] for x in vr])),
        "verify_read_over_state": float(np.median([x["bytes_read"] / x["state_bytes"]
                                                   for x in vr])),
        "pages_copied": 0,
    }


def recovery_summary(rec: dict[str, list[dict[str, Any]]], replay_rows: int) -> dict[str, Any]:
    """Recovery as 4 pieces against as 1: wall-clock speedups and the workers' CPU time."""
    def med(key: str, field: str) -> float:
        return float(np.median([x[field] for x in rec[key]]))

    as1, as4 = f"as1_replay{replay_rows}", f"as4_replay{replay_rows}"
    return {
        "recovery_speedup_4_over_1": med(as1, "total_s") / med(as4, "total_s"),
        "recovery_speedup_4_over_1_min_max": _spread(rec, replay_rows),
        "recovery_speedup_4_over_1_restore_only":
            med("as1_replay0", "total_s") / med("as4_replay0", "total_s"),
        # CPU time (process_time of each worker): what the machine's load cannot inflate
        "recovery_cpu_as1_s": med(as1, "cpu_s_sum"),
        "recovery_cpu_as4_sum_s": med(as4, "cpu_s_sum"),
        "recovery_cpu_as4_slowest_piece_s": med(as4, "cpu_s_max"),
        "recovery_cpu_overhead_4_over_1": med(as4, "cpu_s_sum") / med(as1, "cpu_s_sum"),
        "recovery_speedup_4_over_1_cpu_bound_2_cores": med(as1, "cpu_s_sum") / max(
            med(as4, "cpu_s_sum") / 2, med(as4, "cpu_s_max")),
        "recovery_cpu_restore_as1_s": float(np.median(
            [x["cpu_restore_s_each"][0] for x in rec[as1]])),
        "recovery_cpu_restore_as4_sum_s": float(np.median(
            [sum(x["cpu_restore_s_each"]) for x in rec[as4]])),
        "recovery_as1_s": med(as1, "total_s"),
        "recovery_as4_s": med(as4, "total_s"),
        "replay_rows": replay_rows,
    }


def summarize(plan: Plan, data: dict[str, Any], spark_summary: dict[str, Any]
              ) -> dict[str, Any]:
    """The summary: repartition and recovery ratios, the Spark fields, the run's conditions."""
    return {
        **repartition_summary(data["runs"]),
        **recovery_summary(data["recovery"], plan.replay_rows),
        **spark_summary,
        "state_mb": data["build"]["state_bytes"] / MB,
        "key_groups": plan.key_groups,
        "repeats": plan.repeats,
        "loadavg_before_after": [list(data["load_before"]), list(os.getloadavg())],
        "targets": {"repartition_ratio_vs_copy": ">= 1.0 (136 MB and 1 GB)",
                    "recovery_speedup_4_over_1": ">= 1.6",
                    "restart_downtime_ratio_vs_unchanged": "<= 1.2",
                    "driver_peak_mb": "does not grow with the state"},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Parse; build the state; repartition vs copy; recovery as 4 vs as 1; the Spark
    parts; summarize; write the JSON and the PNG. Returns 0."""
    plan = parse_plan(argv)
    _warm()  # numba kernels loaded from their cache before anything is timed
    scratch = tempfile.mkdtemp(prefix="bench-rescale-", dir=plan.args.dir)
    uri = os.path.join(scratch, "state")
    data: dict[str, Any] = {"runs": [], "load_before": os.getloadavg()}
    try:
        data["build"] = info = build_state(plan, uri)
        data["runs"] = measure_repartition(plan, uri, scratch)
        data["recovery"] = measure_recovery(plan, uri, info["keys"])
        spark_summary = measure_spark(plan, uri, scratch, info, data)
        summary = summarize(plan, data, spark_summary)
        data["env"] = _env()
        _harness.write_result("rescale", summary, data,
                              {"state_mb": plan.state_mb, "key_groups": plan.key_groups,
                               "repeats": plan.repeats, "page_bytes": PAGE,
                               "replay_rows": plan.replay_rows, "quick": plan.args.quick})
        _plot(data, summary)
        print(json.dumps(summary, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _spread(rec: dict[str, list[dict[str, Any]]], rows: int) -> list[float]:
    """Min and max of the as-1 / as-4 ratio, round by round."""
    r = [a["total_s"] / b["total_s"] for a, b in zip(rec[f"as1_replay{rows}"],
                                                     rec[f"as4_replay{rows}"])]
    return [float(min(r)), float(max(r))]


def _env() -> dict[str, Any]:
    import pyarrow
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        sha = "?"
    return {"python": platform.python_version(), "numpy": np.__version__,
            "pyarrow": pyarrow.__version__, "cpus": os.cpu_count(), "git_sha": sha,
            "loadavg": os.getloadavg(), "page_cache": "warm"}


def _plot(data: dict[str, Any], summary: dict[str, Any]) -> None:
    plt, path = _harness.figure("rescale")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    a, b, c = axes
    labels = ["copy"]
    vals = [float(np.median([r["copy_s"] for r in data["runs"]]))]
    for (f, t, v) in sorted({(r["from"], r["to"], r["verify"]) for r in data["runs"]}):
        labels.append(f"{f}->{t}" + ("" if v else " no verify"))
        vals.append(float(np.median([r["repartition_s"] for r in data["runs"]
                                     if (r["from"], r["to"], r["verify"]) == (f, t, v)])))
    a.bar(labels, vals)
    a.set_ylabel("seconds")
    a.set_title(f"{summary['state_mb']:.0f} MB: repartition vs copy "
                f"(ratio {summary['repartition_ratio_vs_copy']:.2f})")
    a.tick_params(axis="x", rotation=30)
    rec = data["recovery"]
    keys = sorted(rec)
    b.bar(keys, [float(np.median([x["total_s"] for x in rec[k]])) for k in keys])
    b.set_ylabel("seconds")
    b.set_title(f"recovery as 1 vs 4 (speedup {summary['recovery_speedup_4_over_1']:.2f})")
    b.tick_params(axis="x", rotation=30)
    if "spark_restart" in data:
        rs = data["spark_restart"]["restarts"]
        c.bar([f"{r['from']}->{r['to']} #{i}" for i, r in enumerate(rs)],
              [r["downtime_s"] for r in rs])
        c.set_ylabel("downtime, seconds")
        ratio = summary.get("restart_downtime_ratio_vs_unchanged")
        c.set_title("Spark restart" + (f" (2->4 / 2->2: {ratio:.2f})" if ratio else "")
                    + (f"; driver +{summary['driver_peak_mb']:.0f} MB" if
                       "driver_peak_mb" in summary else ""))
        c.tick_params(axis="x", rotation=30)
    else:
        c.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
