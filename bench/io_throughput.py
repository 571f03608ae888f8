"""Paper Table 8: checkpoint write and recovery read throughput with 1-8 I/O workers.

The state is one page set of ``--local-mb`` (file://) or ``--s3-mb``
(SeaweedFS) megabytes of 64 KB pages with random bodies. For each worker count
``w`` in 1, 2, 4, 8, in the same run and interleaved (repeat by repeat):

* **checkpoint write**: `CheckpointManager.checkpoint` (full) until its
  `PendingCheckpoint.result` — gather pages (on local storage pages in
  consecutive frames are written from the frames), checksum, write ``w`` files, fsync
  them and the directory (local), write the manifest;
* **raw write**: ``w`` threads, each writing its share of the *same* bytes (the
  pages' frames, contiguous) with a plain pyarrow output stream in the same
  4 MiB chunks, then closing and, on local storage, fsyncing file and
  directory exactly as the checkpoint path does (`StorageRoot.sync`);
* **recovery read**: `ioservice.recovery.restore` with an `IOService` of ``w``
  workers into a page manager (reused across repeats, so its memory is already
  faulted in: the first touch of fresh memory in this VM costs more than the
  read itself) — list, manifest, read every page, verify checksum and PageID,
  copy into frames, rebuild the page table;
* **raw read**: ``w`` threads reading the checkpoint's own page files with
  ``readinto`` in 4 MiB chunks, each file into its slice of one buffer of the
  state's size (reused across repeats, so touched, like the restore's page
  manager): the same bytes through the same pyarrow file API into the same kind
  of memory. (A read into one reused 4 MiB buffer per thread, which stays in the
  CPU cache, is reported as ``raw_read_small_buffer`` but not compared: recovery
  cannot keep its pages in the cache.)

The reads of one repeat run back to back and their order alternates between
repeats. Restore with ``w`` workers reads with ``w`` threads (on local files each
reads and verifies its pages in one compiled call per chunk; on SeaweedFS it
hands verification to up to ``max(2, w)`` verifier threads and reads on); the
summary compares each side at its best worker count over 1-8, so the raw read is
offered up to 8 threads too.

Every (worker count, operation) pair starts with one untimed warm-up round
(new threads, their buffers, fresh files). On local storage the page cache is dropped for the files about to be read
(``posix_fadvise(DONTNEED)`` after fsync), so both reads come from the disk.
Also reported: ``read_pages`` alone (read + verify, no copy into frames).

SeaweedFS: a real cluster started by this script (`ioservice.testing.SeaweedCluster`:
master, three volume servers on two racks with replication 010, 512 MB volumes,
filer, S3 gateway, all on 127.0.0.1) reached through pyarrow's S3 filesystem.

Run: ``python -m bench.io_throughput [--quick] [--no-seaweedfs]``. Writes
``bench/results/io_throughput.json`` (summary: ``write_ratio_vs_raw_local``,
``read_ratio_vs_raw_local``, ``write_ratio_vs_raw_seaweedfs``,
``read_ratio_vs_raw_seaweedfs``: the best checkpoint throughput over the best
raw throughput, each over the worker counts; the ratio at every count and
their geometric mean are in the summary too; ``read_cpu_ratio_vs_raw_local``:
the raw read's CPU time over restore's, all threads, at the best worker count,
what the read ratio tends to on a loaded machine) and
``bench/results/io_throughput.png``.
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
from typing import Any

import numpy as np

import mmm
from bench._harness import figure, parse_args, save_figure, stats, write_result
from ioservice import CheckpointManager, CheckpointPolicy, IOService, StorageRoot, open_root
from ioservice.format import checkpoint_dir
from ioservice.recovery import read_manifest, restore
from ioservice.service import DEFAULT_CHUNK_BYTES
from mmm.page import HEADER_BYTES

MB = 1 << 20
WORKERS = (1, 2, 4, 8)


def build_state(nbytes: int, page_bytes: int) -> tuple[mmm.PageManager, np.ndarray]:
    """A page manager holding ``nbytes`` of pages with random bodies; their frames."""
    n = nbytes // page_bytes
    pm = mmm.PageManager(page_bytes=page_bytes, capacity_bytes=(n + 64) * page_bytes)
    psid = pm.create("blob")
    seqs = pm.allocate(psid, n - 1)
    ps = pm.page_set(psid)
    frames = ps.frames[np.concatenate(([0], seqs))]
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, (256, page_bytes - HEADER_BYTES), dtype=np.uint8)
    body = pm.pool.frames[:, HEADER_BYTES:]
    for s in range(1, len(frames), 256):
        f = frames[s:s + 256]
        body[f] = block[:len(f)]
    return pm, frames


def _evict(root: StorageRoot, relpaths: list[str]) -> None:
    """Drop the page cache of local files (no-op elsewhere)."""
    if root.backend != "local":
        return
    for rel in relpaths:
        fd = os.open(root.full_path(rel), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(root: StorageRoot, directory: str, data: np.ndarray, n_threads: int,
              pool: cf.ThreadPoolExecutor, chunk_bytes: int) -> None:
    """``n_threads`` plain output streams writing contiguous shares of ``data`` (pages)."""
    shares = np.array_split(np.arange(len(data)), n_threads)
    per = max(1, chunk_bytes // data.shape[1])

    def one(k: int) -> None:
        s = shares[k]
        rel = f"{directory}/w{k:03d}.pages"
        out = root.open_output_stream(rel)
        a, b = int(s[0]), int(s[-1]) + 1
        for i in range(a, b, per):
            out.write(data[i:min(i + per, b)])
        out.close()
        root.sync(rel)  # fsync file + directory on local storage, as the checkpoint does

    list(pool.map(one, range(n_threads)))


def raw_read(root: StorageRoot, relpaths: list[str], pool: cf.ThreadPoolExecutor,
             chunk_bytes: int, dest: np.ndarray | None = None,
             sizes: list[int] | None = None) -> int:
    """Read whole files with one thread each, ``readinto`` in ``chunk_bytes`` calls.

    With ``dest`` (a buffer of the files' total size) and their ``sizes``, each file
    lands in its own slice of ``dest``, as recovery lands the pages in frames: the
    fair baseline (the bytes end up in memory of the state's size). Without, every
    thread reads into one reused chunk buffer, which stays in the CPU cache and
    skips the memory traffic recovery pays (reported for reference only)."""
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist() if sizes else []

    def one(i: int) -> int:
        if dest is None:
            mv = memoryview(np.empty(chunk_bytes, dtype=np.uint8))
            span = None
        else:
            assert sizes is not None
            span = memoryview(dest[starts[i]:starts[i] + sizes[i]])  # type: ignore[arg-type]
        n = 0
        f = root.open_input_file(relpaths[i])
        try:
            while True:
                got = f.readinto(mv if span is None else span[n:n + chunk_bytes])
                if not got:
                    break
                n += got
        finally:
            f.close()
        return n

    return sum(pool.map(one, range(len(relpaths))))


def bench_backend(label: str, root: StorageRoot, nbytes: int, page_bytes: int,
                  repeats: int, workers: Sequence[int]) -> dict[str, Any]:
    pm, frames = build_state(nbytes, page_bytes)
    lo, hi = int(frames.min()), int(frames.max()) + 1
    assert hi - lo == len(frames), "pages expected in contiguous frames"
    data = pm.pool.frames[lo:hi]  # the same bytes, contiguous
    size = len(frames) * page_bytes
    pm2 = mmm.PageManager(page_bytes=page_bytes, capacity_bytes=(len(frames) + 64) * page_bytes)
    dest = np.ones(size, dtype=np.uint8)  # the raw read's destination: reused, touched, as pm2
    rows = []
    for w in workers:
        mgr = CheckpointManager(pm, root, f"tp{w}", n_workers=w,
                                policy=CheckpointPolicy(full_every=1, keep=None))
        tpool = cf.ThreadPoolExecutor(w, thread_name_prefix="raw")
        t: dict[str, list[float]] = {"ckpt_write": [], "raw_write": [], "ckpt_restore": [],
                                     "ckpt_read_pages": [], "raw_read": [],
                                     "raw_read_small_buffer": [], "ckpt_restore_cpu": [],
                                     "raw_read_cpu": []}
        last = None
        try:
            keep = [False] + [True] * repeats  # an untimed warm-up round first
            for r, timed in enumerate(keep):
                gc.collect()
                t0 = time.perf_counter()
                man = mgr.checkpoint(full=True).result()  # type: ignore[union-attr]
                dt_ckpt = time.perf_counter() - t0
                if last is not None:
                    root.delete_dir(checkpoint_dir(last), missing_ok=True)
                last = man.name
                rawdir = f"raw/{label}-w{w}-r{r}"
                t0 = time.perf_counter()
                raw_write(root, rawdir, data, w, tpool, DEFAULT_CHUNK_BYTES)
                if timed:
                    t["raw_write"].append(time.perf_counter() - t0)
                    t["ckpt_write"].append(dt_ckpt)
                root.delete_dir(rawdir, missing_ok=True)
            man = read_manifest(root, last)  # type: ignore[arg-type]
            files = [f.path for f in man.files]
            fsizes = [f.size_bytes for f in man.files]
            with IOService(w) as io:
                for r, timed in enumerate(keep):
                    got_n = [0, 0]

                    def rec() -> None:
                        got_n[0] = restore(pm2, root, f"tp{w}", io=io).n_pages

                    def raw() -> None:  # into warm memory of the state's size, as restore
                        got_n[1] = raw_read(root, files, tpool, DEFAULT_CHUNK_BYTES, dest,
                                            fsizes)

                    def raw_small() -> None:
                        raw_read(root, files, tpool, DEFAULT_CHUNK_BYTES)

                    def read_pages() -> None:
                        io.read_pages(root, man, lambda pages: None)

                    # every read from the disk (page cache dropped); the order alternates
                    # between repeats, so load drift does not favour one side
                    ops = [("ckpt_restore", rec), ("raw_read", raw),
                           ("raw_read_small_buffer", raw_small), ("ckpt_read_pages", read_pages)]
                    for key, fn in (ops if r % 2 else ops[::-1]):
                        _evict(root, files)
                        gc.collect()
                        c0, t0 = time.process_time(), time.perf_counter()
                        fn()
                        if timed:
                            t[key].append(time.perf_counter() - t0)
                            if key + "_cpu" in t:  # CPU time of every thread of the process
                                t[key + "_cpu"].append(time.process_time() - c0)
                    assert got_n[0] == len(frames) and got_n[1] == size, (got_n, size)
        finally:
            mgr.close()
            tpool.shutdown()
        if last is not None:
            root.delete_dir(checkpoint_dir(last), missing_ok=True)
        row: dict[str, Any] = {"workers": w}
        for k, v in t.items():
            row[k] = stats(v)
            if not k.endswith("_cpu"):
                row[k + "_mb_s"] = size / MB / row[k]["median"]
        # MB per CPU-second, restore over raw read: the throughput ratio on a machine
        # loaded enough that every CPU-second waits for a core
        row["read_cpu_ratio"] = row["raw_read_cpu"]["median"] / row["ckpt_restore_cpu"]["median"]
        row["write_ratio"] = row["ckpt_write_mb_s"] / row["raw_write_mb_s"]
        row["read_ratio"] = row["ckpt_restore_mb_s"] / row["raw_read_mb_s"]
        row["read_pages_ratio"] = row["ckpt_read_pages_mb_s"] / row["raw_read_mb_s"]
        print(f"  {label:<9} w={w}: write ckpt {row['ckpt_write_mb_s']:7.0f} MB/s vs raw "
              f"{row['raw_write_mb_s']:7.0f} ({row['write_ratio']:.2f}x) | read restore "
              f"{row['ckpt_restore_mb_s']:7.0f} (read_pages {row['ckpt_read_pages_mb_s']:6.0f}) "
              f"vs raw {row['raw_read_mb_s']:7.0f} MB/s ({row['read_ratio']:.2f}x; CPU time "
              f"{row['read_cpu_ratio']:.2f}x)")
        rows.append(row)
    del pm, pm2, data, dest
    gc.collect()
    return {"state_bytes": size, "rows": rows}


def best_ratio(rows: list[dict[str, Any]], ckpt: str, raw: str) -> tuple[float, int, int]:
    """Best checkpoint throughput over best raw throughput (each at its own best
    worker count: symmetric, so noise at one count does not pick the ratio)."""
    bc = max(rows, key=lambda r: r[ckpt])
    br = max(rows, key=lambda r: r[raw])
    return bc[ckpt] / br[raw], bc["workers"], br["workers"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--local-mb", type=int, default=None, help="default 1024, --quick 256")
    ap.add_argument("--s3-mb", type=int, default=None, help="default 256, --quick 64")
    ap.add_argument("--repeats", type=int, default=None, help="default 7, --quick 4")
    ap.add_argument("--page-bytes", type=int, default=1 << 16)
    ap.add_argument("--workers", type=int, nargs="+", default=list(WORKERS))
    ap.add_argument("--no-seaweedfs", action="store_true")
    args = parse_args(ap, argv)
    local_mb = args.local_mb or (256 if args.quick else 1024)
    s3_mb = args.s3_mb or (64 if args.quick else 256)
    repeats = args.repeats or (4 if args.quick else 7)
    results: dict[str, Any] = {}
    load_before = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="sguard-io-throughput-")
    try:
        root = open_root("file://" + tmp)
        print(f"file:// ({tmp}), {local_mb} MB, {repeats} repeats")
        results["local"] = bench_backend("local", root, local_mb * MB, args.page_bytes,
                                         repeats, args.workers)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not args.no_seaweedfs:
        from ioservice.testing import SeaweedCluster
        # Deleted objects are reclaimed only by SeaweedFS's periodic vacuum and each volume
        # server holds at most 32 volumes: larger volumes leave room for every repeat.
        cluster = SeaweedCluster(volume_size_limit_mb=512)
        t0 = time.perf_counter()
        cluster.start()
        try:
            bucket = cluster.create_bucket("bench")
            root = open_root(bucket + "/io", s3_endpoint=cluster.s3_endpoint,
                             s3_access_key=cluster.access_key, s3_secret_key=cluster.secret_key,
                             timeout_s=30.0, max_attempts=6)
            # 8 parallel uploads on 2 shared cores can stall > 3 s, and the gateway
            # answers some of them with a retryable 500: both paths share these settings
            print(f"SeaweedFS at {cluster.s3_endpoint} (started in {time.perf_counter() - t0:.1f} s),"
                  f" {s3_mb} MB, {repeats} repeats")
            results["seaweedfs"] = bench_backend("seaweedfs", root, s3_mb * MB, args.page_bytes,
                                                 repeats, args.workers)
        finally:
            cluster.stop()
    summary: dict[str, Any] = {}
    for be, tag in (("local", "local"), ("seaweedfs", "seaweedfs")):
        if be not in results:
            continue
        rows = results[be]["rows"]
        for what, ckpt, raw, ratio in (("write", "ckpt_write_mb_s", "raw_write_mb_s",
                                        "write_ratio"),
                                       ("read", "ckpt_restore_mb_s", "raw_read_mb_s",
                                        "read_ratio")):
            r, wc, wr = best_ratio(rows, ckpt, raw)
            summary[f"{what}_ratio_vs_raw_{tag}"] = r
            summary[f"{what}_mb_s_{tag}"] = {"checkpoint": max(x[ckpt] for x in rows),
                                             "raw": max(x[raw] for x in rows),
                                             "checkpoint_workers": wc, "raw_workers": wr}
            summary[f"{what}_ratios_by_workers_{tag}"] = {x["workers"]: x[ratio] for x in rows}
            summary[f"{what}_ratio_geomean_{tag}"] = float(
                np.exp(np.mean(np.log([x[ratio] for x in rows]))))
        summary[f"read_cpu_ratio_vs_raw_{tag}"] = max(x["read_cpu_ratio"] for x in rows)
        summary[f"read_cpu_ratios_by_workers_{tag}"] = {x["workers"]: x["read_cpu_ratio"]
                                                        for x in rows}
        summary[f"read_ratio_vs_raw_small_buffer_{tag}"] = (
            max(x["ckpt_restore_mb_s"] for x in rows)
            / max(x["raw_read_small_buffer_mb_s"] for x in rows))  # reference only
    summary["targets"] = {k: ">= 0.8" for k in ("write_ratio_vs_raw_local",
                                               "write_ratio_vs_raw_seaweedfs")}
    summary["targets"]["read_ratio_vs_raw_local"] = ">= 0.9"
    summary["loadavg_1min_before_after"] = [load_before[0], os.getloadavg()[0]]
    print({k: round(v, 3) for k, v in summary.items() if isinstance(v, float)})
    params = {"quick": args.quick, "local_mb": local_mb, "s3_mb": s3_mb, "repeats": repeats,
              "page_bytes": args.page_bytes, "workers": args.workers,
              "chunk_bytes": DEFAULT_CHUNK_BYTES,
              "local_cache": "fsync after writes (both); posix_fadvise DONTNEED before reads",
              "raw_read": "readinto 4 MiB calls into a reused (touched) buffer of the state's "
                          "size, one slice per file; order alternating with restore",
              "restore_target": "reused page manager (memory already faulted in)",
              "seaweedfs": "SeaweedCluster: 1 master, 3 volume servers on 2 racks, replication "
                           "010, 512 MB volumes, filer, S3 gateway on 127.0.0.1; S3 timeout "
                           "30 s, 6 attempts (checkpoint and raw paths alike)"}
    path = write_result("io_throughput", summary, results, params)
    plt, png = figure("io_throughput")
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, (be, res) in zip(axes[0], results.items()):
        ws = [r["workers"] for r in res["rows"]]
        for key, label, style in (("ckpt_write_mb_s", "checkpoint write", "o-"),
                                  ("raw_write_mb_s", "raw write", "o--"),
                                  ("ckpt_restore_mb_s", "recovery (restore)", "s-"),
                                  ("ckpt_read_pages_mb_s", "read_pages (read+verify)", "^:"),
                                  ("raw_read_mb_s", "raw read", "s--")):
            ax.plot(ws, [r[key] for r in res["rows"]], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ws, [str(w) for w in ws])
        ax.set_xlabel("I/O workers (threads)")
        ax.set_ylabel("MB/s")
        ax.set_title(f"{be}: {res['state_bytes'] // MB} MB")
        ax.legend(fontsize=7)
    return save_figure(fig, png, path)


if __name__ == "__main__":
    raise SystemExit(main())
