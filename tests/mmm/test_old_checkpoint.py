"""A checkpoint written by the numpy state core (before the compiled kernels) still restores.

``data/old_checkpoint`` was written by ``data/make_old_checkpoint.py`` with the
code of commit 47c5430; the page layout and checkpoint format must not change,
so the current code reads it back, rebuilds each structure's index from the
pages, answers queries and keeps working on it (a mutation, then a structure
check).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

import mmm
from ioservice import CheckpointManager
from mmm.structures.ordered_map import OrderedMap
from mmm.structures.sequence import PagedDeque, PagedList
from tests.mmm.data.make_old_checkpoint import HAUNIT, PAGE_BYTES, WIN_DT

DATA = Path(__file__).resolve().parent / "data"


def test_old_checkpoint_restores(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(DATA / "old_checkpoint", root)  # restore never writes, but be safe
    want = json.loads((DATA / "old_checkpoint_expected.json").read_text())
    pm = mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=1 << 22)
    with CheckpointManager(pm, str(root), HAUNIT, n_workers=2) as mgr:
        man = mgr.restore()
    assert man is not None and man.name == "old-1"
    assert pm.names() == ["idx", "log", "win"]
    idx = OrderedMap.create(pm, "idx", key="<i8", value=[("v", "<i8")])
    win = PagedDeque.create(pm, "win", WIN_DT)
    log = PagedList.create(pm, "log", "<f8")
    k, v = idx.items()
    assert k.tolist() == want["idx_keys"] and v["v"].tolist() == want["idx_v"]
    assert idx.page_count > 3  # several leaves: the fence index was rebuilt from the chain
    w = win.to_numpy()
    assert w["ts"].tolist() == want["win_ts"] and w["key"].tolist() == want["win_key"]
    assert w["val"].tolist() == want["win_val"]
    assert log.to_numpy().tolist() == want["log"]
    # point and range queries through the search kernels
    keys = np.asarray(want["idx_keys"], "<i8")
    found, got = idx.get(np.r_[keys, keys + 1])
    assert found[:len(keys)].all() and not found[len(keys):].any()
    assert got["v"][:len(keys)].tolist() == want["idx_v"]
    lo, hi = int(keys[3]), int(keys[-3])
    assert idx.range(lo, hi)[0].tolist() == [x for x in want["idx_keys"] if lo <= x < hi]
    # the restored structures keep working
    idx.put(np.array([1, 2, 3], "<i8"), np.array([(1,), (2,), (3,)], idx.value_dtype))
    win.evict_before(want["win_ts"][5], "ts")
    log.extend(np.array([7.0]))
    idx._check()
    win._check()
    log._check()
    assert len(win) == len(want["win_ts"]) - 5
    assert log[-1] == 7.0 and len(log) == len(want["log"]) + 1
