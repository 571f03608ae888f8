"""KeyDict: the cost of string keys against the integer-key path, in the same run.

A Spark stateful operator keyed on a string column maps each row's key to an
int64 id (`mmm.KeyDict.intern`) and then does the integer path's state work
(`HashMap.upsert` on the ids). This bench measures, for the same stream of
rows (uniformly drawn from ``G`` groups, batches of ``--batch`` rows, the
keys already known: the steady state of a running aggregate):

- ``int_upsert``: the integer path, `HashMap.upsert` of int64 keys with a count
  (the baseline);
- ``intern``: `KeyDict.intern` of the same keys as strings, in Arrow layout
  (``user-<n>``, 6-12 bytes: inline records; and ``url`` keys of 40-46 bytes:
  chunk chains);
- ``string_state``: intern + the same upsert on the ids: the whole string-key
  state work;
- ``lookup``, ``keys`` (the gather of a batch of ids back to bytes) and
  ``intern_new`` (every key new: the dictionary being built).

Run: ``python -m bench.keydict [--quick] [--out DIR]``. Writes ``DIR/keydict.json``;
summary: ``intern_ns_per_key_over_int_upsert`` (per key kind and group count),
``index_bytes_per_key`` and ``bytes_per_key`` (the index's pages, and all pages, over the keys),
``string_state_over_int_state`` (target <= 2, issue 17), ``ns_per_key``, and both ratios
in process CPU time (``cpu_time``, steadier on a loaded machine). Each variant's best of
``repeats`` interleaved runs.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

import mmm
from bench._harness import parse_args, stats, write_result

SPEC = {"n": "count"}


def arrow_keys(kind: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keys of group numbers ``ids`` as an Arrow StringArray's (data, int32 offsets)."""
    if kind == "user":
        strs = [f"user-{i}" for i in ids.tolist()]
    else:
        strs = [f"https://example.com/catalog/item/{i:08d}?ref=x" for i in ids.tolist()]
    arr = pa.array(strs, pa.string())
    _, obuf, dbuf = arr.buffers()
    return np.frombuffer(dbuf, np.uint8), np.frombuffer(obuf, np.int32)[:len(arr) + 1]


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def bench_groups(kind: str, groups: int, n: int, batch: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(groups)
    stream = rng.integers(0, groups, n).astype(np.int64)
    bounds = list(range(0, n, batch))
    batches = []
    for a in bounds:
        d, o = arrow_keys(kind, stream[a:a + batch])
        batches.append((d, o, stream[a:a + batch]))
    pm = mmm.PageManager(capacity_bytes=4 << 30)
    hm = mmm.HashMap.create(pm, "int", key="<i8", value=[("n", "<i8")])
    hs = mmm.HashMap.create(pm, "ids", key="<i8", value=[("n", "<i8")])
    kd = mmm.KeyDict.create(pm, "kd")
    all_keys = np.arange(groups, dtype=np.int64)
    d_all, o_all = arrow_keys(kind, all_keys)

    def build() -> None:
        kd.intern(d_all, o_all)

    warm = mmm.KeyDict.create(pm, "warm")  # load the compiled kernels before timing
    warm.intern(d_all[:int(o_all[64])], o_all[:65])
    warm.lookup(d_all[:int(o_all[64])], o_all[:65])
    t_new = timed(build, 1)  # every key new
    assert len(kd) == groups
    hm.upsert(all_keys, combine=SPEC)
    hs.upsert(kd.lookup(d_all, o_all), combine=SPEC)
    # check: the string path gives the same counts as the integer path
    for d, o, k in batches:
        hm.upsert(k, combine=SPEC)
        hs.upsert(kd.intern(d, o), combine=SPEC)
    f1, v1 = hm.get(all_keys)
    f2, v2 = hs.get(kd.lookup(d_all, o_all))
    assert f1.all() and f2.all() and np.array_equal(v1["n"], v2["n"])

    def int_upsert() -> None:
        for _, _, k in batches:
            hm.upsert(k, combine=SPEC)

    def intern() -> None:
        for d, o, _ in batches:
            kd.intern(d, o)

    def string_state() -> None:
        for d, o, _ in batches:
            hs.upsert(kd.intern(d, o), combine=SPEC)

    def lookup() -> None:
        for d, o, _ in batches:
            kd.lookup(d, o)

    id_batches = [kd.lookup(d, o) for d, o, _ in batches]

    def keys() -> None:
        for ids in id_batches:
            kd.keys(ids)

    variants = [("int_upsert", int_upsert), ("intern", intern), ("string_state", string_state),
                ("lookup", lookup), ("keys", keys)]
    for _, fn in variants:
        fn()  # warm
    wall: dict[str, list[float]] = {name: [] for name, _ in variants}
    cpu: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(repeats):  # interleaved: a load change hits every variant alike
        for name, fn in variants:
            t, c = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - t)
    runs = {k: stats(v) for k, v in wall.items()}
    base = runs["int_upsert"]["min"]
    cbase = min(cpu["int_upsert"])
    ns = {k: v["min"] / n * 1e9 for k, v in runs.items()}
    ns["intern_new"] = t_new[0] / groups * 1e9
    return {"kind": kind, "groups": groups, "rows": n, "batch": batch, "ns_per_key": ns,
            "intern_over_int_upsert": runs["intern"]["min"] / base,
            "string_state_over_int_state": runs["string_state"]["min"] / base,
            "cpu_time": {"intern_over_int_upsert": min(cpu["intern"]) / cbase,
                         "string_state_over_int_state": min(cpu["string_state"]) / cbase,
                         "ns_per_key": {k: min(v) / n * 1e9 for k, v in cpu.items()}},
            "seconds": runs, "pages": kd.page_count,
            "index_bytes_per_key": kd.memory()["index"] / groups,
            "bytes_per_key": sum(kd.memory().values()) / groups}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rows, groups and repeats")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=65536, help="rows per call (a Spark batch)")
    args = parse_args(ap, argv)
    rows = min(args.rows, 262_144) if args.quick else args.rows
    repeats = 3 if args.quick else 5
    groups = [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000]
    results: dict[str, Any] = {}
    for kind in ("user", "url"):
        for g in groups:
            r = bench_groups(kind, g, rows, args.batch, repeats)
            results[f"{kind}_{g}"] = r
            ns = r["ns_per_key"]
            print(f"{kind:>4} keys, {g:>8} groups: intern {ns['intern']:5.1f} ns/key = "
                  f"{r['intern_over_int_upsert']:.2f}x the int64 upsert ({ns['int_upsert']:.1f} "
                  f"ns/row); intern+upsert {r['string_state_over_int_state']:.2f}x; lookup "
                  f"{ns['lookup']:.1f}, keys {ns['keys']:.1f}, new keys {ns['intern_new']:.1f} "
                  f"ns/key (CPU time: {r['cpu_time']['intern_over_int_upsert']:.2f}x, "
                  f"{r['cpu_time']['string_state_over_int_state']:.2f}x); index "
                  f"{r['index_bytes_per_key']:.1f} B/key, all pages {r['bytes_per_key']:.1f} B/key")
    summary = {
        "intern_ns_per_key_over_int_upsert": {k: round(v["intern_over_int_upsert"], 3)
                                              for k, v in results.items()},
        "string_state_over_int_state": {k: round(v["string_state_over_int_state"], 3)
                                        for k, v in results.items()},
        "ns_per_key": {k: {m: round(x, 2) for m, x in v["ns_per_key"].items()}
                       for k, v in results.items()},
        "index_bytes_per_key": {k: round(v["index_bytes_per_key"], 1) for k, v in results.items()},
        "bytes_per_key": {k: round(v["bytes_per_key"], 1) for k, v in results.items()},
        "cpu_time": {k: {m: round(x, 3) for m, x in v["cpu_time"].items() if m != "ns_per_key"}
                     for k, v in results.items()},
        "targets": {"intern_ns_per_key_over_int_upsert": "<= 1.5-2 (short keys)",
                    "string_state_over_int_state": "<= 2"},
    }
    path = write_result("keydict", summary, results,
                        {"rows": rows, "batch": args.batch, "repeats": repeats, "groups": groups,
                         "quick": args.quick})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
