"""Paper Figure 9: page-table rebuild and whole recovery time, 64-512 MB, 8 KB and 64 KB pages.

For each page size and state size the Aggregate's state (an mmm `HashMap`,
keys ``0..n-1``) is checkpointed once to ``file://`` (a temporary directory)
with ``--workers`` I/O workers. Then, repeat by repeat (after one untimed
warm-up round), with the page cache of the page files dropped before every
read (``posix_fadvise(DONTNEED)``):

* **read**: the same number of threads read the page files, one file each, in
  4 MiB ``readinto`` calls: the time to just read the bytes;
* **recovery**: `ioservice.recovery.restore` (list, manifest, parallel reads
  straight into frames, on local files ``pread`` and the checksum and PageID
  checks of each 256 KiB piece in one compiled call, the piece checked while it
  is still in the cache; `mmm.Loader.finish`)
  plus reopening the operator (``Aggregate(pm)``), whose `HashMap` rebuilds its
  in-memory index on first access;
* **rebuild** (the part Figure 9 plots): the same load done pass by pass,
  timing only `mmm.Loader.finish` (page tables and catalog from the page
  headers) plus the structure's lazy index rebuild. The pass-by-pass load also
  gives the per-pass profile (``passes``): manifest, ``begin_load``, the
  parallel read with verification, page tables, structure rebuild; the same
  read without verification (what checking every page adds to the wall time)
  and the checksums' CPU time alone (one thread).

Two memory settings: *warm* recovers into a page manager reused across
repeats and reads into a reused, already touched buffer of the state's size
(so both sides write the same bytes to the same kind of memory); *cold*
recovers into a fresh page manager and reads into a fresh buffer of the
state's size, as a restarting process must (both then fault their memory in).
Each recovery runs right next to its read (the order alternates between
repeats) and a ratio is the median over repeats of these paired ratios: on a
shared machine the load drifts between repeats, and a ratio of two medians
taken at different moments would mostly measure that drift (both are
reported, with the load average before and after). The summary's
``recovery_over_read_512mb`` is the warm ratio at the worse page size,
``recovery_over_read_512mb_cold`` the cold one. The same pairs are also compared
in CPU time (``time.process_time``: every thread of the process, kernel time
included), ``recovery_over_read_cpu_512mb`` and ``..._cold``: on a loaded
machine, where every CPU-second waits for a core, the wall ratio tends to it.

Run: ``python -m bench.recovery [--quick] [--priority normal|rt] [--out DIR]``.
Writes ``DIR/recovery.json`` (default ``bench/out``; summary: ``rebuild_ms_512mb``
— the slower page size —, ``recovery_over_read_512mb`` and ``..._cold``, the
per-pass profile ``passes_ms_512mb_<page size>``, load average) and
``DIR/recovery.png``.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import mmm
from bench._harness import figure, parse_args, save_figure, stats, write_result
from bench.chkpt_latency import set_priority
from bench.io_throughput import _evict
from ioservice import CheckpointManager, IOService, StorageRoot, open_root
from ioservice.format import page_checksums
from ioservice.recovery import read_manifest, restore
from ioservice.service import DEFAULT_CHUNK_BYTES
from sguard.operators import Aggregate

MB = 1 << 20


def build(target_bytes: int, page_bytes: int) -> tuple[mmm.PageManager, int]:
    """An Aggregate over keys 0..n-1 with at least ``target_bytes`` of pages."""
    pm = mmm.PageManager(page_bytes=page_bytes, capacity_bytes=2 * target_bytes + (64 << 20))
    op = Aggregate(pm)
    n, step = 0, 1 << 20
    while pm.stats()["used_bytes"] < target_bytes:
        step = min(step, max(1 << 16, (target_bytes - pm.stats()["used_bytes"]) // 24))
        k = np.arange(n, n + step, dtype=np.uint32)
        op.process(k, k.astype(np.int64))
        n += step
    return pm, n


def read_fresh(root: StorageRoot, relpaths: list[str], sizes: list[int],
               pool: cf.ThreadPoolExecutor, chunk_bytes: int,
               dest: np.ndarray | None = None) -> int:
    """Read every file into its slice of one buffer of the state's size (a fresh one
    unless ``dest`` is given): the bytes end up in memory, as recovery's do."""
    if dest is None:
        dest = np.empty(sum(sizes), dtype=np.uint8)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()

    def one(i: int) -> int:
        f = root.open_input_file(relpaths[i])
        n = 0
        try:
            mv = memoryview(dest[starts[i]:starts[i] + sizes[i]])  # type: ignore[arg-type]
            while n < sizes[i]:
                got = f.readinto(mv[n:n + chunk_bytes])
                if not got:
                    break
                n += got
        finally:
            f.close()
        return n

    return sum(pool.map(one, range(len(relpaths))))


def reopen(pm: mmm.PageManager, n_keys: int) -> float:
    """Reopen the Aggregate (its index rebuilds on first access); check it; seconds."""
    t0 = time.perf_counter()
    op = Aggregate(pm)
    n = len(op.state)
    dt = time.perf_counter() - t0
    assert n == n_keys, (n, n_keys)
    return dt


def restore_warm(pm: mmm.PageManager, root: StorageRoot, haunit: str, n_keys: int,
                 io: IOService) -> float:
    """`restore` into ``pm`` plus reopening the operator; seconds."""
    t0 = time.perf_counter()
    restore(pm, root, haunit, io=io)
    reopen(pm, n_keys)
    return time.perf_counter() - t0


def profile_passes(pm: mmm.PageManager, root: StorageRoot, haunit: str, man_name: str,
                   files: list[str], n_keys: int, io: IOService) -> dict[str, float]:
    """One recovery done pass by pass (seconds each): manifest, begin_load, the
    parallel read with verification, `Loader.finish` (page tables), reopening the
    operator (structure rebuild); plus the read without verification (what
    verifying adds to the wall time) and the checksums' CPU time alone (one
    thread, over the loaded frames)."""
    out: dict[str, float] = {}
    _evict(root, files)
    t = time.perf_counter()
    man = read_manifest(root, man_name)
    out["manifest"] = time.perf_counter() - t
    t = time.perf_counter()
    loader = pm.begin_load()
    out["begin_load"] = time.perf_counter() - t
    t = time.perf_counter()
    io.read_pages(root, man, loader.add, verify=True)
    out["read_verify"] = time.perf_counter() - t
    t = time.perf_counter()
    loader.finish()
    out["page_tables"] = time.perf_counter() - t
    out["structure_rebuild"] = reopen(pm, n_keys)
    frames = pm.pool.frames[:man.n_pages]
    t = time.perf_counter()
    page_checksums(frames)
    out["checksum_cpu_1thread"] = time.perf_counter() - t
    _evict(root, files)
    loader = pm.begin_load()
    t = time.perf_counter()
    io.read_pages(root, man, loader.add, verify=False)
    out["read_noverify"] = time.perf_counter() - t
    loader.finish()
    reopen(pm, n_keys)
    return out


def measure(root: StorageRoot, haunit: str, man_name: str, files: list[str], sizes: list[int],
            n_keys: int, page_bytes: int, state_bytes: int, workers: int,
            repeats: int) -> dict[str, Any]:
    """Repeat by repeat, each recovery next to its read baseline (the order of the
    two alternates between repeats), so a ratio pairs two measurements taken
    moments apart: on a shared machine the load drifts between repeats."""
    cap = state_bytes + (64 << 20)
    warm_pm = mmm.PageManager(page_bytes=page_bytes, capacity_bytes=cap)
    warm_dest = np.ones(sum(sizes), dtype=np.uint8)  # reused, already touched
    t: dict[str, list[float]] = {k: [] for k in (
        "read_warm", "recovery_warm", "read_cold", "recovery_cold", "finish", "index",
        "rebuild", "ratio_warm", "ratio_cold", "read_warm_cpu", "recovery_warm_cpu",
        "read_cold_cpu", "recovery_cold_cpu", "cpu_ratio_warm", "cpu_ratio_cold")}
    passes: dict[str, list[float]] = {}
    with IOService(workers) as io, cf.ThreadPoolExecutor(workers) as pool:
        for rep in range(repeats + 1):
            timed = rep > 0
            gc.collect()

            # each returns (wall seconds, CPU seconds of this whole process: every thread)
            def read_w() -> tuple[float, float]:
                _evict(root, files)
                c0, t0 = time.process_time(), time.perf_counter()
                nread = read_fresh(root, files, sizes, pool, DEFAULT_CHUNK_BYTES, warm_dest)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                assert nread == sum(sizes)
                return dt, dc

            def rec_w() -> tuple[float, float]:
                _evict(root, files)
                c0 = time.process_time()
                dt = restore_warm(warm_pm, root, haunit, n_keys, io)
                return dt, time.process_time() - c0

            def read_c() -> tuple[float, float]:
                _evict(root, files)
                gc.collect()
                c0, t0 = time.process_time(), time.perf_counter()
                nread = read_fresh(root, files, sizes, pool, DEFAULT_CHUNK_BYTES)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                assert nread == sum(sizes)
                return dt, dc

            def rec_c() -> tuple[float, float]:
                _evict(root, files)
                gc.collect()
                cold_pm = mmm.PageManager(page_bytes=page_bytes, capacity_bytes=cap)
                c0 = time.process_time()
                dt = restore_warm(cold_pm, root, haunit, n_keys, io)
                dc = time.process_time() - c0
                del cold_pm
                return dt, dc

            if rep % 2:
                rec_warm, read_warm = rec_w(), read_w()
                rec_cold, read_cold = rec_c(), read_c()
            else:
                read_warm, rec_warm = read_w(), rec_w()
                read_cold, rec_cold = read_c(), rec_c()
            prof = profile_passes(warm_pm, root, haunit, man_name, files, n_keys, io)
            if timed:
                for k, v in (("read_warm", read_warm[0]), ("recovery_warm", rec_warm[0]),
                             ("read_cold", read_cold[0]), ("recovery_cold", rec_cold[0]),
                             ("read_warm_cpu", read_warm[1]), ("recovery_warm_cpu", rec_warm[1]),
                             ("read_cold_cpu", read_cold[1]), ("recovery_cold_cpu", rec_cold[1]),
                             ("finish", prof["page_tables"]),
                             ("index", prof["structure_rebuild"]),
                             ("rebuild", prof["page_tables"] + prof["structure_rebuild"]),
                             ("ratio_warm", rec_warm[0] / read_warm[0]),
                             ("ratio_cold", rec_cold[0] / read_cold[0]),
                             ("cpu_ratio_warm", rec_warm[1] / read_warm[1]),
                             ("cpu_ratio_cold", rec_cold[1] / read_cold[1])):
                    t[k].append(v)
                for k, v in prof.items():
                    passes.setdefault(k, []).append(v)
    out: dict[str, Any] = {k: stats(v) for k, v in t.items()}
    out["passes"] = {k: stats(v) for k, v in passes.items()}
    # the median of the paired per-repeat ratios (robust to load drift between repeats)
    out["recovery_over_read_cold"] = out["ratio_cold"]["median"]
    out["recovery_over_read_warm"] = out["ratio_warm"]["median"]
    # the same pairs in CPU time (all threads): what the wall ratio becomes when the
    # machine is loaded enough that every CPU-second waits for a core
    out["recovery_over_read_cpu_cold"] = out["cpu_ratio_cold"]["median"]
    out["recovery_over_read_cpu_warm"] = out["cpu_ratio_warm"]["median"]
    out["ratio_of_medians_cold"] = out["recovery_cold"]["median"] / out["read_cold"]["median"]
    out["ratio_of_medians_warm"] = out["recovery_warm"]["median"] / out["read_warm"]["median"]
    return out


# -- the phases of a run ----------------------------------------------------------------------------
def parse_plan(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[int], int]:
    """Parse the command line (module docstring): the arguments, the state sizes in MB and
    the repeats (their ``--quick`` defaults filled in)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=None,
                    help="default 64 128 256 512, --quick 64 512")
    ap.add_argument("--page-bytes", type=int, nargs="+", default=[1 << 13, 1 << 16])
    ap.add_argument("--workers", type=int, default=4, help="I/O threads (both sides)")
    ap.add_argument("--repeats", type=int, default=None, help="default 7, --quick 5")
    ap.add_argument("--priority", choices=("normal", "rt"), default="normal",
                    help="scheduling of the timed part: rt = SCHED_FIFO for this process's "
                         "threads when permitted (takes both CPUs from other processes "
                         "while it reads: use on a shared machine only briefly)")
    args = parse_args(ap, argv)
    sizes = args.sizes_mb or ([64, 512] if args.quick else [64, 128, 256, 512])
    return args, sizes, args.repeats or (5 if args.quick else 7)


def measure_config(root: StorageRoot, args: argparse.Namespace, pb: int, size: int,
                   repeats: int) -> tuple[dict[str, Any], str]:
    """One page size and state size: checkpoint the state once, then `measure` recovery
    against reading the same files, repeat by repeat. Returns the row and the priority
    the timed part ran at."""
    t = time.perf_counter()
    pm, n_keys = build(size * MB, pb)
    state = pm.stats()["used_bytes"]
    haunit = f"agg-{pb // 1024}k-{size}"
    with CheckpointManager(pm, root, haunit, n_workers=args.workers) as mgr:
        man = mgr.checkpoint(full=True).result()  # type: ignore[union-attr]
    del pm, mgr
    gc.collect()
    files = [f.path for f in man.files]
    fsizes = [f.size_bytes for f in man.files]
    built = time.perf_counter() - t
    prio = set_priority(args.priority)  # the reader threads start inside
    try:
        m = measure(root, haunit, man.name, files, fsizes, n_keys, pb, state,
                    args.workers, repeats)
    finally:
        set_priority("normal")
    row = {"page_bytes": pb, "target_mb": size, "state_bytes": state,
           "pages": man.n_pages, "keys": n_keys, **m}
    root.delete_dir(f"checkpoint/{man.name}", missing_ok=True)
    _print_row(row, built)
    return row, prio


def _print_row(row: dict[str, Any], built: float) -> None:
    """One configuration's medians and ratios, and its per-pass profile."""
    m = row
    print(f"{row['page_bytes'] // 1024:>2} KB pages, {row['state_bytes'] / MB:5.0f} MB "
          f"({row['pages']:6d} pages, "
          f"built {built:4.1f} s): rebuild {m['rebuild']['median'] * 1e3:6.1f} ms "
          f"(finish {m['finish']['median'] * 1e3:5.1f} + index "
          f"{m['index']['median'] * 1e3:5.1f}); recovery/read cold "
          f"{m['recovery_over_read_cold']:.2f} ({m['recovery_cold']['median']:.3f} / "
          f"{m['read_cold']['median']:.3f} s), warm {m['recovery_over_read_warm']:.2f} "
          f"({m['recovery_warm']['median']:.3f} / {m['read_warm']['median']:.3f} s); "
          f"CPU time cold {m['recovery_over_read_cpu_cold']:.2f}, warm "
          f"{m['recovery_over_read_cpu_warm']:.2f}")
    print("   passes (median ms): " + ", ".join(
        f"{k} {v['median'] * 1e3:.1f}" for k, v in m["passes"].items()))


def summarize_512mb(big: list[dict[str, Any]]) -> dict[str, Any]:
    """The 512 MB rows' summary: the worse page size first, then each page size's.

    Every ratio is `measure`'s median over repeats of recovery / read measured
    back to back, warm and cold, in wall and in CPU time.
    """
    summary: dict[str, Any] = {}
    worst = max(big, key=lambda r: r["rebuild"]["median"])
    summary["rebuild_ms_512mb"] = worst["rebuild"]["median"] * 1e3
    summary["rebuild_ms_512mb_page_bytes"] = worst["page_bytes"]
    summary["recovery_over_read_512mb"] = max(r["recovery_over_read_warm"] for r in big)
    summary["recovery_over_read_512mb_cold"] = max(r["recovery_over_read_cold"] for r in big)
    summary["recovery_over_read_cpu_512mb"] = max(r["recovery_over_read_cpu_warm"] for r in big)
    summary["recovery_over_read_cpu_512mb_cold"] = max(r["recovery_over_read_cpu_cold"]
                                                       for r in big)
    for r in big:
        k = f"{r['page_bytes'] // 1024}kb"
        summary[f"rebuild_ms_512mb_{k}"] = r["rebuild"]["median"] * 1e3
        summary[f"recovery_over_read_512mb_{k}"] = r["recovery_over_read_warm"]
        summary[f"recovery_over_read_512mb_{k}_cold"] = r["recovery_over_read_cold"]
        summary[f"recovery_over_read_cpu_512mb_{k}"] = r["recovery_over_read_cpu_warm"]
        summary[f"recovery_over_read_cpu_512mb_{k}_cold"] = r["recovery_over_read_cpu_cold"]
        summary[f"recovery_cpu_s_512mb_{k}"] = r["recovery_warm_cpu"]["median"]
        summary[f"read_cpu_s_512mb_{k}"] = r["read_warm_cpu"]["median"]
        summary[f"recovery_s_512mb_{k}"] = r["recovery_warm"]["median"]
        summary[f"read_s_512mb_{k}"] = r["read_warm"]["median"]
        summary[f"passes_ms_512mb_{k}"] = {p: v["median"] * 1e3 for p, v in r["passes"].items()}
    return summary


def summarize(rows: list[dict[str, Any]], priority: str, load_before: float
              ) -> dict[str, Any]:
    """The summary: the 512 MB fields (when run), then the run's conditions and targets."""
    big = [r for r in rows if r["target_mb"] == 512]
    summary: dict[str, Any] = summarize_512mb(big) if big else {}
    summary["loadavg_1min_before_after"] = [load_before, os.getloadavg()[0]]
    summary["cpus"] = os.cpu_count()
    summary["priority"] = priority
    summary["targets"] = {"rebuild_ms_512mb": "<= 60", "recovery_over_read_512mb": "<= 1.1",
                          "recovery_over_read_512mb_cold": "<= 1.1"}
    return summary


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, json_path: Path) -> int:
    """``<out>/recovery.png``: rebuild time, and recovery against reading, by state size."""
    plt, png = figure("recovery")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for pb in args.page_bytes:
        rs = [r for r in rows if r["page_bytes"] == pb]
        x = [r["state_bytes"] / MB for r in rs]
        lbl = f"{pb // 1024} KB pages"
        a1.plot(x, [r["rebuild"]["median"] * 1e3 for r in rs], "o-", label=f"rebuild, {lbl}")
        a1.plot(x, [r["finish"]["median"] * 1e3 for r in rs], "x:",
                label=f"Loader.finish only, {lbl}")
        a2.plot(x, [r["recovery_warm"]["median"] for r in rs], "o-", label=f"recovery, {lbl}")
        a2.plot(x, [r["read_warm"]["median"] for r in rs], "s--", label=f"read files, {lbl}")
    a1.axhline(60, color="grey", lw=0.8, ls="--")
    a1.set_xlabel("state size (MB)")
    a1.set_ylabel("ms")
    a1.set_title("Page table + index rebuild (target 60 ms at 512 MB)")
    a1.legend(fontsize=7)
    a2.set_xlabel("state size (MB)")
    a2.set_ylabel("s")
    a2.set_title(f"Whole recovery vs reading the files ({args.workers} threads, warm)")
    a2.legend(fontsize=7)
    return save_figure(fig, png, json_path)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse; per page size and state size, checkpoint and measure recovery against read;
    summarize the paired ratios; write the JSON and the PNG. Returns 0."""
    args, sizes, repeats = parse_plan(argv)
    load_before = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="sguard-recovery-")
    rows: list[dict[str, Any]] = []
    prio = args.priority
    try:
        root = open_root("file://" + tmp)
        for pb in args.page_bytes:
            for size in sizes:
                row, prio = measure_config(root, args, pb, size, repeats)
                rows.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = summarize(rows, prio, load_before[0])
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()})
    params = {"quick": args.quick, "sizes_mb": sizes, "page_bytes": args.page_bytes,
              "workers": args.workers, "repeats": repeats, "priority": args.priority,
              "storage": "file:// temporary dir",
              "page_cache": "posix_fadvise(DONTNEED) on the page files before every read",
              "summary_ratio": "median over repeats of recovery / read measured back to back "
                               "(order alternating), the worse page size; warm in "
                               "recovery_over_read_512mb, cold in ..._cold"}
    path = write_result("recovery", summary, {"rows": rows}, params)
    return plot(rows, args, path)


if __name__ == "__main__":
    raise SystemExit(main())
