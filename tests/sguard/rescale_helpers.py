"""A query's state driven through the runtime without Spark (`run_partition_batch`), as
Spark drives it, stopped and repartitioned between batches (`sguard.rescale`)."""
from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ioservice import list_checkpoints, open_root, read_manifest
from sguard import rescale
from sguard.rescale import MARKER_FILE
from sguard.spark import CheckpointConfig, RunningAggregate, WindowAggregate, WindowJoin
from sguard.spark.api import schema_to_json
from sguard.spark.groupstate import split_by_partition
from sguard.spark.keys import key_spec
from sguard.spark.operators import SIDE_COLUMN, Operator
from sguard.spark.placement import root_key
from sguard.spark.runtime import _RUNTIMES, RuntimeConfig, run_partition_batch
from sguard.spark.state import read_durable_state
from sguard.statelayout import OperatorLayout, read_layout, write_layout

K = 8
"""Key groups of the random-repartition runs (`random_run`)."""

HANG_S = 600.0  #: a wait's bound: far above any load, it only turns a hang into a failure
OPS: dict[str, Any] = {
    "running_int": (lambda: RunningAggregate(value="v"), "k", False),
    "running_str": (lambda: RunningAggregate(value="v"), "s", False),
    "window": (lambda: WindowAggregate(time="ts", window=50, value="v", lateness=30), "k", False),
    "join": (lambda: WindowJoin(time="ts", window=15, value="v", lateness=30), "k", True),
}


def make_batches(seed: int, n_batches: int, key: str, join: bool, rows: int = 300,
                 keys: int = 80) -> list[pa.Table]:
    """Rows of each batch (not yet routed): event times advance with the batch, some late."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(n_batches):
        k = rng.integers(0, keys, rows, dtype=np.int64)
        cols: dict[str, Any] = {"s": pa.array([f"user-{x}" for x in k.tolist()])} \
            if key == "s" else {"k": k}
        cols["v"] = rng.integers(-50, 50, rows, dtype=np.int64)
        cols["ts"] = b * 100 + rng.integers(-20, 100, rows, dtype=np.int64)
        if join:
            cols[SIDE_COLUMN] = rng.integers(0, 2, rows, dtype=np.int8)
        out.append(pa.table(cols))
    return out


def rows_of(tables: Sequence[pa.Table]) -> list[tuple[Any, ...]]:
    """The rows of `tables` as a sorted list of tuples (a multiset)."""
    rows = [tuple(r.values()) for t in tables for r in t.to_pylist()]
    return sorted(rows, key=repr)


class Query:
    """One operator's state under ``<d>/state``, its tasks run in this process."""

    def __init__(self, d: Path, op: Operator, key: str, schema: pa.Schema, P: int, K: int,
                 every: int = 2) -> None:
        self.d, self.op, self.key, self.schema = d, op, key, schema
        self.uri = str(d / "state")
        self.every = every
        root = open_root(self.uri)
        write_layout(root, OperatorLayout(
            operator=op.kind, name="op", schema={"params": op.params()}, num_partitions=P,
            key=key, key_groups=K,
            extra={"arrow_schema": schema_to_json(schema),
                   "keys": key_spec(schema, key).describe()}))
        self.state_key = root_key(root)

    @property
    def layout(self) -> OperatorLayout:
        lay = read_layout(open_root(self.uri))
        assert lay is not None
        return lay

    def cfg(self) -> RuntimeConfig:
        return RuntimeConfig(state_uri=self.uri, state_key=self.state_key, layout=self.layout,
                             operator=self.op, key=self.key, input_schema=self.schema,
                             output_schema=self.op.output_schema(self.schema, self.key),
                             local_dir=str(self.d / "local"), capacity_bytes=1 << 26,
                             checkpoint=CheckpointConfig(every_n_batches=self.every))

    def batch(self, b: int, table: pa.Table) -> list[tuple[Any, ...]]:
        """Batch `b` through every partition, as Spark routes it; its output rows."""
        cfg = self.cfg()
        lay = cfg.layout
        parts = split_by_partition(table, self.key, lay.num_partitions, lay.key_groups)
        out = rows_of([run_partition_batch(cfg, p, b, t) for p, t in enumerate(parts)])
        # the checkpoints this batch started land before the next batch: the policy skips
        # a checkpoint while one is in flight, so which batches are checkpointed (what the
        # tests lose, compose and fall back to) would otherwise depend on the machine's load
        rt = _RUNTIMES.get(cfg.sid)
        for part in rt.parts.values() if rt is not None else ():
            if part.ckpt is not None:
                part.ckpt.wait(HANG_S)
        return out

    def stop(self) -> None:
        """The query stops: its in-flight checkpoints land, its partitions are let go."""
        rt = _RUNTIMES.pop(self.cfg().sid, None)
        if rt is None:
            return
        for part in rt.parts.values():
            if part.ckpt is not None:
                part.ckpt.wait(HANG_S)
            part.slot.release()

    def lag(self, rng: np.random.Generator, p_lose: float = 0.6) -> int:
        """Lose the newest checkpoint of some partitions (each keeps one at least), so the
        sources are at different batches; returns how many were lost."""
        root = open_root(self.uri)
        lay = self.layout
        lost = 0
        for p in range(lay.num_partitions):
            cks = [c for c in list_checkpoints(root, lay.haunit(p)) if c.has_manifest]
            if len(cks) >= 2 and rng.random() < p_lose:
                shutil.rmtree(Path(self.uri) / cks[-1].directory)
                lost += 1
        return lost

    def newest_metas(self) -> list[dict[str, Any]]:
        """The `user_meta` of each partition's newest checkpoint."""
        root = open_root(self.uri)
        lay = self.layout
        out = []
        for p in range(lay.num_partitions):
            cks = [c for c in list_checkpoints(root, lay.haunit(p)) if c.has_manifest]
            out.append(read_manifest(root, cks[-1].name).user_meta)
        return out

    def durable(self) -> list[tuple[Any, ...]]:
        """The state rebuilt from the state URI alone (checkpoints plus input log)."""
        t, _ = read_durable_state(self.uri)
        return rows_of([t])

    def repartition(self, P: int, **kw: Any) -> rescale.RescaleResult:
        self.stop()
        return rescale.repartition(self.uri, P, **kw)


def tree_digest(path: str) -> dict[str, str]:
    """Every file under `path` with a digest of its bytes, but the per-batch metrics
    (``metrics/``): not state, and a finished query's executors may still be writing
    them asynchronously (a test comparing two digests would depend on that timing)."""
    out = {}
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            full = os.path.join(dirpath, f)
            rel = os.path.relpath(full, path)
            if rel.split(os.sep, 1)[0] != "metrics":
                out[rel] = hashlib.sha256(Path(full).read_bytes()).hexdigest()
    return out


# -- random repartition schedules (test_rescale, test_runtime_moves) -------------------------
def plan(rng: np.random.Generator, n_batches: int) -> list[tuple[str, int]]:
    """Batches interleaved with repartitions (1..K partitions, some back to back, some to
    the same count)."""
    steps: list[tuple[str, int]] = []
    b = 0
    while b < n_batches:
        n = int(rng.integers(1, 4))
        steps += [("batch", x) for x in range(b, min(b + n, n_batches))]
        b += n
        if b < n_batches:
            for _ in range(int(rng.integers(1, 3))):  # sometimes twice in a row
                steps.append(("repartition", int(rng.integers(1, K + 1))))
    return steps


def random_run(tmp_path: Path, seed: int, lazy_p: float, query: type["Query"] | None = None,
               lazy_seen: bool = True) -> None:
    """Batches of a random operator with random repartitions between them (`plan`), each
    batch's output and the final durable state checked against a run that never rescaled;
    `query`: the query class of the rescaled run (default `Query`); `lazy_seen`: also
    require the schedule to have committed a repartition lazily."""
    name = list(OPS)[seed % len(OPS)]
    make, key, join = OPS[name]
    rng = np.random.default_rng(100 + seed)
    n_batches = 9
    tables = make_batches(seed, n_batches, key, join)
    schema = tables[0].schema
    P0 = int(rng.integers(1, K + 1))
    ref = Query(tmp_path / "ref", make(), key, schema, P0, K, every=2)
    want = [ref.batch(b, t) for b, t in enumerate(tables)]
    ref.stop()
    q = (query or Query)(tmp_path / "run", make(), key, schema, P0, K,
                         every=int(rng.integers(1, 4)))
    got: dict[int, list[Any]] = {}
    history = [P0]
    for what, x in plan(rng, n_batches):
        if what == "batch":
            got[x] = q.batch(x, tables[x])
            assert got[x] == want[x], (name, x, history)
        else:
            before = q.layout
            force = bool(rng.random() < 0.5)
            if force or x != before.num_partitions:
                # the old generation is dead after this: lose some newest checkpoints
                # (a running query's own partitions never lose one behind its back)
                q.stop()
                q.lag(rng)
            lazy = bool(lazy_p and rng.random() < lazy_p)
            res = q.repartition(x, force=force, verify=bool(rng.random() < 0.5), lazy=lazy)
            after = q.layout
            if res.changed:
                assert (after.generation, after.num_partitions) == (before.generation + 1, x)
                assert res.haunits == tuple(after.haunit(t) for t in range(x))
            else:
                assert x == before.num_partitions and after == before
            assert not (Path(q.uri) / MARKER_FILE).exists()
            if res.changed and lazy:
                assert rescale.pending_sources(after) is not None
            history.append(x if not (res.changed and lazy) else f"{x}lazy")
    assert len(got) == n_batches
    q.stop()
    assert q.durable() == ref.durable(), (name, history)
    assert len(set(history)) > 1
    if lazy_p and lazy_seen:
        assert any(isinstance(h, str) for h in history), history
