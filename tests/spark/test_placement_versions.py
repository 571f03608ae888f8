"""Local placement (locks, markers) and the version decisions, without Spark."""
from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest

import mmm
from sguard.spark.errors import PartitionLockTimeout
from sguard.spark.placement import Marker, PartitionSlot, boot_id
from sguard.spark.versions import Action, LocalStateDamaged, attach_at, decide


def _m(status: str, batch: int, base: int | None = None, token: str = "t") -> Marker:
    return Marker(token, status, batch, base, -1, boot_id())


@pytest.mark.parametrize("marker,batch,token,can_rb,want", [
    (None, 5, None, False, Action.RESTORE),
    (_m("applied", 4), 5, "t", False, Action.USE_CACHED),
    (_m("applied", 4), 5, "other", False, Action.ATTACH),
    (_m("applied", 4), 5, None, False, Action.ATTACH),
    (_m("applied", 5, 4), 5, "t", True, Action.ROLLBACK_CACHED),
    (_m("applied", 5, 4), 5, "t", False, Action.ROLLBACK_FILE),
    (_m("applying", 5, 4), 5, None, False, Action.ROLLBACK_FILE),
    (_m("applying", 5, 3), 5, None, False, Action.RESTORE),   # rollback point too old
    (_m("applied", 2), 5, "t", False, Action.RESTORE),        # stale: another host went on
    (_m("applied", 7), 5, "t", False, Action.RESTORE),        # ahead: restore decides
    (_m("applying", 4, 3), 5, "t", True, Action.RESTORE),
])
def test_decide(marker: Marker | None, batch: int, token: str | None, can_rb: bool,
                want: Action) -> None:
    assert decide(marker, batch, token, True, can_rb).action is want


def test_decide_distrusts_other_boot_and_missing_pool() -> None:
    m = Marker("t", "applied", 4, None, -1, "another-boot")
    assert decide(m, 5, "t", True, False).action is Action.RESTORE
    assert decide(_m("applied", 4), 5, "t", False, False).action is Action.RESTORE


def _hold(path: str, sid: str, ready: "mp.synchronize.Event", go: "mp.synchronize.Event") -> None:
    s = PartitionSlot(path, sid, 0)
    s.acquire(5)
    ready.set()
    go.wait(300)
    os._exit(0)  # dies holding the lock: the kernel drops it


def test_lock_excludes_other_processes_and_dies_with_them(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(str(tmp_path), "s", ready, go))
    p.start()
    assert ready.wait(300)
    slot = PartitionSlot(str(tmp_path), "s", 0)
    with pytest.raises(PartitionLockTimeout, match="partition 0"):
        slot.acquire(0.2)
    go.set()
    p.join(600)
    assert p.exitcode == 0  # it died holding the lock...
    slot.acquire(60)  # ...and the kernel dropped it: free at once (the bound only catches a hang)
    slot.release()


def test_marker_and_base_roundtrip_and_damage(tmp_path: Path) -> None:
    slot = PartitionSlot(str(tmp_path), "s", 3)
    os.makedirs(slot.dir)
    assert slot.read_marker() is None and slot.read_base() is None
    m = _m("applying", 9, 8)
    slot.write_marker(m)
    assert slot.read_marker() == m
    Path(slot.marker_path).write_text("{not json")
    assert slot.read_marker() is None  # damaged: not trusted
    ids, fr = np.array([1, 2], np.uint64), np.array([5, 6], np.int64)
    slot.write_base(ids, fr)
    got = slot.read_base()
    assert got is not None and np.array_equal(got[0], ids) and np.array_equal(got[1], fr)


def test_file_rollback_restores_snapshot_and_zeroes_dropped_frames(tmp_path: Path) -> None:
    """Roll back in the pool file what a dead process applied after its snapshot; pages
    it created are gone and their frames come back zeroed (`mmm.PagePool.attach`'s ``rollback_to``)."""
    path = str(tmp_path / "pool")
    pm = mmm.PageManager(4096, 1 << 22, path=path)
    a = mmm.HashMap.create(pm, "a", key="<i8", value=[("n", "<i8")])
    a.upsert(np.arange(100), None, {"n": "count"})
    snap = pm.chkpt()
    base = (snap.page_ids.copy(), snap._frames.copy())
    a.upsert(np.arange(50), None, {"n": "count"})           # touched pages are cloned
    b = mmm.HashMap.create(pm, "b", key="<i8", value=[("n", "<i8")])
    b.upsert(np.arange(500), None, {"n": "count"})          # a structure created after
    pm.flush()
    del pm, a, b, snap                                        # the process "dies"
    pm2 = attach_at(path, 4096, base)
    assert pm2.names() == ["a"]
    a2 = mmm.HashMap.create(pm2, "a", key="<i8", value=[("n", "<i8")])
    k, v = a2.items()
    assert len(k) == 100 and np.all(v["n"] == 1)
    b2 = mmm.HashMap.create(pm2, "b", key="<i8", value=[("n", "<i8")])
    b2.upsert(np.arange(500), None, {"n": "count"})
    assert np.all(b2.get(np.arange(500))[1]["n"] == 1)       # no stale bytes leak in
    pm2._check()
    bad = (base[0], base[1] + 1)
    with pytest.raises(LocalStateDamaged):
        attach_at(path, 4096, bad)


_APPLY_AND_DIE = """
import os, signal, sys
import numpy as np
import mmm
from sguard.spark.versions import attach_at
path, base_path = sys.argv[1], sys.argv[2]
pm = attach_at(path, 4096, None)
a = mmm.HashMap.create(pm, "a", key="<i8", value=[("n", "<i8")])
snap = pm.chkpt()                                   # the rollback point "after b-1"
np.save(base_path, np.stack([snap.page_ids.view(np.int64), snap._frames]))
a.upsert(np.arange(0, 3000, 2), None, {"n": "count"})   # batch b: clones and new pages
b = mmm.HashMap.create(pm, "b", key="<i8", value=[("n", "<i8")])
b.upsert(np.arange(2000), None, {"n": "count"})
pm.pool.frames[pm.pool.state == 0] = 0xEE           # and garbage in every free frame
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("mapped_before", [True, False])
def test_file_rollback_after_another_process_died_mid_batch(tmp_path: Path,
                                                            mapped_before: bool) -> None:
    """A worker that held the partition before (its mapping of the pool file is reused) or
    a new one rolls back what a killed worker applied: the state is exactly the rollback
    point, and no frame handed out later carries the dead worker's bytes."""
    import subprocess
    import sys

    from sguard.spark.versions import forget_mappings
    path, base_path = str(tmp_path / "pool"), str(tmp_path / "base.npy")
    mmm.PagePool(4096, 1 << 22, path).flush()
    pm = attach_at(path, 4096, None)
    a = mmm.HashMap.create(pm, "a", key="<i8", value=[("n", "<i8")])
    a.upsert(np.arange(1000), None, {"n": "count"})
    pm.flush()
    del pm, a
    if not mapped_before:
        forget_mappings()
    r = subprocess.run([sys.executable, "-c", _APPLY_AND_DIE, path, base_path], timeout=600)
    assert r.returncode == -9
    arr = np.load(base_path)
    pm2 = attach_at(path, 4096, (arr[0].view(np.uint64).copy(), arr[1].copy()))
    assert pm2.names() == ["a"]
    a2 = mmm.HashMap.create(pm2, "a", key="<i8", value=[("n", "<i8")])
    k, v = a2.items()
    assert np.array_equal(np.sort(k), np.arange(1000)) and np.all(v["n"] == 1)
    pm2._check()
    used = np.flatnonzero(pm2.pool.state)
    fresh = pm2.pool.allocate(pm2.pool.free_frames // 2)
    assert not pm2.pool.frames[fresh].any(), "a frame of the dead worker leaked into a new page"
    assert not np.isin(used, fresh).any()
    forget_mappings()


def test_replaced_pool_file_is_not_served_from_an_old_mapping(tmp_path: Path) -> None:
    """A worker keeps its mapping of a partition's pool file between attaches; once the
    file is deleted and recreated (a restore), the next attach maps the new file."""
    from sguard.spark import versions
    path = str(tmp_path / "pool")
    mmm.PagePool(4096, 1 << 20, path).flush()
    pm = attach_at(path, 4096, None)
    mmm.HashMap.create(pm, "old", key="<i8", value=[("n", "<i8")]).upsert(
        np.arange(10), None, {"n": "count"})
    pm.flush()
    assert attach_at(path, 4096, None).pool._raw is pm.pool._raw  # the same mapping, reused
    del pm
    os.unlink(path)
    pm_new = mmm.PageManager(4096, 1 << 20, path=path)
    mmm.HashMap.create(pm_new, "new", key="<i8", value=[("n", "<i8")])
    pm_new.flush()
    again = attach_at(path, 4096, None)
    assert again.names() == ["new"]
    assert all(p == path for p in versions._MAPS) and len(versions._MAPS) == 1
    versions.forget_mappings()
