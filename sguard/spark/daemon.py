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
kernel variants workloads used (`mmm.preload_kernels`): those the *record of used
variants* names (`record_path`, a small JSON file next to numba's cache) that
numba's cache holds for the installed code, newest first, at most
`PRELOAD_VARIANTS_PER_KERNEL` of each kernel (``SGUARD_PRELOAD_VARIANTS_PER_KERNEL``
overrides it, ``all`` lifts the bound). A cache that other work filled, such as a
test run compiling many argument types in one process, does not make every daemon
start slower: only variants a worker had to load itself enter the record. Each
worker adds, after a task, the variants it loaded or compiled that the daemon had
not preloaded (`record_used`; nothing is written when there are none). Without a
record yet, the daemon loads each kernel's most recently written cached variants
(up to the same bound); a variant left out is loaded at its first call as without
preloading, and recorded then;
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

import contextlib
import fcntl
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["main", "preload", "record_path", "read_record", "record_used",
           "PRELOAD_VARIANTS_PER_KERNEL", "RECORD_VARIANTS_PER_KERNEL"]

PRELOAD_VARIANTS_PER_KERNEL = 4
"""Cached variants of each kernel the daemon loads, newest first (a workload's operators
use one to three argument-type combinations of a kernel)."""

RECORD_VARIANTS_PER_KERNEL = 16
"""Variants of each kernel the record of used variants keeps, the newest first."""

_RECORD_FORMAT = 1
_RECORD_NAME = "sguard-kernel-variants.json"

# (kernel, argument types) loaded before the workers fork (preloaded) or recorded since
_KNOWN: set[tuple[str, str]] = set()
_RECORD_FAILED = False


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


def record_path() -> str:
    """Where the record of used kernel variants lives: ``SGUARD_KERNEL_RECORD``, else
    `_RECORD_NAME` in numba's cache directory for mmm's kernels (``NUMBA_CACHE_DIR``,
    else their ``__pycache__``), so that it goes with the cache it names."""
    explicit = os.environ.get("SGUARD_KERNEL_RECORD", "").strip()
    if explicit:
        return explicit
    cache = os.environ.get("NUMBA_CACHE_DIR", "").strip()
    if not cache:  # where numba caches the kernels of mmm's preloader's own package
        import inspect

        from mmm import preload_kernels
        cache = os.path.join(os.path.dirname(os.path.abspath(inspect.getfile(preload_kernels))),
                             "__pycache__")
    return os.path.join(cache, _RECORD_NAME)


def read_record(path: str | None = None) -> dict[str, list[str]] | None:
    """``{kernel name: [argument types as text]}``, newest first, from the record at
    `path` (default `record_path`), or None when there is none, or it is unreadable or
    of another format (then the daemon preloads as without one)."""
    try:
        with open(path or record_path(), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != _RECORD_FORMAT:
        return None
    kernels = doc.get("kernels")
    if not isinstance(kernels, dict):
        return None
    out: dict[str, list[str]] = {}
    for name, seen in kernels.items():
        if isinstance(name, str) and isinstance(seen, dict):
            pairs = [(t, s) for s, t in seen.items()
                     if isinstance(s, str) and isinstance(t, (int, float))]
            out[name] = [s for _, s in sorted(pairs, key=lambda p: -p[0])]
    return out


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Hold an exclusive lock beside the record while it is read, merged and replaced
    (the workers of every executor write it)."""
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def record_used(path: str | None = None, now: float | None = None) -> int:
    """Add to the record at `path` (default `record_path`) the kernel variants this
    process compiled or loaded (`mmm.loaded_kernel_variants`) that it neither found
    preloaded nor recorded before; returns how many. Nothing is written when there are
    none, so a worker's steady state costs one pass over the kernels' signature lists.
    The file is JSON (``{"format": 1, "kernels": {name: {types: unix time first
    recorded}}}``), replaced atomically under a lock; each kernel keeps its
    `RECORD_VARIANTS_PER_KERNEL` newest variants.

    Raises
    ------
    OSError
        If the record cannot be written (its directory is read-only, say).
    """
    from mmm import loaded_kernel_variants
    new = {(name, sig) for name, sigs in loaded_kernel_variants().items() for sig in sigs}
    new -= _KNOWN
    if not new:
        return 0
    path = path or record_path()
    stamp = time.time() if now is None else now
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with _locked(path):
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            if not isinstance(doc, dict) or doc.get("format") != _RECORD_FORMAT:
                raise ValueError("another format")
            kernels: dict[str, dict[str, float]] = {
                n: dict(v) for n, v in doc.get("kernels", {}).items() if isinstance(v, dict)}
        except (OSError, ValueError, AttributeError):
            kernels = {}
        for name, sig in sorted(new):
            kernels.setdefault(name, {}).setdefault(sig, stamp)
        for name, seen in kernels.items():
            if len(seen) > RECORD_VARIANTS_PER_KERNEL:
                keep = sorted(seen.items(), key=lambda p: -p[1])[:RECORD_VARIANTS_PER_KERNEL]
                kernels[name] = dict(keep)
        fd, tmp = tempfile.mkstemp(prefix=".record-", dir=os.path.dirname(os.path.abspath(path)))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"format": _RECORD_FORMAT, "kernels": kernels}, f, sort_keys=True)
            os.chmod(tmp, 0o644)  # (mkstemp's 0600: every user of the install reads it)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    _KNOWN.update(new)
    return len(new)


def _record_quietly() -> None:
    """`record_used` after a worker's task: a failure is reported once on stderr and
    never reaches the task."""
    global _RECORD_FAILED
    if _RECORD_FAILED:
        return
    try:
        record_used()
    except Exception as exc:  # noqa: BLE001 - the record is only a hint for the next daemon
        _RECORD_FAILED = True
        print(f"sguard.spark.daemon: not recording the kernel variants used: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _recording(task_main: Callable[..., Any]) -> Callable[..., Any]:
    """PySpark's worker entry point (``pyspark.worker.main``, one call per task), followed
    by `_record_quietly`."""
    def main(*args: Any, **kwargs: Any) -> Any:
        try:
            return task_main(*args, **kwargs)
        finally:
            _record_quietly()
    main.__wrapped__ = task_main  # type: ignore[attr-defined]
    return main


def preload(max_per_kernel: int | None = PRELOAD_VARIANTS_PER_KERNEL,
            record: str | None = None) -> tuple[int, int]:
    """Import sguard's runtime and load the cached kernel variants the record at `record`
    (default `record_path`) names, or without a record each kernel's most recently
    written ones, at most `max_per_kernel` of each (None: all): ``(variants loaded,
    kernels)`` (`mmm.preload_kernels`). What is loaded then counts as known to
    `record_used`."""
    import sguard.convert  # noqa: F401 - kernels of the state conversion
    import sguard.spark.reader  # noqa: F401 - the state readers' tasks
    import sguard.spark.runtime  # noqa: F401 - mmm, ioservice, operators, keys
    from mmm import loaded_kernel_variants, preload_kernels
    got = preload_kernels(max_per_kernel, only=read_record(record))
    _KNOWN.update((n, s) for n, sigs in loaded_kernel_variants().items() for s in sigs)
    return got


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
    import pyspark.worker
    # PySpark's daemon looks ``pyspark.worker.main`` up for each task (`_recording`)
    pyspark.worker.main = _recording(pyspark.worker.main)
    gc.freeze()
    from pyspark import daemon
    daemon.manager()


if __name__ == "__main__":
    main()
