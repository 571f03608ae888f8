"""`sguard.rescale` on the driver touches O(P + K) data, never the state's page tables.

The driver plans from the manifests' *headers* (`ioservice.read_manifest_header`) and
sweeps with the file lists the tasks return; the target tasks parse and validate the page
tables. Checked
by counting page-table decodes (`ioservice.format.page_table_decodes`) and manifest bytes
read outside the tasks, for two state sizes, not by timing.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest

from ioservice import StorageRoot, list_checkpoints, open_root, read_manifest
from ioservice.format import page_table_decodes
from ioservice.testing import FaultyFS
from sguard import rescale
from sguard.statelayout import read_layout
from tests.sguard.rescale_helpers import Query
from tests.sguard.test_rescale import K, _made
from tests.test_readme import checkout

MB = 1 << 20


def _driver_counts(monkeypatch: pytest.MonkeyPatch, uri: str, to: int
                   ) -> tuple[dict[str, Any], rescale.RescaleResult]:
    """Repartition `uri` to `to` through a byte-counting root; the page tables decoded and
    the manifest bytes read (per manifest) by the driver (outside the tasks) and by the
    tasks."""
    handler = FaultyFS(pafs.LocalFileSystem(), count_reads=True)
    croot = StorageRoot(pafs.PyFileSystem(handler), str(Path(uri).resolve()))
    monkeypatch.setattr(rescale, "open_root", lambda *a, **kw: croot)
    marks: list[tuple[int, dict[str, int]]] = []

    def now() -> tuple[int, dict[str, int]]:
        return page_table_decodes(), {p: n for p, n in handler._read_bytes.items()
                                      if p.endswith("manifest.json")}

    def run(tasks: Sequence[rescale.TargetTask]) -> list[dict[str, Any]]:
        marks.append(now())
        out = [rescale.compose_target(t) for t in tasks]
        marks.append(now())
        return out

    start = now()
    res = rescale.repartition(croot, to, run=run)
    end = now()
    (d1, m1), (d2, m2) = marks

    def diff(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {p: n - a.get(p, 0) for p, n in b.items() if n > a.get(p, 0)}
    driver = diff(start[1], m1)
    for p, n in diff(m2, end[1]).items():
        driver[p] = driver.get(p, 0) + n
    return {"driver_decodes": (d1 - start[0]) + (end[0] - d2), "driver_bytes": driver,
            "task_decodes": d2 - d1, "task_bytes": diff(m1, m2)}, res


def test_the_driver_reads_no_page_table_whatever_the_state_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 -> 3 -> 2 on a 1 MB and an 8 MB state (same K): the driver decodes no page table,
    and of each source manifest it plans with it reads only a prefix that ends within
    twice the header's length (the header read starts at 1 KiB here and doubles), while
    the tasks read and decode every source manifest they take in full."""
    import ioservice.recovery
    monkeypatch.setattr(ioservice.recovery, "HEADER_FIRST_BYTES", 1024)
    # `bench` is not part of the installed package: imported from the checkout
    monkeypatch.setattr(sys, "path", [*sys.path, str(checkout())])
    build = importlib.import_module("bench.rescale").build
    heads: dict[str, int] = {}
    for mb in (1, 8):
        uri = str(tmp_path / f"s{mb}")
        info = build(uri, mb * MB, 2, 16)
        for to in (3, 2):
            for m in Path(uri, "checkpoint").glob("*/manifest.json"):
                heads.setdefault(str(m), m.read_bytes().index(b'\n "page_table": '))
            with monkeypatch.context() as mp:
                c, res = _driver_counts(mp, uri, to)
            assert res.changed and res.pages == info["pages"], (mb, to, res)
            assert c["driver_decodes"] == 0, (mb, to, c)
            assert c["task_decodes"] >= to, (mb, to, c)  # each task parsed its sources
            assert len(c["driver_bytes"]) == 5 - to, c  # the sources' headers, nothing else
            for m in Path(uri, "checkpoint").glob("*/manifest.json"):
                heads.setdefault(str(m), m.read_bytes().index(b'\n "page_table": '))
            for p, n in c["driver_bytes"].items():
                assert n <= max(1024, 2 * heads[p]), (mb, to, p, n, heads[p])
            for p, n in c["task_bytes"].items():  # read whole
                assert not Path(p).exists() or n >= Path(p).stat().st_size, (p, n)
            if mb == 8:  # here the page tables are most of a manifest
                assert sum(c["task_bytes"].values()) > 2 * sum(
                    n for p, n in c["driver_bytes"].items() if p in c["task_bytes"])


def test_a_task_falls_back_when_the_planned_page_table_is_damaged(tmp_path: Path) -> None:
    """Partition 0's newest manifest has an intact header but a damaged page table: the
    driver plans with it (it reads headers only), the tasks refuse it and take the
    partition's previous checkpoint, as a restore would; the composed checkpoints say so
    (their key groups' positions are that checkpoint's batch) and the query continued on
    them equals a run that never rescaled."""
    q, tables = _made(tmp_path / "run", 2, n_batches=5)
    root = open_root(q.uri)
    lay = q.layout
    cks = [c for c in list_checkpoints(root, lay.haunit(0)) if c.has_manifest]
    assert len(cks) >= 2
    prev = read_manifest(root, cks[-2].name)
    path = Path(q.uri) / cks[-1].directory / "manifest.json"
    data = bytearray(path.read_bytes())
    at = data.index(b'"page_id"') + 20  # inside the base64 column text
    data[at] = ord("A") if data[at] != ord("A") else ord("B")
    path.write_bytes(bytes(data))
    head = rescale.plan(q.uri)[1][0]
    assert head.name == cks[-1].name  # the driver cannot tell
    res = q.repartition(3)
    assert res.changed
    new = q.layout
    for t, m in enumerate(q.newest_metas()):
        pos = rescale.KeyGroupPositions.from_user_meta(m)
        lo, hi = new.key_group_range(t)
        kg = np.arange(lo, hi)
        in0 = kg < lay.key_group_range(0)[1]
        assert (pos.batch_of(kg)[in0] == prev.user_meta["batch_id"]).all(), (t, m)
    ref = Query(tmp_path / "ref", q.op, q.key, q.schema, 2, K)
    for b in range(7):
        want = ref.batch(b, tables[b])
        if b >= 5:
            assert q.batch(b, tables[b]) == want, b
    q.stop()
    ref.stop()
    assert q.durable() == ref.durable()


def test_manifest_header_reads_the_small_fields_and_refuses_a_damaged_one(
        tmp_path: Path) -> None:
    """`read_manifest_header` returns what `read_manifest` says of the small fields, also
    when ``user_meta`` holds the text that ends a header (escaped inside a string) and
    when the first read is tiny; a damaged header is a `ManifestError`, and `plan` then
    takes the partition's previous checkpoint."""
    from ioservice import CheckpointManager, ManifestError, read_manifest_header
    from mmm import HashMap, PageManager
    root = open_root(str(tmp_path / "r"))
    pm = PageManager(1 << 16, 1 << 26)
    HashMap.create(pm, "m", "<i8", [("a", "<i8")]).load_distinct(
        np.arange(50_000, dtype=np.int64), np.zeros(50_000, [("a", "<i8")]))
    meta = {"note": '\n "files": [', "batch_id": 4}
    with CheckpointManager(pm, root, "hu") as mgr:
        man = mgr.checkpoint(meta).result()
    pm.close()
    for first in (None, 256):
        head = read_manifest_header(root, man.name, first_bytes=first)
        assert (head.name, head.page_bytes, dict(head.user_meta)) == \
            (man.name, man.page_bytes, meta)
    path = Path(tmp_path / "r" / man.manifest_path)
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"user_meta": {', b'"user_meta": {{', 1))
    with pytest.raises(ManifestError, match="header is not valid JSON"):
        read_manifest_header(root, man.name)
    # in a state: the damaged newest checkpoint of partition 0 is skipped by the plan
    q, _ = _made(tmp_path / "run", 2, n_batches=5)
    sroot = open_root(q.uri)
    cks = [c for c in list_checkpoints(sroot, q.layout.haunit(0)) if c.has_manifest]
    mpath = Path(q.uri) / cks[-1].directory / "manifest.json"
    mpath.write_bytes(mpath.read_bytes().replace(b'"user_meta": {', b'"user_meta": [', 1))
    _, srcs = rescale.plan(q.uri)
    assert srcs[0].name == cks[-2].name and srcs[0].older == tuple(
        c.name for c in reversed(cks[:-2]))
