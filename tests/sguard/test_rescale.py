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
    print("lost", lost, "mixed", mixed, history)
