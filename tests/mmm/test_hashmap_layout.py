"""HashMap page layouts and the capacity hint.

New maps are written in layout 2 (a probe group's ctrl bytes and records together);
maps of layout 1 (ctrl bytes, keys and values each in their own region) are still read
and written by the same kernels. Both run the dict-oracle state machine of
`tests/mmm/test_hashmap.py`; the bytes of a record are checked to sit where layout 2
says; a checkpoint keeps its layout through a restore, also into a page manager whose
map object was of the other layout. ``expected_keys`` sizes a new map so that filling
it splits no bucket, and bad hints are refused before anything is created.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine

import mmm
from ioservice.manager import CheckpointManager
from mmm.errors import PoolExhaustedError
from mmm.structures import hashmap as H
from mmm.structures.hashmap import HashMap
from tests.mmm.test_hashmap import VALUE, SPEC, HashMapVsDict, contents, oracle_upsert


class _Layout1(HashMap):
    """Creates maps in the layout maps were written in before layout 2."""

    LAYOUT = 1


class Layout1GroupsVsDict(HashMapVsDict):
    """The dict-oracle machine over a layout-1 map of five 16-slot groups per page."""

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        self.pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
        self.slots = 80
        self.m = _Layout1.create(self.pm, "m", key="<u4", value=VALUE, page_slots=self.slots)
        assert self.m.layout == 1
        self.model = {}
        self.live_snaps = []


TestLayout1GroupsVsDict = Layout1GroupsVsDict.TestCase
TestLayout1GroupsVsDict.settings = settings(max_examples=20, stateful_step_count=30,
                                            deadline=None)


class SizedVsDict(HashMapVsDict):
    """The dict-oracle machine over a map sized up front for 300 keys (then shrunk by
    deletes and grown past the hint)."""

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        self.pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
        self.slots = 16
        self.m = HashMap.create(self.pm, "m", key="<u4", value=VALUE, page_slots=self.slots,
                                expected_keys=300)
        self.model = {}
        self.live_snaps = []


TestSizedVsDict = SizedVsDict.TestCase
TestSizedVsDict.settings = settings(max_examples=15, stateful_step_count=25, deadline=None)


def test_new_maps_are_layout_2_and_a_record_sits_in_its_group() -> None:
    pm = mmm.PageManager(page_bytes=65536, capacity_bytes=1 << 24)
    m = HashMap.create(pm, "m", key="<u4", value=VALUE)
    assert m.layout == 2 and m.S % 16 == 0 and m.S > 16
    keys = np.arange(5000, dtype="<u4") * 7
    vals = np.zeros(5000, VALUE)
    vals["n"] = np.arange(5000) + 11
    m.put(keys, vals)
    m._check()
    co, gs, ko, _, rs, vo, _, _ = m._lay.tolist()
    assert rs == 40 and vo - ko == 8  # a 4-byte key padded to 8, then the 32-byte value
    frames = pm.pool.frames
    seen = 0
    for seq in m._ps.seqs()[1:]:
        page = frames[m._ps.frames[seq]]
        for g in range(m.S // 16):
            ctrl = page[co + g * gs:co + g * gs + 16]
            for j in np.flatnonzero(ctrl >= 0x80).tolist():
                rec = co + g * gs + 16 + j * rs  # the record right after the group's ctrl
                assert rec + rs <= co + (g + 1) * gs
                k = int(page[rec:rec + 4].view("<u4")[0])
                n = int(page[rec + 8:rec + 16].view("<i8")[0])
                assert k % 7 == 0 and n == k // 7 + 11
                seen += 1
    assert seen == 5000


@pytest.mark.parametrize("key,value", [("S7", [("a", "<i4"), ("b", "u1")]),
                                       ("<u8", "u1"), ("<u2", "<f8"),
                                       ([("a", "<i2"), ("b", "S5")], "<i8")])
def test_odd_record_sizes_against_a_dict(key, value) -> None:
    """Keys and values of sizes that are and are not multiples of 8 (padded or packed
    records), over pages of many groups, with splits, deletes and merges."""
    rng = np.random.default_rng(3)
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 23)
    m = HashMap.create(pm, "m", key=key, value=value)
    assert m.layout == 2 and m.S >= 16
    kdt, vdt = m.key_dtype, m.value_dtype
    model: dict = {}
    for rnd in range(4):
        raw = rng.integers(0, 3000, 2500)
        keys = np.zeros(len(raw), kdt)
        if kdt.fields is not None:
            keys["a"] = raw % 300
            keys["b"] = [str(x // 300).encode() for x in raw.tolist()]
        elif kdt.kind == "S":
            keys[:] = [b"k%d" % x for x in raw.tolist()]
        else:
            keys[:] = raw
        vals = np.zeros(len(raw), vdt)
        vals.view(np.uint8).reshape(len(raw), -1)[:] = rng.integers(
            0, 256, (len(raw), vdt.itemsize), dtype=np.uint8)
        if vdt.kind == "f":
            vals[:] = rng.normal(size=len(raw))
        m.put(keys, vals)
        for k, v in zip(keys.tolist(), vals.tolist()):
            model[k] = v
        gone = keys[: 800 * (rnd % 2)]
        m.delete(gone)
        for k in gone.tolist():
            model.pop(k, None)
        m._check()
        k, v = m.items()
        assert dict(zip(k.tolist(), v.tolist())) == model


def test_a_checkpoint_keeps_its_layout_through_a_restore(tmp_path) -> None:
    """A layout-1 checkpoint restored where a layout-2 map of that name is open (and the
    other way round): the open map object takes the restored pages' layout."""
    for first, second in ((_Layout1, HashMap), (HashMap, _Layout1)):
        root = tmp_path / f"r{first.LAYOUT}"
        pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
        m = first.create(pm, "agg", key="<u4", value=VALUE)
        keys = np.arange(900, dtype="<u4")
        ts = (np.arange(900) * 31) % 97
        m.upsert(keys, {"ts": ts, "x": np.ones(900)}, SPEC)
        model: dict = {}
        oracle_upsert(model, keys.tolist(), ts.tolist(), [1.0] * 900)
        with CheckpointManager(pm, str(root), "job") as mgr:
            mgr.checkpoint(user_meta={"offset": 1}).result()
        pm2 = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
        m2 = second.create(pm2, "agg", key="<u4", value=VALUE)
        m2.put(np.array([5000], "<u4"), np.zeros(1, VALUE))
        assert m2.layout == second.LAYOUT
        with CheckpointManager(pm2, str(root), "job") as mgr:
            assert mgr.restore() is not None
        assert len(m2) == 900 and m2.layout == first.LAYOUT
        m2._check()
        assert contents(m2) == model
        m2.upsert(keys[:50], {"ts": ts[:50], "x": np.full(50, 2.0)}, SPEC)
        oracle_upsert(model, keys[:50].tolist(), ts[:50].tolist(), [2.0] * 50)
        m2.delete(keys[100:400])
        for k in range(100, 400):
            del model[k]
        m2._check()
        assert contents(m2) == model


def test_expected_keys_sizes_the_map_so_filling_it_splits_nothing(monkeypatch) -> None:
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 24)
    m = HashMap.create(pm, "m", key="<u4", value=VALUE, expected_keys=20_000)
    want = -(-20_000 // int(HashMap.MAX_LOAD * m.S))
    assert abs(m._n_buckets - want) <= 1 and len(m) == 0
    m._check()
    calls: list[int] = []
    rechain = H.K.rechain
    monkeypatch.setattr(H.K, "rechain", lambda *a: calls.append(1) or rechain(*a))
    keys = np.random.default_rng(1).permutation(20_000).astype("<u4")
    m.upsert(keys, {"ts": keys.astype(np.int64), "x": np.ones(20_000)}, SPEC)
    assert calls == []  # no split
    m._check()
    assert len(m) == 20_000
    found, v = m.get(keys[:100])
    assert found.all() and v["lo"].tolist() == keys[:100].tolist()
    m.upsert(keys + 20_000, {"ts": keys.astype(np.int64), "x": np.ones(20_000)}, SPEC)
    assert calls and len(m) == 40_000  # grows past the hint
    m._check()


def test_expected_keys_is_ignored_when_the_map_exists() -> None:
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "m", key="<u4", value=VALUE)
    m.put(np.arange(10, dtype="<u4"), np.zeros(10, VALUE))
    again = HashMap.create(pm, "m", key="<u4", value=VALUE, expected_keys=50_000)
    assert again is m and m._n_buckets == 1 and len(m) == 10
    zero = HashMap.create(pm, "z", key="<u4", value=VALUE, expected_keys=0)
    assert zero._n_buckets == 1
    # a map restored into a page manager (no object yet) keeps its own size, even where
    # the pool could not hold the hint's pages
    snap = pm.chkpt()
    pages = snap.copy_pages(np.arange(len(snap)))
    snap.release()
    pm2 = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    loader = pm2.begin_load()
    loader.add(pages)
    loader.finish()
    back = HashMap.create(pm2, "m", key="<u4", value=VALUE, expected_keys=10**9)
    assert back._n_buckets == 1 and len(back) == 10


@pytest.mark.parametrize("bad", [-1, 1.5, "100", True, None.__class__])
def test_a_bad_expected_keys_is_refused_and_creates_nothing(bad) -> None:
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    with pytest.raises(ValueError, match="expected_keys"):
        HashMap.create(pm, "m", key="<u4", value=VALUE, expected_keys=bad)
    assert pm.names() == []


def test_an_expected_keys_beyond_the_pool_is_refused_and_creates_nothing() -> None:
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)  # 256 frames
    before = pm.stats()
    with pytest.raises(PoolExhaustedError, match="expected_keys=1000000"):
        HashMap.create(pm, "m", key="<u4", value=VALUE, expected_keys=1_000_000)
    assert pm.names() == [] and pm.stats() == before
    m = HashMap.create(pm, "m", key="<u4", value=VALUE, expected_keys=2000)
    m.put(np.arange(2000, dtype="<u4"), np.zeros(2000, VALUE))
    m._check()


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 3000), slots=st.sampled_from([3, 16, 48, None]))
def test_a_sized_map_holds_what_it_was_given(n: int, slots: int | None) -> None:
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 25)
    m = HashMap.create(pm, "m", key="<u8", value="<i8", page_slots=slots, expected_keys=n)
    keys = np.arange(n, dtype="<u8") * 2654435761
    m.put(keys, np.arange(n))
    m._check()
    assert len(m) == n
    found, v = m.get(keys)
    assert found.all() and v.tolist() == list(range(n))


def test_page_slots_only_layout_1_holds_create_a_layout_1_map() -> None:
    """A map rebuilt with an old map's geometry (more slots than a layout-2 page holds,
    as `sguard convert` asks) is created in layout 1; too many for either is refused."""
    pm = mmm.PageManager(page_bytes=65536, capacity_bytes=1 << 24)
    old = _Layout1.create(pm, "old", key="<u4", value=VALUE)
    new = HashMap.create(pm, "new", key="<u4", value=VALUE)
    assert old.S > new.S
    m = HashMap.create(pm, "m", key="<u4", value=VALUE, page_slots=old.S)
    assert m.layout == 1 and m.S == old.S
    keys = np.arange(3000, dtype="<u4")
    m.put(keys, np.zeros(3000, VALUE))
    m._check()
    assert len(m) == 3000
    with pytest.raises(ValueError, match="page_slots"):
        HashMap.create(pm, "big", key="<u4", value=VALUE, page_slots=4096)
    assert "big" not in pm.names()
