"""``sguard demo``: the Aggregate operator on a generated stream, with state in mmm.

While the operator consumes batches, the demo takes copy-on-write snapshots;
a background I/O thread copies each snapshot's frozen pages and marks them
persisted while the operator keeps running. At the end it rebuilds the state
from the last snapshot's pages in a fresh page manager and checks both the
live state and the rebuilt one against a numpy oracle.
"""
from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import numpy as np

import mmm
from mmm.structures.hashmap import HashMap
from sguard.operators import AGG_VALUE, Aggregate, expected_aggregate

__all__ = ["register", "run_demo", "generate_batch"]


def generate_batch(seed: int, index: int, size: int, groups: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``index`` of the demo stream: deterministic, so it can be replayed."""
    rng = np.random.default_rng([seed, index])
    keys = rng.integers(0, groups, size, dtype=np.uint32)
    ts = np.arange(index * size, (index + 1) * size, dtype=np.int64)
    return keys, ts


def run_demo(tuples: int = 2_000_000, groups: int = 100_000, batch: int = 50_000,
             checkpoint_every: int = 8, page_bytes: int = 1 << 16, seed: int = 1,
             out: Any = print) -> dict[str, Any]:
    """Run the demo; returns its measurements (also printed through ``out``)."""
    pm = mmm.PageManager(page_bytes=page_bytes, capacity_bytes=4 << 30)
    op = Aggregate(pm)
    n_batches = -(-tuples // batch)
    prepare_ms: list[float] = []
    writers: list[threading.Thread] = []
    last: dict[str, Any] = {}

    def persist(snap: mmm.Snapshot, upto: int) -> None:
        pages = np.empty((len(snap), snap.page_bytes), np.uint8)
        for chunk in np.array_split(np.arange(len(snap)), max(1, len(snap) // 64)):
            pages[chunk] = snap.copy_pages(chunk)
            snap.mark_persisted(chunk)
        snap.complete()
        last.update(pages=pages, upto=upto)

    t0 = time.perf_counter()
    for i in range(n_batches):
        keys, ts = generate_batch(seed, i, min(batch, tuples - i * batch), groups)
        op.process(keys, ts)
        if (i + 1) % checkpoint_every == 0:
            for w in writers:  # at most one checkpoint in flight
                w.join()
            t = time.perf_counter()
            snap = pm.chkpt()
            prepare_ms.append((time.perf_counter() - t) * 1e3)
            w = threading.Thread(target=persist, args=(snap, i + 1))
            w.start()
            writers = [w]
    for w in writers:
        w.join()
    elapsed = time.perf_counter() - t0

    all_keys = np.concatenate([generate_batch(seed, i, min(batch, tuples - i * batch),
                                              groups)[0] for i in range(n_batches)])
    all_ts = np.arange(tuples, dtype=np.int64)
    ek, ev = expected_aggregate(all_keys, all_ts)
    gk, gv = op.result()
    live_ok = np.array_equal(ek, gk) and np.array_equal(ev, gv)

    rebuilt_ok = None
    if last:
        pm2 = mmm.PageManager(page_bytes=page_bytes, capacity_bytes=4 << 30)
        loader = pm2.begin_load()
        loader.add(last["pages"][::-1])
        loader.finish()
        m2 = HashMap.create(pm2, "aggregate", key="<u4", value=AGG_VALUE)
        n = last["upto"] * batch
        ek2, ev2 = expected_aggregate(all_keys[:n], all_ts[:n])
        k2, v2 = m2.items()
        o = np.argsort(k2)
        rebuilt_ok = bool(np.array_equal(ek2, k2[o]) and np.array_equal(ev2, v2[o]))

    stats = pm.stats()
    result = {
        "tuples": tuples, "groups": groups, "batches": n_batches,
        "tuples_per_s": tuples / elapsed,
        "snapshots": len(prepare_ms),
        "prepare_ms_mean": float(np.mean(prepare_ms)) if prepare_ms else 0.0,
        "prepare_ms_max": float(np.max(prepare_ms)) if prepare_ms else 0.0,
        "pages_cloned": stats["pages_cloned"],
        "state_pages": stats["used_frames"],
        "state_bytes": stats["used_bytes"],
        "live_state_ok": bool(live_ok),
        "snapshot_rebuild_ok": rebuilt_ok,
    }
    out(f"Aggregate over {tuples:,} tuples, {groups:,} keys, batches of {batch:,}")
    out(f"  throughput          {result['tuples_per_s']:,.0f} tuples/s")
    out(f"  state               {stats['used_frames']} pages of {page_bytes} B "
        f"({stats['used_bytes'] / 2**20:.1f} MiB)")
    out(f"  snapshots           {len(prepare_ms)} (copy-on-write, written by a background thread)")
    out(f"  prepare time        mean {result['prepare_ms_mean']:.3f} ms, "
        f"max {result['prepare_ms_max']:.3f} ms")
    out(f"  pages cloned        {stats['pages_cloned']} (writes to frozen pages)")
    out(f"  live state          {'OK' if live_ok else 'MISMATCH'} (vs numpy oracle)")
    if rebuilt_ok is not None:
        out(f"  last snapshot       {'OK' if rebuilt_ok else 'MISMATCH'} "
            f"(rebuilt from its pages in a new page manager, state after batch {last['upto']})")
    return result


def _main(args: argparse.Namespace) -> int:
    r = run_demo(args.tuples, args.groups, args.batch, args.checkpoint_every, args.page_bytes,
                 args.seed)
    return 0 if r["live_state_ok"] and r["snapshot_rebuild_ok"] is not False else 1


def register(sub: Any) -> None:
    """Add the ``demo`` subcommand to the sguard CLI."""
    p = sub.add_parser("demo", help="run the Aggregate demo with copy-on-write snapshots")
    p.add_argument("--tuples", type=int, default=2_000_000)
    p.add_argument("--groups", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=50_000)
    p.add_argument("--checkpoint-every", type=int, default=8, help="batches between snapshots")
    p.add_argument("--page-bytes", type=int, default=1 << 16)
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=_main)
