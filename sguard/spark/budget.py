"""A memory budget per executor, shared by the partitions that executor holds (issue 33).

Each partition's pool is a file on a local disk under an `mmm.pagecache.PageCache`;
`ExecutorBudget.after_batch` runs after every batch of a partition and keeps the
resident bytes of all the executor's partitions within one budget:

* The budget (`MemoryBudget.from_conf`): a query's own ``sguard.memoryBudget`` option
  when given, else Spark's ``spark.executor.pyspark.memory`` when set (the memory Spark
  grants the executor's Python side), else `DEFAULT_MACHINE_FRACTION` of the memory of
  the machine the executor runs on (its memory cgroup's limit when lower), resolved on
  the executor (`MemoryBudget.resolve`). Sizes use Spark's syntax (``512m``, ``2g``; a
  bare number is MiB, as for ``spark.executor.pyspark.memory``).
* Sharing. An executor's partitions run in several Python workers (one per task slot),
  so they meet in a ledger directory on the executor's local disk: after its batch each
  partition writes its resident bytes there (one small file per partition, replaced
  atomically; entries of dead processes are ignored). A partition may keep resident
  what the others leave free, and at least an equal share (budget / partitions): its
  ``allowance = max(budget // n, budget - others)``. `after_batch` sets the partition's
  cache budget to its allowance and enforces it. The total is within the budget once
  every partition has run a batch since the last one joined (a partition's pages can
  only be let go by the process that maps them); until then it is at most the budget
  plus what the others held above their equal share.
* A partition whose one batch touched more pages than its allowance raises
  `mmm.pagecache.WorkingSetTooLargeError` naming the partition, its state size, the
  batch's pages and the budget (after evicting back within it): raising the budget (a
  new `MemoryBudget`, `ExecutorBudget.set_budget_bytes`) lets the query go on.

Wiring (`sguard.spark.runtime`): a query gets its budget from
`MemoryBudget.for_query` (``stateful(memory_budget=...)``, the session's
`QUERY_OPTION`, `PYSPARK_MEMORY`; none: every page in memory under /dev/shm), its
pools then live on a disk (`sguard.spark.placement.disk_local_dir`), the ledger under
``<local_dir>/_budget`` (`executor_budget`), every batch starts with `before_batch`
(the pages its operator says it reads come in together, `PageCache.will_use`) and ends
with `after_batch` (the batch's pages: those it wrote) and `PageCache.unmap`.

What the budget counts: the pool frames' bytes in memory (`PageCache.resident_bytes`:
page cache, mapped or not), an upper bound of their share of the workers' RSS.
Interpreters, page tables and Arrow batches are outside it.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mmm.pagecache import BudgetError, PageCache, WorkingSetTooLargeError

__all__ = ["MemoryBudget", "ExecutorBudget", "BudgetError", "WorkingSetTooLargeError",
           "DEFAULT_MACHINE_FRACTION", "QUERY_OPTION", "PYSPARK_MEMORY", "parse_size",
           "machine_memory_bytes", "executor_budget"]

DEFAULT_MACHINE_FRACTION = 0.5
"""Without a query option or ``spark.executor.pyspark.memory``, the partitions of one
executor keep at most this fraction of the machine's memory (or of its memory cgroup's
limit, when lower) resident: the rest is for the JVM, the interpreters and Arrow."""
QUERY_OPTION = "sguard.memoryBudget"
"""The per-query option that overrides the executor default (a Spark size: ``4g``)."""
PYSPARK_MEMORY = "spark.executor.pyspark.memory"

_UNITS = {"": 1 << 20, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")
_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def parse_size(value: str | int, what: str) -> int:
    """Bytes of a Spark size (``512m``, ``2g``, ``1024k``, ``100b``; a bare number is MiB).

    Raises
    ------
    BudgetError
        If ``value`` is not such a size or is not positive; the message names ``what``.
    """
    if isinstance(value, bool):
        raise BudgetError(f"{what}: {value!r} is not a size (e.g. 512m, 2g)")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise BudgetError(f"{what}: {value!r} is not a size (e.g. 512m, 2g)")
        n = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if n <= 0:
        raise BudgetError(f"{what}: {value!r} must be positive")
    return n


def _cgroup_limit_bytes() -> int | None:
    """This process's memory cgroup limit (v2 ``memory.max`` of its own cgroup, or v1
    ``memory.limit_in_bytes``), None when unlimited or not readable."""
    paths = list(_CGROUP_FILES)
    try:
        with open("/proc/self/cgroup", encoding="ascii") as fh:
            for line in fh:
                hid, ctrl, rel = line.rstrip("\n").split(":", 2)
                if hid == "0" and ctrl == "":
                    paths.insert(0, f"/sys/fs/cgroup{rel}/memory.max")
                elif "memory" in ctrl.split(","):
                    paths.insert(0, f"/sys/fs/cgroup/memory{rel}/memory.limit_in_bytes")
    except (OSError, ValueError):
        pass
    for p in paths:
        try:
            with open(p, encoding="ascii") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return None


def machine_memory_bytes() -> int:
    """The memory of this machine (``SC_PHYS_PAGES``), or its memory cgroup's limit when
    lower."""
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    lim = _cgroup_limit_bytes()
    return min(phys, lim) if lim is not None else phys


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """Where an executor's memory budget comes from (module docstring); shipped to the
    executors, resolved there."""

    budget_bytes: int | None = None
    """An explicit budget (the query's option or ``spark.executor.pyspark.memory``)."""
    machine_fraction: float = DEFAULT_MACHINE_FRACTION
    """Otherwise this fraction of the executor machine's memory."""
    source: str = "default"
    """What set it: ``"option"``, ``"pyspark.memory"`` or ``"default"``."""

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise BudgetError(f"budget_bytes={self.budget_bytes} must be positive")
        if not 0.0 < self.machine_fraction <= 1.0:
            raise BudgetError(f"machine_fraction={self.machine_fraction} must be in (0, 1]")

    @classmethod
    def from_conf(cls, conf: Mapping[str, str], option: str | int | None = None,
                  machine_fraction: float = DEFAULT_MACHINE_FRACTION) -> "MemoryBudget":
        """The budget a query gets: its ``option`` (`QUERY_OPTION`), else ``conf``'s
        `PYSPARK_MEMORY`, else ``machine_fraction`` of the executor's machine.

        Raises
        ------
        BudgetError
            If the option or the Spark setting is not a positive size (naming which).
        """
        if option is not None:
            return cls(parse_size(option, QUERY_OPTION), machine_fraction, "option")
        raw = conf.get(PYSPARK_MEMORY)
        if raw:
            return cls(parse_size(raw, PYSPARK_MEMORY), machine_fraction, "pyspark.memory")
        return cls(None, machine_fraction, "default")

    @classmethod
    def for_query(cls, keyword: str | int | None, option: str | None,
                  pyspark_memory: str | None) -> "MemoryBudget | None":
        """The budget of a query (`sguard.spark.stateful`'s ``memory_budget``): the
        keyword when given, else the session's `QUERY_OPTION`, else Spark's
        `PYSPARK_MEMORY`, else None (no budget: every page in memory). ``"auto"`` (as
        keyword or option) is `DEFAULT_MACHINE_FRACTION` of the executor's machine,
        resolved there.

        Raises
        ------
        BudgetError
            If the value given is not ``"auto"`` or a positive size; the message names
            where it came from (``memory_budget``, `QUERY_OPTION` or `PYSPARK_MEMORY`).
        """
        for value, what, source in ((keyword, "memory_budget", "option"),
                                    (option, QUERY_OPTION, "option"),
                                    (pyspark_memory, PYSPARK_MEMORY, "pyspark.memory")):
            if value is None or (isinstance(value, str) and not value.strip()):
                continue
            if isinstance(value, str) and value.strip().lower() == "auto":
                return cls(None, DEFAULT_MACHINE_FRACTION, "default")
            return cls(parse_size(value, what), DEFAULT_MACHINE_FRACTION, source)
        return None

    def resolve(self) -> int:
        """Bytes of the budget on this machine."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        return int(machine_memory_bytes() * self.machine_fraction)


class ExecutorBudget:
    """One executor's budget over the page caches of its partitions (module docstring).

    Parameters
    ----------
    budget_bytes : int
        Resident bytes all the executor's partitions may keep after their batches.
    ledger_dir : str, optional
        Directory on the executor's local disk where the executor's workers report their
        partitions' resident bytes (created; a private temporary one when None: then only
        this process's partitions share the budget).

    Raises
    ------
    BudgetError
        If ``budget_bytes`` is not positive.
    """

    def __init__(self, budget_bytes: int, ledger_dir: str | None = None) -> None:
        self.budget_bytes = parse_size(int(budget_bytes), "budget_bytes")
        self.ledger_dir = ledger_dir or tempfile.mkdtemp(prefix="sguard-budget-")
        os.makedirs(self.ledger_dir, exist_ok=True)
        self._caches: dict[str, PageCache] = {}
        self._lock = threading.Lock()

    def set_budget_bytes(self, budget_bytes: int) -> None:
        """Raise or lower the executor's budget (effective at each partition's next batch).

        Raises
        ------
        BudgetError
            If it is not positive; the budget is unchanged.
        """
        self.budget_bytes = parse_size(int(budget_bytes), "budget_bytes")

    # -- membership -------------------------------------------------------------------------
    def _entry(self, partition: str) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", partition)
        return os.path.join(self.ledger_dir, f"{safe}.json")

    def register(self, partition: str, cache: PageCache) -> None:
        """Put a partition's cache under the budget (replacing one of the same name).

        Raises
        ------
        BudgetError
            If the cache cannot be given its equal share (fewer than two pages).
        """
        with self._lock:
            self._caches[partition] = cache
        self._report(partition, cache.resident_bytes(), cache.pool.used_frames
                     * cache.pool.page_bytes)

    def unregister(self, partition: str) -> None:
        """Take a partition out (its pages stay where they are)."""
        with self._lock:
            self._caches.pop(partition, None)
        try:
            os.unlink(self._entry(partition))
        except FileNotFoundError:
            pass

    def _report(self, partition: str, resident_bytes: int, state_bytes: int) -> None:
        path = self._entry(partition)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"partition": partition, "pid": os.getpid(),
                       "start": _start_time(os.getpid()),
                       "resident_bytes": int(resident_bytes),
                       "state_bytes": int(state_bytes)}, fh)
        os.replace(tmp, path)

    def ledger(self) -> dict[str, dict[str, int]]:
        """Every live partition of the executor: ``{name: {"pid", "resident_bytes",
        "state_bytes"}}`` as last reported. An entry whose process is gone is left out and
        removed: a process is its pid and its start time, so that a pid the system has
        since given to another process does not keep a dead partition's share."""
        out: dict[str, dict[str, int]] = {}
        try:
            names = os.listdir(self.ledger_dir)
        except FileNotFoundError:
            return out
        for name in names:
            if not name.endswith(".json"):
                continue
            path = os.path.join(self.ledger_dir, name)
            try:
                with open(path, encoding="utf-8") as fh:
                    e = json.load(fh)
                pid = int(e["pid"])
                start = e.get("start")
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue  # replaced or removed while read
            if pid != os.getpid() and not _alive(pid, start):
                _remove_if_dead(path, pid, start)
                continue
            out[str(e["partition"])] = {"pid": pid, "resident_bytes": int(e["resident_bytes"]),
                                        "state_bytes": int(e["state_bytes"])}
        return out

    # -- the hook -----------------------------------------------------------------------------
    def _cache(self, partition: str) -> PageCache:
        with self._lock:
            cache = self._caches.get(partition)
        if cache is None:
            raise KeyError(f"partition {partition!r} is not under this executor's budget")
        return cache

    def allowance(self, partition: str) -> tuple[int, int]:
        """(bytes ``partition`` may keep resident now, partitions sharing the budget)."""
        led = self.ledger()
        led.pop(partition, None)
        n = len(led) + 1
        others = sum(e["resident_bytes"] for e in led.values())
        return max(self.budget_bytes // n, self.budget_bytes - others), n

    def before_batch(self, partition: str, frames: Any) -> int:
        """Announce the frames ``partition``'s next batch reads (its operator's
        `OperatorState.frames_for`): its cache takes its allowance, evicts the coldest
        frames the batch does not use to make room, and reads those frames in together
        (`PageCache.will_use`) instead of one fault at a time. Returns the frames read
        ahead. Changes no byte of any page.

        Raises
        ------
        KeyError
            If ``partition`` is not registered.
        ValueError
            If a frame lies outside the partition's pool; nothing is evicted or read.
        """
        cache = self._cache(partition)
        allow, _ = self.allowance(partition)
        cache.set_budget(max(allow, 2 * cache.pool.page_bytes))
        return cache.will_use(frames)

    def after_batch(self, partition: str, written_since: int | None = None) -> int:
        """Bring ``partition``'s resident bytes within its allowance after one of its
        batches and report them; returns the frames evicted. With ``written_since`` (the
        pool's clock when the batch began) the batch's pages are those it wrote
        (`PageCache.enforce`): pages an asynchronous checkpoint or a recovery read in
        meanwhile do not count.

        Raises
        ------
        KeyError
            If ``partition`` is not registered.
        WorkingSetTooLargeError
            If the batch touched more pages than the allowance holds (after evicting back
            within it); the message names the partition, its state, the batch's pages, its
            allowance and the executor's budget.
        """
        cache = self._cache(partition)
        allow, n = self.allowance(partition)
        cache.set_budget(max(allow, 2 * cache.pool.page_bytes))
        evicted = cache.enforce(written_since=written_since)
        st = cache.stats()
        self._report(partition, st["resident_bytes"], st["state_bytes"])
        ws = cache.last_working_set_bytes
        if ws > cache.budget_bytes:
            raise WorkingSetTooLargeError(
                f"partition {partition}: one batch touched {ws} bytes of pages, more than "
                f"the {cache.budget_bytes} bytes it may keep in memory (executor memory "
                f"budget {self.budget_bytes} bytes shared by {n} partition(s); state "
                f"{st['state_bytes']} bytes); raise {QUERY_OPTION} or "
                f"{PYSPARK_MEMORY}, or use more partitions", partition, st["state_bytes"],
                ws, self.budget_bytes)
        return evicted

    def stats(self) -> dict[str, dict[str, int]]:
        """Resident and evicted bytes of this process's partitions (`PageCache.stats`)."""
        with self._lock:
            caches = dict(self._caches)
        return {p: c.stats() for p, c in caches.items()}


_EXECUTOR: dict[str, ExecutorBudget] = {}
_EXECUTOR_LOCK = threading.Lock()


def executor_budget(ledger_dir: str, budget_bytes: int) -> ExecutorBudget:
    """This process's `ExecutorBudget` of the executor whose partitions report in
    ``ledger_dir`` (one per directory), its budget set to ``budget_bytes`` (the last
    query to run a batch sets it: a query restarted with a larger budget raises it).

    Raises
    ------
    BudgetError
        If ``budget_bytes`` is not positive.
    """
    with _EXECUTOR_LOCK:
        eb = _EXECUTOR.get(ledger_dir)
        if eb is None:
            eb = _EXECUTOR[ledger_dir] = ExecutorBudget(budget_bytes, ledger_dir)
        elif eb.budget_bytes != budget_bytes:
            eb.set_budget_bytes(budget_bytes)
    return eb


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat``, field
    22), or None where there is no /proc or no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, start: int | None = None) -> bool:
    """Whether process `pid` runs, and is the one that started at `start` (when given and
    the system tells start times)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if start is None:
        return True
    now = _start_time(pid)
    return now is None or now == int(start)


def _remove_if_dead(path: str, pid: int, start: int | None) -> None:
    """Remove a dead process's ledger entry, unless it was replaced meanwhile (by a live
    process that took the partition over)."""
    try:
        with open(path, encoding="utf-8") as fh:
            e = json.load(fh)
        if (int(e["pid"]), e.get("start")) == (pid, start):
            os.unlink(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
