"""Paper Tables 5 and 6: operator state in mmm vs plain Python containers.

Aggregate (count / first / last timestamp per 4-byte key) over 1M tuples with
1k, 10k and 100k groups, and a windowed equi-join (symmetric, time window
``W``), each with (a) plain Python dict/list state, (b) the mmm per-record API,
(c) the mmm batch API. All variants of one experiment consume the same tuples
and their results are checked equal before any time is reported.

Run: ``python -m bench.mmm_ops [--quick]``. Writes ``bench/results/mmm_ops.json``
(summary: ``agg_batch_speedup_vs_dict``, ``agg_record_slowdown_vs_dict``,
``join_batch_speedup_vs_list``) and ``bench/results/mmm_ops.png``.
"""
from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

import mmm
from bench._harness import figure, parse_args, stats, write_result
from mmm.structures.ordered_map import OrderedMap
from mmm.structures.sequence import PagedDeque
from sguard.operators import Aggregate

AGG_SPEC = {"count": "count", "first_ts": ("min", "ts"), "last_ts": ("max", "ts")}

import time

WINDOW_REC = np.dtype([("ts", "<i8"), ("key", "<u4"), ("val", "<i8")])


# -- aggregate -------------------------------------------------------------------------------
def dict_update(state: dict[int, list[int]], keys: list[int], ts: list[int]) -> None:
    """(a) the idiomatic Python Aggregate: one dict update of [count, first, last] per tuple."""
    get = state.get
    for k, t in zip(keys, ts):
        s = get(k)
        if s is None:
            state[k] = [1, t, t]
        else:
            s[0] += 1
            if t < s[1]:
                s[1] = t
            if t > s[2]:
                s[2] = t


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


def check_agg(state: dict[int, list[int]], op: Aggregate) -> None:
    k, v = op.result()
    assert len(k) == len(state)
    ref = np.array([state[x] for x in k.tolist()], dtype=np.int64)
    assert np.array_equal(ref[:, 0], v["count"]) and np.array_equal(ref[:, 1], v["first_ts"])
    assert np.array_equal(ref[:, 2], v["last_ts"])


def bench_aggregate(n: int, groups: int, batch: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(groups)
    keys = rng.integers(0, groups, n, dtype=np.uint32)
    ts = rng.permutation(n).astype(np.int64)
    times: dict[str, list[float]] = {"dict": [], "mmm_record": [], "mmm_batch": []}
    for _ in range(repeats):
        t = time.perf_counter()
        kl, tl = keys.tolist(), ts.tolist()  # a Python operator receives Python values
        d = agg_dict(kl, tl)
        times["dict"].append(time.perf_counter() - t)
        t = time.perf_counter()
        kl, tl = keys.tolist(), ts.tolist()
        r = agg_mmm_record(kl, tl)
        times["mmm_record"].append(time.perf_counter() - t)
        t = time.perf_counter()
        b = agg_mmm_batch(keys, ts, batch)
        times["mmm_batch"].append(time.perf_counter() - t)
        check_agg(d, r)
        check_agg(d, b)
    out = {name: stats(v) for name, v in times.items()}
    out["batch_speedup_vs_dict"] = out["dict"]["min"] / out["mmm_batch"]["min"]
    out["record_slowdown_vs_dict"] = out["mmm_record"]["min"] / out["dict"]["min"]
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


def join_list(rec: np.ndarray, side: np.ndarray, window: int) -> tuple[int, int]:
    """(a) Python: per side a deque for eviction and a dict key -> deque of (ts, val)."""
    wins = [deque(), deque()]
    idx: list[dict[int, deque]] = [{}, {}]
    count = checksum = 0
    for (ts, key, val), x in zip(rec.tolist(), side.tolist()):
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


def join_mmm_record(rec: np.ndarray, side: np.ndarray, window: int) -> tuple[int, int]:
    """(b) mmm per-record: a PagedDeque window and an OrderedMap index (key, ts) -> val."""
    pm = mmm.PageManager()
    wins = [PagedDeque.create(pm, f"win{i}", WINDOW_REC) for i in (0, 1)]
    idx = [OrderedMap.create(pm, f"idx{i}", key="<u8", value="<i8") for i in (0, 1)]
    count = checksum = 0
    for (ts, key, val), x in zip(rec.tolist(), side.tolist()):
        y = 1 - x
        wy, iy = wins[y], idx[y]
        while len(wy) and wy[0]["ts"] < ts - window:
            old = wy.popleft()
            del iy[(int(old["key"]) << 40) | int(old["ts"])]
        _, vals = iy.range(key << 40, (key << 40) | ts)
        count += len(vals)
        checksum += val * int(vals.sum())
        wins[x].append((ts, key, val))
        idx[x][(key << 40) | ts] = val
    return count, checksum


def join_mmm_batch(rec: np.ndarray, side: np.ndarray, window: int, batch: int
                   ) -> tuple[int, int]:
    """(c) mmm batch: PagedDeque windows; each batch joins against a sorted
    (key, ts) view of the other window plus the batch's earlier tuples."""
    pm = mmm.PageManager()
    wins = [PagedDeque.create(pm, f"win{i}", WINDOW_REC) for i in (0, 1)]
    count = checksum = 0
    for i in range(0, len(rec), batch):
        b, bs = rec[i:i + batch], side[i:i + batch]
        lo = int(b["ts"][0])
        for w in wins:
            w.evict_before(lo - window, "ts")
        for x in (0, 1):
            y = 1 - x
            cand = np.concatenate([wins[y].to_numpy(), b[bs == y]])
            comp = (cand["key"].astype(np.int64) << 40) | cand["ts"]
            order = np.argsort(comp)
            comp = comp[order]
            csum = np.concatenate([[0], np.cumsum(cand["val"][order])])
            probe = b[bs == x]
            pk = probe["key"].astype(np.int64) << 40
            lo_i = np.searchsorted(comp, pk | np.maximum(probe["ts"] - window, 0), "left")
            hi_i = np.searchsorted(comp, pk | (probe["ts"] - 1), "right")
            count += int((hi_i - lo_i).sum())
            checksum += int((probe["val"] * (csum[hi_i] - csum[lo_i])).sum())
        for x in (0, 1):
            wins[x].extend(b[bs == x])
    return count, checksum


def bench_join(n: int, n_record: int, keys: int, window: int, batch: int, repeats: int
               ) -> dict[str, Any]:
    rec, side = join_stream(n, keys)
    times: dict[str, list[float]] = {"list": [], "mmm_record": [], "mmm_batch": []}
    for _ in range(repeats):
        t = time.perf_counter()
        ref = join_list(rec, side, window)
        times["list"].append((time.perf_counter() - t) / n)
        t = time.perf_counter()
        got = join_mmm_batch(rec, side, window, batch)
        times["mmm_batch"].append((time.perf_counter() - t) / n)
        assert got == ref, (got, ref)
        t = time.perf_counter()
        got_r = join_mmm_record(rec[:n_record], side[:n_record], window)
        times["mmm_record"].append((time.perf_counter() - t) / n_record)
        assert got_r == join_list(rec[:n_record], side[:n_record], window)
    out = {name + "_s_per_tuple": stats(v) for name, v in times.items()}
    out["result"] = {"pairs": ref[0], "checksum": ref[1]}
    out["batch_speedup_vs_list"] = (out["list_s_per_tuple"]["min"]
                                    / out["mmm_batch_s_per_tuple"]["min"])
    out["record_slowdown_vs_list"] = (out["mmm_record_s_per_tuple"]["min"]
                                      / out["list_s_per_tuple"]["min"])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and join tuples")
    ap.add_argument("--tuples", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=65536, help="batch size of the batch API")
    args = parse_args(ap, argv)
    repeats = 2 if args.quick else 5
    params = {"tuples": args.tuples, "batch": args.batch, "repeats": repeats,
              "groups": [1000, 10_000, 100_000], "join_window": 2000, "join_keys": 1000}
    agg = {}
    for g in params["groups"]:
        agg[str(g)] = bench_aggregate(args.tuples, g, args.batch, repeats)
        print(f"aggregate {g:>6} groups: batch {agg[str(g)]['batch_speedup_vs_dict']:.2f}x "
              f"faster than dict, per-record {agg[str(g)]['record_slowdown_vs_dict']:.2f}x "
              f"the dict time")
    n_join = 100_000 if args.quick else 400_000
    join = bench_join(n_join, 5_000 if args.quick else 20_000, params["join_keys"],
                      params["join_window"], 8192, repeats)
    print(f"windowed join: batch {join['batch_speedup_vs_list']:.2f}x faster than lists, "
          f"per-record {join['record_slowdown_vs_list']:.2f}x the list time")
    summary = {
        "agg_batch_speedup_vs_dict": agg["100000"]["batch_speedup_vs_dict"],
        "agg_record_slowdown_vs_dict": agg["100000"]["record_slowdown_vs_dict"],
        "join_batch_speedup_vs_list": join["batch_speedup_vs_list"],
        "targets": {"agg_batch_speedup_vs_dict": ">= 5", "agg_record_slowdown_vs_dict": "<= 3"},
    }
    path = write_result("mmm_ops", summary, {"aggregate": agg, "join": join}, params)
    plt, png = figure("mmm_ops")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    gs = params["groups"]
    for name, label in (("dict", "(a) dict"), ("mmm_record", "(b) mmm per-record"),
                        ("mmm_batch", "(c) mmm batch")):
        a1.plot(gs, [args.tuples / agg[str(g)][name]["min"] / 1e6 for g in gs], "o-",
                label=label)
    a1.set_xscale("log")
    a1.set_xlabel("groups")
    a1.set_ylabel("million tuples / s")
    a1.set_title(f"Aggregate over {args.tuples:,} tuples")
    a1.legend()
    names = ["list", "mmm_record", "mmm_batch"]
    a2.bar(["(a) dict+deque", "(b) mmm per-record", "(c) mmm batch"],
           [1e-6 / join[f"{nm}_s_per_tuple"]["min"] for nm in names])
    a2.set_ylabel("million tuples / s")
    a2.set_title(f"Windowed equi-join (W={params['join_window']})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
