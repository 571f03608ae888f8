"""Writes ``old_keydict_ckpt/``: KeyDict checkpoints in its format 1 (32-byte index slots
holding a key of up to 15 bytes), kept so that every later KeyDict restores them.

Run once from the worktree root, with the code of the commit that added this file:
``python tests/mmm/data/make_old_keydict_checkpoint.py``. It also writes
``old_keydict_ckpt.json``: for each dictionary, ``[id, key as hex or null]`` of every key
the restore must give back.

The state holds every shape the format-1 pages have: keys kept in the index slot (up to
15 bytes), in the record (16-20) and in chunk chains (longer than 20, some longer than a
page), the null key, removed ids on the free list, deleted index slots, an index grown
past its first page, and a second dictionary whose narrow hash mask makes most keys
collide.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

import mmm
from ioservice.manager import CheckpointManager
from mmm.structures.keydict import KeyDict

HERE = Path(__file__).resolve().parent


def keys_of(rng: np.random.Generator, n: int) -> list[bytes]:
    out = []
    for i in range(n):
        size = int(rng.choice([3, 9, 15, 17, 20, 33, 80]))
        out.append((b"k%d-" % i + bytes(rng.integers(97, 123, size, dtype=np.uint8)))[:size]
                   if size >= 8 else b"%d" % i)
    return out


def enc(keys: list[bytes | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    data = np.frombuffer(b"".join(k or b"" for k in keys) + b"\0", np.uint8)
    offs = np.zeros(len(keys) + 1, np.int64)
    offs[1:] = np.cumsum([len(k or b"") for k in keys])
    return data, offs, np.array([k is not None for k in keys], bool)


def contents(kd: KeyDict) -> list[list[object]]:
    ids, data, offs, valid = kd.items()
    return [[int(ids[i]), bytes(data[offs[i]:offs[i + 1]]).hex() if valid[i] else None]
            for i in range(len(ids))]


def main() -> None:
    out = HERE / "old_keydict_ckpt"
    shutil.rmtree(out, ignore_errors=True)
    rng = np.random.default_rng(2611)
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    kd = KeyDict.create(pm, "names")
    col = KeyDict.create(pm, "collide", _hash_mask=0xFF)
    keys: list[bytes | None] = list(keys_of(rng, 500))
    keys += [None, b"", b"x" * 4200]
    ids = kd.intern(*enc(keys))
    cids = col.intern(*enc(keys[:120]))
    with CheckpointManager(pm, str(out), "old") as mgr:
        mgr.checkpoint(user_meta={"offset": 1}).result()
        kd.remove(ids[5:300:3])
        kd.remove(ids[-3:-2])  # the null key
        kd.intern(*enc([b"after-%d" % i for i in range(30)] + [b"y" * 70]))
        col.remove(cids[::4])
        col.intern(*enc([b"c%d" % i for i in range(20)]))
        mgr.checkpoint(user_meta={"offset": 2}).result()
    kd._check()
    col._check()
    expect = {"names": contents(kd), "collide": contents(col)}
    (HERE / "old_keydict_ckpt.json").write_text(json.dumps(expect))


if __name__ == "__main__":
    main()
