"""A checkpoint written by KeyDict format 1 (32-byte index slots) still restores with
today's code, and the restored dictionaries keep working against a dict oracle."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

import mmm
from ioservice.manager import CheckpointManager
from mmm.structures.keydict import KeyDict

DATA = Path(__file__).resolve().parent / "data"


def enc(keys: list[bytes | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    data = np.frombuffer(b"".join(k or b"" for k in keys) + b"\0", np.uint8)
    offs = np.zeros(len(keys) + 1, np.int64)
    offs[1:] = np.cumsum([len(k or b"") for k in keys])
    return data, offs, np.array([k is not None for k in keys], bool)


def state(kd: KeyDict) -> dict[bytes | None, int]:
    ids, data, offs, valid = kd.items()
    return {(bytes(data[offs[i]:offs[i + 1]]) if valid[i] else None): int(ids[i])
            for i in range(len(ids))}


def test_format1_checkpoint_restores_and_keeps_working(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(DATA / "old_keydict_ckpt", root)
    expect = json.loads((DATA / "old_keydict_ckpt.json").read_text())
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    with CheckpointManager(pm, str(root), "old") as mgr:
        man = mgr.restore()
    assert man is not None and man.user_meta["offset"] == 2
    for name, mask in (("names", None), ("collide", 0xFF)):
        kd = KeyDict.create(pm, name, _hash_mask=mask)
        want = {(bytes.fromhex(k) if k is not None else None): i for i, k in expect[name]}
        assert state(kd) == want  # read before any index use
        keys = list(want)
        old_index = kd.memory()["index"]  # 32-byte slots
        assert kd.lookup(*enc(keys)).tolist() == [want[k] for k in keys]
        assert kd.memory()["index"] < old_index / 2  # rebuilt in 8-byte slots
        kd._check()
        # it keeps working: interns (old and new keys), removes, all against the oracle
        model = dict(want)
        new = [b"new-%d" % i * (1 + i % 9) for i in range(300)] + [None]
        batch = keys[::7] + new + keys[1::11]
        ids = kd.intern(*enc(batch)).tolist()
        for k, i in zip(batch, ids):
            assert model.setdefault(k, i) == i
        assert len(set(model.values())) == len(model) == len(kd)
        gone = [k for k in keys[::3]]
        kd.remove(np.array([model.pop(k) for k in gone], np.int64))
        assert kd.lookup(*enc(gone)).tolist() == [-1] * len(gone)
        assert state(kd) == model
        kd._check()
