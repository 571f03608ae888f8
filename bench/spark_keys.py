"""String and composite keys vs integer keys: the state work of one Spark partition.

What a task of ``sguard.spark.stateful`` spends in the operator (`OperatorState.apply`
of `RunningAggregate`, count/sum/min/max) per micro-batch, at steady state (every key
already in the state), for the same keys given three ways, interleaved in one run:

* ``int``: a long column, ``key="k"`` (stored as its value, no dictionary; the baseline);
* ``str``: the same keys as strings (``"user-<k>"``), through the key dictionary;
* ``composite``: ``key=["tenant", "user"]`` (a short string and the string above).

Reports the median milliseconds per batch and ``ratio_str_over_int_<keys>`` /
``ratio_composite_over_int_<keys>`` in ``summary`` (issue 17 targets the string ratio
<= 2). No Spark: the Arrow tables are what a task receives after the shuffle.

    python -m bench.spark_keys [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from bench._harness import parse_args, stats, write_result

NAME = "spark_keys"


def _tables(keys: int, rows: int, batches: int, seed: int) -> dict[str, list[pa.Table]]:
    rng = np.random.default_rng(seed)
    out: dict[str, list[pa.Table]] = {"int": [], "str": [], "composite": []}
    tenants = np.array(["acme", "globex", "initech", "umbrella"])
    for _ in range(batches):
        k = rng.integers(0, keys, rows, dtype=np.int64)
        v = rng.integers(-1000, 1000, rows, dtype=np.int64)
        user = pa.array(np.char.add("user-", k.astype(str)), pa.string())
        out["int"].append(pa.table({"k": k, "v": v}))
        out["str"].append(pa.table({"user": user, "v": v}))
        out["composite"].append(pa.table({"tenant": pa.array(tenants[k % 4]), "user": user,
                                          "v": v}))
    return out


def _state(kind: str, schema: pa.Schema) -> Any:
    from mmm import PageManager
    from sguard.spark import RunningAggregate
    key: Any = {"int": "k", "str": "user", "composite": ["tenant", "user"]}[kind]
    pm = PageManager(1 << 16, 1 << 31)
    return RunningAggregate(value="v").open(pm, schema, key)


def run(keys_list: Sequence[int], rows: int, repeats: int) -> tuple[dict[str, Any],
                                                                    dict[str, Any]]:
    summary: dict[str, Any] = {}
    data: dict[str, Any] = {}
    for keys in keys_list:
        warm = _tables(keys, keys, 1, 1)      # every key once: steady state from batch 0
        tabs = _tables(keys, rows, repeats, 2)
        states = {kind: _state(kind, t[0].schema) for kind, t in warm.items()}
        for kind, st in states.items():
            st.apply(warm[kind][0], 0)
            st.apply(tabs[kind][0], 1)        # compile and touch every page once
        times: dict[str, list[float]] = {kind: [] for kind in states}
        for i in range(repeats):              # interleaved: load hits all three alike
            for kind, st in states.items():
                t0 = time.perf_counter()
                st.apply(tabs[kind][i], 2 + i)
                times[kind].append(time.perf_counter() - t0)
        data[str(keys)] = {kind: stats(ts) | {"ms_per_batch": float(np.median(ts)) * 1e3}
                           for kind, ts in times.items()}
        base = float(np.median(times["int"]))
        summary[f"ratio_str_over_int_{keys // 1000}k"] = float(np.median(times["str"])) / base
        summary[f"ratio_composite_over_int_{keys // 1000}k"] = (
            float(np.median(times["composite"])) / base)
        summary[f"int_ms_per_batch_{keys // 1000}k"] = base * 1e3
        summary[f"str_ms_per_batch_{keys // 1000}k"] = float(np.median(times["str"])) * 1e3
    return summary, data


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spark_keys", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[10_000, 100_000],
                    help="distinct keys (default 10000 100000)")
    ap.add_argument("--rows", type=int, default=50_000, help="rows per batch (default 50000)")
    ap.add_argument("--repeats", type=int, default=15, help="batches timed (default 15)")
    ap.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = parse_args(ap, argv)
    keys, rows, repeats = (([10_000], 10_000, 5) if args.quick
                           else (args.keys, args.rows, args.repeats))
    summary, data = run(keys, rows, repeats)
    path = write_result(NAME, summary, data, {"keys": keys, "rows": rows, "repeats": repeats})
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
