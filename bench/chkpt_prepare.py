"""Paper Figure 6: time to prepare a checkpoint of 16 MB to 1 GB of operator state.

The state is the Aggregate's (count, first, last timestamp per key) in an mmm
`HashMap`; its size is the bytes of its pages. "Prepare" is what the operator
waits for before it may run again:

* mmm: `PageManager.chkpt` (freeze pages: copy the page table, pin frames);
* pickle: ``pickle.dumps`` of the same state as a Python dict of tuples;
* deepcopy: ``copy.deepcopy`` of that dict (an in-memory snapshot).

Baselines that would take minutes at the largest sizes (``--quick``: pickle
beyond 256 MB, deepcopy beyond 64 MB) are fitted linearly on the measured sizes
and extrapolated; the JSON marks every extrapolated point.

Run: ``python -m bench.chkpt_prepare [--quick]``. Writes
``bench/results/chkpt_prepare.json`` (summary: ``prepare_ms_1gb``,
``prepare_speedup_vs_pickle_1gb``) and ``bench/results/chkpt_prepare.png``.
"""
from __future__ import annotations

import argparse
import copy
import gc
import pickle
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import mmm
from bench._harness import figure, parse_args, save_figure, stats, write_result
from sguard.operators import Aggregate

MB = 1 << 20


def build_state(target_bytes: int, page_bytes: int) -> tuple[mmm.PageManager, Aggregate]:
    """An Aggregate whose pages total about ``target_bytes``."""
    pm = mmm.PageManager(page_bytes=page_bytes, capacity_bytes=max(4 * target_bytes, 1 << 28))
    op = Aggregate(pm)
    rng = np.random.default_rng(0)
    next_key = 0
    while pm.stats()["used_bytes"] < target_bytes:
        step = max(10_000, (target_bytes - pm.stats()["used_bytes"]) // 64)
        keys = np.arange(next_key, next_key + step, dtype=np.uint32)
        next_key += step
        op.process(keys, rng.integers(0, 1 << 40, step))
    return pm, op


def time_prepare(pm: mmm.PageManager, repeats: int) -> dict[str, float]:
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        snap = pm.chkpt()
        dt = time.perf_counter() - t
        snap.release()
        times.append(dt)
    return stats(times[1:])


def as_dict(op: Aggregate) -> dict[int, tuple[int, int, int]]:
    k, v = op.state.items()
    return dict(zip(k.tolist(), v.tolist()))


def time_baseline(fn: Any, state: Any, repeats: int) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        gc.collect()
        t = time.perf_counter()
        out = fn(state)
        times.append(time.perf_counter() - t)
        del out
    return stats(times)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--page-bytes", type=int, default=1 << 16)
    args = parse_args(ap, argv)
    sizes_mb = [16, 64, 256, 1024]
    pickle_max = 256 if args.quick else 1024
    deepcopy_max = 64 if args.quick else 256
    repeats = 3 if args.quick else 5
    rows: list[dict[str, Any]] = []
    for size in sizes_mb:
        pm, op = build_state(size * MB, args.page_bytes)
        st = pm.stats()
        row: dict[str, Any] = {"target_mb": size, "state_bytes": st["used_bytes"],
                               "pages": st["used_frames"], "records": len(op.state),
                               "mmm": time_prepare(pm, 20)}
        if size <= pickle_max or size <= deepcopy_max:
            d = as_dict(op)
            if size <= pickle_max:
                row["pickle"] = time_baseline(
                    lambda s: pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL), d,
                    1 if size >= 256 else repeats)
            if size <= deepcopy_max:
                row["deepcopy"] = time_baseline(copy.deepcopy, d, 1 if size >= 256 else repeats)
            del d
        print(f"{size:>5} MB ({st['used_frames']} pages, {len(op.state):,} keys): "
              f"mmm prepare {row['mmm']['median'] * 1e3:.3f} ms"
              + (f", pickle {row['pickle']['median'] * 1e3:.0f} ms" if "pickle" in row else "")
              + (f", deepcopy {row['deepcopy']['median'] * 1e3:.0f} ms"
                 if "deepcopy" in row else ""))
        rows.append(row)
        del pm, op
        gc.collect()
    for name in ("pickle", "deepcopy"):  # linear fit through the measured points
        xs = [r["state_bytes"] for r in rows if name in r]
        ys = [r[name]["median"] for r in rows if name in r]
        slope = float(np.polyfit(xs, ys, 1)[0]) if len(xs) >= 2 else ys[0] / xs[0]
        for r in rows:
            if name not in r:
                r[name] = {"median": slope * r["state_bytes"], "extrapolated": True}
    big = rows[-1]
    summary = {
        "prepare_ms_1gb": big["mmm"]["median"] * 1e3,
        "prepare_speedup_vs_pickle_1gb": big["pickle"]["median"] / big["mmm"]["median"],
        "prepare_speedup_vs_deepcopy_1gb": big["deepcopy"]["median"] / big["mmm"]["median"],
        "pickle_1gb_extrapolated": bool(big["pickle"].get("extrapolated", False)),
        "targets": {"prepare_ms_1gb": "<= 1", "prepare_speedup_vs_pickle_1gb": ">= 1000"},
    }
    print(f"1 GB: mmm prepare {summary['prepare_ms_1gb']:.3f} ms, "
          f"{summary['prepare_speedup_vs_pickle_1gb']:,.0f}x faster than pickle"
          + (" (pickle extrapolated)" if summary["pickle_1gb_extrapolated"] else ""))
    path = write_result("chkpt_prepare", summary, {"rows": rows},
                        {"page_bytes": args.page_bytes, "quick": args.quick,
                         "sizes_mb": sizes_mb})
    plt, png = figure("chkpt_prepare")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    x = [r["state_bytes"] / MB for r in rows]
    for name, label in (("mmm", "mmm chkpt (copy-on-write)"), ("pickle", "pickle.dumps"),
                        ("deepcopy", "copy.deepcopy")):
        y = [r[name]["median"] * 1e3 for r in rows]
        ext = [bool(r[name].get("extrapolated")) for r in rows]
        line, = ax.plot(x, y, "o-", label=label)
        ax.plot([a for a, e in zip(x, ext) if e], [b for b, e in zip(y, ext) if e], "o",
                mfc="white", color=line.get_color())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("state size (MB)")
    ax.set_ylabel("prepare time (ms)")
    ax.set_title("Checkpoint preparation (hollow: extrapolated)")
    ax.legend()
    return save_figure(fig, png, path)


if __name__ == "__main__":
    raise SystemExit(main())
