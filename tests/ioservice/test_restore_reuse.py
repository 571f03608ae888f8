"""Issue 8 §2: a restore into a page manager whose pool held more pages before
must not hand stale frames to the structures.

Both paths that reuse frames: a live `CheckpointManager.restore` that rolls the
operator back (the frames of the discarded state are reused), and a restore
that falls back past a damaged newest checkpoint (the frames the damaged
candidate was read into are reused). After the restore, heavy inserts and
deletes are compared with a dict after every batch; the time limit turns a
hang in the hash map's placement into a failure.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import mmm
from ioservice import CheckpointManager, CheckpointPolicy, open_root, restore
from ioservice.errors import DamagedCheckpointWarning
from mmm.structures.hashmap import HashMap

PAGE_BYTES = 4096
VAL = np.dtype([("n", "<i8"), ("s", "<f8")])
COMBINE = {"n": "count", "s": ("sum", "x")}


def _pm() -> mmm.PageManager:
    return mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=64 << 20)


def _map(pm: mmm.PageManager) -> HashMap:
    return HashMap.create(pm, "counts", key="<u8", value=VAL)


def _upsert(hm: HashMap, oracle: dict[int, tuple[int, float]], keys: np.ndarray,
            x: np.ndarray) -> None:
    hm.upsert(keys, {"x": x}, COMBINE)
    for k, v in zip(keys.tolist(), x.tolist()):
        n, s = oracle.get(k, (0, 0.0))
        oracle[k] = (n + 1, s + v)


def _delete(hm: HashMap, oracle: dict[int, tuple[int, float]], keys: np.ndarray) -> None:
    hm.delete(keys)
    for k in keys.tolist():
        oracle.pop(k, None)


def _assert_equal(hm: HashMap, oracle: dict[int, tuple[int, float]], what: str) -> None:
    k, v = hm.items()
    assert len(k) == len(np.unique(k)), f"{what}: a key appears twice in the map"
    assert len(hm) == len(oracle) == len(k), f"{what}: {len(hm)}/{len(k)} keys, want {len(oracle)}"
    want_k = np.fromiter(oracle.keys(), dtype=np.uint64, count=len(oracle))
    want_n = np.fromiter((n for n, _ in oracle.values()), dtype=np.int64, count=len(oracle))
    want_s = np.fromiter((s for _, s in oracle.values()), dtype=np.float64, count=len(oracle))
    o, w = np.argsort(k), np.argsort(want_k)
    assert np.array_equal(k[o], want_k[w]), f"{what}: other keys than the oracle"
    assert np.array_equal(v["n"][o], want_n[w]), f"{what}: counts differ"
    assert np.allclose(v["s"][o], want_s[w]), f"{what}: sums differ"
    if len(oracle):
        found, vals = hm.get(want_k)
        assert found.all(), f"{what}: get misses stored keys"
        assert np.array_equal(vals["n"], want_n), f"{what}: get returns other counts"


def _grow_big(hm: HashMap, seed: int) -> None:
    """Fill many pages with non-zero bytes (keys, values, control bytes)."""
    rng = np.random.default_rng(seed)
    for _ in range(6):
        keys = rng.integers(1, 2**63, 20_000, dtype=np.uint64)
        hm.upsert(keys, {"x": rng.random(len(keys))}, COMBINE)


def _hammer(hm: HashMap, oracle: dict[int, tuple[int, float]], seed: int,
            batches: int = 40) -> None:
    """Heavy inserts and deletes, compared with the dict after every batch."""
    rng = np.random.default_rng(seed)
    for b in range(batches):
        keys = rng.integers(0, 30_000, 2_000).astype("<u8")
        _upsert(hm, oracle, keys, rng.random(len(keys)))
        if b % 3 == 2:
            _delete(hm, oracle, rng.integers(0, 30_000, 1_500).astype("<u8"))
        _assert_equal(hm, oracle, f"batch {b}")


def _small_state(hm: HashMap, seed: int) -> dict[int, tuple[int, float]]:
    oracle: dict[int, tuple[int, float]] = {}
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 30_000, 500).astype("<u8")
    _upsert(hm, oracle, keys, rng.random(len(keys)))
    return oracle


@pytest.mark.timeout(600)  # a hang guard
def test_live_restore_rollback_then_heavy_updates(tmp_path: Path) -> None:
    pm = _pm()
    hm = _map(pm)
    oracle = _small_state(hm, 1)
    with CheckpointManager(pm, str(tmp_path), "agg", n_workers=2) as mgr:
        mgr.checkpoint().result()
        _grow_big(hm, 2)  # never checkpointed: the restore rolls it back
        big_frames = pm.pool.used_frames
        man = mgr.restore()
        assert man is not None and man.name == "agg-1"
        assert pm.pool.used_frames < big_frames // 4
        hm = _map(pm)
        _assert_equal(hm, oracle, "after restore")
        _hammer(hm, oracle, 3)
        # the state still checkpoints and restores exactly
        mgr.checkpoint().result()
        pm2 = _pm()
        restore(pm2, open_root(str(tmp_path)), "agg")
        _assert_equal(_map(pm2), oracle, "second restore")


@pytest.mark.timeout(600)  # a hang guard
def test_fallback_past_damaged_newest_then_heavy_updates(tmp_path: Path) -> None:
    pm = _pm()
    hm = _map(pm)
    oracle = _small_state(hm, 4)
    policy = CheckpointPolicy(full_every=1, keep=None)
    with CheckpointManager(pm, str(tmp_path), "agg", policy=policy, n_workers=2) as mgr:
        mgr.checkpoint().result()
        _grow_big(hm, 5)
        newest = mgr.checkpoint().result()
    # damage the last page of every file of the newest checkpoint: the other
    # pages are read into frames first, then the candidate is abandoned
    for f in newest.own_files:
        p = tmp_path / f.path
        data = bytearray(p.read_bytes())
        data[-100] ^= 0xFF
        p.write_bytes(bytes(data))
    for target in (_pm(), pm):  # a fresh process, and the live one (which held more)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            man = restore(target, open_root(str(tmp_path)), "agg")
        assert man.name == "agg-1"
        assert any(issubclass(x.category, DamagedCheckpointWarning) for x in w)
        o = dict(oracle)
        hm2 = _map(target)
        _assert_equal(hm2, o, "after fallback")
        _hammer(hm2, o, 6)
