"""PageCache: every structure's oracle machine with a budget of a few pages (eviction
after every step), checkpoints and rollbacks across evictions, kill -9 during eviction,
and the error of a batch whose pages cannot fit."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import invariant, run_state_machine_as_test

import mmm
from mmm.pagecache import BudgetError, PageCache, WorkingSetTooLargeError, is_memory_fs
from tests.mmm import test_hashmap, test_keydict, test_ordered_map, test_sequence

DISK_TMP = os.environ.get("SGUARD_TEST_DISK_DIR", "/var/tmp")
BUDGET_PAGES = 3
_ORIG_PM = mmm.PageManager
_CACHES: list[PageCache] = []


def _disk_dir() -> str:
    d = tempfile.mkdtemp(prefix="pagecache-", dir=DISK_TMP)
    if is_memory_fs(d):
        shutil.rmtree(d)
        pytest.skip(f"{DISK_TMP} is a memory file system: set SGUARD_TEST_DISK_DIR")
    return d


class SpillingPageManager(_ORIG_PM):  # type: ignore[misc,valid-type]
    """A PageManager whose pool is a file on disk under a budget of `BUDGET_PAGES` pages."""

    DIR = ""

    def __init__(self, page_bytes: int = mmm.manager.DEFAULT_PAGE_BYTES,
                 capacity_bytes: int = 1 << 22, path: str | None = None, **kw: Any) -> None:
        if path is None and kw.get("_pool") is None:
            fd, path = tempfile.mkstemp(prefix="pool-", dir=self.DIR)
            os.close(fd)
        super().__init__(page_bytes, capacity_bytes, path, **kw)
        _CACHES.append(PageCache(self.pool, BUDGET_PAGES * self.pool.page_bytes,
                                 name=f"pool {self.pool.path}"))


@pytest.fixture
def spilling(monkeypatch: pytest.MonkeyPatch) -> Any:
    d = _disk_dir()
    SpillingPageManager.DIR = d
    monkeypatch.setattr(mmm, "PageManager", SpillingPageManager)
    _CACHES.clear()
    yield d
    _CACHES.clear()
    shutil.rmtree(d, ignore_errors=True)


def spilled(machine: Any) -> Any:
    """`machine` with every pool on disk and evicted down to the budget after each step."""

    class Spilled(machine):  # type: ignore[misc,valid-type]
        @invariant()
        def within_budget_after_eviction(self) -> None:
            for cache in list(_CACHES):
                if cache.pool.used_frames == 0:
                    continue
                cache.enforce()
                assert cache.resident_bytes() <= cache.budget_bytes

    Spilled.__name__ = f"Spilled{machine.__name__}"
    return Spilled


FEW = settings(max_examples=12, stateful_step_count=20, deadline=None)
MACHINES = [test_hashmap.HashMapVsDict, test_hashmap.HashMapGroupsVsDict,
            test_ordered_map.OrderedMapVsSortedDict, test_keydict.KeyDictMachine,
            test_sequence.ListScalarMachine, test_sequence.DequeRecordMachine]


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.__name__)
def test_structure_oracle_with_a_few_pages_resident(spilling: str, machine: Any) -> None:
    run_state_machine_as_test(spilled(machine), settings=FEW)
    assert _CACHES and sum(c.evicted_frames for c in _CACHES) > 0


def test_checkpoint_and_rollback_across_evictions(tmp_path: Any) -> None:
    """Snapshots taken, pages evicted, state changed, evicted again: the snapshot's pages
    (read back from the file) and a rollback give the frozen state."""
    d = _disk_dir()
    try:
        pm = _ORIG_PM(page_bytes=4096, capacity_bytes=8 << 20, path=os.path.join(d, "pool"))
        cache = PageCache(pm.pool, 4 * 4096, name="p0")
        m = mmm.HashMap.create(pm, "m", key="<u8", value=[("c", "<i8")])
        keys = np.arange(20000, dtype="<u8")
        m.put(keys, np.zeros(20000, dtype=[("c", "<i8")]))
        assert cache.enforce() > 0 and cache.resident_bytes() <= cache.budget_bytes
        snap = pm.chkpt()
        frozen = snap.copy_pages(np.arange(len(snap)))
        vals = np.zeros(20000, dtype=[("c", "<i8")])
        vals["c"] = 7
        m.put(keys[::3], vals[::3])
        assert cache.enforce() > 0
        # the snapshot reads its (partly evicted) frozen pages
        again = snap.copy_pages(np.arange(len(snap)))
        assert np.array_equal(np.asarray(frozen), np.asarray(again))
        pm.rollback(snap)
        cache.evict_all()
        assert cache.resident_bytes() == 0
        found, got = m.get(keys)
        assert found.all() and int(got["c"].sum()) == 0
        # incremental: a later snapshot sees only the pages changed since
        snap.release()
        s2 = pm.chkpt()
        s2.complete()
        m.put(keys[:5], vals[:5])
        cache.evict_all()
        s3 = pm.chkpt()
        assert 0 < s3.n_changed < len(s3)
        s3.release()
        pm._check()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_batch_larger_than_budget_fails_naming_partition_size_and_budget() -> None:
    d = _disk_dir()
    try:
        pm = _ORIG_PM(page_bytes=4096, capacity_bytes=16 << 20, path=os.path.join(d, "pool"))
        cache = PageCache(pm.pool, 8 * 4096, name="aggregate/partition 3")
        m = mmm.HashMap.create(pm, "m", key="<u8", value=[("c", "<i8")])
        m.put(np.arange(50000, dtype="<u8"), np.zeros(50000, dtype=[("c", "<i8")]))
        with pytest.raises(WorkingSetTooLargeError) as ei:
            cache.enforce(check=True)
        msg = str(ei.value)
        assert "aggregate/partition 3" in msg and "budget of 32768 bytes" in msg
        assert f"state {pm.pool.used_frames * 4096} bytes" in msg
        assert ei.value.budget_bytes == 32768 and ei.value.working_set_bytes > 32768
        # evicted before raising: memory is back within the budget, the map intact
        assert cache.resident_bytes() <= cache.budget_bytes
        assert len(m) == 50000
        # a small batch afterwards fits
        m.put(np.arange(3, dtype="<u8"), np.zeros(3, dtype=[("c", "<i8")]))
        cache.enforce(check=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_refused_pools() -> None:
    pm = _ORIG_PM(page_bytes=4096, capacity_bytes=1 << 20)
    with pytest.raises(BudgetError, match="anonymous memory"):
        PageCache(pm.pool, 1 << 20)
    if os.path.isdir("/dev/shm") and is_memory_fs("/dev/shm"):
        path = tempfile.mktemp(dir="/dev/shm")
        try:
            pm2 = _ORIG_PM(page_bytes=4096, capacity_bytes=1 << 20, path=path)
            with pytest.raises(BudgetError, match="memory file system"):
                PageCache(pm2.pool, 1 << 20)
        finally:
            os.unlink(path)
    d = _disk_dir()
    try:
        pm3 = _ORIG_PM(page_bytes=4096, capacity_bytes=1 << 20, path=os.path.join(d, "p"))
        with pytest.raises(BudgetError, match="fewer than 2 pages"):
            PageCache(pm3.pool, 4096)
        c = PageCache(pm3.pool, 8192)
        with pytest.raises(BudgetError):
            c.set_budget(100)
        assert c.budget_bytes == 8192
    finally:
        shutil.rmtree(d, ignore_errors=True)


_CHILD = textwrap.dedent("""
    import sys, numpy as np, mmm
    from mmm.pagecache import PageCache
    path = sys.argv[1]
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=64 << 20, path=path)
    cache = PageCache(pm.pool, 6 * 4096, name="child")
    m = mmm.HashMap.create(pm, "m", key="<u8", value=[("c", "<i8")])
    rng = np.random.default_rng(1)
    for i in range(1000):
        k = np.unique(rng.integers(0, 40000, 3000).astype("<u8"))
        v = np.zeros(len(k), dtype=[("c", "<i8")]); v["c"] = i + 1
        m.put(k, v)
        print(i, flush=True)
        cache.enforce()  # evicting: the parent kills us in here or right after
        print("e", flush=True)
        sys.stdin.readline()
""")


def test_kill_9_during_eviction_then_local_recovery() -> None:
    """A process killed while evicting leaves a pool file that attaches to the state
    after its last batch (the file is the pages' backing store)."""
    d = _disk_dir()
    try:
        path = os.path.join(d, "pool")
        p = subprocess.Popen([sys.executable, "-c", _CHILD, path], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        assert p.stdout is not None and p.stdin is not None
        rng = np.random.default_rng(1)
        model: dict[int, int] = {}
        last = -1
        for i in range(6):
            k = np.unique(rng.integers(0, 40000, 3000).astype("<u8"))
            for key in k.tolist():
                model[key] = i + 1
            assert p.stdout.readline().strip() == str(i)
            last = i
            if i < 5:
                assert p.stdout.readline().strip() == "e"
                p.stdin.write("\n")
                p.stdin.flush()
        os.kill(p.pid, signal.SIGKILL)  # during batch `last`'s eviction (or just after)
        p.wait()
        assert last == 5
        pm = _ORIG_PM.attach(path, 4096)
        m = mmm.HashMap.create(pm, "m", key="<u8", value=[("c", "<i8")])
        assert len(m) == len(model)
        keys = np.array(sorted(model), dtype="<u8")
        found, got = m.get(keys)
        assert found.all() and got["c"].tolist() == [model[k] for k in sorted(model)]
    finally:
        shutil.rmtree(d, ignore_errors=True)
