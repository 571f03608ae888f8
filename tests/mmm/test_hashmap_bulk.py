"""`HashMap.load_distinct` builds a map that behaves exactly as one built by upserts.

Property tests (hypothesis) over key dtypes (integers, floats with -0.0, bytes,
structured keys), tiny and real page sizes and batch sizes that force overflow
pages: after the build `_check` holds and the map equals a dict oracle; then
the same random updates, deletes and lookups applied to the loaded map, to a
map built by ``put`` and to the oracle agree at every step. Also: duplicates
and non-empty maps are refused with the map unchanged, a snapshot taken before
the build still sees the empty map (copy-on-write: the build writes only fresh
pages), and a pool too small for the build leaves the map as it was.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmm
from mmm import HashMap, PageManager
from mmm.errors import PoolExhaustedError

VAL = np.dtype([("n", "<i8"), ("x", "<f4"), ("tag", "S3")])
SKEY = np.dtype([("a", "<i4"), ("b", "u1")])
KEY_DTYPES = ["<i8", "<u4", "<i2", "<f8", "S5", SKEY]


def _keys(dt: np.dtype[Any], raw: list[int]) -> np.ndarray:
    """Distinct keys of dtype `dt` from distinct integers."""
    r = np.asarray(raw, np.int64)
    if dt.fields is not None:
        out = np.zeros(len(r), dt)
        out["a"] = r // 7
        out["b"] = r % 7
        return out
    if dt.kind == "S":
        return np.array([b"k%d" % x for x in raw], dt)
    if dt.kind == "f":
        return (r * 0.5).astype(dt)
    if dt.kind == "u":
        return np.abs(r).astype(dt) * 2 + (r < 0)
    return r.astype(dt)


def _vals(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = np.zeros(n, VAL)
    v["n"] = rng.integers(-10**12, 10**12, n)
    v["x"] = rng.normal(size=n).astype("<f4")
    v["tag"] = [b"%d" % x for x in rng.integers(0, 999, n)]
    return v


def _pykey(k: Any) -> Any:
    return k.tobytes() if isinstance(k, np.void) else (k.item() if hasattr(k, "item") else k)


def _as_dict(m: HashMap) -> dict[Any, bytes]:
    k, v = m.items()
    return {_pykey(a): b.tobytes() for a, b in zip(k, v)}


def _oracle(keys: np.ndarray, vals: np.ndarray) -> dict[Any, bytes]:
    return {_pykey(a): b.tobytes() for a, b in zip(keys, vals)}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kdt=st.sampled_from(KEY_DTYPES),
       raw=st.lists(st.integers(-2000, 2000), unique=True, max_size=300),
       slots=st.sampled_from([2, 3, 5, 16, 40, None]),
       seed=st.integers(0, 2**16),
       ops=st.lists(st.tuples(st.sampled_from(["put", "delete", "upsert"]),
                              st.lists(st.integers(-2500, 2500), max_size=40)),
                    max_size=6))
def test_load_distinct_behaves_as_a_map_built_by_put(kdt: Any, raw: list[int],
                                                      slots: int | None, seed: int,
                                                      ops: list[tuple[str, list[int]]]) -> None:
    dt = np.dtype(kdt)
    if dt.kind == "i" and dt.itemsize == 2:
        raw = [x for x in raw if -32768 <= x < 32768]
    pm = PageManager(4096, capacity_bytes=8 << 20)
    keys = _keys(dt, raw)
    vals = _vals(len(keys), seed)
    a = HashMap.create(pm, "a", key=dt, value=VAL, page_slots=slots)
    b = HashMap.create(pm, "b", key=dt, value=VAL, page_slots=slots)
    a.load_distinct(keys, vals)
    b.put(keys, vals)
    a._check()
    want = _oracle(keys, vals)
    assert _as_dict(a) == want and len(a) == len(want)
    f, got = a.get(keys)
    assert f.all() and got.tobytes() == vals.tobytes()
    for step, (op, ints) in enumerate(ops):
        k = _keys(dt, [x for x in ints if dt.itemsize != 2 or -32768 <= x < 32768])
        if op == "put":
            v = _vals(len(k), seed + step)
            a.put(k, v)
            b.put(k, v)
            want.update(_oracle(k, v))
        elif op == "delete":
            assert np.array_equal(a.delete(k), b.delete(k))
            for x in k:
                want.pop(_pykey(x), None)
        else:
            spec = {"n": "count"}
            a.upsert(k, None, spec)
            b.upsert(k, None, spec)
            want = _as_dict(b)
        assert _as_dict(a) == want
        probe = _keys(dt, list(range(-30, 30)))
        fa, va = a.get(probe)
        fb, vb = b.get(probe)
        assert np.array_equal(fa, fb) and va.tobytes() == vb.tobytes()
    a._check()


def test_large_load_fills_overflow_pages_and_checks() -> None:
    pm = PageManager(65536, capacity_bytes=256 << 20)
    n = 200_000
    keys = np.random.default_rng(3).permutation(n * 3)[:n].astype("<i8") - n
    vals = _vals(n, 4)
    m = HashMap.create(pm, "m", key="<i8", value=VAL)
    m.load_distinct(keys, vals)
    m._check()
    assert len(m) == n
    f, got = m.get(keys[::-1])
    assert f.all() and got.tobytes() == vals[::-1].tobytes()
    assert not m.contains(np.array([n * 3], "<i8"))[0]
    m.upsert(keys[:1000], None, {"n": "count"})  # grows and splits from the built geometry
    m._check()
    assert (m.get(keys[:1000])[1]["n"] == vals["n"][:1000] + 1).all()


def test_duplicate_keys_and_a_non_empty_map_are_refused_unchanged() -> None:
    pm = PageManager(4096, capacity_bytes=4 << 20)
    m = HashMap.create(pm, "m", key="<i8", value=VAL, page_slots=5)
    keys = np.array([5, 9, 1, 9, 4], "<i8")
    frames_before = pm.pool.free_frames
    with pytest.raises(ValueError, match="index 3"):
        m.load_distinct(keys, _vals(5, 0))
    assert len(m) == 0 and pm.pool.free_frames == frames_before
    m._check()
    with pytest.raises(ValueError, match=r"index 1 .*distinct"):
        m.load_distinct(np.array([-0.0, 0.0]).astype("<i8"), _vals(2, 0))
    m.load_distinct(keys[:3], _vals(3, 1))
    with pytest.raises(ValueError, match="empty map"):
        m.load_distinct(np.array([7], "<i8"), _vals(1, 2))
    assert sorted(m.keys().tolist()) == [1, 5, 9]
    with pytest.raises(mmm.RecordTypeError):
        HashMap.create(pm, "w", key="<i8", value=VAL).load_distinct(keys[:2], _vals(3, 0))


def test_float_keys_minus_zero_equals_zero() -> None:
    pm = PageManager(4096, capacity_bytes=4 << 20)
    m = HashMap.create(pm, "f", key="<f8", value=VAL)
    with pytest.raises(ValueError, match="index 1"):
        m.load_distinct(np.array([-0.0, 0.0]), _vals(2, 0))
    m.load_distinct(np.array([-0.0, 1.5]), _vals(2, 0))
    assert m.contains(np.array([0.0]))[0]


def test_snapshot_before_the_build_still_sees_the_empty_map() -> None:
    pm = PageManager(4096, capacity_bytes=8 << 20)
    m = HashMap.create(pm, "m", key="<i8", value=VAL, page_slots=16)
    m.upsert(np.arange(50, dtype="<i8"), None, {"n": "count"})
    m.delete(np.arange(50, dtype="<i8"))  # empty, with several buckets and tombstones
    snap = pm.chkpt()
    frozen = snap.copy_pages(np.arange(len(snap))).tobytes()
    keys = np.arange(1000, dtype="<i8") * 13
    m.load_distinct(keys, _vals(1000, 5))
    m._check()
    assert snap.copy_pages(np.arange(len(snap))).tobytes() == frozen
    pm.rollback(snap)
    m._check()
    assert len(m) == 0 and not m.contains(keys).any()


def test_pool_too_small_leaves_the_map_unchanged() -> None:
    pm = PageManager(4096, capacity_bytes=16 * 4096)
    m = HashMap.create(pm, "m", key="<i8", value=VAL)
    free = pm.pool.free_frames
    with pytest.raises(PoolExhaustedError):
        m.load_distinct(np.arange(5000, dtype="<i8"), _vals(5000, 0))
    assert len(m) == 0 and pm.pool.free_frames == free
    m._check()
    m.put(np.array([1], "<i8"), _vals(1, 0))
    assert len(m) == 1
