"""The HashMap kernel works in chunks of rows (hash + prefetch, tag match, probe, combine per
field): batches shorter than a chunk, chunk edges, and copy-on-write / overflow / split stops in
the middle of a chunk must give exactly the row-by-row result, running outputs included. Typed
per-record upserters arm their buffers while active: interleaved writers keep input order."""
from __future__ import annotations

import numpy as np
import pytest

import mmm
from mmm._kernels import hashmap as K
from mmm.structures import hashmap as H
from mmm.structures.hashmap import HashMap

VALUE = np.dtype([("n", "<i8"), ("lo", "<i8"), ("hi", "<i8"), ("last", "<f8"), ("s", "<f8")])
SPEC = {"n": "count", "lo": ("min", "ts"), "hi": ("max", "ts"), "last": ("last", "x"),
        "s": ("sum", "x")}


def oracle(model: dict, keys: list[int], ts: list[int], xs: list[float]) -> list[tuple]:
    running = []
    for k, t, x in zip(keys, ts, xs):
        old = model.get(k)
        model[k] = ((1, t, t, x, x) if old is None else
                    (old[0] + 1, min(old[1], t), max(old[2], t), x, old[4] + x))
        running.append(model[k])
    return running


def contents(m: HashMap) -> dict:
    k, v = m.items()
    return {int(a): tuple(b) for a, b in zip(k.tolist(), v.tolist())}


@pytest.fixture
def stops(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(status, row) of every kernel call that returned a request."""
    seen: list[tuple[int, int]] = []
    rows = K.rows

    def spy(*args):  # type: ignore[no-untyped-def]
        code = rows(*args)
        if code != K.DONE:
            seen.append((int(code), int(args[-1][1])))
        return code
    monkeypatch.setattr(H.K, "rows", spy)
    return seen


@pytest.mark.parametrize("slots", [3, 16, 80])
@pytest.mark.parametrize("n", [1, K.CHUNK - 1, K.CHUNK, K.CHUNK + 1, 3 * K.CHUNK + 5])
def test_chunk_edges_and_mid_chunk_stops_match_row_by_row(slots: int, n: int,
                                                          stops: list[tuple[int, int]]) -> None:
    rng = np.random.default_rng(n * 100 + slots)
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "m", key="<u4", value=VALUE, page_slots=slots)
    model: dict = {}
    for rnd in range(3):  # grow (splits, overflow pages), then update under a snapshot
        keys = rng.integers(0, max(2, n // 2 + 8 * rnd), n).astype("<u4")
        ts = rng.integers(-50, 50, n)
        xs = rng.normal(size=n).round(3)
        snap = pm.chkpt() if rnd == 2 else None  # every page pinned: clones mid-chunk
        got = m.upsert(keys, {"ts": ts, "x": xs}, SPEC, returning=True)
        want = oracle(model, keys.tolist(), ts.tolist(), xs.tolist())
        assert [tuple(r) for r in got.tolist()] == want
        m._check()
        assert contents(m) == model
        if snap is not None:
            snap.release()
    mid = [row % K.CHUNK for _, row in stops]
    if n > K.CHUNK and slots < 80:
        assert any(r != 0 for r in mid), stops  # some request stopped inside a chunk
        assert {code for code, _ in stops} >= {K.NEED_CLONE, K.NEED_SPLIT}


def test_get_and_delete_across_chunks_and_chains() -> None:
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "m", key="<u8", value="<i8", page_slots=5)
    keys = np.arange(0, 4 * K.CHUNK + 3, dtype="<u8") * 7919
    m.put(keys, np.arange(len(keys)))
    probe = np.concatenate([keys[::-1], keys + 1])  # hits, then misses
    found, vals = m.get(probe)
    assert found.tolist() == [True] * len(keys) + [False] * len(keys)
    assert vals[:len(keys)].tolist() == list(range(len(keys)))[::-1]
    gone = m.delete(np.concatenate([keys[::2], keys[::2] + 1]))  # presence before the batch
    assert gone.tolist() == [True] * len(keys[::2]) + [False] * len(keys[::2])
    assert sorted(m.keys().tolist()) == sorted(keys[1::2].tolist())
    m._check()


def test_per_record_writers_interleaved_keep_input_order() -> None:
    """Two typed upserters, a generic one and item assignment, interleaved record by
    record: each switch applies the other buffer first, so the map equals the row-by-row
    result and a writer that was switched away from appends again when called."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    val = np.dtype([("n", "<i8"), ("hi", "<i8"), ("x", "<f8")])
    m = HashMap.create(pm, "m", key="<u4", value=val)
    count = m.upserter({"n": "count"})
    top = m.upserter({"hi": ("max", "t")})
    both = m.upserter({"n": "count", "x": ("last", "x"), "hi": ("max", "t")})
    model: dict[int, list] = {}
    rng = np.random.default_rng(3)
    for i in range(600):
        k = int(rng.integers(0, 20))
        new = k not in model
        cur = model.setdefault(k, [0, 0, 0.0])
        r = i % 4 if i < 300 else int(rng.integers(0, 4))
        if r == 0:
            count(k)
            cur[0] += 1
        elif r == 1:
            t = int(rng.integers(-9, 99))
            top(k, t)
            cur[1] = t if new else max(cur[1], t)
        elif r == 2:
            both(k, i, 0.5 * i)
            cur[0] += 1
            cur[1] = i if new else max(cur[1], i)
            cur[2] = 0.5 * i
        else:
            m[k] = (i, -i, 1.0)
            model[k] = [i, -i, 1.0]
        if i % 97 == 0:  # a read in between applies the active buffer
            assert len(m) == len(model)
    assert {k: tuple(v) for k, v in contents(m).items()} == {k: tuple(v) for k, v in
                                                             model.items()}
    m._check()


def test_switched_away_upserter_refuses_bad_records_without_buffering() -> None:
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "m", key="<u2", value=[("n", "<i8"), ("hi", "<i4")])
    a = m.upserter({"hi": ("max", "t")})
    a(1, 5)
    m[2] = (1, 1)  # a is switched away
    with pytest.raises(mmm.RecordTypeError, match="key"):
        a(70000, 1)  # the switch happened (item assignment applied), nothing buffered
    with pytest.raises(mmm.RecordTypeError, match="'t'"):
        a(3, 2**40)
    a(1, 9)
    assert contents(m) == {1: (0, 9), 2: (1, 1)}


def test_typed_upserter_full_buffer_applies_and_refills(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HashMap, "_BUFFER_LIMIT", 8)
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "m", key="<u4", value=[("n", "<i8"), ("hi", "<i8")])
    add = m.upserter({"n": "count", "hi": ("max", "t")})
    model: dict[int, tuple[int, int]] = {}
    for j in range(50):
        k, t = j % 11, (j * 37) % 23
        add(k, t)
        n, hi = model.get(k, (0, t))
        model[k] = (n + 1, max(hi, t))
        assert len(m._buf_keys) == j % 8 + 1  # applied each time the buffer was full
    assert contents(m) == model


def test_typed_upserter_pool_exhaustion_at_a_full_buffer(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The add that meets a full buffer which cannot be applied raises PoolExhaustedError and
    buffers nothing; the map is unchanged and the buffered records are applied later."""
    monkeypatch.setattr(HashMap, "_BUFFER_LIMIT", 40)
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=30 * 4096)
    m = HashMap.create(pm, "m", key="<u4", value=[("n", "<i8"), ("hi", "<i8")], page_slots=16)
    filler = pm.create("filler")
    blocks = pm.allocate(filler, pm.pool.free_frames - 2)
    add = m.upserter({"n": "count", "hi": ("max", "t")})
    for k in range(40):
        add(k, k)
    with pytest.raises(mmm.PoolExhaustedError):
        add(99, 1)
    assert len(m._buf_keys) == 40
    pm.release(filler, blocks)
    assert contents(m) == {k: (1, k) for k in range(40)}
    m._check()
