"""The pool's scalar allocation and orphaning (the per-page copy-on-write path) and the
reset when the last used frame is freed."""
from __future__ import annotations

import numpy as np
import pytest

from mmm.errors import PoolExhaustedError
from mmm.pool import FREE, LIVE, ORPHAN, PagePool

PB = 4096


def test_allocate1_takes_free_list_then_fresh_frames() -> None:
    pool = PagePool(PB, 8 * PB)
    a = pool.allocate(3)
    pool.free(a[1:2])
    f = pool.allocate1()
    assert f == int(a[1]) and pool.state[f] == LIVE
    g = pool.allocate1()
    assert g == 3 and pool.used_frames == 4
    pool._check()


def test_allocate1_exhausted_changes_nothing() -> None:
    pool = PagePool(PB, 2 * PB)
    pool.allocate(pool.n_frames)
    before = (pool.used_frames, pool.state.copy(), list(pool._free))
    with pytest.raises(PoolExhaustedError, match="1 page"):
        pool.allocate1()
    assert pool.used_frames == before[0]
    assert np.array_equal(pool.state, before[1]) and pool._free == before[2]
    pool._check()


def test_orphan1_keeps_a_pinned_frame_and_frees_an_unpinned_one() -> None:
    pool = PagePool(PB, 8 * PB)
    a = pool.allocate(3)
    pool.pin(a[:1])
    pool.orphan1(int(a[0]))
    pool.orphan1(int(a[1]))
    assert pool.state[a[0]] == ORPHAN and pool.state[a[1]] == FREE
    assert pool.used_frames == 2
    pool._check()
    pool.unpin(a[:1])
    assert pool.state[a[0]] == FREE
    pool._check()


def test_freeing_the_last_frames_resets_and_zeroes_on_reuse() -> None:
    pool = PagePool(PB, 8 * PB)
    a = pool.allocate(5)
    pool.frames[a] = 7
    pool.free(a[::-1])
    assert pool.used_frames == 0 and pool._free == [] and pool._watermark == 0
    pool._check()
    b = pool.allocate(5)
    assert b.tolist() == list(range(5)) and not pool.frames[b].any()
    c = pool.allocate(2, zero=False)  # fresh frames above every earlier use
    assert c.tolist() == [5, 6]
    pool._check()
