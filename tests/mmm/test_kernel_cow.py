"""Copy-on-write stays exact under the compiled kernels.

Snapshots are taken in the middle of batches of every kind of write the
kernels and the plain-Python per-record paths perform (ordered-map merges, splits,
per-record inserts and deletes, range eviction; sequence span writes, appends, pops,
bound eviction), the per-record ones with their caches alive across the snapshot. After
each later write the frozen pages must still hold exactly the bytes they had
when the snapshot was taken, and a rollback must give back exactly the
contents of that moment. Also: the page-table rebuild and chain walk reject
damaged pages with `PageFormatError`, and keep the newest copy of a page.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

import mmm
from mmm.page import HEADER_BYTES, HEADER_DTYPE
from mmm.structures.ordered_map import OrderedMap
from mmm.structures.sequence import PagedDeque, PagedList

REC = np.dtype([("ts", "<i8"), ("key", "<u4"), ("val", "<i8")])


def _digest(snap: mmm.Snapshot) -> str:
    return hashlib.sha256(snap.copy_pages(np.arange(len(snap))).tobytes()).hexdigest()


def _contents(s: dict[str, Any]) -> tuple[Any, ...]:
    k, v = s["om"].items()
    kb, vb = s["ob"].items()
    return (k.tolist(), v["v"].tolist(), kb.tolist(), vb.tolist(),
            s["dq"].to_numpy().tolist(), s["ls"].to_numpy().tolist())


def _structures(pm: mmm.PageManager) -> dict[str, Any]:
    return {
        "om": OrderedMap.create(pm, "om", key="<i8", value=[("v", "<i8")], page_slots=8),
        "ob": OrderedMap.create(pm, "ob", key="S4", value="<f8", page_slots=5),
        "dq": PagedDeque.create(pm, "dq", REC, page_slots=6),
        "ls": PagedList.create(pm, "ls", "<i4", page_slots=7),
    }


def _steps(s: dict[str, Any], rng: np.random.Generator, t: int) -> list[Any]:
    """One batch as a list of writes; a snapshot may be taken between any two."""
    om, ob, dq, ls = s["om"], s["ob"], s["dq"], s["ls"]
    k = rng.integers(-200, 200, 20).astype("<i8")
    kb = np.array([b"%03d" % x for x in rng.integers(0, 300, 6)], "S4")
    recs = np.zeros(7, REC)
    recs["ts"] = t * 10 + np.arange(7)
    recs["key"] = rng.integers(0, 9, 7)
    recs["val"] = rng.integers(0, 100, 7)
    i = int(rng.integers(-300, 300))
    return [
        lambda: om.put(k, np.array([(int(x) * t,) for x in k], om.value_dtype)),
        lambda: om.__setitem__(i, (t,)),
        lambda: om.delete(k[:5]),
        lambda: i in om and om.__delitem__(i),
        lambda: om.pop_range(i, i + 40),
        lambda: ob.put(kb, np.arange(len(kb), dtype="<f8") + t),
        lambda: ob.delete(kb[:2]),
        lambda: dq.extend(recs),
        lambda: dq.append((t * 10 + 8, 1, t)),
        lambda: dq.evict_before(t * 10 - 25, "ts"),
        lambda: len(dq) > 3 and dq.popleft(),
        lambda: dq.popleft_before(t * 10 - 20, "ts"),
        lambda: len(dq) > 3 and dq.pop_item(),
        lambda: om.range_lists(i - 50, i + 50),
        lambda: ls.extend(np.arange(5, dtype="<i4") + t),
        lambda: len(ls) > 6 and ls.__setitem__(slice(1, 6), np.full(5, t, "<i4")),
        lambda: len(ls) > 10 and ls.__delitem__(slice(2, 4)),
        lambda: ls.insert(1, t),
    ]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_snapshots_in_the_middle_of_batches(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=16 << 20)
    s = _structures(pm)
    held: list[tuple[mmm.Snapshot, str, tuple[Any, ...]]] = []
    for t in range(1, 40):
        steps = _steps(s, rng, t)
        cut = int(rng.integers(0, len(steps)))
        for j, step in enumerate(steps):
            if j == cut:
                snap = pm.chkpt()
                held.append((snap, _digest(snap), _contents(s)))
            step()
        for snap, dig, _ in held:  # every frozen page still holds its bytes
            assert _digest(snap) == dig
        if len(held) > 3 or t % 7 == 0:
            snap, dig, want = held.pop(0)
            how = t % 3
            if how == 0 and all(h[0].snapshot_id > snap.snapshot_id for h in held):
                for other, _, _ in held:
                    other.release()
                held.clear()
                pm.rollback(snap)
                s = _structures(pm)
                assert _contents(s) == want
            elif how == 1:
                snap.mark_persisted(np.arange(len(snap)))
                snap.complete()
            else:
                snap.release()
        for x in s.values():
            x._check()
    for snap, dig, _ in held:
        assert _digest(snap) == dig
        snap.release()
    assert pm.stats()["pinned_frames"] == 0


def test_per_record_writes_never_touch_a_frozen_leaf() -> None:
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=4 << 20)
    om = OrderedMap.create(pm, "om", key="<u8", value="<i8")
    om.put(np.arange(0, 2000, 2, dtype="<u8"), np.arange(1000, dtype="<i8"))
    for r in range(20):
        snap = pm.chkpt()
        dig = _digest(snap)
        before = om.items()
        om[2 * r + 1] = -r            # per-record insert (memmove in the leaf)
        del om[4 * r]                 # per-record delete
        om[2 * r + 100] = 7           # overwrite
        assert _digest(snap) == dig
        pm.rollback(snap)
        om = OrderedMap.create(pm, "om", key="<u8", value="<i8")
        after = om.items()
        assert np.array_equal(after[0], before[0]) and np.array_equal(after[1], before[1])


def test_per_record_caches_alive_across_snapshots() -> None:
    """The per-record paths cache which pages passed the write barrier; a snapshot taken
    right after such writes (no other operation in between) must make the next write to
    the same leaf / end page clone it, and a rollback gives back that moment exactly."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=4 << 20)
    om = OrderedMap.create(pm, "om", key="<u8", value="<i8")
    dq = PagedDeque.create(pm, "dq", REC)
    model: dict[int, int] = {}
    window: list[tuple[int, int, int]] = []
    for r in range(40):
        for j in range(3):  # warm the caches: these pages are now writable in them
            om[r * 7 + j] = r
            model[r * 7 + j] = r
            dq.append((r * 3 + j, j, r))
            window.append((r * 3 + j, j, r))
        snap = pm.chkpt()
        dig = _digest(snap)
        want_m, want_w = dict(model), list(window)
        om[r * 7 + 5] = -r  # the same leaf and tail page as above: must be cloned
        del om[r * 7]
        assert dq.popleft_item() == window[0]
        dq.append((r * 3 + 3, 9, -r))
        dq.popleft_before(r * 3 - 30, "ts")
        assert om.range_lists(r * 7, r * 7 + 7)[1] == [r, r, -r]
        assert _digest(snap) == dig
        if r % 2:
            pm.rollback(snap)
            om = OrderedMap.create(pm, "om", key="<u8", value="<i8")
            dq = PagedDeque.create(pm, "dq", REC)
            model, window = want_m, want_w
        else:
            snap.release()
            model[r * 7 + 5] = -r
            del model[r * 7]
            window = window[1:] + [(r * 3 + 3, 9, -r)]
            window = [w for w in window if w[0] >= r * 3 - 30]
        assert om.range_lists()[0] == sorted(model)
        assert om.range_lists()[1] == [model[k] for k in sorted(model)]
        assert dq.to_numpy().tolist() == window
        om._check()
        dq._check()
    assert pm.stats()["pinned_frames"] == 0


@pytest.mark.parametrize("dt, vals, bounds", [
    (">i4", np.arange(-50, 50, 3), [-10, 0, 7, -100, 100]),
    ("S3", np.array([b"%03d" % i for i in range(0, 100, 3)]), [b"010", b"5", b"000"]),
    (">f8", np.arange(-50, 50, 3) * 0.5, [-3.2, 0.0, 7.7, -100.0]),
    ("<i8", np.arange(-50, 50, 3), [2.5, -2.5, 1e30, -1e30, 7]),
    ("<M8[s]", np.arange(0, 90, 3).astype("<M8[s]"), [np.datetime64(10, "s"),
                                                      np.datetime64(0, "s")]),
])
def test_evict_before_any_field_dtype(dt: str, vals: np.ndarray, bounds: list[Any]) -> None:
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    for j, bd in enumerate(bounds):
        d = PagedDeque.create(pm, f"d{j}", dt, page_slots=5)
        d.extend(vals.astype(dt))
        want = int(np.count_nonzero(vals.astype(dt) < bd))
        assert d.evict_before(bd) == want
        assert d.to_numpy().tolist() == vals.astype(dt)[want:].tolist()


@pytest.mark.parametrize("kdt", ["<i2", ">i4", ">u8", "<f4", ">f8", "S5", "<m8[ms]", "?"])
def test_ordered_map_key_dtypes_agree_with_numpy(kdt: str) -> None:
    rng = np.random.default_rng(4)
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    if kdt == "S5":
        pool = np.array([b"%d" % x for x in rng.integers(-999, 999, 300)], "S5")
    elif kdt == "?":
        pool = np.array([True, False])
    else:
        pool = (rng.integers(-30000, 30000, 300) * (0.5 if "f" in kdt else 1)).astype(kdt)
        if kdt[1] == "u":
            pool = rng.integers(0, 2**63, 300).astype(kdt)
    om = OrderedMap.create(pm, "om", key=kdt, value="<i4", page_slots=6)
    om.put(pool, np.arange(len(pool), dtype="<i4"))
    model = {}
    for i, x in enumerate(pool.tolist()):
        model[x] = i
    uniq = np.unique(pool)
    assert om.keys().tolist() == uniq.tolist()
    lo, hi = uniq[len(uniq) // 4], uniq[-1]
    assert om.range(lo, hi)[0].tolist() == uniq[(uniq >= lo) & (uniq < hi)].tolist()
    assert om.range(lo, hi, inclusive=(False, True))[0].tolist() == \
        uniq[(uniq > lo) & (uniq <= hi)].tolist()
    found, got = om.get(pool)
    assert found.all() and got.tolist() == [model[x] for x in pool.tolist()]
    om._check()


def test_rebuild_rejects_damaged_chains_and_keeps_newest_copy() -> None:
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    om = OrderedMap.create(pm, "om", key="<i8", value="<i8", page_slots=4)
    om.put(np.arange(20, dtype="<i8"), np.arange(20, dtype="<i8"))
    snap = pm.chkpt()
    pages = snap.copy_pages(np.arange(len(snap)))
    snap.release()
    hdr = pages[:, :HEADER_BYTES].view(HEADER_DTYPE)[:, 0]
    # a newer copy of leaf 1 with another value: the loader keeps it
    newer = pages[1:2].copy()
    nh = newer[:, :HEADER_BYTES].view(HEADER_DTYPE)[:, 0]
    nh["version"] += 1000
    with pytest.raises(mmm.PageFormatError, match="more than once"):
        pm.load([pages, newer])
    assert pm.names() == []  # a failed load leaves nothing half built
    pm2 = mmm.PageManager(_pool=_pool_with(pm.page_bytes, [pages, newer]))
    om2 = OrderedMap.create(pm2, "om", key="<i8", value="<i8")
    assert om2.keys().tolist() == list(range(20))
    # a broken next link
    broken = pages.copy()
    bh = broken[:, :HEADER_BYTES].view(HEADER_DTYPE)[:, 0]
    bh["next"][2] = bh["page_id"][2]
    pm.load([broken])
    with pytest.raises(mmm.PageFormatError, match="leaf chain"):
        OrderedMap.create(pm, "om", key="<i8", value="<i8")
    two_heads = pages.copy()
    th = two_heads[:, :HEADER_BYTES].view(HEADER_DTYPE)[:, 0]
    th["prev"][3] = np.uint64(0xFFFFFFFFFFFFFFFF)
    pm.load([two_heads])
    with pytest.raises(mmm.PageFormatError, match="no predecessor"):
        OrderedMap.create(pm, "om", key="<i8", value="<i8")
    assert hdr["kind"][0] == mmm.Layout.SUPER


def _pool_with(page_bytes: int, chunks: list[np.ndarray]) -> mmm.PagePool:
    """A pool whose frames hold the given pages (as a re-attached pool would)."""
    pool = mmm.PagePool(page_bytes, 1 << 22)
    allp = np.concatenate(chunks)
    fr = pool.allocate(len(allp), zero=False)
    pool.frames[fr] = allp
    return pool
