"""Compiled kernels of the state core (numba).

Every structure's hot loop lives in a submodule here, compiled with `jit`
(``numba.njit`` with ``cache=True`` and ``nogil=True``, so an I/O thread keeps
running while a kernel does). Kernels only ever see numpy arrays: flat views
of page frames, page tables, key and value columns. They never allocate pages
and never write a frame that a snapshot still shares: the Python side resolves
and un-shares (``pm.writable``) every page a batch may write before it calls a
kernel, or the kernel returns early asking for more pages.

numba caches compiled code next to the source in ``__pycache__``; when that is
not writable (a read-only install) it falls back to a per-user cache directory,
and ``NUMBA_CACHE_DIR`` overrides both.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Callable, TypeVar

import numba

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["jit", "cacheable", "cached_signatures", "cached_kernels", "preload_cached",
           "kernel_name", "loaded_variants"]

#: every kernel `jit` made, in definition order (what `preload_cached` loads)
_KERNELS: list[Any] = []


def cacheable(fn: Callable[..., Any]) -> bool:
    """Whether `fn`'s compiled code may be cached on disk.

    Only for functions of a module imported under its package name. A module run
    as a file (``python -m doctest sguard/partitioning.py``) has a top-level name
    (``partitioning``); numba keys its cache by source file and stores that name
    in it, so a later ``import sguard.partitioning`` would load the entry and fail
    with ``ModuleNotFoundError``.
    """
    return "." in getattr(fn, "__module__", "")


def jit(fn: F) -> F:
    """Compile `fn` in nopython mode, cached on disk (see `cacheable`), releasing the GIL."""
    out: F = numba.njit(cache=cacheable(fn), nogil=True)(fn)  # type: ignore[assignment,unused-ignore]
    _KERNELS.append(out)
    return out


def cached_signatures(kernel: Any) -> list[tuple[Any, ...]]:
    """Argument types of every variant numba's disk cache holds for `kernel` (a kernel
    made by `jit`) compiled from its current source, for this CPU and this numba, most
    recently written first; ``[]`` when it has no cache or the cache cannot be read.

    numba has no public way to list a cache: a dispatcher's public side (``signatures``,
    ``stats``, ``compile``) only knows what this process compiled or loaded, and the cache
    index is read lazily, one signature at a time, at a call. So this one function reads
    numba's private cache objects (the dispatcher's ``_cache``, its index file and index
    key) and nothing else in the project does; it is guarded (any error means "nothing
    cached") so a numba that moves them only turns preloading off, and
    ``tests/mmm/test_preload_kernels.py`` pins the behaviour.

    Runtime complexity: O(cached variants) plus reading one small index file.
    """
    try:
        cache = kernel._cache
        current = cache._index_key(None, kernel.targetctx.codegen())[1:]  # machine, source
        index = dict(cache._cache_file._load_index())  # key -> its data file's name
        data_path = cache._cache_file._data_path
    except Exception:  # noqa: BLE001 - no cache (not cacheable, unreadable): nothing cached
        return []

    def written(name: Any) -> float:
        try:
            return os.stat(data_path(name)).st_mtime
        except (OSError, TypeError):
            return 0.0
    keys = [(written(name), n, key) for n, (key, name) in enumerate(index.items())
            if tuple(key[1:]) == tuple(current)]
    keys.sort(key=lambda x: (-x[0], x[1]))
    return [key[0] for _, _, key in keys]


def kernel_name(kernel: Any) -> str:
    """A kernel's name across processes: ``module.qualname`` of its Python function."""
    fn = kernel.py_func
    return f"{fn.__module__}.{fn.__qualname__}"


def loaded_variants() -> dict[str, list[str]]:
    """``{kernel_name: [argument types, as text]}`` of every variant this process
    compiled or loaded so far (numba's public ``Dispatcher.signatures``), for the
    kernels defined so far that have any; the text is ``str`` of the tuple of numba
    types, as `cached_signatures` gives them.

    Runtime complexity: O(kernels + loaded variants).
    """
    out: dict[str, list[str]] = {}
    for k in list(_KERNELS):
        sigs = k.signatures
        if sigs:
            out[kernel_name(k)] = [str(tuple(sig)) for sig in sigs]
    return out


def cached_kernels(max_per_kernel: int | None = None,
                   only: Mapping[str, Sequence[str]] | None = None
                   ) -> list[tuple[Any, tuple[Any, ...]]]:
    """Every ``(kernel, argument types)`` numba's disk cache holds for the kernels defined
    so far (`cached_signatures`), in definition order; with `only` (``{kernel_name:
    [argument types as text]}``, as `loaded_variants` gives), only the variants it names,
    in its order; with `max_per_kernel`, only each kernel's first ones (newest written,
    or first in `only`).

    Raises
    ------
    ValueError
        If `max_per_kernel` is negative.

    Runtime complexity: O(kernels + cached variants).
    """
    if max_per_kernel is not None and max_per_kernel < 0:
        raise ValueError(f"max_per_kernel must be >= 0 or None, got {max_per_kernel}")
    out: list[tuple[Any, tuple[Any, ...]]] = []
    for k in list(_KERNELS):
        if only is None:
            out.extend((k, sig) for sig in cached_signatures(k)[:max_per_kernel])
            continue
        wanted = only.get(kernel_name(k))
        if not wanted:
            continue  # (nothing cached is read for a kernel the workload never used)
        cached = {str(tuple(sig)): sig for sig in cached_signatures(k)}
        picked = [cached[w] for w in dict.fromkeys(wanted) if w in cached]
        out.extend((k, sig) for sig in picked[:max_per_kernel])
    return out


def preload_cached(max_per_kernel: int | None = None,
                   only: Mapping[str, Sequence[str]] | None = None) -> tuple[int, int]:
    """Load, for every kernel defined so far, each compiled variant numba's disk cache
    holds for its current source (`cached_kernels`): ``(variants loaded, kernels)``.
    With `only` (``{kernel_name: [argument types as text]}``, what `loaded_variants`
    recorded in the processes of a workload), only those of the variants: the ones a
    workload uses, not every one other work (a test run compiling many argument types)
    left in the cache. With `max_per_kernel`, at most that many of each kernel (the
    first of `only`, else the most recently written): a bounded time whatever the
    cache holds. A variant left out is loaded at its first call as without preloading.

    A kernel is otherwise loaded from the cache at its first call with new argument
    types, ~7-15 ms each, inside whatever operation called it first: a fresh process's
    first batch, or its first recovery, pays for every kernel it touches. A process
    that forks workers (`sguard.spark.daemon`, PySpark's daemon) calls this once so
    that they start with every kernel in memory. Compiles nothing: a cache entry
    written for other source code, another CPU or another numba is skipped, and one
    that fails to load is left to its first call. Starts no thread.
    """
    loaded = 0
    for kernel, sig in cached_kernels(max_per_kernel, only):
        try:
            kernel.compile(sig)  # finds the entry just listed: loads, compiles nothing
        except Exception:  # noqa: BLE001 - left to its first call
            continue
        loaded += 1
    return loaded, len(_KERNELS)
