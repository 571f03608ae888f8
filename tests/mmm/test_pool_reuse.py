"""Issue 8 §2: a frame handed out by ``PagePool.allocate(zero=True)`` is zero,
whatever its history: recycled, reused below an old high-water mark after
``reset_if_empty``, or inherited from another process's pool file.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mmm.pool import PagePool

PB = 4096


def _scribble(pool: PagePool, frames: np.ndarray, byte: int = 0xAB) -> None:
    pool.frames[frames] = byte


def test_reset_if_empty_then_allocate_gives_zero_frames() -> None:
    pool = PagePool(PB, 64 * PB)
    a = pool.allocate(40)
    _scribble(pool, a)
    pool.free(a)
    assert pool.reset_if_empty()
    b = pool.allocate(40)  # consecutive from frame 0 again: the old, written frames
    assert np.array_equal(np.sort(b), np.arange(40))
    assert not pool.frames[b].any(), "allocate(zero=True) handed out stale bytes"
    pool._check()


def test_reset_then_partial_reuse_and_free_list() -> None:
    pool = PagePool(PB, 64 * PB)
    a = pool.allocate(30)
    _scribble(pool, a)
    pool.free(a)
    pool.reset_if_empty()
    b = pool.allocate(5, zero=False)  # e.g. a restore reading pages in
    _scribble(pool, b, 0x11)
    c = pool.allocate(20)  # frames 5..24: written before the reset
    assert not pool.frames[c].any()
    pool.free(c[:10])
    d = pool.allocate(15)  # 10 recycled + 5 below the old mark
    assert not pool.frames[d].any()
    assert np.all(pool.frames[b] == 0x11), "zero=False frames are left as written"
    pool._check()


def test_zero_false_frames_count_as_used() -> None:
    pool = PagePool(PB, 16 * PB)
    a = pool.allocate(8, zero=False)  # fresh: a loader overwrites them
    _scribble(pool, a)
    pool.free(a)
    pool.reset_if_empty()
    assert not pool.frames[pool.allocate(8)].any()


def test_random_histories_always_zero() -> None:
    rng = np.random.default_rng(8)
    pool = PagePool(PB, 96 * PB)
    live: list[int] = []
    for step in range(600):
        op = rng.integers(0, 10)
        if op < 5 and pool.free_frames:
            n = int(rng.integers(1, min(12, pool.free_frames) + 1))
            zero = bool(rng.integers(0, 4))
            got = pool.allocate(n, zero=zero)
            if zero:
                assert not pool.frames[got].any(), f"step {step}: stale frame"
            _scribble(pool, got, int(rng.integers(1, 256)))
            live.extend(got.tolist())
        elif op < 9 and live:
            k = int(rng.integers(1, len(live) + 1))
            idx = rng.choice(len(live), k, replace=False)
            gone = np.array([live[i] for i in idx], dtype=np.int64)
            live = [f for i, f in enumerate(live) if i not in set(idx.tolist())]
            pool.free(gone)
        else:
            pool.free(np.array(live, dtype=np.int64))
            live = []
            assert pool.reset_if_empty()
        pool._check()


_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from mmm.pool import PagePool
    pool = PagePool(4096, 64 * 4096, sys.argv[1])
    f = pool.allocate(30)
    pool.frames[f] = 0xCD
    pool.free(f[5:])  # five frames stay live; 25 freed frames keep their bytes
    pool.flush()
""")


def test_attach_pool_file_of_another_process(tmp_path: Path) -> None:
    path = tmp_path / "pool.bin"
    subprocess.run([sys.executable, "-c", _WRITER, str(path)], check=True, timeout=600)  # a hang guard, not a speed check
    pool = PagePool.attach(str(path), PB)
    assert pool.used_frames == 5
    got = pool.allocate(40)  # below and above the dead process's high-water mark
    assert not pool.frames[got].any(), "attached pool handed out the other process's bytes"
    pool._check()


@pytest.mark.parametrize("zero", [True, False])
def test_fresh_pool_frames_are_zero(zero: bool) -> None:
    pool = PagePool(PB, 8 * PB)
    assert not pool.frames[pool.allocate(8, zero=zero)].any()
