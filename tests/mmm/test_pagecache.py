"""PageCache: every structure's oracle machine with a budget of a few pages (eviction
after every step, the budget checked both as page-cache residency and as pages mapped
into this process), the budget against the process's own RSS, checkpoints and rollbacks
across evictions, kill -9 during eviction, and the error of a batch whose pages cannot
fit."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import weakref
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
_CACHES: "weakref.WeakSet[PageCache]" = weakref.WeakSet()
_EVICTED = [0]  # frames evicted by every cache of the running test


def _disk_dir() -> str:
    d = tempfile.mkdtemp(prefix="pagecache-", dir=DISK_TMP)
    if is_memory_fs(d):
        shutil.rmtree(d)
        pytest.fail(f"{DISK_TMP} is a memory file system: set SGUARD_TEST_DISK_DIR to a disk")
    return d


def _rss_bytes() -> int:
    """This process's resident set (``Rss`` of /proc/self/smaps_rollup: exact, walked)."""
    with open("/proc/self/smaps_rollup", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Rss in /proc/self/smaps_rollup")


def _within_budget(cache: PageCache) -> None:
    assert cache.resident_bytes() <= cache.budget_bytes, cache.stats()
    assert cache.mapped_bytes() <= cache.budget_bytes, cache.stats()


class SpillingPageManager(_ORIG_PM):  # type: ignore[misc,valid-type]
    """A PageManager whose pool is a file on disk under a budget of `BUDGET_PAGES` pages."""

    DIR = ""

    def __init__(self, page_bytes: int = mmm.manager.DEFAULT_PAGE_BYTES,
                 capacity_bytes: int = 1 << 22, path: str | None = None, **kw: Any) -> None:
        if path is None and kw.get("_pool") is None:
            fd, path = tempfile.mkstemp(prefix="pool-", dir=self.DIR)
            os.close(fd)
            weakref.finalize(self, _unlink, path)
        super().__init__(page_bytes, capacity_bytes, path, **kw)
        self.page_cache = PageCache(self.pool, BUDGET_PAGES * self.pool.page_bytes,
                                    name=f"pool {self.pool.path}")
        _CACHES.add(self.page_cache)
        weakref.finalize(self.page_cache, _count, self.page_cache.__dict__)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _count(d: dict[str, Any]) -> None:
    _EVICTED[0] += int(d.get("evicted_frames", 0))


@pytest.fixture
def spilling(monkeypatch: pytest.MonkeyPatch) -> Any:
    d = _disk_dir()
    SpillingPageManager.DIR = d
    monkeypatch.setattr(mmm, "PageManager", SpillingPageManager)
    _EVICTED[0] = 0
    yield d
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
                _within_budget(cache)

    Spilled.__name__ = f"Spilled{machine.__name__}"
    return Spilled


FEW = settings(max_examples=12, stateful_step_count=20, deadline=None)
MACHINES = [test_hashmap.HashMapVsDict, test_hashmap.HashMapGroupsVsDict,
            test_ordered_map.OrderedMapVsSortedDict, test_keydict.KeyDictMachine,
            test_sequence.ListScalarMachine, test_sequence.DequeRecordMachine]


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.__name__)
def test_structure_oracle_with_a_few_pages_resident(spilling: str, machine: Any) -> None:
    run_state_machine_as_test(spilled(machine), settings=FEW)
    evicted = _EVICTED[0] + sum(c.evicted_frames for c in list(_CACHES))
    assert evicted > 0


def _pool_with_pages(d: str, n: int, capacity: int = 64 << 20) -> tuple[Any, np.ndarray]:
    pm = _ORIG_PM(page_bytes=4096, capacity_bytes=capacity, path=os.path.join(d, "pool"))
    frames = pm.pool.allocate(n)
    pm.pool.frames[frames, 64:] = (frames[:, None] % 251).astype(np.uint8)
    return pm, frames


def test_budget_holds_in_rss_and_page_cache_under_churn() -> None:
    """A pool of 16 MB on disk, every page resident, a budget of 1 MB: after each
    enforce the pool's page-cache residency and its mapped pages are within the budget
    and the process's own RSS fell by what was evicted; then rounds of random reads and
    writes of 2-200 pages, each followed by enforce, keep it so, and no byte changes."""
    d = _disk_dir()
    try:
        n = 4096
        pm, frames = _pool_with_pages(d, n)
        cache = PageCache(pm.pool, 256 * 4096, name="churn")
        assert cache.mapped_bytes() >= n * 4096 and cache.resident_bytes() >= n * 4096
        rss0 = _rss_bytes()
        assert cache.enforce() >= n - 256
        _within_budget(cache)
        # the process's RSS fell by (nearly) the 15 MB evicted: it counts what the bench
        # measures, not just the page cache
        assert rss0 - _rss_bytes() >= (n - 256) * 4096 - (1 << 20)
        model = (frames % 251).astype(np.uint8)
        rng = np.random.default_rng(7)
        for i in range(60):
            k = int(rng.integers(2, 200))
            pick = rng.choice(n, k, replace=False)
            if i % 2:
                model[pick] = i % 251
                pm.pool.frames[frames[pick], 64:] = np.uint8(i % 251)
            else:
                got = pm.pool.frames[frames[pick], 100]
                assert np.array_equal(got, model[pick])
            cache.enforce()
            _within_budget(cache)
        cache.evict_all()
        assert cache.resident_bytes() == 0 and cache.mapped_bytes() == 0
        assert np.array_equal(pm.pool.frames[frames, 4000], model)
        st = cache.stats()
        assert st["over_budget_after_enforce"] == 0
        assert st["state_bytes"] == n * 4096 and st["budget_bytes"] == 256 * 4096
        cache.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_cold_frames_go_first_and_fresh_ones_stay() -> None:
    d = _disk_dir()
    try:
        pm, frames = _pool_with_pages(d, 40)
        cache = PageCache(pm.pool, 20 * 4096, name="order")
        cache.evict_all()
        _ = int(pm.pool.frames[frames[:16], 8].sum())  # 16 pages in
        assert cache.enforce() == 0  # within the budget: nothing to do
        cache.cold(frames[:4])
        pm.pool.frames[frames[16:24], 8] = 1  # 8 more: 24 pages > 20
        assert cache.enforce() == 24 - 17  # down to LOW_WATER of 20 pages: 17
        res = cache.resident()
        assert not res[frames[:4]].any()  # the cold ones first
        assert res[frames[16:24]].all()  # the fresh ones stay
        assert int((res[frames] > 0).sum()) == 17
        with pytest.raises(ValueError, match="order: cold: frames must lie in"):
            cache.cold([pm.pool.n_frames])
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_bookkeeping_covers_frames_in_use_not_the_capacity() -> None:
    d = _disk_dir()
    try:
        pm, frames = _pool_with_pages(d, 10, capacity=1 << 30)  # 262144 frames of capacity
        cache = PageCache(pm.pool, 8 * 4096, name="small")
        assert len(cache.resident()) == 10
        more = pm.pool.allocate(3000)
        pm.pool.frames[more, 8] = 1
        cache.enforce()
        assert len(cache.resident()) == 3010
        _within_budget(cache)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_checkpoint_and_rollback_across_evictions() -> None:
    """Snapshots taken, pages evicted, state changed, evicted again: the snapshot's pages
    (read back from the file) and a rollback give the frozen state."""
    d = _disk_dir()
    try:
        pm = _ORIG_PM(page_bytes=4096, capacity_bytes=8 << 20, path=os.path.join(d, "pool"))
        cache = PageCache(pm.pool, 4 * 4096, name="p0")
        m = mmm.HashMap.create(pm, "m", key="<u8", value=[("c", "<i8")])
        keys = np.arange(20000, dtype="<u8")
        m.put(keys, np.zeros(20000, dtype=[("c", "<i8")]))
        assert cache.enforce() > 0
        _within_budget(cache)
        snap = pm.chkpt()
        frozen = snap.copy_pages(np.arange(len(snap)))
        vals = np.zeros(20000, dtype=[("c", "<i8")])
        vals["c"] = 7
        m.put(keys[::3], vals[::3])
        assert cache.enforce() > 0
        _within_budget(cache)
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
        assert ei.value.partition == "aggregate/partition 3"
        # evicted before raising: memory is back within the budget, the map intact
        _within_budget(cache)
        assert len(m) == 50000
        # a small batch afterwards fits
        m.put(np.arange(3, dtype="<u8"), np.zeros(3, dtype=[("c", "<i8")]))
        cache.enforce(check=True)
        _within_budget(cache)
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
        with pytest.raises(ValueError, match="evict: frames must lie in"):
            c.evict([-1])
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


def test_working_set_of_written_pages_leaves_out_what_a_reader_brought_in() -> None:
    """`enforce(written_since=clock)`: pages another reader of the pool brought in (a
    checkpoint writer, a recovery) do not count as the batch's; the pages the batch wrote
    (copied on write after the snapshot: new versions) do."""
    d = _disk_dir()
    try:
        pm = _ORIG_PM(page_bytes=4096, capacity_bytes=16 << 20, path=os.path.join(d, "pool"))
        cache = PageCache(pm.pool, 8 * 4096, name="p")
        m = mmm.HashMap.create(pm, "m", key="<u8", value=[("c", "<i8")])
        keys = np.arange(20000, dtype="<u8")
        m.put(keys, np.zeros(len(keys), dtype=[("c", "<i8")]))
        cache.evict_all()
        cache.enforce()
        snap = pm.chkpt()  # the rollback point: writes now go to new frames
        clock0 = int(pm.pool.clock)
        _ = int(pm.pool.frames[np.flatnonzero(pm.pool.state)].sum())  # a reader: every page
        m.put(keys[:2], np.ones(2, dtype=[("c", "<i8")]))  # the batch: two keys
        n_pages = int(pm.pool.used_frames)
        cache.enforce(check=True, written_since=clock0)  # no error: the keys' pages only
        assert 0 < cache.last_working_set_bytes <= 4 * 4096 < n_pages * 4096 // 4
        _within_budget(cache)
        # without the clock every page that came in counts
        _ = int(pm.pool.frames[np.flatnonzero(pm.pool.state)].sum())
        with pytest.raises(WorkingSetTooLargeError):
            cache.enforce(check=True)
        found, vals = m.get(keys[:3])
        assert found.all() and vals["c"].tolist() == [1, 1, 0]
        snap.release()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_unmap_leaves_the_bytes_and_the_page_cache() -> None:
    """`unmap`: nothing of the pool stays mapped in this process, every byte is still
    there (and a write after it lands), the page cache keeps the pages until evicted."""
    d = _disk_dir()
    try:
        pm, frames = _pool_with_pages(d, 30)
        cache = PageCache(pm.pool, 64 * 4096, name="u")
        assert cache.mapped_bytes() >= 30 * 4096
        before = cache.resident_bytes()
        cache.unmap()
        assert cache.mapped_bytes() == 0
        assert cache.resident_bytes() == before  # unmapped, not dropped
        assert np.array_equal(pm.pool.frames[frames, 64:],
                              np.broadcast_to((frames[:, None] % 251).astype(np.uint8),
                                              (30, 4096 - 64)))
        pm.pool.frames[frames[:5], 100] = 7
        cache.unmap()
        cache.evict_all()  # from the file now
        assert cache.resident_bytes() == 0
        assert (pm.pool.frames[frames[:5], 100] == 7).all()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_frames_for_names_every_page_an_upsert_of_those_keys_writes() -> None:
    """`HashMap.frames_for`: the chains of the keys' buckets, distinct and sorted; an
    upsert of those (present) keys writes no page outside them; it reads no page."""
    pm = _ORIG_PM(page_bytes=4096, capacity_bytes=32 << 20)
    m = mmm.HashMap.create(pm, "m", key="<u8", value=[("c", "<i8"), ("s", "<f8")],
                           page_slots=8)  # small pages: many buckets, overflow chains
    n = 3000
    m.upsert(np.arange(n, dtype="<u8"), {"x": np.ones(n)}, {"c": "count", "s": ("sum", "x")})
    rng = np.random.default_rng(3)
    spec = {"c": "count", "s": ("sum", "x")}
    for size in (1, 7, 200, 2000):
        keys = rng.integers(0, n, size).astype("<u8")
        fr = m.frames_for(keys)
        assert fr.dtype == np.int64 and np.array_equal(fr, np.unique(fr))
        assert (pm.pool.state[fr] != mmm.pool.FREE).all()
        before = pm.pool.frames.copy()
        m.upsert(keys, {"x": np.full(size, 2.0)}, spec)
        changed = np.flatnonzero((pm.pool.frames != before).any(axis=1))
        assert np.isin(changed, fr).all(), (size, np.setdiff1d(changed, fr))
        assert len(changed) <= len(fr)
    # a key's page is among its frames: look each of a few keys up page by page
    one = m.frames_for(np.array([5], dtype="<u8"))
    assert 1 <= len(one) < pm.pool.used_frames
    assert m.frames_for(np.zeros(0, dtype="<u8")).shape == (0,)
    with pytest.raises(mmm.errors.RecordTypeError):
        m.frames_for(np.zeros(2, dtype="<f4"))
    found, vals = m.get(np.arange(n, dtype="<u8"))
    assert found.all() and int(vals["c"].sum()) == n + 1 + 7 + 200 + 2000


def _frames_for_oracle(budget_pages: int, make_room: bool) -> None:
    d = _disk_dir()
    try:
        pm = _ORIG_PM(page_bytes=4096, capacity_bytes=64 << 20, path=os.path.join(d, "pool"))
        cache = PageCache(pm.pool, budget_pages * 4096, name="wu")
        m = mmm.HashMap.create(pm, "m", key="<u8", value=[("c", "<i8"), ("s", "<f8")],
                               page_slots=16)  # ~12 keys a page: many pages
        spec = {"c": "count", "s": ("sum", "x")}
        model: dict[int, list[float]] = {}
        rng = np.random.default_rng(11)
        read = 0
        for i in range(40):
            hi = 500 + 400 * i  # the key range grows: splits and new pages every batch
            keys = rng.integers(0, hi, int(rng.integers(1, 80))).astype("<u8")
            x = rng.random(len(keys))
            read += cache.will_use(m.frames_for(keys), make_room=make_room)
            if make_room:  # what is in memory plus what it reads fits in the budget
                assert cache.resident_bytes() <= cache.budget_bytes, cache.stats()
            m.upsert(keys, {"x": x}, spec)
            for k, v in zip(keys.tolist(), x.tolist()):
                e = model.setdefault(k, [0, 0.0])
                e[0] += 1
                e[1] += v
            if i % 7 == 3:
                gone = np.array(sorted(model)[::5], dtype="<u8")
                cache.will_use(m.frames_for(gone), make_room=make_room)
                m.delete(gone)
                for k in gone.tolist():
                    del model[k]
            cache.enforce()  # (a batch that splits many buckets may outgrow the budget)
            _within_budget(cache)
        assert read > 0 and cache.evicted_frames > 0
        assert pm.pool.used_frames > 2 * budget_pages
        cache.evict_all()
        ks, vs = m.items()
        got = {int(k): (int(c), float(s)) for k, c, s in zip(ks, vs["c"], vs["s"])}
        assert got.keys() == model.keys()
        for k, (c, s) in model.items():
            assert got[k][0] == c and got[k][1] == pytest.approx(s)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("make_room", [True, False])
def test_will_use_before_each_batch_keeps_the_oracle_and_the_budget(make_room: bool) -> None:
    """A hash map of ~100 pages under a 32-page budget: before each batch `will_use`
    of the frames its keys touch (evicting others first with ``make_room``), after it
    `enforce`: every value equals a dict's, the budget holds after each `enforce` (and
    after `will_use` with ``make_room``)."""
    _frames_for_oracle(32, make_room)


def test_will_use_marks_frames_used_evicts_others_and_reads_only_what_fits() -> None:
    d = _disk_dir()
    try:
        pm, frames = _pool_with_pages(d, 40)
        cache = PageCache(pm.pool, 20 * 4096, name="wu")
        cache.evict_all()
        _ = int(pm.pool.frames[frames[:16], 8].sum())  # 16 pages in
        cache.enforce()
        # 8 not in memory; 16 + 8 > 20: 4 of the others go first, and not frames[:4],
        # which this batch uses
        assert cache.will_use(np.concatenate((frames[:4], frames[30:38]))) == 8
        res = cache.resident()
        assert res[frames[:4]].all() and int((res[frames[4:16]] > 0).sum()) == 8
        pm.pool.frames[frames[30:38], 8] = 3  # the batch
        assert cache.enforce() == 0  # the batch ran within the budget
        # used frames are evicted last: frames[:4] and [30:38] were just used
        _ = int(pm.pool.frames[frames[20:24], 8].sum())  # 4 more in: 24 > 20
        assert cache.enforce() == 24 - 17  # down to LOW_WATER of 20 pages
        res = cache.resident()
        assert res[frames[:4]].all() and res[frames[30:38]].all()
        assert res[frames[20:24]].all() and int((res[frames[4:16]] > 0).sum()) == 1
        assert cache.will_use(frames[30:38]) == 0  # all in memory: nothing read
        # more than the budget holds: it reads only what fits, the rest faults in later
        cache.evict_all()
        assert cache.will_use(frames) == 20
        assert cache.will_use(frames, make_room=False) == 20  # none in memory since
        with pytest.raises(ValueError, match="wu: will_use: frames must lie in"):
            cache.will_use([pm.pool.n_frames])
        assert np.array_equal(pm.pool.frames[frames[30:38], 8], np.full(8, 3, np.uint8))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_evict_unmaps_run_by_run_where_the_kernel_refuses_a_batched_unmap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Eviction unmaps every run in one ``process_madvise`` where the kernel allows it,
    else with one ``madvise`` per run: both leave nothing mapped or resident and lose
    no byte."""
    import mmm.pagecache as pc
    d = _disk_dir()
    try:
        pm, frames = _pool_with_pages(d, 64)
        cache = PageCache(pm.pool, 8 * 4096, name="runs")
        for batched in (True, False):
            monkeypatch.setattr(pc, "_batched_unmap", [batched and pc._batched_unmap[0]])
            pm.pool.frames[frames, 200] = 9 if batched else 10
            assert cache.evict(frames[::2]) == 32
            res = cache.resident()
            assert not res[frames[::2]].any()
            cache.evict_all()
            assert cache.resident_bytes() == 0 and cache.mapped_bytes() == 0
            assert (pm.pool.frames[frames, 200] == (9 if batched else 10)).all()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_frames_many_batches_use_outlive_frames_used_once() -> None:
    """Victims by recency weighted by use: 4 frames announced for 5 batches stay when 20
    frames used once, each more recently, overflow the budget; `cold` takes the weight
    away again."""
    d = _disk_dir()
    try:
        pm, frames = _pool_with_pages(d, 40)
        cache = PageCache(pm.pool, 20 * 4096, name="hits")
        b0 = pm.pool.frames[frames[:4], 100].copy()
        cache.evict_all()
        for _ in range(5):  # a hot key's pages: every batch uses them
            cache.will_use(frames[:4])
            pm.pool.frames[frames[:4], 100] += 1
            cache.enforce()
        _ = int(pm.pool.frames[frames[4:20], 8].sum())  # the tail: once each, later
        cache.enforce()
        _ = int(pm.pool.frames[frames[20:24], 8].sum())  # 24 pages > 20
        assert cache.enforce() == 24 - 17
        res = cache.resident()
        assert res[frames[:4]].all()  # plain LRU would have taken them first
        assert not res[frames[4:11]].any() and res[frames[11:24]].all()
        cache.cold(frames[:4])
        _ = int(pm.pool.frames[frames[24:28], 8].sum())  # 21 pages > 20
        cache.enforce()
        assert not cache.resident()[frames[:4]].any()  # cold: first out again
        assert (pm.pool.frames[frames[:4], 100] == b0 + 5).all()
    finally:
        shutil.rmtree(d, ignore_errors=True)
