"""Staging (copy-out): `Snapshot.plan_staging` / `Snapshot.stage_planned`.

A stager copies planned frozen pages into the snapshot's own buffer and unpins
their frames, so the operator writes those pages in place (no clone) while the
snapshot keeps reading the bytes of the freeze. Readers of a planned page wait
until it is staged; a stager that stops leaves the rest pinned and read from
their frames. Oracles: the frozen bytes (copied right at the freeze) and the
clone counter.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import mmm
from mmm import snapshot as snapshot_mod
from mmm.errors import SnapshotStateError
from mmm.structures.hashmap import HashMap

PB = 4096
VAL = np.dtype([("n", "<i8")])


def _setup(n: int = 20_000) -> tuple[mmm.PageManager, HashMap]:
    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=64 << 20)
    m = HashMap.create(pm, "m", key="<u4", value=VAL)
    m.upsert(np.arange(n, dtype="<u4"), combine={"n": "count"})
    return pm, m


def _frozen(pm: mmm.PageManager, snap: mmm.Snapshot) -> np.ndarray:
    return pm.pool.frames[snap._frames].copy()


def _touch_all(m: HashMap) -> None:
    m.upsert(m.keys(), combine={"n": "count"})


def test_staged_pages_are_written_in_place_and_read_as_frozen() -> None:
    pm, m = _setup()
    snap = pm.chkpt()
    want = _frozen(pm, snap)
    everything = np.arange(len(snap))
    assert snap.plan_staging(everything) == len(snap)
    assert snap.stage_planned(chunk_bytes=3 * PB) == len(snap)
    assert snap.n_staged == len(snap)
    assert not (pm.pool.pins[snap._frames] > 0).any()  # every frame released
    cloned = pm.stats()["pages_cloned"]
    _touch_all(m)
    assert pm.stats()["pages_cloned"] == cloned  # written in place: no copy-on-write
    np.testing.assert_array_equal(snap.copy_pages(everything), want)
    for i in (0, len(snap) // 2, len(snap) - 1):
        np.testing.assert_array_equal(snap.page(i), want[i])
    view = snap.pages_view(np.arange(2, 7))
    assert view is not None  # staged rows are consecutive: no gather needed
    np.testing.assert_array_equal(view, want[2:7])
    snap.mark_persisted(everything)
    snap.complete()
    assert (m.get(np.arange(20_000, dtype="<u4"))[1]["n"] == 2).all()
    pm._check()


def test_partial_staging_mixes_staged_and_pinned_pages_exactly() -> None:
    pm, m = _setup()
    snap = pm.chkpt()
    want = _frozen(pm, snap)
    odd = np.arange(1, len(snap), 2)
    snap.plan_staging(odd)
    snap.stage_planned()
    assert snap.n_staged == len(odd)
    pins = pm.pool.pins[snap._frames]
    assert (pins[odd] == 0).all() and (pins[::2] > 0).all()
    _touch_all(m)  # clones the even (still pinned) pages only
    np.testing.assert_array_equal(snap.copy_pages(np.arange(len(snap))), want)
    assert snap.pages_view(np.arange(0, 4)) is None  # mixed: the caller gathers
    snap.mark_persisted(np.arange(len(snap)))
    snap.complete()
    pm._check()


def test_readers_wait_for_planned_pages_until_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    pm, m = _setup()
    snap = pm.chkpt()
    want = _frozen(pm, snap)
    gate = threading.Event()
    real = snapshot_mod.gather_frames

    def gated(*a: object) -> None:
        gate.wait(600)  # a hang guard
        real(*a)

    monkeypatch.setattr(snapshot_mod, "gather_frames", gated)
    snap.plan_staging(np.arange(len(snap)))
    stager = threading.Thread(target=snap.stage_planned)
    stager.start()
    got: list[np.ndarray] = []
    reader = threading.Thread(target=lambda: got.append(snap.copy_pages(np.arange(len(snap)))))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got  # the reader waits for the stager (held)
    gate.set()
    reader.join(600)
    stager.join(600)
    np.testing.assert_array_equal(got[0], want)
    assert snap.n_staged == len(snap)
    snap.cancel()


def test_a_cancel_while_staging_wakes_readers_and_stops_the_stager(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pm, m = _setup()
    snap = pm.chkpt()
    calls = []
    real = snapshot_mod.gather_frames

    def cancel_after_first(*a: object) -> None:
        real(*a)
        calls.append(1)
        if len(calls) == 1:
            snap.cancel()

    monkeypatch.setattr(snapshot_mod, "gather_frames", cancel_after_first)
    snap.plan_staging(np.arange(len(snap)))
    n = snap.stage_planned(chunk_bytes=PB)
    assert n == 0 and len(calls) == 1  # the chunk copied under the cancel is not used
    with pytest.raises(SnapshotStateError):
        snap.copy_pages([0])
    assert not (pm.pool.pins > 0).any()  # cancel unpinned everything exactly once
    _touch_all(m)
    pm._check()


def test_an_error_in_the_stager_leaves_the_rest_pinned_and_readable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pm, m = _setup()
    snap = pm.chkpt()
    want = _frozen(pm, snap)
    calls = []
    real = snapshot_mod.gather_frames

    def fail_second(*a: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("no memory for the staging buffer")
        real(*a)

    monkeypatch.setattr(snapshot_mod, "gather_frames", fail_second)
    snap.plan_staging(np.arange(len(snap)))
    with pytest.raises(MemoryError):
        snap.stage_planned(chunk_bytes=2 * PB)
    assert snap.n_staged == 2
    assert (pm.pool.pins[snap._frames[2:]] > 0).all()  # not staged: still pinned
    _touch_all(m)
    np.testing.assert_array_equal(snap.copy_pages(np.arange(len(snap))), want)  # no wait
    snap.mark_persisted(np.arange(len(snap)))
    snap.complete()
    pm._check()


def test_a_staged_snapshot_is_no_rollback_point_and_nothing_changes() -> None:
    pm, m = _setup()
    snap = pm.chkpt()
    snap.plan_staging([0, 1])
    snap.stage_planned()
    m.upsert(np.array([7], "<u4"), combine={"n": "count"})
    with pytest.raises(SnapshotStateError, match="staged"):
        pm.rollback(snap)
    assert m.get(np.array([7], "<u4"))[1]["n"][0] == 2  # the failed rollback changed nothing
    snap.release()
    pm._check()


def test_planning_skips_persisted_staged_and_repeated_pages() -> None:
    pm, m = _setup()
    snap = pm.chkpt()
    snap.mark_persisted([0])
    assert snap.plan_staging([0, 1, 1, 2]) == 2
    snap.stage_planned()
    assert snap.plan_staging([1, 2, 3]) == 1
    assert snap.stage_planned() == 1
    assert snap.n_staged == 3
    snap.complete()
    with pytest.raises(SnapshotStateError):
        snap.plan_staging([4])
    pm._check()


def test_a_completed_snapshot_gives_its_buffer_back_a_cancelled_one_does_not() -> None:
    pm, m = _setup()
    snap = pm.chkpt()
    snap.plan_staging(np.arange(len(snap)))
    snap.stage_planned()
    buf = snap._staged
    snap.mark_persisted(np.arange(len(snap)))
    snap.complete()
    assert pm._stage_spare is buf  # kept for the next checkpoint
    _touch_all(m)
    snap2 = pm.chkpt()
    want = _frozen(pm, snap2)
    snap2.plan_staging(np.arange(len(snap2)))
    snap2.stage_planned()
    assert snap2._staged is buf and pm._stage_spare is None  # reused, not shared
    _touch_all(m)
    np.testing.assert_array_equal(snap2.copy_pages(np.arange(len(snap2))), want)
    snap2.cancel()  # a failed write may still read it: dropped, not reused
    assert pm._stage_spare is None
    pm._check()
