"""The background precopy (`mmm.precopy`) and a rollback that keeps untouched pages unchanged.

Precopy: after ``chkpt(precopy=True)`` a copier thread un-shares the frozen
pages; the operator adopts the copies instead of cloning. The snapshot must
still read exactly the bytes at the freeze, the live state must be what the
writes made it, and a copy made of a page that was released (persisted) or
cloned before the adoption must be dropped, never adopted.
"""
from __future__ import annotations

import numpy as np
import pytest

import mmm
from mmm import precopy as precopy_mod
from mmm.structures.hashmap import HashMap

PB = 4096
VAL = np.dtype([("n", "<i8")])


def _map(pm: mmm.PageManager, n: int = 20_000) -> HashMap:
    m = HashMap.create(pm, "m", key="<u4", value=VAL)
    m.upsert(np.arange(n, dtype="<u4"), combine={"n": "count"})
    return m


def _frozen_bytes(snap: mmm.Snapshot) -> np.ndarray:
    return snap.copy_pages(np.arange(len(snap)))


def _wait(pm: mmm.PageManager) -> None:
    for job in pm._precopy:
        job.done.wait(30)


def test_adopted_copies_keep_the_snapshot_and_the_live_state_exact() -> None:
    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=64 << 20)
    m = _map(pm)
    before = pm.pool.frames[pm.page_set(m.psid).frames[pm.page_set(m.psid).seqs()]].copy()
    snap = pm.chkpt(precopy=True)
    frozen = _frozen_bytes(snap)
    assert np.array_equal(np.sort(frozen.view("<u8"), axis=None),
                          np.sort(before.view("<u8"), axis=None))
    _wait(pm)
    job = pm._precopy[0]
    assert job.copied == len(snap)  # the copier un-shared every frozen page
    cloned0 = pm.stats()["pages_cloned"]
    keys = np.arange(20_000, dtype="<u4")
    m.upsert(keys, combine={"n": "count"})  # touches every page
    assert pm.stats()["pages_cloned"] == cloned0  # the operator copied nothing itself
    assert pm.stats()["pages_precopied"] >= m.page_count - 1
    assert np.array_equal(_frozen_bytes(snap), frozen)  # the snapshot did not move
    k, v = m.items()
    assert len(k) == 20_000 and np.all(v["n"] == 2)
    snap.release()
    pm.adopt_precopied()
    assert pm._precopy == []
    pm._check()


def test_copies_of_persisted_or_cloned_pages_are_dropped_not_adopted() -> None:
    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=64 << 20)
    m = _map(pm)
    snap = pm.chkpt(precopy=True)
    _wait(pm)
    ps = pm.page_set(m.psid)
    lo, hi = pm._precopy[0].span(m.psid)
    idx = np.arange(lo, hi)
    released = idx[::3]  # "written" by an I/O thread: unpinned, writable in place again
    snap.mark_persisted(released)
    cloned_seq = int((snap.page_ids[idx[1]] & np.uint64(0xFFFFFFFF)))
    pm.writable1(m.psid, cloned_seq)  # the write barrier adopts this one page's copy
    assert pm.stats()["pages_cloned"] == 0 and pm.stats()["pages_precopied"] == 1
    persisted_frames = snap._frames[released].copy()
    job = pm._precopy[0]
    m.upsert(np.arange(20_000, dtype="<u4"), combine={"n": "count"})
    # released pages are written in place (their frames stay in the page table)
    seqs = (snap.page_ids[released] & np.uint64(0xFFFFFFFF)).astype(np.int64)
    assert np.array_equal(ps.frames[seqs], persisted_frames)
    assert job.discarded == len(released)  # their copies were freed, not adopted
    assert job.adopted == len(snap) - len(released)
    k, v = m.items()
    assert np.all(v["n"] == 2)
    snap.complete()
    pm.adopt_precopied()
    pm._check()


def test_the_copier_leaves_the_frames_the_operator_needs() -> None:
    """In a pool too small for a copy of every frozen page on top of the operator's
    own clones, the copier backs off and the operator's clones still succeed."""
    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=PB * 400)
    m = _map(pm, 30_000)
    n_pages = pm.stats()["used_frames"]
    assert n_pages < pm.pool.free_frames < 2 * n_pages + 16  # room for clones only
    snap = pm.chkpt(precopy=True)
    _wait(pm)
    job = pm._precopy[0]
    m.upsert(np.arange(0, 30_000, 7, dtype="<u4"), combine={"n": "count"})
    assert job.copied == 0 and pm.stats()["pages_cloned"] > 0
    k, v = m.items()
    assert int(v["n"].sum()) == 30_000 + len(range(0, 30_000, 7))
    snap.release()
    pm.adopt_precopied()
    pm._check()


def test_precopy_off_copies_nothing_in_the_background() -> None:
    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=64 << 20)
    m = _map(pm)
    snap = pm.chkpt()
    assert pm._precopy == []
    m.upsert(np.arange(100, dtype="<u4"), combine={"n": "count"})
    assert pm.stats()["pages_precopied"] == 0 and pm.stats()["pages_cloned"] > 0
    snap.release()
    pm._check()


@pytest.mark.parametrize("chunk_pages", [1, 7])
def test_rollback_to_a_snapshot_with_a_running_copier(monkeypatch: pytest.MonkeyPatch,
                                                      chunk_pages: int) -> None:
    monkeypatch.setattr(precopy_mod, "CHUNK_BYTES", chunk_pages * PB)
    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=64 << 20)
    m = _map(pm)
    want_k, want_v = m.items()
    snap = pm.chkpt(precopy=True)
    m.upsert(np.arange(0, 20_000, 3, dtype="<u4"), combine={"n": "count"})
    m.upsert(np.arange(50_000, 51_000, dtype="<u4"), combine={"n": "count"})
    pm.rollback(snap)
    _wait(pm)
    pm.adopt_precopied()
    k, v = m.items()
    o1, o2 = np.argsort(k), np.argsort(want_k)
    assert np.array_equal(k[o1], want_k[o2]) and np.array_equal(v[o1], want_v[o2])
    assert pm._precopy == []
    pm._check()


# -- rollback: only the touched pages become "changed" ------------------------------------------
def test_rollback_marks_only_the_pages_the_rolled_back_work_touched() -> None:
    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=64 << 20)
    m = _map(pm)
    pm.chkpt().complete()  # durable: nothing is "changed" now
    point = pm.chkpt()  # a rollback point, as the Spark runtime keeps one per batch
    assert point.n_changed == 0
    keys = np.array([5, 17, 1234], dtype="<u4")
    m.upsert(keys, combine={"n": "count"})  # touches a few pages
    touched = pm.stats()["pages_cloned"]
    assert 1 <= touched <= 3
    pm.rollback(point)
    nxt = pm.chkpt()
    assert nxt.n_changed == touched  # not the whole map (was: every page)
    assert nxt.n_changed < len(nxt) // 10
    nxt.release()
    pm._check()


def test_rollback_after_a_later_checkpoint_completed_still_writes_the_touched_pages() -> None:
    """Pages written between the rollback point and a checkpoint that completed
    after it hold, in that checkpoint, bytes the rollback undid: they must be
    written again by the next checkpoint."""
    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=64 << 20)
    m = _map(pm)
    pm.chkpt().complete()
    point = pm.chkpt()
    m.upsert(np.array([5, 17], dtype="<u4"), combine={"n": "count"})
    touched = pm.stats()["pages_cloned"]
    later = pm.chkpt()  # a checkpoint of the state after the batch ...
    later.complete()  # ... that became durable
    pm.rollback(point)
    nxt = pm.chkpt()
    assert nxt.n_changed == touched
    nxt.release()


def test_a_file_backed_pool_reattached_with_unadopted_copies_keeps_the_pages(tmp_path) -> None:
    """A process that dies before adopting the copies leaves them in its pool file with
    the same PageIDs; a re-attach keeps the real pages (a copy's version is 0)."""
    path = str(tmp_path / "pool")
    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=32 << 20, path=path)
    m = _map(pm)
    want_k, want_v = m.items()
    snap = pm.chkpt(precopy=True)
    _wait(pm)
    assert pm._precopy[0].copied == len(snap)
    h = pm.pool.headers
    ps = pm.page_set(m.psid)
    live = ps.frames[ps.seqs()]
    job = pm._precopy[0]
    job.drain()
    shadows = job.shadow_of[job.shadow_of >= 0]
    assert np.all(h["version"][shadows] == 0) and np.all(h["version"][live] >= 1)
    assert np.array_equal(np.sort(h["page_id"][shadows]), np.sort(snap.page_ids))
    pm.flush()
    pm2 = mmm.PageManager.attach(path, page_bytes=PB)  # as a new process would
    m2 = HashMap.create(pm2, "m", key="<u4", value=VAL)
    k, v = m2.items()
    o1, o2 = np.argsort(k), np.argsort(want_k)
    assert np.array_equal(k[o1], want_k[o2]) and np.array_equal(v[o1], want_v[o2])
    assert pm2.stats()["used_frames"] == len(snap)  # the copies were dropped
    pm2._check()
    snap.release()
    pm.adopt_precopied()


def test_a_forked_child_gets_a_copier_of_its_own() -> None:
    """Threads do not survive fork(): in a child, jobs started by the parent are over
    and new checkpoints get a new copier thread."""
    import os

    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=64 << 20)
    m = _map(pm)
    first = pm.chkpt(precopy=True)
    _wait(pm)
    pid = os.fork()
    if pid == 0:  # child: any failure shows in the exit code
        code = 1
        try:
            first.release()
            m.upsert(np.arange(20_000, dtype="<u4"), combine={"n": "count"})
            pm.adopt_precopied()
            before = pm.stats()["pages_precopied"]
            snap = pm.chkpt(precopy=True)
            for job in pm._precopy:
                assert job.done.wait(30)
            m.upsert(np.arange(20_000, dtype="<u4"), combine={"n": "count"})
            ok = pm.stats()["pages_precopied"] > before  # the child's own copier ran
            snap.release()
            pm.adopt_precopied()
            k, v = m.items()
            code = 0 if ok and np.all(v["n"] == 3) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    first.release()
    pm.adopt_precopied()
    pm._check()
