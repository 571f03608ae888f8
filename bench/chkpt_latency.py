"""Paper Table 7 and Figures 7-8: stream latency while the Aggregate is checkpointed.

The Aggregate (count, first and last timestamp per 4-byte key) holds about
128 MB of state (``--quick``: 32 MB) and is fed at a steady rate: a batch of
``--batch`` tuples every ``--period-ms`` milliseconds, keys drawn uniformly
from the existing groups (the paper's worst case for copy-on-write: pages are
touched at random). A batch *arrives* at its scheduled time; its latency is the
time from arrival to the end of its processing, so it includes the wait behind
earlier batches and behind any checkpoint work done in the operator thread.
Every ``--interval-s`` seconds the state is checkpointed to ``file://`` (a
temporary directory; every variant fsyncs what it writes). Variants:

* ``none (mmm)`` / ``none (dict)``: no checkpoint; state in an mmm `HashMap`
  (the `Aggregate` operator, batch API) or in a Python dict of
  ``[count, first, last]`` lists updated tuple by tuple (the idiomatic operator);
* ``mmm``: `ioservice.CheckpointManager` at the library's defaults, as the
  Spark runtime builds it: `IOService(2)` (``--workers``) and
  `CheckpointPolicy()`. Its checkpoint writers run ``SCHED_IDLE`` and at most
  one core fewer than the machine has write at once (on this 2-vCPU VM: one;
  two threads in the kernel's write path at once delay every other thread's
  wake-up by up to a 4 ms tick), with no staging. Prepare = freeze pages, then
  the I/O threads write them while the operator runs; the operator updates
  the value of a key in a frozen page in place, logging the old bytes for the
  writers, instead of cloning the page (`CheckpointPolicy.in_place`, off:
  ``--no-in-place``). The baselines' background work runs under the same
  policy (``async pickle``'s writer thread and ``fork``'s child:
  ``SCHED_IDLE`` too);
* ``mmm (previous)``: the same at the defaults before them, for the trade's
  other side: `IOService(2, idle=False, write_threads=2)` (two writers at
  normal priority) and `CheckpointPolicy(stage_mb=256)` (a background thread
  first copies the pages to write out of the pool and releases them). Each
  run records its checkpoints' own durations (start to commit, seen at the
  next batch: 10 ms resolution); ``checkpoint_s_over_previous_default`` is
  mmm's mean duration over this variant's, paired within a round;
* ``sync pickle``: ``pickle.dumps`` of the dict, write and fsync the file, all
  in the operator thread;
* ``async pickle``: ``pickle.dumps`` in the operator thread; write and fsync in
  a background thread;
* ``fork``: ``os.fork``; the child pickles the dict, writes and fsyncs the file
  and exits (Redis BGSAVE); the parent keeps processing. It runs in a fresh
  process of its own (`bench._latency_loop.ForkBaseline`) that holds only its
  dict state and its input: forking this process, which also holds the mmm
  state, the numpy input and the compiled kernels, would copy their page tables
  too and overstate fork's pause. Its process size is reported
  (``fork_process_rss_mb`` beside ``main_process_rss_mb``).

Partitions: the state is split by ``key % P`` into P = 1 or 4 independent
operators (4 `Aggregate` s with 4 page managers / 4 HA units, or 4 dicts); every
batch is split and each part fed to its partition. At a checkpoint tick the
partitions are checkpointed *in turn*, one after the other: the next one starts
once the previous one is done (mmm: committed; fork: child exited; async
pickle: written), and a synchronous one between two batches. The same amount
of state is written per tick as with one partition; each interruption is 1/P.

Rounds: every variant runs ``--rounds`` times, interleaved (each round runs
all variants once, in an order rotated round by round), and every ratio in the
summary is the median over rounds of the ratio *within* a round (runs moments
apart share the machine's load). Each run also records where its latency came
from: ``wake_delay`` (how late the operator thread woke after sleeping until a
batch's arrival: the machine's scheduling, not the variant), ``service`` (the
operator thread's own time per batch: processing, copy-on-write, the checkpoint
start, any wait for the GIL), late batches (arrived while an earlier one was
still being processed), GC time, CPU/wall, involuntary context switches and the
load average. On a shared 2-core machine the wake-up delay drove the spread
(means of 1-20 ms for batches served in 0.3 ms). ``--priority rt`` (opt-in:
real-time threads can starve the rest of a small machine) schedules the timed
runs ``SCHED_FIFO`` when permitted (forked children run normally), which takes
that wait out of every variant alike.

Before its timed run every variant is warmed up (untimed): it processes
batches back to back while taking two rounds of checkpoints (see `warm_up`).
The first mmm checkpoint is full; later ones are incremental, with random
updates nearly as large.
Objects built before the runs are moved out of the garbage collector's reach
(``gc.freeze``) so no variant pays a full collection of millions of lists.

Run: ``python -m bench.chkpt_latency [--quick] [--rounds N] [--priority rt|normal]
[--out DIR]``. Writes ``DIR/chkpt_latency.json`` (default ``bench/out``; summary:
``mmm_mean_ratio_1p``, ``mmm_p99_ratio_1p``, ``checkpoint_s_over_previous_default``
and ``checkpoint_s_mean_1p`` (a checkpoint's own duration beside the latency figures),
``mmm_previous_p99_ratio_1p``, ``spike_ratio_sync_pickle_over_mmm``,
``spike_ratio_fork_over_mmm``, ``mmm_mean_over_dict_none_1p`` — mmm with
checkpoints over the dict without —, ``mmm_service_mean_ratio_1p`` — the
operator thread's own time per batch with checkpoints over without —, the
per-variant means and wake-up delays, the rounds, priority and load) and
``DIR/chkpt_latency.png`` (the last round's curves).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import inspect
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import mmm
from bench._harness import figure, parse_args, save_figure, write_result
from bench._latency_loop import (Done, ForkBaseline, background_idle, dict_update, make_stream,
                                 rss_mb, run, set_priority, summarize, write_file)
from ioservice import CheckpointManager, CheckpointPolicy, IOService
from sguard.operators import Aggregate

MB = 1 << 20
IO_IDLE_DEFAULT: bool = inspect.signature(IOService).parameters["idle"].default
"""Whether the library runs checkpoint writers ``SCHED_IDLE`` by default (the baselines'
background work follows it)."""
VARIANTS = ("none (mmm)", "none (dict)", "mmm", "mmm (previous)", "sync pickle", "async pickle",
            "fork")
MMM_VARIANTS = ("none (mmm)", "mmm", "mmm (previous)")


# -- state -------------------------------------------------------------------------------------
def build_mmm(target_bytes: int, n_parts: int, page_bytes: int) -> tuple[list[Aggregate], int]:
    """``n_parts`` Aggregates over keys ``0..n-1`` (key % n_parts), together ~target_bytes."""
    ops = [Aggregate(mmm.PageManager(page_bytes=page_bytes,
                                     capacity_bytes=max(4 * target_bytes // n_parts, 1 << 26)))
           for _ in range(n_parts)]
    step = 1 << 16
    n = 0
    while sum(op.pm.stats()["used_bytes"] for op in ops) < target_bytes:
        keys = np.arange(n, n + step, dtype=np.uint32)
        ts = keys.astype(np.int64)
        for p, op in enumerate(ops):
            sel = keys % n_parts == p
            op.process(keys[sel], ts[sel])
        n += step
    return ops, n


def to_dict(op: Aggregate) -> dict[int, list[int]]:
    """The same state as a dict of ``[count, first, last]`` lists."""
    k, v = op.state.items()
    return {a: [c, f, l] for a, c, f, l in zip(k.tolist(), v["count"].tolist(),
                                                v["first_ts"].tolist(), v["last_ts"].tolist())}


# -- the variants ----------------------------------------------------------------------------------
class Runner:
    """One variant with P partitions: process a batch; start a partition's checkpoint."""

    def __init__(self, variant: str, ops: list[Aggregate], dicts: list[dict[int, list[int]]],
                 workdir: str, n_workers: int, in_place: bool = True) -> None:
        self.variant = variant
        self.ops, self.dicts = ops, dicts
        self.workdir = workdir
        self.mgrs: list[CheckpointManager] = []
        self.ios: list[IOService] = []
        self.pool: cf.ThreadPoolExecutor | None = None
        self.round = 0
        self.uses_mmm = variant in MMM_VARIANTS
        if variant in ("mmm", "mmm (previous)"):
            root = os.path.join(workdir, "mmm")
            previous = variant == "mmm (previous)"
            for p, op in enumerate(ops):
                io = (IOService(n_workers, idle=False, write_threads=n_workers) if previous
                      else IOService(n_workers))
                policy = (CheckpointPolicy(keep=2, in_place=in_place, stage_mb=256.0)
                          if previous else CheckpointPolicy(keep=2, in_place=in_place))
                self.ios.append(io)
                self.mgrs.append(CheckpointManager(op.pm, "file://" + root, f"agg{p}",
                                                   policy=policy, io=io))
        if variant == "async pickle":  # its writer thread scheduled as mmm's I/O thread
            self.pool = cf.ThreadPoolExecutor(
                1, thread_name_prefix="pickle-writer",
                initializer=background_idle if IO_IDLE_DEFAULT else None)

    def process(self, parts: list[tuple[Any, Any]]) -> None:
        if self.uses_mmm:
            for op, (k, t) in zip(self.ops, parts):
                op.process(k, t)
        else:
            for d, (k, t) in zip(self.dicts, parts):
                dict_update(d, k, t)

    def _path(self, p: int) -> str:
        return os.path.join(self.workdir, f"{self.variant.replace(' ', '_')}-p{p}-{self.round}.pkl")

    def checkpoint(self, p: int) -> Any:
        """Start (or, if synchronous, do) the checkpoint of partition ``p``."""
        v = self.variant
        if self.mgrs:
            return self.mgrs[p].checkpoint()
        path = self._path(p)
        if v == "sync pickle":
            write_file(path, pickle.dumps(self.dicts[p], protocol=pickle.HIGHEST_PROTOCOL))
            return Done()
        if v == "async pickle":
            assert self.pool is not None
            data = pickle.dumps(self.dicts[p], protocol=pickle.HIGHEST_PROTOCOL)
            return self.pool.submit(write_file, path, data)
        raise ValueError(v)  # "fork" runs in a process of its own (`ForkBaseline`)

    def finish_round(self) -> None:
        """Delete the previous round's pickles (keep disk use bounded)."""
        if not self.uses_mmm and self.round:
            self.round -= 1
            for p in range(len(self.dicts)):
                if os.path.exists(self._path(p)):
                    os.unlink(self._path(p))
            self.round += 1
        self.round += 1

    def close(self) -> None:
        for m in self.mgrs:
            m.close()
        for io in self.ios:  # made here, so shut down here
            io.shutdown()
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def _record(out: dict[str, Any]) -> dict[str, Any]:
    """A run's summary: latency statistics, diagnostics, checkpoint events."""
    s = summarize(out["latency_s"])
    s.update(out["diag"])
    s["checkpoints"] = out["events"]
    s["max_pause_ms"] = max((e["pause_s"] * 1e3 for e in out["events"]), default=0.0)
    durs = [e["end_s"] - e["start_s"] for e in out["events"] if e["end_s"] is not None]
    s["checkpoint_s_mean"] = float(np.mean(durs)) if durs else 0.0
    s["checkpoint_s_max"] = float(np.max(durs)) if durs else 0.0
    return s


def _print_run(r: int, v: str, s: dict[str, Any], out: dict[str, Any]) -> None:
    print(f"  round {r} {v:<13} mean {s['mean_ms']:7.2f} ms  p99 "
          f"{s['p99_ms']:7.2f}  max {s['max_ms']:7.1f}  service "
          f"{s['service_mean_ms']:6.2f}/{s['service_p99_ms']:6.2f}/"
          f"{s['service_max_ms']:6.1f}  wake {s['wake_delay_mean_ms']:5.2f}/"
          f"{s['wake_delay_p99_ms']:6.2f}/{s['wake_delay_max_ms']:6.1f}  late "
          f"{s['late_batches']:4d}  load {s['loadavg_1min']:4.1f}  gc "
          f"{s['gc_ms']:5.1f} ms  ({len(out['events'])} chkpts, max pause "
          f"{s['max_pause_ms']:.1f} ms, checkpoint {s['checkpoint_s_mean']:.3f} s mean)",
          flush=True)
    if v.startswith("mmm"):
        print(f"      pages cloned by the operator {s.get('pages_cloned')}, values written "
              f"in place {s.get('values_written_in_place')}, staged "
              f"{s.get('pages_staged')}; slowest batches (latency/service/cpu/queued ms, "
              f"batches after a checkpoint start): " + ", ".join(
                  f"{b['latency_ms']:.1f}/{b['service_ms']:.1f}/{b['cpu_ms']:.1f}/"
                  f"{b['queued_ms']:.1f} @{b['batches_after_checkpoint']}"
                  for b in s["slowest"][:4]), flush=True)


# -- the phases of a run ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """The parsed arguments and the sizes and times ``--quick`` chooses."""
    args: argparse.Namespace
    n_rounds: int
    state_mb: int
    interval: float
    """Checkpoint interval, seconds."""
    first: float
    """First checkpoint after ... seconds."""
    duration: float
    period: float
    """One batch every ... seconds."""
    n_batches: int


def parse_plan(argv: Sequence[str] | None) -> Plan:
    """Parse the command line (module docstring) and fill in the defaults of a `Plan`."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--state-mb", type=int, default=None,
                    help="state size (default 128, --quick 32)")
    ap.add_argument("--batch", type=int, default=200, help="tuples per batch")
    ap.add_argument("--period-ms", type=float, default=10.0, help="one batch every ... ms")
    ap.add_argument("--interval-s", type=float, default=None,
                    help="checkpoint interval (default 10, --quick 2)")
    ap.add_argument("--first-s", type=float, default=None,
                    help="first checkpoint after ... s (default 5, --quick 0.5)")
    ap.add_argument("--duration-s", type=float, default=None,
                    help="length of each run (default 30, --quick 4)")
    ap.add_argument("--page-bytes", type=int, default=1 << 16)
    ap.add_argument("--workers", type=int, default=2,
                    help="mmm's `IOService(n_workers)` (default 2, as the Spark runtime's)")
    ap.add_argument("--partitions", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--no-in-place", action="store_true",
                    help="mmm without in-place writes (`CheckpointPolicy(in_place=False)`): "
                         "the operator clones every frozen page it writes")
    ap.add_argument("--priority", choices=("rt", "normal"), default="normal",
                    help="scheduling of the timed runs: rt = SCHED_FIFO for this process's "
                         "threads (children reset to normal) when permitted; opt-in")
    ap.add_argument("--rounds", type=int, default=None,
                    help="runs of every variant, interleaved (default 5, --quick 3)")
    args = parse_args(ap, argv)
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    duration = args.duration_s or (4.0 if args.quick else 30.0)
    period = args.period_ms / 1e3
    return Plan(args=args, n_rounds=args.rounds or (3 if args.quick else 5),
                state_mb=args.state_mb or (32 if args.quick else 128),
                interval=args.interval_s or (2.0 if args.quick else 10.0),
                first=args.first_s or (0.5 if args.quick else 5.0),
                duration=duration, period=period, n_batches=int(duration / period))


@dataclass
class State:
    """One partitioning's state, the same in both forms, and the input stream."""
    ops: list[Aggregate]
    dicts: list[dict[int, list[int]]]
    n_keys: int
    cols: Any
    """The stream as numpy batches (for the mmm variants)."""
    recs: Any
    """The same stream as lists (for the dict variants)."""
    mmm_bytes: int
    pickled_bytes: int


def build_state(plan: Plan, n_parts: int) -> State:
    """The Aggregate state in ``n_parts`` partitions, its dict twin and the input stream.

    Every variant processes the same keys from the same stream (seed 1); the
    objects are moved out of the collector's reach (``gc.freeze``) so no variant
    pays a full collection of millions of lists.
    """
    gc.collect()
    gc.disable()
    t = time.perf_counter()
    ops, n_keys = build_mmm(plan.state_mb * MB, n_parts, plan.args.page_bytes)
    dicts = [to_dict(op) for op in ops]
    gc.freeze()
    gc.enable()
    mmm_bytes = sum(op.pm.stats()["used_bytes"] for op in ops)
    pickled = sum(len(pickle.dumps(d, protocol=pickle.HIGHEST_PROTOCOL)) for d in dicts)
    cols, recs = make_stream(n_keys, plan.n_batches, plan.args.batch, n_parts, seed=1)
    print(f"{n_parts} partition(s): {n_keys:,} keys, mmm state {mmm_bytes / MB:.0f} MB, "
          f"pickled {pickled / MB:.0f} MB (built in {time.perf_counter() - t:.1f} s)")
    return State(ops, dicts, n_keys, cols, recs, mmm_bytes, pickled)


def run_fork(fork_base: ForkBaseline) -> tuple[dict[str, Any], dict[str, Any]]:
    """One timed run of the ``fork`` baseline in its own process: (record, raw output)."""
    out = fork_base.run()
    return _record(out), out


def run_variant(v: str, state: State, plan: Plan, workdir: str
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One timed run of variant ``v`` in this process: (record, raw output).

    The same stream, period and checkpoint schedule for every variant (``none``:
    no checkpoint); for ``mmm`` the record adds the pages the operator cloned and
    the pages staged in this run.
    """
    runner = Runner(v, state.ops, state.dicts, workdir, plan.args.workers,
                    in_place=not plan.args.no_in_place)
    st0 = [op.pm.stats() for op in state.ops]
    try:
        out = run(runner, state.cols if runner.uses_mmm else state.recs, plan.period,
                  plan.interval, plan.first, checkpoint=not v.startswith("none"))
    finally:
        runner.close()
    s = _record(out)
    if runner.mgrs:  # this run's: cloned by the operator, staged
        st = [op.pm.stats() for op in state.ops]
        s["values_written_in_place"] = int(sum(
            x["values_written_in_place"] - y["values_written_in_place"] for x, y in zip(st, st0)))
        s["pages_cloned"] = int(sum(x["pages_cloned"] - y["pages_cloned"]
                                    for x, y in zip(st, st0)))
        s["pages_staged"] = int(sum(m.counters["pages_staged"] for m in runner.mgrs))
    return s, out


def run_rounds(plan: Plan, n_parts: int, state: State, fork_base: ForkBaseline, workdir: str,
               curves: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Every variant ``plan.n_rounds`` times, interleaved: their records per variant.

    Each round runs every variant once, in a rotated order: the variants' runs sit
    next to each other in time, so a ratio within a round compares runs under the
    same machine load. ``curves`` keeps each variant's last latency curve.
    """
    rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for r in range(plan.n_rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for v in order:
            s, out = (run_fork(fork_base) if v == "fork"
                      else run_variant(v, state, plan, workdir))
            rounds[v].append(s)
            curves[f"{n_parts}:{v}"] = out["latency_s"]
            _print_run(r, v, s, out)
    return rounds


def variant_medians(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per variant: the median over rounds of every numeric field, and the rounds."""
    out: dict[str, Any] = {}
    for v in VARIANTS:
        med = {k: float(np.median([x[k] for x in rounds[v]]))
               for k, val in rounds[v][0].items()
               if isinstance(val, (int, float)) and not isinstance(val, bool)}
        out[v] = {**med, "rounds": rounds[v]}
    return out


def paired_ratios(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Ratios of a variant over its baseline *within* each round (runs moments apart)."""
    def paired(v: str, base: str, key: str) -> list[float]:
        return [a[key] / b[key] if b[key] else float("inf")
                for a, b in zip(rounds[v], rounds[base])]

    return {
        "mmm_mean_ratio": paired("mmm", "none (mmm)", "mean_ms"),
        "mmm_p99_ratio": paired("mmm", "none (mmm)", "p99_ms"),
        "mmm_previous_mean_ratio": paired("mmm (previous)", "none (mmm)", "mean_ms"),
        "mmm_previous_p99_ratio": paired("mmm (previous)", "none (mmm)", "p99_ms"),
        "checkpoint_s_over_previous_default": paired("mmm", "mmm (previous)",
                                                     "checkpoint_s_mean"),
        "mmm_service_mean_ratio": paired("mmm", "none (mmm)", "service_mean_ms"),
        "mmm_mean_over_dict_none": paired("mmm", "none (dict)", "mean_ms"),
        "mmm_none_mean_over_dict_none": paired("none (mmm)", "none (dict)", "mean_ms"),
        "spike_ratio_sync_pickle_over_mmm": paired("sync pickle", "mmm", "max_ms"),
        "spike_ratio_async_pickle_over_mmm": paired("async pickle", "mmm", "max_ms"),
        "spike_ratio_fork_over_mmm": paired("fork", "mmm", "max_ms"),
        # the operator thread's own longest batch (no wake-up delay, no queue)
        "service_spike_ratio_fork_over_mmm": paired("fork", "mmm", "service_max_ms"),
        "pause_ratio_fork_over_mmm": paired("fork", "mmm", "max_pause_ms")}


def measure_partitioning(plan: Plan, n_parts: int, workdir: str,
                         curves: dict[str, Any]) -> dict[str, Any]:
    """Build the state in ``n_parts`` partitions and run every variant on it, in rounds.

    The fork baseline runs in a fresh process holding only its dict state and
    input (`ForkBaseline`); the others here. Returns the partitioning's result:
    sizes, per-variant medians and rounds, and the paired ratios.
    """
    state = build_state(plan, n_parts)
    fork_base = ForkBaseline(state.n_keys, n_parts, plan.n_batches, plan.args.batch, 1,
                             plan.period, plan.interval, plan.first, workdir, plan.args.priority,
                             idle=IO_IDLE_DEFAULT)
    res: dict[str, Any] = {"n_keys": state.n_keys, "mmm_state_bytes": state.mmm_bytes,
                           "pickled_bytes": state.pickled_bytes, "variants": {},
                           "fork_process_rss_mb": fork_base.info["rss_mb"],
                           "main_process_rss_mb": rss_mb()}
    prio = set_priority(plan.args.priority)  # threads started from now on inherit it
    rounds = run_rounds(plan, n_parts, state, fork_base, workdir, curves)
    fork_base.close()
    set_priority("normal")
    res["priority"] = prio
    res["variants"] = variant_medians(rounds)
    res["paired"] = paired_ratios(rounds)
    for k, v in res["paired"].items():
        print(f"  {k}: median {np.median(v):.2f}  rounds {[round(x, 2) for x in v]}")
    gc.unfreeze()
    del state
    gc.collect()
    return res


def summarize_partitioning(res: dict[str, Any], tag: str) -> dict[str, Any]:
    """The summary fields of one partitioning (``tag`` ``1p`` or ``4p``).

    Each ratio is the median over rounds of the ratio paired within a round.
    """
    def ratio(key: str) -> float:
        return float(np.median(res["paired"][key]))

    summary: dict[str, Any] = {}
    summary[f"mmm_mean_ratio_{tag}"] = ratio("mmm_mean_ratio")
    summary[f"mmm_p99_ratio_{tag}"] = ratio("mmm_p99_ratio")
    # the trade's other side: a checkpoint's own duration, and the previous defaults' figures
    summary["checkpoint_s_over_previous_default" + ("" if tag == "1p" else "_4p")] = \
        ratio("checkpoint_s_over_previous_default")
    summary[f"checkpoint_s_mean_{tag}"] = {
        v: res["variants"][v]["checkpoint_s_mean"] for v in ("mmm", "mmm (previous)")}
    summary[f"mmm_previous_mean_ratio_{tag}"] = ratio("mmm_previous_mean_ratio")
    summary[f"mmm_previous_p99_ratio_{tag}"] = ratio("mmm_previous_p99_ratio")
    # mmm *with* checkpoints against the dict operator *without* any
    summary[f"mmm_mean_over_dict_none_{tag}"] = ratio("mmm_mean_over_dict_none")
    summary[f"mmm_none_mean_over_dict_none_{tag}"] = ratio("mmm_none_mean_over_dict_none")
    summary[f"mmm_service_mean_ratio_{tag}"] = ratio("mmm_service_mean_ratio")
    for short in ("sync_pickle", "async_pickle", "fork"):
        summary[f"spike_ratio_{short}_over_mmm" + ("" if tag == "1p" else "_4p")] = \
            ratio(f"spike_ratio_{short}_over_mmm")
    # the operator thread's own pause per checkpoint (freeze for mmm, fork() for fork):
    # latency maxima on a loaded machine are set by scheduling, pauses by the method
    summary[f"pause_ratio_fork_over_mmm_{tag}"] = ratio("pause_ratio_fork_over_mmm")
    summary[f"service_spike_ratio_fork_over_mmm_{tag}"] = ratio(
        "service_spike_ratio_fork_over_mmm")
    var = res["variants"]
    summary[f"mean_ms_{tag}"] = {v: var[v]["mean_ms"] for v in VARIANTS}
    summary[f"wake_delay_mean_ms_{tag}"] = {v: var[v]["wake_delay_mean_ms"] for v in VARIANTS}
    summary[f"service_mean_ms_{tag}"] = {v: var[v]["service_mean_ms"] for v in VARIANTS}
    # across the runs of the variants without pauses in the operator thread: how
    # much of the spread of the mean latency the wake-up delay explains (Pearson r;
    # near 1: the machine's scheduling, not the variant)
    runs = [x for v in ("none (mmm)", "none (dict)", "mmm", "mmm (previous)")
            for x in var[v]["rounds"]]
    lat_m = np.array([x["mean_ms"] for x in runs])
    wake_m = np.array([x["wake_delay_mean_ms"] for x in runs])
    summary[f"spread_r_mean_vs_wake_{tag}"] = (
        float(np.corrcoef(lat_m, wake_m)[0, 1])
        if len(runs) > 2 and lat_m.std() > 0 and wake_m.std() > 0 else None)
    return summary


def summarize_all(plan: Plan, results: dict[str, Any], load_before: float) -> dict[str, Any]:
    """The summary: each partitioning's ratios, then the run's conditions and targets."""
    summary: dict[str, Any] = {}
    for parts, tag in (("1", "1p"), ("4", "4p")):
        if parts in results:
            summary.update(summarize_partitioning(results[parts], tag))
    summary["rounds"] = plan.n_rounds
    summary["priority"] = {parts: results[parts]["priority"] for parts in results}
    summary["loadavg_1min_before_after"] = [load_before, os.getloadavg()[0]]
    summary["cpus"] = os.cpu_count()
    summary["targets"] = {"mmm_mean_ratio_1p": "<= 1.1", "mmm_p99_ratio_1p": "<= 1.5",
                          "mmm_p99_ratio_4p": "<= 1.5",
                          "checkpoint_s_over_previous_default": "<= 1.5",
                          "spike_ratio_sync_pickle_over_mmm": ">= 10",
                          "spike_ratio_fork_over_mmm": ">= 5",
                          "mmm_mean_over_dict_none_1p": "<= 1"}
    summary["state_mb"] = plan.state_mb
    return summary


def _write_threads(n_workers: int) -> int:
    """The checkpoint writers `IOService(n_workers)` runs at once by default."""
    io = IOService(n_workers)
    io.shutdown()
    return io.write_threads


def run_params(plan: Plan) -> dict[str, Any]:
    """The ``params`` of the result: what was run and how the ratios are formed."""
    args = plan.args
    return {"quick": args.quick, "state_mb": plan.state_mb, "batch_tuples": args.batch,
            "period_ms": args.period_ms, "tuples_per_s": args.batch / plan.period,
            "interval_s": plan.interval, "first_checkpoint_s": plan.first,
            "duration_s": plan.duration, "page_bytes": args.page_bytes,
            "mmm_io_workers": args.workers,
            "mmm_stage_mb": CheckpointPolicy().stage_mb,
            "mmm_io_idle": IO_IDLE_DEFAULT,
            "mmm_io_write_threads": _write_threads(args.workers),
            "mmm_previous": "IOService(workers, idle=False, write_threads=workers), "
                            "CheckpointPolicy(stage_mb=256)",
            "mmm_in_place": not args.no_in_place,
            "partitions": args.partitions, "rounds": plan.n_rounds,
            "ratios": "median over rounds of the ratio within each round",
            "storage": "file:// (temporary dir, fsync)",
            "partition_checkpoints": "in turn (next partition once the previous is done)"}


def plot_curves(plan: Plan, curves: dict[str, Any], json_path: Path) -> int:
    """``<out>/chkpt_latency.png``: the last round's latency curves, one panel a partitioning."""
    plt, png = figure("chkpt_latency")
    nrow = len(plan.args.partitions)
    fig, axes = plt.subplots(nrow, 1, figsize=(9, 3.6 * nrow), squeeze=False)
    for ax, n_parts in zip(axes[:, 0], plan.args.partitions):
        for v in VARIANTS:
            y = curves[f"{n_parts}:{v}"] * 1e3
            ax.plot(np.arange(len(y)) * plan.period, y, lw=0.8, label=v)
        ax.set_yscale("log")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("batch latency (ms)")
        ax.set_title(f"{plan.state_mb} MB Aggregate in {n_parts} partition(s), checkpoint every "
                     f"{plan.interval:g} s, {plan.args.batch / plan.period:,.0f} tuples/s")
        ax.legend(fontsize=7, ncol=3)
    return save_figure(fig, png, json_path)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse; per partitioning, build the state and run every variant in rounds; summarize
    the paired ratios; write the JSON and the PNG. Returns 0."""
    plan = parse_plan(argv)
    load_before = os.getloadavg()[0]
    workdir = tempfile.mkdtemp(prefix="sguard-chkpt-latency-")
    results: dict[str, Any] = {}
    curves: dict[str, Any] = {}
    try:
        for n_parts in plan.args.partitions:
            results[str(n_parts)] = measure_partitioning(plan, n_parts, workdir, curves)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize_all(plan, results, load_before)
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in summary.items()})
    path = write_result("chkpt_latency", summary, {"results": results}, run_params(plan))
    return plot_curves(plan, curves, path)


if __name__ == "__main__":
    raise SystemExit(main())
