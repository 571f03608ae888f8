"""Measurements of `bench.spark_stateful` that need no Spark: rollback on mmm.

`rollback_1m_keys`: a `mmm.HashMap` holding the running aggregate of 1M int64 keys; per
repeat, freeze it (``pm.chkpt()``, the rollback point "after b-1"), apply one 50k-row
partition of a batch (keys drawn over 1.05M keys, so a few are new and the map may grow),
then time ``pm.rollback(snap)`` and, separately, the first access after it (the map's
lazy index rebuild), which the next batch pays. The state is checked against a copy
taken before the batch after every repeat (untimed).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

import mmm

AGG_VALUE = np.dtype([("count", "<i8"), ("min_ts", "<i8"), ("max_ts", "<i8")])
SPEC = {"count": "count", "min_ts": ("min", "ts"), "max_ts": ("max", "ts")}


def rollback_1m_keys(n_keys: int = 1_000_000, rows: int = 50_000, repeats: int = 7,
                     page_bytes: int = 64 << 10) -> dict[str, Any]:
    """Times (ms) to roll one partition-batch back in an ``n_keys``-key state."""
    pm = mmm.PageManager(page_bytes=page_bytes, capacity_bytes=1 << 30)
    m = mmm.HashMap.create(pm, "agg", key="<i8", value=AGG_VALUE)
    keys = np.arange(n_keys, dtype=np.int64)
    for lo in range(0, n_keys, 200_000):  # build in chunks like a stream would
        k = keys[lo:lo + 200_000]
        m.upsert(k, {"ts": k}, SPEC)
    n_pages = int(pm.stats().get("used_frames", 0)) if hasattr(pm, "stats") else 0
    rng = np.random.default_rng(7)
    rb, first, touched = [], [], []
    probe = np.arange(0, n_keys, 997, dtype=np.int64)
    for r in range(repeats + 1):
        before = m.get(probe)
        n_before = len(m)
        snap = pm.chkpt()
        bk = rng.integers(0, n_keys + n_keys // 20, size=rows, dtype=np.int64)
        cloned0 = pm.stats_pages_cloned
        m.upsert(bk, {"ts": np.full(rows, 10**9 + r, np.int64)}, SPEC)
        cloned = pm.stats_pages_cloned - cloned0
        t0 = time.perf_counter()
        pm.rollback(snap)
        t1 = time.perf_counter()
        _ = m.get(probe[:1])  # the first access after the rollback rebuilds the index
        t2 = time.perf_counter()
        after = m.get(probe)
        if len(m) != n_before or not np.array_equal(before, after):
            raise AssertionError("rollback did not restore the state")
        if r > 0:  # first repeat is a warm-up
            rb.append((t1 - t0) * 1e3)
            first.append((t2 - t1) * 1e3)
            touched.append(cloned)
    return {"n_keys": n_keys, "rows": rows, "page_bytes": page_bytes, "pages_total": n_pages,
            "pages_touched_per_batch": float(np.median(touched)),
            "rollback_ms": _st(rb), "first_access_after_ms": _st(first),
            "rollback_plus_rebuild_ms": _st([a + b for a, b in zip(rb, first)])}


def _st(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs, float)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()),
            "n": int(len(a))}
