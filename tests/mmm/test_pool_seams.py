"""The public seams of an attach: `PagePool.map_file`, `PagePool.attach` with a kept
``mapping``, a ``rollback_to`` page table and ``populate``, and `PageManager.over`.

Every check runs on real pool files in a temporary directory; a killed writer is a
real ``SIGKILL``ed process."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import mmm
from mmm import PageManager, PagePool
from mmm.pool import FREE, LIVE

PB = 4096
VAL = [("n", "<i8")]


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _counts(pm: PageManager, name: str) -> dict[int, int]:
    k, v = mmm.HashMap.create(pm, name, key="<i8", value=VAL).items()
    return dict(zip(k.tolist(), v["n"].tolist()))


def _written(tmp_path: Path, keys: int = 300) -> tuple[str, PageManager]:
    path = str(tmp_path / "pool")
    pm = PageManager(PB, 1 << 22, path=path)
    mmm.HashMap.create(pm, "a", key="<i8", value=VAL).upsert(
        np.arange(keys), None, {"n": "count"})
    pm.flush()
    return path, pm


def test_over_an_attached_pool_is_attach(tmp_path: Path) -> None:
    path, pm = _written(tmp_path)
    del pm
    a = PageManager.attach(path, PB)
    b = PageManager.over(PagePool.attach(path, PB))
    assert a.names() == b.names() == ["a"]
    assert _counts(a, "a") == _counts(b, "a") == {k: 1 for k in range(300)}
    b._check()


def test_over_an_empty_pool_is_an_empty_manager() -> None:
    pm = PageManager.over(PagePool(PB, 64 * PB))
    assert pm.names() == [] and pm.pool.used_frames == 0
    assert _counts(pm, "x") == {}


def test_a_kept_mapping_is_shared_by_every_attach_through_it(tmp_path: Path) -> None:
    path, pm = _written(tmp_path)
    del pm
    raw = PagePool.map_file(path, PB)
    first = PagePool.attach(path, PB, mapping=raw)
    assert np.shares_memory(first.frames, raw)
    pm1 = PageManager.over(first)
    mmm.HashMap.create(pm1, "a", key="<i8", value=VAL).upsert(
        np.arange(300, 400), None, {"n": "count"})
    pm1.flush()
    del pm1, first
    second = PageManager.over(PagePool.attach(path, PB, mapping=raw))
    assert np.shares_memory(second.pool.frames, raw)
    assert _counts(second, "a") == {k: 1 for k in range(400)}
    # the writes went through the shared mapping to the file: a fresh mapping sees them
    assert _counts(PageManager.attach(path, PB), "a") == {k: 1 for k in range(400)}


def test_a_private_mapping_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    path, pm = _written(tmp_path)
    del pm
    before = _digest(path)
    raw = PagePool.map_file(path, PB, private=True)
    pool = PagePool.attach(path, PB, mapping=raw)
    assert pool.reserved_bytes == 0  # a private mapping reserves nothing in the file
    pm = PageManager.over(pool)
    mmm.HashMap.create(pm, "a", key="<i8", value=VAL).upsert(
        np.arange(5000), None, {"n": "count"})
    mmm.HashMap.create(pm, "b", key="<i8", value=VAL).upsert(np.arange(50), None, {"n": "count"})
    pm.flush()
    assert _counts(pm, "a")[0] == 2 and len(_counts(pm, "a")) == 5000
    assert _digest(path) == before
    assert PageManager.attach(path, PB).names() == ["a"]


def test_map_file_and_mapping_reject_what_is_not_this_pool(tmp_path: Path) -> None:
    path, pm = _written(tmp_path)
    del pm
    (tmp_path / "x").mkdir()
    other, pm2 = _written(tmp_path / "x")
    del pm2
    with pytest.raises(mmm.PoolFileError, match="missing|No such file"):
        PagePool.map_file(str(tmp_path / "missing"), PB)
    with pytest.raises(mmm.PoolFileError, match="page_bytes=4096"):
        PagePool.map_file(path, 2 * PB)
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x07" * (3 * PB))
    with pytest.raises(mmm.PoolFileError, match="bad magic"):
        PagePool.map_file(str(junk), PB)
    cut = tmp_path / "cut"
    cut.write_bytes(Path(path).read_bytes()[:5 * PB])
    with pytest.raises(mmm.PoolFileError, match="truncated"):
        PagePool.map_file(str(cut), PB)
    with pytest.raises(mmm.PageSizeError):
        PagePool.map_file(path, 1000)
    before = _digest(path)
    with pytest.raises(ValueError, match="maps another file"):
        PagePool.attach(path, PB, mapping=PagePool.map_file(other, PB))
    ro = np.memmap(path, dtype=np.uint8, mode="r")
    with pytest.raises(ValueError, match="read-only"):
        PagePool.attach(path, PB, mapping=ro)
    with pytest.raises(TypeError, match="memmap"):
        PagePool.attach(path, PB, mapping=np.zeros(10, np.uint8))  # type: ignore[arg-type]
    with pytest.raises(mmm.PoolFileError, match="page_bytes"):
        PagePool.attach(path, 2 * PB, mapping=PagePool.map_file(path, PB))
    assert _digest(path) == before


def _rollback_point(tmp_path: Path) -> tuple[str, tuple[np.ndarray, np.ndarray]]:
    """A pool file whose writer took a snapshot ("after b-1"), then went on: cloned pages
    of "a", created "b", and left a snapshot unreleased (ORPHAN frames)."""
    path, pm = _written(tmp_path, 2000)
    snap = pm.chkpt()
    base = (snap.page_ids.copy(), snap.frames.copy())
    mmm.HashMap.create(pm, "a", key="<i8", value=VAL).upsert(
        np.arange(0, 3000, 3), None, {"n": "count"})
    mmm.HashMap.create(pm, "b", key="<i8", value=VAL).upsert(
        np.arange(800), None, {"n": "count"})
    pm.pool.frames[pm.pool.state == FREE] = 0xEE  # garbage in every free frame
    pm.flush()
    return path, base


def test_rollback_to_a_page_table_makes_exactly_its_frames_live(tmp_path: Path) -> None:
    path, base = _rollback_point(tmp_path)
    pool = PagePool.attach(path, PB, rollback_to=base)
    assert np.array_equal(np.flatnonzero(pool.state), np.sort(base[1]))
    assert np.all(pool.state[base[1]] == LIVE)
    pool._check()
    pm = PageManager.over(pool)
    assert pm.names() == ["a"]
    assert _counts(pm, "a") == {k: 1 for k in range(2000)}
    fresh = pool.allocate(pool.free_frames // 2)  # frames the writer used after: zeroed
    assert not pool.frames[fresh].any()
    assert not np.isin(base[1], fresh).any()
    pm.pool.free(fresh)
    pm._check()


def test_populate_changes_nothing_but_the_faults(tmp_path: Path) -> None:
    path, base = _rollback_point(tmp_path)
    a = PageManager.over(PagePool.attach(
        path, PB, mapping=PagePool.map_file(path, PB, private=True), rollback_to=base,
        populate=True))
    b = PageManager.over(PagePool.attach(
        path, PB, mapping=PagePool.map_file(path, PB, private=True), rollback_to=base))
    assert np.array_equal(a.pool.state, b.pool.state)
    assert _counts(a, "a") == _counts(b, "a") == {k: 1 for k in range(2000)}


def test_a_rollback_point_the_file_no_longer_holds_changes_nothing(tmp_path: Path) -> None:
    path, base = _rollback_point(tmp_path)
    before = _digest(path)
    ids, frames = base
    shifted = (ids, frames + 1)
    with pytest.raises(mmm.RollbackPointError, match="no longer hold its pages"):
        PagePool.attach(path, PB, rollback_to=shifted)
    outside = (ids, frames.copy())
    outside[1][0] = 1 << 40
    with pytest.raises(mmm.RollbackPointError, match="outside the pool"):
        PagePool.attach(path, PB, rollback_to=outside)
    with pytest.raises(ValueError, match="page ids for"):
        PagePool.attach(path, PB, rollback_to=(ids[:-1], frames))
    assert issubclass(mmm.RollbackPointError, mmm.PoolFileError)
    assert _digest(path) == before  # each failed attach left the file byte for byte
    pm = PageManager.over(PagePool.attach(path, PB, rollback_to=base))  # still usable
    assert _counts(pm, "a") == {k: 1 for k in range(2000)}


_WRITE_AND_DIE = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import mmm
    path, base_path = sys.argv[1], sys.argv[2]
    pm = mmm.PageManager.attach(path, 4096)
    a = mmm.HashMap.create(pm, "a", key="<i8", value=[("n", "<i8")])
    snap = pm.chkpt()
    np.save(base_path, np.stack([snap.page_ids.view(np.int64), snap.frames]))
    a.upsert(np.arange(0, 3000, 2), None, {"n": "count"})
    mmm.HashMap.create(pm, "b", key="<i8", value=[("n", "<i8")]).upsert(
        np.arange(2000), None, {"n": "count"})
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_rollback_after_the_writer_was_killed_through_a_kept_mapping(tmp_path: Path) -> None:
    path, pm = _written(tmp_path, 1000)
    raw = PagePool.map_file(path, PB)  # this process keeps its mapping across the crash
    del pm
    base_path = str(tmp_path / "base.npy")
    r = subprocess.run([sys.executable, "-c", _WRITE_AND_DIE, path, base_path], timeout=600)
    assert r.returncode == -signal.SIGKILL
    arr = np.load(base_path)
    pm2 = PageManager.over(PagePool.attach(
        path, PB, mapping=raw, rollback_to=(arr[0].view(np.uint64).copy(), arr[1].copy())))
    assert pm2.names() == ["a"]
    assert _counts(pm2, "a") == {k: 1 for k in range(1000)}
    pm2._check()
    assert os.path.getsize(path) == len(raw)
