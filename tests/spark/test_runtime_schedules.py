"""The runtime without Spark: 24 seeded random failure schedules, checked against an oracle.

A schedule drives `run_partition_batch` the way Spark drives tasks, with
failures at random batches: an exception mid-batch or after the batch (the
task is retried, possibly in "another worker": the process's handles are
dropped, as when the worker died, so the retry rolls back from the pool file),
the local state deleted (restore from the DFS checkpoint plus the input log), a
whole-batch replay after a "driver restart" (every partition sees the batch
again), and partitions moving between workers. Every schedule's outputs and
final states must equal the failure-free ones. Real Spark runs of the same
failures are in test_exactly_once.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from sguard.spark import (CheckpointConfig, Fault, FaultPlan, InjectedFault, RunningAggregate,
                          WindowAggregate, WindowJoin)
from sguard.spark.operators import SIDE_COLUMN, Operator
from sguard.spark.runtime import RuntimeConfig, _runtime, run_partition_batch
from ioservice import open_root
from sguard.spark.api import schema_to_json
from sguard.spark.groupstate import split_by_partition
from sguard.spark.placement import root_key
from sguard.spark.state import read_local_state
from sguard.statelayout import OperatorLayout, write_layout

P = 2
K = 8
BATCHES = 8


def _tables(seed: int, join: bool) -> list[list[pa.Table]]:
    """Per batch, per partition: the rows (by key group, as Spark routes them)."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(BATCHES):
        n = 400
        k = rng.integers(0, 60, n, dtype=np.int64)
        cols: dict[str, Any] = {"k": k, "v": rng.integers(-50, 50, n, dtype=np.int64),
                                "ts": b * 100 + rng.integers(-20, 100, n, dtype=np.int64)}
        if join:
            cols[SIDE_COLUMN] = rng.integers(0, 2, n, dtype=np.int8)
        t = pa.table(cols)
        out.append(split_by_partition(t, "k", P, K))
    return out


def _config(tmp: Path, op: Operator, schema: pa.Schema, plan: FaultPlan | None,
            every: int) -> RuntimeConfig:
    lay = OperatorLayout(operator=op.kind, name="op", schema={"params": op.params()},
                         num_partitions=P, key="k", key_groups=K, extra={"arrow_schema": schema_to_json(schema)})
    write_layout(open_root(str(tmp / "state")), lay)
    return RuntimeConfig(state_uri=str(tmp / "state"), state_key=root_key(open_root(str(tmp / "state"))),
                         layout=lay,
                         operator=op, key="k", input_schema=schema,
                         output_schema=op.output_schema(schema, "k"),
                         local_dir=str(tmp / "local"), capacity_bytes=1 << 26,
                         checkpoint=CheckpointConfig(every_n_batches=every), faults=plan)


def _run(cfg: RuntimeConfig, tables: list[list[pa.Table]], actions: dict[int, str]
         ) -> tuple[list[list[pa.Table]], list[pa.Table]]:
    rt = _runtime(cfg)
    outs: list[list[pa.Table]] = []
    for b, parts in enumerate(tables):
        act = actions.get(b)
        res: list[pa.Table] = []
        for p, t in enumerate(parts):
            for _attempt in range(4):  # spark.task.maxFailures
                try:
                    res.append(run_partition_batch(cfg, p, b, t))
                    break
                except InjectedFault:
                    part = rt.partition(p)
                    if act == "die":  # the worker died: a new one attaches the file
                        part._drop()
            else:
                raise AssertionError("task failed 4 times")
            if act == "move" and p == 0:  # the partition goes to another worker next time
                part = rt.partition(0)
                if part.ckpt is not None:
                    part.ckpt.wait()
                part._drop()
        if act == "replay":  # driver restart: the whole batch again, same rows
            res = [run_partition_batch(cfg, p, b, t) for p, t in enumerate(parts)]
        outs.append(res)
    for p in range(P):
        part = rt.partition(p)
        if part.ckpt is not None:
            part.ckpt.wait()
    for part in rt.parts.values():
        part.slot.release()
    rt.parts.clear()  # read back through the pool files, as another process would
    st, batches = read_local_state(cfg.state_uri, local_dir=cfg.local_dir)
    assert all(b == BATCHES - 1 for b in batches.values()), batches
    return outs, [st]


OPS: dict[str, Any] = {
    "running": (lambda: RunningAggregate(value="v"), False),
    "window": (lambda: WindowAggregate(time="ts", window=50, value="v", lateness=30), False),
    "join": (lambda: WindowJoin(time="ts", window=15, value="v", lateness=30), True),
}


@pytest.mark.parametrize("seed", range(24))
def test_random_schedule_equals_failure_free(tmp_path: Path, seed: int) -> None:
    name = ["running", "window", "join"][seed % 3]
    make, join = OPS[name]
    tables = _tables(seed, join)
    schema = tables[0][0].schema
    ref_out, ref_state = _run(_config(tmp_path / "ref", make(), schema, None, 3), tables, {})
    rng = np.random.default_rng(1000 + seed)
    faults, actions = [], {}
    (tmp_path / "faults").mkdir()
    for b in rng.choice(np.arange(1, BATCHES), 4, replace=False).tolist():
        kind = ["raise_mid", "raise_end", "delete", "replay", "move"][int(rng.integers(0, 5))]
        p = int(rng.integers(0, P))
        if kind.startswith("raise"):
            faults.append(Fault("raise", b, p, kind[6:]))
            actions[b] = "die" if rng.random() < 0.5 else "retry"
        elif kind == "delete":
            faults.append(Fault("delete_local", b, p, "start"))
        else:
            actions[b] = kind
    plan = FaultPlan(tuple(faults), str(tmp_path / "faults"))
    out, state = _run(_config(tmp_path / "run", make(), schema, plan, 2), tables, actions)
    assert len(list((tmp_path / "faults").glob("fired-*"))) == len(faults)
    for b in range(BATCHES):
        for p in range(P):
            assert out[b][p].equals(ref_out[b][p]), (name, b, p, faults, actions)
    assert state[0].equals(ref_state[0]), (name, faults, actions)
    assert state[0].num_rows > 0


def test_checkpoints_through_the_peace_coordinator(tmp_path: Path) -> None:
    """One option (`CheckpointConfig(scheduler="peace://...")`) sends every partition's
    checkpoints through a real coordinator process; the state equals an unscheduled run."""
    import dataclasses

    from sguard.scheduling import start_coordinator
    make, join = OPS["running"]
    tables = _tables(7, join)
    schema = tables[0][0].schema
    _, ref_state = _run(_config(tmp_path / "ref", make(), schema, None, 2), tables, {})
    with start_coordinator("paper") as coord:
        cfg = _config(tmp_path / "sched", make(), schema, None, 2)
        cfg = dataclasses.replace(cfg, checkpoint=CheckpointConfig(every_n_batches=2,
                                                                   scheduler=coord.uri))
        rt = _runtime(cfg)
        counters: list[dict[str, int]] = []
        for b, parts in enumerate(tables):
            for p, t in enumerate(parts):
                run_partition_batch(cfg, p, b, t)
        for p in range(P):
            part = rt.partition(p)
            assert part.ckpt is not None
            part.ckpt.wait()
            counters.append(dict(part.ckpt.mgr.schedule_counters))
        for part in rt.parts.values():
            part.slot.release()
        rt.parts.clear()
    assert sum(c["scheduled"] for c in counters) > 0, counters
    assert all(c["unscheduled_fallbacks"] == 0 for c in counters), counters
    st, _ = read_local_state(cfg.state_uri, local_dir=cfg.local_dir)
    assert st.equals(ref_state[0])
