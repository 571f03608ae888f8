"""Composed checkpoints and partial restores (issue 20, ioservice part).

Sources are real checkpoints of several HA units on a real local filesystem
(`StorageRoot` over pyarrow's LocalFileSystem). Their page sets sit in psid
blocks, as key groups' do: group ``g`` owns psids ``[(g + 1) * B, (g + 2) * B)``.
The oracle is the sources themselves: a composed checkpoint must restore
exactly the selected page sets, byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmm
from ioservice import (CheckpointDamagedError, CheckpointManager, CheckpointNotFoundError,
                       CheckpointPolicy, CompositionConflictError, CompositionError,
                       DamagedCheckpointWarning, DuplicatePagesError, IOService, Manifest,
                       ManifestError, OverlappingRangesError, PageSizeMismatchError, StorageRoot,
                       open_root, read_manifest, restore, verify_checkpoint)
from ioservice.format import COMPOSED_FORMAT_VERSION, FORMAT_VERSION, psid_mask
from ioservice.testing import FaultyFS
from mmm.structures.hashmap import HashMap

PAGE_BYTES = 4096
B = 8  # psids per group
VAL_DT = np.dtype([("n", "<i8"), ("s", "<f8")])


# ----------------------------------------------------------------------------- helpers


def new_pm(page_bytes: int = PAGE_BYTES) -> mmm.PageManager:
    return mmm.PageManager(page_bytes=page_bytes, capacity_bytes=64 << 20)


def psid_of_group(g: int, j: int = 0) -> int:
    return (g + 1) * B + j


def open_map(pm: mmm.PageManager, g: int, j: int = 0) -> HashMap:
    return HashMap.create(pm, f"g{g:03d}/m{j}", key="<u8", value=VAL_DT)


def fill(m: HashMap, seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 1 << 40, n).astype("<u8")
    m.upsert(keys, {"x": rng.random(n)}, {"n": "count", "s": ("sum", "x")})


def build_pm(groups: list[int], seed: int, *, per_group: int = 2, n: int = 600,
             page_bytes: int = PAGE_BYTES) -> mmm.PageManager:
    """A page manager whose structures ``g{g}/m{j}`` have psid ``psid_of_group(g, j)``
    (fillers are created and destroyed to move the psid counter forward)."""
    pm = new_pm(page_bytes)
    k = last = 0
    for g in sorted(groups):
        for j in range(per_group):
            want = psid_of_group(g, j)
            while last < want - 1:  # advance the psid counter by public calls only
                last = pm.create(f"~fill{k}")
                k += 1
                pm.destroy(last)
            m = open_map(pm, g, j)
            last = want
            assert pm.recover(f"g{g:03d}/m{j}") == want
            fill(m, seed * 1000 + g * 10 + j, n + 97 * j + 31 * g)
    return pm


def content(pm: mmm.PageManager) -> dict[str, Any]:
    """name -> sorted (keys, values) of every structure (the oracle's state)."""
    out = {}
    for name in sorted(pm.names()):
        if name.startswith("~"):
            continue
        m = HashMap.create(pm, name, key="<u8", value=VAL_DT)
        k, v = m.items()
        order = np.argsort(k, kind="stable")
        out[name] = (k[order].tobytes(), v[order].tobytes())
    return out


def page_bytes_of(root: StorageRoot, man: Manifest) -> dict[int, bytes]:
    """page_id -> page bytes, read and verified through IOService."""
    got: dict[int, bytes] = {}
    with IOService(2) as io:
        def sink(pages: np.ndarray) -> None:
            for row in pages:
                pid = int(np.frombuffer(row[:64].tobytes(), dtype=mmm.page.HEADER_DTYPE)[0]
                          ["page_id"])
                got[pid] = row.tobytes()
        io.read_pages(root, man, sink)
    return got


def checkpoint_unit(root: StorageRoot, haunit: str, pm: mmm.PageManager,
                    meta: dict[str, Any] | None = None, **kw: Any) -> Manifest:
    with CheckpointManager(pm, root, haunit, n_workers=2, **kw) as mgr:
        return mgr.checkpoint(meta or {}).result()  # type: ignore[union-attr]


def listing(base: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(base)), p.stat().st_size if p.is_file() else -1)
                  for p in base.rglob("*"))


def local_root(path: Path) -> StorageRoot:
    return open_root(str(path))


@pytest.fixture
def root(tmp_path: Path) -> StorageRoot:
    return local_root(tmp_path / "store")


def two_sources(root: StorageRoot) -> tuple[Manifest, Manifest, mmm.PageManager, mmm.PageManager]:
    """Units a (groups 0-2) and b (groups 3-5); a has a two-checkpoint chain."""
    pa_ = build_pm([0, 1, 2], seed=1)
    with CheckpointManager(pa_, root, "a", n_workers=2) as mgr:
        mgr.checkpoint({"at": 1}).result()
        fill(open_map(pa_, 1), 99, 50)  # a-2 rewrites group 1's pages, references the rest
        man_a = mgr.checkpoint({"at": 2}).result()
    assert not man_a.full and len(man_a.referenced_checkpoints) == 2
    pb_ = build_pm([3, 4, 5], seed=2)
    man_b = checkpoint_unit(root, "b", pb_, {"at": 7})
    return man_a, man_b, pa_, pb_


def group_ranges(groups: list[int]) -> list[tuple[int, int]]:
    return [(psid_of_group(g), psid_of_group(g + 1)) for g in groups]


def expected_content(pms_and_ranges: list[tuple[mmm.PageManager, list[tuple[int, int]]]]
                     ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pm, rs in pms_and_ranges:
        for name, val in content(pm).items():
            psid = pm.recover(name)
            if any(lo <= psid < hi for lo, hi in rs):
                out[name] = val
    return out


# ------------------------------------------------------------------------ compose basics


def test_compose_writes_only_a_manifest_and_restores_the_selection(root: StorageRoot,
                                                                   tmp_path: Path) -> None:
    man_a, man_b, pa_, pb_ = two_sources(root)
    before = listing(tmp_path / "store")
    parts = [(man_a, group_ranges([1, 2])), (man_b, group_ranges([3]))]
    pm = new_pm()
    croot, handler = counting_root(tmp_path / "store")
    with CheckpointManager(pm, croot, "c", n_workers=2, check_root=False) as mgr:
        man = mgr.compose(parts, user_meta={"batch": 5})
        assert mgr.base is man
    assert handler.bytes_read() == 0  # not even a manifest: the parts are given
    assert handler.stats().get("open_input_file", 0) == 0
    assert handler.stats()["written_bytes"] == \
        (tmp_path / "store" / man.manifest_path).stat().st_size  # the manifest only
    after = listing(tmp_path / "store")
    added = sorted(set(after) - set(before))
    # exactly one new directory holding one manifest: no page bytes written
    assert [p for p, _ in added] == ["checkpoint/c-1", "checkpoint/c-1/manifest.json"]
    assert set(before) <= set(after)
    assert man.composed and man.composed_from == ("a-2", "b-1") and man.base is None
    assert not man.full and man.depth == man_a.depth == 1 and man.n_pages_written == 0
    assert man.user_meta == {"batch": 5}
    doc = json.loads((tmp_path / "store" / man.manifest_path).read_bytes())
    assert doc["format_version"] == COMPOSED_FORMAT_VERSION
    assert doc["composed_from"] == ["a-2", "b-1"]
    assert set(man.referenced_checkpoints) == {"a-1", "a-2", "b-1"}
    assert read_manifest(root, "c-1").same_content(man)
    # exactly the source rows in the ranges
    rows_a = psid_mask(man_a.pages.page_id, group_ranges([1, 2]))
    rows_b = psid_mask(man_b.pages.page_id, group_ranges([3]))
    want_ids = np.sort(np.concatenate([man_a.pages.page_id[rows_a], man_b.pages.page_id[rows_b]]))
    assert np.array_equal(man.pages.page_id, want_ids)
    assert set(man.structures) == {"g001/m0", "g001/m1", "g002/m0", "g002/m1", "g003/m0",
                                   "g003/m1"}
    # restore: exactly the selected pages, byte for byte; structures equal the sources'
    pm2 = new_pm()
    got = restore(pm2, root, "c")
    assert got.name == "c-1" and got.user_meta == {"batch": 5}
    assert content(pm2) == expected_content([(pa_, group_ranges([1, 2])),
                                             (pb_, group_ranges([3]))])
    src_pages = {**page_bytes_of(root, man_a), **page_bytes_of(root, man_b)}
    comp_pages = page_bytes_of(root, man)
    assert set(comp_pages) == set(want_ids.tolist())
    assert all(comp_pages[p] == src_pages[p] for p in comp_pages)
    verify_checkpoint(root, "c-1")


def test_ordinary_checkpoints_stay_version_2(root: StorageRoot, tmp_path: Path) -> None:
    man = checkpoint_unit(root, "plain", build_pm([0], seed=3))
    doc = json.loads((tmp_path / "store" / man.manifest_path).read_bytes())
    assert doc["format_version"] == FORMAT_VERSION == 2 and "composed_from" not in doc
    assert not man.composed


def test_incremental_after_compose_writes_only_changed_pages(root: StorageRoot) -> None:
    man_a, man_b, pa_, pb_ = two_sources(root)
    parts = [(man_a, group_ranges([0, 1])), (man_b, group_ranges([4, 5]))]
    pm = new_pm()
    with CheckpointManager(pm, root, "c", n_workers=2,
                           policy=CheckpointPolicy(full_every=8, keep=None)) as mgr:
        comp = mgr.compose(parts)
        assert mgr.restore().name == comp.name  # load the composed state
        assert mgr.checkpoint() is None  # nothing changed since the composed base
        m = open_map(pm, 4)
        fill(m, 1234, 40)
        man = mgr.checkpoint({"after": "compose"}).result()  # type: ignore[union-attr]
    psid4 = psid_of_group(4)
    changed = psid_mask(man.pages.page_id, [(psid4, psid4 + 1)])
    assert man.base == comp.name and man.depth == comp.depth + 1 and not man.composed
    assert 0 < man.n_pages_written <= int(changed.sum())
    # the rest is referenced where it lies, foreign files included
    assert {"a-1", "a-2", "b-1"} <= set(man.referenced_checkpoints)
    expect = expected_content([(pa_, group_ranges([0, 1])), (pb_, group_ranges([4, 5]))])
    pm2 = new_pm()
    assert restore(pm2, root, "c").name == man.name
    got = content(pm2)
    assert got != expect and got["g004/m0"] != expect["g004/m0"]
    assert {k: v for k, v in got.items() if k != "g004/m0"} == \
        {k: v for k, v in expect.items() if k != "g004/m0"}
    assert got["g004/m0"] == content(pm)["g004/m0"]


# -------------------------------------------------------------------- idempotent reruns


def test_rerun_of_the_same_composition_returns_the_existing_one(root: StorageRoot,
                                                                tmp_path: Path) -> None:
    man_a, man_b, *_ = two_sources(root)
    parts = [(man_a, group_ranges([0])), (man_b, group_ranges([5]))]
    with CheckpointManager(new_pm(), root, "c", n_workers=1) as mgr:
        first = mgr.compose(parts, {"batch": 3})
    before = listing(tmp_path / "store")
    # a retried task: a new process, a new manager, the parts in another order
    with CheckpointManager(new_pm(), root, "c", n_workers=1) as mgr:
        again = mgr.compose(list(reversed(parts)), {"batch": 3})
        assert mgr.base is not None and mgr.base.name == first.name
    assert again.name == first.name and again.same_content(first)
    assert listing(tmp_path / "store") == before
    # a different composition (other meta, other ranges) is a conflict; nothing written
    with CheckpointManager(new_pm(), root, "c", n_workers=1) as mgr:
        with pytest.raises(CompositionConflictError, match="c-1"):
            mgr.compose(parts, {"batch": 4})
        with pytest.raises(CompositionConflictError, match="c-1"):
            mgr.compose([(man_a, group_ranges([0, 1])), (man_b, group_ranges([5]))], {"batch": 3})
    assert listing(tmp_path / "store") == before


def test_concurrent_attempts_one_writes_the_other_returns_it(root: StorageRoot) -> None:
    """Two attempts pick the same name; the later create-only write finds the first's
    manifest: identical, so it returns it; different, so it is a conflict."""
    man_a, man_b, *_ = two_sources(root)
    parts = [(man_a, group_ranges([2])), (man_b, group_ranges([3]))]

    won: list[Manifest] = []

    def race(meta_other: dict[str, Any]):  # before_commit: the other attempt commits first
        def hook(pending: Any) -> None:
            with CheckpointManager(new_pm(), root, pending.name.rsplit("-", 1)[0],
                                   n_workers=1) as other:
                won.append(other.compose(parts, meta_other))
                assert won[-1].name == pending.name
        return hook

    with CheckpointManager(new_pm(), root, "c", n_workers=1, before_commit=race({"x": 1})) as mgr:
        got = mgr.compose(parts, {"x": 1})
        # the other attempt's manifest, not a second write
        assert got.name == "c-1" and got.created_unix_s == won[0].created_unix_s
    with CheckpointManager(new_pm(), root, "d", n_workers=1, before_commit=race({"x": 2})) as mgr:
        with pytest.raises(CompositionConflictError, match="d-1"):
            mgr.compose(parts, {"x": 1})
    assert read_manifest(root, "d-1").user_meta == {"x": 2}


def test_compose_respects_seq_range_and_exclusive(root: StorageRoot) -> None:
    man_a, man_b, *_ = two_sources(root)
    parts = [(man_a, group_ranges([1])), (man_b, group_ranges([4]))]
    lo = 3 * 10**9
    with CheckpointManager(new_pm(), root, "c", n_workers=1, seq_range=(lo, lo + 10**9),
                           exclusive=True) as mgr:
        man = mgr.compose(parts)
        assert man.seq == lo and mgr.last_seq == lo
    # a retry under a newer epoch's range finds it and returns it
    with CheckpointManager(new_pm(), root, "c", n_workers=1, seq_range=(lo + 10**9, lo + 2 * 10**9),
                           exclusive=True) as mgr:
        assert mgr.compose(parts).name == man.name
    with CheckpointManager(new_pm(), root, "e", n_workers=1, seq_range=(5, 6)) as mgr:
        assert mgr.compose(parts).seq == 5
    refuse = CheckpointManager(new_pm(), root, "f", n_workers=1,
                               before_commit=lambda p: (_ for _ in ()).throw(RuntimeError("fenced")))
    with refuse, pytest.raises(RuntimeError, match="fenced"):
        refuse.compose(parts)
    assert not any(c.haunit == "f" for c in __import__("ioservice").list_checkpoints(root))


# ---------------------------------------------------------------------- refused inputs


def test_refused_compositions_leave_the_store_unchanged(root: StorageRoot,
                                                        tmp_path: Path) -> None:
    man_a, man_b, *_ = two_sources(root)
    big = checkpoint_unit(root, "big", build_pm([7], seed=5, page_bytes=8192))
    clash = build_pm([], seed=0)
    HashMap.create(clash, "g001/m0", key="<u8", value=VAL_DT)  # same name, other psid
    man_clash = checkpoint_unit(root, "clash", clash)
    plain = checkpoint_unit(root, "c", build_pm([9], seed=6))  # c has a checkpoint already
    dup = dataclasses.replace(man_b, pages=man_b.pages.take(
        np.array([0, 0] + list(range(1, len(man_b.pages))))))
    before = listing(tmp_path / "store")
    r = group_ranges
    cases: list[tuple[Any, type[Exception], str]] = [
        ([(man_a, [(16, 30), (20, 40)])], OverlappingRangesError, "overlap"),
        ([(man_a, r([1])), (man_b, [(psid_of_group(1) + 3, 1000)])], OverlappingRangesError,
         "part 0 .a-2. overlaps .* part 1 .b-1."),
        ([(man_a, r([0])), (big, r([7]))], PageSizeMismatchError, "8192-byte"),
        ([(man_a, r([1])), (man_clash, [(1, 2)])], CompositionError, "g001/m0"),
        ([(man_a, r([0])), (dup, r([3, 4]))], DuplicatePagesError, "two parts"),
        ([(man_a, [(5, 5)])], CompositionError, "0 <= lo < hi"),
        ([(man_a, [(-1, 5)])], CompositionError, "0 <= lo < hi"),
        ([(man_a, [(1, 2**32 + 1)])], CompositionError, "0 <= lo < hi"),
        ([(man_a, [(1.0, 5)])], CompositionError, "0 <= lo < hi"),
        ([(man_a, [(1, 2, 3)])], CompositionError, "not a .lo, hi. pair"),
        ([(man_a, "1-5")], CompositionError, "sequence of"),
        ([("a-2", r([0]))], CompositionError, "not a Manifest"),
        ([man_a], CompositionError, "not a .Manifest, psid ranges. pair"),
        ([], CompositionError, "non-empty"),
    ]
    for parts, exc, msg in cases:
        with CheckpointManager(new_pm(), root, "fresh", n_workers=1) as mgr:
            with pytest.raises(exc, match=msg):
                mgr.compose(parts)
            assert mgr.base is None
    with CheckpointManager(new_pm(), root, "a", n_workers=1) as mgr:  # from itself
        with pytest.raises(CompositionError, match="HA unit composed into"):
            mgr.compose([(man_a, r([0]))])
    with CheckpointManager(new_pm(), root, "fresh", n_workers=1) as mgr:
        with pytest.raises(TypeError, match="JSON"):
            mgr.compose([(man_a, r([0]))], {"x": object()})
    with CheckpointManager(new_pm(), root, "c", n_workers=1) as mgr:  # not a composition
        with pytest.raises(CompositionConflictError, match=f"{plain.name}.*not composed"):
            mgr.compose([(man_a, r([0]))])
    assert listing(tmp_path / "store") == before
    # a source file gone: refused as damage, nothing written
    os.remove(tmp_path / "store" / man_b.files[0].path)
    before = listing(tmp_path / "store")
    with CheckpointManager(new_pm(), root, "fresh", n_workers=1) as mgr:
        with pytest.raises(CheckpointDamagedError, match=man_b.files[0].path):
            mgr.compose([(man_b, r([3]))])
    assert listing(tmp_path / "store") == before


def test_manifest_rules_for_composed_checkpoints(root: StorageRoot, tmp_path: Path) -> None:
    """The seal covers composed_from; version-2 documents cannot carry it; a composed
    checkpoint cannot be full, have a base, name itself or hold files of its own."""
    man_a, man_b, *_ = two_sources(root)
    with CheckpointManager(new_pm(), root, "c", n_workers=1) as mgr:
        man = mgr.compose([(man_a, group_ranges([0])), (man_b, group_ranges([3]))])
    raw = man.to_json()
    doc = json.loads(raw)
    assert Manifest.from_json(raw).same_content(man)

    def resealed(d: dict[str, Any]) -> bytes:
        from ioservice.format import DOCUMENT_CHECKSUM_KEY, document_checksum
        d = dict(d)
        d[DOCUMENT_CHECKSUM_KEY] = document_checksum(d)
        return json.dumps(d).encode()

    tampered = dict(doc, composed_from=["a-2"])
    with pytest.raises(ManifestError, match="document checksum"):
        Manifest.from_json(json.dumps(tampered).encode())
    bad: list[tuple[dict[str, Any], str]] = [
        (dict(doc, format_version=2), "unknown field"),
        (dict(doc, full=True), "composed checkpoint has full"),
        (dict(doc, base="c-0"), "composed checkpoint has full"),
        (dict(doc, composed_from=["b-1", "a-2"]), "sorted"),
        (dict(doc, composed_from=["a-2", "a-2"]), "sorted"),
        (dict(doc, composed_from=["a-2", "c-1"]), "not name the checkpoint itself"),
        (dict(doc, composed_from=["a-2", "not a name"]), "checkpoint names"),
        (dict(doc, composed_from="a-2"), "type str"),
        ({k: v for k, v in doc.items() if k != "composed_from"}, "'composed_from' is missing"),
        (dict(doc, files=[dict(doc["files"][0], path="checkpoint/c-1/w000.pages")]
              + doc["files"][1:]), "files in its own directory"),
    ]
    for d, msg in bad:
        with pytest.raises(ManifestError, match=msg):
            Manifest.from_json(resealed(d))
    # seeded damage: every flip, byte or truncation is refused or harmless (layout only)
    rng = np.random.default_rng(2026)
    for _ in range(400):
        data = bytearray(raw)
        i = int(rng.integers(len(data)))
        if rng.random() < 0.2:
            data = data[:i]
        else:
            data[i] = (data[i] ^ int(rng.integers(1, 256))) & 0xFF
        try:
            got = Manifest.from_json(bytes(data))
        except ManifestError:
            continue
        assert got.name == man.name and got.same_content(man) and got.composed
    # version 3 with an empty composed_from is an ordinary checkpoint's manifest
    plain = json.loads(checkpoint_unit(root, "p", build_pm([0], seed=4)).to_json())
    v3 = Manifest.from_json(resealed(dict(plain, format_version=3, composed_from=[])))
    assert not v3.composed and v3.full


# --------------------------------------------------------------------- oracle (Hypothesis)


@st.composite
def compositions(draw: st.DrawFn) -> dict[str, Any]:
    n_src = draw(st.integers(2, 4))
    n_groups = draw(st.integers(n_src, 8))
    owner = draw(st.lists(st.integers(0, n_src - 1), min_size=n_groups, max_size=n_groups))
    owner[:n_src] = list(range(n_src))  # every source holds at least one group
    top = psid_of_group(n_groups) + 2
    cuts = sorted(set(draw(st.lists(st.integers(1, top - 1), max_size=10))))
    bounds = [0] + cuts + [top]
    # each interval goes to one source or to none: disjoint ranges across the parts
    assign = draw(st.lists(st.integers(-1, n_src - 1), min_size=len(bounds) - 1,
                           max_size=len(bounds) - 1))
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(n_src)]
    for (lo, hi), who in zip(zip(bounds, bounds[1:]), assign):
        if who >= 0:
            ranges[who].append((lo, hi))
    chain = draw(st.lists(st.booleans(), min_size=n_src, max_size=n_src))
    return {"owner": owner, "ranges": ranges, "chain": chain, "seed": draw(st.integers(0, 99))}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(compositions())
def test_oracle_compose_then_restore_equals_the_selected_source_pages(case: dict[str, Any]
                                                                      ) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = local_root(Path(tmp))
        parts = []
        pms = []
        src_pages: dict[int, bytes] = {}
        for i, rs in enumerate(case["ranges"]):
            groups = [g for g, o in enumerate(case["owner"]) if o == i]
            pm = build_pm(groups, seed=case["seed"] + i, per_group=2, n=150)
            with CheckpointManager(pm, root, f"src{i}", n_workers=2) as mgr:
                man = mgr.checkpoint().result()  # type: ignore[union-attr]
                if case["chain"][i]:  # an incremental source: pages in two directories
                    fill(open_map(pm, groups[0]), 7, 30)
                    man = mgr.checkpoint().result()  # type: ignore[union-attr]
            src_pages.update(page_bytes_of(root, man))
            parts.append((man, rs))
            pms.append((pm, rs))
        with CheckpointManager(new_pm(), root, "target", n_workers=2) as mgr:
            comp = mgr.compose(parts, {"case": 1})
        want = np.sort(np.concatenate([m.pages.page_id[psid_mask(m.pages.page_id, rs)]
                                       for m, rs in parts]))
        assert np.array_equal(comp.pages.page_id, want)
        got_pages = page_bytes_of(root, comp)
        assert set(got_pages) == set(want.tolist())
        assert all(got_pages[p] == src_pages[p] for p in got_pages)
        pm2 = new_pm()
        if len(want) == 0:
            restore(pm2, root, "target")
            assert content(pm2) == {}
        else:
            assert restore(pm2, root, "target").name == comp.name
            # whole page sets only (ranges cut at psids): every structure comes back whole
            assert content(pm2) == expected_content(pms)


# --------------------------------------------------------------------------- partial restore


def counting_root(base: Path) -> tuple[StorageRoot, FaultyFS]:
    handler = FaultyFS(pafs.LocalFileSystem(), count_reads=True)
    return StorageRoot(pafs.PyFileSystem(handler), str(base)), handler


def test_partial_restore_reads_only_the_selected_pages(tmp_path: Path) -> None:
    base = tmp_path / "store"
    root = local_root(base)
    groups = list(range(8))
    pm = build_pm(groups, seed=11, n=900)
    with CheckpointManager(pm, root, "p", n_workers=2) as mgr:
        mgr.checkpoint().result()
        fill(open_map(pm, 5), 5, 200)
        man = mgr.checkpoint().result()  # type: ignore[union-attr]
    ranges = group_ranges([2, 5])
    selected = int(psid_mask(man.pages.page_id, ranges).sum())
    assert 0 < selected < len(man.pages) // 2
    croot, handler = counting_root(base)
    pm2 = new_pm()
    got = restore(pm2, croot, "p", psid_ranges=ranges)
    assert handler.bytes_read("*.pages") == selected * PAGE_BYTES
    assert got.n_pages == selected and got.name == man.name
    assert set(got.structures) == {"g002/m0", "g002/m1", "g005/m0", "g005/m1"}
    assert content(pm2) == expected_content([(pm, ranges)])
    # the whole restore reads every page
    handler.reset_counters()
    restore(new_pm(), croot, "p")
    assert handler.bytes_read("*.pages") == len(man.pages) * PAGE_BYTES
    with pytest.raises(ValueError, match="overlap"):
        restore(new_pm(), croot, "p", psid_ranges=[(16, 40), (30, 50)])


def test_partial_restore_verifies_only_the_selected_pages(tmp_path: Path) -> None:
    base = tmp_path / "store"
    root = local_root(base)
    pm = build_pm([0, 1, 2], seed=12)
    with CheckpointManager(pm, root, "p", n_workers=2, policy=CheckpointPolicy(keep=None)) as mgr:
        first = mgr.checkpoint().result()  # type: ignore[union-attr]
        fill(open_map(pm, 0), 1, 10)
        fill(open_map(pm, 2), 1, 10)
        man = mgr.checkpoint(full=True).result()  # type: ignore[union-attr]
    in_g1 = np.flatnonzero(psid_mask(man.pages.page_id, group_ranges([1])))
    row = int(in_g1[0])
    path = base / man.files[int(man.pages.file[row])].path
    data = bytearray(path.read_bytes())
    data[int(man.pages.offset[row]) + 100] ^= 0xFF  # damage a page of group 1
    path.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not one damage warning: group 1 is not read
        got = restore(new_pm(), root, "p", psid_ranges=group_ranges([0, 2]))
    assert got.name == man.name
    pm3 = new_pm()
    with pytest.warns(DamagedCheckpointWarning, match=man.name):
        got = restore(pm3, root, "p", psid_ranges=group_ranges([1]))
    assert got.name == first.name  # fell back to the older checkpoint


def test_manager_partial_restore_then_checkpoint(tmp_path: Path) -> None:
    root = local_root(tmp_path / "store")
    pm = build_pm([0, 1, 2, 3], seed=13)
    man = checkpoint_unit(root, "p", pm)
    pm2 = new_pm()
    with CheckpointManager(pm2, root, "p", n_workers=2) as mgr:
        got = mgr.restore(psid_ranges=group_ranges([1, 3]))
        assert got is not None and got.name == man.name and mgr.base is got
        nxt = mgr.checkpoint()  # never skipped: the state is no longer the whole of p-1
        assert nxt is not None
        new = nxt.result()
    assert new.n_pages_written == 0 and new.base == man.name
    assert set(new.structures) == {"g001/m0", "g001/m1", "g003/m0", "g003/m1"}
    pm3 = new_pm()
    assert restore(pm3, root, "p").name == new.name
    assert content(pm3) == expected_content([(pm, group_ranges([1, 3]))])
    with CheckpointManager(new_pm(), root, "p", n_workers=1) as mgr:
        with pytest.raises(ValueError, match="0 <= lo < hi"):
            mgr.restore(psid_ranges=[(3, 3)])


# ------------------------------------------------------------------------------- damage


def test_damaged_foreign_file_is_reported_like_any_damage(root: StorageRoot,
                                                          tmp_path: Path) -> None:
    man_a, man_b, pa_, pb_ = two_sources(root)
    parts = [(man_a, group_ranges([0, 1])), (man_b, group_ranges([3]))]
    pm = new_pm()
    with CheckpointManager(pm, root, "c", n_workers=2,
                           policy=CheckpointPolicy(keep=None)) as mgr:
        comp = mgr.compose(parts)
        mgr.restore()
        fill(open_map(pm, 0), 77, 30)
        inc = mgr.checkpoint().result()  # type: ignore[union-attr]
    # a page of group 3 lies in b's directory, referenced by c-1 and c-2
    row = int(np.flatnonzero(psid_mask(inc.pages.page_id, group_ranges([3])))[0])
    f = inc.files[int(inc.pages.file[row])]
    assert f.checkpoint == "b-1"
    path = tmp_path / "store" / f.path
    data = bytearray(path.read_bytes())
    data[int(inc.pages.offset[row]) + 200] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamagedError, match=f.path):
        verify_checkpoint(root, comp.name)
    with pytest.warns(DamagedCheckpointWarning) as rec:
        with pytest.raises(CheckpointNotFoundError, match="c-2, c-1"):
            restore(new_pm(), root, "c")
    assert [w.message.args[0].split()[1] for w in rec.list] == ["c-2", "c-1"]
    # a partial restore that does not need b's page still works
    pm2 = new_pm()
    assert restore(pm2, root, "c", psid_ranges=group_ranges([0, 1])).name == inc.name
    # a foreign file missing: the same
    path.unlink()
    with pytest.warns(DamagedCheckpointWarning, match="missing"):
        with pytest.raises(CheckpointNotFoundError):
            restore(new_pm(), root, "c")


# ------------------------------------------------------------------- garbage collection


def test_retention_keeps_files_another_unit_references(root: StorageRoot,
                                                       tmp_path: Path) -> None:
    pa_ = build_pm([0, 1, 2, 3], seed=21)
    pol = CheckpointPolicy(full_every=1, keep=1)  # every checkpoint full, keep only the last
    with CheckpointManager(pa_, root, "a", n_workers=2, policy=pol) as mga:
        a1 = mga.checkpoint().result()  # type: ignore[union-attr]
        with CheckpointManager(new_pm(), root, "c", n_workers=1) as mgc:
            comp = mgc.compose([(a1, group_ranges([1]))])
        used = {f.path for f in comp.files}
        assert used and all(p.startswith("checkpoint/a-1/") for p in used)
        unused = {f.path for f in a1.files} - used
        fill(open_map(pa_, 0), 1, 20)
        mga.checkpoint().result()
        fill(open_map(pa_, 2), 1, 20)
        a3 = mga.checkpoint().result()  # type: ignore[union-attr]
        # a-2 is gone; a-1 is expired (no manifest) but c-1's files in it stay
        names = {c.name: c for c in __import__("ioservice").list_checkpoints(root, "a")}
        assert set(names) == {"a-1", "a-3"} and not names["a-1"].has_manifest
    store = tmp_path / "store"
    assert all((store / p).exists() for p in used)
    assert not any((store / p).exists() for p in unused)
    pm = new_pm()
    assert restore(pm, root, "c").name == comp.name
    assert content(pm) == expected_content([(build_pm([1], seed=21), group_ranges([1]))])
    assert restore(new_pm(), root, "a").name == a3.name


def test_sweep_unreferenced_keeps_what_live_units_reference(root: StorageRoot,
                                                            tmp_path: Path) -> None:
    from ioservice import sweep_unreferenced
    store = tmp_path / "store"
    man_a, man_b, pa_, pb_ = two_sources(root)  # a-1, a-2 (incremental), b-1
    with CheckpointManager(new_pm(), root, "c", n_workers=1) as mgr:
        comp_c = mgr.compose([(man_a, group_ranges([1])), (man_b, group_ranges([3]))])
    # d takes group 1 from a-2: only a-2's own file (a-2 rewrote group 1)
    with CheckpointManager(new_pm(), root, "d", n_workers=1) as mgr:
        comp_d = mgr.compose([(man_a, group_ranges([2]))])
    untouched = checkpoint_unit(root, "z", build_pm([0], seed=3))
    (store / "checkpoint/a-9").mkdir()  # a leftover of a failed checkpoint
    (store / "checkpoint/a-9/w000-x.pages").write_bytes(b"\0" * PAGE_BYTES)
    (store / "checkpoint/b-1/notes.txt").write_text("not ioservice's")
    (store / "checkpoint/README").write_text("not a checkpoint")
    referenced = {f.path for f in comp_c.files} | {f.path for f in comp_d.files}
    a_b_files = {f.path for m in (man_a, man_b) for f in m.files}
    z_before = listing(store / "checkpoint/z-1")
    with pytest.raises(ValueError, match="both dead and live"):
        sweep_unreferenced(root, ["a", "b"], ["b", "c"])
    # a live manifest that cannot be read: nothing is deleted
    before = listing(store)
    d_manifest = (store / comp_d.manifest_path).read_bytes()
    (store / comp_d.manifest_path).write_bytes(d_manifest[:-20])
    with pytest.raises(CheckpointDamagedError):
        sweep_unreferenced(root, ["a", "b"], ["c", "d"])
    (store / comp_d.manifest_path).write_bytes(d_manifest)
    assert listing(store) == before
    deleted = sweep_unreferenced(str(store), ["a", "b"], ["c", "d"])
    gone = a_b_files - referenced
    assert gone  # something to collect: a-1's or a-2's files nobody references
    assert set(deleted) >= gone | {"checkpoint/a-9", "checkpoint/a-9/w000-x.pages",
                                   "checkpoint/a-1/manifest.json", "checkpoint/a-2/manifest.json",
                                   "checkpoint/b-1/manifest.json"}
    assert all((store / p).exists() for p in referenced)
    assert not any((store / p).exists() for p in gone)
    assert not (store / "checkpoint/a-9").exists()
    assert (store / "checkpoint/b-1/notes.txt").exists() and (store / "checkpoint/README").exists()
    assert listing(store / "checkpoint/z-1") == z_before
    assert all(not d.startswith(("checkpoint/c-", "checkpoint/d-", "checkpoint/z-"))
               for d in deleted)
    # the live units restore exactly as before; the dead ones have no checkpoint left
    for comp, parts in ((comp_c, [(pa_, group_ranges([1])), (pb_, group_ranges([3]))]),
                        (comp_d, [(pa_, group_ranges([2]))])):
        pm = new_pm()
        assert restore(pm, root, comp.haunit).name == comp.name
        assert content(pm) == expected_content(parts)
    with pytest.raises(CheckpointNotFoundError):
        restore(new_pm(), root, "a")
    assert restore(new_pm(), root, "z").name == untouched.name
    # a second sweep finds nothing more to delete
    assert sweep_unreferenced(root, ["a", "b"], ["c", "d"]) == []
    # once the live units no longer need them, everything of a and b goes (notes.txt stays)
    sweep_unreferenced(root, ["a", "b", "c", "d"], ["z"])
    left = [p for p, _ in listing(store / "checkpoint")]
    assert sorted(left) == ["README", "b-1", "b-1/notes.txt", "z-1"] + \
        sorted(p for p, _ in [(f"z-1/{q}", 0) for q, _ in z_before])


def test_cli_shows_composed_checkpoints(root: StorageRoot, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from ioservice import sweep_unreferenced
    from sguard.cli import main
    man_a, man_b, *_ = two_sources(root)
    with CheckpointManager(new_pm(), root, "c", n_workers=1) as mgr:
        mgr.compose([(man_a, group_ranges([0])), (man_b, group_ranges([4]))])
    store = str(tmp_path / "store")
    assert main(["checkpoints", "show", store, "c-1"]) == 0
    out = capsys.readouterr().out
    assert "composed from a-2, b-1, depth 1" in out and "format_version  3" in out
    assert main(["checkpoints", "ls", store, "--haunit", "c"]) == 0
    assert any(line.split()[:2] == ["c-1", "comp(+1)"]
               for line in capsys.readouterr().out.splitlines())
    assert main(["checkpoints", "verify", store, "--checkpoint", "c-1"]) == 0
    capsys.readouterr()
    sweep_unreferenced(root, ["a", "b"], ["c"])  # b-1 keeps data for c-1, without a manifest
    assert main(["checkpoints", "ls", store, "--all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:2] == ["b-1", "expired"] and "(data kept)" in line
               for line in lines), lines
