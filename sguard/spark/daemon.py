"""PySpark's Python worker daemon, with sguard and its compiled kernels loaded before it forks.

PySpark starts one daemon per executor (``pyspark.daemon``) and forks a worker
from it for each Python task slot, again whenever a worker dies (a crash, a
killed task, an idle timeout) or a task needs one more. A fresh worker imports
sguard at its first task and loads each numba kernel from the disk cache at the
kernel's first call: about 0.5 s of imports and ~7-15 ms per kernel, paid inside
that task, so the first batch a new worker runs, and above all the recovery it
runs after a crash or a rescale (whose kernels no earlier task touched), is slowed
by what is the same in every worker.

Run as the daemon (``spark.python.daemon.module=sguard.spark.daemon``, which
`sguard.spark.local_session` sets), this module imports sguard and loads the
kernel variants numba has cached for the installed code (`mmm.preload_kernels`),
at most `PRELOAD_VARIANTS_PER_KERNEL` of each kernel, the most recently written
(``SGUARD_PRELOAD_VARIANTS_PER_KERNEL`` overrides it, ``all`` lifts the bound): a
cache that other work filled, such as a test run compiling many argument types,
must not make every daemon start slower, and a variant left out is loaded at its
first call as without preloading;
imports PySpark's worker module, freezes every object so far out of Python's
cyclic garbage collector (`gc.freeze`, what the Python documentation advises
before forking), then runs PySpark's own daemon unchanged: every worker it forks
starts with all of it in memory, shared copy-on-write. The freeze matters as
much: a reused worker runs ``gc.collect()`` after every task, which otherwise
walks every object of those imports (about 130,000, 50 ms a task here) before
the worker takes its next task, on the critical path of a batch of more tasks
than cores. Nothing here starts a thread (the daemon must not have any when it
forks), writes to stdout (the daemon's port goes there), or compiles anything; a
failure to preload is reported on stderr and the daemon runs as PySpark's would.
"""
from __future__ import annotations

import gc
import os
import sys
import time

__all__ = ["main", "preload", "PRELOAD_VARIANTS_PER_KERNEL"]

PRELOAD_VARIANTS_PER_KERNEL = 4
"""Cached variants of each kernel the daemon loads, newest first (a workload's operators
use one to three argument-type combinations of a kernel)."""


def _bound_from_env() -> int | None:
    """``SGUARD_PRELOAD_VARIANTS_PER_KERNEL``: a count, or ``all`` (no bound).

    Raises
    ------
    ValueError
        If it is neither ``all`` nor an integer >= 0.
    """
    raw = os.environ.get("SGUARD_PRELOAD_VARIANTS_PER_KERNEL", "").strip()
    if not raw:
        return PRELOAD_VARIANTS_PER_KERNEL
    if raw.lower() == "all":
        return None
    if not raw.isdigit():
        raise ValueError(f"SGUARD_PRELOAD_VARIANTS_PER_KERNEL must be 'all' or an integer "
                         f">= 0, got {raw!r}")
    return int(raw)


def preload(max_per_kernel: int | None = PRELOAD_VARIANTS_PER_KERNEL) -> tuple[int, int]:
    """Import sguard's runtime and load the cached kernel variants, at most
    `max_per_kernel` of each (None: all): ``(variants loaded, kernels)``
    (`mmm.preload_kernels`)."""
    import sguard.convert  # noqa: F401 - kernels of the state conversion
    import sguard.spark.reader  # noqa: F401 - the state readers' tasks
    import sguard.spark.runtime  # noqa: F401 - mmm, ioservice, operators, keys
    from mmm import preload_kernels
    return preload_kernels(max_per_kernel)


def main() -> None:
    t = time.perf_counter()
    try:
        loaded, kernels = preload(_bound_from_env())
    except Exception as exc:  # noqa: BLE001 - the daemon must start regardless
        print(f"sguard.spark.daemon: preloading failed, workers load sguard themselves: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    else:
        print(f"sguard.spark.daemon: {loaded} cached variants of {kernels} kernels loaded "
              f"in {time.perf_counter() - t:.2f} s", file=sys.stderr, flush=True)
    # what every worker imports first (after the fork in PySpark's daemon); then every object
    # so far is frozen out of the cyclic GC: a reused worker runs gc.collect() after each
    # task, which otherwise walks all of the above (~130k objects, ~50 ms a task here)
    import pyspark.worker  # noqa: F401
    gc.freeze()
    from pyspark import daemon
    daemon.manager()


if __name__ == "__main__":
    main()
