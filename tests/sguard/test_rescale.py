"""`sguard.rescale`: repartitioning by whole key groups, its replay contract, its crash safety.

State is made by the runtime itself (`run_partition_batch`, no Spark) with K small key
groups; the oracle of every repartitioned run is the same run that never rescaled.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ioservice import open_root
from sguard import rescale
from sguard.rescale import KILL_ENV, MARKER_FILE, RescaleError, repartition
from tests.sguard.rescale_helpers import K, OPS, Query, make_batches, random_run, tree_digest

ROOT = Path(__file__).resolve().parents[2]


# -- exactly-once across random repartitions ---------------------------------------------------
@pytest.mark.parametrize("seed", range(8))
def test_random_repartitions_equal_a_run_that_never_rescaled(tmp_path: Path, seed: int) -> None:
    """Batches through the runtime with repartitions P -> P' (1..K) between them, each
    after losing some partitions' newest checkpoints (sources at different batches, so
    the composed checkpoints carry per-key-group positions): every batch's output and the
    final durable state equal those of a run with one partition count throughout."""
    random_run(tmp_path, seed, lazy_p=0.0)


@pytest.mark.parametrize("seed", range(4))
def test_random_lazy_repartitions_equal_a_run_that_never_rescaled(tmp_path: Path,
                                                                  seed: int) -> None:
    """The same with most repartitions committed lazily (``lazy=True``, as at a query's
    start-up): each new partition's first task composes its checkpoint, a repartition
    right after a lazy one composes the missing partitions first, and a final lazy one is
    read through its sources (`read_durable_state`)."""
    random_run(tmp_path, 50 + seed, lazy_p=0.7)


def _made(tmp: Path, P: int, n_batches: int = 4, name: str = "window", every: int = 1,
          seed: int = 3) -> tuple[Query, list[Any]]:
    make, key, join = OPS[name]
    tables = make_batches(seed, n_batches + 4, key, join)
    q = Query(tmp, make(), key, tables[0].schema, P, K, every=every)
    for b in range(n_batches):
        q.batch(b, tables[b])
    q.stop()
    return q, tables


def _checkpoint_files(uri: str, generation: int) -> dict[str, str]:
    return {p: d for p, d in tree_digest(uri).items()
            if p.startswith("checkpoint") and f".g{generation}.p" in p}


def _referenced_files(uri: str) -> set[str]:
    """The page files the current generation's checkpoints reference."""
    from ioservice import list_checkpoints, read_manifest
    root = open_root(uri)
    lay = rescale.read_layout(root)
    assert lay is not None
    out: set[str] = set()
    for p in range(lay.num_partitions):
        for c in list_checkpoints(root, lay.haunit(p)):
            if c.has_manifest:
                out |= {f.path for f in read_manifest(root, c.name).files}
    return out


def _sources_kept(uri: str, sources: dict[str, str]) -> None:
    """Source files are never changed; the page files the new generation references are
    all there (the old generation's manifests and unreferenced pages may be swept after
    the commit)."""
    now = tree_digest(uri)
    assert all(now[p] == d for p, d in sources.items() if p in now), "a source file changed"
    refs = _referenced_files(uri)
    assert refs and refs <= set(now)
    assert refs & set(sources)  # the new generation's pages are the sources' own files


def test_key_group_positions_travel_and_the_log_fills_the_gaps(tmp_path: Path) -> None:
    """One partition's newest checkpoint is lost, so its key groups are behind the other
    partition's: each composed target records where each of its key groups is
    (``kg_batches`` when they differ, the smallest as ``batch_id``), and the query
    continued on them replays exactly what each key group missed."""
    from ioservice import list_checkpoints
    q, tables = _made(tmp_path / "run", 2, n_batches=5)
    metas = q.newest_metas()
    ahead_p = int(metas[1]["batch_id"] >= metas[0]["batch_id"])  # the one further on
    behind_p = 1 - ahead_p
    root = open_root(q.uri)
    while q.newest_metas()[behind_p]["batch_id"] >= metas[ahead_p]["batch_id"]:
        cks = [c for c in list_checkpoints(root, q.layout.haunit(behind_p)) if c.has_manifest]
        assert len(cks) >= 2, "no older checkpoint to fall back to"
        shutil.rmtree(Path(q.uri) / cks[-1].directory)  # its newest checkpoint is lost
    metas = q.newest_metas()
    at = {p: metas[p]["batch_id"] for p in (0, 1)}
    assert at[behind_p] < at[ahead_p]
    res = q.repartition(3)
    assert res.changed and res.pages > 0
    lay = q.layout
    new = q.newest_metas()
    for t, m in enumerate(new):
        assert m["key_groups"] == list(lay.key_group_range(t)) and m["partition"] == t
        pos = rescale.KeyGroupPositions.from_user_meta(m)
        assert m["batch_id"] == pos.min_batch_id
        kg = np.arange(*lay.key_group_range(t))
        want = np.where(kg < K // 2, at[0], at[1])  # partition 0 of 2 held key groups 0..3
        np.testing.assert_array_equal(pos.batch_of(kg), want)
        assert ("kg_batches" in m) == (len(set(want.tolist())) > 1)
    assert any("kg_batches" in m for m in new)
    ref = Query(tmp_path / "ref", q.op, q.key, q.schema, 2, K)
    for b in range(8):
        want_rows = ref.batch(b, tables[b])
        if b >= 5:
            assert q.batch(b, tables[b]) == want_rows, b
    q.stop()
    ref.stop()
    assert q.durable() == ref.durable()


# -- what a repartition reads and writes -----------------------------------------------------------
def _counting(monkeypatch: pytest.MonkeyPatch, uri: str) -> Any:
    """Every root `sguard.rescale` opens (the tasks' too) counts the bytes read from it."""
    import pyarrow.fs as pafs

    from ioservice import StorageRoot
    from ioservice.testing import FaultyFS
    handler = FaultyFS(pafs.LocalFileSystem(), count_reads=True)
    croot = StorageRoot(pafs.PyFileSystem(handler), str(Path(uri).resolve()))
    monkeypatch.setattr(rescale, "open_root", lambda *a, **kw: croot)
    return croot, handler


@pytest.mark.parametrize("verify", [False, True])
def test_repartition_reads_only_taken_pages_and_writes_only_manifests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool) -> None:
    """2 -> 3: no page bytes read without verify, exactly the sources' pages (each once)
    with it; the only new files are the targets' manifests and the layout documents."""
    q, _ = _made(tmp_path / "s", 2, n_batches=5)
    layout = q.layout
    srcs = q.newest_metas()
    root = open_root(q.uri)
    from ioservice import list_checkpoints, read_manifest
    mans = [read_manifest(root, [c for c in list_checkpoints(root, layout.haunit(p))
                                 if c.has_manifest][-1].name) for p in range(2)]
    in_groups = [m.select_psids(rescale.psid_ranges(0, K)).n_pages for m in mans]
    assert in_groups == [m.n_pages for m in mans] and min(in_groups) > 0  # all in key groups
    before = tree_digest(q.uri)
    croot, handler = _counting(monkeypatch, q.uri)
    res = repartition(croot, 3, verify=verify)
    page_bytes = mans[0].page_bytes
    want = sum(in_groups) * page_bytes if verify else 0
    assert handler.bytes_read("*.pages") == want == res.bytes_read
    assert res.pages == sum(in_groups) and res.state_bytes == sum(in_groups) * page_bytes
    after = tree_digest(q.uri)
    changed = [p for p, d in before.items() if p in after and after[p] != d]
    assert changed == ["sguard-operator.json"]  # the commit; nothing else touched
    refs = _referenced_files(q.uri)  # what no new checkpoint references may be swept
    assert refs <= set(before) & set(after)
    new = sorted(set(after) - set(before))
    assert new == sorted([f"checkpoint/op.g1.p{t:04d}-1/manifest.json" for t in range(3)]
                         + ["layout/g00000001.json"]), new
    assert not any(p.endswith(".pages") for p in new)
    assert {m["batch_id"] for m in q.newest_metas()} == {m["batch_id"] for m in srcs}


def _flip_a_page_byte(uri: str, generation: int) -> tuple[Path, int, int]:
    pages = sorted(p for p in Path(uri, "checkpoint").rglob("*.pages")
                   if f".g{generation}.p0001" in str(p))
    f = pages[-1]
    data = bytearray(f.read_bytes())
    at = len(data) // 2
    old = data[at]
    data[at] ^= 0x5A
    f.write_bytes(bytes(data))
    return f, at, old


def test_damaged_source_page_fails_a_verified_repartition_and_a_rerun_completes(
        tmp_path: Path) -> None:
    """A flipped byte in a source page: repartition(verify=True) raises an ioservice error
    and the layout (generation, partitions) stays; once repaired, a rerun completes and the
    continued query equals one that never rescaled."""
    from ioservice.errors import IOServiceError
    q, tables = _made(tmp_path / "s", 2, n_batches=4)
    ref, _ = _made(tmp_path / "ref", 2, n_batches=4)
    layout = q.layout
    f, at, old = _flip_a_page_byte(q.uri, 0)
    with pytest.raises(IOServiceError) as info:
        repartition(q.uri, 3, verify=True)
    assert "checksum" in str(info.value).lower() or "damaged" in str(info.value).lower(), \
        str(info.value)
    assert q.layout == layout
    data = bytearray(f.read_bytes())
    data[at] = old
    f.write_bytes(bytes(data))
    res = repartition(q.uri, 3, verify=True)
    assert res.changed and (q.layout.generation, q.layout.num_partitions) == (1, 3)
    assert not Path(q.uri, MARKER_FILE).exists()
    for b in range(4, 7):
        assert q.batch(b, tables[b]) == ref.batch(b, tables[b])
    q.stop()
    ref.stop()
    assert q.durable() == ref.durable()


def test_lazy_compose_falls_back_past_a_damaged_source_page(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A flipped byte in a page of a source's newest checkpoint, found only after a lazy
    commit (the layout is the new one already): the first task composing that page's
    key groups falls back to the source's older checkpoint and replays the longer log,
    and the query equals one that never rescaled."""
    import logging
    q, tables = _made(tmp_path / "s", 2, n_batches=4)
    ref, _ = _made(tmp_path / "ref", 2, n_batches=4)
    _flip_a_page_byte(q.uri, 0)
    repartition(q.uri, 3, lazy=True)
    with caplog.at_level(logging.WARNING, logger="sguard.rescale"):
        for b in range(4, 7):
            assert q.batch(b, tables[b]) == ref.batch(b, tables[b])
    assert "damaged, trying an older one" in caplog.text
    q.stop()
    ref.stop()
    assert q.durable() == ref.durable()


def test_a_reader_of_an_uncomposed_partition_falls_back_past_a_damaged_source_page(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The same damage read before any task composed: every reader of the uncomposed
    partitions (`read_durable_state`, `read_partition_at` as ``sguard state show`` and
    `read_state`'s tasks run it, `restore_piece`) falls back to the source's older
    checkpoint and replays the longer log, returning the state of a run that never
    rescaled; the positions it replays from are exactly those of the checkpoint the
    query's first task then composes, and the continued query equals that run too."""
    import logging
    from ioservice import list_checkpoints, read_manifest
    from mmm import PageManager
    from sguard.spark.groupstate import open_state
    from sguard.spark.reader import PARTITION_COLUMN, available_batches, read_partition_at
    from tests.sguard.rescale_helpers import rows_of
    q, tables = _made(tmp_path / "s", 2, n_batches=4)
    ref, _ = _made(tmp_path / "ref", 2, n_batches=4)
    want = ref.durable()
    assert want
    _flip_a_page_byte(q.uri, 0)
    repartition(q.uri, 3, lazy=True)
    root, lay = open_root(q.uri), q.layout
    assert rescale.uncomposed(q.uri) == [0, 1, 2]
    planned = [rescale.pending_manifest(root, lay, t) for t in range(3)]
    verified = [rescale.pending_manifest(root, lay, t, verified=True) for t in range(3)]
    metas = [(m.user_meta, v.user_meta) for m, v in zip(planned, verified)
             if m is not None and v is not None]
    fell_back = [v for m, v in metas if m != v]
    assert fell_back, "the damaged page is in no target's composition"
    assert all(v["batch_id"] < 3 or v.get("kg_batches") for v in fell_back)  # older positions
    with caplog.at_level(logging.WARNING, logger="sguard.rescale"):
        assert q.durable() == want
    assert "verifying them one by one" in caplog.text
    assert available_batches(q.uri)[1] == 3
    assert rows_of([read_partition_at(root, lay, t, 3).drop([PARTITION_COLUMN])
                    for t in range(3)]) == want
    for t, v in enumerate(verified):  # a piece's positions are the fallen-back ones
        if v is None:
            continue
        pm = PageManager(v.page_bytes, 1 << 26)
        (lo, hi), pos = rescale.restore_piece(q.uri, t, 1, 0, pm)
        assert pos == rescale.KeyGroupPositions.from_user_meta(v.user_meta).restrict(lo, hi)
        whole = PageManager(v.page_bytes, 1 << 26)
        rescale.load_manifest(whole, root, v)
        assert rows_of([open_state(q.op, pm, q.schema, q.key, (lo, hi)).dump()]) == \
            rows_of([open_state(q.op, whole, q.schema, q.key, (lo, hi)).dump()])
    assert rescale.uncomposed(q.uri) == [0, 1, 2]  # readers wrote nothing
    for b in range(4, 7):  # the query's first tasks compose past the damage
        assert q.batch(b, tables[b]) == ref.batch(b, tables[b])
        if b > 4:
            continue
        for t, v in enumerate(verified):  # the composed checkpoint is what readers read
            first = [c for c in list_checkpoints(root, lay.haunit(t)) if c.has_manifest][0]
            got = read_manifest(root, first.name)
            assert v is not None and got.user_meta == v.user_meta
            assert got.pages.page_id.tolist() == v.pages.page_id.tolist()
            assert [f.path for f in got.files] == [f.path for f in v.files]
    q.stop()
    ref.stop()
    assert q.durable() == ref.durable()


# -- lazy commit (a query's start-up) ----------------------------------------------------------
def test_lazy_repartition_keeps_sources_until_every_partition_composed(tmp_path: Path) -> None:
    """``repartition(lazy=True)`` commits 2 -> 3 with no composition: the old generation
    survives every sweep while a new partition has not composed; readers (the durable
    state, `restore_piece`) see an uncomposed partition through its sources, the same
    state as once composed; each partition's first task composes (once), the batches
    equal a run that never rescaled, and only then does the sweep delete what no composed
    checkpoint references."""
    from mmm import PageManager
    from sguard.spark.groupstate import open_state
    from tests.sguard.rescale_helpers import rows_of
    make, key, join = OPS["running_int"]
    tables = make_batches(11, 7, key, join)
    ref = Query(tmp_path / "ref", make(), key, tables[0].schema, 2, K, every=1)
    want = [ref.batch(b, t) for b, t in enumerate(tables)]
    ref.stop()
    q = Query(tmp_path / "s", make(), key, tables[0].schema, 2, K, every=1)
    for b in range(4):
        assert q.batch(b, tables[b]) == want[b]
    q.stop()
    uri, root = q.uri, open_root(q.uri)
    original = q.durable()
    sources = _checkpoint_files(uri, 0)
    res = repartition(uri, 3, lazy=True)
    lay = q.layout
    assert res.changed and (lay.generation, lay.num_partitions) == (1, 3)
    assert rescale.pending_sources(lay) is not None
    assert rescale.uncomposed(uri) == [0, 1, 2]
    assert not [p for p in tree_digest(uri) if ".g1." in p]  # nothing composed, no job
    assert rescale.sweep_old_generations(uri) == 0 and _checkpoint_files(uri, 0) == sources
    assert q.durable() == original  # every partition read through its sources
    from sguard.spark.reader import PARTITION_COLUMN, available_batches, read_partition_at
    assert available_batches(uri)[1] == 3  # `sguard state show`'s reader, too
    assert rows_of([read_partition_at(root, lay, t, 3).drop([PARTITION_COLUMN])
                    for t in range(3)]) == original

    def pieces(t: int) -> list[Any]:
        out = []
        for j in range(2):
            pm = PageManager(1 << 16, 1 << 26)
            (lo, hi), pos = rescale.restore_piece(uri, t, 2, j, pm)
            assert pos.ranges and all(lo <= a < b <= hi for a, b, _ in pos.ranges)
            out.append(open_state(q.op, pm, q.schema, q.key, (lo, hi)).dump())
        return rows_of(out)

    through_sources = pieces(1)
    assert through_sources
    assert rescale.compose_if_pending(root, lay, 1)  # partition 1's first task
    assert not rescale.compose_if_pending(root, lay, 1)  # once
    assert rescale.uncomposed(uri) == [0, 2]
    assert pieces(1) == through_sources  # the same state, now from its own checkpoint
    assert rescale.sweep_old_generations(uri) == 0 and _checkpoint_files(uri, 0) == sources
    assert q.durable() == original  # one composed, two through their sources
    for b in range(4, 7):  # the query runs on: each partition composes in its first task
        assert q.batch(b, tables[b]) == want[b]
        assert rescale.uncomposed(uri) == []
    q.stop()
    assert q.durable() == ref.durable()
    assert rescale.sweep_old_generations(uri) > 0  # now the old generation may go
    _sources_kept(uri, sources)


def test_repartition_after_a_lazy_one_composes_the_missing_partitions_first(
        tmp_path: Path) -> None:
    """A lazily committed 2 -> 3 that never ran is repartitioned again (3 -> 2): the
    uncomposed partitions are composed from their sources first, so nothing is read as
    empty, and the state is the same."""
    q, _ = _made(tmp_path / "s", 2, n_batches=4, name="running_str")
    original = q.durable()
    repartition(q.uri, 3, lazy=True)
    assert rescale.uncomposed(q.uri) == [0, 1, 2]
    res = repartition(q.uri, 2)
    lay = q.layout
    assert res.changed and (lay.generation, lay.num_partitions) == (2, 2)
    assert rescale.pending_sources(lay) is None
    assert q.durable() == original
    repartition(q.uri, 4, lazy=True)  # and lazily again, read through its sources
    assert q.durable() == original


# -- parallel recovery -------------------------------------------------------------------------------
@pytest.mark.parametrize("pieces", [1, 3, 4])
def test_restore_piece_splits_a_partition_into_disjoint_pieces_reading_only_theirs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pieces: int) -> None:
    """k pieces of partition 1: disjoint key groups that together are the partition's,
    their states together the partition's state, each reading only its own pages."""
    from ioservice import list_checkpoints, read_manifest, restore
    from mmm import PageManager
    from sguard.spark.groupstate import open_state, stored_key_groups
    from tests.sguard.rescale_helpers import rows_of
    q, _ = _made(tmp_path / "s", 2, n_batches=4, name="running_str")
    layout = q.layout
    root = open_root(q.uri)
    man = read_manifest(root, [c for c in list_checkpoints(root, layout.haunit(1))
                               if c.has_manifest][-1].name)
    whole = PageManager(man.page_bytes, 1 << 26)
    restore(whole, root, layout.haunit(1))
    kg_range = layout.key_group_range(1)
    want = rows_of([open_state(q.op, whole, q.schema, q.key, kg_range).dump()])
    assert want
    croot, handler = _counting(monkeypatch, q.uri)
    got, seen = [], []
    for j in range(pieces):
        handler.reset_counters()
        pm = PageManager(man.page_bytes, 1 << 26)
        (lo, hi), pos = rescale.restore_piece(croot, 1, pieces, j, pm)
        mine = man.select_psids(rescale.psid_ranges(lo, hi)).n_pages
        assert handler.bytes_read("*.pages") == mine * man.page_bytes
        assert set(stored_key_groups(pm)) <= set(range(lo, hi))
        assert pos.ranges and all(lo <= a < b <= hi for a, b, _ in pos.ranges)
        assert pos.min_batch_id == man.user_meta["batch_id"]
        seen.append((lo, hi))
        got.append(open_state(q.op, pm, q.schema, q.key, (lo, hi)).dump())
    assert seen[0][0] == kg_range[0] and seen[-1][1] == kg_range[1]
    assert all(a[1] == b[0] for a, b in zip(seen, seen[1:]))  # contiguous, disjoint
    assert rows_of(got) == want
    with pytest.raises(RescaleError, match=f"piece {pieces} of {pieces}"):
        rescale.restore_piece(q.uri, 1, pieces, pieces, PageManager(man.page_bytes, 1 << 20))
    with pytest.raises(RescaleError, match="partition 2 out of range"):
        rescale.restore_piece(q.uri, 2, pieces, 0, PageManager(man.page_bytes, 1 << 20))


# -- bad input, refusals, no-ops ---------------------------------------------------------------------
def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sguard", "state", "repartition", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``sguard state repartition`` through the CLI's `main` in this process (the same parser,
    checks and messages as `_run_cli`, without a process start-up each; every refusal here
    comes before Spark would start), as a completed process."""
    from sguard.cli import main
    capsys.readouterr()
    try:
        code = main(["state", "repartition", *args])
    except SystemExit as exc:
        code = int(exc.code or 0)
    got = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, got.out, got.err)


def _one_line(out: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_input_gets_one_line_errors_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Unknown URI, no state there, P' < 1 or > K, a source checkpoint of another operator:
    a `RescaleError` naming the fault (CLI: one line, exit 2) and not a byte written."""
    from ioservice import CheckpointManager
    from mmm import PageManager
    q, _ = _made(tmp_path / "s", 2, n_batches=2, name="running_int")
    uri = q.uri
    before = tree_digest(uri)
    with pytest.raises(RescaleError, match="does not exist"):
        repartition(str(tmp_path / "nope"), 2)
    assert not (tmp_path / "nope").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(RescaleError, match="no sguard operator state"):
        repartition(str(tmp_path / "empty"), 2)
    for bad in (0, -3, True, 2.5, "3"):
        with pytest.raises(RescaleError, match="partitions must be an integer >= 1"):
            repartition(uri, bad)  # type: ignore[arg-type]
    with pytest.raises(RescaleError, match=f"exceeds the state's {K} key groups"):
        repartition(uri, K + 1)
    assert tree_digest(uri) == before
    _one_line(_main(capsys, uri, "--partitions", "0"), 2, "--partitions must be >= 1")
    _one_line(_main(capsys, str(tmp_path / "nope"), "--partitions", "3"), 2, "does not exist")
    _one_line(_main(capsys, str(tmp_path / "empty"), "--partitions", "3"), 2,
              "no sguard operator state")
    _one_line(_main(capsys, uri, "--partitions", str(K + 1)), 2, f"{K} key groups")
    out = _main(capsys, uri, "--partitions", "x")  # argparse: usage + one error line, exit 2
    assert out.returncode == 2 and "invalid int value" in out.stderr.splitlines()[-1]
    assert tree_digest(uri) == before
    # a checkpoint of another operator in partition 1's HA unit
    layout = q.layout
    pm = PageManager(1 << 16, 1 << 20)
    with CheckpointManager(pm, open_root(uri), layout.haunit(1)) as mgr:
        mgr.checkpoint({"operator": "other_op", "name": "op", "generation": 0,
                        "partition": 1, "num_partitions": 2, "batch_id": 9}).result()
    pm.close()
    mixed = tree_digest(uri)
    with pytest.raises(RescaleError, match="is not partition 1 of generation 0.*other_op"):
        repartition(uri, 3)
    _one_line(_main(capsys, uri, "--partitions", "3"), 2, "other_op")
    assert tree_digest(uri) == mixed
    assert q.layout == layout


def test_layout_version_1_is_refused_naming_the_convert_command(tmp_path: Path) -> None:
    """A state URI written before key groups is never misread: the API and the CLI refuse
    it, naming `sguard state convert`, and write nothing."""
    uri = tmp_path / "old"
    uri.mkdir()
    doc = {"layout_version": 1, "operator": "running_aggregate", "name": "op",
           "schema": {}, "num_partitions": 2, "key": "k", "generation": 0,
           "schema_version": 1, "partitioner": "spark-murmur3", "extra": {}}
    (uri / "sguard-operator.json").write_text(json.dumps(doc))
    before = tree_digest(str(uri))
    with pytest.raises(RescaleError, match="sguard state convert"):
        repartition(str(uri), 3)
    _one_line(_run_cli(str(uri), "--partitions", "3"), 2, "layout_version 1",
              "sguard state convert")
    assert tree_digest(str(uri)) == before


def test_foreign_next_generation_is_refused_not_deleted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """HA units of generation g+1 that no repartition marked are left alone."""
    from ioservice import CheckpointManager
    from mmm import PageManager
    q, _ = _made(tmp_path / "s", 2, n_batches=2, name="running_int")
    pm = PageManager(1 << 16, 1 << 20)
    with CheckpointManager(pm, open_root(q.uri), "op.g1.p0000") as mgr:
        mgr.checkpoint({}).result()
    pm.close()
    before = tree_digest(q.uri)
    with pytest.raises(RescaleError, match="no repartition made them"):
        repartition(q.uri, 3)
    _one_line(_main(capsys, q.uri, "--partitions", "3"), 2, "no repartition made them")
    assert tree_digest(q.uri) == before


def test_same_partition_count_is_a_no_op_unless_forced(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Asking for the current P writes nothing (API and CLI); force writes a generation."""
    q, tables = _made(tmp_path / "s", 3, n_batches=3, name="running_int")
    before = tree_digest(q.uri)
    res = repartition(q.uri, 3)
    assert not res.changed and res.generation == 0 and res.pages == 0
    out = _main(capsys, q.uri, "--partitions", "3")
    assert out.returncode == 0 and "nothing to do" in out.stdout, out.stderr
    assert len(out.stdout.strip().splitlines()) == 1
    assert tree_digest(q.uri) == before
    res = repartition(q.uri, 3, force=True)
    assert res.changed and res.generation == 1 and res.pages > 0
    assert (q.layout.generation, q.layout.num_partitions) == (1, 3)
    ref, _ = _made(tmp_path / "ref", 3, n_batches=3, name="running_int")
    assert q.batch(3, tables[3]) == ref.batch(3, tables[3])
    q.stop()
    ref.stop()
    assert q.durable() == ref.durable()


# -- crash safety ------------------------------------------------------------------------------------
_POINTS = ["validated", "marked", "cleaned", "compose", "composed", "before_commit", "committed"]
_CHILD = """
import sys
from sguard.rescale import repartition
repartition(sys.argv[1], int(sys.argv[2]), verify=sys.argv[3] == "1")
"""


def _child(uri: str, P2: int, point: str | None, verify: bool = True
           ) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(KILL_ENV, None)
    if point is not None:
        env[KILL_ENV] = point
    return subprocess.run([sys.executable, "-c", _CHILD, uri, str(P2), "1" if verify else "0"],
                          env=env, timeout=300, capture_output=True, cwd=ROOT)


@pytest.mark.parametrize("trial", range(len(_POINTS) + 3))
def test_killed_repartition_leaves_sources_intact_and_a_rerun_completes(
        tmp_path: Path, trial: int) -> None:
    """A real process SIGKILLed at each point of the repartition (the n-th pass of the
    per-target points; some after an earlier interrupted run to another count): the
    sources' files are untouched, the layout changes only at ``committed``, the durable
    state is the same, and a rerun completes to the same state, leaving no marker."""
    point = _POINTS[trial % len(_POINTS)]
    rng = np.random.default_rng(trial)
    P = 2 + trial % 2
    P2 = [1, 4, 5, 6][trial % 4]  # never P, nor P - 2 (the earlier run goes to P2 + 2)
    nth = int(rng.integers(1, min(P2, 2) + 1)) if point in ("compose", "composed") else 1
    q, _ = _made(tmp_path / "s", P, n_batches=3, name="running_str")
    uri = q.uri
    original = q.durable()
    if trial >= len(_POINTS):  # an earlier interrupted run left part of a generation
        out = _child(uri, P2 + 2, "composed:1")
        assert out.returncode == -signal.SIGKILL, out.stderr.decode()[-2000:]
    sources = _checkpoint_files(uri, 0)
    layout = q.layout
    out = _child(uri, P2, f"{point}:{nth}", verify=bool(trial % 2))
    assert out.returncode == -signal.SIGKILL, (point, out.stderr.decode()[-2000:])
    assert _checkpoint_files(uri, 0) == sources, "a source checkpoint changed"
    now = q.layout
    if point == "committed":
        assert (now.generation, now.num_partitions) == (1, P2)
    else:
        assert now == layout
        assert point == "validated" or Path(uri, MARKER_FILE).exists()
    assert q.durable() == original  # the old generation's or the new one's: the same
    res = repartition(uri, P2)
    assert res.changed == (point != "committed")
    lay = q.layout
    assert (lay.generation, lay.num_partitions) == (1, P2)
    assert not Path(uri, MARKER_FILE).exists()
    _sources_kept(uri, sources)
    assert not [p for p in tree_digest(uri) if ".g2." in p]
    assert q.durable() == original


def test_state_show_storage_failure_is_one_line_exit_1(tmp_path: Path) -> None:
    """``sguard state show`` over storage that fails (the input log is a file, not a
    directory): one error line, exit 1 (not a traceback)."""
    q, _ = _made(tmp_path / "s", 2, n_batches=2, name="running_int")
    shutil.rmtree(Path(q.uri) / "inputlog")
    (Path(q.uri) / "inputlog").write_text("not a directory")
    out = subprocess.run([sys.executable, "-m", "sguard", "state", "show", q.uri],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    _one_line(out, 1, "sguard state show: error:")
