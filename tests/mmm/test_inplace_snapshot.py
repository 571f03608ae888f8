"""In-place snapshots: ``PageManager.chkpt(in_place=True)``.

A soft pin lets the hash map kernel update the value of a key already in a
frozen page in place, after logging the value's old bytes (the pool's undo
log); every reader of the snapshot (`page`, `copy_pages`, `pages_view`, the
stager) lays the logged before-images over its copy. Oracles: the frozen bytes,
copied right at the freeze; the same operations on a map that was never frozen;
the clone and in-place counters (which path ran).
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import mmm
from mmm import snapshot as snapshot_mod
from mmm.errors import SnapshotStateError
from mmm.pool import HARD_PIN
from mmm.structures.hashmap import HashMap

PB = 4096
VAL = np.dtype([("n", "<i8"), ("s", "<f8"), ("lo", "<i4")])
SPEC = {"n": "count", "s": ("sum", "x"), "lo": ("min", "y")}


def _setup(n: int = 20_000) -> tuple[mmm.PageManager, HashMap]:
    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=128 << 20)
    m = HashMap.create(pm, "m", key="<u4", value=VAL)
    _batch(m, np.arange(n, dtype="<u4"), 0)
    return pm, m


def _batch(m: HashMap, keys: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed)
    m.upsert(keys, {"x": rng.random(len(keys)), "y": rng.integers(-1000, 1000, len(keys))},
             SPEC)


def _frozen(pm: mmm.PageManager, snap: mmm.Snapshot) -> np.ndarray:
    return pm.pool.frames[snap._frames].copy()


def _state(m: HashMap) -> dict[int, tuple]:
    k, v = m.items()
    return dict(zip(k.tolist(), v.tolist()))


def _ops(m: HashMap, n: int, rounds: int, seed: int) -> None:
    """Random batches: mostly existing keys (written in place), some new keys (an
    insert clones), a few deletes (a delete clones), repeats within a batch."""
    rng = np.random.default_rng(seed)
    for r in range(rounds):
        keys = rng.integers(0, n, 500).astype("<u4")
        keys[:20] = keys[20:40]  # repeats: the oldest before-image must win
        if r % 3 == 1:
            keys[-10:] = rng.integers(n, 2 * n, 10)
        _batch(m, keys, seed * 100 + r)
        if r % 4 == 3:
            m.delete(rng.integers(0, n, 5).astype("<u4"))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_readers_see_the_frozen_bytes_while_values_change_in_place(seed: int) -> None:
    pm, m = _setup()
    twin = _state(m)
    snap = pm.chkpt(in_place=True)
    want = _frozen(pm, snap)
    c0, w0 = pm.stats()["pages_cloned"], pm.stats()["values_written_in_place"]
    _ops(m, 20_000, 12, seed)
    st = pm.stats()
    assert st["values_written_in_place"] - w0 > 1000  # the in-place path ran ...
    assert st["pages_cloned"] - c0 < len(snap) // 2  # ... instead of cloning every page
    everything = np.arange(len(snap))
    np.testing.assert_array_equal(snap.copy_pages(everything), want)
    for i in range(0, len(snap), 7):
        np.testing.assert_array_equal(snap.page(i), want[i])
    assert snap.pages_view(everything[:4]) is None  # its frames are not stable bytes
    # the live map: as if never frozen
    pm2, m2 = _setup()
    assert _state(m2) == twin
    _ops(m2, 20_000, 12, seed)
    assert _state(m) == _state(m2)
    snap.mark_persisted(everything)
    snap.complete()
    pm._check()


def test_the_stager_stages_the_frozen_bytes() -> None:
    pm, m = _setup()
    snap = pm.chkpt(in_place=True)
    want = _frozen(pm, snap)
    _ops(m, 20_000, 4, 7)  # before staging: values changed in place
    everything = np.arange(len(snap))
    assert snap.plan_staging(everything) == len(snap)
    assert snap.stage_planned(chunk_bytes=3 * PB) == len(snap)
    assert not (pm.pool.pins[snap._frames] > 0).any()
    _ops(m, 20_000, 4, 8)  # after staging: plain writes, nothing logged for it
    np.testing.assert_array_equal(snap.copy_pages(everything), want)
    view = snap.pages_view(np.arange(2, 7))
    assert view is not None  # staged rows are stable
    np.testing.assert_array_equal(view, want[2:7])
    snap.mark_persisted(everything)
    snap.complete()
    pm._check()


def test_two_in_place_snapshots_each_read_their_own_freeze() -> None:
    pm, m = _setup()
    s1 = pm.chkpt(in_place=True)
    w1 = _frozen(pm, s1)
    _ops(m, 20_000, 3, 11)
    s2 = pm.chkpt(in_place=True)  # frames s1 still pins, now holding later values
    w2 = _frozen(pm, s2)
    assert (pm.pool.pins[s2._frames] == 2).any()
    _ops(m, 20_000, 3, 12)
    np.testing.assert_array_equal(s1.copy_pages(np.arange(len(s1))), w1)
    np.testing.assert_array_equal(s2.copy_pages(np.arange(len(s2))), w2)
    s1.release()
    _ops(m, 20_000, 2, 13)
    np.testing.assert_array_equal(s2.copy_pages(np.arange(len(s2))), w2)
    s2.release()
    pm._check()
    assert not pm.pool.pins.any()


def test_a_hard_pin_beside_a_soft_one_means_clones() -> None:
    pm, m = _setup()
    soft = pm.chkpt(in_place=True)
    ws = _frozen(pm, soft)
    hard = pm.chkpt()  # a rollback point: its frames are never written
    wh = _frozen(pm, hard)
    assert (pm.pool.pins[hard._frames] >= HARD_PIN).all()
    w0 = pm.stats()["values_written_in_place"]
    _ops(m, 20_000, 3, 21)
    assert pm.stats()["values_written_in_place"] == w0
    np.testing.assert_array_equal(pm.pool.frames[hard._frames], wh)  # untouched frames
    np.testing.assert_array_equal(soft.copy_pages(np.arange(len(soft))), ws)
    before = _state(m)
    pm.rollback(hard)  # the map follows its page set back
    assert _state(m) != before
    _, m3 = _setup()
    assert _state(m) == _state(m3)  # the freeze point
    soft.release()
    pm._check()


def test_a_full_undo_log_falls_back_to_cloning() -> None:
    pm, m = _setup()
    pm.pool.undo[2] = 50  # room for 50 records
    snap = pm.chkpt(in_place=True)
    want = _frozen(pm, snap)
    c0 = pm.stats()["pages_cloned"]
    _ops(m, 20_000, 6, 31)
    assert pm.pool.undo[0] == 50
    assert pm.stats()["pages_cloned"] > c0
    np.testing.assert_array_equal(snap.copy_pages(np.arange(len(snap))), want)
    snap.release()
    pm.pool.undo[2] = mmm.pool.UNDO_ENTRIES
    pm._check()


def test_an_in_place_snapshot_is_not_a_rollback_point() -> None:
    pm, m = _setup(1000)
    snap = pm.chkpt(in_place=True)
    _ops(m, 1000, 1, 41)
    with pytest.raises(SnapshotStateError, match="in place"):
        pm.rollback(snap)
    assert snap.state is mmm.SnapshotState.ACTIVE  # nothing changed
    snap.release()


def test_the_log_empties_when_no_snapshot_is_active() -> None:
    pm, m = _setup()
    s1 = pm.chkpt(in_place=True)
    _ops(m, 20_000, 2, 51)
    n1 = int(pm.pool.undo[0])
    assert n1 > 0
    s1.release()
    total = pm.stats()["values_written_in_place"]
    s2 = pm.chkpt(in_place=True)
    assert pm.pool.undo[0] == 0 and s2._log0 == 0
    assert pm.stats()["values_written_in_place"] == total  # the count survives the reset
    s2.release()


@pytest.mark.parametrize("stager_pages", [1, 4])
def test_stager_reader_and_operator_race_on_every_page(monkeypatch: pytest.MonkeyPatch,
                                                       stager_pages: int) -> None:
    """The stager copies a few pages at a time, a reader thread copies random pages
    over and over, and the operator writes every page's values in place meanwhile:
    every copy any of them made equals the frozen bytes."""
    monkeypatch.setattr(snapshot_mod, "STAGE_CHUNK_BYTES", stager_pages * PB)
    pm, m = _setup()
    keys = m.keys()
    for rnd in range(4):
        snap = pm.chkpt(in_place=True)
        want = _frozen(pm, snap)
        n = len(snap)
        if rnd % 2:
            snap.plan_staging(np.random.default_rng(rnd).permutation(n))
        bad: list[str] = []
        stop = threading.Event()

        def reader() -> None:
            rng = np.random.default_rng(100 + rnd)
            while not stop.is_set():
                idx = rng.choice(n, 8, replace=False)
                got = snap.copy_pages(idx)
                for j, i in enumerate(idx):
                    if not np.array_equal(got[j], want[i]):
                        bad.append(f"round {rnd}: page {i} differs from its freeze")

        t_read = threading.Thread(target=reader)
        t_stage = threading.Thread(target=snap.stage_planned)
        t_read.start()
        t_stage.start()
        for r in range(6):  # every key, so every page, each time
            _batch(m, keys, 1000 * rnd + r)
        t_stage.join(600)
        stop.set()
        t_read.join(600)
        assert not bad, bad[:3]
        np.testing.assert_array_equal(snap.copy_pages(np.arange(n)), want)
        snap.mark_persisted(np.arange(n))
        snap.complete()
    assert pm.stats()["values_written_in_place"] > 0
    pm._check()


def test_new_keys_clone_only_the_pages_they_go_to() -> None:
    """A batch mixing new keys (into frozen last pages of their chains) with updates:
    the pages the inserts need are cloned in one bulk copy, the updates stay in place."""
    pm, m = _setup()
    snap = pm.chkpt(in_place=True)
    want = _frozen(pm, snap)
    rng = np.random.default_rng(61)
    keys = np.concatenate([rng.integers(0, 20_000, 400), np.arange(20_000, 20_050)]).astype("<u4")
    rng.shuffle(keys)
    c0, w0 = pm.stats()["pages_cloned"], pm.stats()["values_written_in_place"]
    _batch(m, keys, 62)
    cloned = pm.stats()["pages_cloned"] - c0
    assert 0 < cloned <= 50  # at most one page per new key
    assert pm.stats()["values_written_in_place"] - w0 > 100
    np.testing.assert_array_equal(snap.copy_pages(np.arange(len(snap))), want)
    pm2, m2 = _setup()
    _batch(m2, keys, 62)
    assert _state(m) == _state(m2)
    snap.release()
    pm._check()
