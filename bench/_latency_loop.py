"""The timed loop of `bench.chkpt_latency`, and its `fork()` baseline in a process of its own.

Kept apart from `bench.chkpt_latency` (and free of mmm, ioservice and numba) so
that the `fork()` baseline runs in a fresh process that holds only what it
checkpoints: its own dict state and its own input. A `fork()` copies the page
tables of the whole process, so forking the benchmark's main process (which also
holds the mmm state, the numpy input columns and the compiled kernels) would
overstate fork's pause. `ForkBaseline` starts that process (``python -m
bench._latency_loop``), which builds the same dict state and the same stream,
then runs the fork variant whenever asked, with the same loop (`run`) as every
other variant; results come back as one JSON line per run.
"""
from __future__ import annotations

import gc
import json
import os
import pickle
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["run", "warm_up", "summarize", "set_priority", "make_stream", "write_file", "Done",
           "Child", "wait_handle", "dict_update", "build_dicts", "ForkBaseline", "rss_mb"]


def dict_update(state: dict[int, list[int]], keys: list[int], ts: list[int]) -> None:
    """The idiomatic Python Aggregate: one dict update of [count, first, last] per tuple
    (here, not in `bench.mmm_ops`, so that the fork baseline's process need not import
    mmm; both benches use this one)."""
    get = state.get
    for k, t in zip(keys, ts):
        s = get(k)
        if s is None:
            state[k] = [1, t, t]
        else:
            s[0] += 1
            if t < s[1]:
                s[1] = t
            if t > s[2]:
                s[2] = t


def build_dicts(n_keys: int, n_parts: int) -> list[dict[int, list[int]]]:
    """The dict state `bench.chkpt_latency.build_mmm` builds in mmm: keys ``0..n_keys-1``
    split by ``key % n_parts``, each seen once at timestamp ``key``."""
    return [{k: [1, k, k] for k in range(p, n_keys, n_parts)} for p in range(n_parts)]


def write_file(path: str, data: bytes) -> None:
    """Write and fsync (durable, as the mmm checkpoint is)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())



class Done:
    """A checkpoint already finished (synchronous variants)."""

    def done(self) -> bool:
        return True


class Child:
    """A forked checkpoint process; done once reaped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.status: int | None = None

    def done(self) -> bool:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
                if os.waitstatus_to_exitcode(status) != 0:
                    raise RuntimeError(f"fork checkpoint child {self.pid} failed: {status}")
        return self.status is not None

    def wait(self) -> None:
        while not self.done():
            time.sleep(0.001)


def wait_handle(h: Any) -> None:
    if isinstance(h, Child):
        h.wait()
    elif hasattr(h, "result"):
        h.result()



def warm_up(runner: Any, batches: list[list[tuple[Any, Any]]], n_parts: int,
            checkpoint: bool, rounds: int = 2, min_batches: int = 100) -> None:
    """Untimed: process batches back to back, taking `rounds` checkpoints meanwhile.

    Brings every variant to its steady state (as the paper measures "after
    warm up"): caches warm; for mmm, the frames copy-on-write clones need are
    faulted in once (first touches of fresh memory are slow in a VM) and the
    first, full checkpoint is behind us.
    """
    i = 0
    for _ in range(rounds if checkpoint else 0):
        for p in range(n_parts):
            h = runner.checkpoint(p)
            while h is not None and not h.done():
                runner.process(batches[i % len(batches)])
                i += 1
            wait_handle(h)
        runner.finish_round()
    while i < min_batches:
        runner.process(batches[i % len(batches)])
        i += 1


def run(runner: Any, batches: list[list[tuple[Any, Any]]], period_s: float,
        interval_s: float, first_s: float, checkpoint: bool) -> dict[str, Any]:
    """Feed ``batches`` one per ``period_s``; checkpoint every ``interval_s`` (in turn)."""
    n_parts = len(batches[0])
    warm_up(runner, batches, n_parts, checkpoint)
    lat = np.empty(len(batches))
    service = np.empty(len(batches))  # processing the batch (and starting a checkpoint)
    cpu = np.empty(len(batches))  # the operator thread's CPU time in it (service - cpu: waits)
    wake = np.full(len(batches), np.nan)  # lateness of the wake-up after an on-time sleep
    events: list[dict[str, Any]] = []
    queue: list[int] = []
    inflight: Any = None
    next_due = first_s
    gc_s = [0.0]
    gc_t = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_t[0] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - gc_t[0]

    gc.callbacks.append(on_gc)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter() + 0.01
    w0 = t0
    for i, parts in enumerate(batches):
        arrive = t0 + i * period_s
        now = time.perf_counter()
        if now < arrive:
            time.sleep(arrive - now)
            wake[i] = time.perf_counter() - arrive
        begin = time.perf_counter()
        c0 = time.thread_time()
        if checkpoint:
            now = time.perf_counter() - t0
            if inflight is None and not queue and now >= next_due:
                queue = list(range(n_parts))
                next_due += interval_s
            if inflight is not None and inflight.done():
                events[-1]["end_s"] = time.perf_counter() - t0
                inflight = None
                if not queue:
                    runner.finish_round()
            if inflight is None and queue:
                p = queue.pop(0)
                s = time.perf_counter()
                inflight = runner.checkpoint(p)
                e = time.perf_counter()
                events.append({"partition": p, "start_s": s - t0, "pause_s": e - s,
                               "end_s": None})
                if e - t0 >= next_due:  # ticks missed during a pause longer than the
                    next_due = e - t0 + interval_s  # interval are skipped, not caught up
                if inflight is None:  # mmm skipped it: nothing changed
                    events[-1]["end_s"] = e - t0
        runner.process(parts)
        end = time.perf_counter()
        lat[i] = end - arrive
        service[i] = end - begin
        cpu[i] = time.thread_time() - c0
    wall = time.perf_counter() - w0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    gc.callbacks.remove(on_gc)
    if inflight is not None:
        wait_handle(inflight)
        events[-1]["end_s"] = time.perf_counter() - t0
    on_time = wake[~np.isnan(wake)]
    diag = {"loadavg_1min": load0,
            "cpu_s_per_wall_s": (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / wall,
            "involuntary_switches": ru1.ru_nivcsw - ru0.ru_nivcsw,
            "wake_delay_mean_ms": float(on_time.mean() * 1e3) if len(on_time) else 0.0,
            "wake_delay_p99_ms": float(np.percentile(on_time, 99) * 1e3) if len(on_time) else 0.0,
            "late_batches": int(len(batches) - len(on_time)),
            "service_mean_ms": float(service.mean() * 1e3),
            "service_p99_ms": float(np.percentile(service, 99) * 1e3),
            "service_max_ms": float(service.max() * 1e3),
            "wake_delay_max_ms": float(on_time.max() * 1e3) if len(on_time) else 0.0,
            "gc_ms": gc_s[0] * 1e3,
            "slowest": _slowest(lat, service, cpu, wake, events, t0_rel=period_s)}
    return {"latency_s": lat, "events": events, "diag": diag}


def _slowest(lat: np.ndarray, service: np.ndarray, cpu: np.ndarray, wake: np.ndarray,
             events: list[dict[str, Any]], t0_rel: float, k: int = 6) -> list[dict[str, Any]]:
    """Where the time of the ``k`` slowest batches went: the operator thread's own
    time (``service``), of it on a CPU (``cpu``; the rest waited for the GIL, a lock
    or a core), the wake-up delay, the wait behind earlier batches (``queued``),
    and the batch's position after the last checkpoint start."""
    starts = np.array([e["start_s"] for e in events]) if events else np.zeros(0)
    out = []
    for i in np.argsort(-lat)[:k].tolist():
        at = i * t0_rel
        before = starts[starts <= at + t0_rel]
        w = 0.0 if np.isnan(wake[i]) else float(wake[i])
        out.append({"batch": i, "latency_ms": float(lat[i] * 1e3),
                    "service_ms": float(service[i] * 1e3), "cpu_ms": float(cpu[i] * 1e3),
                    "wake_ms": w * 1e3,
                    "queued_ms": float(max(0.0, lat[i] - service[i] - w) * 1e3),
                    "batches_after_checkpoint": (int(round((at - before[-1]) / t0_rel))
                                                 if len(before) else None)})
    return out


def set_priority(kind: str) -> str:
    """Schedule this thread (and threads it starts later) SCHED_FIFO ("rt") or normally.

    On a shared machine most of a batch's latency is the wait for a CPU after
    its sleep (``wake_delay``), set by other processes' load, not by the
    variant; a real-time priority takes that wait out of every variant alike.
    Forked children are reset to normal scheduling. Returns what was applied.
    """
    try:
        if kind == "rt":
            os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK,
                                  os.sched_param(10))
            return "SCHED_FIFO 10"
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError) as exc:
        return f"normal ({kind} not permitted: {exc})"
    return "normal"


def summarize(lat: np.ndarray) -> dict[str, float]:
    ms = lat * 1e3
    return {"mean_ms": float(ms.mean()), "std_ms": float(ms.std()),
            "median_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99)),
            "max_ms": float(ms.max()), "n": int(len(ms))}


def make_stream(n_keys: int, n_batches: int, batch: int, n_parts: int, seed: int, *,
                columns: bool = True
                ) -> tuple[list[list[tuple[Any, Any]]], list[list[tuple[Any, Any]]]]:
    """The batches, split by partition, as numpy columns (mmm; empty without
    ``columns``) and as lists (dict)."""
    rng = np.random.default_rng(seed)
    cols, recs = [], []
    for i in range(n_batches):
        keys = rng.integers(0, n_keys, batch).astype(np.uint32)
        ts = np.arange(i * batch, (i + 1) * batch, dtype=np.int64) + (1 << 32)
        c, r = [], []
        for p in range(n_parts):
            sel = keys % n_parts == p if n_parts > 1 else slice(None)
            k, t = keys[sel], ts[sel]
            c.append((k, t))
            r.append((k.tolist(), t.tolist()))
        if columns:
            cols.append(c)
        recs.append(r)
    return cols, recs


# -- the fork() baseline in its own process --------------------------------------------------------
class ForkRunner:
    """The ``fork`` variant: `os.fork`; the child pickles the dict, writes and fsyncs
    the file and exits (Redis BGSAVE); the parent keeps processing."""

    variant = "fork"

    def __init__(self, dicts: list[dict[int, list[int]]], workdir: str,
                 idle: bool = False) -> None:
        self.dicts = dicts
        self.workdir = workdir
        self.idle = idle
        self.round = 0

    def process(self, parts: list[tuple[Any, Any]]) -> None:
        for d, (k, t) in zip(self.dicts, parts):
            dict_update(d, k, t)

    def _path(self, p: int, r: int) -> str:
        return os.path.join(self.workdir, f"fork-p{p}-{r}.pkl")

    def checkpoint(self, p: int) -> Child:
        path = self._path(p, self.round)
        pid = os.fork()
        if pid == 0:  # child: serialize the (copy-on-write) state, write, exit
            code = 0
            try:
                if self.idle:  # the same policy as mmm's I/O thread (--profile latency)
                    background_idle()
                write_file(path, pickle.dumps(self.dicts[p], protocol=pickle.HIGHEST_PROTOCOL))
            except BaseException:  # noqa: BLE001 - reported through the exit code
                code = 1
            os._exit(code)
        return Child(pid)

    def finish_round(self) -> None:
        """Delete the previous round's pickles (keep disk use bounded)."""
        if self.round:
            for p in range(len(self.dicts)):
                if os.path.exists(self._path(p, self.round - 1)):
                    os.unlink(self._path(p, self.round - 1))
        self.round += 1


def background_idle() -> None:
    """Run the calling thread (or forked child) under ``SCHED_IDLE``, as
    `ioservice.IOService(idle=True)` runs mmm's I/O threads: every variant's background
    checkpoint work gets the same scheduling (a no-op where Linux's policy is missing)."""
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def rss_mb() -> float:
    """This process's resident memory now (``ru_maxrss`` would carry the parent's
    high-water mark across the exec of a subprocess)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def serve(argv: Sequence[str]) -> int:
    """The fork baseline's process: build, say ready, then one run per ``run`` line."""
    n_keys, n_parts, n_batches, batch, seed = (int(x) for x in argv[:5])
    period, interval, first = (float(x) for x in argv[5:8])
    workdir, priority, idle = argv[8], argv[9], argv[10] == "idle"
    gc.collect()
    gc.disable()
    dicts = build_dicts(n_keys, n_parts)
    _, recs = make_stream(n_keys, n_batches, batch, n_parts, seed, columns=False)
    gc.freeze()
    gc.enable()
    out = sys.stdout
    print(json.dumps({"ready": True, "rss_mb": rss_mb()}), file=out, flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        runner = ForkRunner(dicts, workdir, idle)
        prio = set_priority(priority)
        try:
            res = run(runner, recs, period, interval, first, checkpoint=True)
        finally:
            set_priority("normal")
        res["latency_s"] = res["latency_s"].tolist()
        res["priority"] = prio
        res["rss_mb"] = rss_mb()
        print(json.dumps(res), file=out, flush=True)
    return 0


class ForkBaseline:
    """The fork variant run in a fresh process (see the module docstring)."""

    def __init__(self, n_keys: int, n_parts: int, n_batches: int, batch: int, seed: int,
                 period_s: float, interval_s: float, first_s: float, workdir: str,
                 priority: str, idle: bool = False) -> None:
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        args = [n_keys, n_parts, n_batches, batch, seed, period_s, interval_s, first_s,
                workdir, priority, "idle" if idle else "normal"]
        self.proc = subprocess.Popen([sys.executable, "-m", "bench._latency_loop",
                                      *map(str, args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fork baseline process exited ({self.proc.wait()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def run(self) -> dict[str, Any]:
        """One timed run of the fork variant; the same result as `run`."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        res = self._read()
        res["latency_s"] = np.asarray(res["latency_s"])
        return res

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


if __name__ == "__main__":
    raise SystemExit(serve(sys.argv[1:]))
