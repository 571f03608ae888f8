"""The pipelined read (`IOService.read_pages`): readers read ahead while verifier
threads check and place earlier chunks. Damage found late in the pipeline, with
chunks still in flight, must leave no frame behind and fall back; bounce buffers
must not be reused before their chunk is verified and placed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ioservice import (CheckpointManager, CheckpointPolicy, DamagedCheckpointWarning, IOService,
                       open_root, restore)
from ioservice.errors import CheckpointDamagedError
from ioservice.recovery import read_manifest
from tests.ioservice.ckpt_helpers import PAGE_BYTES, mutate, new_pm, open_structures, state_of

CHUNK = 2 * PAGE_BYTES  # two pages per read: many chunks per file, several in flight


def _two_checkpoints(tmp_path: Path):
    pm = new_pm()
    s = open_structures(pm)
    mutate(s, 0, n=4000)
    root = open_root(str(tmp_path))
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
        tmp_path: Path, where: str, workers: int) -> None:
    """A damaged page among chunks in flight: the candidate's frames (committed,
    reserved, in verification) all go back, recovery falls back to p-1, and the
    page manager holds exactly p-1's pages, as a clean restore of p-1 leaves it."""
    root, states = _two_checkpoints(tmp_path)
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


def test_failed_read_leaves_the_loader_empty_and_no_late_calls(tmp_path: Path) -> None:
    """After `read_pages` raises, no verifier thread touches the loader any more, and
    aborting the load frees every frame: none stays reserved by a chunk in flight."""
    root, _ = _two_checkpoints(tmp_path)
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


def test_slow_sink_sees_every_page_intact(tmp_path: Path) -> None:
    """A plain sink slower than the reads: pages go through the bounce buffers, which
    are reused only after their chunk was verified and handed over, so every page
    reaches the sink once and intact."""
    root, _ = _two_checkpoints(tmp_path)
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
