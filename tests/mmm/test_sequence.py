"""Tests of `PagedList` and `PagedDeque`: stateful oracles (list, deque), snapshots, errors."""
from __future__ import annotations

import collections
import copy
import gc
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import mmm
from mmm.page import HEADER_BYTES, Layout
from mmm.structures.sequence import PagedDeque, PagedList

PAGE_BYTES = 4096
CAPACITY_BYTES = 4 << 20
NAME = "seq"
REC = np.dtype([("ts", "<i8"), ("key", "<u4"), ("v", "<f8")])
SCALAR = np.dtype("<i8")

keys = st.integers(0, 2**32 - 1)
vals = st.floats(allow_nan=False, width=64)
ints = st.integers(-2**40, 2**40)


def as_py(x: Any) -> Any:
    """A numpy record or scalar as a plain Python value (tuple or number)."""
    return x.item()


def to_list(arr: np.ndarray) -> list[Any]:
    return arr.tolist()


def new_pm() -> mmm.PageManager:
    return mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=CAPACITY_BYTES)


class SequenceMachine(RuleBasedStateMachine):
    """Base oracle machine; subclasses fix the structure class, dtype and oracle type."""

    CLS: Any = PagedList
    DTYPE: np.dtype[Any] = SCALAR
    ORACLE: Any = list
    SORTED = False  # keep the records nondecreasing in ts, so evict_before applies

    def __init__(self) -> None:
        super().__init__()
        self.pm: mmm.PageManager | None = None
        self.paged: Any = None
        self.model: Any = self.ORACLE()
        self.snap: mmm.Snapshot | None = None
        self.frozen: list[Any] = []
        self.saved: dict[int, np.ndarray] = {}
        self.hi = 0  # next ts at the back (SORTED), only grows
        self.lo = 0  # next ts at the front (SORTED), only shrinks

    # -- record generation -------------------------------------------------------------------
    def payload(self) -> st.SearchStrategy[tuple[Any, ...]]:
        if self.DTYPE.fields is None:
            return st.tuples(ints, st.integers(0, 3))
        return st.tuples(ints, st.integers(0, 3), keys, vals)

    def payloads(self, n_max: int = 12, n_min: int = 0) -> st.SearchStrategy[list[Any]]:
        return st.lists(self.payload(), min_size=n_min, max_size=max(n_max, n_min))

    def make(self, p: tuple[Any, ...], side: str, ts: int | None = None) -> Any:
        """A model record from a drawn payload; in SORTED machines ts comes from the counters."""
        if self.SORTED and ts is None:
            if side == "right":
                self.hi += p[1]
                ts = self.hi
            else:
                self.lo -= p[1]
                ts = self.lo
        if ts is None:
            ts = p[0]
        return ts if self.DTYPE.fields is None else (ts, p[2], p[3])

    def ts_of(self, rec: Any) -> int:
        return rec if self.DTYPE.fields is None else rec[0]

    def with_ts(self, rec: Any, ts: int) -> Any:
        return ts if self.DTYPE.fields is None else (ts,) + tuple(rec[1:])

    def encode(self, recs: list[Any], fmt: str) -> Any:
        """Records in one of the accepted input forms."""
        if fmt == "list":
            return list(recs)
        arr = np.array(recs, dtype=self.DTYPE)
        if fmt == "reordered" and self.DTYPE.fields is not None:
            other = np.dtype([("v", "<f8"), ("ts", "<i8"), ("key", "<u4")])
            out = np.empty(len(arr), other)
            for f in other.names:
                out[f] = arr[f]
            return out
        return arr

    fmts = st.sampled_from(["list", "array", "reordered"])

    # -- set-up --------------------------------------------------------------------------------
    @initialize(slots=st.integers(2, 5))
    def setup(self, slots: int) -> None:
        self.pm = new_pm()
        self.paged = self.CLS.create(self.pm, NAME, self.DTYPE, page_slots=slots)
        self.slots = slots

    # -- growing -------------------------------------------------------------------------------
    @rule(data=st.data(), fmt=fmts)
    def extend(self, data: st.DataObject, fmt: str) -> None:
        recs = [self.make(p, "right") for p in data.draw(self.payloads())]
        self.paged.extend(self.encode(recs, fmt))
        self.model.extend(recs)

    @rule(data=st.data(), fmt=fmts)
    def extendleft(self, data: st.DataObject, fmt: str) -> None:
        recs = [self.make(p, "left") for p in data.draw(self.payloads())]
        self.paged.extendleft(self.encode(recs, fmt))
        if isinstance(self.model, list):
            self.model[:0] = recs[::-1]
        else:
            self.model.extendleft(recs)

    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        rec = self.make(data.draw(self.payload()), "right")
        self.paged.append(rec)
        self.model.append(rec)

    @rule(data=st.data())
    def appendleft(self, data: st.DataObject) -> None:
        rec = self.make(data.draw(self.payload()), "left")
        if self.DTYPE.fields is not None and data.draw(st.booleans()):
            rec_in: Any = np.array([rec], self.DTYPE)[0]  # a numpy record
        else:
            rec_in = rec
        self.paged.appendleft(rec_in)
        if isinstance(self.model, list):
            self.model.insert(0, rec)
        else:
            self.model.appendleft(rec)

    @rule(data=st.data(), i=st.integers(-30, 30))
    def insert(self, data: st.DataObject, i: int) -> None:
        p = data.draw(self.payload())
        ts = None
        if self.SORTED:
            n = len(self.model)
            j = min(max(i + n if i < 0 else i, 0), n)
            ts = self.ts_of(self.model[j - 1]) if j > 0 else (
                self.ts_of(self.model[0]) if n else self.hi)
        rec = self.make(p, "mid", ts)
        self.paged.insert(i, rec)
        self.model.insert(i, rec)

    # -- shrinking -------------------------------------------------------------------------------
    @precondition(lambda self: self.model)
    @rule()
    def pop1(self) -> None:
        assert as_py(self.paged.pop()) == self.model.pop()

    @precondition(lambda self: self.model)
    @rule()
    def popleft1(self) -> None:
        want = self.model.pop(0) if isinstance(self.model, list) else self.model.popleft()
        assert as_py(self.paged.popleft()) == want

    # -- the per-record path (Python values in and out, end-page cache) ----------------------------
    def record_op(self, op: str, data: st.DataObject) -> None:
        """One per-record operation, checked against the oracle."""
        m = self.model
        left = (lambda: m.pop(0)) if isinstance(m, list) else m.popleft
        if op in ("append", "appendleft"):
            rec = self.make(data.draw(self.payload()), "right" if op == "append" else "left")
            getattr(self.paged, op)(rec)
            m.append(rec) if op == "append" else m.insert(0, rec) if isinstance(m, list) \
                else m.appendleft(rec)
        elif op in ("pop_item", "popleft_item", "item0", "item-1") and not m:
            with pytest.raises(IndexError, match=NAME):
                getattr(self.paged, op)() if op.startswith("pop") else \
                    self.paged.item(int(op[4:]))
        elif op == "pop_item":
            assert self.paged.pop_item() == m.pop()
        elif op == "popleft_item":
            assert self.paged.popleft_item() == left()
        elif op in ("item0", "item-1"):
            assert self.paged.item(int(op[4:])) == m[int(op[4:])]
            assert as_py(self.paged[int(op[4:])]) == m[int(op[4:])]
        elif op == "popleft_before" and self.SORTED:
            bound = data.draw(st.integers(self.lo - 2, self.hi + 2))
            want = []
            while m and self.ts_of(m[0]) < bound:
                want.append(left())
            got = self.paged.popleft_before(bound, None if self.DTYPE.fields is None else "ts")
            assert got == want
        elif op == "snapshot" and self.snap is None:
            self.snapshot()  # taken with the end-page cache alive: later writes must clone
        assert len(self.paged) == len(m) and bool(self.paged) == bool(m)

    record_ops = st.sampled_from(["append", "appendleft", "pop_item", "popleft_item", "item0",
                                  "item-1", "popleft_before", "snapshot"])

    @rule(data=st.data(), op=record_ops)
    def record1(self, data: st.DataObject, op: str) -> None:
        self.record_op(op, data)

    @rule(data=st.data(), ops=st.lists(record_ops, min_size=2, max_size=25))
    def record_run(self, data: st.DataObject, ops: list[str]) -> None:
        """A run of per-record operations with no other operation in between (the end-page
        cache stays alive), maybe with a snapshot in the middle whose pages must keep the
        state of that moment (checked when the snapshot is loaded or rolled back to)."""
        for op in ops:
            self.record_op(op, data)

    @rule(data=st.data())
    def pop_n(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, len(self.model)))
        got = to_list(self.paged.pop(n))
        want = [self.model.pop() for _ in range(n)][::-1]
        assert got == want

    @rule(data=st.data())
    def popleft_n(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, len(self.model)))
        got = to_list(self.paged.popleft(n))
        want = [self.model.popleft() if not isinstance(self.model, list) else self.model.pop(0)
                for _ in range(n)]
        assert got == want

    @rule(n=st.integers(0, 15))
    def evict(self, n: int) -> None:
        k = min(n, len(self.model))
        assert self.paged.evict(n) == k
        for _ in range(k):
            self.model.pop(0) if isinstance(self.model, list) else self.model.popleft()

    @precondition(lambda self: self.SORTED)
    @rule(data=st.data())
    def evict_before(self, data: st.DataObject) -> None:
        bound = data.draw(st.integers(self.lo - 2, self.hi + 2))
        field = None if self.DTYPE.fields is None else "ts"
        k = 0
        while k < len(self.model) and self.ts_of(self.model[k]) < bound:
            k += 1
        assert self.paged.evict_before(bound, field) == k
        for _ in range(k):
            self.model.popleft()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delitem(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(-len(self.model), len(self.model) - 1))
        del self.paged[i]
        del self.model[i]

    @rule(a=st.integers(-20, 20), b=st.integers(-20, 20) | st.none())
    def delslice(self, a: int, b: int | None) -> None:
        del self.paged[a:b]
        m = list(self.model)
        del m[a:b]
        self.model = self.ORACLE(m)

    @rule()
    def clear(self) -> None:
        self.paged.clear()
        self.model.clear()

    # -- reading and writing in place --------------------------------------------------------------
    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def getitem(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(-len(self.model), len(self.model) - 1))
        assert as_py(self.paged[i]) == self.model[i]

    @rule(a=st.integers(-20, 20) | st.none(), b=st.integers(-20, 20) | st.none(),
          step=st.sampled_from([None, 1, 2, 3, -1, -2]))
    def getslice(self, a: int | None, b: int | None, step: int | None) -> None:
        assert to_list(self.paged[a:b:step]) == list(self.model)[a:b:step]

    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        n = len(self.model)
        idx = data.draw(st.lists(st.integers(-n, n - 1), max_size=8)) if n else []
        got = to_list(self.paged.take(np.array(idx, dtype=np.int64)))
        assert got == [self.model[i] for i in idx]

    @rule(n=st.integers(0, 20))
    def head_tail(self, n: int) -> None:
        m = list(self.model)
        assert to_list(self.paged.head(n)) == m[:n]
        assert to_list(self.paged.tail(n)) == (m[-n:] if n else [])

    @rule()
    def iterate(self) -> None:
        assert [as_py(r) for r in self.paged] == list(self.model)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def setitem(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(-len(self.model), len(self.model) - 1))
        rec = self.make(data.draw(self.payload()), "mid",
                        self.ts_of(self.model[i]) if self.SORTED else None)
        self.paged[i] = rec
        self.model[i] = rec

    @rule(data=st.data(), a=st.integers(-20, 20), fmt=fmts)
    def setslice(self, data: st.DataObject, a: int, fmt: str) -> None:
        m = list(self.model)
        lo, hi, _ = slice(a, None).indices(len(m))
        b = data.draw(st.integers(lo, hi))
        old = m[lo:b]
        recs = [self.make(p, "mid", self.ts_of(o) if self.SORTED else None)
                for p, o in zip(data.draw(self.payloads(0, len(old))),
                                old)]
        self.paged[lo:b] = self.encode(recs, fmt)
        m[lo:b] = recs
        self.model = self.ORACLE(m)

    # -- errors leave the state unchanged ---------------------------------------------------------------
    @rule(bad=st.sampled_from(["dtype", "shape", "fields", "one"]))
    def bad_records(self, bad: str) -> None:
        before = len(self.model)
        with pytest.raises(mmm.RecordTypeError, match=NAME):
            if bad == "dtype":
                self.paged.extend(np.array([1.5, 2.5]) if self.DTYPE.fields is None
                                  else np.array([1, 2]))
            elif bad == "shape":
                self.paged.extend(np.zeros((2, 2), dtype=self.DTYPE))
            elif bad == "fields":
                self.paged.extendleft(np.zeros(3, [("a", "<i8")]))
            else:
                self.paged.append([1, 2] if self.DTYPE.fields is None else (1, 2))
        assert len(self.paged) == before

    # -- reopening -------------------------------------------------------------------------------------
    @rule()
    def reopen_same(self) -> None:
        assert self.CLS.create(self.pm, NAME, self.DTYPE) is self.paged

    @rule()
    def reopen_fresh(self) -> None:
        """Drop the object; a new one rebuilds its index from the pages."""
        self.paged = None
        if self.pm._lookup_object(NAME) is not None:
            gc.collect()
        self.paged = self.CLS.create(self.pm, NAME, self.DTYPE)

    # -- snapshots ---------------------------------------------------------------------------------------
    @precondition(lambda self: self.snap is None)
    @rule()
    def snapshot(self) -> None:
        self.snap = self.pm.chkpt()
        self.frozen = copy.deepcopy(list(self.model))
        self.saved = {}

    @precondition(lambda self: self.snap is not None and not self.saved)
    @rule()
    def rollback(self) -> None:
        self.pm.rollback(self.snap)
        self.snap = None
        self.model = self.ORACLE(self.frozen)
        assert self.CLS.create(self.pm, NAME, self.DTYPE) is self.paged

    @precondition(lambda self: self.snap is not None)
    @rule(data=st.data())
    def persist_some(self, data: st.DataObject) -> None:
        """Copy some frozen pages (as an I/O thread would) and mark them persisted."""
        snap = self.snap
        todo = [i for i in range(len(snap)) if i not in self.saved]
        pick = data.draw(st.lists(st.sampled_from(todo), unique=True, min_size=1)) if todo else []
        if pick:
            for i, page in zip(pick, snap.copy_pages(pick)):
                self.saved[i] = page
            snap.mark_persisted(pick)
        if snap.state is mmm.SnapshotState.COMPLETED:
            self.verify_load(self.saved)
            self.snap = None
        else:
            with pytest.raises(mmm.SnapshotStateError):
                self.pm.rollback(snap)

    @precondition(lambda self: self.snap is not None)
    @rule()
    def complete(self) -> None:
        snap = self.snap
        self.verify_load(self.all_pages())
        snap.complete()
        self.snap = None

    @precondition(lambda self: self.snap is not None)
    @rule()
    def check_snapshot_load(self) -> None:
        self.verify_load(self.all_pages())

    def all_pages(self) -> dict[int, np.ndarray]:
        """Saved pages plus copies of the frozen pages not yet persisted."""
        snap = self.snap
        rest = [i for i in range(len(snap)) if i not in self.saved]
        pages = dict(self.saved)
        if rest:
            pages.update(zip(rest, snap.copy_pages(rest)))
        return pages

    def verify_load(self, pages: dict[int, np.ndarray]) -> None:
        """Frozen pages loaded into a fresh manager rebuild the snapshot-time state."""
        pm2 = new_pm()
        loader = pm2.begin_load()
        order = sorted(pages, reverse=True)
        loader.add(np.stack([pages[i] for i in order]))
        loader.finish()
        other = self.CLS.create(pm2, NAME, self.DTYPE)
        other._check()
        assert to_list(other.to_numpy()) == self.frozen
        assert other.page_slots == self.slots

    # -- invariants --------------------------------------------------------------------------------------
    @invariant()
    def agrees_with_oracle(self) -> None:
        if self.paged is None:
            return
        self.paged._check()
        assert len(self.paged) == len(self.model)
        assert to_list(self.paged.to_numpy()) == list(self.model)


class ListScalarMachine(SequenceMachine):
    CLS, DTYPE, ORACLE = PagedList, SCALAR, list


class ListRecordMachine(SequenceMachine):
    CLS, DTYPE, ORACLE = PagedList, REC, list


class DequeScalarMachine(SequenceMachine):
    CLS, DTYPE, ORACLE, SORTED = PagedDeque, SCALAR, collections.deque, True


class DequeRecordMachine(SequenceMachine):
    CLS, DTYPE, ORACLE, SORTED = PagedDeque, REC, collections.deque, True


TestPagedListScalar = ListScalarMachine.TestCase
TestPagedListRecords = ListRecordMachine.TestCase
TestPagedDequeScalar = DequeScalarMachine.TestCase
TestPagedDequeRecords = DequeRecordMachine.TestCase


# -- example-based tests ------------------------------------------------------------------------------
@pytest.fixture
def pm() -> mmm.PageManager:
    return new_pm()


def test_object_fields_refused_with_schema_error(pm: mmm.PageManager) -> None:
    """Object and unicode fields are refused."""
    with pytest.raises(mmm.SchemaError):
        PagedList.create(pm, "o", [("a", "O")])
    with pytest.raises(mmm.SchemaError):
        PagedDeque.create(pm, "u", "U4")
    assert pm.names() == []


def test_reopen_with_other_schema_raises_mismatch(pm: mmm.PageManager) -> None:
    """Reopening by name with another dtype, kind or page_slots raises SchemaMismatchError."""
    xs = PagedList.create(pm, "xs", "<i8", page_slots=3)
    xs.extend([1, 2, 3, 4])
    with pytest.raises(mmm.SchemaMismatchError, match="xs"):
        PagedList.create(pm, "xs", "<i4")
    with pytest.raises(mmm.SchemaMismatchError):
        PagedDeque.create(pm, "xs", "<i8")
    with pytest.raises(mmm.SchemaMismatchError, match="page_slots"):
        PagedList.create(pm, "xs", "<i8", page_slots=4)
    del xs
    gc.collect()
    with pytest.raises(mmm.SchemaMismatchError):
        PagedList.create(pm, "xs", "<u8")
    with pytest.raises(mmm.SchemaMismatchError):
        PagedDeque.create(pm, "xs", "<i8")
    with pytest.raises(mmm.SchemaMismatchError, match="page_slots"):
        PagedList.create(pm, "xs", "<i8", page_slots=5)
    again = PagedList.create(pm, "xs", "<i8")
    assert again.to_numpy().tolist() == [1, 2, 3, 4] and again.page_slots == 3


def test_bad_page_slots_raise_value_error(pm: mmm.PageManager) -> None:
    """page_slots must be an integer between 2 and what fits a page."""
    for bad in (1, 0, 10_000, 2.5, True):
        with pytest.raises(ValueError, match="page_slots"):
            PagedList.create(pm, "xs", "<i8", page_slots=bad)
    with pytest.raises(mmm.SchemaError):
        PagedList.create(pm, "big", ("S", 3000))


@pytest.mark.parametrize("cls", [PagedList, PagedDeque])
def test_wrong_records_raise_record_type_error_and_change_nothing(
        pm: mmm.PageManager, cls: Any) -> None:
    """Wrong dtypes and shapes raise RecordTypeError naming the structure; nothing changes."""
    s = cls.create(pm, "win", REC, page_slots=4)
    s.extend(np.array([(1, 2, 3.0), (2, 3, 4.0)], REC))
    pages = s.page_count
    bad_inputs = [np.arange(3), np.zeros(2, [("ts", "<i8")]), [(1, 2)], [(1, 2, 3.0, 4)],
                  np.zeros((2, 2), REC), "abc", [("x", 1, 1.0)]]
    for bad in bad_inputs:
        for op in (s.extend, s.extendleft):
            with pytest.raises(mmm.RecordTypeError, match="win"):
                op(bad)
    for bad in (5, [(1, 2, 3.0)], (1, 2)):
        with pytest.raises(mmm.RecordTypeError, match="win"):
            s.append(bad)
        with pytest.raises(mmm.RecordTypeError):
            s[0] = bad
    with pytest.raises(mmm.RecordTypeError, match="slice"):
        s[0:2] = np.zeros(3, REC)
    assert s.to_numpy().tolist() == [(1, 2, 3.0), (2, 3, 4.0)] and s.page_count == pages
    s._check()


def test_scalar_schema_casts_safely_only(pm: mmm.PageManager) -> None:
    """Scalar schemas accept safe casts and refuse float->int and out-of-range values."""
    s = PagedList.create(pm, "u", "<u2", page_slots=2)
    s.extend(np.array([1, 2, 3], np.uint8))
    s.extend([4, 5])
    for bad in (np.array([1.5]), [70000], [-1], np.zeros(2, [("a", "<u2")])):
        with pytest.raises(mmm.RecordTypeError, match="'u'"):
            s.extend(bad)
    assert s.to_numpy().tolist() == [1, 2, 3, 4, 5]
    s._check()


def test_index_errors_have_messages(pm: mmm.PageManager) -> None:
    """Out-of-range indices and pops from an empty sequence raise IndexError."""
    d = PagedDeque.create(pm, "d", "<i8", page_slots=2)
    with pytest.raises(IndexError, match="empty"):
        d.pop()
    with pytest.raises(IndexError, match="empty"):
        d.popleft()
    d.extend([1, 2, 3])
    for op in (lambda: d[3], lambda: d[-4], lambda: d.__setitem__(5, 1),
               lambda: d.__delitem__(-9), lambda: d.popleft(4), lambda: d.pop(4),
               lambda: d.take([0, 3])):
        with pytest.raises(IndexError, match="'d'"):
            op()
    with pytest.raises(ValueError):
        d.pop(-1)
    with pytest.raises(ValueError):
        d.evict(-1)
    with pytest.raises(TypeError):
        d["x"]
    assert d.to_numpy().tolist() == [1, 2, 3]
    d._check()


def test_evict_before_field_errors(pm: mmm.PageManager) -> None:
    """evict_before needs an existing scalar field for structured records, none for scalars."""
    w = PagedDeque.create(pm, "w", REC)
    with pytest.raises(mmm.RecordTypeError):
        w.evict_before(3)
    with pytest.raises(mmm.RecordTypeError):
        w.evict_before(3, "nope")
    s = PagedDeque.create(pm, "s", "<i8")
    with pytest.raises(mmm.RecordTypeError):
        s.evict_before(3, "ts")
    assert w.evict_before(3, "ts") == 0 and s.evict_before(3) == 0


def test_evict_before_large_window_uses_page_bounds(pm: mmm.PageManager) -> None:
    """A window buffer over many full pages evicts exactly the records below the bound."""
    w = PagedDeque.create(pm, "w", REC)
    ts = np.repeat(np.arange(2000), 3)
    recs = np.zeros(len(ts), REC)
    recs["ts"] = ts
    recs["key"] = np.arange(len(ts)) % 7
    w.extend(recs)
    assert w.evict_before(1000, "ts") == 3000
    assert w.evict_before(1000, "ts") == 0
    assert w.evict_before(1500, "ts") == 1500
    assert np.array_equal(w.to_numpy(), recs[4500:])
    w._check()


def test_pool_exhaustion_leaves_state_unchanged() -> None:
    """Extending beyond the pool raises PoolExhaustedError without changing the sequence."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=8 * 4096)
    s = PagedList.create(pm, "s", "<i8", page_slots=4)
    s.extend(np.arange(20))  # 5 pages + super page
    with pytest.raises(mmm.PoolExhaustedError):
        s.extend(np.arange(20))
    assert s.to_numpy().tolist() == list(range(20))
    s._check()
    snap = pm.chkpt()  # every page pinned: each write needs a clone
    s.extend([20])     # clones the tail page (7 of 8 frames used)
    s.extend([21, 22, 23])  # one new page: pool full
    with pytest.raises(mmm.PoolExhaustedError):
        s.insert(1, 99)  # would clone the head page
    with pytest.raises(mmm.PoolExhaustedError):
        del s[5]
    assert s.to_numpy().tolist() == list(range(24))
    s._check()
    snap.release()
    s.insert(1, 99)
    s._check()


def test_snapshot_pages_are_never_written(pm: mmm.PageManager) -> None:
    """Writes after a snapshot clone its pages; the frozen bytes stay identical."""
    s = PagedList.create(pm, "s", REC, page_slots=3)
    s.extend(np.zeros(10, REC))
    snap = pm.chkpt()
    before = snap.copy_pages(np.arange(len(snap)))
    s[4] = (1, 1, 1.0)
    s.insert(2, (2, 2, 2.0))
    del s[0]
    s.extendleft([(3, 3, 3.0)])
    s.popleft(4)
    s.evict(1)
    s.clear()
    assert np.array_equal(snap.copy_pages(np.arange(len(snap))), before)
    assert pm.stats()["pages_cloned"] > 0
    s._check()
    snap.release()
    s._check()


def test_append_writes_only_the_tail_page_under_a_snapshot(pm: mmm.PageManager) -> None:
    """Appending and popping at the ends clone at most one page per snapshot."""
    d = PagedDeque.create(pm, "d", "<i8", page_slots=8)
    d.extend(np.arange(36))
    snap = pm.chkpt()
    for i in range(3):
        d.append(100 + i)
    assert pm.stats_pages_cloned == 1
    d.popleft(3)
    assert pm.stats_pages_cloned == 2
    assert snap.n_changed == len(snap)
    snap.complete()
    snap2 = pm.chkpt()
    assert snap2.n_changed == 2  # the two pages written since the completed snapshot
    snap2.release()


def test_recreated_after_load_and_rollback(pm: mmm.PageManager) -> None:
    """create-by-name returns the contents after rollback and after loading the pages."""
    d = PagedDeque.create(pm, "d", REC, page_slots=4)
    d.extend(np.array([(i, i, i / 2) for i in range(11)], REC))
    snap = pm.chkpt()
    pages = snap.copy_pages(np.arange(len(snap)))
    d.popleft(7)
    d.append((99, 9, 9.0))
    pm.rollback(snap)
    assert len(d) == 11 and d[10].item() == (10, 10, 5.0)
    d.destroy()
    with pytest.raises(mmm.StructureNotFoundError):
        len(d)
    loader = pm.begin_load()
    loader.add(pages)
    loader.finish()
    again = PagedDeque.create(pm, "d", REC)
    assert again is not d and again.page_slots == 4
    assert [r[0] for r in again.to_numpy().tolist()] == list(range(11))
    again._check()


def test_reattach_file_backed_pool(tmp_path: Any) -> None:
    """A file-backed pool re-attached by a new manager shows the same sequence."""
    path = str(tmp_path / "pool")
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20, path=path)
    s = PagedList.create(pm, "s", "<i4", page_slots=5)
    s.extend(np.arange(23, dtype="<i4"))
    del s[3:9]
    pm.flush()
    pm2 = mmm.PageManager.attach(path, 4096)
    t = PagedList.create(pm2, "s", "<i4")
    assert t.to_numpy().tolist() == list(range(3)) + list(range(9, 23))
    t._check()


def test_empty_sequence_keeps_one_page_and_releases_the_rest(pm: mmm.PageManager) -> None:
    """Draining releases emptied pages but keeps one, reused on refill."""
    d = PagedDeque.create(pm, "d", "<i8", page_slots=4)
    assert d.page_count == 1  # just the super page
    d.extend(np.arange(17))
    assert d.page_count == 1 + 5
    d.popleft(17)
    assert d.page_count == 2 and len(d) == 0
    d._check()
    d.extendleft([1, 2])
    assert d.page_count == 2 and d.to_numpy().tolist() == [2, 1]
    d._check()


def test_middle_deletes_merge_pages(pm: mmm.PageManager) -> None:
    """Deleting from the middle merges neighbours whose records fit one page."""
    s = PagedList.create(pm, "s", "<i8", page_slots=8)
    s.extend(np.arange(64))
    for _ in range(40):
        del s[10]
    s._check()
    assert s.page_count - 1 <= -(-2 * len(s) // 8) + 1
    assert s.to_numpy().tolist() == list(range(10)) + list(range(50, 64))


def test_insert_splits_full_pages(pm: mmm.PageManager) -> None:
    """Inserting into full pages splits them; order is kept."""
    s = PagedList.create(pm, "s", "<i8", page_slots=4)
    s.extend(np.arange(8))
    model = list(range(8))
    for i, v in [(2, 100), (3, 101), (6, 102), (1, 103), (9, 104)]:
        s.insert(i, v)
        model.insert(i, v)
        s._check()
    assert s.to_numpy().tolist() == model


def test_broken_links_raise_page_format_error(pm: mmm.PageManager) -> None:
    """A rebuild from pages whose links do not form one chain raises PageFormatError."""
    s = PagedList.create(pm, "s", "<i8", page_slots=2)
    s.extend(np.arange(6))
    snap = pm.chkpt()
    pages = snap.copy_pages(np.arange(len(snap)))
    snap.release()
    hdr = pages[:, :HEADER_BYTES].view(mmm.page.HEADER_DTYPE)[:, 0]
    assert np.all(hdr["kind"][1:] == Layout.SEQUENCE)
    hdr["next"][2] = hdr["page_id"][2]  # a self loop
    loader = pm.begin_load()
    loader.add(pages)
    loader.finish()
    with pytest.raises(mmm.PageFormatError):
        PagedList.create(pm, "s", "<i8")


def test_failed_single_record_writes_leave_no_trace(pm: mmm.PageManager) -> None:
    """A record that numpy cannot convert raises RecordTypeError on every per-record path."""
    s = PagedDeque.create(pm, "s", REC, page_slots=4)
    s.extend(np.array([(1, 1, 1.0), (2, 2, 2.0)], REC))
    s.popleft()  # room at the front of the head page, and at the end
    for bad in ((1, -1, 2.0), (1, 2), ("x", 1, 1.0), ([1], 1, 1.0), [1, 2, 3.0]):
        for op in (s.append, s.appendleft, lambda r: s.insert(1, r),
                   lambda r: s.__setitem__(0, r)):
            with pytest.raises(mmm.RecordTypeError, match="'s'"):
                op(bad)
    s.append((3, 3, 3.0))
    s.appendleft((0, 0, 0.0))
    assert s.to_numpy().tolist() == [(0, 0, 0.0), (2, 2, 2.0), (3, 3, 3.0)]
    s._check()
    u = PagedList.create(pm, "u", "<u4", page_slots=3)
    u.extend([1, 2])
    for bad in (-1, 2**33, 1.5, "7", None):
        with pytest.raises(mmm.RecordTypeError, match="'u'"):
            u.append(bad)
        with pytest.raises(mmm.RecordTypeError, match="'u'"):
            u.appendleft(bad)
    assert u.to_numpy().tolist() == [1, 2]
    u._check()


def test_argument_type_errors(pm: mmm.PageManager) -> None:
    """Non-integer indices and counts raise TypeError; extended slices cannot be assigned."""
    s = PagedList.create(pm, "s", "<i8", page_slots=3)
    s.extend(np.arange(7))
    for op in (lambda: s[1.0], lambda: s.insert("1", 5), lambda: s.pop(1.5),
               lambda: s.evict(None), lambda: s.take([0.5]), lambda: s[True]):
        with pytest.raises(TypeError):
            op()
    with pytest.raises(ValueError, match="step"):
        s[::2] = np.arange(4)
    with pytest.raises(ValueError, match="step"):
        del s[::2]
    assert s[[0, -1]].tolist() == [0, 6] and s[np.array([2])].tolist() == [2]
    assert s.take([]).tolist() == [] and bool(s) and s.dtype == np.dtype("<i8")
    assert "len=7" in repr(s)
    s.destroy()
    assert "len=?" in repr(s)


def test_io_thread_persists_while_operator_mutates(pm: mmm.PageManager) -> None:
    """A background thread copies and persists frozen pages while the deque keeps changing."""
    import threading
    d = PagedDeque.create(pm, "w", REC, page_slots=16)
    recs = np.zeros(3000, REC)
    recs["ts"] = np.arange(3000)
    d.extend(recs[:2000])
    snap = pm.chkpt()
    frozen = d.to_numpy()
    copied: list[np.ndarray] = []

    def io() -> None:
        for lo in range(0, len(snap), 7):
            idx = np.arange(lo, min(lo + 7, len(snap)))
            copied.append(snap.copy_pages(idx))
            snap.mark_persisted(idx)

    t = threading.Thread(target=io)
    t.start()
    for i in range(2000, 3000, 10):
        d.extend(recs[i:i + 10])
        d.evict_before(i - 1500, "ts")
        d[5] = (5, 5, 5.0)
    t.join()
    snap.complete()
    d._check()
    assert np.array_equal(d.to_numpy()[6:], recs[1500 - 10 + 6:][:len(d) - 6])
    pm2 = new_pm()
    loader = pm2.begin_load()
    loader.add(np.concatenate(copied))
    loader.finish()
    again = PagedDeque.create(pm2, "w", REC)
    again._check()
    assert np.array_equal(again.to_numpy(), frozen)
