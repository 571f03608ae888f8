"""The read (`IOService.read_pages`), both ways: through the filesystem's streams
(``stream``: a `FaultyFS` without faults over the local filesystem), where
readers read ahead while verifier threads check and place earlier chunks; and
on local files (``local``), where each reader reads and verifies every chunk in
one compiled call. Damage found late, with chunks still in flight, must leave
no frame behind and fall back; bounce buffers must not be reused before their
chunk is verified and placed."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from ioservice import (CheckpointManager, CheckpointPolicy, DamagedCheckpointWarning, IOService,
                       open_root, restore)
from ioservice.errors import CheckpointDamagedError
from ioservice.format import PageTable
from ioservice.recovery import read_manifest
from tests.ioservice.ckpt_helpers import (PAGE_BYTES, faulty_root, mutate, new_pm,
                                          open_structures, state_of)

CHUNK = 2 * PAGE_BYTES  # two pages per read: many chunks per file, several in flight


@pytest.fixture(params=["local", "stream"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _two_checkpoints(tmp_path: Path, kind: str = "local"):
    pm = new_pm()
    s = open_structures(pm)
    mutate(s, 0, n=4000)
    if kind == "local":
        root = open_root(str(tmp_path))
        assert root._native_local
    else:
        root, _ = faulty_root(pafs.LocalFileSystem(), str(tmp_path))
        assert not root._native_local
    states = []
    with CheckpointManager(pm, root, "p", n_workers=2,
                           policy=CheckpointPolicy(full_every=1)) as mgr:
        for step in (1, 2):
            mutate(s, step, n=4000)
            mgr.checkpoint().result()
            states.append(state_of(s))
    return root, states


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["last-page", "first-page"])
@pytest.mark.parametrize("workers", [1, 3])
def test_damage_late_in_the_pipeline_leaves_nothing_and_falls_back(
        tmp_path: Path, where: str, workers: int, kind: str) -> None:
    """A damaged page among chunks in flight: the candidate's frames (committed,
    reserved, in verification) all go back, recovery falls back to p-1, and the
    page manager holds exactly p-1's pages, as a clean restore of p-1 leaves it."""
    root, states = _two_checkpoints(tmp_path, kind)
    man = read_manifest(root, "p-2")
    assert max(f.size_bytes for f in man.files) >= 8 * CHUNK  # many chunks per file
    victim = tmp_path / man.files[-1].path
    size = victim.stat().st_size
    _flip(victim, size - PAGE_BYTES // 2 if where == "last-page" else 100)

    ref = new_pm()
    assert restore(ref, root, "p", before_seq=2).name == "p-1"
    pm = new_pm()
    open_structures(pm)  # some state before, which the load replaces
    with IOService(workers, chunk_bytes=CHUNK) as io:
        with pytest.warns(DamagedCheckpointWarning, match=r"checkpoint p-2 .*checksum"):
            assert restore(pm, root, "p", io=io).name == "p-1"
    assert state_of(open_structures(pm)) == states[0]
    st = pm.stats()
    assert st["used_frames"] == ref.stats()["used_frames"]
    assert st["pinned_frames"] == 0 and st["orphan_frames"] == 0
    pm._check()


def test_failed_read_leaves_the_loader_empty_and_no_late_calls(tmp_path: Path,
                                                               kind: str) -> None:
    """After `read_pages` raises, no verifier thread touches the loader any more, and
    aborting the load frees every frame: none stays reserved by a chunk in flight."""
    root, _ = _two_checkpoints(tmp_path, kind)
    man = read_manifest(root, "p-2")
    _flip(tmp_path / man.files[0].path, 100)  # the first chunk: later ones are in flight
    pm = new_pm()
    loader = pm.begin_load()
    calls = [0]
    real_commit = loader.commit

    def commit(frames: np.ndarray) -> None:
        time.sleep(0.02)  # placement lags behind the reads
        real_commit(frames)
        calls[0] += 1

    loader.commit = commit  # type: ignore[method-assign]
    with IOService(1, chunk_bytes=CHUNK) as io:  # one reader, two verifier threads
        with pytest.raises(CheckpointDamagedError, match="checksum"):
            io.read_pages(root, man, loader.add)
        after = calls[0]
        time.sleep(0.2)
        assert calls[0] == after  # nothing placed after the call returned
    loader.abort()
    assert pm.stats()["used_frames"] == 0


def test_slow_sink_sees_every_page_intact(tmp_path: Path, kind: str) -> None:
    """A plain sink slower than the reads: pages go through the bounce buffers, which
    are reused only after their chunk was verified and handed over, so every page
    reaches the sink once and intact."""
    root, _ = _two_checkpoints(tmp_path, kind)
    man = read_manifest(root, "p-2")
    seen: dict[int, bytes] = {}
    lock = threading.Lock()

    def sink(pages: np.ndarray) -> None:
        time.sleep(0.002)
        ids = pages[:, 8:16].copy().view("<u8")[:, 0]
        with lock:
            for pid, page in zip(ids.tolist(), pages):
                assert pid not in seen
                seen[pid] = page.tobytes()

    with IOService(1, chunk_bytes=CHUNK) as io:
        io.read_pages(root, man, sink, verify=True)
    assert sorted(seen) == man.pages.page_id.tolist()
    for i in range(0, man.n_pages, 7):  # the bytes are the file's
        f = man.files[int(man.pages.file[i])]
        off = int(man.pages.offset[i])
        raw = (tmp_path / f.path).read_bytes()[off:off + PAGE_BYTES]
        assert seen[int(man.pages.page_id[i])] == raw


@pytest.mark.parametrize("damage", ["checksum", "page-id", "short", "missing"])
def test_local_read_names_the_damage_and_leaves_nothing(tmp_path: Path, damage: str) -> None:
    """The compiled local read finds each kind of damage in a page that is not the
    first of its chunk or of its ``pread`` piece, names the file (and page), and
    leaves no frame reserved; the same checkpoint undamaged loads bit-exact."""
    import ioservice.service as service
    root, states = _two_checkpoints(tmp_path, "local")
    man = read_manifest(root, "p-2")
    victim_row = int(np.flatnonzero(man.pages.file == 0)[5])  # the 6th page of file 0
    f = man.files[0]
    path = tmp_path / f.path
    off = int(man.pages.offset[victim_row])
    if damage == "checksum":
        _flip(path, off + PAGE_BYTES - 3)
        match = rf"{f.path}.*page {int(man.pages.page_id[victim_row]):#x}.*checksum"
    elif damage == "page-id":  # the manifest expects another PageID at that offset
        t = man.pages
        ids = t.page_id.copy()
        ids[victim_row] ^= np.uint64(1 << 40)
        man = dataclasses.replace(man, pages=PageTable(ids, t.file, t.offset, t.checksum))
        match = rf"{f.path}.*offset {off} has PageID"
    elif damage == "short":
        with open(path, "r+b") as fh:
            fh.truncate(off + PAGE_BYTES // 2)
        match = rf"{f.path}.*short file"
    else:
        path.unlink()
        match = rf"{f.path}.*missing"
    old = service.READ_PIECE_BYTES
    service.READ_PIECE_BYTES = 2 * PAGE_BYTES  # several pieces per chunk
    try:
        pm = new_pm()
        loader = pm.begin_load()
        with IOService(2, chunk_bytes=4 * PAGE_BYTES) as io:
            with pytest.raises(CheckpointDamagedError, match=match):
                io.read_pages(root, man, loader.add)
        loader.abort()
        assert pm.stats()["used_frames"] == 0
        if damage != "page-id":  # the files are damaged: recovery falls back to p-1
            with IOService(2, chunk_bytes=4 * PAGE_BYTES) as io:
                with pytest.warns(DamagedCheckpointWarning, match="checkpoint p-2"):
                    assert restore(pm, root, "p", io=io).name == "p-1"
            assert state_of(open_structures(pm)) == states[0]
        else:
            with IOService(2, chunk_bytes=4 * PAGE_BYTES) as io:
                assert restore(pm, root, "p", io=io).name == "p-2"
            assert state_of(open_structures(pm)) == states[1]
        pm._check()
    finally:
        service.READ_PIECE_BYTES = old


def test_restore_prefetches_the_candidates_page_files(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On local storage, restore asks the kernel to read each candidate's own page files
    (``POSIX_FADV_WILLNEED``) before it parses the manifest; a missing file is skipped
    and the damaged candidate still falls back; a partial restore prefetches nothing."""
    import os
    import ioservice.recovery as recovery
    root, states = _two_checkpoints(tmp_path, "local")
    advised: list[str] = []
    lock = threading.Lock()
    threads: list[threading.Thread] = []
    real_fadvise, real_thread = os.posix_fadvise, threading.Thread

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_WILLNEED
        with lock:
            advised.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fadvise(fd, offset, length, advice)

    def thread(*args, **kwargs):  # type: ignore[no-untyped-def]
        th = real_thread(*args, **kwargs)
        threads.append(th)
        return th

    monkeypatch.setattr(recovery.os, "posix_fadvise", fadvise)
    monkeypatch.setattr(recovery.threading, "Thread", thread)
    p2 = read_manifest(root, "p-2")
    (tmp_path / p2.files[0].path).unlink()
    pm = new_pm()
    with pytest.warns(DamagedCheckpointWarning, match="checkpoint p-2 .*missing"):
        assert restore(pm, root, "p").name == "p-1"
    for th in threads:
        th.join()
    assert state_of(open_structures(pm)) == states[0]
    want = {str(tmp_path / f.path) for f in p2.files[1:]} | \
        {str(tmp_path / f.path) for f in read_manifest(root, "p-1").files}
    assert set(advised) == want and len(advised) == len(want)
    advised.clear()
    restore(new_pm(), root, "p", before_seq=2, psid_ranges=[(0, 1 << 32)])
    for th in threads:
        th.join()
    assert advised == []
