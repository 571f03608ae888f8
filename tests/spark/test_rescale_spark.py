"""Scale out and in at start-up on real Spark (``local[2,4]``): a streaming query that is
stopped (or whose driver is SIGKILLed) and restarted with another ``num_partitions``
repartitions its state before it starts, moving whole key groups (`sguard.spark.rescaling`:
the driver commits the layout, each new partition's first task composes its first
checkpoint), and its sink rows and final state equal a run that never changed its
partition count (the numpy oracles), for the running aggregate and the tumbling-window
aggregate; a first task SIGKILLed while composing is retried (composing is idempotent)."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import sguard.spark as ss
from ioservice import list_checkpoints, open_root
from sguard.spark import inputlog
from sguard.spark.errors import InputLogGapError
from sguard.spark.checkpointing import latest_checkpoint_batch
from sguard.spark.state import read_durable_state
from sguard.statelayout import read_layout
from tests.spark.helpers import (StreamInput, every_batch, landed_metrics, last_batch, make_input,
                                 run_query, running_oracle, task_records)

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
W = 10  # window seconds; batch i of make_input holds event times in [10 i, 10 i + 10) s


def _staged(tmp: Path, batches: int, rows: int = 2000, keys: int = 300,
            seed: int = 5) -> tuple[StreamInput, Path]:
    """All batches generated into ``stage/``; the query reads ``live/``, where `_feed`
    moves them (a rename keeps the mtime the file source orders by)."""
    stage, live = tmp / "stage", tmp / "live"
    stage.mkdir()
    live.mkdir()
    gen = make_input(stage, batches, rows, keys, seed)
    return StreamInput(live, gen.tables), stage


def _feed(inp: StreamInput, stage: Path, upto: int) -> None:
    for i in range(upto):
        f = stage / f"part-{i:05d}.parquet"
        if f.exists():
            os.rename(f, inp.dir / f.name)


def window_oracle(tables: list[pa.Table]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """(sink rows, state rows) of WindowAggregate(time="ts", window=10 s, value="v") as
    ``(window_start_s, key, count, sum, min, max)``: every window but the last closes
    when the next batch's rows arrive (the data are in time order; nothing is late)."""
    agg: dict[tuple[int, int], list[int]] = {}
    for t in tables:
        ts = t["ts"].cast(pa.int64()).to_numpy() // 1_000_000
        for k, v, s in zip(t["k"].to_numpy().tolist(), t["v"].to_numpy().tolist(),
                           (ts // W * W).tolist()):
            a = agg.get((s, k))
            if a is None:
                agg[(s, k)] = [1, v, v, v]
            else:
                a[0] += 1
                a[1] += v
                a[2] = min(a[2], v)
                a[3] = max(a[3], v)
    last = (len(tables) - 1) * W
    rows = sorted((s, k, *a) for (s, k), a in agg.items())
    return [r for r in rows if r[0] < last], [r for r in rows if r[0] >= last]


def _window_rows(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Sink or state rows ``(start, end, k, count, sum, min, max)`` as the oracle's tuples."""
    return sorted((int(r[0].timestamp()), *r[2:]) for r in rows)


def test_running_aggregate_scaled_out_then_in(spark: Any, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """P = 2 for batches 0-2, stop; P = 3 for 3-4 (with its newest batches only in the
    input log), stop; P = 1 for 5-7. Each restart repartitions at start-up."""
    inp, stage = _staged(tmp_path, 8)
    op = ss.RunningAggregate(value="v")
    ck = ss.CheckpointConfig(every_n_batches=2)
    for upto, p in ((3, 2), (5, 3), (8, 1)):
        _feed(inp, stage, upto)
        with caplog.at_level(logging.WARNING, logger="sguard.spark.api"):
            rows, state, failures = run_query(spark, inp, tmp_path, op, partitions=p,
                                              checkpoint=ck)
        assert failures == 0
    want_rows, want_state = running_oracle(inp.tables)
    assert rows == want_rows
    assert state == want_state
    durable, _ = read_durable_state(str(tmp_path / "state"))  # checkpoints + input log
    assert [tuple(r.values()) for r in durable.to_pylist()] == want_state
    lines = [r.getMessage() for r in caplog.records if "repartitioned" in r.getMessage()]
    assert len(lines) == 2 and "from 2 to 3 partitions" in lines[0] \
        and "from 3 to 1 partitions" in lines[1], lines
    lay = read_layout(open_root(str(tmp_path / "state")))
    assert lay is not None and (lay.generation, lay.num_partitions) == (2, 1)
    # the new partitions restored from the repartitioned checkpoints, replaying the log
    recs = task_records(open_root(str(tmp_path / "state")), {(3, 0), (3, 1), (3, 2), (5, 0)})
    assert {recs[(3, q)]["recovery"] for q in range(3)} == {"restored"}
    assert recs[(5, 0)]["recovery"] == "restored"


def test_driver_sigkilled_then_scaled_out_and_in(spark: Any, tmp_path: Path) -> None:
    """The driver (P = 2) is SIGKILLed while batch 3 is half applied in partition 1 and
    wholly applied and logged in partition 0; the query restarts with P = 3, so Spark replays
    batch 3 under the new partitioning, and never checkpoints; then with P = 1, whose
    partition replays batches 0-4 from the log: batch 3 from the P = 3 run's files, not
    twice (the killed run's files of it are leftovers)."""
    inp, stage = _staged(tmp_path, 7, seed=9)
    _feed(inp, stage, 5)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "tests.spark.cluster_driver", "local[2,4]", str(inp.dir),
           str(tmp_path), "pause:3:1:mid", "pause:3:0:end"]
    with open(tmp_path / "driver1.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            paused = [tmp_path / "faults" / f"paused-b3-p{q}" for q in (0, 1)]
            while not all(f.exists() for f in paused):
                assert proc.poll() is None, (tmp_path / "driver1.log").read_text()[-3000:]
                time.sleep(0.1)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    root = open_root(str(tmp_path / "state"))
    killed = {e.name for e in root.list_dir(inputlog.batch_dir(3))}
    assert "g0-p0000-e1.arrow" in killed  # the killed run logged batch 3 (never committed)
    op = ss.RunningAggregate(value="v")
    run_query(spark, inp, tmp_path, op, partitions=3,
              checkpoint=ss.CheckpointConfig(every_n_batches=100))
    assert {e.name for e in root.list_dir(inputlog.batch_dir(3))} >= killed | {
        "g1-p0000-e1.arrow", "g1-p0001-e1.arrow", "g1-p0002-e1.arrow"}
    _feed(inp, stage, 7)
    rows, state, failures = run_query(spark, inp, tmp_path, op, partitions=1)
    want_rows, want_state = running_oracle(inp.tables)
    assert failures == 0
    assert rows == want_rows
    assert state == want_state
    recs = task_records(root, {(5, 0)})
    # restored from the repartitioned checkpoint: batches 0-4 replayed from the log, or fewer
    # when the start-up repartition aligned its sources to a later batch first
    assert recs[(5, 0)]["recovery"] == "restored" and 1 <= recs[(5, 0)]["replayed_batches"] <= 5
    durable, _ = read_durable_state(str(tmp_path / "state"))  # checkpoints + input log
    assert [tuple(r.values()) for r in durable.to_pylist()] == want_state


def test_window_aggregate_scaled_with_lagging_checkpoint(
        spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Tumbling windows over 8 key groups (each sees rows every batch, so every window but
    the last closes when the next batch arrives, whatever the partitioning: event time is
    per key group), P = 2 -> 3 at start-up, then 3 -> 4 offline (``sguard state
    repartition``). Before the first restart partition 0's newest checkpoint is lost, so
    its key groups are behind partition 1's: the new partitions replay each key group
    from where it is."""
    inp, stage = _staged(tmp_path, 10, seed=3)
    op = ss.WindowAggregate(time="ts", window=W, value="v")
    # keep=8: no checkpoint is retired here, so each new partition's composed checkpoint is
    # still there to read after its run (how many checkpoints a partition takes depends on
    # which worker ran each batch: with keep=2 a third one retired it)
    ck = ss.CheckpointConfig(every_n_batches=4, keep=8)
    root = open_root(str(tmp_path / "state"))
    for upto, p in ((6, 2), (8, 3), (10, 4)):
        _feed(inp, stage, upto)
        if p == 3:  # partition 0's newest checkpoint is lost
            hu = [f"window_aggregate.g0.p{q:04d}" for q in (0, 1)]
            # every checkpoint the finished query started has landed (which batches start
            # one depends on which worker ran each batch)
            landed_metrics(root, every_batch(last_batch(tmp_path), 2), checkpoints=True)
            # drop partition 0's newest checkpoints until it is behind partition 1 (which
            # batches were checkpointed depends on which worker ran each batch; with none
            # left, partition 0's key groups replay from the start of the log)
            while latest_checkpoint_batch(root, hu[0]) >= latest_checkpoint_batch(root, hu[1]):
                infos = [c for c in list_checkpoints(root, hu[0]) if c.has_manifest]
                assert infos, "partition 1 has no checkpoint"
                shutil.rmtree(tmp_path / "state" / infos[-1].directory)
            assert latest_checkpoint_batch(root, hu[0]) < latest_checkpoint_batch(root, hu[1])
        if p == 4:  # this time offline, with the one command; the query then just runs
            out = subprocess.run([sys.executable, "-m", "sguard", "state", "repartition",
                                  str(tmp_path / "state"), "--partitions", "4",
                                  "--master", "local[2]"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, out.stderr[-3000:]
            line, = out.stdout.strip().splitlines()
            assert "3 -> 4 partitions, generation 2; whole key groups moved" in line, line
            assert " 0 written" in line, line
        with caplog.at_level(logging.WARNING, logger="sguard.spark.api"):
            rows, state, failures = run_query(spark, inp, tmp_path, op, partitions=p,
                                              checkpoint=ck, key_groups=8)
        assert failures == 0
        if p == 3:  # the composed checkpoints carry partition 0's and 1's positions
            from ioservice import read_manifest
            metas = [read_manifest(root, c.name).user_meta for q in range(3)
                     for c in list_checkpoints(root, f"window_aggregate.g1.p{q:04d}")
                     if c.has_manifest]
            composed = [m for m in metas if m.get("rescaled_from") == 2]
            assert sorted(m["partition"] for m in composed) == [0, 1, 2], metas
            assert any("kg_batches" in m for m in composed), composed
    want_rows, want_state = window_oracle(inp.tables)
    assert _window_rows(rows) == want_rows
    assert _window_rows(state) == want_state
    lines = [r.getMessage() for r in caplog.records if "repartitioned" in r.getMessage()]
    assert len(lines) == 1 and "from 2 to 3 partitions" in lines[0], lines
    lay = read_layout(root)
    assert lay is not None and (lay.generation, lay.num_partitions, lay.key_groups) == (2, 4, 8)


_KILLED_STARTUP = """
import sys
from ioservice import open_root
from sguard.spark import local_session
from sguard.spark.placement import root_key
from sguard.spark.rescaling import repartition_at_startup
from sguard.statelayout import read_layout
root = open_root(sys.argv[1])
spark = local_session("local[1]", "killed-startup")
repartition_at_startup(spark, root, read_layout(root), 3, state_key=root_key(root),
                       local_dir=sys.argv[2])
"""


@pytest.mark.parametrize("point", ["marked", "before_commit"])
def test_killed_start_up_repartition_completes_on_rerun(spark: Any, tmp_path: Path,
                                                        point: str) -> None:
    """The driver is SIGKILLed inside the start-up repartition (a real process with its own
    Spark session, killed at `point`: after the marker, or right before the commit): the
    old partitioning is still the state, and the query
    started again with the same count completes the repartition and continues exactly
    once."""
    from sguard import rescale
    inp, stage = _staged(tmp_path, 4, rows=500, keys=50)
    op = ss.RunningAggregate(value="v")
    _feed(inp, stage, 2)
    run_query(spark, inp, tmp_path, op, partitions=2,
              checkpoint=ss.CheckpointConfig(every_n_batches=1))
    root = open_root(str(tmp_path / "state"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{rescale.KILL_ENV: point})
    out = subprocess.run([sys.executable, "-c", _KILLED_STARTUP, str(tmp_path / "state"),
                          str(tmp_path / "local")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    lay = read_layout(root)
    assert lay is not None and (lay.generation, lay.num_partitions) == (0, 2)
    assert root.exists(rescale.MARKER_FILE)
    if point == "before_commit":  # nothing composed: each new partition's first task does
        assert not [h for h in __import__("ioservice").list_haunits(root) if ".g1." in h]
    _feed(inp, stage, 4)
    rows, state, _ = run_query(spark, inp, tmp_path, op, partitions=3)
    assert (rows, state) == running_oracle(inp.tables)
    lay = read_layout(root)
    assert lay is not None and (lay.generation, lay.num_partitions) == (1, 3)
    assert not root.exists(rescale.MARKER_FILE)


@pytest.mark.parametrize("point", ["compose", "composed"])
def test_first_task_killed_while_composing_is_retried_exactly_once(spark: Any, tmp_path: Path,
                                                                   point: str) -> None:
    """The query is restarted 2 -> 3: the start-up repartition only commits the layout (no
    Spark job, nothing composed), and each new partition's first task composes its first
    checkpoint. That task's Python worker is SIGKILLed in its first attempt, before or
    after writing the composed manifest: Spark retries the task, the retry composes again
    (or finds the checkpoint), and the output and state equal the oracle."""
    from ioservice import read_manifest
    from sguard import rescale
    inp, stage = _staged(tmp_path, 5, rows=800, keys=120)
    op = ss.RunningAggregate(value="v")
    _feed(inp, stage, 3)
    run_query(spark, inp, tmp_path, op, partitions=2, key_groups=16,
              checkpoint=ss.CheckpointConfig(every_n_batches=1))
    sc = spark.sparkContext
    _feed(inp, stage, 5)
    sc.environment[rescale.KILL_ENV] = f"{point}@first-attempt"
    try:
        rows, state, failures = run_query(spark, inp, tmp_path, op, partitions=3)
    finally:
        del sc.environment[rescale.KILL_ENV]
    assert failures == 0  # the tasks were retried, the query never failed
    assert (rows, state) == running_oracle(inp.tables)
    root = open_root(str(tmp_path / "state"))
    lay = read_layout(root)
    assert lay is not None and (lay.generation, lay.num_partitions) == (1, 3)
    assert rescale.pending_sources(lay) is not None and rescale.uncomposed(root) == []
    recs = task_records(root, {(3, q) for q in range(3)})
    for q in range(3):
        first = [c for c in list_checkpoints(root, lay.haunit(q)) if c.has_manifest][0]
        assert read_manifest(root, first.name).composed  # composed by the query's task
        # its first attempt claimed epoch 1 and died; the retry claimed epoch 2
        assert recs[(3, q)]["recovery"] == "restored"
        assert "(epoch 2," in recs[(3, q)]["reason"], recs[(3, q)]["reason"]
    durable, _ = read_durable_state(str(tmp_path / "state"))
    assert [tuple(r.values()) for r in durable.to_pylist()] == state


@pytest.mark.parametrize("point", ["compose", "composed"])
def test_repartition_job_survives_sigkilled_task_workers(spark: Any, tmp_path: Path,
                                                         point: str) -> None:
    """The offline repartition job (``sguard state repartition``'s, `repartition_job`, with
    the query stopped): its tasks are SIGKILLed (their Python worker process) in their
    first attempt, before or after writing their composed checkpoint: Spark retries them,
    the retry composes (or finds its checkpoint), and the query continues exactly once on
    the new partitioning."""
    from sguard import rescale
    from sguard.spark.rescaling import repartition_job
    inp, stage = _staged(tmp_path, 5, rows=800, keys=120)
    op = ss.RunningAggregate(value="v")
    _feed(inp, stage, 3)
    run_query(spark, inp, tmp_path, op, partitions=2, key_groups=16,
              checkpoint=ss.CheckpointConfig(every_n_batches=1))
    root = open_root(str(tmp_path / "state"))
    sc = spark.sparkContext
    sc.setJobGroup(f"rescale-kill-{point}", "repartition with killed task workers")
    sc.environment[rescale.KILL_ENV] = f"{point}@first-attempt"
    try:
        res = repartition_job(spark, root, 3)
    finally:
        del sc.environment[rescale.KILL_ENV]
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert res.changed and res.pages > 0
    tracker = sc.statusTracker()
    failed = 0
    for job in tracker.getJobIdsForGroup(f"rescale-kill-{point}"):
        info = tracker.getJobInfo(job)
        for sid in (info.stageIds if info is not None else []):
            st = tracker.getStageInfo(sid)
            if st is not None and st.name and "collect" in st.name:
                failed += st.numFailedTasks
    assert failed >= 3, failed  # each of the 3 targets' first attempt died
    lay = read_layout(root)
    assert lay is not None and (lay.generation, lay.num_partitions) == (1, 3)
    assert rescale.pending_sources(lay) is None  # composed before the commit
    assert not root.exists(rescale.MARKER_FILE)
    for q in range(3):  # one composed checkpoint per target, whichever attempt wrote it
        assert len([c for c in list_checkpoints(root, lay.haunit(q)) if c.has_manifest]) == 1
    _feed(inp, stage, 5)
    rows, state, failures = run_query(spark, inp, tmp_path, op, partitions=3)
    assert failures == 0
    assert (rows, state) == running_oracle(inp.tables)


def test_uncomposed_partitions_are_read_through_their_sources(spark: Any, tmp_path: Path
                                                              ) -> None:
    """The query is stopped right after a start-up repartition 2 -> 3 committed (before
    any batch ran): `read_state` and `read_durable_state` read every partition through its
    sources; a restart with the same count sweeps nothing; the query then continues
    exactly once."""
    from sguard import rescale
    from sguard.spark.api import _repartition, _sweep
    from sguard.spark.reader import read_state
    inp, stage = _staged(tmp_path, 5, rows=600, keys=90, seed=13)
    op = ss.RunningAggregate(value="v")
    _feed(inp, stage, 3)
    _, before, _ = run_query(spark, inp, tmp_path, op, partitions=2,
                             checkpoint=ss.CheckpointConfig(every_n_batches=1))
    root = open_root(str(tmp_path / "state"))
    old = read_layout(root)
    assert old is not None
    _repartition(spark, root, old, 3, local_dir=str(tmp_path / "local"))  # what stateful does
    assert rescale.uncomposed(root) == [0, 1, 2]
    olds = [h for h in __import__("ioservice").list_haunits(root) if ".g0." in h]
    n_old = sum(len(list_checkpoints(root, h)) for h in olds)
    durable, _ = read_durable_state(str(tmp_path / "state"))
    assert sorted(tuple(r.values()) for r in durable.to_pylist()) == before
    got = read_state(spark, str(tmp_path / "state"), 2)
    assert sorted(tuple(r)[:-1] for r in got.collect()) == before
    _sweep(root)  # what `stateful` runs when restarted with the same count
    assert sum(len(list_checkpoints(root, h)) for h in olds) == n_old  # nothing swept
    _feed(inp, stage, 5)
    rows, state, failures = run_query(spark, inp, tmp_path, op, partitions=3)
    assert failures == 0
    assert (rows, state) == running_oracle(inp.tables)
    assert rescale.uncomposed(root) == []


def test_read_input_takes_one_generation(tmp_path: Path) -> None:
    """A batch logged by two generations (the older never committed it) is read from the
    newest generation not above the reader's, filtered to the reader's key groups."""
    from sguard.keygroups import owner_of
    from sguard.spark.groupstate import add_key_groups, key_group_column
    root = open_root(str(tmp_path))
    K = 16
    keys = np.arange(400, dtype=np.int64)
    t = add_key_groups(pa.table({"k": keys, "v": keys * 2}), "k", K)
    kg = key_group_column(t).astype(np.int64)
    for g, P in ((0, 2), (1, 3)):
        own = owner_of(kg, P, K)
        for p in range(P):
            inputlog.write_input(root, t.filter(pa.array(own == p)), 7, g, p, P, "k")
    got = inputlog.read_input(root, 7, 2, 0, 1, "k", key_groups=K)  # generation 2 of 1
    assert sorted(got.column("k").to_pylist()) == keys.tolist()
    got = inputlog.read_input(root, 7, 2, 1, 2, "k", key_groups=K)  # generation 2 of 2
    want = keys[owner_of(kg, 2, K) == 1]
    assert sorted(got.column("k").to_pylist()) == sorted(want.tolist())
    got = inputlog.read_input(root, 7, 0, 1, 2, "k", key_groups=K)  # its own file
    assert sorted(got.column("k").to_pylist()) == sorted(want.tolist())
    # its own file gone (trimmed) while the other partitions' of its generation remain:
    # a gap, never their rows filtered to its key groups (none: an empty batch)
    for f in inputlog.own_files(root, 1, 2).get(7, []):
        root.delete_file(f.relpath)
    with pytest.raises(InputLogGapError, match="has no file of partition 2 .generation 1."):
        inputlog.read_input(root, 7, 1, 2, 3, "k", key_groups=K)
    got = inputlog.read_input(root, 7, 1, 1, 3, "k", key_groups=K)  # the others still read
    assert sorted(got.column("k").to_pylist()) == sorted(keys[owner_of(kg, 3, K) == 1].tolist())


def test_state_repartition_to_the_same_count_composes_the_uncomposed_as_a_spark_job(
        tmp_path: Path) -> None:
    """A start-up repartition 2 -> 3 committed lazily (`sguard.rescale.repartition` with
    ``lazy=True``), of whose partitions only 1 was composed by its first task:
    ``sguard state repartition --partitions 3`` composes 0 and 2 as a Spark job, one task
    each, never on the driver: with the compose point SIGKILLing its process, the command
    itself lives and reports the failed job (exit 1, nothing changed: a ``local[1]`` task
    is not retried); rerun, it composes them, and the state and the continued query equal
    a run that never rescaled."""
    from ioservice import read_manifest
    from sguard import rescale
    from tests.sguard.rescale_helpers import OPS, Query, make_batches, tree_digest
    make, key, join = OPS["running_int"]
    tables = make_batches(5, 6, key, join)
    ref = Query(tmp_path / "ref", make(), key, tables[0].schema, 2, 8, every=1)
    q = Query(tmp_path / "s", make(), key, tables[0].schema, 2, 8, every=1)
    for b in range(4):
        assert q.batch(b, tables[b]) == ref.batch(b, tables[b])
    q.stop()
    rescale.repartition(q.uri, 3, lazy=True)
    root = open_root(q.uri)
    assert rescale.compose_if_pending(root, q.layout, 1)  # partition 1's first task ran
    assert rescale.uncomposed(q.uri) == [0, 2]
    before = tree_digest(q.uri)

    def cli(**env: str) -> subprocess.CompletedProcess[str]:
        e = {k: v for k, v in os.environ.items() if k != rescale.KILL_ENV}
        return subprocess.run([sys.executable, "-m", "sguard", "state", "repartition", q.uri,
                               "--partitions", "3", "--master", "local[1]"], cwd=ROOT,
                              env={**e, "PYTHONPATH": str(ROOT), **env},
                              capture_output=True, text=True, timeout=600)
    out = cli(**{rescale.KILL_ENV: "compose"})
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr[-3000:])
    assert "the repartition job failed" in out.stderr, out.stderr[-3000:]
    assert rescale.uncomposed(q.uri) == [0, 2] and tree_digest(q.uri) == before
    out = cli()
    assert out.returncode == 0, out.stderr[-3000:]
    line, = out.stdout.strip().splitlines()
    assert "already 3 partition(s) (generation 1); composed the first checkpoint of 2 " \
           "partition(s)" in line and "(0, 2) as a Spark job" in line, line
    assert rescale.uncomposed(q.uri) == []
    lay = q.layout
    assert (lay.generation, lay.num_partitions) == (1, 3)
    for t in range(3):
        cks = [c for c in list_checkpoints(root, lay.haunit(t)) if c.has_manifest]
        assert len(cks) == 1 and read_manifest(root, cks[0].name).composed
    assert q.durable() == ref.durable()
    for b in range(4, 6):
        assert q.batch(b, tables[b]) == ref.batch(b, tables[b])
    q.stop()
    ref.stop()
    assert q.durable() == ref.durable()
