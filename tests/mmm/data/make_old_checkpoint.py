"""Write ``old_checkpoint/``: a checkpoint made by the numpy (pre-kernel) state core.

Run once, from the repository root, with the code of commit 47c5430 (before the
compiled kernels): ``python -m tests.mmm.data.make_old_checkpoint``. The test
``tests/mmm/test_old_checkpoint.py`` restores it with the current code and
compares every structure with ``old_checkpoint_expected.json`` (plain JSON lists,
written by this script from the live structures at checkpoint time).

The state has the page shapes the kernels must read back: an OrderedMap of
several leaves (after splits and a merge-inducing delete), a PagedDeque whose
head page starts mid-page (popleft / evict), and a PagedList whose head page
was prepended (``start > 0``) and whose middle was deleted.
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

HERE = Path(__file__).resolve().parent
HAUNIT = "old"
PAGE_BYTES = 4096
WIN_DT = np.dtype([("ts", "<i8"), ("key", "<u4"), ("val", "<i8")])


def build(pm: mmm.PageManager) -> dict[str, object]:
    idx = OrderedMap.create(pm, "idx", key="<i8", value=[("v", "<i8")], page_slots=16)
    win = PagedDeque.create(pm, "win", WIN_DT, page_slots=20)
    log = PagedList.create(pm, "log", "<f8", page_slots=12)
    rng = np.random.default_rng(10)
    k = rng.permutation(np.arange(-60, 60, dtype="<i8") * 7)
    idx.put(k, np.array([(int(x) * 3,) for x in k], idx.value_dtype))
    idx.delete(np.arange(-60, 0, dtype="<i8") * 7 * 2)
    idx[5] = (55,)
    rec = np.zeros(70, WIN_DT)
    rec["ts"] = np.cumsum(rng.integers(1, 4, 70))
    rec["key"] = rng.integers(0, 9, 70)
    rec["val"] = rng.integers(0, 1000, 70)
    win.extend(rec)
    win.evict_before(int(rec["ts"][13]), "ts")
    win.popleft()
    win.append((10_000, 3, 7))
    log.extend(np.arange(40, dtype="<f8") / 4)
    log.extendleft(np.array([-1.5, -2.5, -3.5]))
    del log[10:17]
    log.insert(5, 99.25)
    return {"idx": idx, "win": win, "log": log}


def expected(s: dict[str, object]) -> dict[str, object]:
    idx, win, log = s["idx"], s["win"], s["log"]
    k, v = idx.items()  # type: ignore[attr-defined]
    w = win.to_numpy()  # type: ignore[attr-defined]
    return {"idx_keys": k.tolist(), "idx_v": v["v"].tolist(),
            "win_ts": w["ts"].tolist(), "win_key": w["key"].tolist(),
            "win_val": w["val"].tolist(),
            "log": log.to_numpy().tolist()}  # type: ignore[attr-defined]


def main() -> None:
    out = HERE / "old_checkpoint"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    pm = mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=1 << 22)
    s = build(pm)
    with CheckpointManager(pm, str(out), HAUNIT, n_workers=1) as mgr:
        mgr.checkpoint().future.result()
    (HERE / "old_checkpoint_expected.json").write_text(json.dumps(expected(s), indent=0) + "\n")


if __name__ == "__main__":
    main()
