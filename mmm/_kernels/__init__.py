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

from typing import Any, Callable, TypeVar

import numba

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["jit", "cacheable"]


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
    return out
