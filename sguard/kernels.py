"""``sguard kernels warm``: compile the state core's kernels before the first batch.

sguard's hot loops are numba kernels, compiled for each combination of argument
types (a key width, a value dtype) at their first call and cached on disk next to
the installed package (``NUMBA_CACHE_DIR`` overrides where). A fresh install
therefore compiles inside the first batches of every query: 0.1-10 s per variant,
about 100 s of one core for all of them, and several processes that start at once
(Spark's Python workers, parallel tests) each compile the same variants until one
has written them. Run this once after installing (in an image build, before the
executors start) and every later process only loads them (~10 ms each).

The variants compiled are those the test suite and the benchmarks use
(`VARIANTS_FILE`, written from numba's cache by ``scripts/kernel_variants.py``), or
those of ``--variants FILE`` in the same format: ``{"format": 1, "kernels":
{kernel name: [argument types as text]}}`` (see `mmm.compile_kernel_variants`).
Kernels are compiled in ``--jobs`` processes (default: one per core), each kernel's
variants in one process, so that no two processes write one kernel's cache index.

Exit status: 0 every variant is ready, 1 some failed to compile (each named on
stderr), 2 bad arguments (nothing compiled).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["register", "VARIANTS_FILE", "read_variants", "warm"]

#: the variants compiled by default, packaged with sguard
VARIANTS_FILE = Path(__file__).with_name("kernel_variants.json")
_FORMAT = 1


def read_variants(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """``{kernel name: [variant text]}`` of a variants file.

    Raises
    ------
    ValueError
        If the file is unreadable or not in the format above (naming the file).
    """
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read kernel variants file {str(path)!r}: {e}") from e
    kernels = doc.get("kernels") if isinstance(doc, dict) else None
    if (not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(kernels, dict)
            or not all(isinstance(k, str) and isinstance(v, list)
                       and all(isinstance(t, str) for t in v) for k, v in kernels.items())):
        raise ValueError(f"kernel variants file {str(path)!r} is not "
                         f'{{"format": {_FORMAT}, "kernels": {{name: [variant, ...]}}}}')
    return {k: list(v) for k, v in kernels.items()}


def _compile_one(name: str, texts: Sequence[str]) -> tuple[int, int, list[tuple[str, str, str]]]:
    from mmm import compile_kernel_variants
    r = compile_kernel_variants({name: texts})
    return r.compiled, r.cached, r.failed


def warm(variants: Mapping[str, Sequence[str]], jobs: int) -> tuple[int, int, list[tuple[str, str, str]]]:
    """Compile `variants` (``{kernel name: [variant text]}``) in `jobs` processes (one
    kernel per task, the kernels with most variants first); returns ``(compiled, already
    cached, failed)``, `failed` as ``(kernel name, variant text, error)``."""
    order = sorted(variants, key=lambda n: -len(variants[n]))
    compiled = cached = 0
    failed: list[tuple[str, str, str]] = []
    if jobs <= 1:
        results: Any = (_compile_one(n, variants[n]) for n in order)
        for c, h, f in results:
            compiled, cached = compiled + c, cached + h
            failed.extend(f)
        return compiled, cached, failed
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for c, h, f in pool.map(_compile_one, order, [variants[n] for n in order]):
            compiled, cached = compiled + c, cached + h
            failed.extend(f)
    return compiled, cached, failed


def register(subparsers: Any) -> None:
    """Add ``kernels warm`` to the ``sguard`` command line."""
    from sguard.cliargs import positive_int
    p = subparsers.add_parser("kernels", help="compile the state core's kernels ahead of use",
                              description=__doc__.splitlines()[0],
                              epilog="example:\n  sguard kernels warm   # once after installing",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="kernels_command", required=True)
    w = sub.add_parser("warm", help="compile the kernel variants workloads use into numba's "
                       "disk cache (once per install)", description=__doc__.splitlines()[0],
                       epilog="examples:\n  sguard kernels warm\n"
                              "  sguard kernels warm --jobs 4 --variants my-variants.json",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    w.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                   help="processes compiling at once (default: one per core)")
    w.add_argument("--variants", default=str(VARIANTS_FILE), metavar="FILE",
                   help="a variants file (default: the variants sguard's tests and "
                        "benchmarks use, packaged with it)")
    w.set_defaults(func=_cmd_warm)


def _cmd_warm(args: argparse.Namespace) -> int:
    try:
        variants = read_variants(args.variants)
    except ValueError as e:
        print(f"sguard kernels warm: error: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    compiled, cached, failed = warm(variants, args.jobs)
    for name, text, err in failed:
        first = (err.strip().splitlines() or [""])[0]
        print(f"sguard kernels warm: {name} {text}: {first[:300]}", file=sys.stderr)
    total = sum(len(v) for v in variants.values())
    print(f"sguard kernels warm: {total - len(failed)} of {total} variants of "
          f"{len(variants)} kernels ready ({compiled} compiled, {cached} already cached) in "
          f"{time.monotonic() - t0:.1f} s with {min(args.jobs, max(len(variants), 1))} "
          f"process(es)")
    return 1 if failed else 0
