"""sguard.spark.budget: where an executor's budget comes from, partitions of one executor
sharing it (in one process and across worker processes through the ledger), the error
of a batch that cannot fit, and the recovery when the budget is raised. Real pool files
on disk under real page caches; a real second process killed with SIGKILL."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mmm.pagecache import BudgetError, PageCache, WorkingSetTooLargeError, is_memory_fs
from mmm.pool import PagePool
from sguard.spark.budget import (DEFAULT_MACHINE_FRACTION, PYSPARK_MEMORY, QUERY_OPTION,
                                 ExecutorBudget, MemoryBudget, machine_memory_bytes,
                                 parse_size)

DISK_TMP = os.environ.get("SGUARD_TEST_DISK_DIR", "/var/tmp")
PB = 4096
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def disk() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="budget-", dir=DISK_TMP)
    if is_memory_fs(d):
        shutil.rmtree(d)
        pytest.fail(f"{DISK_TMP} is a memory file system: set SGUARD_TEST_DISK_DIR to a disk")
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Part:
    """A partition: frames of a pool file on disk under a page cache; a batch writes some
    of them (its working set is exactly those pages)."""

    def __init__(self, d: str, name: str, n: int) -> None:
        self.pool = PagePool(page_bytes=PB, capacity_bytes=64 << 20,
                             path=os.path.join(d, f"pool-{name.replace('/', '_')}"))
        self.frames = self.pool.allocate(n)
        self.model = (np.arange(n) % 251).astype(np.uint8)
        self.pool.frames[self.frames, 100] = self.model
        self.cache = PageCache(self.pool, 2 * PB, name=name)
        self.cache.evict_all()  # a batch's pages then all come in during it

    def batch(self, idx: Any, value: int) -> None:
        self.pool.frames[self.frames[idx], 100] = np.uint8(value)
        self.model[idx] = value

    def read_all(self) -> None:
        assert np.array_equal(self.pool.frames[self.frames, 100], self.model)


def test_sizes_parse_as_spark_writes_them() -> None:
    assert parse_size("512m", "x") == 512 << 20
    assert parse_size("2g", "x") == 2 << 30
    assert parse_size("2GB", "x") == 2 << 30
    assert parse_size("1024k", "x") == 1 << 20
    assert parse_size("300", "x") == 300 << 20  # MiB, as spark.executor.pyspark.memory
    assert parse_size(4096, "x") == 4096
    for bad in ("", "12q", "-1g", "0", "1.5g", True):
        with pytest.raises(BudgetError, match="^x: "):
            parse_size(bad, "x")  # type: ignore[arg-type]


def test_budget_from_option_then_pyspark_memory_then_machine_fraction() -> None:
    conf = {PYSPARK_MEMORY: "3g"}
    assert MemoryBudget.from_conf(conf, "1g") == MemoryBudget(1 << 30, source="option")
    b = MemoryBudget.from_conf(conf)
    assert (b.resolve(), b.source) == (3 << 30, "pyspark.memory")
    d = MemoryBudget.from_conf({})
    assert d.source == "default" and d.budget_bytes is None
    machine = machine_memory_bytes()
    assert 0 < machine <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert d.resolve() == int(machine * DEFAULT_MACHINE_FRACTION)
    assert MemoryBudget.from_conf({}, machine_fraction=0.25).resolve() == int(machine * 0.25)
    with pytest.raises(BudgetError, match=QUERY_OPTION):
        MemoryBudget.from_conf(conf, "lots")
    with pytest.raises(BudgetError, match=PYSPARK_MEMORY):
        MemoryBudget.from_conf({PYSPARK_MEMORY: "2x"})
    with pytest.raises(BudgetError, match="machine_fraction"):
        MemoryBudget(machine_fraction=1.5)


def test_partitions_of_one_process_share_the_budget(disk: str) -> None:
    """Alone, a partition may use the whole budget; a second one gets what is free or
    its equal share; once both ran a batch the total is within the budget, and every
    byte reads back."""
    budget = 64 * PB
    ex = ExecutorBudget(budget, os.path.join(disk, "ledger"))
    a, b = Part(disk, "a", 200), Part(disk, "b", 200)
    ex.register("a", a.cache)
    rng = np.random.default_rng(3)
    for i in range(4):
        a.batch(rng.choice(200, 20, replace=False), i)
        ex.after_batch("a")
        assert a.cache.resident_bytes() <= budget
    assert a.cache.budget_bytes == budget  # alone: the whole budget
    ex.register("b", b.cache)
    for i in range(6):
        b.batch(rng.choice(200, 20, replace=False), i)
        ex.after_batch("b")
        assert b.cache.resident_bytes() <= b.cache.budget_bytes
        a.batch(rng.choice(200, 20, replace=False), 10 + i)
        ex.after_batch("a")
        total = a.cache.resident_bytes() + b.cache.resident_bytes()
        assert total <= budget
        assert a.cache.budget_bytes >= budget // 2 and b.cache.budget_bytes >= budget // 2
    led = ex.ledger()
    assert set(led) == {"a", "b"} and sum(e["resident_bytes"] for e in led.values()) <= budget
    st = ex.stats()
    assert st["a"]["evicted_bytes"] > 0 and st["a"]["state_bytes"] == 200 * PB
    a.read_all()
    b.read_all()
    ex.unregister("b")
    assert set(ex.ledger()) == {"a"}
    with pytest.raises(KeyError, match="'b' is not under"):
        ex.after_batch("b")


def test_before_batch_reads_the_batch_pages_within_the_allowance(disk: str) -> None:
    """`before_batch` reads the announced frames in and evicts others to make room within
    the partition's allowance (here: what the other partition leaves), changes no byte,
    and refuses a frame outside the pool, or a partition not registered, before any work."""
    budget = 64 * PB
    ex = ExecutorBudget(budget, os.path.join(disk, "ledger"))
    a, b = Part(disk, "a", 200), Part(disk, "b", 200)
    ex.register("a", a.cache)
    ex.register("b", b.cache)
    a.batch(np.arange(40), 7)  # a keeps 40 pages resident: b may keep its equal share
    ex.after_batch("a")
    assert a.cache.resident_bytes() == 40 * PB
    b.batch(np.arange(20), 9)
    ex.after_batch("b")
    b.cache.evict_all()
    want = b.frames[[1, 5, 6, 7, 30, 31, 100, 150]]
    assert ex.before_batch("b", want) == len(want)
    assert b.cache.budget_bytes == budget // 2
    for _ in range(200):  # read in (asynchronously), not faulted one by one
        if b.cache.resident_bytes() >= len(want) * PB:
            break
        time.sleep(0.01)
    assert b.cache.resident_bytes() >= len(want) * PB
    ex.after_batch("b")
    assert ex.before_batch("b", want) == 0  # resident since the batch: nothing to read
    # a batch of more frames than the allowance: the coldest others make room
    big = b.frames[np.arange(0, 200, 5)]  # 40 frames against an allowance of 32
    before = b.cache.resident_bytes()
    got = ex.before_batch("b", big)
    assert 0 < got < len(big)  # no more than the allowance holds: the rest fault in
    assert b.cache.resident_bytes() <= max(before, b.cache.budget_bytes)
    with pytest.raises(ValueError):
        ex.before_batch("b", np.array([b.pool.n_frames + 5]))
    with pytest.raises(KeyError, match="'c' is not under"):
        ex.before_batch("c", want)
    a.read_all()
    b.read_all()


_WORKER = textwrap.dedent("""
    import os, sys
    from mmm.pagecache import PageCache
    from mmm.pool import PagePool
    from sguard.spark.budget import ExecutorBudget
    d, ledger, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pool = PagePool(4096, 64 << 20, os.path.join(d, "pool-w"))
    cache = PageCache(pool, 8192, name="w")
    ex = ExecutorBudget(budget, ledger)
    ex.register("worker 2/partition 7", cache)
    pool.frames[pool.allocate(20), 100] = 1  # 20 pages: less than an equal share
    ex.after_batch("worker 2/partition 7")
    print(cache.resident_bytes(), flush=True)
    sys.stdin.readline()
""")


def test_workers_of_one_executor_share_through_the_ledger(disk: str) -> None:
    """A partition in another worker process holds part of the budget: this process's
    partition keeps what is left (or its equal share); once that worker is killed -9 its
    entry no longer counts."""
    budget = 64 * PB
    ledger = os.path.join(disk, "ledger")
    p = subprocess.Popen([sys.executable, "-c", _WORKER, disk, ledger, str(budget)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert p.stdout is not None
        theirs = int(p.stdout.readline())
        assert 0 < theirs <= budget
        ex = ExecutorBudget(budget, ledger)
        a = Part(disk, "a", 200)
        ex.register("a", a.cache)
        assert set(ex.ledger()) == {"a", "worker 2/partition 7"}
        a.batch(np.arange(10), 1)
        ex.after_batch("a")
        assert a.cache.budget_bytes == max(budget // 2, budget - theirs)
        assert a.cache.resident_bytes() + theirs <= budget
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    assert set(ex.ledger()) == {"a"}
    assert sorted(os.listdir(ledger)) == ["a.json"]  # the dead worker's entry is removed
    a.batch(np.arange(10, 20), 2)
    ex.after_batch("a")
    assert a.cache.budget_bytes == budget
    a.read_all()


def test_a_reused_pid_does_not_keep_a_dead_partitions_share(disk: str) -> None:
    """A ledger entry names its process by pid and start time: an entry whose pid the
    system has given to another (live) process no longer counts, and is removed; an
    entry written before start times were recorded counts while its pid lives."""
    ledger = os.path.join(disk, "ledger")
    ex = ExecutorBudget(64 * PB, ledger)
    a = Part(disk, "a", 50)
    ex.register("a", a.cache)
    parent = os.getppid()  # a live process, never this one
    for name, start in (("stale", 12345), ("old format", None)):
        entry = {"partition": name, "pid": parent, "resident_bytes": 10 * PB,
                 "state_bytes": 40 * PB}
        if start is not None:
            entry["start"] = start
        with open(os.path.join(ledger, f"{name}.json"), "w", encoding="utf-8") as fh:
            json.dump(entry, fh)
    assert set(ex.ledger()) == {"a", "old format"}
    assert not os.path.exists(os.path.join(ledger, "stale.json"))
    assert ex.allowance("a") == (64 * PB - 10 * PB, 2)  # what the live one leaves
    a.read_all()


def test_a_batch_that_cannot_fit_names_partition_size_and_budget_then_runs_when_raised(
        disk: str) -> None:
    ex = ExecutorBudget(16 * PB, os.path.join(disk, "ledger"))
    a = Part(disk, "aggregate/partition 3", 300)
    ex.register("aggregate/partition 3", a.cache)
    a.batch(np.arange(40), 1)  # 40 pages in one batch: more than 16
    with pytest.raises(WorkingSetTooLargeError) as ei:
        ex.after_batch("aggregate/partition 3")
    e: Any = ei.value
    msg = str(e)
    state = 300 * PB
    assert "partition aggregate/partition 3" in msg
    assert f"executor memory budget {16 * PB} bytes" in msg and f"state {state} bytes" in msg
    assert e.partition == "aggregate/partition 3" and e.state_bytes == state
    assert e.working_set_bytes > 16 * PB and e.budget_bytes == 16 * PB
    assert a.cache.resident_bytes() <= 16 * PB  # evicted before raising
    # the same batch size again fails again; with the budget raised it runs
    a.batch(np.arange(40, 80), 2)
    with pytest.raises(WorkingSetTooLargeError):
        ex.after_batch("aggregate/partition 3")
    ex.set_budget_bytes(64 * PB)
    a.batch(np.arange(80, 120), 3)
    ex.after_batch("aggregate/partition 3")
    assert a.cache.resident_bytes() <= 64 * PB
    a.read_all()
    with pytest.raises(BudgetError):
        ex.set_budget_bytes(0)
    assert ex.budget_bytes == 64 * PB


def test_a_query_budget_from_keyword_then_option_then_pyspark_memory() -> None:
    """`MemoryBudget.for_query`: the first value given wins; none is no budget; ``auto``
    is the machine fraction; a bad value names where it came from."""
    assert MemoryBudget.for_query(None, None, None) is None
    assert MemoryBudget.for_query(None, "  ", None) is None
    assert MemoryBudget.for_query("64m", "1g", "2g") == MemoryBudget(64 << 20, source="option")
    assert MemoryBudget.for_query(None, "1g", "2g") == MemoryBudget(1 << 30, source="option")
    assert MemoryBudget.for_query(None, None, "2g") == MemoryBudget(2 << 30,
                                                                    source="pyspark.memory")
    assert MemoryBudget.for_query(4096, None, None) == MemoryBudget(4096, source="option")
    auto = MemoryBudget.for_query(None, "AUTO", "2g")
    assert auto is not None and auto.budget_bytes is None
    assert auto.resolve() == int(machine_memory_bytes() * DEFAULT_MACHINE_FRACTION)
    for args, what in (((1.5, None, None), "memory_budget"), ((None, "x", None), QUERY_OPTION),
                       ((None, None, "0"), PYSPARK_MEMORY), ((True, None, None), "memory_budget")):
        with pytest.raises(BudgetError, match=what.replace(".", r"\.")):
            MemoryBudget.for_query(*args)  # type: ignore[arg-type]


def test_one_executor_budget_per_ledger_and_disk_local_dirs(disk: str) -> None:
    from sguard.spark.budget import executor_budget
    from sguard.spark.placement import disk_local_dir
    led = os.path.join(disk, "ledger")
    a = executor_budget(led, 1 << 20)
    assert executor_budget(led, 1 << 20) is a
    assert executor_budget(led, 2 << 20) is a and a.budget_bytes == 2 << 20  # raised
    assert executor_budget(os.path.join(disk, "other"), 1 << 20) is not a
    with pytest.raises(BudgetError):
        executor_budget(led, 0)
    assert a.budget_bytes == 2 << 20  # unchanged by the refused value
    assert disk_local_dir(1, [disk]) == os.path.join(disk, f"sguard-{os.getuid()}")
    if is_memory_fs("/dev/shm"):
        assert disk_local_dir(1, ["/dev/shm", disk]).startswith(disk)
        with pytest.raises(BudgetError, match="every local directory"):
            disk_local_dir(1, ["/dev/shm"])
