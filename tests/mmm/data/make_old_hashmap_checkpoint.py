"""Writes ``old_hashmap_ckpt/``: HashMap checkpoints made by the vectorized numpy HashMap
(commit 47c5430, before the numba kernels), kept so that every later HashMap restores them.

Run once from the worktree root: ``python tests/mmm/data/make_old_hashmap_checkpoint.py``.
It also writes ``old_hashmap_ckpt.json``: the contents the restore must give back.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

import mmm
from ioservice.manager import CheckpointManager
from mmm.structures.hashmap import HashMap

HERE = Path(__file__).resolve().parent
VALUE = np.dtype([("n", "<i8"), ("lo", "<i8"), ("hi", "<i8"), ("last", "<f8")])
SPEC = {"n": "count", "lo": ("min", "ts"), "hi": ("max", "ts"), "last": ("last", "x")}
SKEY = np.dtype([("a", "<i2"), ("b", "S5")], align=True)


def main() -> None:
    out = HERE / "old_hashmap_ckpt"
    shutil.rmtree(out, ignore_errors=True)
    rng = np.random.default_rng(2026)
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    agg = HashMap.create(pm, "agg", key="<u4", value=VALUE)
    sk = HashMap.create(pm, "skeys", key=SKEY, value="<i8", page_slots=8)
    keys = rng.integers(0, 160, 600).astype("<u4")
    agg.upsert(keys, {"ts": rng.integers(-10**12, 10**12, 600), "x": rng.random(600)}, SPEC)
    skeys = np.array([(i % 7 - 3, bytes([97 + i % 5]) * (i % 6)) for i in range(40)], SKEY)
    sk.put(skeys, np.arange(40) * 11)
    with CheckpointManager(pm, str(out), "old") as mgr:
        mgr.checkpoint(user_meta={"offset": 1}).result()
        agg.delete(np.arange(0, 160, 3, dtype="<u4"))
        agg.upsert(keys[:50], {"ts": np.arange(50) - 25, "x": np.arange(50) * 0.5}, SPEC)
        sk.delete(skeys[::4])
        mgr.checkpoint(user_meta={"offset": 2}).result()
    k, v = agg.items()
    s_k, s_v = sk.items()
    expect = {
        "agg": sorted([int(a)] + list(b) for a, b in zip(k.tolist(), v.tolist())),
        "skeys": sorted([int(a[0]), a[1].decode(), int(b)] for a, b in zip(s_k.tolist(),
                                                                           s_v.tolist())),
    }
    (HERE / "old_hashmap_ckpt.json").write_text(json.dumps(expect, indent=0))


if __name__ == "__main__":
    main()
