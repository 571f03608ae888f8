"""OrderedMap against a sorted-dict oracle, with copy-on-write snapshots, rollback and load."""
from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import threading
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import mmm
from mmm.errors import (PoolExhaustedError, RecordTypeError, SchemaError, SchemaMismatchError,
                        SnapshotStateError)
from mmm.snapshot import SnapshotState
from mmm.structures.hashmap import HashMap
from mmm.structures.ordered_map import OrderedMap

VALUE = np.dtype([("n", "<i8"), ("lo", "<i8"), ("hi", "<i8"), ("s", "<f8")])
SPEC_AGG = {"n": "count", "lo": ("min", "ts"), "hi": ("max", "ts"), "s": ("sum", "x")}
SPEC_EDGE = {"lo": ("first", "ts"), "hi": ("last", "ts")}
KEY_MAX = 40
PAGE_BYTES = 4096
CAPACITY = 1 << 20

# key dtype -> (int model keys -> key array, key array -> int model keys); both monotonic
KEYS: dict[str, tuple[Callable[[Any], np.ndarray], Callable[[np.ndarray], list[int]]]] = {
    "<i4": (lambda a: np.asarray(a, dtype="<i4").reshape(-1),
            lambda k: k.astype(np.int64).tolist()),
    ">u2": (lambda a: np.asarray(a, dtype=">u2").reshape(-1),
            lambda k: k.astype(np.int64).tolist()),
    "<f8": (lambda a: np.asarray(a, dtype=float).reshape(-1) * 0.5 - 10.0,  # 20 -> 0.0
            lambda k: np.rint((k + 10.0) * 2).astype(np.int64).tolist()),
    "S3": (lambda a: np.array([b"%03d" % x for x in np.asarray(a).reshape(-1)], dtype="S3"),
           lambda k: [int(x) for x in k.tolist()]),
    "<M8[s]": (lambda a: np.asarray(a, dtype="<i8").reshape(-1).astype("<M8[s]"),
               lambda k: k.astype(np.int64).tolist()),
}

keys_st = st.lists(st.integers(0, KEY_MAX), max_size=12)
bound_st = st.one_of(st.none(), st.integers(0, KEY_MAX + 2))
incl_st = st.tuples(st.booleans(), st.booleans())
small = st.integers(-50, 50)


def _values(rows: list[tuple[int, int, int, int]]) -> np.ndarray:
    return np.array([(n, lo, hi, float(s)) for n, lo, hi, s in rows], dtype=VALUE)


def _in(k: int, lo: int | None, hi: int | None, incl: tuple[bool, bool]) -> bool:
    if lo is not None and (k < lo if incl[0] else k <= lo):
        return False
    if hi is not None and (k > hi if incl[1] else k >= hi):
        return False
    return True


class OrderedMapVsSortedDict(RuleBasedStateMachine):
    """Every OrderedMap operation, snapshot, rollback and load against a dict + sorted()."""

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[int, tuple[int, int, int, float]] = {}
        self.snap: mmm.Snapshot | None = None
        self.frozen: dict[int, tuple[int, int, int, float]] | None = None
        self.saved: dict[int, bytes] = {}

    @initialize(slots=st.integers(3, 6), kdt=st.sampled_from(sorted(KEYS)))
    def setup(self, slots: int, kdt: str) -> None:
        self.pm = mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=CAPACITY)
        self.kdt = kdt
        self.to_key, self.from_key = KEYS[kdt]
        self.m = OrderedMap.create(self.pm, "om", key=kdt, value=VALUE, page_slots=slots)

    def _k(self, ints: Any) -> np.ndarray:
        return self.to_key(np.asarray(ints, dtype=np.int64))

    def _k1(self, i: int) -> Any:
        return self._k([i])[0]

    # -- batch writes ---------------------------------------------------------------------------
    @rule(keys=keys_st, data=st.data())
    def put(self, keys: list[int], data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.tuples(small, small, small, small), min_size=len(keys),
                                  max_size=len(keys)))
        self.m.put(self._k(keys), _values(rows))
        for k, r in zip(keys, rows):
            self.model[k] = (r[0], r[1], r[2], float(r[3]))

    @rule(keys=keys_st, data=st.data(), edge=st.booleans())
    def upsert(self, keys: list[int], data: st.DataObject, edge: bool) -> None:
        ts = data.draw(st.lists(small, min_size=len(keys), max_size=len(keys)))
        x = data.draw(st.lists(small, min_size=len(keys), max_size=len(keys)))
        spec = SPEC_EDGE if edge else SPEC_AGG
        self.m.upsert(self._k(keys), {"ts": np.array(ts, dtype=np.int64),
                                      "x": np.array(x, dtype=np.int64)}, spec)
        for k, t, v in zip(keys, ts, x):
            old = self.model.get(k)
            if edge:
                self.model[k] = (0, t, t, 0.0) if old is None else (old[0], old[1], t, old[3])
            elif old is None:
                self.model[k] = (1, t, t, float(v))
            else:
                self.model[k] = (old[0] + 1, min(old[1], t), max(old[2], t), old[3] + v)

    @rule(keys=keys_st)
    def delete(self, keys: list[int]) -> None:
        found = self.m.delete(self._k(keys))
        assert found.tolist() == [k in self.model for k in keys]
        for k in keys:
            self.model.pop(k, None)

    @rule(lo=bound_st, hi=bound_st, incl=incl_st)
    def pop_range(self, lo: int | None, hi: int | None, incl: tuple[bool, bool]) -> None:
        lo_k = None if lo is None else self._k1(lo)
        hi_k = None if hi is None else self._k1(hi)
        keys, vals = self.m.pop_range(lo_k, hi_k, inclusive=incl)
        want = [k for k in sorted(self.model) if _in(k, lo, hi, incl)]
        assert self.from_key(keys) == want
        assert vals.tolist() == [self.model[k] for k in want]
        for k in want:
            del self.model[k]

    @rule()
    def clear(self) -> None:
        self.m.clear()
        self.model.clear()

    # -- per-record -------------------------------------------------------------------------------
    @rule(k=st.integers(0, KEY_MAX), r=st.tuples(small, small, small, small))
    def setitem(self, k: int, r: tuple[int, int, int, int]) -> None:
        self.m[self._k1(k)] = (r[0], r[1], r[2], float(r[3]))
        self.model[k] = (r[0], r[1], r[2], float(r[3]))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delitem(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.model)))
        del self.m[self._k1(k)]
        del self.model[k]

    # -- the per-record path: Python keys and values (plain Python over memoryviews) ------------------
    def _py(self, i: int) -> Any:
        """Model key ``i`` as a plain Python key (what the per-record path takes): int, float
        or bytes; a datetime key stays a numpy scalar (the batch path)."""
        k = self._k1(i)
        return k if self.kdt.startswith("<M") else k.item()

    def record_op(self, op: str, data: st.DataObject) -> None:
        """One per-record operation with Python keys and values, checked against the oracle."""
        k = data.draw(st.integers(0, KEY_MAX))
        key = self._py(k)
        if op == "setitem":
            r = data.draw(st.tuples(small, small, small, small))
            self.m[key] = (r[0], r[1], r[2], float(r[3]))
            self.model[k] = (r[0], r[1], r[2], float(r[3]))
        elif op == "delitem":
            if k in self.model:
                del self.m[key]
                del self.model[k]
            else:
                with pytest.raises(KeyError):
                    del self.m[key]
        elif op == "get":
            assert (key in self.m) == (k in self.model)
            if k in self.model:
                assert self.m[key].tolist() == self.model[k]
        elif op == "range":
            lo, hi = data.draw(bound_st), data.draw(bound_st)
            incl = data.draw(incl_st)
            keys, vals = self.m.range_lists(None if lo is None else self._py(lo),
                                            None if hi is None else self._py(hi), inclusive=incl)
            want = [x for x in sorted(self.model) if _in(x, lo, hi, incl)]
            assert keys == [self._py(x) for x in want] or self.kdt.startswith("<M")
            assert vals == [self.model[x] for x in want]
        elif op == "snapshot" and not self._active():
            self.snapshot()  # taken with the per-record cache alive: later writes must clone
        assert len(self.m) == len(self.model)

    record_ops = st.sampled_from(["setitem", "setitem", "delitem", "get", "range", "snapshot"])

    @rule(data=st.data(), op=record_ops)
    def record1(self, data: st.DataObject, op: str) -> None:
        self.record_op(op, data)

    @rule(data=st.data(), ops=st.lists(record_ops, min_size=2, max_size=25))
    def record_run(self, data: st.DataObject, ops: list[str]) -> None:
        """A run of per-record operations with no other operation in between (the cache of
        leaf frames and write-barrier passes stays alive), maybe with a snapshot in the
        middle whose pages must keep the state of that moment (checked on load/rollback)."""
        for op in ops:
            self.record_op(op, data)

    # -- reads -------------------------------------------------------------------------------------
    @rule(keys=keys_st)
    def lookup(self, keys: list[int]) -> None:
        found, vals = self.m.get(self._k(keys))
        assert found.tolist() == [k in self.model for k in keys]
        assert vals.tolist() == [self.model.get(k, (0, 0, 0, 0.0)) for k in keys]
        for k in keys[:2]:
            key = self._k1(k)
            assert (key in self.m) == (k in self.model)
            if k in self.model:
                assert self.m[key].tolist() == self.model[k]
            else:
                with pytest.raises(KeyError):
                    self.m[key]
                with pytest.raises(KeyError):
                    del self.m[key]

    @rule(lo=st.one_of(st.none(), st.integers(0, KEY_MAX)),
          hi=st.one_of(st.none(), st.integers(0, KEY_MAX)), incl=incl_st)
    def range(self, lo: int | None, hi: int | None, incl: tuple[bool, bool]) -> None:
        keys, vals = self.m.range(None if lo is None else self._k1(lo),
                                  None if hi is None else self._k1(hi), inclusive=incl)
        want = [k for k in sorted(self.model) if _in(k, lo, hi, incl)]
        assert self.from_key(keys) == want
        assert vals.tolist() == [self.model[k] for k in want]

    @rule()
    def iterate_and_extremes(self) -> None:
        assert self.from_key(np.array(list(self.m), dtype=self.m.key_dtype)) == sorted(self.model)
        if self.model:
            assert self.from_key(np.array([self.m.min_key()])) == [min(self.model)]
            assert self.from_key(np.array([self.m.max_key()])) == [max(self.model)]
        else:
            with pytest.raises(ValueError):
                self.m.min_key()

    @rule()
    def reopen_from_pages(self) -> None:
        """Drop the object; create-by-name rebuilds the index from the leaf chain."""
        slots = self.m.S
        del self.m
        gc.collect()
        self.m = OrderedMap.create(self.pm, "om", key=self.kdt, value=VALUE)
        assert self.m.S == slots
        assert OrderedMap.create(self.pm, "om", key=self.kdt, value=VALUE) is self.m

    # -- snapshots ---------------------------------------------------------------------------------
    def _active(self) -> bool:
        return self.snap is not None and self.snap.state is SnapshotState.ACTIVE

    @precondition(lambda self: not self._active())
    @rule()
    def snapshot(self) -> None:
        self.snap = self.pm.chkpt()
        self.frozen = copy.deepcopy(self.model)
        self.saved = {}

    @precondition(lambda self: self._active())
    @rule(data=st.data())
    def persist_some(self, data: st.DataObject) -> None:
        """An I/O thread writes some frozen pages (we keep their bytes) and marks them persisted."""
        assert self.snap is not None
        idx = data.draw(st.lists(st.integers(0, len(self.snap) - 1), max_size=4))
        for i in idx:
            if i not in self.saved:
                self.saved[i] = self.snap.copy_pages([i]).tobytes()
        self.snap.mark_persisted(idx)

    @precondition(lambda self: self._active())
    @rule(how=st.sampled_from(["rollback", "complete", "release", "cancel"]))
    def end_snapshot(self, how: str) -> None:
        """End the active snapshot (one rule, so that swarm testing keeps every ending)."""
        snap = self.snap
        assert snap is not None and self.frozen is not None
        if how == "rollback" and self.saved:
            with pytest.raises(SnapshotStateError, match="persisted"):
                self.pm.rollback(snap)  # pages were persisted: no longer a rollback point
            how = "complete"
        if how == "rollback":
            self.pm.rollback(snap)  # the same map object now sees the snapshot state
            self.model = self.frozen
            self.snap = self.frozen = None
        elif how == "complete":  # write the remaining pages, keep their bytes for a load
            rest = [i for i in range(len(snap)) if i not in self.saved]
            if rest:
                buf = snap.copy_pages(rest)
                for j, i in enumerate(rest):
                    self.saved[i] = buf[j].tobytes()
            snap.complete()
        else:
            getattr(snap, how)()
            self.snap = self.frozen = None

    @precondition(lambda self: self.snap is not None and self.snap.state in
                  (SnapshotState.ACTIVE, SnapshotState.COMPLETED))
    @rule()
    def load_into_fresh_manager(self) -> None:
        """Rebuild the snapshot's pages in a new PageManager: equals the oracle at snapshot time."""
        snap = self.snap
        assert snap is not None
        if snap.state is SnapshotState.ACTIVE:
            rest = np.array([i for i in range(len(snap)) if i not in self.saved], dtype=np.int64)
            copied = snap.copy_pages(rest) if len(rest) else None
            pages = {i: self.saved[i] for i in self.saved}
            for j, i in enumerate(rest.tolist()):
                assert copied is not None
                pages[i] = copied[j].tobytes()
        else:
            pages = self.saved
        buf = b"".join(pages[i] for i in range(len(snap)))
        pm2 = mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=CAPACITY)
        ld = pm2.begin_load()
        ld.add(buf)
        ld.finish()
        m2 = OrderedMap.create(pm2, "om", key=self.kdt, value=VALUE)
        m2._check()
        assert self.frozen is not None
        keys, vals = m2.items()
        assert self.from_key(keys) == sorted(self.frozen)
        assert vals.tolist() == [self.frozen[k] for k in sorted(self.frozen)]

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def agrees_with_sorted_dict(self) -> None:
        self.m._check()
        assert len(self.m) == len(self.model)
        keys, vals = self.m.items()
        want = sorted(self.model)
        assert self.from_key(keys) == want
        assert vals.tolist() == [self.model[k] for k in want]

    def teardown(self) -> None:
        if self._active():
            assert self.snap is not None
            self.snap.release()


TestOrderedMapVsSortedDict = OrderedMapVsSortedDict.TestCase


# -- error cases -----------------------------------------------------------------------------------
@pytest.fixture
def pm() -> mmm.PageManager:
    return mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=CAPACITY)


@pytest.fixture
def om(pm: mmm.PageManager) -> OrderedMap:
    m = OrderedMap.create(pm, "om", key="<i8", value=VALUE, page_slots=4)
    m.put(np.arange(0, 20, 2), np.zeros(10, VALUE))
    return m


@pytest.mark.parametrize("key", [[("a", "<i4")], ("<i4", (2,)), "c16", "U4", "O"])
def test_create_refuses_unordered_or_object_key_dtypes(pm: mmm.PageManager, key: Any) -> None:
    """Structured, subarray, complex, unicode and object keys raise SchemaError naming the map."""
    with pytest.raises(SchemaError, match="om"):
        OrderedMap.create(pm, "om", key=key, value=VALUE)
    assert not pm.exists("om")


@pytest.mark.parametrize("value", [[("a", "O")], "U3", ("<f8", (3,))])
def test_create_refuses_object_unicode_and_subarray_values(pm: mmm.PageManager,
                                                           value: Any) -> None:
    """Object, unicode and top-level subarray value dtypes raise SchemaError."""
    with pytest.raises(SchemaError):
        OrderedMap.create(pm, "om", key="<i8", value=value)


@pytest.mark.parametrize("slots", [0, 1, True, 10_000])
def test_create_refuses_bad_page_slots(pm: mmm.PageManager, slots: Any) -> None:
    """page_slots below 2, a bool, or more than a page holds raise ValueError."""
    with pytest.raises(ValueError, match="page_slots"):
        OrderedMap.create(pm, "om", key="<i8", value=VALUE, page_slots=slots)


def test_reopen_with_another_schema_or_kind_raises(om: OrderedMap, pm: mmm.PageManager) -> None:
    """Reopening by name with another key/value dtype or structure kind is refused."""
    with pytest.raises(SchemaMismatchError, match="om"):
        OrderedMap.create(pm, "om", key="<i4", value=VALUE)
    with pytest.raises(SchemaMismatchError, match="om"):
        OrderedMap.create(pm, "om", key="<i8", value="<f8")
    with pytest.raises(SchemaMismatchError):
        HashMap.create(pm, "om", key="<i8", value=VALUE)
    assert OrderedMap.create(pm, "om", key="<i8", value=VALUE) is om


@pytest.mark.parametrize("keys", [
    np.array([1.5]),                         # float into int keys
    np.array(["a"]),                         # unicode
    np.array([[1, 2]]),                      # 2-D
    np.array([2 ** 70], dtype=object),       # object
    np.zeros(1, [("a", "<i8")]),             # structured
])
def test_wrong_key_dtype_or_shape_raises_and_leaves_map_unchanged(om: OrderedMap,
                                                                  keys: np.ndarray) -> None:
    """Bad keys raise RecordTypeError naming the structure; nothing changes."""
    before = om.items()
    with pytest.raises(RecordTypeError, match="om"):
        om.put(keys, np.zeros(len(keys), VALUE))
    with pytest.raises(RecordTypeError, match="om"):
        om.delete(keys)
    with pytest.raises(RecordTypeError, match="om"):
        om.get(keys)
    om._check()
    assert np.array_equal(om.items()[0], before[0])


def test_wrong_values_raise_and_leave_map_unchanged(om: OrderedMap) -> None:
    """Values of the wrong length or fields raise RecordTypeError; nothing changes."""
    with pytest.raises(RecordTypeError, match="om"):
        om.put(np.array([1, 3]), np.zeros(1, VALUE))
    with pytest.raises(RecordTypeError, match="om"):
        om.put(np.array([1]), np.zeros(1, [("q", "<i8")]))
    om._check()
    assert om.keys().tolist() == list(range(0, 20, 2))


def test_nan_nat_and_truncated_keys_are_refused(pm: mmm.PageManager) -> None:
    """NaN, NaT and byte keys longer than the key dtype raise RecordTypeError."""
    f = OrderedMap.create(pm, "f", key="<f8", value="<i8")
    with pytest.raises(RecordTypeError, match="NaN"):
        f.put(np.array([1.0, np.nan]), np.array([1, 2]))
    assert len(f) == 0
    f[-0.0] = 1
    f[0.0] = 2
    assert len(f) == 1 and f[0.0] == 2 and not np.signbit(f.min_key())
    t = OrderedMap.create(pm, "t", key="<M8[s]", value="<i8")
    with pytest.raises(RecordTypeError, match="NaT"):
        t.put(np.array(["NaT"], "<M8[s]"), np.array([1]))
    with pytest.raises(RecordTypeError, match="truncation"):
        t.put(np.array(["2020-01-01T00:00:00.5"], "<M8[ms]"), np.array([1]))
    b = OrderedMap.create(pm, "b", key="S3", value="<i8")
    with pytest.raises(RecordTypeError, match="truncation"):
        b.put(np.array([b"abcd"]), np.array([1]))
    for numbers in (np.array([1.5]), np.array([7]), [2.0]):  # never cast to b"1.5", b"7"
        with pytest.raises(RecordTypeError, match="cannot be stored as \\|S3"):
            b.put(numbers, np.array([1]))
    b.put(np.array([b"ab"]), np.array([1]))
    assert b[b"ab"] == 1 and "ab" not in b  # str is not a bytes key: False, not an error
    assert b.keys().tolist() == [b"ab"]
    for m in (f, t, b):
        m._check()


def test_missing_keys_raise_keyerror(om: OrderedMap) -> None:
    """m[k] and del m[k] of an absent key raise KeyError."""
    with pytest.raises(KeyError):
        om[1]
    with pytest.raises(KeyError):
        del om[1]
    assert 1 not in om and 2 in om


def test_per_record_keys_are_validated_like_batches(pm: mmm.PageManager) -> None:
    """Python and numpy scalars take the fast path; bad ones raise as batches do."""
    i4 = OrderedMap.create(pm, "i4", key="<i4", value="<i8", page_slots=3)
    for k in range(10):
        i4[k] = k * 10
    i4[np.int32(3)] = -3
    assert i4[3] == -3 and i4[np.int64(4)] == 40 and i4[np.array(5)] == 50
    with pytest.raises(RecordTypeError, match="i4"):
        i4[2 ** 40] = 1
    with pytest.raises(RecordTypeError, match="i4"):
        i4[1.5]
    assert 2 ** 40 not in i4 and 1.5 not in i4 and "a" not in i4 and 9 in i4
    f4 = OrderedMap.create(pm, "f4", key="<f4", value="<i8")
    f4[0.5] = 1
    f4[-0.0] = 2
    assert f4[np.float32(0.5)] == 1 and f4[0.0] == 2 and len(f4) == 2
    with pytest.raises(RecordTypeError, match="NaN"):
        f4[float("nan")] = 3
    assert float("nan") not in f4
    s3 = OrderedMap.create(pm, "s3", key="S3", value="<i8")
    s3[b"b"] = 2
    s3[b"abc"] = 1
    with pytest.raises(RecordTypeError, match="truncation"):
        s3[b"abcd"] = 0
    assert [bytes(k) for k in s3] == [b"abc", b"b"]
    for m in (i4, f4, s3):
        m._check()


def test_upsert_spec_errors(pm: mmm.PageManager, om: OrderedMap) -> None:
    """Scalar value dtypes, unknown ops/fields and missing columns raise RecordTypeError."""
    scalar = OrderedMap.create(pm, "s", key="<i8", value="<f8")
    with pytest.raises(RecordTypeError, match="structured"):
        scalar.upsert(np.array([1]), {"x": np.array([1.0])}, {"v": "sum"})
    k = np.array([1, 2])
    with pytest.raises(RecordTypeError, match="unknown op"):
        om.upsert(k, {"ts": k}, {"lo": ("median", "ts")})
    with pytest.raises(RecordTypeError, match="zz"):
        om.upsert(k, {"ts": k}, {"zz": "count"})
    with pytest.raises(RecordTypeError, match="missing"):
        om.upsert(k, {"ts": k}, {"s": ("sum", "x")})
    with pytest.raises(RecordTypeError, match="shape"):
        om.upsert(k, {"x": np.arange(3)}, {"s": ("sum", "x")})
    with pytest.raises(RecordTypeError, match="combine spec"):
        om.upsert(k, {"x": k})
    om._check()
    assert om.keys().tolist() == list(range(0, 20, 2))


def test_upsert_count_only_needs_no_values(om: OrderedMap) -> None:
    """A count-only spec reads no input columns; other fields stay zero on insert."""
    om.upsert(np.array([1, 1, 2, 5, 5, 5]), None, {"n": "count"})
    assert om[1].tolist() == (2, 0, 0, 0.0) and om[5]["n"] == 3 and om[2]["n"] == 1
    om._check()


def test_range_bounds_and_inclusive(om: OrderedMap) -> None:
    """All four inclusive combinations and open ends select the right keys."""
    assert om.range(4, 10)[0].tolist() == [4, 6, 8]
    assert om.range(4, 10, inclusive=(False, True))[0].tolist() == [6, 8, 10]
    assert om.range(5, 9, inclusive=(True, True))[0].tolist() == [6, 8]
    assert om.range(None, 3)[0].tolist() == [0, 2]
    assert om.range(15)[0].tolist() == [16, 18]
    assert om.range(10, 4)[0].tolist() == []
    with pytest.raises(ValueError, match="inclusive"):
        om.range(1, 2, inclusive=True)  # type: ignore[arg-type]


def test_iteration_detects_mutation(om: OrderedMap) -> None:
    """Mutating the map while iterating raises RuntimeError."""
    it = iter(om)
    next(it)
    om[100] = (0, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="changed during iteration"):
        list(it)


def test_pool_exhaustion_during_split_leaves_map_unchanged() -> None:
    """A split or copy-on-write clone that finds no free frame raises and changes nothing."""
    pm = mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=8 * PAGE_BYTES)
    m = OrderedMap.create(pm, "om", key="<i8", value="<i8", page_slots=4)
    n = 0
    with pytest.raises(PoolExhaustedError):
        while True:
            m.put(np.arange(n, n + 4), np.arange(n, n + 4))
            n += 4
    m._check()
    assert m.keys().tolist() == list(range(n))
    # copy-on-write: a snapshot pins every page; the next write needs a clone and fails
    snap = pm.chkpt()
    free = pm.pool.free_frames
    filler = pm.allocate(pm.recover("om"), free, mmm.Layout.RAW) if free else None
    with pytest.raises(PoolExhaustedError):
        m.put(np.array([0]), np.array([-1]))
    with pytest.raises(PoolExhaustedError):
        m.delete(np.array([0, 1]))
    if filler is not None:
        pm.release(pm.recover("om"), filler)
    m._check()
    assert m[0] == 0 and len(m) == n
    snap.release()


def test_large_batches_with_default_page_size() -> None:
    """64 KiB pages (thousands of slots): batch ops agree with numpy set operations."""
    rng = np.random.default_rng(7)
    pm = mmm.PageManager(capacity_bytes=64 << 20)
    m = OrderedMap.create(pm, "big", key="<u8", value=[("v", "<i8")])
    assert m.S > 1000
    keys = rng.integers(0, 1 << 40, 200_000, dtype=np.uint64)
    vals = np.zeros(len(keys), [("v", "<i8")])
    vals["v"] = np.arange(len(keys))
    m.put(keys, vals)
    u, first_rev = np.unique(keys[::-1], return_index=True)
    want_v = (len(keys) - 1 - first_rev)
    m._check()
    k, v = m.items()
    assert np.array_equal(k, u) and np.array_equal(v["v"], want_v)
    probe = np.concatenate([keys[:5000], rng.integers(0, 1 << 40, 5000, dtype=np.uint64)])
    found, _ = m.get(probe)
    assert np.array_equal(found, np.isin(probe, u))
    gone = m.delete(u[::3])
    assert gone.all()
    m._check()
    lo, hi = int(u[1000]), int(u[50_000])
    rk, _ = m.pop_range(lo, hi)
    left = np.setdiff1d(u, u[::3])
    assert np.array_equal(rk, left[(left >= lo) & (left < hi)])
    m._check()
    assert len(m) == len(left) - len(rk)


def test_append_workload_fills_leaves(pm: mmm.PageManager) -> None:
    """Keys appended in increasing order pack leaves full (window state); eviction frees them."""
    m = OrderedMap.create(pm, "w", key="<i8", value="<i8", page_slots=5)
    for start in range(0, 100, 7):
        m.put(np.arange(start, start + 7), np.zeros(7, "<i8"))
    m._check()
    assert list(m._counts[:-1]) == [5] * (len(m._counts) - 1)
    before = m.page_count
    m.pop_range(None, 90)
    m._check()
    assert m.keys().tolist() == list(range(90, 105)) and m.page_count < before


def test_snapshot_copy_in_background_thread_while_mutating() -> None:
    """A thread copies frozen pages and marks them persisted while the operator writes;
    the copied pages rebuild the snapshot state, the live map the current one."""
    rng = np.random.default_rng(3)
    pm = mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=8 << 20)
    m = OrderedMap.create(pm, "om", key="<i8", value=VALUE, page_slots=6)
    spec = {"n": "count", "lo": ("min", "ts"), "hi": ("max", "ts"), "s": ("sum", "x")}
    k = rng.integers(0, 5000, 20_000)
    m.upsert(k, {"ts": k, "x": k}, spec)
    frozen_k, frozen_v = m.items()
    snap = pm.chkpt()
    out = np.empty((len(snap), PAGE_BYTES), dtype=np.uint8)

    def writer() -> None:
        for lo in range(0, len(snap), 16):
            idx = np.arange(lo, min(lo + 16, len(snap)))
            snap.copy_pages(idx, out=out[lo:lo + len(idx)])
            snap.mark_persisted(idx)

    t = threading.Thread(target=writer)
    t.start()
    for _ in range(30):
        b = rng.integers(0, 6000, 500)
        m.upsert(b, {"ts": b, "x": b}, spec)
        m.delete(rng.integers(0, 6000, 200))
        m.pop_range(int(rng.integers(0, 6000)), int(rng.integers(0, 6000)))
    t.join()
    assert snap.persisted.all() and snap.state is SnapshotState.ACTIVE
    snap.complete()
    assert snap.state is SnapshotState.COMPLETED
    m._check()
    live = m.items()
    pm2 = mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=8 << 20)
    ld = pm2.begin_load()
    ld.add(out)
    ld.finish()
    m2 = OrderedMap.create(pm2, "om", key="<i8", value=VALUE)
    m2._check()
    assert np.array_equal(m2.items()[0], frozen_k) and np.array_equal(m2.items()[1], frozen_v)
    assert np.array_equal(m.items()[0], live[0])
    assert pm.stats()["orphan_frames"] == 0


def test_file_backed_map_reattached_by_second_process(tmp_path: Any) -> None:
    """A second process attaching the pool file sees the same ordered contents."""
    path = str(tmp_path / "pool.bin")
    pm = mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=CAPACITY, path=path)
    m = OrderedMap.create(pm, "om", key="<i4", value="<i8", page_slots=5)
    m.put(np.arange(100, 0, -3, dtype="<i4"), np.arange(34))
    m.delete(np.arange(0, 100, 7))
    pm.flush()
    want = ",".join(map(str, m.keys().tolist()))
    code = ("import mmm; from mmm.structures.ordered_map import OrderedMap as O;"
            f"pm = mmm.PageManager.attach({path!r}, page_bytes={PAGE_BYTES});"
            "m = O.create(pm, 'om', key='<i4', value='<i8'); m._check();"
            "print(','.join(map(str, m.keys().tolist())))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(mmm.__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == want


def test_docstring_examples_run() -> None:
    """The module's doctest examples pass."""
    import doctest

    import mmm.structures.ordered_map as module
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
