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

from sguard import rescale
from sguard.rescale import KILL_ENV, MARKER_FILE, RescaleError, repartition
from sguard.statelayout import read_layout
from tests.sguard.rescale_helpers import OPS, Query, make_batches, tree_digest

from ioservice import open_root

K = 8
ROOT = Path(__file__).resolve().parents[2]


# -- exactly-once across random repartitions ---------------------------------------------------
def _plan(rng: np.random.Generator, n_batches: int) -> list[tuple[str, int]]:
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


@pytest.mark.parametrize("seed", range(8))
def test_random_repartitions_equal_a_run_that_never_rescaled(tmp_path: Path, seed: int) -> None:
    """Batches through the runtime with repartitions P -> P' (1..K) between them, each
    after losing some partitions' newest checkpoints (sources at different batches, so
    the composed checkpoints carry per-key-group positions): every batch's output and the
    final durable state equal those of a run with one partition count throughout."""
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
    q = Query(tmp_path / "run", make(), key, schema, P0, K, every=int(rng.integers(1, 4)))
    got: dict[int, list[Any]] = {}
    history = [P0]
    lost = mixed = 0
    for what, x in _plan(rng, n_batches):
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
                lost += q.lag(rng)
            res = q.repartition(x, force=force, verify=bool(rng.random() < 0.5))
            after = q.layout
            if res.changed:
                assert (after.generation, after.num_partitions) == (before.generation + 1, x)
                assert res.haunits == tuple(after.haunit(t) for t in range(x))
            else:
                assert x == before.num_partitions and after == before
            assert not (Path(q.uri) / MARKER_FILE).exists()
            mixed += sum("kg_batches" in m for m in q.newest_metas())
            history.append(x)
    assert len(got) == n_batches
    q.stop()
    assert q.durable() == ref.durable(), (name, history)
    assert len(set(history)) > 1

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


def test_key_group_positions_travel_and_the_log_fills_the_gaps(tmp_path: Path) -> None:
    """Partition 0's newest checkpoint is lost, so its key groups are a batch behind
    partition 1's: each composed target records where each of its key groups is
    (``kg_batches`` when they differ, the smallest as ``batch_id``), and the query
    continued on them replays exactly what each key group missed."""
    q, tables = _made(tmp_path / "run", 2, n_batches=5)
    newest0 = [c for c in sorted((Path(q.uri) / "checkpoint").iterdir(),
                                 key=lambda d: int(d.name.rpartition("-")[2]))
               if ".g0.p0000-" in c.name][-1]
    shutil.rmtree(newest0)
    metas = q.newest_metas()
    lag, ahead = metas[0]["batch_id"], metas[1]["batch_id"]
    assert lag < ahead
    res = q.repartition(3)
    assert res.changed and res.pages > 0
    lay = q.layout
    new = q.newest_metas()
    for t, m in enumerate(new):
        assert m["key_groups"] == list(lay.key_group_range(t)) and m["partition"] == t
        pos = rescale.KeyGroupPositions.from_user_meta(m)
        assert m["batch_id"] == pos.min_batch_id
        kg = np.arange(*lay.key_group_range(t))
        want = np.where(kg < K // 2, lag, ahead)  # partition 0 of 2 held key groups 0..3
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
