"""Checkpoint round trips, incremental chains, retention, policies and hooks."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

import mmm
from ioservice import (CheckpointInProgressError, CheckpointManager, CheckpointPolicy,
                       InvalidNameError, IOService, Manifest, ManifestError, RootNotWritableError,
                       StorageUnreachableError, UnsupportedURIError, list_checkpoints, open_root,
                       read_manifest, restore)
from ioservice.format import FORMAT_VERSION
from ioservice.testing import SeaweedCluster
from mmm.structures.hashmap import HashMap

from tests.ioservice.ckpt_helpers import (faulty_root, mutate, new_pm, open_structures,
                                          recover_in_subprocess, state_of, step_of)


def _roundtrip_while_mutating(root, faulty, recover_uri: str, tmp_path: Path, env=None) -> None:
    """Checkpoint, mutate while the write is held open (storage gated shut), recover in a new
    process."""
    pm = new_pm()
    s = open_structures(pm)
    for step in range(6):
        mutate(s, step)
    with CheckpointManager(pm, root, "rt", n_workers=3) as mgr:
        oracle = state_of(s)
        faulty.write_gate = threading.Event()  # holds the write open during the mutations
        pending = mgr.checkpoint({"step": 5})
        for step in range(6, 9):  # the operator keeps running while pages are written
            mutate(s, step)
        assert not pending.done()
        live = state_of(s)
        faulty.write_gate.set()
        man = pending.result(timeout_s=600)
    assert man.full and man.n_pages == pending.n_pages_written > 20
    assert state_of(s) == live != oracle
    assert pm.stats()["pinned_frames"] == 0
    got = recover_in_subprocess(recover_uri, "rt", tmp_path / "out.json", env)
    assert got["name"] == "rt-1" and got["user_meta"] == {"step": 5}
    assert got["state"] == oracle and got["step"] == 5


def test_roundtrip_every_structure_local_while_mutating(tmp_path: Path) -> None:
    """All four structures round-trip through file:// into a new process, bit-exact."""
    root, faulty = faulty_root(pafs.LocalFileSystem(), str(tmp_path / "r"), latency_s=0.003)
    (tmp_path / "r").mkdir()
    _roundtrip_while_mutating(root, faulty, f"file://{tmp_path / 'r'}", tmp_path)


@pytest.mark.seaweedfs
def test_roundtrip_every_structure_seaweedfs_while_mutating(
        seaweed: SeaweedCluster, seaweed_uri: str, tmp_path: Path) -> None:
    """The same round trip through the replicated SeaweedFS cluster (S3)."""
    base = seaweed_uri[len("s3://"):]
    root, faulty = faulty_root(seaweed.filesystem(), base, latency_s=0.003)
    _roundtrip_while_mutating(root, faulty, seaweed_uri, tmp_path, env=seaweed.env())


@pytest.mark.seaweedfs
def test_incremental_chain_on_seaweedfs(seaweed: SeaweedCluster, seaweed_uri: str) -> None:
    """An incremental chain written to SeaweedFS restores its last checkpoint."""
    root = open_root(seaweed_uri, s3_endpoint=seaweed.s3_endpoint,
                     s3_access_key=seaweed.access_key, s3_secret_key=seaweed.secret_key)
    pm = new_pm()
    s = open_structures(pm)
    with CheckpointManager(pm, root, "chain", policy=CheckpointPolicy(full_every=4)) as mgr:
        for step in range(4):
            mutate(s, step, n=40)
            man = mgr.checkpoint({"step": step}).result(timeout_s=600)
        assert not man.full and man.depth == 3
    pm2 = new_pm()
    assert restore(pm2, root, "chain").name == "chain-4"
    assert state_of(open_structures(pm2)) == state_of(s)


def test_incremental_chain_writes_only_changes_and_restores_last(tmp_path: Path) -> None:
    """Small changes write few pages; the last checkpoint restores through its references."""
    pm = new_pm()
    s = open_structures(pm)
    for step in range(10):
        mutate(s, step, n=2000)
    policy = CheckpointPolicy(full_every=4, keep=None)
    states = []
    with CheckpointManager(pm, str(tmp_path), "inc", policy=policy) as mgr:
        mans = []
        for step in range(10, 16):
            mutate(s, step, n=10)
            p = mgr.checkpoint({"step": step})
            mans.append(p.result())
            states.append(state_of(s))
    assert [m.full for m in mans] == [True, False, False, False, True, False]
    assert [m.depth for m in mans] == [0, 1, 2, 3, 0, 1]
    assert mans[1].base == "inc-1" and mans[3].referenced_checkpoints == ("inc-1", "inc-2",
                                                                          "inc-3", "inc-4")
    for m in mans[1:4]:
        assert m.n_pages_written < m.n_pages / 2
    assert mans[4].referenced_checkpoints == ("inc-5",)  # compaction: a full one
    # every checkpoint of the chain restores its own state
    for m, want in zip(mans, states):
        pm2 = new_pm()
        got = restore(pm2, open_root(str(tmp_path)), "inc", before_seq=m.seq + 1)
        assert got.name == m.name
        assert state_of(open_structures(pm2)) == want
        assert pm2.stats()["pinned_frames"] == 0


def test_retention_keeps_chain_restorable_and_deletes_unreferenced(tmp_path: Path) -> None:
    """keep=2 deletes expired manifests and unreferenced files, never what a kept chain needs."""
    pm = new_pm()
    s = open_structures(pm)
    policy = CheckpointPolicy(full_every=3, keep=2)
    root = open_root(str(tmp_path))
    with CheckpointManager(pm, root, "ret", policy=policy) as mgr:
        for step in range(7):
            mutate(s, step, n=30)
            mgr.checkpoint({"step": step}).result()
            infos = list_checkpoints(root, "ret")
            kept = [c.name for c in infos if c.has_manifest]
            assert len(kept) == min(step + 1, 2)
            referenced = set()
            for name in kept:
                referenced |= {f.path for f in read_manifest(root, name).files}
            on_disk = {e.relpath for e in root.list_dir("checkpoint", recursive=True)
                       if not e.is_dir and not e.relpath.endswith("manifest.json")}
            assert on_disk == referenced, step
    # checkpoints 1 (full), 2, 3 (incr), 4 (full), 5, 6 (incr), 7 (full): kept 6 and 7
    assert [c.name for c in list_checkpoints(root, "ret") if c.has_manifest] == ["ret-6", "ret-7"]
    dirs = {c.name for c in list_checkpoints(root, "ret")}
    assert {"ret-4", "ret-6", "ret-7"} <= dirs <= {"ret-4", "ret-5", "ret-6", "ret-7"}
    pm2 = new_pm()
    assert restore(pm2, root, "ret", before_seq=7).name == "ret-6"  # chain 4 <- 5 <- 6 intact


def test_skip_when_nothing_changed_and_destroy_is_a_change(tmp_path: Path) -> None:
    """Unchanged state is skipped (S4 dirty flag); dropping a structure is not 'unchanged'."""
    pm = new_pm()
    s = open_structures(pm)
    mutate(s, 0)
    with CheckpointManager(pm, str(tmp_path), "skip") as mgr:
        mgr.checkpoint().result()
        assert mgr.checkpoint() is None
        assert mgr.counters["skipped"] == 1
        assert pm.stats()["pinned_frames"] == 0
        pm.destroy(pm.recover("window"))
        man = mgr.checkpoint().result()
        assert "window" not in man.structures
        forced = mgr.checkpoint(full=True).result()
        assert forced.full


def test_policies_interval_and_tuple_count(tmp_path: Path) -> None:
    """maybe_checkpoint fires on the tuple count and on the time interval, one at a time."""
    now = [0.0]
    root, faulty = faulty_root(pafs.LocalFileSystem(), str(tmp_path))
    pm = new_pm()
    s = open_structures(pm)
    policy = CheckpointPolicy(interval_s=10.0, every_n_tuples=1000)
    with CheckpointManager(pm, root, "pol", policy=policy, clock=lambda: now[0]) as mgr:
        mutate(s, 0)
        assert mgr.maybe_checkpoint(999) is None
        faulty.write_gate = gate = threading.Event()  # keeps the first one in flight
        p = mgr.maybe_checkpoint(1)
        assert p is not None and not p.done()
        mutate(s, 1)
        assert mgr.maybe_checkpoint(5000) is None  # one in flight: counted, not started
        gate.set()
        p.result()
        q = mgr.maybe_checkpoint(0)  # the 5000 tuples counted meanwhile make it due
        assert q is not None and q.result().name == "pol-2"
        now[0] = 5.0
        mutate(s, 2)
        assert mgr.maybe_checkpoint(10) is None  # neither due
        now[0] = 100.0
        r = mgr.maybe_checkpoint(0)  # interval elapsed
        assert r is not None and r.result().name == "pol-3"
        assert mgr.maybe_checkpoint(0) is None  # interval restarted
        now[0] = 200.0
        assert mgr.maybe_checkpoint(0) is None  # due, but nothing changed: skipped
        staged = mgr.counters.pop("pages_staged")
        assert mgr.counters == {"committed": 3, "failed": 0, "skipped": 1,
                                "retention_deleted": 0}
        assert staged == 0  # staging is off by default (`CheckpointPolicy.stage_mb`)


def test_at_most_one_checkpoint_in_flight(tmp_path: Path) -> None:
    """A second checkpoint while one is being written raises; the first still commits."""
    root, faulty = faulty_root(pafs.LocalFileSystem(), str(tmp_path))
    pm = new_pm()
    mutate(open_structures(pm), 0)
    with CheckpointManager(pm, root, "one") as mgr:
        faulty.write_gate = gate = threading.Event()  # the first stays in flight
        p = mgr.checkpoint()
        with pytest.raises(CheckpointInProgressError, match="one-1"):
            mgr.checkpoint()
        assert mgr.maybe_checkpoint(10**9) is None
        gate.set()
        assert p.result().name == "one-1"


def test_five_steps_hooks_and_user_meta(tmp_path: Path) -> None:
    """on_start meta lands in the manifest; on_record then on_done see the committed manifest."""
    events: list[tuple[str, object]] = []
    pm = new_pm()
    s = open_structures(pm)
    mutate(s, 0)

    def on_start(seq: int) -> dict[str, object]:
        events.append(("start", seq))
        return {"inputs": {"src0": 123}}

    def on_record(man: Manifest) -> None:
        assert root.exists(man.manifest_path)
        events.append(("record", man.name))

    root = open_root(str(tmp_path))
    with CheckpointManager(pm, root, "hooks", on_start=on_start, on_record=on_record,
                           on_done=lambda m: events.append(("done", m.user_meta["inputs"]))) as mgr:
        man = mgr.checkpoint({"epoch": 1}).result()
        mgr.wait()
    assert events == [("start", 1), ("record", "hooks-1"), ("done", {"src0": 123})]
    assert man.user_meta == {"epoch": 1, "inputs": {"src0": 123}}
    with pytest.raises(TypeError, match="JSON"):
        with CheckpointManager(pm, root, "hooks") as mgr:
            mgr.checkpoint({"bad": object()})
    assert pm.stats()["pinned_frames"] == 0


def test_manifest_format_is_versioned_json_and_validated(tmp_path: Path) -> None:
    """The manifest is plain JSON with format_version; damage and other versions are refused."""
    pm = new_pm()
    mutate(open_structures(pm), 0)
    root = open_root(str(tmp_path))
    with CheckpointManager(pm, root, "fmt") as mgr:
        man = mgr.checkpoint().result()
    raw = root.read_bytes(man.manifest_path)
    doc = json.loads(raw)
    assert doc["format_version"] == FORMAT_VERSION and doc["name"] == "fmt-1"
    assert set(doc["page_table"]["columns"]) == {"page_id", "file", "offset", "checksum"}
    again = Manifest.from_json(raw)
    assert np.array_equal(again.pages.checksum, man.pages.checksum)
    for bad, msg in [(b"{", "not valid JSON"), (raw.replace(f'"format_version": {FORMAT_VERSION}'.encode(), b'"format_version": 99'), "format_version 99"),
                     (json.dumps({**doc, "page_bytes": "x"}).encode(), "page_bytes"),
                     (json.dumps({**doc, "files": doc["files"][:1]}).encode(), "file"),
                     (json.dumps({**doc, "files": [{"path": "../../etc/passwd", "size_bytes": 1}]}).encode(), "not checkpoint/")]:
        with pytest.raises(ManifestError, match=msg):
            Manifest.from_json(bad, where="m")
    doc["page_table"]["columns"]["checksum"][1] = doc["page_table"]["columns"]["offset"][1]
    with pytest.raises(ManifestError, match="checksum mismatch"):
        Manifest.from_json(json.dumps(doc).encode())


def test_io_service_write_and_read_many_workers(tmp_path: Path) -> None:
    """IOService splits pages over workers, one file each, and reads them back verified."""
    pm = new_pm()
    mutate(open_structures(pm), 0, n=3000)
    snap = pm.chkpt()
    root = open_root(str(tmp_path))
    progress: list[int] = []
    with IOService(n_workers=4, chunk_bytes=64 << 10) as io:
        res = io.write_snapshot(root, "checkpoint/x-1", snap,
                                on_progress=lambda d, t: progress.append(d)).result()
        assert len(res.files) == 4 and max(progress) == len(snap)
        assert pm.stats()["pinned_frames"] == 0  # every page marked persisted as written
        snap.complete()
        man = Manifest("x", 1, snap.snapshot_id, pm.page_bytes, True, 0, None, res.files,
                       res.table, snap.structures)
        man.validate()
        seen: list[np.ndarray] = []
        io.read_pages(root, man, lambda p: seen.append(p[:, 8:16].copy().view("<u8")[:, 0]))
    assert np.array_equal(np.sort(np.concatenate(seen)), snap.page_ids)


# --------------------------------------------------------------------------- bad input


def test_bad_haunit_names_are_refused(tmp_path: Path) -> None:
    """HA unit names with '/', '..' or empty are refused before anything is written."""
    pm = new_pm()
    for bad in ("a/b", "..", "../x", "", "a\\b", ".hidden"):
        with pytest.raises(InvalidNameError):
            CheckpointManager(pm, str(tmp_path), bad)
    with pytest.raises(InvalidNameError):
        restore(pm, open_root(str(tmp_path)), "../x")
    assert not any(tmp_path.iterdir())


def test_unknown_scheme_and_unwritable_root(tmp_path: Path) -> None:
    """Unknown URI schemes and unwritable roots fail at construction with clear errors."""
    pm = new_pm()
    with pytest.raises(UnsupportedURIError, match="ftp"):
        CheckpointManager(pm, "ftp://host/x", "u")
    (tmp_path / "file").write_text("x")
    with pytest.raises(RootNotWritableError, match="not a directory"):
        CheckpointManager(pm, str(tmp_path / "file"), "u")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not _can_write(ro):
            with pytest.raises(RootNotWritableError, match="not writable"):
                CheckpointManager(pm, str(ro), "u")
    finally:
        ro.chmod(0o700)


def _can_write(path: Path) -> bool:
    try:
        (path / ".probe").write_text("x")
    except OSError:
        return False
    (path / ".probe").unlink()
    return True  # running as root: permissions do not apply


def test_unreachable_endpoint_is_a_clear_error() -> None:
    """An S3 endpoint nobody listens on raises StorageUnreachableError quickly."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(StorageUnreachableError, match=f"127.0.0.1:{port}"):
        CheckpointManager(new_pm(), open_root(f"s3://b/p", s3_endpoint=f"http://127.0.0.1:{port}",
                                              timeout_s=0.5, max_attempts=1), "u")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_io_and_staging_threads_run_at_the_lowered_priority(tmp_path: Path) -> None:
    """`IOService(nice=n)`: its workers and the manager's stager run n nice levels below
    the thread that made them; the operator's thread keeps its priority."""
    me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    want = min(19, me + 6)
    seen: dict[str, int] = {}

    def prio() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "m", key="<u4", value="<i8")
    m.put(np.arange(5000, dtype="<u4"), np.arange(5000))
    with IOService(2, nice=6) as io:
        seen["io"] = io._write_pool.submit(prio).result()
        seen["reader"] = io._pool.submit(prio).result()  # recovery reads: not lowered
        mgr = CheckpointManager(pm, str(tmp_path), "u", io=io)
        mgr.checkpoint().result()
        assert mgr._stager is not None
        seen["stager"] = mgr._stager.submit(prio).result()
        mgr.close()
    assert seen == {"io": want, "stager": want, "reader": me}
    assert prio() == me


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
def test_idle_io_and_staging_threads_run_sched_idle(tmp_path: Path) -> None:
    """`IOService(idle=True)`: its writers run SCHED_IDLE (the manager's stager and its
    readers do not) and still write a checkpoint that restores exactly; the operator's
    thread keeps its policy."""
    me = os.sched_getscheduler(0)
    seen: dict[str, int] = {}
    pm = new_pm()
    s = open_structures(pm)
    with IOService(1, idle=True) as io:
        seen["io"] = io._write_pool.submit(os.sched_getscheduler, 0).result()
        seen["reader"] = io._pool.submit(os.sched_getscheduler, 0).result()
        mgr = CheckpointManager(pm, str(tmp_path), "u", io=io)
        for step in range(2):
            mutate(s, step, n=40)
            mgr.checkpoint().result()
        assert mgr._stager is not None
        seen["stager"] = mgr._stager.submit(os.sched_getscheduler, 0).result()
        mgr.close()
    # the stager at normal priority: writers wait for it, and nothing raises a starved one
    assert seen == {"io": os.SCHED_IDLE, "stager": me, "reader": me}
    assert os.sched_getscheduler(0) == me != os.SCHED_IDLE
    pm2 = new_pm()
    assert restore(pm2, open_root(str(tmp_path)), "u").name == "u-2"
    assert state_of(open_structures(pm2)) == state_of(s)


@pytest.mark.parametrize("idle", [1, "yes", None])
def test_io_service_refuses_a_bad_idle(idle: object) -> None:
    with pytest.raises(ValueError, match="idle"):
        IOService(1, idle=idle)  # type: ignore[arg-type]


@pytest.mark.parametrize("nice", [-1, 20, 1.5, True])
def test_io_service_refuses_a_bad_nice(nice: object) -> None:
    with pytest.raises(ValueError, match="nice"):
        IOService(1, nice=nice)  # type: ignore[arg-type]
