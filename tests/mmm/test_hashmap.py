"""HashMap against a dict oracle, with tiny pages so splits, merges and overflow chains
happen every few operations; copy-on-write snapshots, rollback and rebuild included."""
from __future__ import annotations

import copy

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, invariant, precondition, rule)

import mmm
from mmm.structures.hashmap import HashMap

VALUE = np.dtype([("n", "<i8"), ("lo", "<i8"), ("hi", "<i8"), ("last", "<f8")])
SPEC = {"n": "count", "lo": ("min", "ts"), "hi": ("max", "ts"), "last": ("last", "x")}
keys_st = st.lists(st.integers(0, 400), max_size=80)


def oracle_upsert(model: dict, keys: list[int], ts: list[int], xs: list[float]) -> None:
    for k, t, x in zip(keys, ts, xs):
        old = model.get(k)
        if old is None:
            model[k] = (1, t, t, x)
        else:
            model[k] = (old[0] + 1, min(old[1], t), max(old[2], t), x)


def contents(m: HashMap) -> dict:
    k, v = m.items()
    return {int(a): tuple(b) for a, b in zip(k.tolist(), v.tolist())}


class HashMapVsDict(RuleBasedStateMachine):
    """Every HashMap operation mirrored on a dict; snapshots checked against copies."""

    snapshots = Bundle("snapshots")

    def __init__(self) -> None:
        super().__init__()
        self.pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
        self.slots = 3
        self.m = HashMap.create(self.pm, "m", key="<u4", value=VALUE, page_slots=self.slots)
        self.model: dict[int, tuple] = {}
        self.live_snaps: list[tuple[mmm.Snapshot, dict]] = []

    @rule(keys=keys_st, data=st.data())
    def upsert(self, keys: list[int], data: st.DataObject) -> None:
        ts = data.draw(st.lists(st.integers(-1000, 1000), min_size=len(keys),
                                max_size=len(keys)))
        xs = [float(i) for i in range(len(keys))]
        self.m.upsert(np.array(keys, "<u4"), {"ts": np.array(ts), "x": np.array(xs)}, SPEC)
        oracle_upsert(self.model, keys, ts, xs)

    @rule(keys=keys_st)
    def put(self, keys: list[int]) -> None:
        vals = np.zeros(len(keys), VALUE)
        vals["n"] = np.arange(len(keys)) + 100
        self.m.put(np.array(keys, "<u4"), vals)
        for k, v in zip(keys, vals.tolist()):
            self.model[k] = tuple(v)

    @rule(keys=keys_st)
    def delete(self, keys: list[int]) -> None:
        found = self.m.delete(np.array(keys, "<u4"))
        expect = []
        gone: set[int] = set()
        for k in keys:
            expect.append(k in self.model and k not in gone or (k in self.model))
        for k in keys:
            self.model.pop(k, None)
        # the mask reports presence *before* the batch, per input key
        assert found.tolist() == [e for e in expect]

    @rule(keys=keys_st, bound=st.integers(-1000, 1000))
    def expire(self, keys: list[int], bound: int) -> None:
        gone = self.m.expire(np.array(keys, "<u4"), "lo", bound)
        # per input key: present before the call with its "lo" at most the bound
        expect = [k in self.model and self.model[k][1] <= bound for k in keys]
        for k, e in zip(keys, expect):
            if e:
                self.model.pop(k, None)
        assert gone.tolist() == expect

    @rule(keys=keys_st)
    def get(self, keys: list[int]) -> None:
        found, vals = self.m.get(np.array(keys, "<u4"))
        for k, f, v in zip(keys, found.tolist(), vals.tolist()):
            assert f == (k in self.model)
            if f:
                assert tuple(v) == self.model[k]

    @rule(k=st.integers(0, 60), t=st.integers(-5, 5))
    def per_record(self, k: int, t: int) -> None:
        self.m.upsert_record(k, SPEC, ts=t, x=2.5)
        oracle_upsert(self.model, [k], [t], [2.5])
        if k % 3 == 0:
            self.m[k + 1] = (7, 7, 7, 7.0)
            self.model[k + 1] = (7, 7, 7, 7.0)

    @rule(k=st.integers(0, 61))
    def per_record_read_delete(self, k: int) -> None:
        assert (k in self.m) == (k in self.model)
        if k in self.model:
            assert tuple(self.m[k].tolist()) == self.model[k]
            del self.m[k]
            del self.model[k]
        else:
            with pytest.raises(KeyError):
                self.m[k]

    @precondition(lambda self: len(self.model) > 0)
    @rule()
    def clear(self) -> None:
        self.m.clear()
        self.model.clear()

    @rule(target=snapshots)
    def snapshot(self) -> tuple:
        snap = self.pm.chkpt()
        frozen = copy.deepcopy(self.model)
        self.live_snaps.append((snap, frozen))
        return (snap, frozen)

    @rule(target=snapshots)
    def snapshot_in_place(self) -> tuple:
        """A checkpoint writer's snapshot: values of keys in its pages change in place."""
        snap = self.pm.chkpt(in_place=True)
        frozen = copy.deepcopy(self.model)
        self.live_snaps.append((snap, frozen))
        return (snap, frozen)

    @rule(entry=snapshots)
    def snapshot_rebuilds_frozen_state(self, entry: tuple) -> None:
        snap, frozen = entry
        if snap.state is not mmm.SnapshotState.ACTIVE or snap.persisted.any():
            return
        pages = snap.copy_pages(np.arange(len(snap)))
        pm2 = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
        loader = pm2.begin_load()
        order = np.random.default_rng(len(pages)).permutation(len(pages))
        loader.add(pages[order])
        loader.finish()
        m2 = HashMap.create(pm2, "m", key="<u4", value=VALUE, page_slots=self.slots)
        m2._check()
        assert contents(m2) == frozen

    @rule(entry=snapshots, data=st.data())
    def persist_some(self, entry: tuple, data: st.DataObject) -> None:
        snap, _ = entry
        if snap.state is not mmm.SnapshotState.ACTIVE:
            return
        n = len(snap)
        idx = data.draw(st.lists(st.integers(0, n - 1), max_size=n)) if n else []
        snap.mark_persisted(np.array(idx, dtype=np.int64))
        if data.draw(st.booleans()):
            snap.complete()

    @rule(entry=snapshots)
    def rollback(self, entry: tuple) -> None:
        snap, frozen = entry
        if snap.state is not mmm.SnapshotState.ACTIVE or snap.persisted.any() or snap.in_place:
            return
        self.pm.rollback(snap)
        self.model = copy.deepcopy(frozen)

    @invariant()
    def agrees_with_dict(self) -> None:
        self.m._check()
        assert len(self.m) == len(self.model)
        assert contents(self.m) == self.model

    def teardown(self) -> None:
        for snap, _ in self.live_snaps:
            snap.release()
        self.pm._check()
        assert self.pm.stats()["pinned_frames"] == 0
        assert self.pm.stats()["orphan_frames"] == 0


TestHashMapVsDict = HashMapVsDict.TestCase
TestHashMapVsDict.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


class HashMapGroupsVsDict(HashMapVsDict):
    """Same machine with 80-slot pages: five 16-slot probe groups (SWAR, double hashing)."""

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        self.pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
        self.slots = 80
        self.m = HashMap.create(self.pm, "m", key="<u4", value=VALUE, page_slots=self.slots)
        self.model = {}
        self.live_snaps = []


TestHashMapGroupsVsDict = HashMapGroupsVsDict.TestCase
TestHashMapGroupsVsDict.settings = settings(max_examples=30, stateful_step_count=40,
                                            deadline=None)


@settings(max_examples=25, deadline=None)
@given(keys=st.lists(st.tuples(st.integers(-3, 3), st.binary(min_size=0, max_size=5)),
                     max_size=200),
       slots=st.integers(2, 6))
def test_structured_keys_with_padding_and_bytes(keys, slots):
    """Structured keys (int + bytes) behave like tuples in a dict."""
    kdt = np.dtype([("a", "<i2"), ("b", "S5")], align=True)
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "s", key=kdt, value="<i8", page_slots=slots)
    arr = np.array(keys, dtype=kdt)
    m.put(arr, np.arange(len(arr)))
    model = {}
    for i, k in enumerate(keys):
        model[(k[0], k[1].rstrip(b"\x00"))] = i
    m._check()
    assert len(m) == len(model)
    found, vals = m.get(arr)
    assert found.all()
    for k, v in zip(keys, vals.tolist()):
        assert model[(k[0], k[1].rstrip(b"\x00"))] == v


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=True, width=64), max_size=100))
def test_float_keys_treat_negative_zero_as_zero(values):
    """Float keys follow Python equality: -0.0 and 0.0 are one key."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "f", key="<f8", value="<i8", page_slots=4)
    m.put(np.array(values, "<f8"), np.arange(len(values)))
    model = {}
    for i, v in enumerate(values):
        model[v] = i
    m._check()
    assert len(m) == len(model)


def test_large_batches_match_dict():
    """64 KiB pages, 200k keys in batches: the aggregate equals a dict's."""
    rng = np.random.default_rng(7)
    pm = mmm.PageManager()
    m = HashMap.create(pm, "agg", key="<u8", value=[("n", "<i8"), ("s", "<f8")])
    spec = {"n": "count", "s": ("sum", "x")}
    keys = rng.integers(0, 50_000, 200_000).astype("<u8")
    xs = rng.random(200_000)
    for i in range(0, len(keys), 30_000):
        m.upsert(keys[i:i + 30_000], {"x": xs[i:i + 30_000]}, spec)
    m._check()
    cnt = np.bincount(keys.astype(np.int64), minlength=50_000)
    tot = np.bincount(keys.astype(np.int64), weights=xs, minlength=50_000)
    found, vals = m.get(np.arange(50_000, dtype="<u8"))
    assert np.array_equal(found, cnt > 0)
    assert np.array_equal(vals["n"][found], cnt[cnt > 0])
    assert np.allclose(vals["s"][found], tot[cnt > 0])


def test_wrong_key_dtype_is_refused_and_map_unchanged():
    """Keys that do not fit the key dtype raise RecordTypeError and change nothing."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "m", key="<u2", value=[("n", "<i8")])
    m.upsert(np.array([1, 2], "<u2"), None, {"n": "count"})
    before = contents(m)
    with pytest.raises(mmm.RecordTypeError, match="'m'.*do not fit"):
        m.upsert(np.array([1, 70000]), None, {"n": "count"})
    with pytest.raises(mmm.RecordTypeError, match="cannot be stored"):
        m.put(np.array([1.5]), np.zeros(1, m.value_dtype))
    with pytest.raises(mmm.RecordTypeError, match="expected a 1-D"):
        m.get(np.zeros((2, 2), "<u2"))
    with pytest.raises(mmm.RecordTypeError, match="expected 3 records"):
        m.put(np.array([1, 2, 3], "<u2"), np.zeros(2, m.value_dtype))
    with pytest.raises(mmm.RecordTypeError, match="unknown op"):
        m.upsert(np.array([1], "<u2"), None, {"n": "median"})
    with pytest.raises(mmm.RecordTypeError, match="input column 'ts' is missing"):
        m.upsert(np.array([1], "<u2"), {"x": [1]}, {"n": ("min", "ts")})
    with pytest.raises(mmm.RecordTypeError, match="not in value fields"):
        m.upsert(np.array([1], "<u2"), None, {"zz": "count"})
    assert contents(m) == before
    m._check()


def test_expire_refuses_a_bad_field_or_bound_and_changes_nothing():
    """expire's field must be an int64 value field and its bound an int64 integer: anything
    else raises naming it, before any write."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "m", key="<u4", value=VALUE)
    m.upsert(np.arange(50, dtype="<u4"), {"ts": np.arange(50), "x": np.zeros(50)}, SPEC)
    before = contents(m)
    for field in ("last", "zz"):
        with pytest.raises(mmm.RecordTypeError, match=f"'m': expire: field '{field}' is not "
                                                       f"an int64 field"):
            m.expire(np.arange(50, dtype="<u4"), field, 100)
    for bound in (1.5, 2 ** 63, True, "3"):
        with pytest.raises(ValueError, match=f"'m': expire: bound={bound!r} must be an int64"):
            m.expire(np.arange(50, dtype="<u4"), "lo", bound)  # type: ignore[arg-type]
    with pytest.raises(mmm.RecordTypeError, match="do not fit"):
        m.expire(np.array([1, -1]), "lo", 100)
    assert contents(m) == before
    m._check()


def test_expire_does_not_clone_pages_of_live_keys():
    """Keys above the bound are not written: a snapshot's pages holding only them stay
    shared (no clone), while a page with an expired key is cloned and the snapshot still
    sees the key."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "m", key="<u4", value=VALUE)
    keys = np.arange(2000, dtype="<u4")
    m.upsert(keys, {"ts": keys.astype(np.int64), "x": np.zeros(2000)}, SPEC)
    snap = pm.chkpt()
    cloned = pm.stats()["pages_cloned"]
    assert not m.expire(keys[1000:], "lo", 999).any()  # all live: nothing written
    assert pm.stats()["pages_cloned"] == cloned
    gone = m.expire(keys, "lo", 9)
    assert gone.tolist() == [True] * 10 + [False] * 1990
    assert pm.stats()["pages_cloned"] > cloned  # the expired keys' pages were cloned
    assert len(m) == 1990 and not m.contains(keys[:10]).any()
    pages = snap.copy_pages(np.arange(len(snap)))
    snap.release()
    pm2 = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    loader = pm2.begin_load()
    loader.add(pages)
    loader.finish()
    assert len(HashMap.create(pm2, "m", key="<u4", value=VALUE)) == 2000
    m._check()


def test_nan_key_is_refused():
    """NaN cannot be a key (it equals nothing)."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "f", key="<f4", value="<i4")
    with pytest.raises(mmm.RecordTypeError, match="NaN"):
        m.put(np.array([1.0, np.nan], "<f4"), np.zeros(2, "<i4"))
    assert len(m) == 0


def test_object_fields_and_reopen_with_other_schema_are_refused():
    """Object fields raise SchemaError; reopening with another schema SchemaMismatchError."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    with pytest.raises(mmm.SchemaError, match="object"):
        HashMap.create(pm, "o", key="<u4", value=[("x", object)])
    with pytest.raises(mmm.SchemaError, match="unicode"):
        HashMap.create(pm, "u", key="U4", value="<i4")
    HashMap.create(pm, "m", key="<u4", value="<i8")
    with pytest.raises(mmm.SchemaMismatchError, match="value: stored"):
        HashMap.create(pm, "m", key="<u4", value="<i4")
    assert pm.names() == ["m"]


def test_same_name_returns_same_object_and_contents():
    """create() with an existing name reopens it."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "m", key="<u4", value="<i8")
    m.put(np.array([5], "<u4"), np.array([9]))
    assert HashMap.create(pm, "m", key="<u4", value="<i8") is m
    assert int(HashMap.create(pm, "m", key="<u4", value="<i8")[5]) == 9
