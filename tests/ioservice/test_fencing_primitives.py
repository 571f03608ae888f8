"""The ioservice primitives several writers over time rely on (sguard's fencing):
create-only writes, writer-tagged page files, sequence ranges, a commit veto, a
deletion veto, and `CheckpointManager.adopt_base`."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ioservice import (CheckpointError, CheckpointInProgressError, CheckpointManager,
                       CheckpointPolicy, CheckpointWriteError, StorageExistsError,
                       list_checkpoints, open_root, read_manifest, restore)
from ioservice.testing import SeaweedCluster

from tests.ioservice.ckpt_helpers import mutate, new_pm, open_structures, state_of


def test_write_new_never_replaces(tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    root.write_new("a/x.json", b"first")
    with pytest.raises(StorageExistsError, match="a/x.json"):
        root.write_new("a/x.json", b"second")
    assert root.read_bytes("a/x.json") == b"first"
    assert [e.name for e in root.list_dir("a")] == ["x.json"]  # no temp file left


def test_write_new_races_one_winner(tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    wins: list[int] = []
    barrier = threading.Barrier(8)

    def go(i: int) -> None:
        barrier.wait()
        try:
            root.write_new("race.json", str(i).encode())
            wins.append(i)
        except StorageExistsError:
            pass

    ts = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(wins) == 1
    assert root.read_bytes("race.json") == str(wins[0]).encode()


@pytest.mark.seaweedfs
def test_write_new_on_s3_refuses_a_visible_target(seaweed: SeaweedCluster,
                                                  seaweed_uri: str) -> None:
    root = open_root(seaweed_uri + "/writenew", s3_endpoint=seaweed.s3_endpoint,
                     s3_access_key=seaweed.access_key, s3_secret_key=seaweed.secret_key)
    root.write_new("m.json", b"one")
    with pytest.raises(StorageExistsError):
        root.write_new("m.json", b"two")
    assert root.read_bytes("m.json") == b"one"


def test_exclusive_output_stream_refuses_existing_local_file(tmp_path: Path) -> None:
    root = open_root(str(tmp_path))
    root.write_atomic("f.bin", b"keep")
    with pytest.raises(StorageExistsError):
        root.open_output_stream("f.bin", exclusive=True)
    assert root.read_bytes("f.bin") == b"keep"


def test_seq_range_tagged_files_and_create_only_manifests(tmp_path: Path) -> None:
    """Two writers with their own ranges never share a name; the lower one's retention
    never deletes the higher one's checkpoints."""
    root = open_root(str(tmp_path))
    pm_a, pm_b = new_pm(), new_pm()
    sa, sb = open_structures(pm_a), open_structures(pm_b)
    pol = CheckpointPolicy(keep=1)
    with CheckpointManager(pm_b, root, "u", seq_range=(2000, 3000), exclusive=True,
                           policy=pol) as b, \
            CheckpointManager(pm_a, root, "u", seq_range=(1000, 2000), exclusive=True,
                              policy=pol) as a:
        mutate(sb, 0)
        mb = b.checkpoint({"w": "b"}).result()
        for step in range(3):
            mutate(sa, step)
            a.checkpoint({"w": "a"}).result()
    assert mb.seq == 2000 and all("-" in f.path.rsplit("/", 1)[1] for f in mb.files)
    names = [c.name for c in list_checkpoints(root, "u") if c.has_manifest]
    assert names == ["u-1002", "u-2000"]  # a's retention kept its newest, never b's
    assert read_manifest(root, "u-2000").user_meta == {"w": "b"}
    pm = new_pm()
    assert restore(pm, root, "u").name == "u-2000"
    assert state_of(open_structures(pm)) == state_of(sb)


def test_seq_range_is_used_up_cleanly(tmp_path: Path) -> None:
    pm = new_pm()
    s = open_structures(pm)
    with CheckpointManager(pm, str(tmp_path), "r", seq_range=(5, 7)) as mgr:
        for step in range(2):
            mutate(s, step)
            mgr.checkpoint().result()
        mutate(s, 2)
        with pytest.raises(CheckpointError, match="used up"):
            mgr.checkpoint()
        assert pm.stats()["pinned_frames"] == 0
    with pytest.raises(ValueError, match="seq_range"):
        CheckpointManager(new_pm(), str(tmp_path), "r", seq_range=(7, 5))


def test_before_commit_veto_and_may_delete(tmp_path: Path) -> None:
    """A refused commit writes no manifest; with may_delete False its files stay (a fenced
    writer deletes nothing) and retention deletes nothing either."""
    root = open_root(str(tmp_path))
    pm = new_pm()
    s = open_structures(pm)
    allowed = [True]
    veto = [False]

    class Refused(Exception):
        pass

    def before(p):  # noqa: ANN001
        if veto[0]:
            raise Refused(f"{p.name} refused")

    with CheckpointManager(pm, root, "v", policy=CheckpointPolicy(keep=1),
                           before_commit=before, may_delete=lambda: allowed[0]) as mgr:
        mutate(s, 0)
        first = mgr.checkpoint().result()
        veto[0], allowed[0] = True, False
        mutate(s, 1)
        p = mgr.checkpoint()
        with pytest.raises(CheckpointWriteError, match="refused"):
            p.result()
        veto[0] = False
        mutate(s, 2)
        mgr.checkpoint().result()  # retention vetoed: the first one stays
    infos = {c.name: c for c in list_checkpoints(root, "v")}
    assert not infos[p.name].has_manifest and infos[p.name].n_files > 0  # orphan left
    assert infos[first.name].has_manifest
    assert pm.stats()["pinned_frames"] == 0


def test_adopt_base_makes_the_next_checkpoint_incremental(tmp_path: Path) -> None:
    """A second manager over the same pages adopts the first's checkpoint as its base."""
    root = open_root(str(tmp_path))
    pm = new_pm()
    s = open_structures(pm)
    for step in range(4):
        mutate(s, step, n=2000)
    with CheckpointManager(pm, root, "ad") as m1:
        base = m1.checkpoint().result()
    mutate(s, 4, n=5)
    with CheckpointManager(pm, root, "ad") as m2:
        assert m2.base is None and m2.last_seq == base.seq
        m2.adopt_base(base)
        assert m2.base is base
        man = m2.checkpoint().result()
    assert not man.full and man.base == base.name and man.n_pages_written < man.n_pages / 2
    pm2 = new_pm()
    restore(pm2, root, "ad")
    assert state_of(open_structures(pm2)) == state_of(s)
    with CheckpointManager(new_pm(), root, "other") as m3:
        with pytest.raises(ValueError, match="HA unit"):
            m3.adopt_base(base)
        m3.adopt_base(None)
        assert m3.base is None


def test_adopt_base_refused_while_in_flight(tmp_path: Path) -> None:
    """adopt_base while a checkpoint is in flight raises and changes nothing (the checkpoint
    is held in flight by a storage gate, not by timing)."""
    from tests.ioservice.ckpt_helpers import faulty_root
    import pyarrow.fs as pafs
    root, faulty = faulty_root(pafs.LocalFileSystem(), str(tmp_path))
    pm = new_pm()
    s = open_structures(pm)
    mutate(s, 0)
    with CheckpointManager(pm, root, "fl") as mgr:
        base = mgr.checkpoint().result()
        mutate(s, 1)
        faulty.write_gate = gate = threading.Event()
        p = mgr.checkpoint()
        with pytest.raises(CheckpointInProgressError, match="in flight"):
            mgr.adopt_base(None)
        with pytest.raises(CheckpointInProgressError, match="in flight"):
            mgr.adopt_base(base)
        assert mgr.base is base and not p.done()
        gate.set()
        man = p.result()
    assert man.base == base.name
