"""Shared benchmark helpers: arguments, timing repeats, result JSON with a summary, plots.

Every benchmark measures its baseline in the same run and reports ratios:
the machines are shared and noisy, absolute times are not comparable.

Where results go: every bench parses its arguments with `parse_args`, which
adds ``--out DIR`` (default `DEFAULT_OUT`, the untracked, git-ignored
``bench/out/``); `write_result` and `figure` then write ``DIR/<name>.json`` and
``DIR/<name>.png``. The committed ``bench/results/`` is only written by asking
for it (``--out bench/results``), so a run never dirties the checkout.
`parse_args` also refuses, before any work, a numeric option that is not
positive (every bench option is a size, a count or a duration; ``0`` would
otherwise silently mean "the default").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
"""The committed results (``--out bench/results`` records a run there)."""
DEFAULT_OUT = Path(__file__).resolve().parent / "out"
"""Default output directory: untracked and git-ignored."""

_out_dir: Path = DEFAULT_OUT


def parse_args(ap: argparse.ArgumentParser, argv: Sequence[str] | None = None
               ) -> argparse.Namespace:
    """``ap.parse_args(argv)`` plus ``--out DIR``; validates before any work.

    Adds ``--out`` to ``ap``, parses, exits with status 2 and a one-line error
    if a numeric option is not positive (a finite number > 0) or ``--out`` names
    an existing non-directory, and makes ``--out`` the directory `write_result`
    and `figure` write to. Returns the parsed arguments (``args.out`` a `Path`).
    """
    global _out_dir
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                    help="write <name>.json and <name>.png here (default: bench/out, untracked; "
                         "--out bench/results records a run)")
    args = ap.parse_args(argv)
    for key, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not (
                    v > 0 and math.isfinite(v)):
                ap.exit(2, f"{ap.prog}: error: argument --{key.replace('_', '-')}: must be "
                           f"positive, got {v}\n")
    out: Path = args.out
    if out.exists() and not out.is_dir():
        ap.exit(2, f"{ap.prog}: error: argument --out: {out} exists and is not a directory\n")
    _out_dir = out
    return args


def out_dir() -> Path:
    """The directory results go to (``--out``; created on first write)."""
    return _out_dir


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
    """Write ``<out>/<name>.json`` with a top-level ``summary`` (``<out>``: see `parse_args`)."""
    _out_dir.mkdir(parents=True, exist_ok=True)
    path = _out_dir / f"{name}.json"
    doc = {"summary": summary, "params": params, "data": data,
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "platform": platform.platform()},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.write_text(json.dumps(doc, indent=2, default=float))
    return path


def figure(name: str) -> tuple[Any, Path]:
    """A matplotlib (Agg) module and the PNG path ``<out>/<name>.png``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    _out_dir.mkdir(parents=True, exist_ok=True)
    return plt, _out_dir / f"{name}.png"


def save_figure(fig: Any, png: Path, json_path: Path) -> int:
    """Lay out ``fig``, write it to ``png`` and close it; say where the results went.

    The common end of a bench's ``main``: returns 0, its exit status.
    """
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"wrote {json_path} and {png}")
    return 0
