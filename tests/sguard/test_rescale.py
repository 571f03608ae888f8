"""`sguard.rescale`: repartitioning checkpointed state, its crash safety and replay contract."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ioservice import CheckpointManager, list_checkpoints, open_root, read_manifest, restore
from mmm import HashMap, OrderedMap, PagedDeque, PagedList, PageManager
from sguard.operators import AGG_VALUE, expected_aggregate
from sguard.partitioning import partition_of
from sguard.rescale import (KILL_ENV, MARKER_FILE, ReplayPositions, RescaleError, repartition,
                            replay_mask, restore_piece, source_groups)
from sguard.statelayout import OperatorLayout, read_layout, write_layout

PAGE = 4096
VAL = np.dtype([("n", "<i8"), ("s", "<f8")])
KW = np.dtype([("k", "<i8"), ("w", "<i4")])
REC = np.dtype([("ts", "<i8"), ("k", "<i8")])
ITEM = np.dtype([("k", "<i8"), ("x", "<i4")])
_AGG = {"count": "count", "first_ts": ("min", "ts"), "last_ts": ("max", "ts")}


def _layout(P: int, key_dtype: str = "<i8") -> OperatorLayout:
    return OperatorLayout(operator="test_op", name="op", schema={"key": key_dtype},
                          num_partitions=P, key="k",
                          extra={"routing": {"buf": {"order": "ts"}}})


def _meta(layout: OperatorLayout, p: int, batch_id: int) -> dict[str, Any]:
    return {"operator": layout.operator, "name": layout.name, "generation": layout.generation,
            "partition": p, "num_partitions": layout.num_partitions, "batch_id": batch_id}


def make_state(uri: str, P: int, seed: int, n_keys: int = 1500) -> None:
    """Write a P-partition state of five structures of every kind, keys placed by Spark's rule."""
    root = open_root(uri)
    layout = _layout(P)
    write_layout(root, layout)
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(-10**9, 10**9, n_keys))
    part = partition_of(keys, P)
    for p in range(P):
        k = keys[part == p]
        pm = PageManager(PAGE, 1 << 26)
        v = np.zeros(len(k), VAL)
        v["n"], v["s"] = rng.integers(0, 100, len(k)), rng.normal(size=len(k))
        HashMap.create(pm, "agg", key="<i8", value=VAL, page_slots=32).put(k, v)
        OrderedMap.create(pm, "om", key="<i8", value=VAL, page_slots=8).put(k, v)
        kw = np.zeros(2 * len(k), KW)
        kw["k"], kw["w"] = np.repeat(k, 2), np.tile([0, 1], len(k))
        HashMap.create(pm, "bykw", key=KW, value="<f8", page_slots=16).put(
            kw, rng.normal(size=len(kw)))
        rec = np.zeros(3 * len(k), REC)
        rec["k"] = rng.permutation(np.repeat(k, 3))
        rec["ts"] = np.sort(rng.integers(0, 10**6, len(rec)))
        PagedDeque.create(pm, "buf", REC, page_slots=7).extend(rec)
        items = np.zeros(2 * len(k), ITEM)
        items["k"], items["x"] = rng.permutation(np.repeat(k, 2)), np.arange(2 * len(k))
        PagedList.create(pm, "lst", ITEM, page_slots=9).extend(items)
        with CheckpointManager(pm, root, layout.haunit(p)) as mgr:
            mgr.checkpoint(_meta(layout, p, int(rng.integers(0, 5)))).result()


def read_state(uri: str) -> dict[str, Any]:
    """The whole state (union of partitions), asserting every row sits where Spark puts its key."""
    root = open_root(uri)
    layout = read_layout(root)
    assert layout is not None
    P = layout.num_partitions
    out: dict[str, list[Any]] = {n: [] for n in ("agg", "om", "bykw", "buf", "lst")}
    for p in range(P):
        pm = PageManager(PAGE, 1 << 26)
        man = restore(pm, root, layout.haunit(p))
        assert man.user_meta["partition"] == p and man.user_meta["num_partitions"] == P
        assert man.user_meta["generation"] == layout.generation
        k, v = HashMap.create(pm, "agg", key="<i8", value=VAL).items()
        assert (partition_of(k, P) == p).all()
        out["agg"].append((k, v))
        ok, ov = OrderedMap.create(pm, "om", key="<i8", value=VAL).items()
        assert (partition_of(ok, P) == p).all()
        out["om"].append((ok, ov))
        kk, kv = HashMap.create(pm, "bykw", key=KW, value="<f8").items()
        assert (partition_of(kk["k"], P) == p).all()
        out["bykw"].append((kk, kv))
        buf = PagedDeque.create(pm, "buf", REC).to_numpy()
        assert (partition_of(buf["k"], P) == p).all()
        assert (np.diff(buf["ts"]) >= 0).all(), "a window buffer lost its time order"
        out["buf"].append(buf)
        lst = PagedList.create(pm, "lst", ITEM).to_numpy()
        assert (partition_of(lst["k"], P) == p).all()
        out["lst"].append(lst)
    state: dict[str, Any] = {}
    for name in ("agg", "om", "bykw"):
        k = np.concatenate([a for a, _ in out[name]])
        v = np.concatenate([b for _, b in out[name]])
        order = np.argsort(k, kind="stable")
        assert len(np.unique(k)) == len(k), f"{name}: a key sits in two partitions"
        state[name] = (k[order], v[order])
    buf = np.concatenate(out["buf"])
    state["buf"] = np.sort(buf, order=["ts", "k"])
    lst = np.concatenate(out["lst"])
    state["lst"] = lst[np.lexsort((lst["x"], lst["k"]))]  # per-key order is the x order
    return state


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name in ("agg", "om", "bykw"):
        np.testing.assert_array_equal(a[name][0], b[name][0], err_msg=name)
        np.testing.assert_array_equal(a[name][1], b[name][1], err_msg=name)
    for name in ("buf", "lst"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def tree_digest(path: str) -> dict[str, str]:
    """Every file under `path` with a digest of its bytes."""
    out = {}
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            full = os.path.join(dirpath, f)
            out[os.path.relpath(full, path)] = hashlib.sha256(Path(full).read_bytes()).hexdigest()
    return out


# -- state equality and placement ----------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_random_repartitions_keep_every_key_and_place_it_as_spark(tmp_path: Path,
                                                                  seed: int) -> None:
    """P -> P' -> ... (1..8, P' = P and P' = 1 included): the union equals the old state."""
    rng = np.random.default_rng(seed)
    uri = str(tmp_path / "state")
    P = int(rng.integers(1, 9))
    make_state(uri, P, seed, n_keys=800)
    original = read_state(uri)
    chain = [int(x) for x in rng.integers(1, 9, 2)] + [P, 1, P]
    for P2 in chain:
        res = repartition(uri, P2, workers=1 if seed % 2 else None, force=True)
        assert res.num_partitions == P2 and res.changed
        assert read_layout(open_root(uri)).num_partitions == P2  # type: ignore[union-attr]
        assert not (tmp_path / "state" / MARKER_FILE).exists()
        assert_same_state(read_state(uri), original)


def test_same_partition_count_is_a_no_op_unless_forced(tmp_path: Path) -> None:
    """Asking for the current P writes nothing; --force writes a new generation."""
    uri = str(tmp_path / "s")
    make_state(uri, 3, 5, n_keys=300)
    before = tree_digest(uri)
    assert not repartition(uri, 3).changed
    out = _run_cli(uri, "--partitions", "3")
    assert out.returncode == 0 and "nothing to do" in out.stdout
    assert tree_digest(uri) == before
    assert repartition(uri, 3, force=True).generation == 1
    out = _run_cli(uri, "--partitions", "2")
    assert out.returncode == 0 and "3 -> 2 partitions, generation 2" in out.stdout, out.stderr
    assert len(out.stdout.strip().splitlines()) == 1


def test_groups_follow_the_gcd() -> None:
    """Old partition s feeds new partition t only when s = t mod gcd(P, P')."""
    assert source_groups(4, 2) == [([0, 2], [0]), ([1, 3], [1])]
    assert source_groups(3, 5) == [([0, 1, 2], [0, 1, 2, 3, 4])]
    keys = np.random.default_rng(0).integers(-2**62, 2**62, 20_000)
    for P, P2 in [(4, 6), (2, 8), (6, 4), (5, 3)]:
        links = set(zip(partition_of(keys, P).tolist(), partition_of(keys, P2).tolist()))
        allowed = {(s, t) for srcs, tgts in source_groups(P, P2) for s in srcs for t in tgts}
        assert links <= allowed


def test_bytes_keys_route_like_spark_binary(tmp_path: Path) -> None:
    """A map keyed by fixed bytes splits by the hash of the bytes without padding."""
    uri = str(tmp_path / "b")
    root = open_root(uri)
    layout = OperatorLayout(operator="o", name="b", schema={}, num_partitions=2, key="k")
    write_layout(root, layout)
    keys = np.array([f"user-{i}".encode() for i in range(500)], dtype="S12")
    for p in range(2):
        pm = PageManager(PAGE, 1 << 24)
        k = keys[partition_of(keys, 2) == p]
        HashMap.create(pm, "m", key="S12", value="<i8").put(k, np.arange(len(k)))
        with CheckpointManager(pm, root, layout.haunit(p)) as mgr:
            mgr.checkpoint(_meta(layout, p, 0)).result()
    repartition(uri, 3)
    got = []
    for t in range(3):
        pm = PageManager(PAGE, 1 << 24)
        restore(pm, root, f"b.g1.p{t:04d}")
        k, _ = HashMap.create(pm, "m", key="S12", value="<i8").items()
        assert (partition_of(k, 3) == t).all()
        got.append(k)
    assert sorted(np.concatenate(got).tolist()) == sorted(keys.tolist())


# -- exactly-once across a repartition -----------------------------------------------------------
class _Pipeline:
    """A keyed running aggregate over P partitions, checkpointed per partition."""

    def __init__(self, uri: str, layout: OperatorLayout) -> None:
        self.root = open_root(uri)
        self.layout = layout
        self.pms = [PageManager(PAGE, 1 << 26) for _ in range(layout.num_partitions)]
        self.maps = [HashMap.create(pm, "agg", key="<i8", value=AGG_VALUE, page_slots=32)
                     for pm in self.pms]

    def apply(self, t: int, keys: np.ndarray, ts: np.ndarray) -> None:
        self.maps[t].upsert(keys, {"ts": ts}, _AGG)

    def route(self, keys: np.ndarray, ts: np.ndarray) -> None:
        part = partition_of(keys, self.layout.num_partitions)
        for t in range(self.layout.num_partitions):
            self.apply(t, keys[part == t], ts[part == t])

    def checkpoint(self, t: int, batch_id: int) -> None:
        with CheckpointManager(self.pms[t], self.root, self.layout.haunit(t)) as mgr:
            mgr.checkpoint(_meta(self.layout, t, batch_id), full=True).result()

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        k = np.concatenate([m.items()[0] for m in self.maps])
        v = np.concatenate([m.items()[1] for m in self.maps])
        order = np.argsort(k)
        return k[order], v[order]


@pytest.mark.parametrize("P,P2,seed", [(2, 5, 0), (4, 2, 1), (3, 1, 2), (1, 4, 3)])
def test_pipeline_continuing_after_repartition_matches_one_that_never_stopped(
        tmp_path: Path, P: int, P2: int, seed: int) -> None:
    """Partitions checkpointed at different batches, stopped, repartitioned, replayed, continued."""
    rng = np.random.default_rng(seed)
    batches = [(rng.integers(0, 400, 300).astype(np.int64), rng.integers(0, 10**6, 300))
               for _ in range(12)]
    stop = 7
    uri = str(tmp_path / "p")
    layout = _layout(P)
    write_layout(open_root(uri), layout)
    run = _Pipeline(uri, layout)
    for b, (k, ts) in enumerate(batches[:stop + 1]):
        run.route(k, ts)
        for t in range(P):
            if (b + t) % 3 == 0:  # partitions checkpoint after different batches
                run.checkpoint(t, b)
    del run  # the live state is lost; only the checkpoints remain
    repartition(uri, P2)
    new_layout = read_layout(open_root(uri))
    assert new_layout is not None and new_layout.num_partitions == P2
    run = _Pipeline(uri, new_layout)
    for t in range(P2):
        man = restore(run.pms[t], run.root, new_layout.haunit(t))
        meta = man.user_meta
        pos = ReplayPositions.from_user_meta(meta)
        assert meta["batch_id"] == pos.min_batch_id
        for b in range(pos.min_batch_id + 1, stop + 1):  # replay exactly what each key missed
            k, ts = batches[b]
            mask = replay_mask(meta, k, b)
            run.apply(t, k[mask], ts[mask])
    for k, ts in batches[stop + 1:]:
        run.route(k, ts)
    keys = np.concatenate([k for k, _ in batches])
    want_k, want_v = expected_aggregate(keys.astype(np.uint32), np.concatenate(
        [ts for _, ts in batches]))
    got_k, got_v = run.result()
    np.testing.assert_array_equal(got_k, want_k.astype(np.int64))
    np.testing.assert_array_equal(got_v, want_v)


def test_replay_positions_compose_over_two_repartitions_without_a_checkpoint() -> None:
    """Each key matches exactly one class, with its own source's batch."""
    pos = ReplayPositions.from_user_meta(
        {"sources": [{"num_partitions": 3, "partition": s, "batch_id": s} for s in range(3)]})
    keys = np.arange(-5000, 5000)
    mine = np.ones(len(keys), bool)
    for P2, t in [(5, 2), (2, 1)]:
        sub = pos.restrict(P2, t)
        mine &= partition_of(keys, P2) == t
        np.testing.assert_array_equal(sub.batch_of(keys[mine]), partition_of(keys[mine], 3))
        assert (sub.batch_of(keys[~mine]) == -1).all()
        pos = sub


# -- bad input ------------------------------------------------------------------------------------
def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sguard", "state", "repartition", *args],
                          capture_output=True, text=True, timeout=120)


def test_bad_input_gets_one_line_errors_and_writes_nothing(tmp_path: Path) -> None:
    """Unknown URI, P' < 1, mixed operators, mixed schema versions: clear errors, no writes."""
    uri = str(tmp_path / "s")
    make_state(uri, 2, 7, n_keys=200)
    before = tree_digest(uri)
    with pytest.raises(RescaleError, match="does not exist"):
        repartition(str(tmp_path / "nope"), 2)
    assert not (tmp_path / "nope").exists()
    with pytest.raises(RescaleError, match="no sguard operator state"):
        repartition(str(tmp_path), 2)
    for bad in (0, -3):
        with pytest.raises(RescaleError, match="partitions must be an integer >= 1"):
            repartition(uri, bad)
    assert tree_digest(uri) == before
    out = _run_cli(uri, "--partitions", "0")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    out = _run_cli(str(tmp_path / "nope"), "--partitions", "3")
    assert out.returncode == 2 and "does not exist" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert tree_digest(uri) == before

    root = open_root(uri)
    layout = read_layout(root)
    assert layout is not None

    def overwrite_partition(meta: dict[str, Any], value_dtype: Any = VAL) -> None:
        pm = PageManager(PAGE, 1 << 24)
        restore(pm, root, layout.haunit(1))
        if value_dtype is not VAL:
            HashMap.create(pm, "agg", key="<i8", value=VAL).destroy()
            HashMap.create(pm, "agg", key="<i8", value=value_dtype)
        with CheckpointManager(pm, root, layout.haunit(1)) as mgr:
            mgr.checkpoint(meta, full=True).result()

    overwrite_partition(dict(_meta(layout, 1, 3), operator="other_op"))
    mixed = tree_digest(uri)
    with pytest.raises(RescaleError, match="operator='other_op'.*mixed operators"):
        repartition(uri, 3)
    out = _run_cli(uri, "--partitions", "3")
    assert out.returncode == 2 and "mixed operators" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert tree_digest(uri) == mixed

    overwrite_partition(_meta(layout, 1, 3), value_dtype=[("n", "<i4")])
    mixed = tree_digest(uri)
    with pytest.raises(RescaleError, match="structure 'agg'.*mixed schema versions"):
        repartition(uri, 3)
    overwrite_partition(dict(_meta(layout, 1, 3), schema_version=2))
    with pytest.raises(RescaleError, match="schema_version 2.*mixed schema versions"):
        repartition(uri, 3)
    assert read_layout(root) == layout


def test_foreign_next_generation_is_refused_not_deleted(tmp_path: Path) -> None:
    """HA units of generation g+1 that no repartition marked are left alone."""
    uri = str(tmp_path / "s")
    make_state(uri, 2, 8, n_keys=100)
    root = open_root(uri)
    pm = PageManager(PAGE, 1 << 22)
    HashMap.create(pm, "x", key="<i8", value="<i8")
    with CheckpointManager(pm, root, "op.g1.p0000") as mgr:
        mgr.checkpoint({}).result()
    before = tree_digest(uri)
    with pytest.raises(RescaleError, match="no repartition made them"):
        repartition(uri, 3)
    assert tree_digest(uri) == before


def test_unroutable_structure_is_named(tmp_path: Path) -> None:
    """A structure without the key column is refused with its name."""
    uri = str(tmp_path / "s")
    root = open_root(uri)
    layout = OperatorLayout(operator="o", name="u", schema={}, num_partitions=1, key="k")
    write_layout(root, layout)
    pm = PageManager(PAGE, 1 << 22)
    PagedList.create(pm, "log", [("a", "<i8")]).extend(np.zeros(3, [("a", "<i8")]))
    with CheckpointManager(pm, root, layout.haunit(0)) as mgr:
        mgr.checkpoint(_meta(layout, 0, 0)).result()
    with pytest.raises(RescaleError, match="structure 'log'.*no column 'k'"):
        repartition(uri, 2)


# -- crash safety ----------------------------------------------------------------------------------
_POINTS = ["validated", "marked", "cleaned", "source_restored", "target_written",
           "before_commit", "committed", "time"]


def _source_files(uri: str, generation: int) -> dict[str, str]:
    return {p: d for p, d in tree_digest(uri).items()
            if f".g{generation}.p" in p and p.startswith("checkpoint")}


def test_killed_repartition_leaves_sources_intact_and_a_rerun_completes(tmp_path: Path) -> None:
    """SIGKILL at seeded points (and a few seeded times): sources intact, rerun completes."""
    base = {P: str(tmp_path / f"base{P}") for P in (2, 3)}
    for P, uri in base.items():
        make_state(uri, P, P, n_keys=300)
    originals = {P: read_state(uri) for P, uri in base.items()}
    rng = np.random.default_rng(12)
    trials = 0
    for trial in range(22):
        P = 2 + trial % 2
        P2 = int(rng.choice([1, 4, 5, 6]))
        point = _POINTS[trial % len(_POINTS)]
        nth = int(rng.integers(1, 3)) if point in ("source_restored", "target_written") else 1
        uri = str(tmp_path / f"t{trial}")
        shutil.copytree(base[P], uri)
        if trial % 4 == 3:  # a previous interrupted run already left a partial generation
            env = dict(os.environ, **{KILL_ENV: "target_written:1"})
            subprocess.run([sys.executable, "-c", _CHILD, uri, str(P2 + 1)], env=env,
                           timeout=120, capture_output=True)
        sources = _source_files(uri, 0)
        layout_before = Path(uri, "sguard-operator.json").read_bytes()
        env = dict(os.environ)
        if point != "time":
            env[KILL_ENV] = f"{point}:{nth}"
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, uri, str(P2)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if point == "time":
            time.sleep(float(rng.uniform(0.5, 3.0)))
            proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=120)
        killed = proc.returncode == -signal.SIGKILL
        assert killed or point == "time", (point, proc.returncode)
        assert _source_files(uri, 0) == sources, "a source checkpoint changed"
        layout_now = Path(uri, "sguard-operator.json").read_bytes()
        committed = layout_now != layout_before
        assert committed == (point == "committed") or point == "time"
        assert_same_state(read_state(uri), originals[P])  # old or new generation: same state
        repartition(uri, P2, workers=1)
        lay = read_layout(open_root(uri))
        assert lay is not None and lay.num_partitions == P2 and lay.generation == 1
        assert not Path(uri, MARKER_FILE).exists()
        assert _source_files(uri, 0) == sources
        assert_same_state(read_state(uri), originals[P])
        assert not [p for p in tree_digest(uri) if ".g2." in p]
        trials += 1
    assert trials >= 20


_CHILD = """
import sys
from sguard.rescale import repartition
repartition(sys.argv[1], int(sys.argv[2]), workers=1)
"""


# -- parallel recovery ---------------------------------------------------------------------------
def test_restore_piece_splits_a_partition_into_k_disjoint_pieces(tmp_path: Path) -> None:
    """k pieces of partition s hold its keys exactly once, each where P*k partitioning puts it."""
    uri = str(tmp_path / "s")
    make_state(uri, 3, 9, n_keys=900)
    root = open_root(uri)
    pm = PageManager(PAGE, 1 << 26)
    man = restore(pm, root, "op.g0.p0001")
    whole_k, whole_v = HashMap.create(pm, "agg", key="<i8", value=VAL).items()
    whole_buf = PagedDeque.create(pm, "buf", REC).to_numpy()
    k = 4
    got, bufs = [], []
    for j in range(k):
        piece = PageManager(PAGE, 1 << 26)
        pos = restore_piece(uri, 1, k, j, piece)
        assert pos.classes[0].batch_id == man.user_meta["batch_id"]
        kj, _ = HashMap.create(piece, "agg", key="<i8", value=VAL).items()
        assert (partition_of(kj, 3 * k) == 1 + 3 * j).all()
        got.append(kj)
        bufs.append(PagedDeque.create(piece, "buf", REC).to_numpy())
    assert sorted(np.concatenate(got).tolist()) == sorted(whole_k.tolist())
    assert sum(len(b) for b in bufs) == len(whole_buf)
    with pytest.raises(RescaleError, match="piece 4 of 4"):
        restore_piece(uri, 1, 4, 4, PageManager(PAGE, 1 << 20))
    with pytest.raises(RescaleError, match="partition 3 out of range"):
        restore_piece(uri, 3, 2, 0, PageManager(PAGE, 1 << 20))


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_groups_run_in_parallel_workers(tmp_path: Path, executor: str) -> None:
    """2 -> 4 and back with one worker (process or thread) per independent group."""
    uri = str(tmp_path / "s")
    make_state(uri, 2, 11, n_keys=400)
    original = read_state(uri)
    for P2 in (4, 2):
        res = repartition(uri, P2, workers=2, executor=executor)
        assert res.phases_s["insert_s"] > 0
        assert_same_state(read_state(uri), original)


META = np.dtype([("max_ts", "<i8"), ("seen", "<i8"), ("late", "<i8")])
JREC = np.dtype([("k", "<i8"), ("t", "<i8"), ("v", "<f8")])


def test_join_and_window_layouts_route_by_rules_and_replicate_metadata(tmp_path: Path) -> None:
    """Shapes of sguard.spark's states: deques keyed by a field a glob rule names, a
    per-partition metadata map replicated (max / sum), windows open in some partitions only;
    the window join's default rules apply when the layout has none."""
    uri = str(tmp_path / "j")
    root = open_root(uri)
    layout = OperatorLayout(
        operator="window_join", name="j", schema={}, num_partitions=2, key="user",
        extra={"routing": {"buf.*": {"key": "k", "order": "t"},
                           "meta": {"replicate": {"max_ts": "max", "seen": "sum",
                                                  "late": "sum"}}}})
    write_layout(root, layout)
    rng = np.random.default_rng(4)
    keys = np.arange(300, dtype=np.int64)
    all_recs, wins = [], {}
    for p in range(2):
        pm = PageManager(PAGE, 1 << 24)
        k = keys[partition_of(keys, 2) == p]
        recs = np.zeros(2 * len(k), JREC)
        recs["k"], recs["t"] = rng.permutation(np.repeat(k, 2)), np.sort(rng.integers(0, 99, 2 * len(k)))
        PagedDeque.create(pm, "buf.L", JREC, page_slots=6).extend(recs)
        all_recs.append(recs)
        HashMap.create(pm, "cnt.L", key="<i8", value=[("n", "<i8")]).put(
            k, np.ones(len(k), [("n", "<i8")]))
        HashMap.create(pm, "meta", key="<u1", value=META).put(
            np.zeros(1, np.uint8), np.array([(10 * (p + 1), 100 + p, p)], META))
        start = 60 * p  # window 0 is open in partition 0 only, window 60 in partition 1 only
        HashMap.create(pm, f"win.{start}", key="<i8", value=[("n", "<i8")]).put(
            k, np.full(len(k), start, [("n", "<i8")]))
        wins[start] = set(k.tolist())
        with CheckpointManager(pm, root, layout.haunit(p)) as mgr:
            mgr.checkpoint(_meta(layout, p, 3)).result()
    with pytest.raises(RescaleError, match="replicate needs an op"):
        write_layout(root, replace(layout, extra={"routing": {
            "buf.*": {"key": "k"}, "meta": {"replicate": {"max_ts": "max"}}}}))
        repartition(uri, 3)
    write_layout(root, replace(layout, extra={}))  # sguard.spark's own rules by default
    repartition(uri, 3)
    got_recs, got_wins = [], {0: set(), 60: set()}
    for t in range(3):
        pm = PageManager(PAGE, 1 << 24)
        restore(pm, root, f"j.g1.p{t:04d}")
        buf = PagedDeque.create(pm, "buf.L", JREC).to_numpy()
        assert (partition_of(buf["k"], 3) == t).all() and (np.diff(buf["t"]) >= 0).all()
        got_recs.append(buf)
        _, mv = HashMap.create(pm, "meta", key="<u1", value=META).items()
        assert mv.tolist() == [(20, 201, 1)]  # max of max_ts, sum of the counters
        for start in (0, 60):
            if pm.exists(f"win.{start}"):
                wk, _ = HashMap.create(pm, f"win.{start}", key="<i8", value=[("n", "<i8")]).items()
                assert (partition_of(wk, 3) == t).all()
                got_wins[start] |= set(wk.tolist())
    assert got_wins == wins
    want = np.sort(np.concatenate(all_recs), order=["t", "k"])
    np.testing.assert_array_equal(np.sort(np.concatenate(got_recs), order=["t", "k"]), want)


def test_bulk_built_targets_pass_check_and_keep_updating_like_the_original(
        tmp_path: Path) -> None:
    """Targets' hash maps are bulk-built (`HashMap.load_distinct`): every invariant holds,
    and the same later upserts give the same values as on the never-repartitioned state."""
    uri = str(tmp_path / "s")
    make_state(uri, 2, 21, n_keys=3000)
    before = read_state(uri)
    repartition(uri, 3)
    root = open_root(uri)
    rng = np.random.default_rng(5)
    new_keys = rng.integers(-10**9, 10**9, 500)
    upd = np.concatenate([before["agg"][0][::7], new_keys])
    ref = PageManager(PAGE, 1 << 26)
    m_ref = HashMap.create(ref, "agg", key="<i8", value=VAL, page_slots=32)
    m_ref.put(*before["agg"])
    m_ref.upsert(upd, {"x": np.ones(len(upd))}, {"n": "count", "s": ("sum", "x")})
    want = dict(zip(*[a.tolist() for a in m_ref.items()]))
    got: dict[int, Any] = {}
    for p in range(3):
        pm = PageManager(PAGE, 1 << 26)
        restore(pm, root, haunit(p))
        m = HashMap.create(pm, "agg", key="<i8", value=VAL)
        m._check()
        HashMap.create(pm, "bykw", key=KW, value="<f8")._check()
        mine = upd[partition_of(upd, 3) == p]
        m.upsert(mine, {"x": np.ones(len(mine))}, {"n": "count", "s": ("sum", "x")})
        m._check()
        got.update(zip(*[a.tolist() for a in m.items()]))
    assert got == want


def haunit(p: int) -> str:
    return replace(_layout(3), generation=1).haunit(p)


def test_a_key_in_two_source_partitions_is_refused_and_nothing_commits(
        tmp_path: Path) -> None:
    uri = str(tmp_path / "s")
    make_state(uri, 2, 23, n_keys=200)
    root = open_root(uri)
    layout = read_layout(root)
    assert layout is not None
    pm0 = PageManager(PAGE, 1 << 26)
    restore(pm0, root, layout.haunit(0))
    dup = HashMap.create(pm0, "agg", key="<i8", value=VAL).keys()[:1]
    pm = PageManager(PAGE, 1 << 26)
    man = restore(pm, root, layout.haunit(1))
    HashMap.create(pm, "agg", key="<i8", value=VAL).put(dup, np.zeros(1, VAL))
    with CheckpointManager(pm, root, layout.haunit(1)) as mgr:  # a damaged source
        mgr.checkpoint(dict(man.user_meta)).result()
    with pytest.raises(RescaleError, match="agg.*earlier in the batch"):
        repartition(uri, 1, workers=1)
    assert read_layout(root) == layout  # not committed
    with pytest.raises(RescaleError, match="agg"):
        repartition(uri, 1)  # a rerun is refused the same way
