"""A file-backed pool on a full file system: `PoolSpaceError` at allocation, never SIGBUS.

Each test mounts a tmpfs of a few MB (so it needs root; elsewhere it is skipped and
says why) and unmounts it whatever happens.
"""
from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mmm
from ioservice import CheckpointManager
from mmm import HashMap, KeyDict, OrderedMap, PagedDeque, PagedList, PoolExhaustedError, PoolSpaceError


@contextlib.contextmanager
def small_tmpfs(size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted on a fresh temporary directory, unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    d = tempfile.mkdtemp(prefix="sguard-small-tmpfs-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", d],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield Path(d)
    finally:
        gc.collect()  # page managers of the test still mapping a file there
        if subprocess.run(["umount", d], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", d], check=True)  # freed with the last mapping
        os.rmdir(d)


@pytest.fixture
def tmpfs_4m() -> Iterator[Path]:
    with small_tmpfs(4 << 20) as d:
        yield d


# -- one filler per structure: (create, one growing step, the state as plain values) ------------
def _hashmap(pm: mmm.PageManager) -> tuple[Callable[[int], None], Callable[[], Any], Any]:
    m = HashMap.create(pm, "m", key="<i8", value=[("n", "<i8")])

    def step(i: int) -> None:
        m.upsert(np.arange(i * 2000, (i + 1) * 2000, dtype="<i8"), combine={"n": "count"})
    return step, lambda: sorted(zip(*(a.tolist() for a in (m.keys(), m.values()["n"])))), m


def _ordered_map(pm: mmm.PageManager) -> tuple[Callable[[int], None], Callable[[], Any], Any]:
    m = OrderedMap.create(pm, "m", key="<i8", value="<i8")

    def step(i: int) -> None:
        k = np.random.default_rng(i).permutation(2000).astype("<i8") + i * 2000
        m.put(k, k * 3)
    return step, lambda: [a.tolist() for a in m.items()], m


def _paged_list(pm: mmm.PageManager) -> tuple[Callable[[int], None], Callable[[], Any], Any]:
    xs = PagedList.create(pm, "xs", "<i8")

    def step(i: int) -> None:
        xs.extend(np.arange(i * 2000, (i + 1) * 2000, dtype="<i8"))
    return step, lambda: xs.to_numpy().tolist(), xs


def _paged_deque(pm: mmm.PageManager) -> tuple[Callable[[int], None], Callable[[], Any], Any]:
    q = PagedDeque.create(pm, "q", "<i8")

    def step(i: int) -> None:
        recs = np.arange(i * 2000, (i + 1) * 2000, dtype="<i8")
        if i % 2:
            q.extendleft(recs)
        else:
            q.extend(recs)
    return step, lambda: q.to_numpy().tolist(), q


def _keydict(pm: mmm.PageManager) -> tuple[Callable[[int], None], Callable[[], Any], Any]:
    kd = KeyDict.create(pm, "kd")

    def step(i: int) -> None:
        keys = [b"key-%08d-" % j * 2 for j in range(i * 500, (i + 1) * 500)]
        data = np.frombuffer(b"".join(keys), np.uint8)
        offs = np.zeros(len(keys) + 1, np.int64)
        offs[1:] = np.cumsum([len(k) for k in keys])
        kd.intern(data, offs)

    def state() -> Any:
        return [np.asarray(a).tolist() for a in kd.items()]
    return step, state, kd


FILLERS = {"HashMap": _hashmap, "OrderedMap": _ordered_map, "PagedList": _paged_list,
           "PagedDeque": _paged_deque, "KeyDict": _keydict}


@pytest.mark.parametrize("kind", sorted(FILLERS))
def test_structure_filling_a_small_tmpfs_gets_space_error_then_goes_on(
        kind: str, tmpfs_4m: Path, tmp_path: Path) -> None:
    ballast = tmpfs_4m / "ballast"
    ballast.write_bytes(b"\1" * (512 << 10))  # given back after the error
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 30, path=str(tmpfs_4m / "pool"))
    step, state, s = FILLERS[kind](pm)
    err: PoolSpaceError | None = None
    for i in range(100_000):
        before = state()
        try:
            step(i)
        except PoolExhaustedError as exc:
            assert isinstance(exc, PoolSpaceError), repr(exc)
            err = exc
            break
    assert err is not None, "the tmpfs never filled up"
    # the failed call changed nothing, and the error says where, how much and how much is free
    assert state() == before
    pm.pool._check()
    s._check()
    assert err.directory == str(tmpfs_4m)
    assert err.needed_bytes > err.free_bytes >= 0
    msg = str(err)
    assert str(tmpfs_4m) in msg and f"{err.needed_bytes} more bytes" in msg
    assert f"{err.free_bytes} bytes free" in msg
    # a checkpoint of the state after the error restores it exactly
    with CheckpointManager(pm, str(tmp_path / "root"), "ha", n_workers=1) as mgr:
        pend = mgr.checkpoint()
        assert pend is not None
        pend.result()
    pm2 = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 30)
    with CheckpointManager(pm2, str(tmp_path / "root"), "ha", n_workers=1) as mgr:
        assert mgr.restore() is not None
    _, state2, s2 = FILLERS[kind](pm2)
    assert state2() == before
    s2._check()
    # given room, the same call succeeds
    ballast.unlink()
    step(i)
    assert state() != before
    pm.pool._check()
    s._check()


def test_reserved_frames_survive_attach_and_the_space_error_follows(tmpfs_4m: Path) -> None:
    path = str(tmpfs_4m / "pool")
    pool = mmm.PagePool(4096, 1 << 30, path)
    assert pool.reserved_bytes > 0
    frames = []
    with pytest.raises(PoolSpaceError):
        while True:
            frames.append(pool.allocate(16))
    used = pool.used_frames
    pool.frames[np.concatenate(frames)] = 7  # every frame handed out is backed: no SIGBUS
    reserved = pool.reserved_bytes
    del pool
    again = mmm.PagePool.attach(path, 4096)
    assert again.reserved_bytes == reserved  # read from the header: nothing reserved again
    assert again.used_frames == used
    with pytest.raises(PoolSpaceError):
        again.allocate(16)
    again._check()
    assert again.used_frames == used


def test_pool_larger_than_the_tmpfs_for_its_own_tables_fails_at_creation() -> None:
    with small_tmpfs(1 << 20) as d:
        path = d / "pool"
        with pytest.raises(PoolSpaceError, match=str(d)) as info:
            mmm.PagePool(1 << 20, 1 << 30, str(path))  # header and state table: 2 MB
        assert info.value.needed_bytes > info.value.free_bytes
        assert not path.exists()


def test_anonymous_pool_reserves_nothing() -> None:
    pool = mmm.PagePool(4096, 1 << 20)
    assert pool.reserved_bytes == 0
    assert pool.free_frames == pool.n_frames


def test_issue_scenario_ends_in_an_exception_not_sigbus(tmpfs_4m: Path) -> None:
    """64 KiB pages, a 1 GiB capacity, 200k new int64 keys per upsert (the 64 MB /dev/shm
    case, scaled to 4 MB): the process ends normally with the space error."""
    code = textwrap.dedent(f"""
        import numpy as np, mmm
        pm = mmm.PageManager(page_bytes=1 << 16, capacity_bytes=1 << 30,
                             path={str(tmpfs_4m / 'pool')!r})
        m = mmm.HashMap.create(pm, "m", key="<i8", value=[("n", "<i8")])
        try:
            for i in range(1000):
                m.upsert(np.arange(i * 200_000, (i + 1) * 200_000, dtype="<i8"),
                         combine={{"n": "count"}})
        except mmm.PoolSpaceError as exc:
            print("space error after", len(m), "keys:", exc)
        m._check()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "space error after" in r.stdout and "no space for the page pool" in r.stdout
