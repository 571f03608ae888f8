"""The pool's memory and the kernels' byte copies.

* `mmm._kernels.pages.copy_bytes` / `move_bytes` (what every kernel copies bytes with)
  agree with numpy's slice assignment, overlapping moves included;
* an in-memory pool's frames and undo log are private anonymous memory: a forked child
  writing them changes nothing in the parent, and neither is advised for transparent
  huge pages (whose page faults can stall the operator while the kernel compacts memory);
* a sequence page the append allocates unzeroed holds zero bytes after its records, so
  a page's bytes (and a checkpoint's) never depend on what its frame held before.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st

import mmm
from mmm._kernels.pages import copy_bytes, move_bytes
from mmm.page import HEADER_BYTES
from mmm.structures.sequence import PagedDeque

REC = np.dtype([("ts", "<i8"), ("key", "<u4"), ("val", "<i8")])


@given(n=st.integers(0, 300), src=st.integers(0, 300), dst=st.integers(0, 300),
       seed=st.integers(0, 2**32 - 1))
def test_move_bytes_is_a_memmove(n: int, src: int, dst: int, seed: int) -> None:
    """Any overlap, either direction: the bytes a copy through a temporary gives."""
    row = np.random.default_rng(seed).integers(0, 256, 700).astype(np.uint8)
    want = row.copy()
    want[dst:dst + n] = row[src:src + n].copy()
    move_bytes(row, dst, src, n)
    assert row.tobytes() == want.tobytes()


@given(n=st.integers(0, 5000), seed=st.integers(0, 2**32 - 1))
def test_copy_bytes_copies_every_byte_and_nothing_else(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, n).astype(np.uint8)
    dst = np.full(n + 16, 7, np.uint8)
    copy_bytes(dst[8:8 + n], src)
    assert dst[8:8 + n].tobytes() == src.tobytes()
    assert (dst[:8] == 7).all() and (dst[8 + n:] == 7).all()


def _vm_flags(addr: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds `addr`."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_pool_memory_is_not_advised_for_huge_pages() -> None:
    """numpy advises large arrays for transparent huge pages (``hg``); the pool's frames
    and undo log must not be (a numpy array of the same size is, as the control)."""
    pm = mmm.PageManager(capacity_bytes=64 << 20)
    control = np.zeros(64 << 20, np.uint8)
    # (numpy advises from the array's first whole 4 KiB page on: look 1 MiB in)
    assert "hg" in _vm_flags(control.ctypes.data + (1 << 20)) or not _numpy_advises()
    for arr in (pm.pool.frames, pm.pool.undo, pm.pool.undo_data):
        for at in (0, arr.nbytes // 2, arr.nbytes - 1):
            assert "hg" not in _vm_flags(arr.ctypes.data + at)


def _numpy_advises() -> bool:
    from numpy._core import multiarray
    return bool(getattr(multiarray, "_get_madvise_hugepage", lambda: False)())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_write_the_parents_pool() -> None:
    pm = mmm.PageManager(capacity_bytes=1 << 20)
    d = PagedDeque.create(pm, "d", REC)
    d.extend(np.zeros(10, REC))
    before = pm.pool.frames.tobytes(), pm.pool.undo.tobytes(), pm.pool.undo_data[:64].tobytes()
    pid = os.fork()
    if pid == 0:  # the child scribbles over all three, then leaves without cleanup
        pm.pool.frames[:] = 0xAB
        pm.pool.undo[:] = -1
        pm.pool.undo_data[:64] = 0xCD
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    after = pm.pool.frames.tobytes(), pm.pool.undo.tobytes(), pm.pool.undo_data[:64].tobytes()
    assert after == before
    assert len(d) == 10


def test_appended_pages_are_zero_after_their_records() -> None:
    """Frames recycled full of other bytes: the append writes its records, the header,
    and zeroes the rest of each new page."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    junk = PagedDeque.create(pm, "junk", np.dtype("<u8"))
    junk.extend(np.full(20_000, 0xFF, np.uint8).view("<u8"))
    used = pm.pool.stats()["used_frames"]
    junk.destroy()  # its frames, full of 0xFF, go back to the pool for the next pages
    assert pm.pool.stats()["used_frames"] < used - 4
    d = PagedDeque.create(pm, "d", REC)
    recs = np.zeros(1000, REC)
    recs["ts"] = np.arange(1000)
    recs["key"] = 3
    recs["val"] = -1
    d.extend(recs[:7])      # a partial first page
    d.extend(recs[7:])      # fills it, then new pages, the last one partial
    assert d.to_numpy().tobytes() == recs.tobytes()
    ps = pm.page_set(d.psid)
    for seq in ps.seqs().tolist():
        if seq == 0:
            continue  # the super page
        f = int(ps.frames[seq])
        start, count = int(pm.pool.headers["start"][f]), int(pm.pool.headers["count"][f])
        body = pm.pool.frames[f, HEADER_BYTES:]
        end = (start + count) * REC.itemsize
        assert not body[end:].any(), f"page seq {seq}: bytes after its records"
        assert not body[:start * REC.itemsize].any(), f"page seq {seq}: bytes before them"
