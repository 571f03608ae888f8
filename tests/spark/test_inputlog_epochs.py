"""The input log with ownership epochs (issue 18) and the trimming of old generations'
files after a repartitioning (issue 21), on a real local root, without Spark."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from ioservice import open_root
from sguard.spark import InputLogGapError, fencing, inputlog


def _t(n: int, tag: int) -> pa.Table:
    return pa.table({"k": np.arange(n, dtype=np.int64), "v": np.full(n, tag, np.int64)})


def test_highest_valid_epoch_wins_and_stale_files_never_count(tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    hu = "op.g0.p0000"
    a = fencing.claim(root, hu, 0)
    for b in range(6):
        inputlog.write_input(root, _t(3, 100 + b), b, 0, 0, 1, "k", a.epoch)
    bb = fencing.claim(root, hu, 3)          # another host takes over at batch 3
    assert bb.epoch == a.epoch + 1
    inputlog.write_input(root, _t(3, 203), 3, 0, 0, 1, "k", bb.epoch)
    fence = fencing.read_claims(root, hu)
    assert not fence.owns(a.epoch, a.token) and fence.owns(bb.epoch, bb.token)
    read = lambda b: inputlog.read_input(root, b, 0, 0, 1, "k", fence, key_groups=1)  # noqa: E731
    assert read(2).column("v").to_pylist() == [102] * 3   # before the takeover: A's counts
    assert read(3).column("v").to_pylist() == [203] * 3   # both wrote: the new owner's
    with pytest.raises(InputLogGapError, match="fenced"):
        read(4)                                           # only the stale owner's
    assert inputlog.valid_batches(root, 0, 0, fence) == {0, 1, 2, 3}
    with pytest.raises(fencing.FencedError, match=f"epoch {bb.epoch}"):
        fencing.check_owner(root, hu, a, "batch 5")
    # the owner collects older claims; its own stays and still fences A's files
    assert fencing.collect(root, hu, bb) == 1
    fence = fencing.read_claims(root, hu)
    assert [c.epoch for c in fence.claims] == [bb.epoch]
    assert not fence.log_valid(a.epoch, 4) and fence.log_valid(a.epoch, 2)


def test_concurrent_claims_leave_one_owner(tmp_path: Path) -> None:
    import threading
    root = open_root(str(tmp_path))
    got: list[fencing.Claim] = []
    barrier = threading.Barrier(6)

    def go() -> None:
        barrier.wait()
        got.append(fencing.claim(root, "h", 1))

    ts = [threading.Thread(target=go) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    view = fencing.read_claims(root, "h")
    owners = [c for c in got if view.owns(c.epoch, c.token)]
    assert len(owners) == 1 and owners[0].epoch == max(c.epoch for c in got)
    assert len({c.epoch for c in got}) == 6  # no two claimants went on with one epoch


def test_old_generation_files_trimmed_once_every_new_partition_covers_them(
        tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    for b in range(4):                       # generation 0, 2 partitions, batches 0..3
        for p in range(2):
            inputlog.write_input(root, _t(2, b), b, 0, p, 2, "k", 1)
    for b in range(4, 7):                    # generation 1, 3 partitions, batches 4..6
        for p in range(3):
            inputlog.write_input(root, _t(2, b), b, 1, p, 3, "k", 1)

    def old_batches() -> list[int]:
        return sorted({b for b in inputlog.logged_batches(root)
                       for e in root.list_dir(inputlog.batch_dir(b))
                       if e.name.startswith("g0-")})

    inputlog.trim(root, 5, 1, 0, 3)
    inputlog.trim(root, 2, 1, 1, 3)
    assert old_batches() == [0, 1, 2, 3]     # partition 2 has not trimmed yet: all kept
    inputlog.trim(root, 6, 1, 2, 3)
    assert old_batches() == [3]              # min(5, 2, 6) = 2: batches 0..2 collected
    assert inputlog.logged_batches(root) == [3, 4, 5, 6]
    # the new generation's own files: each partition trimmed its own only
    assert sorted(inputlog.own_files(root, 1, 1)) == [4, 5, 6]
    assert sorted(inputlog.own_files(root, 1, 0)) == [6]
