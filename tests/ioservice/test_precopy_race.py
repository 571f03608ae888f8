"""Stress: the background copier, the I/O threads and the operator race on every page.

Checkpoints are taken with the background precopy on (`CheckpointPolicy.precopy`)
while the operator keeps mutating every structure, touching every
page of the hash map in each round. Storage is slowed down and written in small
chunks (the I/O threads release pages a few at a time) and the copier publishes
a page or two at a time, so the three threads interleave on every page. Oracles:
every checkpoint, restored into a new page manager, equals the state at its
freeze point; the live state equals the same mutations replayed without any
checkpoint; the page manager's invariants hold.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from ioservice import CheckpointManager, CheckpointPolicy, IOService, restore
from mmm import precopy as precopy_mod
from tests.ioservice.ckpt_helpers import (PAGE_BYTES, faulty_root, mutate, new_pm,
                                          open_structures, state_of)


def touch_every_page(s: dict, step: int) -> None:
    """A batch that writes every record of the hash map (so every one of its pages)."""
    keys = s["counts"].keys()
    rng = np.random.default_rng(10_000 + step)
    s["counts"].upsert(keys, {"x": rng.random(len(keys))}, {"n": "count", "s": ("sum", "x")})


@pytest.mark.parametrize("copier_pages", [1, 2, 5])
def test_copier_io_and_operator_race_on_every_page(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   copier_pages: int) -> None:
    monkeypatch.setattr(precopy_mod, "CHUNK_BYTES", copier_pages * PAGE_BYTES)
    # on odd checkpoints the copier waits until the operator has touched every page
    # once (so the operator's own clones race the copier's), on even ones it runs free
    gate = threading.Event()
    real_copy = precopy_mod.copy_frames

    def gated_copy(frames: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        gate.wait(30)
        real_copy(frames, src, dst)

    monkeypatch.setattr(precopy_mod, "copy_frames", gated_copy)
    root, fs = faulty_root(pafs.LocalFileSystem(), str(tmp_path / "store"), latency_s=0.001)
    io = IOService(2, chunk_bytes=3 * PAGE_BYTES)
    pm = new_pm()
    s = open_structures(pm)
    mgr = CheckpointManager(pm, root, "race", io=io,
                            policy=CheckpointPolicy(keep=None, full_every=3, precopy=True))
    assert mgr.policy.precopy
    at_freeze: dict[int, dict[str, str]] = {}
    ops: list[tuple[str, int]] = []  # what was applied, to replay without checkpoints

    def apply(s: dict, op: str, step: int) -> None:
        (mutate if op == "mutate" else touch_every_page)(s, step)
        ops.append((op, step))

    step = 0
    in_flight_steps = 0
    for c in range(6):
        apply(s, "mutate", step)
        step += 1
        if c % 2:
            gate.clear()
        else:
            gate.set()
        fs.write_gate = held = threading.Event()  # storage waits until the operator has run
        pending = mgr.checkpoint()
        assert pending is not None
        at_freeze[pending.seq] = state_of(s)
        if c % 4 == 0:  # the copier finishes first: the operator meets only shadows
            for job in list(pm._precopy):
                assert job.done.wait(60)
        apply(s, "touch", step)  # c % 4 == 2: right away, racing the copier's first chunks;
        gate.set()               # odd c: the copier is held, the operator clones for itself
        for _ in range(2):  # while the write is held in flight (ordering, not timing)
            apply(s, "mutate", step)
            apply(s, "touch", step)
            step += 1
            in_flight_steps += 1
        assert not pending.done()
        held.set()
        while not pending.done():
            apply(s, "mutate", step)
            apply(s, "touch", step)
            step += 1
            in_flight_steps += 1
        pending.result()
    live = state_of(s)
    st = pm.stats()
    mgr.close()
    io.shutdown()
    # the race happened: mutations while pages were being written, pages un-shared by
    # the copier and adopted, others cloned by the operator itself
    assert in_flight_steps >= 6
    assert st["pages_precopied"] > 0
    assert st["pages_cloned"] > 0
    for job in pm._precopy:
        job.done.wait(30)
    pm.adopt_precopied()
    assert pm._precopy == []  # every copy adopted or freed
    pm._check()
    # every checkpoint equals the state at its freeze point
    for seq, want in at_freeze.items():
        pm2 = new_pm()
        man = restore(pm2, root, "race", before_seq=seq + 1)
        assert man.seq == seq
        assert state_of(open_structures(pm2)) == want, f"checkpoint {seq}"
    # the live state equals the same operations replayed without any checkpoint
    s3 = open_structures(new_pm())
    for op, k in ops:
        (mutate if op == "mutate" else touch_every_page)(s3, k)
    assert state_of(s3) == live
