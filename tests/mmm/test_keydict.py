"""Tests of `KeyDict`: unit tests, a stateful oracle, copy-on-write, pool exhaustion, restore."""
from __future__ import annotations

import gc
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import mmm
from ioservice import CheckpointManager
from mmm._kernels import keydict as K
from mmm.structures.keydict import KeyDict

PAGE_BYTES = 4096
RPP = (PAGE_BYTES - 64) // K.REC  # records a page
Key = "bytes | None"


def enc(keys: list[bytes | None], start: int = 0, dtype: str = "<i8"
        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys in Arrow layout; ``start`` garbage bytes before the first key."""
    body = b"".join(k or b"" for k in keys)
    data = np.frombuffer(b"\xee" * start + body + b"\xdd" * 3, np.uint8).copy()
    offs = np.zeros(len(keys) + 1, np.int64)
    offs[1:] = np.cumsum([len(k or b"") for k in keys])
    valid = np.array([k is not None for k in keys], bool)
    return data, (offs + start).astype(dtype), valid


def dec(data: np.ndarray, offs: np.ndarray, valid: np.ndarray) -> list[bytes | None]:
    return [bytes(data[offs[i]:offs[i + 1]]) if valid[i] else None for i in range(len(valid))]


def new_pm(capacity: int = 32 << 20) -> mmm.PageManager:
    return mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=capacity)


def state_of(kd: KeyDict) -> dict[bytes | None, int]:
    ids, data, offs, valid = kd.items()
    return dict(zip(dec(data, offs, valid), ids.tolist()))


@pytest.fixture
def pm() -> mmm.PageManager:
    return new_pm()


# -- basics -------------------------------------------------------------------------------------
def test_intern_first_appearance_order_and_exact_keys(pm: mmm.PageManager) -> None:
    kd = KeyDict.create(pm, "kd")
    keys: list[bytes | None] = [b"b", b"a", b"", b"b", b"ab", b"a\x00", b"a", b""]
    data, offs, _ = enc(keys)
    ids = kd.intern(data, offs)
    assert ids.tolist() == [0, 1, 2, 0, 3, 4, 1, 2]
    assert ids.dtype == np.int64
    assert kd.lookup(data, offs).tolist() == ids.tolist()
    assert len(kd) == 5
    d, o, v = kd.keys(np.array([4, 0, 2, 3]))
    assert o.dtype == np.int64 and o[0] == 0 and v.all()
    assert dec(d, o, v) == [b"a\x00", b"b", b"", b"ab"]
    kd._check()


def test_lookup_changes_nothing(pm: mmm.PageManager) -> None:
    kd = KeyDict.create(pm, "kd")
    kd.intern(*enc([b"x", b"y"])[:2])
    before = pm.pool.frames.copy()
    data, offs, valid = enc([b"z", None, b"x", b"q" * 100])
    assert kd.lookup(data, offs, valid).tolist() == [-1, -1, 0, -1]
    assert np.array_equal(pm.pool.frames, before)
    assert len(kd) == 2


def test_null_key_is_one_key_of_its_own(pm: mmm.PageManager) -> None:
    kd = KeyDict.create(pm, "kd")
    data, offs, valid = enc([None, b"", None, b"n"])
    ids = kd.intern(data, offs, valid)
    assert ids.tolist() == [0, 1, 0, 2]
    # the null key's bytes are ignored: a null row with bytes is still the null key
    data2 = np.frombuffer(b"zzz", np.uint8)
    assert kd.intern(data2, np.array([0, 3]), np.array([False])).tolist() == [0]
    assert kd.intern(data2, np.array([0, 3])).tolist() == [3]
    d, o, v = kd.keys(np.array([0, 1]))
    assert v.tolist() == [False, True] and o.tolist() == [0, 0, 0]
    kd.remove(np.array([0]))
    assert kd.lookup(data, offs, valid).tolist() == [-1, 1, -1, 2]
    assert kd.intern(data, offs, valid).tolist() == [0, 1, 0, 2]  # the id is reused
    kd._check()


def test_arrow_buffers_zero_copy_with_offset(pm: mmm.PageManager) -> None:
    """An Arrow StringArray slice: int32 offsets not starting at 0, a validity bitmap."""
    kd = KeyDict.create(pm, "kd")
    words = ["pre", "alpha", None, "béta", "alpha", "a-long-string-of-thirty-bytes!", None, ""]
    arr = pa.array(words, pa.string()).slice(1)
    vbuf, obuf, dbuf = arr.buffers()
    offs = np.frombuffer(obuf, np.int32)[arr.offset:arr.offset + len(arr) + 1]
    data = np.frombuffer(dbuf, np.uint8)
    assert offs[0] != 0
    valid = np.unpackbits(np.frombuffer(vbuf, np.uint8), bitorder="little")[
        arr.offset:arr.offset + len(arr)].astype(bool)
    ids = kd.intern(data, offs, valid)
    assert ids.tolist() == [0, 1, 2, 0, 3, 1, 4]
    d, o, v = kd.keys(ids)
    want = [None if w is None else w.encode() for w in words[1:]]
    assert dec(d, o, v) == want
    # the Arrow data buffer itself (any bytes-like buffer) is accepted as data
    assert kd.lookup(dbuf, offs, valid).tolist() == ids.tolist()
    # the same keys in a fresh int64 layout find the same ids
    data2, offs2, valid2 = enc(want)
    assert kd.lookup(data2, offs2, valid2).tolist() == ids.tolist()


def test_long_keys_span_chunks_and_pages(pm: mmm.PageManager) -> None:
    """Keys of every length around the inline and chunk boundaries, and keys longer than
    a page, read back exactly; keys differing only in their last byte stay apart."""
    kd = KeyDict.create(pm, "kd")
    rng = np.random.default_rng(1)
    lens = list(range(0, 130)) + [K.INLINE * 7, 4000, 9000, 20000]
    keys: list[bytes | None] = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lens]
    twins = [k[:-1] + bytes([(k[-1] + 1) % 256]) for k in keys if k]
    allk = keys + twins
    data, offs, _ = enc(allk, start=5)
    ids = kd.intern(data, offs)
    assert ids.tolist() == list(range(len(allk)))
    assert dec(*kd.keys(ids)) == allk
    assert kd.lookup(data, offs).tolist() == ids.tolist()
    kd._check()
    kd.remove(ids[::3])
    kd._check()
    again = kd.intern(data, offs)
    assert dec(*kd.keys(again)) == allk
    kd._check()


def test_forced_hash_collisions_are_told_apart_by_bytes(pm: mmm.PageManager) -> None:
    for mask in (0, 0x3):
        kd = KeyDict.create(pm, f"weak{mask}", _hash_mask=mask)
        keys: list[bytes | None] = [b"k%d" % i for i in range(300)]
        keys += [b"L" * 40 + b"%d" % i for i in range(60)]
        data, offs, _ = enc(keys)
        ids = kd.intern(data, offs)
        assert len(set(ids.tolist())) == len(keys)
        hs = K.hash_keys(data, offs, np.uint64(mask))
        assert len(set(hs.tolist())) <= mask + 1  # the hook really collides
        assert kd.lookup(data, offs).tolist() == ids.tolist()
        kd.remove(ids[5:200])
        got = kd.lookup(data, offs)
        assert (got[5:200] == -1).all() and got[:5].tolist() == ids[:5].tolist()
        assert got[200:].tolist() == ids[200:].tolist()
        kd._check()
    # the mask is stored: a reopened dictionary (from pages) keeps colliding
    pm2 = new_pm()
    loader = pm2.begin_load()
    snap = pm.chkpt()
    loader.add(snap.copy_pages(np.arange(len(snap))))
    loader.finish()
    snap.release()
    kd2 = KeyDict.create(pm2, "weak0")
    assert kd2._mask == 0
    assert kd2.lookup(data, offs).tolist() == got.tolist()


def test_many_keys_grow_the_index(pm: mmm.PageManager) -> None:
    kd = KeyDict.create(pm, "kd")
    n = 30000
    keys: list[bytes | None] = [b"user-%07d" % i for i in range(n)]
    data, offs, _ = enc(keys)
    for a in range(0, n, 7000):  # several batches
        kd.intern(data, offs[a:min(a + 7000, n) + 1])
    assert len(kd._iseqs) > 100  # many index pages
    assert kd.lookup(data, offs).tolist() == list(range(n))
    kd._check()
    # removing most of them shrinks the index again
    kd.remove(np.arange(100, n))
    assert len(kd._iseqs) < 10
    assert kd.lookup(data, offs)[:100].tolist() == list(range(100))
    kd._check()


def test_removed_space_is_reused(pm: mmm.PageManager) -> None:
    """A churn of keys (long and short) keeps the pages in use bounded."""
    kd = KeyDict.create(pm, "kd")
    pages = []
    for r in range(8):
        keys: list[bytes | None] = [b"r%d-%d" % (r, i) * (1 + i % 9) for i in range(600)]
        ids = kd.intern(*enc(keys)[:2])
        kd.remove(ids)
        pages.append(kd.page_count)
    assert len(kd) == 0
    assert pages[-1] == pages[1]
    kd._check()


def test_freed_pages_go_back_to_the_pool_and_are_reused(pm: mmm.PageManager) -> None:
    kd = KeyDict.create(pm, "kd")
    keys: list[bytes | None] = [b"key-%d" % i * (1 + i % 12) for i in range(3000)]
    data, offs, _ = enc(keys)
    ids = kd.intern(data, offs)
    full = kd.memory()
    free0 = pm.pool.free_frames
    kd.remove(ids[1000:])  # the last 2000 ids: their record and chunk pages go back
    part = kd.memory()
    assert pm.pool.free_frames - free0 >= (full["records"] + full["chunks"] - part["records"]
                                           - part["chunks"]) // PAGE_BYTES
    assert part["records"] == -(-1000 // RPP) * PAGE_BYTES
    assert 0 < part["chunks"] < full["chunks"] / 2
    kd._check()
    snap = pm.chkpt()  # it keeps the pages it shares until released
    kd.remove(ids[:1000])  # every key: every record and chunk page goes back
    assert kd.memory()["records"] == kd.memory()["chunks"] == 0 and len(kd) == 0
    kd._check()
    again = kd.intern(data, offs)
    assert again.tolist() == list(range(3000))  # ids start over, pages reused
    assert kd.memory() == full
    kd._check()
    pm.rollback(snap)  # the pages a snapshot shares were never written
    assert state_of(kd) == dict(zip(keys[:1000], range(1000)))
    kd._check()


def test_ids_are_deterministic(pm: mmm.PageManager) -> None:
    """The same calls on two dictionaries give the same ids and the same record bytes."""
    dicts = [KeyDict.create(pm, "a"), KeyDict.create(pm, "b")]
    rng = np.random.default_rng(3)
    for step in range(6):
        keys: list[bytes | None] = [b"%d" % x * int(x % 5 + 1)
                                    for x in rng.integers(0, 400, 300)]
        outs = [kd.intern(*enc(keys)[:2]) for kd in dicts]
        assert outs[0].tolist() == outs[1].tolist()
        rm = np.unique(outs[0])[::3]
        for kd in dicts:
            kd.remove(rm)
    assert state_of(dicts[0]) == state_of(dicts[1])


def test_create_by_name_and_schema_mismatch(pm: mmm.PageManager) -> None:
    kd = KeyDict.create(pm, "kd")
    assert KeyDict.create(pm, "kd") is kd
    mmm.HashMap.create(pm, "hm", key="<i8", value="<i8")
    with pytest.raises(mmm.SchemaMismatchError):
        KeyDict.create(pm, "hm")
    with pytest.raises(mmm.SchemaMismatchError):
        mmm.HashMap.create(pm, "kd", key="<i8", value="<i8")
    kd.intern(*enc([b"x"])[:2])
    del kd
    gc.collect()
    kd = KeyDict.create(pm, "kd")  # a new object rebuilds its page lists from the pages
    assert kd.lookup(*enc([b"x"])[:2]).tolist() == [0]


@numba.njit(cache=False)
def _divide(xs: np.ndarray, m: int) -> np.ndarray:
    out = np.empty_like(xs)
    for i in range(xs.shape[0]):
        out[i] = K._div(xs[i], m)
    return out


def test_division_by_magic_is_exact() -> None:
    """The kernels divide ids and slots by page capacities with a multiply (`K.magic`)."""
    rng = np.random.default_rng(0)
    for d in (2, 3, 63, 126, 127, 252, 1022, 1023, 2046, 4092, 16380, 65535):
        top = (1 << 48) - 1
        ks = np.r_[rng.integers(0, top // d, 2000), top // d, 0, 1]
        xs = np.r_[ks * d, ks * d - 1, ks * d + d - 1, rng.integers(0, top, 2000), top]
        xs = xs[(xs >= 0) & (xs <= top)].astype(np.int64)
        assert np.array_equal(_divide(xs, K.magic(d)), xs // d), d


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("args,exc,word", [
    ((np.zeros(4, np.int32), np.array([0, 1])), mmm.RecordTypeError, "data"),
    ((np.zeros((2, 2), np.uint8), np.array([0, 1])), mmm.RecordTypeError, "data"),
    ((123, np.array([0, 1])), mmm.RecordTypeError, "data"),
    ((np.zeros(4, np.uint8), np.array([0.0, 1.0])), mmm.RecordTypeError, "offsets"),
    ((np.zeros(4, np.uint8), [0, 1]), mmm.RecordTypeError, "offsets"),
    ((np.zeros(4, np.uint8), np.zeros(0, np.int64)), mmm.RecordTypeError, "offsets"),
    ((np.zeros(4, np.uint8), np.array([0, 1], np.int16)), mmm.RecordTypeError, "offsets"),
    ((np.zeros(4, np.uint8), np.array([0, 3, 2])), mmm.KeyFormatError, "offsets decrease"),
    ((np.zeros(4, np.uint8), np.array([0, 5])), mmm.KeyFormatError, "offsets"),
    ((np.zeros(4, np.uint8), np.array([-1, 2])), mmm.KeyFormatError, "offsets"),
    ((np.zeros(4, np.uint8), np.array([0, 1]), np.array([True, False])), mmm.RecordTypeError,
     "valid"),
    ((np.zeros(4, np.uint8), np.array([0, 1]), np.array([1])), mmm.RecordTypeError, "valid"),
])
def test_bad_input_names_the_argument_and_changes_nothing(pm: mmm.PageManager, args: Any,
                                                           exc: type, word: str) -> None:
    kd = KeyDict.create(pm, "kd")
    kd.intern(*enc([b"x", b"y" * 30])[:2])
    before = pm.pool.frames.copy()
    for fn in (kd.intern, kd.lookup):
        with pytest.raises(exc, match=word):
            fn(*args)
    assert np.array_equal(pm.pool.frames, before)
    kd._check()


def test_unknown_ids_raise_and_change_nothing(pm: mmm.PageManager) -> None:
    kd = KeyDict.create(pm, "kd")
    ids = kd.intern(*enc([b"a", b"b", b"c"])[:2])
    kd.remove(ids[1:2])
    before = pm.pool.frames.copy()
    for bad in ([0, 1], [5], [-1], [2, 3]):
        with pytest.raises(mmm.IdNotFoundError, match=f"id {bad[-1]}"):
            kd.remove(np.array(bad))
        with pytest.raises(mmm.IdNotFoundError):
            kd.keys(np.array(bad))
    with pytest.raises(KeyError):  # also a KeyError
        kd.keys([7])
    with pytest.raises(mmm.RecordTypeError, match="ids"):
        kd.keys(np.array([0.5]))
    assert np.array_equal(pm.pool.frames, before)
    assert kd.keys(np.zeros(0, np.int64))[1].tolist() == [0]
    kd.remove(np.array([0, 0, 2]))  # repeats allowed
    assert len(kd) == 0


# -- copy-on-write, rollback, pool exhaustion, restore -------------------------------------------
def test_snapshot_pages_are_never_written(pm: mmm.PageManager) -> None:
    """Under a held snapshot writes go on; the frozen pages keep the old dictionary."""
    kd = KeyDict.create(pm, "kd")
    old: list[bytes | None] = [b"k%d" % i * (i % 40 + 1) for i in range(500)] + [None]
    ids = kd.intern(*enc(old))
    snap = pm.chkpt()
    frozen = snap.copy_pages(np.arange(len(snap)))
    kd.remove(ids[::2])
    new: list[bytes | None] = [b"n%d" % i * (i % 30 + 1) for i in range(3000)]
    kd.intern(*enc(new))
    kd.intern(*enc(old))
    assert pm.stats()["pages_cloned"] > 0
    assert np.array_equal(snap.copy_pages(np.arange(len(snap))), frozen)
    kd._check()
    # the frozen pages, loaded elsewhere, are the dictionary at snapshot time
    pm2 = new_pm()
    pm2.load([frozen])
    kd2 = KeyDict.create(pm2, "kd")
    kd2._check()
    assert state_of(kd2) == dict(zip(old, ids.tolist()))
    pm.rollback(snap)
    assert state_of(kd) == dict(zip(old, ids.tolist()))
    kd._check()


def test_incremental_snapshot_sees_only_touched_pages(pm: mmm.PageManager) -> None:
    kd = KeyDict.create(pm, "kd")
    kd.intern(*enc([b"key-%d" % i for i in range(5000)])[:2])
    pm.chkpt().complete()
    kd.intern(*enc([b"key-%d" % i for i in range(5000)])[:2])  # only existing keys
    snap = pm.chkpt()
    assert snap.n_changed == 0
    snap.complete()
    kd.intern(*enc([b"fresh"])[:2])
    snap = pm.chkpt()
    assert 1 <= snap.n_changed <= 3  # control, record and index page
    snap.release()


@pytest.mark.parametrize("held", [False, True])
def test_pool_exhaustion_leaves_the_dictionary_unchanged(held: bool) -> None:
    pm = mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=48 * PAGE_BYTES)
    kd = KeyDict.create(pm, "kd")
    base: list[bytes | None] = [b"b%d" % i * (1 + i % 30) for i in range(300)]
    kd.intern(*enc(base)[:2])
    snap = pm.chkpt() if held else None
    want = state_of(kd)
    used = pm.pool.used_frames
    big: list[bytes | None] = [b"x%d" % i * (1 + i % 50) for i in range(20000)]
    with pytest.raises(mmm.PoolExhaustedError):
        kd.intern(*enc(big)[:2])
    assert state_of(kd) == want
    assert pm.pool.used_frames == used
    kd._check()
    if snap is not None:
        snap.release()
    kd.intern(*enc(big[:200])[:2])  # still works
    kd._check()


def test_restore_from_an_ioservice_checkpoint(tmp_path: Path) -> None:
    pm = new_pm()
    kd = KeyDict.create(pm, "kd")
    keys: list[bytes | None] = [b"u%d" % i * (1 + i % 25) for i in range(4000)] + [None]
    ids = kd.intern(*enc(keys))
    kd.remove(ids[:10])
    want = state_of(kd)
    with CheckpointManager(pm, str(tmp_path / "root"), "ha", n_workers=2) as mgr:
        pend = mgr.checkpoint()
        assert pend is not None
        pend.result()
        kd.intern(*enc([b"after"])[:2])  # not in the checkpoint
    pm2 = new_pm()
    with CheckpointManager(pm2, str(tmp_path / "root"), "ha", n_workers=2) as mgr:
        assert mgr.restore() is not None
    kd2 = KeyDict.create(pm2, "kd")
    kd2._check()
    assert state_of(kd2) == want
    assert kd2.lookup(*enc([b"after"])[:2]).tolist() == [-1]
    # it keeps working: removed ids are reused first, in ascending order
    assert kd2.intern(*enc([b"after", b"x"])[:2]).tolist() == [0, 1]


def test_reattach_file_backed_pool(tmp_path: Path) -> None:
    path = str(tmp_path / "pool")
    pm = mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=4 << 20, path=path)
    kd = KeyDict.create(pm, "kd")
    keys: list[bytes | None] = [b"f%d" % i * 9 for i in range(700)]
    ids = kd.intern(*enc(keys)[:2])
    pm.flush()
    pm2 = mmm.PageManager.attach(path, PAGE_BYTES)
    kd2 = KeyDict.create(pm2, "kd")
    assert kd2.lookup(*enc(keys)[:2]).tolist() == ids.tolist()
    kd2._check()


# -- stateful oracle ------------------------------------------------------------------------------
SHORT = st.binary(max_size=4)
MID = st.binary(min_size=17, max_size=24)  # around the inline limit (20)
LONG = st.binary(min_size=50, max_size=200)  # chunk chains
HUGE = st.binary(min_size=4000, max_size=9000)  # longer than a page
keys_st = st.one_of(st.none(), SHORT, SHORT, MID, LONG, st.sampled_from([b"", b"a", b"b" * 60]))


class KeyDictMachine(RuleBasedStateMachine):
    """KeyDict against a dict oracle, including the exact id each new key gets."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="kd-")
        self.mgr: CheckpointManager | None = None
        self.snap: mmm.Snapshot | None = None
        self.frozen: tuple[dict[Any, int], list[int], int] | None = None

    def teardown(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @initialize(mask=st.sampled_from([(1 << 64) - 1, (1 << 64) - 1, 0, 0x7]))
    def setup(self, mask: int) -> None:
        self.mask = mask
        self.pm = new_pm()
        self.kd = KeyDict.create(self.pm, "kd", _hash_mask=mask)
        self.model: dict[bytes | None, int] = {}
        self.free: list[int] = []  # removed ids, the next one reused at the end
        self.high = 0

    # -- the oracle's id rule ------------------------------------------------------------------
    def expect(self, keys: list[bytes | None]) -> list[int]:
        out = []
        for k in keys:
            if k not in self.model:
                if self.free:
                    self.model[k] = self.free.pop()
                else:
                    self.model[k] = self.high
                    self.high += 1
            out.append(self.model[k])
        return out

    def trim(self) -> None:
        """The record pages at the end holding no key go back to the pool: the high mark
        comes down to the end of the last page with a key, the free ids past it are gone."""
        live = set(self.model.values())
        pages = -(-self.high // RPP)
        while pages > 0 and not any((pages - 1) * RPP <= i < self.high for i in live):
            pages -= 1
        self.high = min(self.high, pages * RPP)
        self.free = [f for f in self.free if f < self.high]

    def known(self) -> list[bytes | None]:
        return list(self.model)

    @rule(data=st.data(), start=st.integers(0, 3), wide=st.booleans())
    def intern(self, data: st.DataObject, start: int, wide: bool) -> None:
        fresh = data.draw(st.lists(keys_st, max_size=12))
        old = data.draw(st.lists(st.sampled_from(self.known()), max_size=6)) if self.model else []
        keys = data.draw(st.permutations(fresh + old))
        d, o, v = enc(keys, start, "<i8" if wide else "<i4")
        got = self.kd.intern(d, o, v if None in keys or data.draw(st.booleans()) else None)
        assert got.tolist() == self.expect(keys)

    @rule(n=st.integers(100, 600), seed=st.integers(0, 2**32 - 1))
    def intern_many(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        keys: list[bytes | None] = [rng.integers(0, 256, int(m), dtype=np.uint8).tobytes()
                                    for m in rng.integers(0, 40, n)]
        got = self.kd.intern(*enc(keys))
        assert got.tolist() == self.expect(keys)

    @rule(k=HUGE)
    def intern_huge(self, k: bytes) -> None:
        assert self.kd.intern(*enc([k, b"tail"])).tolist() == self.expect([k, b"tail"])

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(keys_st, max_size=10))
        if self.model:
            keys += data.draw(st.lists(st.sampled_from(self.known()), max_size=10))
        d, o, v = enc(keys, 1)
        got = self.kd.lookup(d, o, v)
        assert got.tolist() == [self.model.get(k, -1) for k in keys]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def keys(self, data: st.DataObject) -> None:
        pick = data.draw(st.lists(st.sampled_from(self.known()), max_size=10))
        ids = np.array([self.model[k] for k in pick], np.int64)
        assert dec(*self.kd.keys(ids)) == pick

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        pick = data.draw(st.lists(st.sampled_from(self.known()), max_size=8))
        ids = [self.model.pop(k) for k in dict.fromkeys(pick)]
        self.kd.remove(np.array(ids + ids[:1], np.int64))
        self.free.extend(sorted(ids, reverse=True))
        self.trim()

    @precondition(lambda self: len(self.model) > 50)
    @rule(frac=st.floats(0.3, 1.0))
    def remove_many(self, frac: float) -> None:
        ks = self.known()[:int(len(self.model) * frac)]
        ids = [self.model.pop(k) for k in ks]
        self.kd.remove(np.array(ids, np.int64))
        self.free.extend(sorted(ids, reverse=True))
        self.trim()

    @precondition(lambda self: self.snap is None)
    @rule()
    def snapshot(self) -> None:
        self.snap = self.pm.chkpt()
        self.frozen = (dict(self.model), list(self.free), self.high)

    @precondition(lambda self: self.snap is not None)
    @rule()
    def rollback(self) -> None:
        assert self.snap is not None and self.frozen is not None
        self.pm.rollback(self.snap)
        self.snap = None
        self.model, self.free, self.high = dict(self.frozen[0]), list(self.frozen[1]), \
            self.frozen[2]
        assert KeyDict.create(self.pm, "kd") is self.kd

    @precondition(lambda self: self.snap is not None)
    @rule()
    def snapshot_loads_elsewhere(self) -> None:
        """The held snapshot's pages are the dictionary at snapshot time."""
        assert self.snap is not None and self.frozen is not None
        pm2 = new_pm()
        pm2.load([self.snap.copy_pages(np.arange(len(self.snap)))])
        kd2 = KeyDict.create(pm2, "kd")
        assert state_of(kd2) == self.frozen[0]

    @precondition(lambda self: self.snap is not None)
    @rule()
    def release(self) -> None:
        assert self.snap is not None
        self.snap.release()
        self.snap = None

    @precondition(lambda self: self.snap is None)
    @rule()
    def checkpoint_restore(self) -> None:
        """Checkpoint through ioservice (incremental after the first: the manager that
        restored is kept), restore into a fresh manager, go on there."""
        root = str(Path(self.tmp) / "root")
        if self.mgr is None:
            self.mgr = CheckpointManager(self.pm, root, "ha", n_workers=2)
        pend = self.mgr.checkpoint()
        if pend is not None:
            pend.result()
        self.mgr.close()
        pm2 = new_pm()
        self.mgr = CheckpointManager(pm2, root, "ha", n_workers=2)
        assert self.mgr.restore() is not None
        self.pm = pm2
        self.kd = KeyDict.create(pm2, "kd")

    @invariant()
    def agrees_with_oracle(self) -> None:
        if not hasattr(self, "kd"):
            return
        self.kd._check()
        assert len(self.kd) == len(self.model)
        ids, data, offs, valid = self.kd.items()
        assert ids.tolist() == sorted(self.model.values())
        assert dict(zip(dec(data, offs, valid), ids.tolist())) == self.model
        assert self.kd.memory()["records"] == -(-self.high // RPP) * PAGE_BYTES

    @precondition(lambda self: len(self.model) > 50)
    @rule()
    def remove_all(self) -> None:
        """Every page of records and chunks goes back to the pool, and the dictionary
        starts over from id 0."""
        free0 = self.pm.pool.free_frames
        pages0 = self.kd.memory()
        self.kd.remove(np.array(list(self.model.values()), np.int64))
        self.model.clear()
        self.free.clear()
        self.high = 0
        mem = self.kd.memory()
        assert mem["records"] == mem["chunks"] == 0
        if self.snap is None:  # (a snapshot holds the pages it shares)
            assert self.pm.pool.free_frames >= free0 + (pages0["records"] +
                                                        pages0["chunks"]) // PAGE_BYTES


TestKeyDictMachine = KeyDictMachine.TestCase
TestKeyDictMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
