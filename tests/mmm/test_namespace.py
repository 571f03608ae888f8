"""Explicit PSIDs and `mmm.Namespace`: prefixed names, PSID blocks, snapshots, rollback,
ioservice checkpoints (pyarrow local filesystem) and loading several namespaces' pages,
checkpointed by different page managers, into one."""
from __future__ import annotations

import copy
import doctest
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import mmm
import mmm.namespace
from ioservice import CheckpointManager, IOService, open_root, read_manifest
from mmm.page import HEADER_BYTES, HEADER_DTYPE
from mmm.structures.hashmap import HashMap
from mmm.structures.keydict import KeyDict
from mmm.structures.ordered_map import OrderedMap
from mmm.structures.sequence import PagedDeque, PagedList

PB = 4096
VAL = [("n", "<i8")]


def new_pm(capacity: int = 32 << 20) -> mmm.PageManager:
    return mmm.PageManager(page_bytes=PB, capacity_bytes=capacity)


def kg_ns(pm: mmm.PageManager, kg: int) -> mmm.Namespace:
    """The sguard runtime's key-group namespace (its convention, tested here)."""
    return mmm.Namespace(pm, f"kg{kg:05d}/", (kg + 1) << 16, (kg + 2) << 16)


def enc(keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    data = np.frombuffer(b"".join(keys) + b"\0", np.uint8).copy()
    offs = np.zeros(len(keys) + 1, np.int64)
    offs[1:] = np.cumsum([len(k) for k in keys])
    return data, offs


def hm_contents(m: HashMap) -> dict[int, int]:
    k, v = m.items()
    return dict(zip(k.tolist(), v["n"].tolist()))


def kd_contents(kd: KeyDict) -> dict[bytes, int]:
    ids, data, offs, valid = kd.items()
    return {bytes(data[offs[i]:offs[i + 1]]): int(ids[i]) for i in range(len(ids))}


# -- explicit PSIDs on the page manager ------------------------------------------------------------
def test_explicit_psid_and_automatic_psids_skip_it() -> None:
    pm = new_pm()
    assert pm.create("big", psid=70_000) == 70_000
    assert pm.create("a") == 1
    assert pm.create("c", psid=2) == 2
    assert pm.create("d") == 3  # 2 was taken explicitly
    assert pm.create("top", psid=(1 << 32) - 1) == (1 << 32) - 1
    before = (pm.names(), pm.stats())
    with pytest.raises(mmm.PageSetExistsError, match=r"page set 2 .*'c'.*'e'"):
        pm.create("e", psid=2)
    with pytest.raises(ValueError, match="already exists"):
        pm.create("c", psid=9)
    for bad in (0, -1, 1 << 32, True, 1.0, "3", None.__class__):
        with pytest.raises(ValueError, match="psid"):
            pm.create("e", psid=bad)  # type: ignore[arg-type]
    assert (pm.names(), pm.stats()) == before
    assert pm.create("e", psid=np.int64(5)) == 5
    assert pm.create("f") == 4
    assert pm.create("g") == 6
    assert [pm.page_set(pm.recover(n)).psid for n in ("big", "top")] == [70_000, (1 << 32) - 1]
    pm._check()


def test_open_structure_psid_and_reopen() -> None:
    pm = new_pm()
    m = HashMap.create(pm, "m", key="<u4", value=VAL)
    assert m.psid == 1
    psid, created = pm.open_structure("x", "hashmap", {"k": "v"}, {}, psid=1234)
    assert (psid, created) == (1234, True)
    assert pm.open_structure("x", "hashmap", {"k": "v"}, {}, psid=1234) == (1234, False)
    assert pm.open_structure("x", "hashmap", {"k": "v"}, {}) == (1234, False)
    with pytest.raises(mmm.SchemaMismatchError, match="page set 1234, not 77"):
        pm.open_structure("x", "hashmap", {"k": "v"}, {}, psid=77)
    with pytest.raises(mmm.PageSetExistsError, match="page set 1 .*'m'"):
        pm.open_structure("y", "hashmap", {"k": "v"}, {}, psid=1)
    assert not pm.exists("y")


def test_automatic_psids_after_load_and_rollback_stay_small() -> None:
    pm = new_pm()
    ns = kg_ns(pm, 3)
    for name in ("a", "b", "c"):
        HashMap.create(pm, name, key="<u4", value=VAL)
        HashMap.create(ns, name, key="<u4", value=VAL)
    pm.destroy(pm.recover("b"))
    snap = pm.chkpt()
    pages = [pm.page(int(i)).copy() for i in snap.page_ids]
    pm.create("d")  # after the snapshot: gone after the rollback
    pm.rollback(snap)
    assert pm.names() == ["a", "c", "kg00003/a", "kg00003/b", "kg00003/c"]
    assert pm.create("e") == 2  # the lowest free, not above the namespace's block
    assert pm.create("f") == 4
    pm2 = new_pm()
    pm2.load(pages)
    assert pm2.create("g") == 2
    assert pm2.create("h", psid=4) == 4
    assert pm2.create("i") == 5
    assert kg_ns(pm2, 3).psids() == [4 << 16, (4 << 16) + 1, (4 << 16) + 2]
    pm._check()
    pm2._check()


# -- Namespace basics --------------------------------------------------------------------------
def test_namespace_doctest() -> None:
    assert doctest.testmod(mmm.namespace, optionflags=doctest.ELLIPSIS).failed == 0


def test_namespace_rejects_bad_arguments() -> None:
    pm = new_pm()
    with pytest.raises(TypeError, match="PageManager"):
        mmm.Namespace(kg_ns(pm, 0), "x/", 10, 20)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix"):
        mmm.Namespace(pm, "", 10, 20)
    with pytest.raises(TypeError, match="psid_base"):
        mmm.Namespace(pm, "x/", 1.5, 20)  # type: ignore[arg-type]
    assert mmm.Namespace(pm, "x/", np.int64(3) << 16, np.int32(4) << 16).psid_base == 3 << 16
    for lo, hi in ((0, 5), (5, 5), (7, 5), (1, (1 << 32) + 1)):
        with pytest.raises(ValueError, match=r"PSID block"):
            mmm.Namespace(pm, "x/", lo, hi)


def test_names_isolation_and_operator_idioms() -> None:
    pm = new_pm()
    a, b = kg_ns(pm, 0), kg_ns(pm, 1)
    root = HashMap.create(pm, "win.1", key="<u4", value=VAL)
    ma = HashMap.create(a, "win.1", key="<u4", value=VAL)
    mb = HashMap.create(b, "win.1", key="<u4", value=VAL)
    HashMap.create(a, "win.2", key="<u4", value=VAL)
    HashMap.create(a, "other", key="<u4", value=VAL)
    assert len({id(root), id(ma), id(mb)}) == 3
    assert ma.name == mb.name == root.name == "win.1"
    assert a.names() == ["other", "win.1", "win.2"]
    assert b.names() == ["win.1"]
    assert pm.names() == ["kg00000/other", "kg00000/win.1", "kg00000/win.2", "kg00001/win.1",
                          "win.1"]
    assert HashMap.create(a, "win.1", key="<u4", value=VAL) is ma  # the open object
    ma.upsert(np.array([1, 1], "<u4"), combine={"n": "count"})
    mb.upsert(np.array([1], "<u4"), combine={"n": "count"})
    assert (hm_contents(ma), hm_contents(mb), hm_contents(root)) == ({1: 2}, {1: 1}, {})
    # what operators do to drop their windows
    for n in [n for n in a.names() if n.startswith("win.")]:
        a.destroy(a.recover(n))
    assert a.names() == ["other"] and b.names() == ["win.1"] and pm.exists("win.1")
    with pytest.raises(mmm.StructureNotFoundError, match="kg00000/"):
        a.recover("win.1")
    # a namespace destroys only its own page sets
    with pytest.raises(mmm.PageSetNotFoundError, match=r"not a structure of namespace 'kg00000/'.*'kg00001/win.1'"):
        a.destroy(mb.psid)
    with pytest.raises(mmm.PageSetNotFoundError, match="no such page set"):
        a.destroy(12345)
    assert b.exists("win.1") and not a.exists("win.1")
    mb.destroy()
    assert b.names() == [] and b.psids() == []
    pm._check()


def test_namespace_psid_block_lowest_free_explicit_and_full() -> None:
    pm = new_pm()
    ns = mmm.Namespace(pm, "t/", 100, 103)
    assert ns.create("x") == 100
    assert ns.create("y", psid=102) == 102
    assert ns.create("z") == 101
    with pytest.raises(mmm.NamespaceFullError, match=r"'t/'.*\[100, 103\).*'t/w'"):
        ns.create("w")
    with pytest.raises(mmm.NamespaceFullError):
        HashMap.create(ns, "w", key="<u4", value=VAL)
    with pytest.raises(ValueError, match="outside namespace 't/'"):
        ns.create("w", psid=103)
    with pytest.raises(mmm.PageSetExistsError, match="page set 101 .*'t/z'"):
        pm.create("root", psid=101)
    assert ns.names() == ["x", "y", "z"] and not pm.exists("t/w") and not pm.exists("root")
    ns.destroy(ns.recover("x"))
    assert HashMap.create(ns, "w", key="<u4", value=VAL).psid == 100  # the lowest free
    # a PSID of the block taken by the root manager is skipped
    ns2 = mmm.Namespace(pm, "u/", 200, 300)
    pm.create("squatter", psid=200)
    assert ns2.create("a") == 201
    pm._check()


def test_every_structure_kind_through_a_namespace() -> None:
    pm = new_pm()
    ns = kg_ns(pm, 7)
    lo, hi = 8 << 16, 9 << 16
    hm = HashMap.create(ns, "hm", key="<u4", value=VAL, page_slots=4)
    om = OrderedMap.create(ns, "om", key="<i8", value=VAL, page_slots=4)
    pl = PagedList.create(ns, "pl", "<i8", page_slots=4)
    dq = PagedDeque.create(ns, "dq", "<i8", page_slots=4)
    kd = KeyDict.create(ns, "kd")
    keys = np.arange(50, dtype="<u4")
    hm.upsert(keys, combine={"n": "count"})
    om.upsert(keys.astype("<i8"), combine={"n": "count"})
    pl.extend(np.arange(30, dtype="<i8"))
    dq.extend(np.arange(30, dtype="<i8"))
    dq.popleft(7)
    dq.appendleft(-1)
    kd.intern(*enc([b"a", b"bb", b"a"]))
    for s in (hm, om, pl, dq, kd):
        s._check()
        assert lo <= s.psid < hi and s.page_count > 1
        assert s._pm is pm and s._catalog is ns
    assert ns.names() == ["dq", "hm", "kd", "om", "pl"]
    snap = ns.chkpt()  # this namespace's page sets only
    assert set(snap.psids) == set(ns.psids())
    ids = snap.page_ids >> np.uint64(32)
    assert np.all((ids >= lo) & (ids < hi))
    hm.upsert(keys, combine={"n": "count"})
    dq.extend(np.arange(5, dtype="<i8"))
    kd.intern(*enc([b"ccc"]))
    HashMap.create(pm, "root", key="<u4", value=VAL)
    ns.rollback(snap)
    assert pm.exists("root")  # a namespace snapshot does not cover the root's structures
    assert hm_contents(hm) == {k: 1 for k in range(50)}
    assert dq.to_numpy().tolist() == [-1] + list(range(7, 30))
    assert kd_contents(kd) == {b"a": 0, b"bb": 1}
    # load everything into a fresh manager: reopen through a fresh namespace
    snap = pm.chkpt()
    pages = [pm.page(int(i)).copy() for i in snap.page_ids]
    snap.release()
    pm2 = new_pm()
    pm2.load(pages)
    ns2 = kg_ns(pm2, 7)
    assert ns2.names() == ns.names() and ns2.psids() == ns.psids()
    hm2 = HashMap.create(ns2, "hm", key="<u4", value=VAL, page_slots=4)
    om2 = OrderedMap.create(ns2, "om", key="<i8", value=VAL, page_slots=4)
    pl2 = PagedList.create(ns2, "pl", "<i8")
    dq2 = PagedDeque.create(ns2, "dq", "<i8")
    kd2 = KeyDict.create(ns2, "kd")
    assert hm_contents(hm2) == hm_contents(hm)
    assert om2.items()[0].tolist() == list(range(50))
    assert pl2.to_numpy().tolist() == list(range(30))
    assert dq2.to_numpy().tolist() == dq.to_numpy().tolist()
    assert kd_contents(kd2) == {b"a": 0, b"bb": 1}
    # schema mismatches name the unqualified structure
    with pytest.raises(mmm.SchemaMismatchError, match="'kg00007/hm'"):
        HashMap.create(ns2, "hm", key="<u8", value=VAL)
    with pytest.raises(ValueError, match="structure name"):
        HashMap.create(ns2, "", key="<u4", value=VAL)
    pm2._check()


def test_namespace_chkpt_refuses_foreign_names_and_psids() -> None:
    pm = new_pm()
    a, b = kg_ns(pm, 0), kg_ns(pm, 1)
    ma = HashMap.create(a, "m", key="<u4", value=VAL)
    mb = HashMap.create(b, "m", key="<u4", value=VAL)
    with pytest.raises(mmm.PageSetNotFoundError):
        a.chkpt(psids=[mb.psid])
    with pytest.raises(mmm.StructureNotFoundError):
        a.chkpt(names=["x"])
    assert not pm._active
    snap = a.chkpt(names=["m"])
    assert snap.psids == (ma.psid,)
    snap.release()


# -- two page managers' namespaces loaded into one -----------------------------------------------
def _fill(ns: mmm.Namespace, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    hm = HashMap.create(ns, "agg", key="<u4", value=VAL, page_slots=8)
    keys = rng.integers(0, 500, 2000).astype("<u4")
    hm.upsert(keys, combine={"n": "count"})
    dq = PagedDeque.create(ns, "buf", "<i8", page_slots=16)
    vals = rng.integers(-10**9, 10**9, 300)
    dq.extend(vals)
    kd = KeyDict.create(ns, "keys")
    words = [f"{ns.prefix}w{i}".encode() * (1 + i % 5) for i in range(40)]
    kd.intern(*enc(words))
    u, c = np.unique(keys, return_counts=True)
    return {"agg": dict(zip(u.tolist(), c.tolist())), "buf": vals.tolist(),
            "keys": {w: i for i, w in enumerate(words)}}


def _check_ns(ns: mmm.Namespace, want: dict[str, Any]) -> None:
    assert ns.names() == ["agg", "buf", "keys"]
    assert all(ns.psid_base <= p < ns.psid_limit for p in ns.psids())
    assert hm_contents(HashMap.create(ns, "agg", key="<u4", value=VAL)) == want["agg"]
    assert PagedDeque.create(ns, "buf", "<i8").to_numpy().tolist() == want["buf"]
    assert kd_contents(KeyDict.create(ns, "keys")) == want["keys"]


@pytest.mark.timeout(600)  # a hang guard
def test_pages_of_two_managers_namespaces_load_into_one(tmp_path: Path) -> None:
    root_uri = str(tmp_path / "root")
    kgs = {0: (3, 17), 1: (64, 100)}  # page manager -> its key groups
    want: dict[int, dict[str, Any]] = {}
    for p, groups in kgs.items():
        pm = new_pm()
        for kg in groups:
            want[kg] = _fill(kg_ns(pm, kg), kg)
        with CheckpointManager(pm, root_uri, f"op.p{p}", n_workers=2) as mgr:
            mgr.checkpoint(user_meta={"key_groups": list(groups)}).result()
    root = open_root(root_uri)
    mans = [read_manifest(root, f"op.p{p}-1") for p in kgs]
    io = IOService(2)
    try:
        # all pages of both checkpoints into one page manager
        pm = new_pm()
        loader = pm.begin_load()
        for man in mans:
            io.read_pages(root, man, loader.add)
        loader.finish()
        pm._check()
        assert sorted(pm.names()) == sorted(f"kg{kg:05d}/{n}" for kg in want
                                            for n in ("agg", "buf", "keys"))
        for kg in want:
            _check_ns(kg_ns(pm, kg), want[kg])
        # repartitioning: one key group of each, chosen by the PSIDs of the pages
        pick = (17, 64)

        def only(pages: np.ndarray) -> None:
            pages = pages.reshape(-1, PB)
            hdr = pages[:, :HEADER_BYTES].copy().view(HEADER_DTYPE)[:, 0]
            kg = (hdr["page_id"] >> np.uint64(48)).astype(np.int64) - 1  # (psid >> 16) - 1
            loader.add(pages[np.isin(kg, pick)])

        pm = new_pm()
        loader = pm.begin_load()
        for man in mans:
            io.read_pages(root, man, only)
        loader.finish()
        assert [n.split("/")[0] for n in pm.names()] == ["kg00017"] * 3 + ["kg00064"] * 3
        for kg in pick:
            _check_ns(kg_ns(pm, kg), want[kg])
            kg_ns(pm, kg).names()
        assert kg_ns(pm, 3).names() == []
        # the same namespace's pages twice: refused, nothing kept
        pm = new_pm()
        loader = pm.begin_load()
        io.read_pages(root, mans[0], loader.add)
        io.read_pages(root, mans[0], loader.add)
        with pytest.raises(mmm.PageFormatError, match="more than once"):
            loader.finish()
        assert pm.names() == [] and pm.pool.used_frames == 0
    finally:
        io.shutdown()


# -- the stateful oracle -------------------------------------------------------------------------
SCOPES = [None, 0, 5, 300]  # None: the root page manager; else a key group's namespace
NAMES = ["h", "kd", "q"]
scope_st = st.sampled_from(SCOPES)
name_st = st.sampled_from(NAMES)
WORDS = st.sampled_from([b"", b"a", b"b", b"ab", b"x" * 30, b"y" * 70])


class NamespacesVsDicts(RuleBasedStateMachine):
    """A HashMap, a KeyDict and a PagedDeque (same names) in the root manager and in
    three namespaces, against dicts; snapshots, rollback, destroy, checkpoint/restore."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="ns-")
        self.mgr: CheckpointManager | None = None
        self.pm = new_pm()
        self.models: dict[Any, dict[str, Any]] = {s: {} for s in SCOPES}
        self.snap: tuple[mmm.Snapshot, dict[Any, dict[str, Any]]] | None = None

    def teardown(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def scope(self, s: Any) -> Any:
        return self.pm if s is None else kg_ns(self.pm, s)

    def open(self, s: Any, name: str) -> Any:
        where = self.scope(s)
        if name == "h":
            obj = HashMap.create(where, "h", key="<u4", value=VAL, page_slots=4)
            empty: Any = {}
        elif name == "kd":
            obj = KeyDict.create(where, "kd")
            empty = {}
        else:
            obj = PagedDeque.create(where, "q", "<i8", page_slots=4)
            empty = []
        assert obj.name == name
        self.models[s].setdefault(name, empty)
        return obj

    @rule(s=scope_st, keys=st.lists(st.integers(0, 60), max_size=40))
    def count(self, s: Any, keys: list[int]) -> None:
        self.open(s, "h").upsert(np.array(keys, "<u4"), combine={"n": "count"})
        model = self.models[s]["h"]
        for k in keys:
            model[k] = model.get(k, 0) + 1

    @rule(s=scope_st, words=st.lists(WORDS, max_size=10))
    def intern(self, s: Any, words: list[bytes]) -> None:
        ids = self.open(s, "kd").intern(*enc(words))
        model = self.models[s]["kd"]
        for w in words:
            model.setdefault(w, len(model))
        assert ids.tolist() == [model[w] for w in words]

    @rule(s=scope_st, n=st.integers(0, 12), data=st.data())
    def push(self, s: Any, n: int, data: st.DataObject) -> None:
        vals = data.draw(st.lists(st.integers(-99, 99), min_size=n, max_size=n))
        self.open(s, "q").extend(np.array(vals, "<i8"))
        self.models[s]["q"].extend(vals)

    @rule(s=scope_st, n=st.integers(1, 10))
    def pop(self, s: Any, n: int) -> None:
        q = self.open(s, "q")
        model = self.models[s]["q"]
        n = min(n, len(model))
        got = q.popleft(n)
        assert np.asarray(got).tolist() == model[:n]
        del model[:n]

    @rule(s=scope_st, name=name_st)
    def destroy(self, s: Any, name: str) -> None:
        where = self.scope(s)
        if name in self.models[s]:
            where.destroy(where.recover(name))
            del self.models[s][name]
        assert not where.exists(name)

    @rule(s=scope_st, t=scope_st, name=name_st)
    def explicit_psid_conflict(self, s: Any, t: Any, name: str) -> None:
        """A PSID in use is refused, through the manager or a namespace, naming its holder."""
        if name not in self.models[s]:
            return
        held = self.scope(s).recover(name)
        holder = (name if s is None else f"kg{s:05d}/{name}")
        before = self.pm.names()
        with pytest.raises(mmm.PageSetExistsError, match=f"page set {held} .*'{holder}'"):
            self.pm.create("intruder", psid=held)
        if t is not None:
            where = kg_ns(self.pm, t)
            if where.psid_base <= held < where.psid_limit:
                with pytest.raises(mmm.PageSetExistsError, match=f"page set {held} "):
                    where.create("intruder", psid=held)
            else:
                with pytest.raises(ValueError, match="outside namespace"):
                    where.create("intruder", psid=held)
        assert self.pm.names() == before

    @precondition(lambda self: self.snap is None)
    @rule()
    def chkpt(self) -> None:
        self.snap = (self.pm.chkpt(), copy.deepcopy(self.models))

    @precondition(lambda self: self.snap is not None)
    @rule()
    def rollback(self) -> None:
        assert self.snap is not None
        snap, models = self.snap
        self.pm.rollback(snap)
        self.models, self.snap = models, None

    @precondition(lambda self: self.snap is not None)
    @rule()
    def release(self) -> None:
        assert self.snap is not None
        self.snap[0].release()
        self.snap = None

    @precondition(lambda self: self.snap is None)
    @rule()
    def checkpoint_restore(self) -> None:
        """Checkpoint through ioservice onto a local pyarrow filesystem, restore into a
        fresh manager, go on there (structures reopen by name)."""
        root = str(Path(self.tmp) / "root")
        if self.mgr is None:
            self.mgr = CheckpointManager(self.pm, root, "ha", n_workers=2)
        pend = self.mgr.checkpoint()
        if pend is not None:
            pend.result()
        self.mgr.close()
        self.pm = new_pm()
        self.mgr = CheckpointManager(self.pm, root, "ha", n_workers=2)
        assert self.mgr.restore() is not None

    @invariant()
    def agrees(self) -> None:
        pm = self.pm
        pm._check()
        every: list[str] = []
        for s in SCOPES:
            where = self.scope(s)
            if s is None:
                own = [n for n in pm.names() if "/" not in n]
                assert own == sorted(self.models[s])
                assert all(pm.recover(n) < 1 << 16 for n in own)  # automatic PSIDs stay small
                every += own
                continue
            assert where.names() == sorted(self.models[s])
            every += [where.prefix + n for n in where.names()]
            lo, hi = (s + 1) << 16, (s + 2) << 16
            psids = where.psids()
            assert psids == sorted(where.recover(n) for n in where.names())
            assert all(lo <= p < hi for p in psids)
            for p in psids:  # every page of the namespace carries a PSID of its block
                ps = pm.page_set(p)
                ids = (np.uint64(p) << np.uint64(32)) | ps.seqs().astype(np.uint64)
                assert all(pm.resolve(int(i)) >= 0 for i in ids)
                hdr = pm.pool.headers["page_id"][ps.frames[ps.seqs()]] >> np.uint64(32)
                assert np.all((hdr >= lo) & (hdr < hi))
        assert sorted(every) == pm.names()
        for s in SCOPES:
            for name, model in self.models[s].items():
                obj = self.open(s, name)
                if name == "h":
                    assert hm_contents(obj) == model
                elif name == "kd":
                    assert kd_contents(obj) == model
                else:
                    assert obj.to_numpy().tolist() == model


TestNamespacesVsDicts = NamespacesVsDicts.TestCase
TestNamespacesVsDicts.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)
