"""A checkpoint written by the numpy HashMap (before the numba kernels) still restores,
and the restored maps keep working (upserts, deletes, splits) against a dict."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

import mmm
from ioservice.manager import CheckpointManager
from mmm.structures.hashmap import HashMap

DATA = Path(__file__).resolve().parent / "data"
VALUE = np.dtype([("n", "<i8"), ("lo", "<i8"), ("hi", "<i8"), ("last", "<f8")])
SPEC = {"n": "count", "lo": ("min", "ts"), "hi": ("max", "ts"), "last": ("last", "x")}
SKEY = np.dtype([("a", "<i2"), ("b", "S5")], align=True)


def test_old_format_checkpoint_restores_and_keeps_working(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(DATA / "old_hashmap_ckpt", root)
    expect = json.loads((DATA / "old_hashmap_ckpt.json").read_text())
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    with CheckpointManager(pm, str(root), "old") as mgr:
        man = mgr.restore()
    assert man is not None and man.user_meta["offset"] == 2
    agg = HashMap.create(pm, "agg", key="<u4", value=VALUE)
    sk = HashMap.create(pm, "skeys", key=SKEY, value="<i8", page_slots=8)
    agg._check()
    sk._check()
    k, v = agg.items()
    assert sorted([int(a)] + list(b) for a, b in zip(k.tolist(), v.tolist())) == \
        [list(r) for r in expect["agg"]]
    s_k, s_v = sk.items()
    assert sorted([int(a[0]), a[1].decode(), int(b)] for a, b in zip(s_k.tolist(),
                                                                     s_v.tolist())) == \
        [list(r) for r in expect["skeys"]]
    # the restored pages keep working with today's code
    model = {r[0]: tuple(r[1:]) for r in expect["agg"]}
    keys = np.arange(0, 400, dtype="<u4")
    ts = (np.arange(400) * 7919) % 1000 - 500
    agg.upsert(keys, {"ts": ts, "x": np.full(400, 2.0)}, SPEC)
    for kk, t in zip(keys.tolist(), ts.tolist()):
        o = model.get(kk)
        model[kk] = (1, t, t, 2.0) if o is None else (o[0] + 1, min(o[1], t), max(o[2], t), 2.0)
    agg.delete(np.arange(0, 400, 5, dtype="<u4"))
    for kk in range(0, 400, 5):
        model.pop(kk, None)
    agg._check()
    k, v = agg.items()
    assert {int(a): tuple(b) for a, b in zip(k.tolist(), v.tolist())} == model
    found, vals = sk.get(np.array([(r[0], r[1].encode()) for r in expect["skeys"]], SKEY))
    assert found.all() and vals.tolist() == [r[2] for r in expect["skeys"]]
