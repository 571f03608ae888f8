"""``sguard demo``: the main job on the embedded default (local filesystem).

An Aggregate operator (count / first / last timestamp per 4-byte key) consumes
a generated stream with its state in an mmm `HashMap`, and checkpoints it
asynchronously (copy-on-write; incremental) to ``file://<root>`` through
`ioservice.CheckpointManager`. The demo runs the operator in a worker process
that **kills itself with SIGKILL mid-run**, then recovers in this process from
the latest complete checkpoint, checks the recovered state against a numpy
oracle of exactly the input that checkpoint covers (its manifest records the
input position), replays the rest of the stream and checks that the final
state equals a failure-free run: no loss, no duplicates.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import mmm
from ioservice import CheckpointManager, CheckpointPolicy, list_checkpoints, open_root
from sguard.operators import Aggregate, expected_aggregate

__all__ = ["register", "generate_batch", "run_worker", "run_demo"]

HAUNIT = "aggregate"


def generate_batch(seed: int, index: int, size: int, groups: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``index`` of the demo stream: deterministic, so it can be replayed."""
    rng = np.random.default_rng([seed, index])
    keys = rng.integers(0, groups, size, dtype=np.uint32)
    ts = np.arange(index * size, (index + 1) * size, dtype=np.int64)
    return keys, ts


def _stream(args: argparse.Namespace, start: int, stop: int):  # type: ignore[no-untyped-def]
    for i in range(start, stop):
        yield i, *generate_batch(args.seed, i, args.batch, args.groups)


def _process(op: Aggregate, mgr: CheckpointManager, args: argparse.Namespace, start: int,
             kill_at: int | None, report: dict[str, Any]) -> None:
    """Consume batches ``start..`` with periodic checkpoints; SIGKILL self at ``kill_at``."""
    prepare: list[float] = report.setdefault("prepare_ms", [])
    t0 = time.perf_counter()
    done = 0
    for i, keys, ts in _stream(args, start, args.batches):
        if kill_at is not None and i == kill_at:
            print(f"[worker] batch {i}: killing myself with SIGKILL "
                  f"({len(prepare)} checkpoints started)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        op.process(keys, ts)
        done += 1
        pending = mgr.maybe_checkpoint(len(keys), user_meta={"batches": i + 1})
        if pending is not None:
            prepare.append(pending.prepare_s * 1e3)
    mgr.wait()
    report["tuples_per_s"] = done * args.batch / (time.perf_counter() - t0)


def _manager(pm: mmm.PageManager, args: argparse.Namespace) -> CheckpointManager:
    policy = CheckpointPolicy(every_n_tuples=args.checkpoint_every * args.batch, keep=3,
                              full_every=4)
    if args.scheduler:
        import sguard.scheduling  # noqa: F401  (registers peace://)
    return CheckpointManager(pm, str(Path(args.root).resolve()), HAUNIT, policy=policy,
                             n_workers=args.io_workers, scheduler=args.scheduler or None)


def run_worker(args: argparse.Namespace) -> int:
    """The operator process: runs until it kills itself at ``args.kill_at``."""
    pm = mmm.PageManager(page_bytes=args.page_bytes, capacity_bytes=8 << 30)
    op = Aggregate(pm)
    report: dict[str, Any] = {}
    with _manager(pm, args) as mgr:
        _process(op, mgr, args, 0, args.kill_at, report)
    return 0


def _check(op: Aggregate, args: argparse.Namespace, n_batches: int) -> bool:
    keys = np.concatenate([generate_batch(args.seed, i, args.batch, args.groups)[0]
                           for i in range(n_batches)]) if n_batches else np.zeros(0, np.uint32)
    ek, ev = expected_aggregate(keys, np.arange(n_batches * args.batch, dtype=np.int64))
    gk, gv = op.result()
    return bool(np.array_equal(ek, gk) and np.array_equal(ev, gv))


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Run worker (killed mid-run), recover, replay, verify; returns the measurements."""
    root = Path(args.root).resolve()
    if (root / "checkpoint").exists():
        shutil.rmtree(root / "checkpoint")  # each demo run starts from an empty root
    root.mkdir(parents=True, exist_ok=True)
    kill_at = args.kill_at if args.kill_at is not None else (args.batches * 2) // 3
    print(f"sguard demo: Aggregate over {args.batches} batches x {args.batch:,} tuples, "
          f"{args.groups:,} keys; checkpoints every {args.checkpoint_every} batches to "
          f"file://{root}")
    cmd = [sys.executable, "-m", "sguard", "demo", "--worker", "--kill-at", str(kill_at),
           *_forward(args)]
    t = time.perf_counter()
    child = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    print(f"[demo] worker exited with {child.returncode} after {time.perf_counter() - t:.1f} s"
          f" ({'killed by SIGKILL' if child.returncode == -signal.SIGKILL else 'unexpected'})")
    killed = child.returncode == -signal.SIGKILL

    storage = open_root(str(root))
    cps = list_checkpoints(storage, HAUNIT)
    print("[demo] checkpoint directories on disk: "
          + ", ".join(f"{c.name}{'' if c.has_manifest else ' (no manifest)'}" for c in cps)
          + "\n       (no manifest: in flight when killed, or expired but still referenced"
          " by an incremental checkpoint)")

    pm = mmm.PageManager(page_bytes=args.page_bytes, capacity_bytes=8 << 30)
    report: dict[str, Any] = {}
    with _manager(pm, args) as mgr:
        t = time.perf_counter()
        man = mgr.restore()
        recover_s = time.perf_counter() - t
        op = Aggregate(pm)  # create-by-name finds the recovered state
        start = int(man.user_meta["batches"]) if man is not None else 0
        recovered_ok = _check(op, args, start)
        print(f"[demo] recovered {man.name if man else 'nothing'} in {recover_s * 1e3:.0f} ms: "
              f"state after batch {start} ({len(op.state):,} keys, {pm.stats()['used_frames']} "
              f"pages) {'OK' if recovered_ok else 'MISMATCH'} vs oracle")
        print(f"[demo] replaying batches {start}..{args.batches - 1}")
        _process(op, mgr, args, start, None, report)
        final_ok = _check(op, args, args.batches)
    stats = pm.stats()
    prep = report.get("prepare_ms") or [0.0]
    print(f"[demo] throughput {report.get('tuples_per_s', 0):,.0f} tuples/s while checkpointing;"
          f" prepare (the only pause) mean {np.mean(prep):.2f} ms, max {np.max(prep):.2f} ms;"
          f" pages cloned by copy-on-write {stats['pages_cloned']}")
    print(f"[demo] final state after all {args.batches} batches: "
          f"{'OK' if final_ok else 'MISMATCH'} — equals the failure-free result "
          f"(exactly once)")
    result = {"killed": killed, "recovered_from": man.name if man else None,
              "recovered_batches": start, "recovered_ok": recovered_ok, "final_ok": final_ok,
              "recover_ms": recover_s * 1e3, "prepare_ms_mean": float(np.mean(prep)),
              "prepare_ms_max": float(np.max(prep)), "pages_cloned": stats["pages_cloned"],
              "tuples_per_s": report.get("tuples_per_s", 0.0)}
    if args.json:
        print(json.dumps(result))
    return result


def _forward(args: argparse.Namespace) -> list[str]:
    return ["--batches", str(args.batches), "--batch", str(args.batch), "--groups",
            str(args.groups), "--checkpoint-every", str(args.checkpoint_every),
            "--page-bytes", str(args.page_bytes), "--seed", str(args.seed),
            "--root", str(args.root), "--io-workers", str(args.io_workers),
            *(["--scheduler", args.scheduler] if args.scheduler else [])]


def _main(args: argparse.Namespace) -> int:
    if args.worker:
        return run_worker(args)
    r = run_demo(args)
    ok = r["killed"] and r["recovered_ok"] and r["final_ok"] and r["recovered_from"]
    return 0 if ok else 1


def register(sub: Any) -> None:
    """Add the ``demo`` subcommand to the sguard CLI."""
    p = sub.add_parser("demo", help="Aggregate with async checkpoints, self-kill, recovery")
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--batch", type=int, default=50_000)
    p.add_argument("--groups", type=int, default=200_000)
    p.add_argument("--checkpoint-every", type=int, default=6, help="batches between checkpoints")
    p.add_argument("--page-bytes", type=int, default=1 << 16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--root", default="sguard-data", help="checkpoint root (local directory)")
    p.add_argument("--io-workers", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=None,
                   help="batch at which the worker kills itself (default: 2/3 of the run)")
    p.add_argument("--scheduler", default=None, metavar="URI",
                   help="write checkpoints through a write scheduler, e.g. the Peace coordinator "
                        "peace://127.0.0.1:PORT (see `sguard peace serve`); default: unscheduled")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="also print the result as JSON")
    p.set_defaults(func=_main)
