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


def state_work_direct(n_keys: int = 100_000, partitions: int = 2, warm_batches: int = 6,
                      repeats: int = 5, local_dir: str | None = None, kind: str = "int"
                      ) -> dict[str, Any]:
    """The sguard operator's work on one partition's rows of a 100k-row batch, without Spark.

    The same code a task runs (`sguard.spark.RunningAggregate`'s state ``apply``) on the rows
    of partition 0 (keys with ``key % partitions == 0``, a stand-in for Spark's hash
    partitioner; about 50k rows at 2 partitions) of the workload's batches, in a
    file-backed pool under ``local_dir``. After ``warm_batches`` batches (all keys
    known), per repeat:

    * ``kept_ms``: ``apply`` in the process that holds the state (the partition stayed in
      its Python worker);
    * ``attach_ms`` + ``apply_after_attach_ms``: re-attaching the pool file in a fresh
      `PageManager` (`mmm.PageManager.attach`, as a worker that gets the partition from
      another worker does) and the first ``apply`` there, which pays the map's lazy index
      rebuild.

    ``kind``: the same keys as ``int64``, strings or a composite key
    (`bench._spark_variants.batch_table`; the same rows go to partition 0 in each).
    """
    import os
    import tempfile

    import pyarrow as pa
    import sguard.spark as ss

    from bench._spark_variants import KEY_COLUMNS, batch_columns, batch_table

    op = ss.RunningAggregate(value="ts", aggs=("count", "min", "max"))
    cols = KEY_COLUMNS[kind]
    key: Any = cols[0] if len(cols) == 1 else list(cols)
    schema = batch_table(8, 0, kind).schema
    d = tempfile.mkdtemp(prefix="sguard-bench-state-", dir=local_dir)
    path = os.path.join(d, "pool")

    def part(b: int) -> Any:
        k, _ = batch_columns(n_keys, b)
        return batch_table(n_keys, b, kind).filter(pa.array((k % partitions) == 0))

    pm = mmm.PageManager(capacity_bytes=1 << 30, path=path)
    st = op.open(pm, schema, key)
    for b in range(warm_batches):
        st.apply(part(b), b)
    kept, att, first, rows = [], [], [], []
    b = warm_batches
    try:
        for _ in range(repeats):
            tbl = part(b)
            rows.append(tbl.num_rows)
            t0 = time.perf_counter()
            st.apply(tbl, b)
            pm.flush_structures()
            kept.append((time.perf_counter() - t0) * 1e3)
            b += 1
            pm.flush()
            tbl = part(b)
            t0 = time.perf_counter()
            pm2 = mmm.PageManager.attach(path)
            t1 = time.perf_counter()
            st2 = op.open(pm2, schema, key)
            st2.apply(tbl, b)
            pm2.flush_structures()
            t2 = time.perf_counter()
            att.append((t1 - t0) * 1e3)
            first.append((t2 - t1) * 1e3)
            pm2.flush()
            pm2.close()
            b += 1
            pm.close()  # the other process's view is stale now: re-attach it
            pm = mmm.PageManager.attach(path)
            st = op.open(pm, schema, key)
            st.apply(part(b), b)  # rebuild its index untimed
            b += 1
    finally:
        pm.close()
        import shutil
        shutil.rmtree(d, ignore_errors=True)
    return {"n_keys": n_keys, "partitions": partitions, "rows_per_partition": float(np.mean(rows)),
            "state_keys": int(st.n_keys()) if hasattr(st, "n_keys") else None,
            "kept_ms": _st(kept), "attach_ms": _st(att), "apply_after_attach_ms": _st(first)}


def rollback_file_1m_keys(n_keys: int = 1_000_000, rows: int = 50_000, repeats: int = 5,
                          local_dir: str | None = None) -> dict[str, Any]:
    """The other rollback path of the runtime: a worker that did not apply the batch rolls
    it back in the pool *file* while attaching it (`sguard.spark.versions.attach_at` with
    the rollback point's page table), then the map's first access rebuilds its index.

    Two cases, alternating: ``warm``, the worker still maps the file because it held the
    partition before (what Spark's ``local[2]`` does: partitions alternate between the two
    Python workers), and ``cold``, a worker mapping the file for the first time (a new
    Python worker after a crash: `sguard.spark.versions.forget_mappings` before the attach).
    The previous manager is dropped before the clock starts in both."""
    import gc
    import os
    import shutil
    import tempfile

    from sguard.spark.versions import attach_at, forget_mappings

    d = tempfile.mkdtemp(prefix="sguard-bench-rb-", dir=local_dir)
    path = os.path.join(d, "pool")
    pm = attach_at(_new_pool(path), 1 << 16, None)
    m = mmm.HashMap.create(pm, "agg", key="<i8", value=AGG_VALUE)
    keys = np.arange(n_keys, dtype=np.int64)
    for lo in range(0, n_keys, 200_000):
        k = keys[lo:lo + 200_000]
        m.upsert(k, {"ts": k}, SPEC)
    rng = np.random.default_rng(11)
    probe = np.arange(0, n_keys, 997, dtype=np.int64)
    res: dict[str, tuple[list[float], list[float]]] = {"warm": ([], []), "cold": ([], [])}
    try:
        for r in range(2 * (repeats + 1)):
            case = "cold" if r % 2 else "warm"
            before = m.get(probe)
            snap = pm.chkpt()
            base = (snap.page_ids.copy(), snap.frames.copy())
            bk = rng.integers(0, n_keys + n_keys // 20, size=rows, dtype=np.int64)
            m.upsert(bk, {"ts": np.full(rows, 10**9 + r, np.int64)}, SPEC)
            pm.flush()
            del m, snap, pm  # the process that applied the batch is gone
            gc.collect()
            if case == "cold":
                forget_mappings()
            t0 = time.perf_counter()
            pm = attach_at(path, 1 << 16, base)
            t1 = time.perf_counter()
            m = mmm.HashMap.create(pm, "agg", key="<i8", value=AGG_VALUE)
            _ = m.get(probe[:1])
            t2 = time.perf_counter()
            if not np.array_equal(before, m.get(probe)) or len(m) != n_keys:
                raise AssertionError("file rollback did not restore the state")
            if r > 1:
                res[case][0].append((t1 - t0) * 1e3)
                res[case][1].append((t2 - t1) * 1e3)
    finally:
        pm.close()
        forget_mappings()
        shutil.rmtree(d, ignore_errors=True)
    out: dict[str, Any] = {"n_keys": n_keys, "rows": rows}
    for case, (att, first) in res.items():
        out[case] = {"attach_rollback_ms": _st(att), "first_access_after_ms": _st(first),
                     "total_ms": _st([a + b for a, b in zip(att, first)])}
    out["total_ms"] = out["warm"]["total_ms"]
    return out


def _new_pool(path: str) -> str:
    mmm.PagePool(1 << 16, 1 << 30, path).flush()
    return path


def state_work_interleaved(kinds: tuple[str, ...] = ("int", "str", "composite"),
                           n_keys: int = 100_000, partitions: int = 2, warm_batches: int = 6,
                           repeats: int = 9, local_dir: str | None = None) -> dict[str, Any]:
    """The operator's ``apply`` on one partition's rows (as `state_work_direct`'s
    ``kept_ms``) for each key kind, measured steadily: one state per kind, all built and
    warmed (every key known, kernels compiled) before the clock starts, then ``repeats``
    rounds that each apply the next batch to every kind, forward order on even rounds and
    reversed on odd ones, so drift and order effects fall on every kind alike. The inputs
    are built before each round (outside the timings).

    Returns per kind the apply times (``ms``), and per non-int kind ``over_int_of_best``:
    the best (least disturbed) apply over the int path's best, the steady figure on a
    shared machine, where other load only ever adds time; ``over_int``: the per-round
    ratios of back-to-back applies (median, min, max), which show the noise.
    """
    import os
    import shutil
    import tempfile

    import pyarrow as pa
    import sguard.spark as ss

    from bench._spark_variants import KEY_COLUMNS, batch_columns, batch_table

    op = ss.RunningAggregate(value="ts", aggs=("count", "min", "max"))
    d = tempfile.mkdtemp(prefix="sguard-bench-inter-", dir=local_dir)

    def part(b: int, kind: str) -> Any:
        k, _ = batch_columns(n_keys, b)
        return batch_table(n_keys, b, kind).filter(pa.array((k % partitions) == 0))

    states: dict[str, tuple[Any, Any]] = {}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for kind in kinds:
            cols = KEY_COLUMNS[kind]
            key: Any = cols[0] if len(cols) == 1 else list(cols)
            pm = mmm.PageManager(capacity_bytes=1 << 30, path=os.path.join(d, kind))
            st = op.open(pm, batch_table(8, 0, kind).schema, key)
            for b in range(warm_batches):
                st.apply(part(b, kind), b)
            pm.flush_structures()
            states[kind] = (pm, st)
        for r in range(repeats):
            b = warm_batches + r
            order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
            tables = {kind: part(b, kind) for kind in kinds}
            for kind in order:
                pm, st = states[kind]
                t0 = time.perf_counter()
                st.apply(tables[kind], b)
                pm.flush_structures()
                times[kind].append((time.perf_counter() - t0) * 1e3)
    finally:
        for pm, _ in states.values():
            pm.close()
        shutil.rmtree(d, ignore_errors=True)
    out: dict[str, Any] = {"n_keys": n_keys, "partitions": partitions, "repeats": repeats,
                           "warm_batches": warm_batches,
                           "ms": {k: _st(v) for k, v in times.items()}}
    if "int" in kinds:
        base = np.asarray(times["int"])
        out["over_int"] = {k: _st((np.asarray(v) / base).tolist())
                           for k, v in times.items() if k != "int"}
        out["over_int_of_best"] = {k: float(np.min(v) / base.min())
                                   for k, v in times.items() if k != "int"}
    return out
