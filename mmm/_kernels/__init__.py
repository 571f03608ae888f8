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

import ast
import importlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import numba

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["jit", "cacheable", "cached_signatures", "cached_kernels", "preload_cached",
           "kernel_name", "loaded_variants", "variant_text", "parse_variant", "find_kernel",
           "compile_variants", "CompileReport", "cached_variants"]

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


def cached_variants() -> dict[str, list[str]]:
    """``{kernel_name: [variant_text, ...]}`` of every variant numba's disk cache holds for
    the kernels defined so far (`cached_kernels`), for the format `compile_variants` reads.
    Kernels made inside a function (a ``<locals>`` name) are left out: no module
    defines them, and they are compiled with the kernels that call them.
    """
    out: dict[str, list[str]] = {}
    for kernel, sig in cached_kernels():
        name = kernel_name(kernel)
        if "<locals>" not in name:
            out.setdefault(name, []).append(variant_text(sig))
    return out


def variant_text(sig: Sequence[Any]) -> str:
    """The argument types of a kernel variant as text that `parse_variant` reads back
    (numba's ``repr`` of the types, e.g. ``(Array(int64, 1, 'C', False, aligned=True),
    int64)``), to list variants in a file.
    """
    return repr(tuple(sig))


_LITERAL_KINDS = {"int": int, "bool": bool}


def parse_variant(text: str) -> tuple[Any, ...]:
    """The numba argument types `variant_text` wrote as `text`.

    Only a tuple of numba type expressions is read: names of ``numba.types``, calls of
    them with constant arguments, and literals (``Literal[int](0)``); nothing else is
    evaluated, so a variants file cannot run code.

    Raises
    ------
    ValueError
        If `text` is not such a tuple (naming the part that is not).
    """
    from numba import types as nt

    def ev(node: ast.expr) -> Any:
        if isinstance(node, ast.Tuple):
            return tuple(ev(e) for e in node.elts)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, str, bool)):
            return node.value
        if isinstance(node, ast.Name):
            value = getattr(nt, node.id, None)
            if isinstance(value, nt.Type) or (isinstance(value, type)
                                              and issubclass(value, nt.Type)):
                return value
        if isinstance(node, ast.Call) and not any(k.arg is None for k in node.keywords):
            func = node.func
            if (isinstance(func, ast.Subscript) and isinstance(func.value, ast.Name)
                    and func.value.id == "Literal" and isinstance(func.slice, ast.Name)
                    and func.slice.id in _LITERAL_KINDS and len(node.args) == 1
                    and not node.keywords):
                value = ev(node.args[0])
                if type(value) is _LITERAL_KINDS[func.slice.id]:
                    return nt.literal(value)  # type: ignore[no-untyped-call]
            elif isinstance(func, ast.Name):
                make = ev(func)
                if isinstance(make, type):
                    return make(*(ev(a) for a in node.args),
                                **{k.arg: ev(k.value) for k in node.keywords if k.arg})
        raise ValueError(f"not a numba type in kernel variant {text!r}: {ast.unparse(node)!r}")

    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"kernel variant {text!r} is not a tuple of numba types: {e}") from e
    if not isinstance(tree, ast.Tuple):
        raise ValueError(f"kernel variant {text!r} is not a tuple of numba types")
    out = ev(tree)
    assert isinstance(out, tuple)
    return out


def find_kernel(name: str) -> Any:
    """The kernel `jit` made whose `kernel_name` is `name`, importing its module
    (the longest importable prefix of `name`) if no kernel of that name is defined yet.

    Raises
    ------
    LookupError
        If no module defines a kernel of that name.
    """
    def defined() -> Any:
        return next((k for k in _KERNELS if kernel_name(k) == name), None)
    kernel = defined()
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if kernel is not None:
            return kernel
        try:
            importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        kernel = defined()
        break
    if kernel is None:
        raise LookupError(f"no kernel named {name!r}")
    return kernel


@dataclass
class CompileReport:
    """What `compile_variants` did: variants compiled, found in numba's disk cache
    (loaded), and those that failed as ``(kernel name, variant text, error)``."""

    compiled: int = 0
    cached: int = 0
    failed: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, other: "CompileReport") -> None:
        self.compiled += other.compiled
        self.cached += other.cached
        self.failed.extend(other.failed)


def compile_variants(variants: Mapping[str, Sequence[str]]) -> CompileReport:
    """Make each listed kernel variant (``{kernel_name: [variant_text, ...]}``) ready in
    numba's disk cache: compile it, and write it there, unless the cache already holds it
    (then it is only loaded). A later process then loads it (~7-15 ms) at its first call
    instead of compiling it (0.1-10 s per variant), so that a deployment can compile once
    (an image build, a warm-up before the first batch) what every fresh process would.

    A kernel that cannot be found or a variant that does not parse or compile is
    reported in `CompileReport.failed`; the others are still done.

    Runtime complexity: the compilation itself, O(variants) otherwise.
    """
    report = CompileReport()
    for name, texts in variants.items():
        try:
            kernel = find_kernel(name)
        except LookupError as e:
            report.failed.extend((name, t, str(e)) for t in texts)
            continue
        for text in texts:
            try:
                sig = parse_variant(text)
                hits = sum(kernel.stats.cache_hits.values())
                kernel.compile(sig)
            except Exception as e:  # noqa: BLE001 - reported; the other variants go on
                report.failed.append((name, text, f"{type(e).__name__}: {e}"))
                continue
            if sum(kernel.stats.cache_hits.values()) > hits:
                report.cached += 1
            else:
                report.compiled += 1
    return report
