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

Each run writes into a new directory ``<root>/run-<N>`` that it creates (the
smallest unused N), so it never touches, let alone deletes, anything that was
there before. The exit status is the verdict: 0 when the worker was killed, the
recovered state matched its oracle and the final state matched the
failure-free run (the last line printed says ``verdict: OK``); 1 otherwise
(``verdict: FAILED`` with the reasons); 2 for a usage error, before any work.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

import mmm
from ioservice import CheckpointManager, CheckpointPolicy, list_checkpoints, open_root
from mmm.pool import check_page_bytes
from sguard.cliargs import UsageError, nonnegative_int, positive_int, set_validator
from sguard.operators import Aggregate, expected_aggregate

__all__ = ["register", "generate_batch", "run_worker", "run_demo", "verdict", "new_run_dir"]

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
            if prepare and mgr.base is None:
                mgr.wait()  # a checkpoint is in flight and none is durable yet: let one land,
                #             so the recovery below always has a checkpoint to show
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
    return CheckpointManager(pm, str(Path(args.run_dir).resolve()), HAUNIT, policy=policy,
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


def new_run_dir(root: Path) -> Path:
    """Create and return ``root/run-<N>`` for the smallest N not taken (``root`` made if missing).

    Creation is atomic (``mkdir`` without ``exist_ok``), so two demos started at
    once get different directories, and nothing that exists is ever reused.
    """
    root.mkdir(parents=True, exist_ok=True)
    taken = {p.name for p in root.iterdir()}
    n = 1
    while True:
        path = root / f"run-{n}"
        if path.name not in taken:
            try:
                path.mkdir()
                return path
            except FileExistsError:
                pass
        n += 1


def verdict(result: dict[str, Any]) -> list[str]:
    """The reasons the demo failed (empty: it passed); the exit status is 0 iff empty.

    The worker must have been killed by its own SIGKILL, the recovered state
    must equal the oracle of exactly the input its checkpoint covers (the empty
    state when no checkpoint completed before the kill), and the final state
    must equal the failure-free run.
    """
    reasons = []
    if not result["killed"]:
        reasons.append("the worker was not killed by SIGKILL (it crashed or finished)")
    if not result["recovered_ok"]:
        reasons.append(f"recovered state after batch {result['recovered_batches']} differs "
                       "from the oracle")
    if not result["final_ok"]:
        reasons.append("final state differs from the failure-free run")
    return reasons


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Run worker (killed mid-run), recover, replay, verify; returns the measurements.

    Writes only into a new directory ``args.root/run-<N>`` (see `new_run_dir`).
    """
    run_dir = new_run_dir(Path(args.root).resolve())
    args.run_dir = str(run_dir)
    kill_at = args.kill_at if args.kill_at is not None else (args.batches * 2) // 3
    print(f"sguard demo: Aggregate over {args.batches} batches x {args.batch:,} tuples, "
          f"{args.groups:,} keys; checkpoints every {args.checkpoint_every} batches to "
          f"file://{run_dir} (a new directory)")
    cmd = [sys.executable, "-m", "sguard", "demo", "--worker", "--kill-at", str(kill_at),
           "--run-dir", str(run_dir), *_forward(args)]
    t = time.perf_counter()
    child = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    killed = child.returncode == -signal.SIGKILL
    print(f"[demo] worker exited with {child.returncode} after {time.perf_counter() - t:.1f} s"
          f" ({'killed by SIGKILL: OK' if killed else 'NOT killed: unexpected'})")

    storage = open_root(str(run_dir))
    cps = list_checkpoints(storage, HAUNIT)
    print("[demo] checkpoint directories on disk: "
          + (", ".join(f"{c.name}{'' if c.has_manifest else ' (no manifest)'}" for c in cps)
             or "none")
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
        what = (f"recovered {man.name} in {recover_s * 1e3:.0f} ms: state after batch {start}"
                if man is not None else
                "no checkpoint had completed before the kill: recovery starts from the empty "
                "state (batch 0)")
        print(f"[demo] {what} ({len(op.state):,} keys, {pm.stats()['used_frames']} "
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
    result: dict[str, Any] = {
        "root": str(run_dir), "killed": killed, "kill_at": kill_at,
        "recovered_from": man.name if man else None, "recovered_batches": start,
        "recovered_ok": recovered_ok, "final_ok": final_ok, "recover_ms": recover_s * 1e3,
        "prepare_ms_mean": float(np.mean(prep)), "prepare_ms_max": float(np.max(prep)),
        "pages_cloned": stats["pages_cloned"], "tuples_per_s": report.get("tuples_per_s", 0.0)}
    reasons = verdict(result)
    result["ok"] = not reasons
    print("[demo] verdict: OK" if not reasons else f"[demo] verdict: FAILED: {'; '.join(reasons)}")
    print(f"[demo] inspect: {_sguard_command()} checkpoints ls {run_dir}")
    if args.json:
        print(json.dumps(result))
    return result


def _sguard_command() -> str:
    """How to run ``sguard`` from this interpreter's environment (it may not be on PATH)."""
    script = Path(sys.executable).parent / "sguard"
    return str(script) if script.exists() else f"{sys.executable} -m sguard"


def _forward(args: argparse.Namespace) -> list[str]:
    return ["--batches", str(args.batches), "--batch", str(args.batch), "--groups",
            str(args.groups), "--checkpoint-every", str(args.checkpoint_every),
            "--page-bytes", str(args.page_bytes), "--seed", str(args.seed),
            "--root", str(args.root), "--io-workers", str(args.io_workers),
            *(["--scheduler", args.scheduler] if args.scheduler else [])]


def _main(args: argparse.Namespace) -> int:
    if args.worker:
        return run_worker(args)
    return 0 if run_demo(args)["ok"] else 1


def _validate(args: argparse.Namespace) -> None:
    if args.kill_at is not None and args.kill_at >= args.batches:
        raise UsageError(f"--kill-at {args.kill_at} must be below --batches {args.batches} "
                         "(the worker must die before the stream ends)")
    root = Path(args.root)
    for p in (root, *root.resolve().parents):
        if p.exists():
            if not p.is_dir():
                raise UsageError(f"--root {args.root}: {p} exists and is not a directory")
            if not os.access(p, os.W_OK):
                raise UsageError(f"--root {args.root}: {p} is not writable")
            break
    if args.worker and not args.run_dir:
        raise UsageError("--worker needs --run-dir")


def _page_bytes(text: str) -> int:
    value = positive_int(text)
    try:
        return check_page_bytes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_EPILOG = """\
example:
  sguard demo                          # 60 batches x 50,000 tuples, killed at batch 40
  sguard demo --batches 12 --batch 4000 --groups 3000 --root /tmp/demo --json

exit status: 0 verdict OK, 1 verdict FAILED, 2 usage error (nothing was run).
"""


def register(sub: Any) -> None:
    """Add the ``demo`` subcommand to the sguard CLI."""
    p = sub.add_parser(
        "demo", help="the Aggregate demo: async checkpoints, SIGKILL, recovery, exactly-once check",
        description=textwrap.fill(
            "Run an Aggregate operator (count / first / last timestamp per key) with its "
            "state in mmm pages and asynchronous incremental checkpoints to a local "
            "directory, in a worker process that kills itself with SIGKILL mid-run; then "
            "recover the latest complete checkpoint, check it against an oracle, replay "
            "the rest of the stream and check the final state against a failure-free "
            "run. Each run writes into a new directory ROOT/run-N and never touches "
            "anything else."),
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=positive_int, default=60,
                   help="batches in the stream (default %(default)s)")
    p.add_argument("--batch", type=positive_int, default=50_000,
                   help="tuples per batch (default %(default)s)")
    p.add_argument("--groups", type=positive_int, default=200_000,
                   help="distinct keys the tuples are drawn from (default %(default)s)")
    p.add_argument("--checkpoint-every", type=positive_int, default=6,
                   help="batches between checkpoints (default %(default)s)")
    p.add_argument("--page-bytes", type=_page_bytes, default=1 << 16,
                   help="mmm page size, a power of two in 4096..1048576 (default %(default)s)")
    p.add_argument("--seed", type=nonnegative_int, default=1,
                   help="seed of the generated stream (default %(default)s)")
    p.add_argument("--root", default="sguard-data",
                   help="local directory under which each run creates run-N "
                        "(default %(default)s)")
    p.add_argument("--io-workers", type=positive_int, default=4,
                   help="checkpoint writer threads (default %(default)s)")
    p.add_argument("--kill-at", type=nonnegative_int, default=None,
                   help="batch at which the worker kills itself, below --batches "
                        "(default: 2/3 of the run)")
    p.add_argument("--scheduler", default=None, metavar="URI",
                   help="write checkpoints through a write scheduler, e.g. the Peace coordinator "
                        "peace://127.0.0.1:PORT (see `sguard peace serve`); default: unscheduled")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true",
                   help="also print the result as one JSON line at the end")
    p.set_defaults(func=_main)
    set_validator(p, _validate)
