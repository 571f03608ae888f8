"""A rollback marks only the pages the rolled-back work touched as changed.

The Spark runtime keeps a rollback point per batch; after a retried task the
next incremental checkpoint must write the pages the undone batch touched (their
bytes in any checkpoint taken meanwhile were undone), not the whole state.
"""
from __future__ import annotations

import numpy as np

import mmm
from mmm.structures.hashmap import HashMap

PB = 4096
VAL = np.dtype([("n", "<i8")])


def _map(pm: mmm.PageManager, n: int = 20_000) -> HashMap:
    m = HashMap.create(pm, "m", key="<u4", value=VAL)
    m.upsert(np.arange(n, dtype="<u4"), combine={"n": "count"})
    return m


def test_rollback_marks_only_the_pages_the_rolled_back_work_touched() -> None:
    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=64 << 20)
    m = _map(pm)
    pm.chkpt().complete()  # durable: nothing is "changed" now
    point = pm.chkpt()  # a rollback point, as the Spark runtime keeps one per batch
    assert point.n_changed == 0
    keys = np.array([5, 17, 1234], dtype="<u4")
    m.upsert(keys, combine={"n": "count"})  # touches a few pages
    touched = pm.stats()["pages_cloned"]
    assert 1 <= touched <= 3
    pm.rollback(point)
    nxt = pm.chkpt()
    assert nxt.n_changed == touched  # not the whole map (was: every page)
    assert nxt.n_changed < len(nxt) // 10
    nxt.release()
    pm._check()


def test_rollback_after_a_later_checkpoint_completed_still_writes_the_touched_pages() -> None:
    """Pages written between the rollback point and a checkpoint that completed
    after it hold, in that checkpoint, bytes the rollback undid: they must be
    written again by the next checkpoint."""
    pm = mmm.PageManager(page_bytes=PB, capacity_bytes=64 << 20)
    m = _map(pm)
    pm.chkpt().complete()
    point = pm.chkpt()
    m.upsert(np.array([5, 17], dtype="<u4"), combine={"n": "count"})
    touched = pm.stats()["pages_cloned"]
    later = pm.chkpt()  # a checkpoint of the state after the batch ...
    later.complete()  # ... that became durable
    pm.rollback(point)
    nxt = pm.chkpt()
    assert nxt.n_changed == touched
    nxt.release()
