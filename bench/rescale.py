"""Repartitioning and parallel recovery of aggregate state (issue 12).

Builds the running aggregate's state (an mmm `HashMap`, int64 key ->
count/first_ts/last_ts, as `sguard.operators.Aggregate`) of ``--state-mb``
MB in 2 partitions under a ``file://`` state URI, checkpointed as the Spark
runtime would (`sguard.statelayout`), then, in the same run:

* **copy** (the baseline): the source partitions' checkpoint files copied by
  one thread per partition, the way a repartition must at least handle the
  bytes: read into a user-space buffer, written, fsynced (checkpoints are
  durable); page cache warm as for the repartition, which reads the same files
  just after. The kernel's own copy (``shutil.copyfile``: ``sendfile``, no
  fsync) is measured too, for reference (``kernel_copy_gb_s``,
  ``repartition_ratio_vs_kernel_copy``);
* **repartition 2 -> 4 and 4 -> 2** (`sguard.rescale.repartition` with its
  default executor: one thread per independent group, the compiled kernels
  releasing the GIL): GB/s of source state, and the ratio to the copy's GB/s
  measured right before it (``repartition_ratio_vs_copy``, the median over
  repeats and directions), with the workers' seconds per pass (read +
  checksum, extract, route, build, write: ``repartition_phase_share``). 2 -> 4
  is also run with worker processes and in one thread, for comparison;
* **restart downtime** (`bench._spark_restart`): a real Spark streaming query
  with ``--state-mb`` of state (at most 32 with ``--quick``) stopped and
  restarted with 4 partitions instead of 2, from ``stop()`` to the first batch
  committed after the restart, with the start-up repartition's share, against
  the same restart without a partition change;
* **parallel recovery** of one partition holding the whole state (the 4 -> 2
  output merged to 1): restored *as 1* (`ioservice.restore`) by one process,
  or *as 4 pieces* by 4 processes (`sguard.rescale.restore_piece`, each
  reading and checksumming the whole checkpoint, keeping a quarter of the
  keys and bulk-building its map; their passes summed in ``pieces_*_s``),
  each followed by the replay of ``--replay-rows`` logged rows (as 4: each
  piece replays its own keys' rows). Processes are started and their imports
  and kernels warmed before timing; all start at a barrier.

Run: ``python -m bench.rescale [--quick] [--out DIR]``; writes
``DIR/rescale.json`` (``summary``: ``repartition_ratio_vs_copy``,
``restart_downtime_s``, ``recovery_speedup_4_over_1``) and ``DIR/rescale.png``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench import _harness

MB = 1 << 20
PAGE = 1 << 16
AGG = {"count": "count", "first_ts": ("min", "ts"), "last_ts": ("max", "ts")}
PHASES = ("read_s", "extract_s", "route_s", "build_s", "write_s")
"""Worker seconds per pass of a repartition (`sguard.rescale.RescaleResult.phases_s`)."""


def build(uri: str, state_bytes: int, partitions: int) -> dict[str, Any]:
    """An aggregate state of about `state_bytes` in `partitions` partitions, checkpointed.

    Every key is seen once (count 1, first_ts = last_ts = its ts), the state an
    ``upsert`` of one row per key leaves; it is built with
    `mmm.HashMap.load_distinct` (the same pages, minutes faster at 1 GB).
    """
    from ioservice import CheckpointManager, open_root
    from mmm import HashMap, PageManager
    from sguard.operators import AGG_VALUE
    from sguard.partitioning import partition_of
    from sguard.statelayout import OperatorLayout, write_layout

    root = open_root(uri)
    layout = OperatorLayout(operator="running_aggregate", name="agg", schema={"key": "<i8"},
                            num_partitions=partitions, key="k")
    write_layout(root, layout)
    # about 1 / 0.6 load * 0.85 fill ... measured: ~57 B of pages per key at 64 KiB pages
    n = int(state_bytes / 57)
    rng = np.random.default_rng(0)
    keys = rng.permutation(np.arange(n, dtype=np.int64) * 7919 + 13)
    part = partition_of(keys, partitions)
    total = 0
    for p in range(partitions):
        k = keys[part == p]
        pm = PageManager(PAGE, capacity_bytes=4 * state_bytes // partitions + 64 * MB)
        m = HashMap.create(pm, "agg", key="<i8", value=AGG_VALUE)
        v = np.zeros(len(k), AGG_VALUE)
        v["count"], v["first_ts"], v["last_ts"] = 1, k, k
        m.load_distinct(k, v)
        with CheckpointManager(pm, root, layout.haunit(p)) as mgr:
            pending = mgr.checkpoint({"operator": layout.operator, "name": layout.name,
                                  "generation": 0, "partition": p,
                                  "num_partitions": partitions, "batch_id": 9})
            assert pending is not None
            man = pending.result()
        total += man.state_bytes
        del pm, m
    return {"keys": n, "state_bytes": total}


def _generation_dirs(uri: str, generation: int) -> list[Path]:
    return sorted(p for p in Path(uri, "checkpoint").iterdir() if f".g{generation}.p" in p.name)


def copy_files(uri: str, generation: int, dest: str, *, kernel: bool = False
               ) -> tuple[float, int]:
    """Copy a generation's checkpoint files, one thread per partition: (seconds, bytes).

    The fair baseline (default) does what a repartition must at least do with
    the bytes: read each file into a user-space buffer, write it out and make
    it durable (fsync the file and its directory, as checkpoints are).
    ``kernel=True`` is the cheapest copy there is, for reference:
    ``shutil.copyfile`` (``sendfile`` inside the kernel), no fsync.
    """
    dirs = _generation_dirs(uri, generation)
    shutil.rmtree(dest, ignore_errors=True)

    def one(d: Path) -> int:
        out = Path(dest, d.name)
        out.mkdir(parents=True)
        n = 0
        buf = bytearray(4 * MB)
        view = memoryview(buf)
        for f in d.iterdir():
            if kernel:
                shutil.copyfile(f, out / f.name)
                n += f.stat().st_size
                continue
            with open(f, "rb", buffering=0) as src, open(out / f.name, "wb", buffering=0) as dst:
                while (got := src.readinto(buf)):
                    dst.write(view[:got])
                    n += got
                os.fsync(dst.fileno())
        if not kernel:
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


def drop_generation(uri: str, generation: int) -> None:
    for d in _generation_dirs(uri, generation):
        shutil.rmtree(d)


def restore_time(uri: str, haunit: str) -> float:
    from ioservice import open_root, restore
    from mmm import HashMap, PageManager
    from sguard.operators import AGG_VALUE
    pm = PageManager(PAGE, 4 << 30)
    t = time.perf_counter()
    restore(pm, open_root(uri), haunit)
    len(HashMap.create(pm, "agg", key="<i8", value=AGG_VALUE))
    return time.perf_counter() - t


# -- parallel recovery workers ---------------------------------------------------------------------
def _warm(_: int) -> int:
    """Imports and numba kernels (restore, route, bulk build, upsert) loaded before timing."""
    from mmm import HashMap, PageManager
    from sguard.operators import AGG_VALUE
    from sguard.partitioning import partition_of
    from sguard.rescale import _route
    k = np.arange(100, dtype=np.int64)
    partition_of(k, 2)
    _route(np.arange(10, dtype=np.int32), 2, np.array([0, -1]), 1)
    pm = PageManager(PAGE, 8 * MB)
    v = np.zeros(100, AGG_VALUE)
    m = HashMap.create(pm, "w", key="<i8", value=AGG_VALUE)
    m.load_distinct(k, v)
    m.items()
    m.upsert(k, {"ts": k}, AGG)
    return os.getpid()


def _replay_log(rows: int, n_keys: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(0, rows, 100_000):
        k = rng.integers(0, n_keys, min(100_000, rows - i)).astype(np.int64) * 7919 + 13
        out.append((k, rng.integers(0, 10**9, len(k))))
    return out


def _recover(args: tuple[str, int, int, int, int, Any]
             ) -> tuple[float, float, float, dict[str, float]]:
    """One recovery worker: (start, restored, end) wall-clock times, seconds per pass."""
    uri, pieces, piece, rows, n_keys, barrier = args
    from ioservice import open_root, restore
    from mmm import HashMap, PageManager
    from sguard.operators import AGG_VALUE
    from sguard.partitioning import partition_of
    from sguard.rescale import restore_piece
    from sguard.statelayout import read_layout
    log = _replay_log(rows, n_keys)
    root = open_root(uri)
    layout = read_layout(root)
    assert layout is not None
    pm = PageManager(PAGE, 4 << 30)
    barrier.wait()
    t0 = time.time()
    phases: dict[str, float] = {}
    if pieces == 1:
        man = restore(pm, root, layout.haunit(0))
        meta = man.user_meta
    else:
        restore_piece(root, 0, pieces, piece, pm, phases=phases)
    m = HashMap.create(pm, "agg", key="<i8", value=AGG_VALUE)
    len(m)
    t1 = time.time()
    for k, ts in log:
        if pieces > 1:
            sel = partition_of(k, pieces) == piece
            k, ts = k[sel], ts[sel]
        m.upsert(k, {"ts": ts}, AGG)
    return t0, t1, time.time(), phases


def recovery(uri: str, pieces: int, rows: int, n_keys: int, pool: ProcessPoolExecutor,
             manager: Any) -> dict[str, float]:
    barrier = manager.Barrier(pieces)
    res = list(pool.map(_recover, [(uri, pieces, j, rows, n_keys, barrier)
                                   for j in range(pieces)]))
    start = min(r[0] for r in res)
    out = {"restore_s": max(r[1] for r in res) - start, "total_s": max(r[2] for r in res) - start}
    for k in PHASES[:4]:  # summed over the pieces
        out[f"pieces_{k}"] = sum(r[3].get(k, 0.0) for r in res)
    return out


# -- main ------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rescale", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small state, one repeat (CI)")
    ap.add_argument("--state-mb", type=int, default=None, help="state size (default 1024; quick 128)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats (default 3; quick 1)")
    ap.add_argument("--replay-rows", type=int, default=None,
                    help="rows replayed after a recovery (default 4M; quick 1M)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = _harness.parse_args(ap, argv)  # adds --out (default bench/out)
    state_mb = args.state_mb or (128 if args.quick else 1024)
    repeats = args.repeats or (1 if args.quick else 3)
    replay_rows = args.replay_rows if args.replay_rows is not None else \
        (1_000_000 if args.quick else 4_000_000)
    from sguard.rescale import repartition

    _warm(0)  # numba kernels loaded from their cache before anything is timed
    scratch = tempfile.mkdtemp(prefix="bench-rescale-", dir=args.dir)
    uri = os.path.join(scratch, "state")
    data: dict[str, Any] = {"runs": []}
    try:
        t = time.perf_counter()
        info = build(uri, state_mb * MB, 2)
        data["build"] = dict(info, seconds=time.perf_counter() - t)
        print(f"built {info['state_bytes'] / MB:.0f} MB of state ({info['keys']} keys) "
              f"in {data['build']['seconds']:.1f} s", flush=True)
        gen = 0
        ratios: list[float] = []
        kratios: list[float] = []
        warm = 0 if args.quick else 1
        # thread: the default executor (one thread per independent group); process: worker
        # processes (started per call); inline: everything in one thread
        steps = [(4, "thread"), (2, "thread"), (4, "process"), (2, "thread"), (4, "inline"),
                 (2, "thread")]
        for r in range(repeats + warm):  # the first round is a warm-up (not with --quick)
            for P2, mode in steps:
                kcopy_s, _ = copy_files(uri, gen, os.path.join(scratch, "copy"), kernel=True)
                copy_s, nbytes = copy_files(uri, gen, os.path.join(scratch, "copy"))
                res = repartition(uri, P2, executor="thread" if mode == "thread" else "process",
                                  workers=1 if mode == "inline" else 2)
                gen = res.generation
                row: dict[str, Any] = {"round": r, "from": res.from_partitions, "to": P2, "mode": mode,
                       "copy_s": copy_s, "copy_gb_s": nbytes / copy_s / 1e9,
                       "kernel_copy_s": kcopy_s, "kernel_copy_gb_s": nbytes / kcopy_s / 1e9,
                       "repartition_s": res.seconds,
                       "repartition_gb_s": res.bytes_read / res.seconds / 1e9,
                       "bytes": res.bytes_read, "phases_s": res.phases_s}
                row["ratio_vs_copy"] = row["repartition_gb_s"] / row["copy_gb_s"]
                row["ratio_vs_kernel_copy"] = row["repartition_gb_s"] / row["kernel_copy_gb_s"]
                if P2 == 4 and mode == "process":
                    rest = [restore_time(uri, h) for h in res.haunits]
                    row["restore_s_max"] = max(rest)
                if r >= warm:
                    data["runs"].append(row)
                    if mode == "thread":
                        ratios.append(row["ratio_vs_copy"])
                        kratios.append(row["ratio_vs_kernel_copy"])
                ph = res.phases_s
                print(f"round {r} {res.from_partitions}->{P2} {mode:7s}: "
                      f"{res.seconds:6.2f} s ({row['repartition_gb_s']:.2f} GB/s), copy "
                      f"{copy_s:5.2f} s ({row['copy_gb_s']:.2f} GB/s; kernel copy "
                      f"{row['kernel_copy_gb_s']:.2f} GB/s), ratio "
                      f"{row['ratio_vs_copy']:.2f} [" + " ".join(
                          f"{k[:-2]} {ph.get(k, 0.0):.2f}" for k in PHASES) + "]", flush=True)
                drop_generation(uri, gen - 1)
        res = repartition(uri, 1)
        drop_generation(uri, res.generation - 1)
        rec: dict[str, list[dict[str, float]]] = {}
        ctx = mp.get_context("forkserver")
        with ctx.Manager() as manager, ProcessPoolExecutor(4, mp_context=ctx) as pool:
            list(pool.map(_warm, range(8)))
            for rnd in range(repeats + warm):
                for replay in (0, replay_rows):
                    for k in (1, 4):
                        out = recovery(uri, k, replay, info["keys"], pool, manager)
                        print(f"round {rnd} recovery as {k} (replay {replay} rows): restore "
                              f"{out['restore_s']:.2f} s, total {out['total_s']:.2f} s",
                              flush=True)
                        if rnd >= warm:
                            rec.setdefault(f"as{k}_replay{replay}", []).append(out)
        data["recovery"] = rec
        from bench import _spark_restart  # a real Spark query restarted with 4 partitions
        data["spark_restart"] = _spark_restart.run(min(state_mb, 32) if args.quick else state_mb,
                                                   scratch, cycles=1 if args.quick else 2)

        def med(key: str, field: str) -> float:
            return float(np.median([x[field] for x in rec[key]]))

        speed = med(f"as1_replay{replay_rows}", "total_s") / med(f"as4_replay{replay_rows}",
                                                                  "total_s")
        speed0 = med("as1_replay0", "total_s") / med("as4_replay0", "total_s")
        by_mode = {m: float(np.median([x["repartition_s"] for x in data["runs"]
                                       if x["mode"] == m and x["to"] == 4]))
                   for m in ("process", "thread", "inline")}
        default_runs = [x for x in data["runs"] if x["mode"] == "thread"]
        summary = {
            "repartition_ratio_vs_copy": float(np.median(ratios)),
            "repartition_ratio_vs_copy_min_max": [float(min(ratios)), float(max(ratios))],
            "repartition_ratio_vs_kernel_copy": float(np.median(kratios)),
            "repartition_gb_s": float(np.median([x["repartition_gb_s"] for x in default_runs])),
            "copy_gb_s": float(np.median([x["copy_gb_s"] for x in default_runs])),
            "kernel_copy_gb_s": float(np.median([x["kernel_copy_gb_s"]
                                                 for x in default_runs])),
            "repartition_phase_share": {
                d: _shares([x for x in default_runs if f"{x['from']}->{x['to']}" == d])
                for d in sorted({f"{x['from']}->{x['to']}" for x in default_runs})},
            **_spark_restart.summarize(data["spark_restart"]),
            "recovery_speedup_4_over_1": speed,
            "recovery_speedup_4_over_1_restore_only": speed0,
            "replay_rows": replay_rows,
            "repartition_2to4_s_by_executor": by_mode,
            "state_mb": data["build"]["state_bytes"] / MB,
            "targets": {"repartition_ratio_vs_copy": ">= 0.5",
                        "recovery_speedup_4_over_1": ">= 2 (or the measured reason)"},
            "notes": "restart_downtime_s: a Spark query (local[2]) stopped and restarted with "
                     "4 partitions instead of 2, from stop() to the first batch committed; "
                     "restart_repartition_s is its start-up repartition; "
                     "restart_downtime_same_p_s the same restart at 2 partitions.",
        }
        data["env"] = _env()
        _harness.write_result("rescale", summary, data,
                              {"state_mb": state_mb, "repeats": repeats, "page_bytes": PAGE,
                               "replay_rows": replay_rows, "quick": args.quick})
        _plot(data, summary)
        print(json.dumps(summary, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _shares(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median share of each pass in the workers' summed seconds."""
    out = {}
    for k in PHASES:
        out[k[:-2]] = float(np.median([r["phases_s"].get(k, 0.0)
                                       / max(sum(r["phases_s"].get(j, 0.0) for j in PHASES),
                                             1e-9) for r in runs]))
    return out


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
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels, vals = ["copy"], [float(np.median([r["copy_gb_s"] for r in data["runs"]]))]
    for (f, t, m) in sorted({(r["from"], r["to"], r["mode"]) for r in data["runs"]}):
        labels.append(f"{f}->{t} {m}")
        vals.append(float(np.median([r["repartition_gb_s"] for r in data["runs"]
                                     if (r["from"], r["to"], r["mode"]) == (f, t, m)])))
    a.bar(labels, vals)
    a.set_ylabel("GB/s of state")
    a.set_title(f"repartition vs copy (ratio {summary['repartition_ratio_vs_copy']:.2f})")
    a.tick_params(axis="x", rotation=30)
    rec = data["recovery"]
    keys = sorted(rec)
    b.bar(keys, [float(np.median([x["total_s"] for x in rec[k]])) for k in keys])
    b.set_ylabel("seconds")
    b.set_title(f"recovery as 1 vs 4 (speedup {summary['recovery_speedup_4_over_1']:.2f})")
    b.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
