"""Page manager: errors, copy-on-write with a concurrent writer thread, rollback,
loading pages in any order, and re-attaching a file-backed pool from another process."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import mmm
from mmm.structures.hashmap import HashMap

VALUE = np.dtype([("n", "<i8"), ("lo", "<i8"), ("hi", "<i8")])
SPEC = {"n": "count", "lo": ("min", "ts"), "hi": ("max", "ts")}


def contents(m: HashMap) -> dict:
    k, v = m.items()
    return {int(a): tuple(b) for a, b in zip(k.tolist(), v.tolist())}


@pytest.mark.parametrize("bad", [0, 1000, 2048, 3 * 4096, 1 << 21, -4096, 4096.0, True])
def test_bad_page_size_is_refused(bad):
    """Page sizes that are not powers of two in [4 KiB, 1 MiB] raise PageSizeError."""
    with pytest.raises(mmm.PageSizeError, match="page_bytes"):
        mmm.PageManager(page_bytes=bad, capacity_bytes=1 << 22)


def test_exhausted_pool_raises_and_leaves_state_unchanged():
    """Allocation past the capacity raises PoolExhaustedError naming the sizes."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=8 * 4096)
    psid = pm.create("raw")
    pm.allocate(psid, 5)
    before = pm.stats()
    with pytest.raises(mmm.PoolExhaustedError, match=r"3 page\(s\) of 4096 bytes requested, 2 of 8 free"):
        pm.allocate(psid, 3)
    assert pm.stats() == before
    pm._check()


def test_structure_growth_past_capacity_raises_memory_error():
    """A map that outgrows the pool raises a MemoryError subclass."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=16 * 4096)
    m = HashMap.create(pm, "m", key="<u8", value="<i8")
    with pytest.raises(MemoryError):
        m.put(np.arange(100_000, dtype="<u8"), np.zeros(100_000, "<i8"))


def test_unknown_ids_and_names_raise_specific_errors():
    """Unknown PageIDs, PSIDs and names raise KeyError subclasses naming them."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    psid = pm.create("a")
    with pytest.raises(mmm.PageNotFoundError, match="seq 7"):
        pm.resolve(mmm.make_page_id(psid, 7))
    with pytest.raises(mmm.PageNotFoundError):
        pm.release(psid, [3])
    with pytest.raises(mmm.PageSetNotFoundError, match="page set 99"):
        pm.allocate(99)
    with pytest.raises(mmm.StructureNotFoundError, match="'nope'"):
        pm.recover("nope")
    with pytest.raises(mmm.StructureNotFoundError):
        pm.chkpt(names=["nope"])
    with pytest.raises(ValueError, match="already exists"):
        pm.create("a")
    assert pm.exists("a") and not pm.exists("nope")
    pm._check()


def test_snapshot_prepare_copies_no_bytes_and_clones_on_write():
    """chkpt pins pages; the first write to each clones it once, later writes do not."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "m", key="<u4", value=VALUE)
    m.upsert(np.arange(1000, dtype="<u4"), {"ts": np.arange(1000)}, SPEC)
    used = pm.stats()["used_frames"]
    snap = pm.chkpt()
    assert pm.stats()["used_frames"] == used and pm.stats()["pages_cloned"] == 0
    m.upsert(np.array([1], "<u4"), {"ts": np.array([5])}, SPEC)
    cloned = pm.stats()["pages_cloned"]
    assert cloned >= 1
    m.upsert(np.array([1], "<u4"), {"ts": np.array([6])}, SPEC)
    assert pm.stats()["pages_cloned"] == cloned
    snap.mark_persisted(np.arange(len(snap)))
    snap.complete()
    assert pm.stats()["pinned_frames"] == 0 and pm.stats()["orphan_frames"] == 0
    pm._check()


def test_incremental_changed_flags_follow_completed_snapshots():
    """`changed` marks pages modified since the last *completed* snapshot only."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    m = HashMap.create(pm, "m", key="<u4", value=VALUE, page_slots=8)
    m.upsert(np.arange(200, dtype="<u4"), {"ts": np.arange(200)}, SPEC)
    s1 = pm.chkpt()
    assert s1.changed.all()
    s1.complete()
    s2 = pm.chkpt()
    assert not s2.changed.any()
    s2.cancel()
    m.upsert(np.array([3], "<u4"), {"ts": np.array([1])}, SPEC)
    s3 = pm.chkpt()
    assert s3.n_changed == 1
    s3.cancel()  # failed checkpoint: the page stays changed
    s4 = pm.chkpt()
    assert s4.n_changed == 1
    s4.complete()
    assert pm.chkpt().n_changed == 0


def test_cow_oracle_with_concurrent_io_thread():
    """An I/O thread copies frozen pages while the operator mutates; the copy rebuilds
    exactly the snapshot-time state and the live map equals the current oracle."""
    rng = np.random.default_rng(3)
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 24)
    m = HashMap.create(pm, "m", key="<u4", value=VALUE, page_slots=16)
    model: dict[int, tuple] = {}

    def apply(keys: np.ndarray, ts: np.ndarray) -> None:
        m.upsert(keys, {"ts": ts}, SPEC)
        for k, t in zip(keys.tolist(), ts.tolist()):
            o = model.get(k)
            model[k] = (1, t, t) if o is None else (o[0] + 1, min(o[1], t), max(o[2], t))

    for _ in range(5):
        apply(rng.integers(0, 3000, 500).astype("<u4"), rng.integers(0, 10**6, 500))
    for round_ in range(4):
        snap = pm.chkpt()
        frozen = copy.deepcopy(model)
        out = np.empty((len(snap), snap.page_bytes), np.uint8)
        order = rng.permutation(len(snap))

        def writer() -> None:
            for chunk in np.array_split(order, 7):
                out[chunk] = snap.copy_pages(chunk)
                snap.mark_persisted(chunk)

        t = threading.Thread(target=writer)
        t.start()
        for _ in range(20):  # the operator keeps running during the write
            apply(rng.integers(0, 3000, 300).astype("<u4"), rng.integers(0, 10**6, 300))
        t.join()
        snap.complete()
        pm2 = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 24)
        loader = pm2.begin_load()
        loader.add(out[rng.permutation(len(out))])
        loader.finish()
        m2 = HashMap.create(pm2, "m", key="<u4", value=VALUE, page_slots=16)
        m2._check()
        assert contents(m2) == frozen, f"round {round_}"
        m._check()
        assert contents(m) == model
        assert pm.stats()["pinned_frames"] == 0


def test_rollback_restores_and_destroys_newer_structures():
    """Rollback restores every structure and removes ones created after the snapshot."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    a = HashMap.create(pm, "a", key="<u4", value="<i8", page_slots=4)
    a.put(np.arange(50, dtype="<u4"), np.arange(50))
    snap = pm.chkpt()
    a.delete(np.arange(25, dtype="<u4"))
    b = HashMap.create(pm, "b", key="<u4", value="<i8")
    b.put(np.array([1], "<u4"), np.array([1]))
    pm.rollback(snap)
    assert len(a) == 50 and int(a[3]) == 3
    assert pm.names() == ["a"]
    with pytest.raises(mmm.StructureNotFoundError, match="'b' no longer exists"):
        len(b)
    with pytest.raises(mmm.SnapshotStateError, match="RELEASED"):
        pm.rollback(snap)
    pm._check()
    assert pm.stats()["pinned_frames"] == 0


def test_rollback_after_persisting_is_refused():
    """A snapshot whose pages were persisted (and may be reused) is no rollback point."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    a = HashMap.create(pm, "a", key="<u4", value="<i8")
    a.put(np.arange(10, dtype="<u4"), np.arange(10))
    snap = pm.chkpt()
    snap.mark_persisted([0])
    with pytest.raises(mmm.SnapshotStateError, match="already persisted"):
        pm.rollback(snap)
    assert len(a) == 10


def test_load_rejects_foreign_bytes_and_duplicates():
    """Loading bytes that are not pages, or a page twice, raises PageFormatError."""
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    a = HashMap.create(pm, "a", key="<u4", value="<i8")
    a.put(np.arange(10, dtype="<u4"), np.arange(10))
    snap = pm.chkpt()
    pages = snap.copy_pages(np.arange(len(snap)))
    snap.complete()
    pm2 = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22)
    loader = pm2.begin_load()
    with pytest.raises(mmm.PageFormatError, match="not a whole number"):
        loader.add(b"x" * 100)
    with pytest.raises(mmm.PageFormatError, match="no page header"):
        loader.add(np.zeros(4096, np.uint8))
    loader.add(pages)
    loader.add(pages[:1])
    with pytest.raises(mmm.PageFormatError, match="more than once"):
        loader.finish()
    assert pm2.stats()["used_frames"] == 0


def test_file_backed_pool_reattached_by_second_process(tmp_path):
    """A second process attaches the pool file and sees the same state."""
    path = str(tmp_path / "pool")
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 22, path=path)
    m = HashMap.create(pm, "m", key="<u4", value=VALUE, page_slots=8)
    keys = np.arange(0, 3000, 7, dtype="<u4")
    m.upsert(keys, {"ts": keys.astype(np.int64)}, SPEC)
    snap = pm.chkpt()  # a copy-on-write in flight at "crash" time
    m.upsert(keys[:10], {"ts": -keys[:10].astype(np.int64)}, SPEC)
    pm.flush()
    expect = contents(m)
    script = textwrap.dedent(f"""
        import json, numpy as np, mmm
        from mmm.structures.hashmap import HashMap
        pm = mmm.PageManager.attach({path!r}, page_bytes=4096)
        pm._check()
        m = HashMap.create(pm, "m", key="<u4", value={VALUE.descr!r}, page_slots=8)
        m._check()
        k, v = m.items()
        print(json.dumps(sorted([int(a), *map(int, b)] for a, b in zip(k.tolist(), v.tolist()))))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()), check=True).stdout
    import json
    got = {row[0]: tuple(row[1:]) for row in json.loads(out)}
    assert got == expect
    del snap


def test_attach_refuses_foreign_files(tmp_path):
    """Attaching a file that is not a pool, or with another page size, raises PoolFileError."""
    bad = tmp_path / "x"
    bad.write_bytes(b"hello world" * 100)
    with pytest.raises(mmm.PoolFileError, match="not an sguard pool"):
        mmm.PageManager.attach(str(bad))
    with pytest.raises(mmm.PoolFileError, match="No such file"):
        mmm.PageManager.attach(str(tmp_path / "missing"))
    path = str(tmp_path / "pool")
    mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20, path=path)
    with pytest.raises(mmm.PoolFileError, match="page_bytes=4096"):
        mmm.PageManager.attach(path, page_bytes=8192)


def test_snapshot_does_not_import_the_manager() -> None:
    """The import arrow is one way: mmm.manager -> mmm.snapshot, never back (not even
    for type checking: a snapshot knows its owner through the SnapshotOwner protocol)."""
    import ast
    from pathlib import Path
    pkg = Path(mmm.__file__).parent
    imported = set()
    for node in ast.walk(ast.parse((pkg / "snapshot.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert "mmm.manager" not in imported and "mmm" not in imported, imported
    assert "mmm.snapshot" in {n.module for n in ast.walk(ast.parse((pkg / "manager.py")
                              .read_text())) if isinstance(n, ast.ImportFrom)}
    pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    owner: mmm.snapshot.SnapshotOwner = pm  # the manager satisfies the protocol (mypy)
    assert owner.page_bytes == 4096
