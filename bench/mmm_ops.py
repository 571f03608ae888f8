"""Paper Tables 5 and 6: operator state in mmm vs plain Python containers.

Aggregate (count / first / last timestamp per 4-byte key) over 1M tuples with
1k, 10k, 100k and 1M groups, and a windowed equi-join (symmetric, time window
``W``), each with (a) plain Python dict/list state, (b) the mmm per-record API,
(c) the mmm batch API. All variants of one experiment consume the same tuples
and their results are checked equal before any time is reported. The
aggregate also measures its hardware floor in the same run: a dense
``np.add.at`` over an array indexed by key (and, for reference, the dense
count + min + max with ``ufunc.at``); a second reference, the *hash floor*, is
the same aggregate in a minimal compiled open-addressing table (one flat array
of 32-byte records, linear probing, sized up front: what any hash map pays for
a key's random cache line), and the same table *growing* from 16 slots by doubling (what
a map that does not know the number of groups pays, as the dict does); the batch API
once more with the map sized up front (``HashMap.create(..., expected_keys=groups)``,
the counterpart of the sized floor); and the cold start of the first operator call in a
fresh process, with and without a warm numba cache.

The join's batch variant keeps both windows in `PagedDeque` pages and joins each
batch in one compiled pass (`_join_batch`); its *floor* is that same compiled
pass over the whole stream with plain numpy state. The paged windows are created
(a page manager and two structures: about 0.8 ms on this machine, a one-time cost of a
running operator) before its timed region and timed on their own
(``join_setup_ms``); ``join_batch_speedup_vs_list_with_setup`` charges that to the
stream too (with ``--quick`` about 10% of the stream's time). ``structures`` reports ns per
record of the compiled OrderedMap / PagedDeque / PagedList paths next to a numpy
floor doing the same data movement on one flat array.

Run: ``python -m bench.mmm_ops [--quick] [--parts agg,join,structures] [--out DIR]``.
Writes ``DIR/mmm_ops.json`` (default ``bench/out``; summary: ``agg_batch_speedup_vs_dict``,
``agg_batch_speedup_vs_dict_1m``, ``agg_ns_per_tuple``, ``agg_ns_per_tuple_over_floor``,
``agg_hash_floor_ns_per_tuple``, ``agg_ns_per_tuple_over_hash_floor`` (and ``_1m``),
``agg_ns_per_tuple_over_growing_hash_floor``, ``agg_hash_floor_speedup_vs_dict``,
``agg_batch_speedup_vs_dict_sized`` and ``agg_ns_per_tuple_over_hash_floor_sized`` (the
map sized by ``expected_keys``, each also ``_1m``),
``agg_growing_hash_floor_speedup_vs_dict`` (each also ``_1m``: the floors' own speedups
over the dict bound the batch speedup any hash map can reach),
``agg_record_slowdown_vs_dict_by_groups``, ``agg_cpu_time_by_groups`` (the batch and
per-record ratios in process CPU time, for a loaded machine),
``agg_cold_start_s``, ``agg_record_slowdown_vs_dict``, ``join_batch_speedup_vs_list``,
``join_record_slowdown_vs_list``, ``join_batch_over_floor``, ``join_ns_per_tuple``,
``structures_over_floor``, ``agg_conversion_ms`` (``_1m``), ``join_conversion_ms``,
``join_setup_ms`` and ``join_batch_speedup_vs_list_with_setup``) and
``DIR/mmm_ops.png``.

The Python variants (dict, lists, and the mmm per-record API, which all take Python
values) get the input as Python lists converted *before* their timed region, as
`bench.chkpt_latency` does; that ``tolist()`` conversion is timed on its own and
reported as ``*_conversion_ms``, charged to no variant and excluded from every ratio.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import numpy as np

import mmm
from bench._harness import figure, parse_args, save_figure, stats, write_result
from bench._latency_loop import dict_update
from mmm import jit
from mmm.structures.ordered_map import OrderedMap
from mmm.structures.sequence import PagedDeque, PagedList
from sguard.operators import AGG_VALUE, Aggregate

AGG_SPEC = {"count": "count", "first_ts": ("min", "ts"), "last_ts": ("max", "ts")}

import time

WINDOW_REC = np.dtype([("ts", "<i8"), ("key", "<u4"), ("val", "<i8")])


# -- aggregate -------------------------------------------------------------------------------
# (a) the idiomatic Python Aggregate: `dict_update`, one dict update per tuple (in
# bench._latency_loop, which the fork baseline's process imports without mmm)


def agg_dict(keys: list[int], ts: list[int]) -> dict[int, list[int]]:
    """(a) over the whole stream."""
    state: dict[int, list[int]] = {}
    dict_update(state, keys, ts)
    return state


def agg_mmm_record(keys: list[int], ts: list[int]) -> Aggregate:
    """(b) the same loop through the mmm per-record API (`HashMap.upserter`)."""
    op = Aggregate(mmm.PageManager())
    add = op.state.upserter(AGG_SPEC)
    for k, t in zip(keys, ts):
        add(k, t)
    len(op.state)  # any read applies the buffered records
    return op


def agg_mmm_batch(keys: np.ndarray, ts: np.ndarray, batch: int) -> Aggregate:
    """(c) the mmm batch API over numpy batches."""
    op = Aggregate(mmm.PageManager())
    for i in range(0, len(keys), batch):
        op.process(keys[i:i + batch], ts[i:i + batch])
    return op


class SizedAggregate(Aggregate):
    """`Aggregate` over a map sized up front for ``groups`` keys (``expected_keys``)."""

    def __init__(self, pm: mmm.PageManager, groups: int) -> None:
        self.pm = pm
        self.state = mmm.HashMap.create(pm, "aggregate", key="<u4", value=AGG_VALUE,
                                        expected_keys=groups)
        self.tuples = 0

    def process(self, keys: np.ndarray, ts: np.ndarray) -> None:
        self.state.upsert(keys, {"ts": ts}, AGG_SPEC)
        self.tuples += len(keys)


def agg_mmm_batch_sized(keys: np.ndarray, ts: np.ndarray, batch: int,
                        groups: int) -> Aggregate:
    """(c) with the map sized for the groups up front (the capacity hint)."""
    op = SizedAggregate(mmm.PageManager(), groups)
    for i in range(0, len(keys), batch):
        op.process(keys[i:i + batch], ts[i:i + batch])
    return op


def check_agg(state: dict[int, list[int]], op: Aggregate) -> None:
    k, v = op.result()
    assert len(k) == len(state)
    ref = np.array([state[x] for x in k.tolist()], dtype=np.int64)
    assert np.array_equal(ref[:, 0], v["count"]) and np.array_equal(ref[:, 1], v["first_ts"])
    assert np.array_equal(ref[:, 2], v["last_ts"])


def agg_floor(keys: np.ndarray, ts: np.ndarray, groups: int) -> tuple[float, float]:
    """Dense floors in seconds: ``np.add.at`` (count) over an array indexed by key, and
    count + min + max with ``ufunc.at`` (the same aggregate, no hashing, no pages)."""
    ki = keys.astype(np.intp)
    t = time.perf_counter()
    cnt = np.zeros(groups, np.int64)
    np.add.at(cnt, ki, 1)
    add = time.perf_counter() - t
    t = time.perf_counter()
    cnt = np.zeros(groups, np.int64)
    lo = np.full(groups, np.iinfo(np.int64).max)
    hi = np.full(groups, np.iinfo(np.int64).min)
    np.add.at(cnt, ki, 1)
    np.minimum.at(lo, ki, ts)
    np.maximum.at(hi, ki, ts)
    return add, time.perf_counter() - t


@jit
def _hash_table_agg(keys: Any, ts: Any, cap: int) -> Any:
    """The same count/min/max aggregate in a minimal open-addressing hash table: one flat
    array of 32-byte records (key + 1, count, min, max; key 0 means empty), linear probing
    from a multiplicative hash, no pages, no growth (sized for the groups up front)."""
    tab = np.zeros((cap, 4), np.int64)
    mask = cap - 1
    for i in range(keys.shape[0]):
        k = np.int64(keys[i]) + 1
        t = ts[i]
        j = np.int64((np.uint64(k) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) & mask
        while True:
            if tab[j, 0] == k:
                tab[j, 1] += 1
                if t < tab[j, 2]:
                    tab[j, 2] = t
                if t > tab[j, 3]:
                    tab[j, 3] = t
                break
            if tab[j, 0] == 0:
                tab[j, 0] = k
                tab[j, 1] = 1
                tab[j, 2] = t
                tab[j, 3] = t
                break
            j = (j + 1) & mask
    return tab


@jit
def _doubled(tab: Any) -> Any:
    """`_hash_table_agg`'s table rehashed into twice the slots."""
    cap = 2 * tab.shape[0]
    out = np.zeros((cap, 4), np.int64)
    for s in range(tab.shape[0]):
        k = tab[s, 0]
        if k != 0:
            h = (np.uint64(k) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
            j = np.int64(h) & (cap - 1)
            while out[j, 0] != 0:
                j = (j + 1) & (cap - 1)
            out[j, :] = tab[s, :]
    return out


@jit
def _hash_table_agg_growing(keys: Any, ts: Any) -> Any:
    """`_hash_table_agg` without knowing the number of groups: from 16 slots, doubled
    (`_doubled`, every record rehashed into fresh memory) when it would be more than half
    full, as any map of unknown final size grows (a Python dict too). Its probe repeats
    `_hash_table_agg`'s on purpose: one loop for both (the growth check inside) or a
    shared ``inline="always"`` step made the sized floor about 2x slower (measured),
    and a slower floor would flatter every ratio against it."""
    tab = np.zeros((16, 4), np.int64)
    used = 0
    for i in range(keys.shape[0]):
        if 2 * (used + 1) > tab.shape[0]:
            tab = _doubled(tab)
        mask = tab.shape[0] - 1
        k = np.int64(keys[i]) + 1
        t = ts[i]
        j = np.int64((np.uint64(k) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) & mask
        while True:
            if tab[j, 0] == k:
                tab[j, 1] += 1
                if t < tab[j, 2]:
                    tab[j, 2] = t
                if t > tab[j, 3]:
                    tab[j, 3] = t
                break
            if tab[j, 0] == 0:
                tab[j, 0] = k
                tab[j, 1] = 1
                tab[j, 2] = t
                tab[j, 3] = t
                used += 1
                break
            j = (j + 1) & mask
    return tab


def growing_hash_floor(keys: np.ndarray, ts: np.ndarray) -> tuple[float, np.ndarray]:
    """Seconds for `_hash_table_agg_growing` over the whole stream."""
    t = time.perf_counter()
    tab = _hash_table_agg_growing(keys, ts)
    return time.perf_counter() - t, tab


def hash_floor(keys: np.ndarray, ts: np.ndarray, groups: int) -> tuple[float, np.ndarray]:
    """Seconds for `_hash_table_agg` over the whole stream (table at most half full)."""
    cap = 1 << max(4, int(2 * groups - 1).bit_length())
    t = time.perf_counter()
    tab = _hash_table_agg(keys, ts, cap)
    return time.perf_counter() - t, tab


def bench_aggregate(n: int, groups: int, batch: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(groups)
    keys = rng.integers(0, groups, n, dtype=np.uint32)
    ts = rng.permutation(n).astype(np.int64)
    times: dict[str, list[float]] = {"dict": [], "mmm_record": [], "mmm_batch": [],
                                     "mmm_batch_sized": [],
                                     "floor_add_at": [], "floor_count_min_max": [],
                                     "floor_hash_table": [], "floor_hash_table_growing": [],
                                     "conversion": []}
    cpu: dict[str, list[float]] = {"dict": [], "mmm_record": [], "mmm_batch": []}
    hash_floor(keys[:100], ts[:100], 100)  # compile (or load from the cache) untimed
    growing_hash_floor(keys[:100], ts[:100])
    for _ in range(repeats):
        # A Python operator receives Python values: the numpy -> list conversion is timed
        # on its own (``conversion``), outside every variant's timed region, as
        # `bench.chkpt_latency` converts outside its timing.
        t = time.perf_counter()
        kl, tl = keys.tolist(), ts.tolist()
        times["conversion"].append(time.perf_counter() - t)
        t, c = time.perf_counter(), time.process_time()
        d = agg_dict(kl, tl)
        times["dict"].append(time.perf_counter() - t)
        cpu["dict"].append(time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        r = agg_mmm_record(kl, tl)
        times["mmm_record"].append(time.perf_counter() - t)
        cpu["mmm_record"].append(time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        b = agg_mmm_batch(keys, ts, batch)
        times["mmm_batch"].append(time.perf_counter() - t)
        cpu["mmm_batch"].append(time.process_time() - c)
        t = time.perf_counter()
        bs = agg_mmm_batch_sized(keys, ts, batch, groups)
        times["mmm_batch_sized"].append(time.perf_counter() - t)
        fa, fc = agg_floor(keys, ts, groups)
        times["floor_add_at"].append(fa)
        times["floor_count_min_max"].append(fc)
        fh, tab = hash_floor(keys, ts, groups)
        times["floor_hash_table"].append(fh)
        fg, gtab = growing_hash_floor(keys, ts)
        times["floor_hash_table_growing"].append(fg)
        check_agg(d, r)
        check_agg(d, b)
        check_agg(d, bs)
        for t_ in (tab, gtab):
            used = t_[t_[:, 0] != 0]
            assert len(used) == len(d) and int(used[:, 1].sum()) == n
            assert all(d[int(k) - 1] == [c, lo, hi] for k, c, lo, hi in used[:100].tolist())
        del d, r, b, bs, kl, tl
    out: dict[str, Any] = {name: stats(v) for name, v in times.items()}
    out["conversion_ms"] = out["conversion"]["min"] * 1e3
    out["batch_speedup_vs_dict"] = out["dict"]["min"] / out["mmm_batch"]["min"]
    out["batch_speedup_vs_dict_sized"] = out["dict"]["min"] / out["mmm_batch_sized"]["min"]
    out["batch_sized_over_hash_floor"] = (out["mmm_batch_sized"]["min"]
                                          / out["floor_hash_table"]["min"])
    out["record_slowdown_vs_dict"] = out["mmm_record"]["min"] / out["dict"]["min"]
    out["ns_per_tuple"] = {name: 1e9 * out[name]["min"] / n for name in times}
    out["batch_over_floor"] = out["mmm_batch"]["min"] / out["floor_add_at"]["min"]
    out["batch_over_count_min_max_floor"] = (out["mmm_batch"]["min"]
                                             / out["floor_count_min_max"]["min"])
    out["batch_over_hash_floor"] = out["mmm_batch"]["min"] / out["floor_hash_table"]["min"]
    out["batch_over_growing_hash_floor"] = (out["mmm_batch"]["min"]
                                            / out["floor_hash_table_growing"]["min"])
    # what the dict ratio could be at best: a map sized up front / one that grows
    out["hash_floor_speedup_vs_dict"] = out["dict"]["min"] / out["floor_hash_table"]["min"]
    out["growing_hash_floor_speedup_vs_dict"] = (out["dict"]["min"]
                                                 / out["floor_hash_table_growing"]["min"])
    # the same ratios in process CPU time (user + system): on a shared, loaded machine they
    # do not count the time the process waited for a core
    cmin = {name: min(v) for name, v in cpu.items()}
    out["cpu_time"] = {"batch_speedup_vs_dict": cmin["dict"] / cmin["mmm_batch"],
                       "record_slowdown_vs_dict": cmin["mmm_record"] / cmin["dict"],
                       "ns_per_tuple": {name: 1e9 * v / n for name, v in cmin.items()}}
    return out


_COLD = """
import time
t0 = time.perf_counter()
import numpy as np
import mmm
from sguard.operators import Aggregate
op = Aggregate(mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22))
op.process(np.arange(100, dtype="<u4"), np.arange(100, dtype=np.int64))
op.process_record(5, 7)
assert len(op.state) == 100
print(time.perf_counter() - t0)
"""


def cold_start() -> dict[str, float]:
    """Seconds from interpreter start to the first batch and per-record call done, in a
    fresh process: with empty numba and bytecode caches (everything compiles) and with
    warm ones. The bytecode cache is the child's own (``PYTHONPYCACHEPREFIX`` in the
    temporary directory, written whatever ``PYTHONDONTWRITEBYTECODE`` says here): an
    installed package has its ``.pyc`` files, and without them every import compiles
    the sources again (0.1-0.2 s of the warm figure, measured)."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache,
                   PYTHONPYCACHEPREFIX=os.path.join(cache, "pyc"))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        for label in ("no_cache", "warm_cache", "warm_cache_2"):
            res = subprocess.run([sys.executable, "-c", _COLD], env=env, check=True,
                                 capture_output=True, text=True)
            out[label] = float(res.stdout.strip().splitlines()[-1])
    out["warm_cache"] = min(out["warm_cache"], out.pop("warm_cache_2"))
    return out


# -- windowed equi-join ------------------------------------------------------------------------
def join_stream(n: int, keys: int, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Interleaved tuples of two streams in timestamp order: (records, side)."""
    rng = np.random.default_rng(seed)
    rec = np.zeros(n, WINDOW_REC)
    rec["ts"] = np.cumsum(rng.integers(1, 4, n))
    rec["key"] = rng.integers(0, keys, n)
    rec["val"] = rng.integers(0, 1000, n)
    side = rng.integers(0, 2, n).astype(np.int8)
    return rec, side


def join_lists(rec: np.ndarray, side: np.ndarray) -> tuple[list[Any], list[int]]:
    """The stream as Python values (what a Python operator receives): timed on its own."""
    return rec.tolist(), side.tolist()


def join_list(rec: list[Any], side: list[int], window: int) -> tuple[int, int]:
    """(a) Python: per side a deque for eviction and a dict key -> deque of (ts, val).
    Takes the stream as Python values (`join_lists`, converted outside the timing)."""
    wins = [deque(), deque()]
    idx: list[dict[int, deque]] = [{}, {}]
    count = checksum = 0
    for (ts, key, val), x in zip(rec, side):
        y = 1 - x
        wy, iy = wins[y], idx[y]
        while wy and wy[0][0] < ts - window:  # evict the other side's old tuples
            ots, okey, _ = wy.popleft()
            dq = iy[okey]
            dq.popleft()
            if not dq:
                del iy[okey]
        for _, oval in iy.get(key, ()):
            count += 1
            checksum += val * oval
        wins[x].append((ts, key, val))
        ix = idx[x]
        dq = ix.get(key)
        if dq is None:
            ix[key] = dq = deque()
        dq.append((ts, val))
    return count, checksum


def join_mmm_record(rec: list[Any], side: list[int], window: int) -> tuple[int, int]:
    """(b) mmm per-record: a PagedDeque window and an OrderedMap index (key, ts) -> val,
    through the per-record API, which takes and returns plain Python values
    (`PagedDeque.popleft_before`, `PagedDeque.append`, ``m[k] = v``, ``del m[k]``,
    `OrderedMap.range_lists`). Takes the stream as Python values, like `join_list`."""
    pm = mmm.PageManager()
    wins = [PagedDeque.create(pm, f"win{i}", WINDOW_REC) for i in (0, 1)]
    idx = [OrderedMap.create(pm, f"idx{i}", key="<u8", value="<i8") for i in (0, 1)]
    count = checksum = 0
    for (ts, key, val), x in zip(rec, side):
        y = 1 - x
        wy, iy = wins[y], idx[y]
        for ots, okey, _ in wy.popleft_before(ts - window, "ts"):  # evict old tuples
            del iy[(okey << 40) | ots]
        vals = iy.range_lists(key << 40, (key << 40) | ts)[1]
        count += len(vals)
        checksum += val * sum(vals)
        wins[x].append((ts, key, val))
        idx[x][(key << 40) | ts] = val
    return count, checksum


@jit
def _join_slot(tkey: Any, k: int) -> int:
    """Slot of key ``k`` in the open-addressing table ``tkey`` (-1 marks an empty slot;
    the key is claimed if absent)."""
    mask = tkey.shape[0] - 1
    h = (k * 0x9E3779B1) & mask
    while tkey[h] != k and tkey[h] != -1:
        h = (h + 1) & mask
    tkey[h] = k
    return h


@jit
def _join_batch(w0k: Any, w0t: Any, w0v: Any, w1k: Any, w1t: Any, w1v: Any, bk: Any, bt: Any,
                bv: Any, bs: Any, window: int) -> Any:
    """The symmetric windowed equi-join of one batch against both windows: each batch
    tuple (in ts order) meets the other side's tuples with ``ts >= t - window`` that came
    before it (the windows' records, then the batch's earlier ones). One hash table on
    the key holds, per side, the head of a chain of that key's records (newest first),
    so each batch tuple costs one probe. ``(pairs, checksum)``."""
    n = w0k.shape[0] + w1k.shape[0] + bk.shape[0]
    sz = 16
    while sz < 2 * n:
        sz <<= 1
    tkey = np.full(sz, -1, np.int64)
    head = np.full((sz, 2), -1, np.int64)
    T = np.empty(n, np.int64)
    V = np.empty(n, np.int64)
    P = np.empty(n, np.int64)
    m = 0
    for i in range(w0k.shape[0]):
        h = _join_slot(tkey, np.int64(w0k[i]))
        T[m] = w0t[i]
        V[m] = w0v[i]
        P[m] = head[h, 0]
        head[h, 0] = m
        m += 1
    for i in range(w1k.shape[0]):
        h = _join_slot(tkey, np.int64(w1k[i]))
        T[m] = w1t[i]
        V[m] = w1v[i]
        P[m] = head[h, 1]
        head[h, 1] = m
        m += 1
    count = 0
    checksum = 0
    for i in range(bk.shape[0]):
        t = np.int64(bt[i])
        v = np.int64(bv[i])
        x = np.int64(bs[i])
        h = _join_slot(tkey, np.int64(bk[i]))
        pos = head[h, 1 - x]
        while pos >= 0 and T[pos] >= t - window:
            count += 1
            checksum += v * V[pos]
            pos = P[pos]
        T[m] = t
        V[m] = v
        P[m] = head[h, x]
        head[h, x] = m
        m += 1
    return count, checksum


def join_floor(rec: np.ndarray, side: np.ndarray, window: int) -> tuple[int, int]:
    """The floor: the same compiled join over the whole stream at once, state in
    plain numpy arrays (no paged state, no batches)."""
    e = np.zeros(0, np.int64)
    c, s = _join_batch(e, e, e, e, e, e, rec["key"], rec["ts"], rec["val"], side, window)
    return int(c), int(s)


def join_windows() -> list[PagedDeque]:
    """The state of (c): a page manager and the two window `PagedDeque`s (created once by
    a running operator; timed on its own, ``join_setup_ms``)."""
    pm = mmm.PageManager()
    return [PagedDeque.create(pm, f"win{i}", WINDOW_REC) for i in (0, 1)]


def join_mmm_batch(rec: np.ndarray, side: np.ndarray, window: int, batch: int,
                   wins: list[PagedDeque] | None = None) -> tuple[int, int]:
    """(c) mmm batch: the two windows are PagedDeques (`evict_before` a ts bound,
    `extend`, span reads); each batch is joined by one compiled pass that indexes
    the other window and the batch's earlier tuples by key (`_join_batch`). `wins`:
    empty windows made by `join_windows` (default: made here)."""
    if wins is None:
        wins = join_windows()
    count = checksum = 0
    for i in range(0, len(rec), batch):
        b, bs = rec[i:i + batch], side[i:i + batch]
        lo = int(b["ts"][0])
        for w in wins:
            w.evict_before(lo - window, "ts")
        w0, w1 = wins[0].to_numpy(), wins[1].to_numpy()
        c, s = _join_batch(w0["key"], w0["ts"], w0["val"], w1["key"], w1["ts"], w1["val"],
                           b["key"], b["ts"], b["val"], bs, window)
        count += int(c)
        checksum += int(s)
        raw = b.view(np.uint8).reshape(-1, b.dtype.itemsize)  # split by side as byte rows:
        for x in (0, 1):  # np.compress of rows is 2x a boolean mask over raw records, ~30x
            wins[x].extend(np.compress(bs == x, raw, axis=0).view(b.dtype).reshape(-1))  # packed structs
    return count, checksum


def bench_join(n: int, n_record: int, keys: int, window: int, batch: int, repeats: int
               ) -> dict[str, Any]:
    rec, side = join_stream(n, keys)
    join_mmm_batch(rec[:2 * batch], side[:2 * batch], window, batch)  # compile / load kernels
    join_mmm_record(*join_lists(rec[:200], side[:200]), window)
    times: dict[str, list[float]] = {"list": [], "mmm_record": [], "mmm_batch": [], "floor": [],
                                     "list_record": [], "conversion": [], "setup": []}
    for _ in range(repeats):
        # the numpy -> Python values conversion of the stream, timed on its own and charged
        # to no variant (``conversion_ms``)
        t = time.perf_counter()
        rl, sl = join_lists(rec, side)
        times["conversion"].append((time.perf_counter() - t) / n)
        t = time.perf_counter()
        ref = join_list(rl, sl, window)
        times["list"].append((time.perf_counter() - t) / n)
        # the paged windows' creation (a page manager, two structures: a one-time cost of
        # a running operator) is timed on its own, as the list variant's two deques and
        # dicts are created (in ~1 us) inside its timing
        t = time.perf_counter()
        wins = join_windows()
        times["setup"].append((time.perf_counter() - t) / n)
        t = time.perf_counter()
        got = join_mmm_batch(rec, side, window, batch, wins)
        times["mmm_batch"].append((time.perf_counter() - t) / n)
        del wins
        assert got == ref, (got, ref)
        t = time.perf_counter()
        got_f = join_floor(rec, side, window)
        times["floor"].append((time.perf_counter() - t) / n)
        assert got_f == ref, (got_f, ref)
        # the per-record run is shorter: its list baseline is timed on the same prefix
        rl, sl = rl[:n_record], sl[:n_record]
        t = time.perf_counter()
        ref_r = join_list(rl, sl, window)
        times["list_record"].append((time.perf_counter() - t) / n_record)
        t = time.perf_counter()
        got_r = join_mmm_record(rl, sl, window)
        times["mmm_record"].append((time.perf_counter() - t) / n_record)
        assert got_r == ref_r, (got_r, ref_r)
    out: dict[str, Any] = {name + "_s_per_tuple": stats(v) for name, v in times.items()}
    out["result"] = {"pairs": ref[0], "checksum": ref[1]}
    mins = {name: out[name + "_s_per_tuple"]["min"] for name in times}
    out["ns_per_tuple"] = {name: v * 1e9 for name, v in mins.items()}
    out["conversion_ms"] = mins["conversion"] * n * 1e3
    out["setup_ms"] = mins["setup"] * n * 1e3
    out["setup_ms_max"] = max(times["setup"]) * n * 1e3
    out["batch_speedup_vs_list"] = mins["list"] / mins["mmm_batch"]
    # the same with the windows' creation charged to this stream (its median over repeats)
    out["batch_speedup_vs_list_with_setup"] = mins["list"] / (
        mins["mmm_batch"] + float(np.median(times["setup"])))
    out["batch_over_floor"] = mins["mmm_batch"] / mins["floor"]
    out["record_slowdown_vs_list"] = mins["mmm_record"] / mins["list_record"]
    # the same ratios per repeat (same-run pairs), for the spread
    out["batch_speedup_vs_list_per_repeat"] = [
        a / b for a, b in zip(times["list"], times["mmm_batch"])]
    out["record_slowdown_vs_list_per_repeat"] = [
        a / b for a, b in zip(times["mmm_record"], times["list_record"])]
    return out


# -- per-structure ns/record against a numpy floor ------------------------------------------------
def _best(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_structures(n: int, repeats: int) -> dict[str, Any]:
    """ns per record of the compiled structure paths, each next to a numpy floor doing the
    same data movement on one flat in-memory array (no pages, no copy-on-write)."""
    rng = np.random.default_rng(7)
    keys = rng.permutation(n * 4)[:n].astype("<u8")
    vals = np.arange(n, dtype="<i8")
    probe = rng.permutation(keys)
    out: dict[str, dict[str, float]] = {}

    def om_put() -> OrderedMap:
        pm = mmm.PageManager(capacity_bytes=256 << 20)
        m = OrderedMap.create(pm, "m", key="<u8", value="<i8")
        for i in range(0, n, 8192):
            m.put(keys[i:i + 8192], vals[i:i + 8192])
        return m

    m = om_put()
    sk = np.sort(keys)

    def floor_put() -> None:
        arr = np.zeros(0, "<u8")
        for i in range(0, n, 8192):
            arr = np.sort(np.concatenate([arr, keys[i:i + 8192]]))  # a sorted array, batch-merged

    out["ordered_map_put_batch"] = {"mmm": _best(om_put, repeats), "floor": _best(floor_put,
                                                                                   repeats)}
    out["ordered_map_get"] = {"mmm": _best(lambda: m.get(probe), repeats),
                              "floor": _best(lambda: np.searchsorted(sk, probe), repeats)}
    out["ordered_map_range_scan"] = {"mmm": _best(lambda: m.range(None, None), repeats),
                                     "floor": _best(lambda: (sk[1:].copy(), vals[1:].copy()),
                                                    repeats)}
    rec = np.zeros(n, WINDOW_REC)
    rec["ts"] = np.arange(n)

    def dq_run() -> None:
        pm = mmm.PageManager(capacity_bytes=256 << 20)
        d = PagedDeque.create(pm, "d", WINDOW_REC)
        for i in range(0, n, 4096):
            d.extend(rec[i:i + 4096])
            d.evict_before(i - 20_000, "ts")

    def dq_floor() -> None:
        buf = np.empty(n, WINDOW_REC)
        lo = 0
        for i in range(0, n, 4096):
            buf[i:i + 4096] = rec[i:i + 4096]
            lo += int(np.searchsorted(buf["ts"][lo:i + 4096], i - 20_000))

    out["deque_extend_evict"] = {"mmm": _best(dq_run, repeats), "floor": _best(dq_floor, repeats)}
    pm = mmm.PageManager(capacity_bytes=256 << 20)
    lst = PagedList.create(pm, "l", WINDOW_REC)
    lst.extend(rec)
    flat = rec.copy()

    def l_write() -> None:
        lst[1000:n - 1000] = rec[1000:n - 1000]

    def f_write() -> None:
        flat[1000:n - 1000] = rec[1000:n - 1000]

    out["list_span_read"] = {"mmm": _best(lambda: lst[1000:n - 1000], repeats),
                             "floor": _best(lambda: flat[1000:n - 1000].copy(), repeats)}
    out["list_span_write"] = {"mmm": _best(l_write, repeats), "floor": _best(f_write, repeats)}
    res: dict[str, Any] = {}
    for name, t in out.items():
        res[name] = {"mmm_ns_per_record": t["mmm"] / n * 1e9,
                     "floor_ns_per_record": t["floor"] / n * 1e9,
                     "over_floor": t["mmm"] / t["floor"]}
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and join tuples")
    ap.add_argument("--tuples", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=65536, help="batch size of the batch API")
    ap.add_argument("--parts", default="agg,join,structures",
                    help="comma-separated experiments to run (agg, join, structures)")
    ap.add_argument("--no-cold-start", dest="cold_start", action="store_false",
                    help="leave out agg's cold start (a fresh process compiling every kernel "
                         "into an empty numba cache: ~40 s)")
    args = parse_args(ap, argv)
    parts = set(args.parts.split(","))
    if not parts <= {"agg", "join", "structures"}:
        ap.exit(2, f"{ap.prog}: error: argument --parts: {args.parts!r}: choose among agg, join, structures\n")
    repeats = 2 if args.quick else 5
    params = {"tuples": args.tuples, "batch": args.batch, "repeats": repeats,
              "groups": [1000, 10_000, 100_000, 1_000_000], "join_window": 2000, "join_keys": 1000}
    agg: dict[str, Any] = {}
    for g in params["groups"] if "agg" in parts else []:
        agg[str(g)] = bench_aggregate(args.tuples, g, args.batch, repeats)
        a = agg[str(g)]
        print(f"aggregate {g:>7} groups: batch {a['batch_speedup_vs_dict']:.2f}x faster than "
              f"dict ({a['ns_per_tuple']['mmm_batch']:.0f} ns/tuple, "
              f"{a['batch_over_floor']:.1f}x the np.add.at floor of "
              f"{a['ns_per_tuple']['floor_add_at']:.1f} ns; {a['batch_over_hash_floor']:.1f}x "
              f"a minimal hash table's {a['ns_per_tuple']['floor_hash_table']:.1f} ns, "
              f"{a['batch_over_growing_hash_floor']:.1f}x the same table grown from empty: "
              f"{a['ns_per_tuple']['floor_hash_table_growing']:.1f} ns); sized up front "
              f"{a['batch_speedup_vs_dict_sized']:.2f}x faster than dict "
              f"({a['ns_per_tuple']['mmm_batch_sized']:.0f} ns/tuple, "
              f"{a['batch_sized_over_hash_floor']:.1f}x the sized table), per-record "
              f"{a['record_slowdown_vs_dict']:.2f}x the dict time; in CPU time "
              f"{a['cpu_time']['batch_speedup_vs_dict']:.2f}x and "
              f"{a['cpu_time']['record_slowdown_vs_dict']:.2f}x; tolist() of the input "
              f"{a['conversion_ms']:.0f} ms (not timed in any variant)")
    cold = cold_start() if "agg" in parts and args.cold_start else {}
    if cold:
        print(f"cold start (import + first calls): {cold['no_cache']:.2f} s without a numba "
              f"cache, {cold['warm_cache']:.2f} s with a warm one")
    n_join = 100_000 if args.quick else 400_000
    join: dict[str, Any] = {}
    if "join" in parts:
        join = bench_join(n_join, 5_000 if args.quick else 20_000, params["join_keys"],
                          params["join_window"], 8192, 3 if args.quick else 5)
        print(f"windowed join: batch {join['batch_speedup_vs_list']:.2f}x faster than lists "
              f"({join['batch_over_floor']:.2f}x the compiled floor), per-record "
              f"{join['record_slowdown_vs_list']:.2f}x the list time; tolist() of the stream "
              f"{join['conversion_ms']:.0f} ms (not timed); the paged windows' creation "
              f"{join['setup_ms']:.2f} ms (up to {join['setup_ms_max']:.2f}; timed apart: "
              f"{join['batch_speedup_vs_list_with_setup']:.2f}x with it); ns/tuple "
              + ", ".join(f"{k} {v:.0f}" for k, v in join["ns_per_tuple"].items()))
    structures: dict[str, Any] = {}
    if "structures" in parts:
        structures = bench_structures(100_000 if args.quick else 400_000, 3 if args.quick else 5)
        for name, r in structures.items():
            print(f"{name:>24}: {r['mmm_ns_per_record']:7.1f} ns/record, floor "
                  f"{r['floor_ns_per_record']:6.1f} ({r['over_floor']:.2f}x)")
    summary: dict[str, Any] = {"targets": {}}
    if agg:
        summary.update({
            "agg_batch_speedup_vs_dict": agg["100000"]["batch_speedup_vs_dict"],
            "agg_batch_speedup_vs_dict_1m": agg["1000000"]["batch_speedup_vs_dict"],
            "agg_ns_per_tuple": agg["100000"]["ns_per_tuple"]["mmm_batch"],
            "agg_floor_ns_per_tuple": agg["100000"]["ns_per_tuple"]["floor_add_at"],
            "agg_ns_per_tuple_over_floor": agg["100000"]["batch_over_floor"],
            "agg_ns_per_tuple_over_floor_1m": agg["1000000"]["batch_over_floor"],
            "agg_hash_floor_ns_per_tuple": agg["100000"]["ns_per_tuple"]["floor_hash_table"],
            "agg_ns_per_tuple_over_hash_floor": agg["100000"]["batch_over_hash_floor"],
            "agg_ns_per_tuple_over_hash_floor_1m": agg["1000000"]["batch_over_hash_floor"],
            # the same floor without knowing the groups up front (it grows by doubling), and
            # both floors' speedups over the dict: the bound of the batch speedup targets
            "agg_ns_per_tuple_over_growing_hash_floor":
                agg["100000"]["batch_over_growing_hash_floor"],
            "agg_ns_per_tuple_over_growing_hash_floor_1m":
                agg["1000000"]["batch_over_growing_hash_floor"],
            # the map sized by expected_keys, against the table sized up front
            "agg_batch_speedup_vs_dict_sized": agg["100000"]["batch_speedup_vs_dict_sized"],
            "agg_batch_speedup_vs_dict_1m_sized":
                agg["1000000"]["batch_speedup_vs_dict_sized"],
            "agg_ns_per_tuple_over_hash_floor_sized":
                agg["100000"]["batch_sized_over_hash_floor"],
            "agg_ns_per_tuple_over_hash_floor_1m_sized":
                agg["1000000"]["batch_sized_over_hash_floor"],
            "agg_hash_floor_speedup_vs_dict": agg["100000"]["hash_floor_speedup_vs_dict"],
            "agg_hash_floor_speedup_vs_dict_1m": agg["1000000"]["hash_floor_speedup_vs_dict"],
            "agg_growing_hash_floor_speedup_vs_dict":
                agg["100000"]["growing_hash_floor_speedup_vs_dict"],
            "agg_growing_hash_floor_speedup_vs_dict_1m":
                agg["1000000"]["growing_hash_floor_speedup_vs_dict"],
            "agg_record_slowdown_vs_dict_by_groups": {
                g: a["record_slowdown_vs_dict"] for g, a in agg.items()},
            "agg_cpu_time_by_groups": {g: a["cpu_time"] for g, a in agg.items()},
            "agg_record_slowdown_vs_dict": agg["100000"]["record_slowdown_vs_dict"],
            "agg_cold_start_s": cold or None,  # None: --no-cold-start
            # numpy -> Python lists of the input, charged to no variant (ms, 1M tuples)
            "agg_conversion_ms": agg["100000"]["conversion_ms"],
            "agg_conversion_ms_1m": agg["1000000"]["conversion_ms"]})
        summary["targets"].update({"agg_batch_speedup_vs_dict": ">= 20",
                                   "agg_batch_speedup_vs_dict_1m": ">= 15",
                                   "agg_batch_speedup_vs_dict_1m_sized": ">= 15",
                                   "agg_ns_per_tuple_over_growing_hash_floor": "<= 1.0",
                                   "agg_ns_per_tuple_over_growing_hash_floor_1m": "<= 1.0",
                                   "agg_ns_per_tuple_over_floor": "<= 4",
                                   "agg_record_slowdown_vs_dict": "<= 1",
                                   "agg_cold_start_s.warm_cache": "<= 0.5"})
    if join:
        summary.update({
            "join_batch_speedup_vs_list": join["batch_speedup_vs_list"],
            "join_record_slowdown_vs_list": join["record_slowdown_vs_list"],
            "join_batch_over_floor": join["batch_over_floor"],
            "join_ns_per_tuple": join["ns_per_tuple"],
            "join_conversion_ms": join["conversion_ms"],
            "join_setup_ms": join["setup_ms"],
            "join_batch_speedup_vs_list_with_setup": join["batch_speedup_vs_list_with_setup"],
            "join_batch_speedup_vs_list_per_repeat": join["batch_speedup_vs_list_per_repeat"]})
        summary["targets"].update({"join_batch_speedup_vs_list": ">= 10",
                                   "join_record_slowdown_vs_list": "<= 3"})
    if structures:
        summary["structures_over_floor"] = {k: v["over_floor"] for k, v in structures.items()}
        summary["structures_ns_per_record"] = {k: v["mmm_ns_per_record"]
                                               for k, v in structures.items()}
    path = write_result("mmm_ops", summary, {"aggregate": agg, "join": join,
                                             "structures": structures}, params)
    plt, png = figure("mmm_ops")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    gs = params["groups"]
    for name, label in (("dict", "(a) dict"), ("mmm_record", "(b) mmm per-record"),
                        ("mmm_batch", "(c) mmm batch"),
                        ("mmm_batch_sized", "(c) sized (expected_keys)")):
        if agg:
            a1.plot(gs, [args.tuples / agg[str(g)][name]["min"] / 1e6 for g in gs], "o-",
                    label=label)
    a1.set_xscale("log")
    a1.set_xlabel("groups")
    a1.set_ylabel("million tuples / s")
    a1.set_title(f"Aggregate over {args.tuples:,} tuples")
    a1.legend()
    names = ["list", "mmm_record", "mmm_batch", "floor"]
    if join:
        a2.bar(["(a) dict+deque", "(b) mmm per-record", "(c) mmm batch", "compiled floor"],
               [1e-6 / join[f"{nm}_s_per_tuple"]["min"] for nm in names])
    a2.set_ylabel("million tuples / s")
    a2.set_title(f"Windowed equi-join (W={params['join_window']})")
    return save_figure(fig, png, path)


if __name__ == "__main__":
    raise SystemExit(main())
