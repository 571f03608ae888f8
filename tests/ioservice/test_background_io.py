"""Checkpoint writers in the background by default: `IOService` writes at ``SCHED_IDLE``
with at most one core fewer threads than the machine has, reads at normal priority, and a
starved write is written on at normal priority (``rescue_after_s``); files, page order and
recovery are the same as with the previous defaults (two writers at normal priority, 256 MB
of staging)."""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ioservice import CheckpointManager, CheckpointPolicy, IOService, open_root, restore
from ioservice.format import checkpoint_dir
from tests.ioservice.ckpt_helpers import PAGE_BYTES, mutate, new_pm, open_structures, state_of

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="SCHED_IDLE is Linux's")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@linux_only
def test_defaults_write_sched_idle_on_one_core_fewer_and_read_at_normal_priority() -> None:
    me = os.sched_getscheduler(0)
    assert CheckpointPolicy().stage_mb == 0
    with IOService() as io:
        assert io.idle and io.rescue_after_s is not None
        assert io.write_threads == max(1, min(io.n_workers, _cpus() - 1))
        assert io._write_pool.submit(os.sched_getscheduler, 0).result() == os.SCHED_IDLE
        assert io._pool.submit(os.sched_getscheduler, 0).result() == me != os.SCHED_IDLE
    with IOService(2, idle=False) as io:  # normal writers need no rescuer
        assert io.rescue_after_s is None
        assert io._write_pool.submit(os.sched_getscheduler, 0).result() == me


def _snapshot_pages(snap) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.stack([np.array(snap.page(i)) for i in range(len(snap))])


def _file_pages(root_dir: Path, res) -> dict[int, bytes]:  # type: ignore[no-untyped-def]
    """page_id -> the bytes the files hold for it (through the write's page table)."""
    out = {}
    t = res.table
    for pid, f, off in zip(t.page_id.tolist(), t.file.tolist(), t.offset.tolist()):
        data = (root_dir / res.files[f].path).read_bytes()
        out[pid] = data[off:off + PAGE_BYTES]
    return out


def test_one_writer_thread_writes_every_file_whole_and_in_order(tmp_path: Path) -> None:
    """``write_threads=1`` with 4 files: the files are written one after the other by one
    thread, each holding its share's pages in share order, none lost or repeated."""
    pm = new_pm()
    s = open_structures(pm)
    mutate(s, 0, n=400)
    threads: set[int] = set()
    with IOService(4, chunk_bytes=3 * PAGE_BYTES, write_threads=1, rescue_after_s=None) as io:
        snap = pm.chkpt()
        want = _snapshot_pages(snap)
        res = io.write_snapshot(open_root(str(tmp_path)), "d", snap,
                                on_progress=lambda a, b: threads.add(threading.get_ident())
                                ).result()
        snap.complete()
    assert len(threads) == 1 and len(res.files) == 4
    assert res.rescued_chunks == 0
    got = b"".join((tmp_path / f.path).read_bytes() for f in res.files)
    assert got == want.tobytes()  # shares in file order, pages in share order


def test_a_starved_write_is_rescued_in_order_and_the_writer_finds_it_done(
        tmp_path: Path) -> None:
    """The only writer thread is busy elsewhere (as if starved): after ``rescue_after_s``
    a thread of normal priority writes every file, chunk by chunk in order; the queued
    writer tasks then find nothing left to write."""
    pm = new_pm()
    s = open_structures(pm)
    mutate(s, 1, n=400)
    gate = threading.Event()
    with IOService(3, chunk_bytes=2 * PAGE_BYTES, write_threads=1, rescue_after_s=0.01) as io:
        blocker = io._write_pool.submit(gate.wait, 60)
        snap = pm.chkpt()
        want = _snapshot_pages(snap)
        res = io.write_snapshot(open_root(str(tmp_path)), "d", snap).result(timeout=60)
        assert not blocker.done()  # written while the writer was held
        gate.set()
        snap.complete()
    n_chunks = sum(-(-len(share) // 2) for share in np.array_split(np.arange(len(want)), 3))
    assert res.rescued_chunks >= n_chunks  # every chunk (and each file's close step)
    got = b"".join((tmp_path / f.path).read_bytes() for f in res.files)
    assert got == want.tobytes()
    assert _file_pages(tmp_path, res) == {int(p): want[i].tobytes()
                                          for i, p in enumerate(snap.page_ids)}


def test_without_rescue_a_starved_write_waits_for_its_writer(tmp_path: Path) -> None:
    pm = new_pm()
    mutate(open_structures(pm), 2, n=50)
    gate = threading.Event()
    with IOService(2, write_threads=1, rescue_after_s=None) as io:
        io._write_pool.submit(gate.wait, 60)
        snap = pm.chkpt()
        fut = io.write_snapshot(open_root(str(tmp_path)), "d", snap)
        time.sleep(0.3)
        assert not fut.done()  # no rescuer: the write waits for its (busy) writer
        gate.set()
        assert fut.result(timeout=60).rescued_chunks == 0
        snap.complete()


def test_checkpoints_at_the_new_and_previous_defaults_are_byte_identical_and_restore(
        tmp_path: Path) -> None:
    """The same state checkpointed (full, then incremental) at the new defaults and at
    the previous ones (two normal-priority writers, 256 MB staging): the same pages with
    the same checksums, file for file the same bytes, and both restore the state."""
    pms = {"new": new_pm(), "previous": new_pm()}  # the same operations on each
    ss = {k: open_structures(pm) for k, pm in pms.items()}
    roots = {"new": tmp_path / "new", "previous": tmp_path / "previous"}
    io_prev = IOService(2, idle=False, write_threads=2)
    mgrs = {"new": CheckpointManager(pms["new"], str(roots["new"]), "u", io=IOService(2)),
            "previous": CheckpointManager(pms["previous"], str(roots["previous"]), "u",
                                          io=io_prev, policy=CheckpointPolicy(stage_mb=256))}
    try:
        for step in range(3):
            for s in ss.values():
                mutate(s, step, n=200)
            mans = {k: m.checkpoint().result(timeout_s=120) for k, m in mgrs.items()}
            a, b = mans["new"], mans["previous"]
            assert a.name == b.name
            assert np.array_equal(a.pages.page_id, b.pages.page_id)
            assert np.array_equal(a.pages.checksum, b.pages.checksum)
            assert [f.path for f in a.files] == [f.path for f in b.files]
            for f in a.files:
                if f.path.startswith(checkpoint_dir(a.name)):
                    assert (roots["new"] / f.path).read_bytes() == \
                        (roots["previous"] / f.path).read_bytes()
        assert mgrs["previous"].counters["pages_staged"] > 0
        assert mgrs["new"].counters["pages_staged"] == 0
    finally:
        for k, m in mgrs.items():
            m.close()
            m.io.shutdown()
    want = state_of(ss["new"])
    assert state_of(ss["previous"]) == want
    for k, root in roots.items():
        pm2 = new_pm()
        assert restore(pm2, open_root(str(root)), "u").name == "u-3"
        assert state_of(open_structures(pm2)) == want, k


@pytest.mark.parametrize("bad", [0, 5, 1.5, True, "2"])
def test_io_service_refuses_bad_write_threads(bad: object) -> None:
    with pytest.raises(ValueError, match="write_threads"):
        IOService(4, write_threads=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1.0, True, "1"])
def test_io_service_refuses_a_bad_rescue_after_s(bad: object) -> None:
    with pytest.raises(ValueError, match="rescue_after_s"):
        IOService(2, rescue_after_s=bad)  # type: ignore[arg-type]


def _may_raise_priority() -> bool:
    """Whether this process may move a SCHED_IDLE thread back to normal priority."""
    out: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            out.append(True)
        except OSError:
            out.append(False)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return out[0]


@linux_only
def test_a_stalled_write_raises_its_writer_to_normal_priority_then_lowers_it(
        tmp_path: Path) -> None:
    """Slow storage stalls the SCHED_IDLE writer inside its chunks: the rescuer raises it
    to normal priority (where permitted) while the write lasts, and lowers it after; the
    file is whole and in order."""
    from tests.ioservice.ckpt_helpers import faulty_root
    import pyarrow.fs as pafs
    pm = new_pm()
    mutate(open_structures(pm), 3, n=200)
    root, _ = faulty_root(pafs.LocalFileSystem(), str(tmp_path), latency_s=0.05)
    policies: list[int] = []
    with IOService(1, chunk_bytes=4 * PAGE_BYTES, rescue_after_s=0.01) as io:
        snap = pm.chkpt()
        want = _snapshot_pages(snap)

        def seen(a: int, b: int) -> None:  # the writer's policy (not the rescuer's own)
            if threading.current_thread().name.startswith("sguard-io-write"):
                policies.append(os.sched_getscheduler(0))

        res = io.write_snapshot(root, "d", snap, on_progress=seen).result(timeout=120)
        snap.complete()
        # the rescuer lowers the writer when the write ends, which may be just after the
        # result is set: wait (bounded) for it rather than race it
        deadline = time.monotonic() + 10
        while (io._write_pool.submit(os.sched_getscheduler, 0).result() != os.SCHED_IDLE
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert io._write_pool.submit(os.sched_getscheduler, 0).result() == os.SCHED_IDLE
    got = b"".join((tmp_path / f.path).read_bytes() for f in res.files)
    assert got == want.tobytes()
    if _may_raise_priority():
        assert os.SCHED_OTHER in policies  # raised while stalled
    else:
        assert set(policies) <= {os.SCHED_IDLE}
