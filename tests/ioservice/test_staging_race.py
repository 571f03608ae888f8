"""Stress: the stager, the I/O threads and the operator race on every page.

Checkpoints stage their pages (`CheckpointPolicy.stage_mb`: a background thread
copies the pages to write out of the pool and unpins them, `mmm.Snapshot.stage_planned`)
while the operator keeps mutating every structure, touching every page of the
hash map in each round. The stager copies one page or a few at a time, storage
is written in small chunks and held until the operator has run, and on some
checkpoints the stager is held too, so the operator clones pages the stager
copies later. Oracles: every checkpoint, restored into a new page manager,
equals the state at its freeze point; the live state equals the same mutations
replayed without any checkpoint; the page manager's invariants hold.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from ioservice import CheckpointManager, CheckpointPolicy, IOService, restore
from mmm import snapshot as snapshot_mod
from tests.ioservice.ckpt_helpers import (PAGE_BYTES, faulty_root, mutate, new_pm,
                                          open_structures, state_of)


def touch_every_page(s: dict, step: int) -> None:
    """A batch that writes every record of the hash map (so every one of its pages)."""
    keys = s["counts"].keys()
    rng = np.random.default_rng(10_000 + step)
    s["counts"].upsert(keys, {"x": rng.random(len(keys))}, {"n": "count", "s": ("sum", "x")})


@pytest.mark.parametrize("stager_pages", [1, 5])
def test_stager_io_and_operator_race_on_every_page(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   stager_pages: int) -> None:
    monkeypatch.setattr(snapshot_mod, "STAGE_CHUNK_BYTES", stager_pages * PAGE_BYTES)
    gate = threading.Event()  # odd checkpoints: the stager waits until the operator ran
    real = snapshot_mod.gather_frames

    def gated(*a: object) -> None:
        gate.wait(600)  # a hang guard
        real(*a)

    monkeypatch.setattr(snapshot_mod, "gather_frames", gated)
    root, fs = faulty_root(pafs.LocalFileSystem(), str(tmp_path / "store"), latency_s=0.001)
    io = IOService(2, chunk_bytes=3 * PAGE_BYTES)
    pm = new_pm()
    s = open_structures(pm)
    mgr = CheckpointManager(pm, root, "race", io=io,
                            policy=CheckpointPolicy(keep=None, full_every=3, stage_mb=256))
    at_freeze: dict[int, dict[str, str]] = {}
    ops: list[tuple[str, int]] = []
    cloned = 0

    def apply(s: dict, op: str, step: int) -> None:
        (mutate if op == "mutate" else touch_every_page)(s, step)
        ops.append((op, step))

    step = 0
    for c in range(6):
        apply(s, "mutate", step)
        step += 1
        gate.clear() if c % 2 else gate.set()
        fs.write_gate = held = threading.Event()  # storage waits until the operator has run
        c0 = pm.stats()["pages_cloned"]
        pending = mgr.checkpoint()
        assert pending is not None
        at_freeze[pending.seq] = state_of(s)
        apply(s, "touch", step)  # odd c: the stager is held, the operator clones for itself
        gate.set()
        for _ in range(2):  # while the write is held in flight (ordering, not timing)
            apply(s, "mutate", step)
            apply(s, "touch", step)
            step += 1
        assert not pending.done()
        held.set()
        while not pending.done():
            apply(s, "mutate", step)
            apply(s, "touch", step)
            step += 1
        pending.result()
        cloned += pm.stats()["pages_cloned"] - c0
    staged = mgr.counters.get("pages_staged", 0)
    live = state_of(s)
    mgr.close()
    io.shutdown()
    assert staged > 0 and cloned > 0  # both paths ran
    pm._check()
    for seq, want in at_freeze.items():
        pm2 = new_pm()
        man = restore(pm2, root, "race", before_seq=seq + 1)
        assert man.seq == seq
        assert state_of(open_structures(pm2)) == want, f"checkpoint {seq}"
    s3 = open_structures(new_pm())
    for op, k in ops:
        (mutate if op == "mutate" else touch_every_page)(s3, k)
    assert state_of(s3) == live


def test_stage_mb_zero_stages_nothing(tmp_path: Path) -> None:
    pm = new_pm()
    s = open_structures(pm)
    mutate(s, 0)
    mgr = CheckpointManager(pm, "file://" + str(tmp_path / "store"), "off",
                            policy=CheckpointPolicy(stage_mb=0))
    mgr.checkpoint()
    mgr.wait()
    assert mgr.counters.get("pages_staged", 0) == 0
    mgr.close()
    with pytest.raises(ValueError, match="stage_mb"):
        CheckpointPolicy(stage_mb=-1)
