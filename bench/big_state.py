"""State bigger than memory: the running aggregate with state 4x its memory budget.

Each configuration runs in its own worker process. With a budget, the worker's pool is
a file on disk (``--dir``, default /var/tmp) under `mmm.pagecache.PageCache`, enforced
after every batch, and the worker runs inside a memory cgroup (v1
``memory.limit_in_bytes`` or v2 ``memory.max``, when this machine lets us make one)
whose limit is the worker's own memory before the state (interpreter, numpy, numba
kernels) plus 1.1x the budget plus 16 MB. The same run measures the same aggregate
with the same state fully in memory (anonymous pool, no budget, no limit).

Phases: build (every key inserted once, in batches) then the timed phase: ``--tuples``
tuples in batches of ``--batch``, keys uniform or Zipf (s = ``--zipf-s``) over the
keys. Throughput is tuples per second of the timed phase, eviction included. Before
each budgeted batch the worker announces the pages the batch's keys live on
(`mmm.pagecache.PageCache.will_use` of `mmm.HashMap.frames_for`): the cache evicts
the coldest other pages to make room and reads those pages in together, instead of one
fault at a time (``--no-will-use`` measures without it).

Summary: ``big_state_ratio_vs_in_memory_zipf`` and ``_uniform`` (budgeted throughput
over in-memory; goal >= 0.5 for Zipf), ``peak_rss_over_budget`` (the worker's peak
resident memory above its own memory before the state, over the budget; goal <= 1.1;
``_run``: the timed phase's peak alone),
``peak_frames_over_budget`` (the pool's resident bytes at their peak, measured at the
end of each batch before eviction), the cgroup's limit, peak usage and OOM kills.
A budgeted configuration one of whose batches touches more pages than the budget holds
stops there and reports ``failed`` (the `WorkingSetTooLargeError`) and no throughput.

``--spark`` measures the same aggregate through Spark (`bench._big_state_spark`): sguard
under the budget against Spark SQL's aggregate on RocksDB (bounded to the same budget)
under the same memory-cgroup limit, and sguard in memory; summary
``big_state_ratio_vs_rocksdb_sql_uniform`` (goal >= 1), ``spark_budget_over_in_memory_uniform``,
the cgroups' peaks and OOM kills, and an exactly-once check of the state read back
(``big_state_spark.json``/``.png``).

``--runtime`` measures something else (`runtime_main`): what a budget costs a state that
fits in memory, through the Spark runtime's batch path (`sguard.spark.runtime`, no
Spark): the default pool under /dev/shm without a budget against a pool on ``--dir``
under a budget larger than the state, interleaved ``--reps`` times; summary
``disk_over_shm_call_ms``, ``disk_over_shm_apply_ms``, ``budget_ms_median``
(``big_state_runtime.json``/``.png``).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._harness import figure, parse_args, save_figure, write_result  # noqa: E402

MB = 1 << 20
VALUE = [("c", "<i8"), ("s", "<f8"), ("lo", "<f8"), ("hi", "<f8")]
SPEC = {"c": "count", "s": ("sum", "x"), "lo": ("min", "x"), "hi": ("max", "x")}
CGROUP_V1 = "/sys/fs/cgroup/memory"
CGROUP_V2 = "/sys/fs/cgroup"


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (``/proc/self/clear_refs``, Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        pass


def keys_for(kind: str, rng: np.random.Generator, n: int, nkeys: int, s: float) -> Any:
    if kind == "uniform":
        return rng.integers(0, nkeys, n).astype("<u8")
    return ((rng.zipf(s, n) - 1) % nkeys).astype("<u8")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration in this process (after the parent put it in the cgroup)."""
    import mmm
    from mmm.pagecache import PageCache
    nkeys, pb = args.keys, args.page_bytes
    # warm the kernels on a small map (growing by splits, as the measured one does) so
    # that their compiled code is part of the base memory, then free it
    wpm = mmm.PageManager(pb, 1 << 26)
    w = mmm.HashMap.create(wpm, "w", key="<u8", value=VALUE)
    for i in range(0, 20000, 4096):
        wk = np.arange(i, i + 4096, dtype="<u8")
        w.frames_for(wk)
        w.upsert(wk, {"x": np.ones(4096)}, SPEC)
    w.upsert(np.arange(20000, dtype="<u8"), {"x": np.ones(20000)}, SPEC)
    del w, wpm
    if args.budget_mb:  # and the page cache's paths (a pool file of 1000 pages)
        wd = tempfile.mkdtemp(prefix="big-state-warm-", dir=args.dir)
        try:
            wpm = mmm.PageManager(pb, 1 << 26, os.path.join(wd, "pool"))
            wc = PageCache(wpm.pool, 64 * pb, "warm")
            w = mmm.HashMap.create(wpm, "w", key="<u8", value=VALUE, page_slots=16)
            for i in range(0, 8000, 800):
                wk = np.arange(i, i + 800, dtype="<u8")
                wc.will_use(w.frames_for(wk))
                w.upsert(wk, {"x": np.ones(800)}, SPEC)
                wc.enforce(check=False)
            wc.evict_all()
            wc.close()
            del w, wc, wpm
        finally:
            shutil.rmtree(wd, ignore_errors=True)
    base_rss = _status("VmRSS")
    print(json.dumps({"base_rss": base_rss}), flush=True)
    sys.stdin.readline()  # the parent sets the limit from base_rss, then says go
    cap = 1 << 34
    path = None
    if args.budget_mb:
        d = tempfile.mkdtemp(prefix="big-state-", dir=args.dir)
        atexit.register(shutil.rmtree, d, True)  # also when a batch cannot fit
        path = os.path.join(d, "pool")
    pm = mmm.PageManager(pb, cap, path)
    cache = PageCache(pm.pool, args.budget_mb * MB, "bench/partition 0") if path else None
    # grown by splits as the keys arrive (not sized up front: that would allocate the whole
    # state in one call, before any enforce); the same in memory, so both end alike
    m = mmm.HashMap.create(pm, "agg", key="<u8", value=VALUE)
    rng = np.random.default_rng(7)
    t0 = time.perf_counter()
    hook = cache is not None and not args.no_will_use
    for i in range(0, nkeys, args.batch):
        k = np.arange(i, min(nkeys, i + args.batch), dtype="<u8")
        if hook and cache is not None:
            cache.will_use(m.frames_for(k))
        m.upsert(k, {"x": rng.random(len(k))}, SPEC)
        if cache:
            cache.enforce()
    build_s = time.perf_counter() - t0
    state_bytes = pm.pool.used_frames * pb
    peak_rss_build = _status("VmHWM")
    _reset_peak_rss()  # VmHWM from here on: the timed phase's peak
    done = 0
    t0 = time.perf_counter()
    evict_s = will_use_s = 0.0
    read_ahead = 0
    while done < args.tuples:
        n = min(args.batch, args.tuples - done)
        k = keys_for(args.dist, rng, n, nkeys, args.zipf_s)
        if hook and cache is not None:
            e0 = time.perf_counter()
            read_ahead += cache.will_use(m.frames_for(k))
            will_use_s += time.perf_counter() - e0
        m.upsert(k, {"x": rng.random(n)}, SPEC)
        done += n
        if cache:
            e0 = time.perf_counter()
            cache.enforce(check=True)
            evict_s += time.perf_counter() - e0
    run_s = time.perf_counter() - t0
    peak_rss_run = _status("VmHWM")  # before the check below reads the whole state
    rss_end = {f: _status(f) for f in ("RssAnon", "RssFile", "RssShmem")}
    assert len(m) == nkeys
    total = int(m.values()["c"].sum())
    assert total == nkeys + args.tuples, (total, nkeys, args.tuples)
    out: dict[str, Any] = {
        "dist": args.dist, "budget_bytes": (args.budget_mb or 0) * MB,
        "state_bytes": state_bytes,
        "build_s": build_s, "run_s": run_s, "evict_s": evict_s, "will_use_s": will_use_s,
        "will_use": hook, "read_ahead_frames": read_ahead,
        "tuples_per_s": args.tuples / run_s, "base_rss": base_rss,
        "peak_rss_run": peak_rss_run, "peak_rss_build": peak_rss_build,
        "count_total": total, "rss_end": rss_end}
    out["peak_rss"] = max(out["peak_rss_run"], peak_rss_build)
    if cache:
        st = cache.stats()
        out.update({"peak_resident_frames_bytes": cache.peak_resident_bytes,
                    "evicted_frames_total": st["evicted_frames_total"],
                    "resident_bytes_end": st["resident_bytes"]})
        shutil.rmtree(os.path.dirname(pm.pool.path or ""), ignore_errors=True)
    return out


class Cgroup:
    """A memory cgroup made for one worker (v1 or v2), or None when we may not make one."""

    def __init__(self, name: str) -> None:
        self.path = ""
        self.v = 0
        for v, root in ((2, CGROUP_V2), (1, CGROUP_V1)):
            ctl = os.path.join(root, "cgroup.controllers")
            if v == 2 and not (os.path.exists(ctl) and "memory" in open(ctl).read()):
                continue
            if v == 1 and not os.path.exists(os.path.join(root, "memory.limit_in_bytes")):
                continue
            p = os.path.join(root, name)
            try:
                os.mkdir(p)
            except OSError:
                continue
            self.path, self.v = p, v
            return

    def add(self, pid: int) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as fh:
            fh.write(str(pid))

    def limit(self, nbytes: int) -> None:
        """Set the memory limit (bytes; negative: none)."""
        f = "memory.max" if self.v == 2 else "memory.limit_in_bytes"
        with open(os.path.join(self.path, f), "w") as fh:
            fh.write(str(nbytes) if nbytes >= 0 else "max" if self.v == 2 else "-1")

    def usage(self) -> int:
        """The cgroup's memory in use now (bytes)."""
        f = "memory.current" if self.v == 2 else "memory.usage_in_bytes"
        with open(os.path.join(self.path, f)) as fh:
            return int(fh.read())

    def reset_peak(self) -> None:
        """Start the peak again from the usage now (where the kernel allows it)."""
        f = "memory.peak" if self.v == 2 else "memory.max_usage_in_bytes"
        try:
            with open(os.path.join(self.path, f), "w") as fh:
                fh.write("0")
        except OSError:
            pass

    def report(self) -> dict[str, Any]:
        def rd(f: str) -> str:
            try:
                with open(os.path.join(self.path, f)) as fh:
                    return fh.read()
            except OSError:
                return ""
        if self.v == 1:
            oom = rd("memory.oom_control")
            kills = [int(ln.split()[1]) for ln in oom.splitlines() if ln.startswith("oom_kill ")]
            return {"cgroup": "v1", "peak_bytes": int(rd("memory.max_usage_in_bytes") or 0),
                    "limit_bytes": int(rd("memory.limit_in_bytes") or 0),
                    "failcnt": int(rd("memory.failcnt") or 0),
                    "oom_kills": kills[0] if kills else None}
        ev = dict(ln.split() for ln in rd("memory.events").splitlines() if ln)
        return {"cgroup": "v2", "peak_bytes": int(rd("memory.peak") or 0),
                "limit_bytes": int(rd("memory.max").strip() or 0),
                "oom_kills": int(ev.get("oom_kill", 0))}

    def remove(self) -> None:
        if self.path:
            try:
                os.rmdir(self.path)
            except OSError:
                pass


class LimitedChild:
    """A bench process (``python -m <cmd>`` in the checkout) that speaks JSON lines on
    stdout and takes words on stdin, in a memory cgroup of its own (`Cgroup`) when
    ``limited``: it joins before it starts anything, so every process it starts (a JVM,
    Python workers) is in it too. A context manager: the process is killed and the
    cgroup removed on exit."""

    def __init__(self, cmd: list[str], name: str, limited: bool) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.p = subprocess.Popen([sys.executable, "-m", *cmd], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=root)
        self.cg = Cgroup(f"{name}-{self.p.pid}") if limited else None
        if self.cg is not None and self.cg.path:
            self.cg.add(self.p.pid)

    def __enter__(self) -> LimitedChild:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        if self.cg is not None:
            self.cg.remove()

    def read(self) -> dict[str, Any] | None:
        """The next JSON line (None: the process ended first)."""
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        return json.loads(line) if line.strip() else None

    def say(self, word: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(word + "\n")
        self.p.stdin.flush()

    @property
    def limited(self) -> bool:
        return self.cg is not None and bool(self.cg.path)

    def limit(self, nbytes: int) -> None:
        """Set the cgroup's limit (negative: none) and start its peak again."""
        if self.cg is not None and self.cg.path:
            self.cg.limit(nbytes)
            self.cg.reset_peak()

    def usage(self) -> int:
        assert self.cg is not None
        return self.cg.usage()

    def report(self) -> dict[str, Any] | None:
        """The cgroup's figures (None when not limited)."""
        if self.cg is None:
            return None
        return self.cg.report() if self.cg.path else {"cgroup": None,
                                                      "why": "no writable memory cgroup"}

    def wait(self) -> int:
        return self.p.wait()


def run_worker(args: argparse.Namespace, dist: str, budget_mb: int, limit: bool
               ) -> dict[str, Any]:
    cmd = ["bench.big_state", "--worker", "--dist", dist,
           "--keys", str(args.keys), "--tuples", str(args.tuples), "--batch", str(args.batch),
           "--page-bytes", str(args.page_bytes), "--zipf-s", str(args.zipf_s),
           "--dir", args.dir, "--out", str(args.out)]
    if args.no_will_use:
        cmd.append("--no-will-use")
    if budget_mb:
        cmd += ["--budget-mb", str(budget_mb)]
    t0 = time.perf_counter()
    with LimitedChild(cmd, "sguard-big-state", limit) as c:
        first = c.read()
        if first is None:
            return {"failed": True, "returncode": c.wait()}
        c.limit(int(first["base_rss"] + 1.1 * budget_mb * MB + 16 * MB))
        c.say("go")
        res = c.read() or {"failed": True}
        res["returncode"] = c.wait()
        res["wall_s"] = time.perf_counter() - t0  # the worker's whole life, build included
        if limit:
            res["limit"] = c.report()
        return res


def runtime_run(args: argparse.Namespace, local_root: str, budget: str | None, tag: str
                ) -> dict[str, Any]:
    """``--runtime``: one partition through the Spark runtime's batch path
    (`sguard.spark.runtime.run_partition_batch`, no Spark), the state resident: per batch
    the time of the call and the record's ``apply_ms`` and ``budget_ms``."""
    import pyarrow as pa

    import sguard.spark as ss
    from ioservice import open_root
    from sguard.spark.budget import MemoryBudget
    from sguard.spark.metrics import read_metrics
    from sguard.spark.runtime import RuntimeConfig, run_partition_batch
    from sguard.statelayout import OperatorLayout
    work = tempfile.mkdtemp(prefix=f"big-state-{tag}-", dir=local_root)
    try:
        op = ss.RunningAggregate("v")
        schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
        lay = OperatorLayout(operator=op.kind, name=tag, schema={"params": op.params()},
                             num_partitions=1, key="k", key_groups=8)
        cfg = RuntimeConfig(state_uri=os.path.join(work, "state"), state_key=tag, layout=lay,
                            operator=op, key="k", input_schema=schema,
                            output_schema=op.output_schema(schema, "k"),
                            local_dir=os.path.join(work, "local"),
                            memory_budget=MemoryBudget.for_query(budget, None, None))
        rng = np.random.default_rng(5)
        call_ms = []
        for b in range(args.batches):
            t = pa.table({"k": rng.integers(0, args.keys, args.batch, dtype=np.int64),
                          "v": rng.integers(-500, 500, args.batch, dtype=np.int64)})
            t0 = time.perf_counter()
            run_partition_batch(cfg, 0, b, t)
            call_ms.append((time.perf_counter() - t0) * 1e3)
        root = open_root(cfg.state_uri)
        for _ in range(100):  # records are written by an I/O thread
            recs = read_metrics(root)[0]
            if len(recs) == args.batches:
                break
            time.sleep(0.1)
        warm = slice(2, None)  # batch 0 builds the map; 1 may compile
        return {"tag": tag, "local_root": local_root, "budget": budget,
                "call_ms": call_ms, "call_ms_median": float(np.median(call_ms[warm])),
                "apply_ms_median": float(np.median([r["apply_ms"] for r in recs][warm])),
                "budget_ms_median": float(np.median([r.get("budget_ms", 0.0)
                                                     for r in recs][warm])),
                "state_bytes": recs[-1].get("state_bytes"),
                "resident_bytes": recs[-1].get("resident_bytes"),
                "evicted_bytes": recs[-1].get("evicted_bytes")}
    finally:
        time.sleep(1.0)  # the last checkpoint (asynchronous) lands first
        shutil.rmtree(work, ignore_errors=True)


def runtime_main(args: argparse.Namespace) -> int:
    """``--runtime``: the cost of a disk-backed pool under a budget the state fits in,
    against the default (no budget, the pool under /dev/shm), interleaved ``--reps``
    times. Summary: ``disk_over_shm_call_ms`` and ``disk_over_shm_apply_ms`` (ratios of
    the medians over the repetitions), ``budget_ms_median``."""
    from mmm.pagecache import is_memory_fs
    if is_memory_fs(args.dir) or not is_memory_fs("/dev/shm"):
        print(f"big_state --runtime: error: --dir {args.dir} must be a disk and /dev/shm a "
              f"tmpfs", file=sys.stderr)
        return 2
    args.keys = args.keys or 200_000
    args.batches = 12 if args.quick else 30
    rows: dict[str, Any] = {"shm": [], "disk": []}
    runtime_run(args, "/dev/shm", None, "warm")  # kernels compiled, caches warm
    for _ in range(args.reps):
        rows["shm"].append(runtime_run(args, "/dev/shm", None, "shm"))
        rows["disk"].append(runtime_run(args, args.dir, "auto", "disk"))
    med = {k: {f: float(np.median([r[f] for r in v]))
               for f in ("call_ms_median", "apply_ms_median", "budget_ms_median")}
           for k, v in rows.items()}
    summary = {"disk_over_shm_call_ms": med["disk"]["call_ms_median"]
               / med["shm"]["call_ms_median"],
               "disk_over_shm_apply_ms": med["disk"]["apply_ms_median"]
               / med["shm"]["apply_ms_median"],
               "shm_call_ms": med["shm"]["call_ms_median"],
               "disk_call_ms": med["disk"]["call_ms_median"],
               "budget_ms_median": med["disk"]["budget_ms_median"],
               "state_bytes": rows["disk"][-1]["state_bytes"],
               "load": os.getloadavg()}
    print(json.dumps(summary))
    path = write_result("big_state_runtime", summary, rows,
                        {"quick": args.quick, "keys": args.keys, "batch": args.batch,
                         "batches": args.batches, "reps": args.reps, "dir": args.dir})
    plt, png = figure("big_state_runtime")
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for k, v in rows.items():
        for i, r in enumerate(v):
            ax.plot(r["call_ms"], label=f"{k} rep {i}", color="C0" if k == "shm" else "C1",
                    alpha=0.4 + 0.6 * (i == 0))
    ax.set_xlabel("batch")
    ax.set_ylabel("ms per batch (run_partition_batch)")
    ax.set_yscale("log")
    ax.set_title(f"resident state, {args.keys} keys: /dev/shm vs disk under a budget")
    ax.legend(fontsize=7)
    return save_figure(fig, png, path)


def recovery_entry(args: argparse.Namespace) -> int:
    """``--recovery`` (`bench._big_state_recovery.recovery_main`)."""
    from bench._big_state_recovery import recovery_main
    got = recovery_main(args)
    summary = {**got["summary"], "load": os.getloadavg()}
    print(json.dumps(summary, default=str))
    path = write_result("big_state_recovery", summary, got["rows"],
                        {"quick": args.quick, "budget_mb": args.budget_mb, "keys": args.keys})
    plt, png = figure("big_state_recovery")
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    names = ["recovery_s_memory", "recovery_s_budget", "checkpoint_read_s"]
    ax.bar(["in memory", "under the budget", "reading the checkpoint"],
           [summary[n] or 0 for n in names])
    ax.set_ylabel("seconds")
    ax.set_title(f"recovering a partition {summary['recovery_state_over_budget']:.1f}x its "
                 f"{args.budget_mb} MB budget")
    return save_figure(fig, png, path)


def spark_entry(args: argparse.Namespace) -> int:
    """``--spark`` (`bench._big_state_spark.spark_main`)."""
    from bench._big_state_spark import VARIANTS, spark_main
    got = spark_main(args)
    summary = {**got["summary"], "load": os.getloadavg(),
               "targets": {"big_state_ratio_vs_rocksdb_sql_uniform": ">= 1"}}
    print(json.dumps(summary, default=str))
    path = write_result("big_state_spark", summary, got["rows"],
                        {"quick": args.quick, "budget_mb": args.budget_mb, "keys": args.keys})
    plt, png = figure("big_state_spark")
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    ax.bar(list(VARIANTS), [(got["rows"][v].get("rows_per_s") or 0) / 1e3 for v in VARIANTS])
    ax.set_ylabel("thousand rows / s (timed batches)")
    ax.set_title(f"Spark running aggregate, state ~4x a {args.budget_mb} MB budget")
    return save_figure(fig, png, path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dist", default="zipf", choices=["zipf", "uniform"])
    ap.add_argument("--budget-mb", type=int, default=None)
    ap.add_argument("--keys", type=int, default=None, help="distinct keys (state size)")
    ap.add_argument("--tuples", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--page-bytes", type=int, default=4096)
    ap.add_argument("--zipf-s", type=float, default=1.2)
    ap.add_argument("--dir", default="/var/tmp", help="a disk directory for the pool files")
    ap.add_argument("--no-will-use", action="store_true",
                    help="budgeted runs: do not announce each batch's pages "
                    "(PageCache.will_use of HashMap.frames_for); they fault in one by one")
    ap.add_argument("--runtime", action="store_true",
                    help="measure the runtime's batch path with the state resident: no "
                    "budget (pool under /dev/shm) against a budget on --dir (runtime_main)")
    ap.add_argument("--reps", type=int, default=3, help="--runtime: interleaved repetitions")
    ap.add_argument("--spark", action="store_true",
                    help="the running aggregate in Spark: sguard under the budget against "
                    "Spark SQL on RocksDB under the same memory limit, and sguard in memory "
                    "(bench._big_state_spark; writes big_state_spark.json/.png)")
    ap.add_argument("--recovery", action="store_true",
                    help="recovering a partition 4x its budget under the memory cgroup vs "
                    "in memory vs reading its checkpoint (bench._big_state_recovery; writes "
                    "big_state_recovery.json/.png)")
    args = parse_args(ap, argv)
    if args.runtime:
        return runtime_main(args)
    if args.recovery:
        return recovery_entry(args)
    if args.spark:
        return spark_entry(args)
    if args.worker:
        from mmm.pagecache import WorkingSetTooLargeError
        try:
            print(json.dumps(worker(args)), flush=True)
        except WorkingSetTooLargeError as exc:  # a batch's pages cannot fit: reported
            print(json.dumps({"dist": args.dist, "failed": str(exc),
                              "working_set_bytes": exc.working_set_bytes,
                              "budget_bytes": exc.budget_bytes}), flush=True)
        return 0
    budget_mb = args.budget_mb or (32 if args.quick else 128)
    # ~64 bytes of pages per key at the map's load: 4x the budget
    args.keys = args.keys or int(4 * budget_mb * MB / 64)
    args.tuples = args.tuples or (1_000_000 if args.quick else 5_000_000)
    rows: dict[str, Any] = {}
    for dist in ("zipf", "uniform"):
        rows[f"memory_{dist}"] = run_worker(args, dist, 0, limit=False)
        rows[f"budget_{dist}"] = run_worker(args, dist, budget_mb, limit=True)
        for k in (f"memory_{dist}", f"budget_{dist}"):
            r = rows[k]
            print(f"{k}: {r.get('tuples_per_s', 0):,.0f} tuples/s, state "
                  f"{r.get('state_bytes', 0) / MB:.0f} MB, peak rss "
                  f"{r.get('peak_rss', 0) / MB:.0f} MB (base {r.get('base_rss', 0) / MB:.0f} MB)"
                  + (f", limit {r['limit']}" if "limit" in r else ""))

    def ratio(dist: str) -> float | None:
        b, mem = rows[f"budget_{dist}"], rows[f"memory_{dist}"]
        if "tuples_per_s" not in b or "tuples_per_s" not in mem:
            return None
        return float(b["tuples_per_s"] / mem["tuples_per_s"])
    budget_rows = [rows[f"budget_{d}"] for d in ("zipf", "uniform")]
    ok = [r for r in budget_rows if "peak_rss" in r]
    summary = {
        "big_state_ratio_vs_in_memory_zipf": ratio("zipf"),
        "big_state_ratio_vs_in_memory_uniform": ratio("uniform"),
        "peak_rss_over_budget": max(((r["peak_rss"] - r["base_rss"]) / r["budget_bytes"]
                                     for r in ok), default=None),
        "peak_rss_over_budget_run": max(((r["peak_rss_run"] - r["base_rss"])
                                         / r["budget_bytes"] for r in ok), default=None),
        "peak_frames_over_budget": max((r["peak_resident_frames_bytes"] / r["budget_bytes"]
                                        for r in ok), default=None),
        "state_over_budget": max((r["state_bytes"] / r["budget_bytes"] for r in ok),
                                 default=None),
        "limit": [r.get("limit") for r in budget_rows],
        "targets": {"big_state_ratio_vs_in_memory_zipf": ">= 0.5",
                    "peak_rss_over_budget": "<= 1.1"},
        "load": os.getloadavg(),
    }
    print(json.dumps({k: v for k, v in summary.items() if k not in ("targets",)}, default=str))
    path = write_result("big_state", summary, rows,
                        {"quick": args.quick, "budget_mb": budget_mb, "keys": args.keys,
                         "tuples": args.tuples, "batch": args.batch,
                         "page_bytes": args.page_bytes, "zipf_s": args.zipf_s,
                         "will_use": not args.no_will_use})
    plt, png = figure("big_state")
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    names = list(rows)
    ax.bar(names, [rows[n].get("tuples_per_s", 0) / 1e6 for n in names])
    ax.set_ylabel("million tuples / s")
    ax.set_title(f"running aggregate, state {summary['state_over_budget'] or 0:.1f}x budget "
                 f"({budget_mb} MB)")
    return save_figure(fig, png, path)


if __name__ == "__main__":
    raise SystemExit(main())
