"""Shared benchmark helpers: timing repeats, result JSON with a summary, plots.

Every benchmark measures its baseline in the same run and reports ratios:
the machines are shared and noisy, absolute times are not comparable.
"""
from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def timeit(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
           setup: Callable[[], Any] | None = None) -> dict[str, float]:
    """Run ``fn`` ``warmup`` times then ``repeats`` times; seconds as min/median/p90/max.

    ``setup`` (untimed) runs before every call and its result is passed to ``fn``
    when ``fn`` takes an argument.
    """
    times = []
    for i in range(warmup + repeats):
        arg = setup() if setup is not None else None
        t = time.perf_counter()
        fn(arg) if setup is not None else fn()  # type: ignore[call-arg]
        dt = time.perf_counter() - t
        if i >= warmup:
            times.append(dt)
    return stats(times)


def stats(times: list[float]) -> dict[str, float]:
    """min / median / p90 / max / mean of a list of seconds."""
    a = np.asarray(times, dtype=float)
    return {"min": float(a.min()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "max": float(a.max()),
            "mean": float(a.mean()), "n": int(len(a))}


def write_result(name: str, summary: dict[str, Any], data: dict[str, Any],
                 params: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` with a top-level ``summary``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    doc = {"summary": summary, "params": params, "data": data,
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "platform": platform.platform()},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.write_text(json.dumps(doc, indent=2, default=float))
    return path


def figure(name: str) -> tuple[Any, Path]:
    """A matplotlib (Agg) module and the PNG path for ``name``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    RESULTS.mkdir(parents=True, exist_ok=True)
    return plt, RESULTS / f"{name}.png"
