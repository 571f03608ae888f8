"""A page version, once given in a pool file, is never given again to the same page.

Incremental checkpoints after a re-attach rest on it: a worker that re-attaches a pool
file takes a page for unchanged since the recorded checkpoint when its header still
carries the recorded (page id, version) (`sguard.spark.checkpointing`). A page freed
after that checkpoint leaves no live page with its version, so a clock started above
the live pages only could give the same page id the same version again, with other
bytes. The clock of an attached pool starts above every version in the file's headers,
freed frames' included."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mmm import PageManager

PB = 4096


def _pairs(pm: PageManager) -> set[tuple[int, int]]:
    """(page id, version) of every live page."""
    out = set()
    for _, ps in pm.page_sets():
        seqs = ps.seqs()
        frames = ps.frames[seqs]
        h = pm.pool.headers
        out |= set(zip(h["page_id"][frames].tolist(), h["version"][frames].tolist()))
    return out


def _clone(pm: PageManager, psid: int, seqs: np.ndarray, times: int,
           seen: set[tuple[int, int]]) -> None:
    """Write `seqs` `times` times under a snapshot (each write clones: a new version)."""
    for _ in range(times):
        snap = pm.chkpt()
        pm.writable(psid, seqs)
        seen |= _pairs(pm)
        snap.release()


def test_a_freed_pages_version_is_not_given_again_after_attach(tmp_path: Path) -> None:
    path = str(tmp_path / "pool")
    pm = PageManager(PB, 256 * PB, path=path)
    psid = pm.create("s")
    seqs = pm.allocate(psid, 4)
    seen = _pairs(pm)
    _clone(pm, psid, seqs[-2:], 25, seen)      # the last two pages reach high versions
    high = max(v for _, v in seen)
    pm.release(psid, seqs[-2:])                # ... and are freed: no live page holds them
    assert max(v for _, v in _pairs(pm)) < high
    pm.flush()
    pm.close()

    pm = PageManager.attach(path, PB)
    assert pm.pool.clock >= high             # the next version given is above it
    again = pm.allocate(psid, 2)               # the freed page ids come back
    assert sorted(again.tolist()) == sorted(seqs[-2:].tolist())
    fresh = _pairs(pm)
    _clone(pm, psid, again, 30, fresh)         # versions climb through the old range
    ids = {(psid << 32) | int(s) for s in again}
    before = {(p, v) for p, v in seen if p in ids}
    after = {(p, v) for p, v in fresh if p in ids}
    assert len(after) > 30 and not before & after, \
        f"page ids given versions they had before the attach: {sorted(before & after)[:4]}"
