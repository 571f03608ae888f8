"""What a Python worker keeps of a partition from task to task, and when it must not.

Without Spark (`run_partition_batch`, as Spark drives it). A worker keeps its partitions'
page and checkpoint managers while the query definition is the same (`_runtime`), and
trusts them only while the partition's marker is the one it wrote. Two ways to get that
wrong are checked here:

* pages restored from a checkpoint (a restore, or a partition's first task after a
  repartition composing its checkpoint from the old partitions' pages) keep the versions
  their writer's pool gave them. When the restoring pool's clock stayed below them, a page
  written after the next checkpoint could take the very version that checkpoint recorded
  for it (``ckpt.npz``), and a worker re-attaching the pool file took the page for
  unchanged: its incremental checkpoint referenced the old bytes, and a later restore
  (or repartition) read a wrong state. That is what every partition moving to another
  worker at every batch (as in Spark) met after lazy repartitions;
* a runtime kept of an earlier generation, or of another definition of the same state, is
  let go (checkpoint landed, handles dropped, lock released) once the state runs on.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from ioservice import open_root
from mmm import PageManager
from sguard import rescale
from sguard.spark import CheckpointConfig, RunningAggregate
from sguard.spark.api import schema_to_json
from sguard.spark.placement import root_key
from sguard.spark.runtime import _RUNTIMES, RuntimeConfig, _runtime, run_partition_batch
from sguard.spark.state import read_durable_state
from sguard.statelayout import OperatorLayout, write_layout
from tests.sguard.rescale_helpers import HANG_S, K, OPS, Query, make_batches, random_run
from tests.spark.helpers import landed_metrics

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


class MovingQuery(Query):
    """A query whose every partition runs each batch in "another worker": its handles are
    dropped after the batch, so the next batch re-attaches the pool file (and adopts the
    recorded checkpoint as the base of its next one), as Spark moves partitions."""

    def batch(self, b: int, table: pa.Table) -> list[tuple[Any, ...]]:
        out = super().batch(b, table)  # its checkpoints have landed
        rt = _RUNTIMES.get(self.cfg().sid)
        assert rt is not None
        for part in rt.parts.values():
            part._drop()
        return out


@pytest.mark.parametrize("seed", range(6))
def test_lazy_repartitions_with_partitions_moving_every_batch(tmp_path: Path,
                                                              seed: int) -> None:
    """Batches with lazy and eager repartitions between them, every partition re-attached
    at every batch: each batch's output and the final durable state equal those of a run
    that never rescaled nor moved. (Seed 2 is the schedule that failed at batch 6.)"""
    random_run(tmp_path, 50 + seed, lazy_p=0.7, query=MovingQuery, lazy_seen=False)


def _config(tmp: Path, op: Any = None, every: int = 1) -> RuntimeConfig:
    op = op or RunningAggregate(value="v")
    uri = str(tmp / "state")
    root = open_root(uri)
    lay = OperatorLayout(operator=op.kind, name="op", schema={"params": op.params()},
                         num_partitions=1, key="k", key_groups=K,
                         extra={"arrow_schema": schema_to_json(SCHEMA)})
    write_layout(root, lay)
    return RuntimeConfig(state_uri=uri, state_key=root_key(root), layout=lay, operator=op,
                         key="k", input_schema=SCHEMA,
                         output_schema=op.output_schema(SCHEMA, "k"),
                         local_dir=str(tmp / "local"), capacity_bytes=1 << 26,
                         checkpoint=CheckpointConfig(every_n_batches=every, full_every=100))


def _versions(pm: PageManager) -> np.ndarray:
    h = pm.pool.headers["version"]
    return np.concatenate([h[ps.frames[ps.seqs()]] for _, ps in pm.page_sets()])


def test_a_restored_pool_clock_starts_above_the_pages_it_loaded(tmp_path: Path) -> None:
    """Many batches raise the writer's clock; the local state is lost and the next batch
    restores the latest checkpoint into a new pool: every page version it then writes is
    above every version it loaded (the rule the incremental checkpoints of a re-attached
    pool rely on, `sguard.spark.checkpointing`)."""
    cfg = _config(tmp_path)
    rng = np.random.default_rng(3)
    tables = [pa.table({"k": np.arange(20_000, dtype=np.int64),
                        "v": np.ones(20_000, dtype=np.int64)})]
    for _ in range(40):  # a few pages written per batch: the clock climbs
        k = rng.integers(0, 20_000, 4, dtype=np.int64)
        tables.append(pa.table({"k": k, "v": np.ones(4, dtype=np.int64)}))
    rt = _runtime(cfg)
    for b, t in enumerate(tables):
        run_partition_batch(cfg, 0, b, t)
    part = rt.partition(0)
    assert part.pm is not None and part.ckpt is not None
    part.ckpt.wait(HANG_S)
    written = int(part.pm.pool.clock)
    part._drop()
    part.slot.wipe()  # the host lost its local state
    n = len(tables)
    run_partition_batch(cfg, 0, n, tables[1].slice(0, 0))
    assert part.pm is not None
    loaded = _versions(part.pm)
    assert loaded.max() > 20, (written, loaded.max())  # versions from the old pool
    assert part.pm.pool.clock > loaded.max()
    run_partition_batch(cfg, 0, n + 1, tables[1])
    assert part.pm is not None and part.ckpt is not None
    part.ckpt.wait(HANG_S)
    recs, _ = landed_metrics(open_root(cfg.state_uri), [(n, 0)])
    assert {r["batch"]: r["recovery"] for r in recs}[n] == "restored"
    part.slot.release()
    _RUNTIMES.pop(cfg.sid, None)


def test_a_kept_runtime_goes_when_the_state_is_repartitioned(tmp_path: Path) -> None:
    """A worker kept generation 0's partitions; the state is repartitioned behind it
    (lazily, as at a query's start-up) and the next task runs generation 1: generation 0's
    runtime is gone from the worker, its handles dropped and its locks released, and the
    batches equal a run that never rescaled."""
    make, key, join = OPS["running_int"]
    tables = make_batches(7, 6, key, join)
    schema = tables[0].schema
    ref = Query(tmp_path / "ref", make(), key, schema, 2, K, every=1)
    want = [ref.batch(b, t) for b, t in enumerate(tables)]
    ref.stop()
    q = Query(tmp_path / "run", make(), key, schema, 2, K, every=1)
    for b in range(3):
        assert q.batch(b, tables[b]) == want[b]
    old_cfg = q.cfg()
    old = _RUNTIMES[old_cfg.sid]
    parts = list(old.parts.values())
    assert len(parts) == 2 and all(p.pm is not None for p in parts)
    assert not any(p.slot.locked for p in parts)  # let go at the end of each task
    for p in parts:  # as if a task were still holding them: the retirement lets them go
        p.slot.acquire(HANG_S)
    rescale.repartition(q.uri, 3, lazy=True)  # no q.stop(): the worker keeps generation 0
    for b in range(3, 6):
        assert q.batch(b, tables[b]) == want[b]
    assert old_cfg.sid not in _RUNTIMES
    assert all(p.pm is None and p.ckpt is None and not p.slot.locked for p in parts)
    q.stop()
    assert q.durable() == ref.durable()


def test_another_definition_of_the_state_gets_a_runtime_of_its_own(tmp_path: Path) -> None:
    """The same state run by a config built with another operator object (a query defined
    anew): the worker does not use what it kept for the old definition (the batch
    re-attaches the pool file) and lets the old runtime go; a copy of the same config (what
    each task unpickles) keeps it ('cached')."""
    import pickle
    cfg = _config(tmp_path)
    t = pa.table({"k": np.arange(100, dtype=np.int64), "v": np.ones(100, dtype=np.int64)})
    run_partition_batch(cfg, 0, 0, t)
    rt = _runtime(cfg)
    run_partition_batch(pickle.loads(pickle.dumps(cfg)), 0, 1, t)
    assert _runtime(cfg) is rt
    import dataclasses
    anew = dataclasses.replace(cfg, operator=RunningAggregate(value="v"), instance="")
    assert anew != cfg
    out = run_partition_batch(anew, 0, 2, t)
    assert rt.partition(0).pm is None and _RUNTIMES[cfg.sid] is not rt
    assert out.column("count").to_pylist() == [3] * 100  # the state after batches 0 and 1
    new = _runtime(anew)
    assert new.partition(0).ckpt is not None
    new.partition(0).ckpt.wait(HANG_S)
    recs, _ = landed_metrics(open_root(cfg.state_uri), [(0, 0), (1, 0), (2, 0)])
    assert [r["recovery"] for r in recs] == ["fresh", "cached", "attached"]
    new.partition(0).slot.release()
    _RUNTIMES.pop(cfg.sid, None)
    got, _ = read_durable_state(cfg.state_uri)
    assert got.num_rows == 100
