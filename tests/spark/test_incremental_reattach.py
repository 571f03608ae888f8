"""Checkpoints stay incremental when a partition moves between Python workers.

Without Spark: `run_partition_batch` with the partition's handles dropped
between batches, as when Spark gives it to the other worker (the next batch
re-attaches the pool file in a fresh page manager and checkpoint manager).
The checkpoints after the first must be incremental, write only the pages the
batches changed, and restore (from the state URI alone) to exactly the state
a single worker builds.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from ioservice import Manifest, list_checkpoints, open_root, read_manifest
from sguard.spark import CheckpointConfig, RunningAggregate
from sguard.spark.api import schema_to_json
from sguard.spark.placement import root_key
from sguard.spark.runtime import RuntimeConfig, _runtime, run_partition_batch
from sguard.spark.state import read_durable_state
from sguard.statelayout import OperatorLayout, write_layout

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def _config(tmp: Path, every: int) -> RuntimeConfig:
    op = RunningAggregate(value="v")
    lay = OperatorLayout(operator=op.kind, name="op", schema={"params": op.params()},
                         num_partitions=1, key="k",
                         extra={"arrow_schema": schema_to_json(SCHEMA)})
    uri = str(tmp / "state")
    write_layout(open_root(uri), lay)
    return RuntimeConfig(state_uri=uri, state_key=root_key(open_root(uri)), layout=lay,
                         operator=op, key="k", input_schema=SCHEMA,
                         output_schema=op.output_schema(SCHEMA, "k"),
                         local_dir=str(tmp / "local"), capacity_bytes=1 << 28,
                         checkpoint=CheckpointConfig(every_n_batches=every, full_every=100),
                         metrics=False)


def _batches(n: int) -> list[pa.Table]:
    rng = np.random.default_rng(5)
    out = [pa.table({"k": np.arange(200_000, dtype=np.int64),  # many pages
                     "v": rng.integers(0, 100, 200_000, dtype=np.int64)})]
    for _ in range(n - 1):  # then a few keys per batch: a few pages change
        k = rng.integers(0, 200_000, 3, dtype=np.int64)
        out.append(pa.table({"k": k, "v": rng.integers(0, 100, 3, dtype=np.int64)}))
    return out


def _run(cfg: RuntimeConfig, tables: list[pa.Table], move: bool) -> None:
    rt = _runtime(cfg)
    for b, t in enumerate(tables):
        run_partition_batch(cfg, 0, b, t)
        part = rt.partition(0)
        if part.ckpt is not None:
            part.ckpt.wait()
        if move:  # the next batch runs in "another worker": it re-attaches the pool file
            part._drop()
    part = rt.partition(0)
    if part.ckpt is not None:
        part.ckpt.wait()
    part.slot.release()
    rt.parts.clear()


def _manifests(cfg: RuntimeConfig) -> list[Manifest]:
    root = open_root(cfg.state_uri)
    return [read_manifest(root, c.name) for c in list_checkpoints(root) if c.has_manifest]


@pytest.mark.parametrize("move", [True, False])
def test_checkpoints_after_a_reattach_are_incremental_and_exact(tmp_path: Path,
                                                                move: bool) -> None:
    tables = _batches(9)
    cfg = _config(tmp_path / "moving", every=2)
    _run(cfg, tables, move)
    mans = _manifests(cfg)
    assert len(mans) >= 2  # keep=2: the last two (the first, full one is gone)
    for m in mans:
        assert int(m.user_meta["batch_id"]) >= 2
        assert not m.full, f"{m.name} is a full checkpoint"
        own = np.array([f.checkpoint == m.name for f in m.files])[m.pages.file]
        assert 1 <= int(own.sum()) <= 12, f"{m.name} wrote {int(own.sum())} of {m.n_pages} pages"
        assert m.n_pages > 100
    oracle = _config(tmp_path / "oracle", every=100)
    _run(oracle, tables, move=False)
    got, _ = read_durable_state(cfg.state_uri, upto_batch=len(tables) - 1)
    want, _ = read_durable_state(oracle.state_uri, upto_batch=len(tables) - 1)
    assert got.num_rows == 200_000 and got.equals(want)


def _restored(cfg: RuntimeConfig, m: Manifest) -> pa.Table:
    """The state checkpoint `m` holds (restored alone, no log replayed)."""
    import mmm
    from ioservice import restore
    from sguard.spark.groupstate import open_state
    pm = mmm.PageManager(cfg.page_bytes, 1 << 26)
    got = restore(pm, open_root(cfg.state_uri), m.haunit, before_seq=m.seq + 1)
    assert got.name == m.name
    st = open_state(cfg.operator, pm, SCHEMA, "k", cfg.layout.key_group_range(0)).dump()
    return st.sort_by([(c, "ascending") for c in st.column_names])


@pytest.mark.parametrize("seed", range(6))
def test_adopted_bases_stay_exact_under_moves_and_failures(tmp_path: Path, seed: int) -> None:
    """Random moves, failures mid-batch (the retry rolls back in the pool file, in this or
    a "new" worker) and replays: every checkpoint, restored alone with the input log after
    it, gives the failure-free state of its batch."""
    from sguard.spark import Fault, FaultPlan, InjectedFault
    rng = np.random.default_rng(seed)
    n = 12
    tables = [pa.table({"k": np.arange(50_000, dtype=np.int64),
                        "v": rng.integers(0, 100, 50_000, dtype=np.int64)})]
    for _ in range(n - 1):
        k = rng.integers(0, 50_000, int(rng.integers(1, 40)), dtype=np.int64)
        tables.append(pa.table({"k": k, "v": rng.integers(0, 100, len(k), dtype=np.int64)}))
    (tmp_path / "faults").mkdir()
    acts = {b: str(rng.choice(["move", "stay", "die", "retry", "replay"])) for b in range(1, n)}
    faults = tuple(Fault("raise", b, 0, "mid") for b, a in acts.items() if a in ("die", "retry"))
    import dataclasses
    cfg = dataclasses.replace(_config(tmp_path / "run", every=2),
                              faults=FaultPlan(faults, str(tmp_path / "faults")))
    rt = _runtime(cfg)
    for b, t in enumerate(tables):
        for _attempt in range(3):
            try:
                run_partition_batch(cfg, 0, b, t)
                break
            except InjectedFault:
                if acts[b] == "die":
                    rt.partition(0)._drop()
        if acts.get(b) == "replay":
            run_partition_batch(cfg, 0, b, t)
        part = rt.partition(0)
        if part.ckpt is not None:
            part.ckpt.wait()
        if acts.get(b) in ("move", "die"):
            part._drop()
    part = rt.partition(0)
    if part.ckpt is not None:
        part.ckpt.wait()
    part.slot.release()
    rt.parts.clear()
    oracle = _config(tmp_path / "oracle", every=100)
    _run(oracle, tables, move=False)
    mans = _manifests(cfg)
    assert mans
    for m in mans:  # each checkpoint, restored alone, is the state after its batch
        want, _ = read_durable_state(oracle.state_uri, upto_batch=int(m.user_meta["batch_id"]))
        assert _restored(cfg, m).equals(want), (seed, m.name, m.full, acts)
    got, _ = read_durable_state(cfg.state_uri, upto_batch=n - 1)
    want, _ = read_durable_state(oracle.state_uri, upto_batch=n - 1)
    assert got.equals(want), (seed, acts)


def test_durable_state_reads_checkpoints_of_any_page_size(tmp_path: Path) -> None:
    """read_durable_state restores with the checkpoint's own page size (here 16 KiB)."""
    from dataclasses import replace
    tables = _batches(4)
    cfg = replace(_config(tmp_path, every=1), page_bytes=1 << 14)
    _run(cfg, tables, move=False)
    assert {m.page_bytes for m in _manifests(cfg)} == {1 << 14}
    got, batches = read_durable_state(cfg.state_uri, upto_batch=len(tables) - 1)
    allk = np.concatenate([t.column("k").to_numpy() for t in tables])
    allv = np.concatenate([t.column("v").to_numpy() for t in tables])
    want = np.bincount(allk, weights=allv, minlength=200_000).astype(np.int64)
    g = got.sort_by("k")
    assert batches == {0: len(tables) - 1}
    assert np.array_equal(g.column("k").to_numpy(), np.arange(200_000))
    assert np.array_equal(g.column("sum_v").to_numpy(), want)


def test_a_worker_that_attaches_counts_from_the_checkpoint_last_started(tmp_path: Path) -> None:
    """The partition moves to another worker after every batch, while the checkpoint the
    last worker started may not be durable yet (the marker is written before it lands):
    the checkpoints are taken after the same batches as without moves, none extra."""
    import dataclasses
    tables = _batches(11)

    def batches(move: bool) -> list[int]:
        cfg = _config(tmp_path / f"move{move}", every=4)
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, keep=100))
        _run(cfg, tables, move)
        return sorted(int(m.user_meta["batch_id"]) for m in _manifests(cfg))

    assert batches(move=False) == [3, 7]
    assert batches(move=True) == [3, 7]
