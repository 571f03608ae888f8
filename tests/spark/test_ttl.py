"""State TTL (`sguard.spark.ttl`) without Spark: the runtime driven batch by batch, checked
against a plain-Python oracle, with failures mid-batch, retries, a driver-restart replay and
a restore from checkpoint plus input log. Processing time comes from a controlled clock
(`ttl._wall_clock_ms`) that jumps far ahead before every retry and replay: a run that used
the clock again instead of the recorded time would evict other keys. Spark runs are in
test_read_state.py."""
from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pytest

from ioservice import open_root
from sguard.keygroups import DEFAULT_KEY_GROUPS
from sguard.spark.groupstate import split_by_partition
from mmm import PageManager
from sguard.spark import CheckpointConfig, Fault, FaultPlan, InjectedFault, RunningAggregate
from sguard.spark import ttl as ttl_mod
from sguard.spark.api import schema_to_json
from sguard.spark.errors import BatchTimeMissingError, SchemaChangedError
from sguard.spark.operators import operator_from_params
from sguard.spark.placement import root_key
from sguard.spark.reader import read_partition_at
from sguard.spark.runtime import RuntimeConfig, _runtime, run_partition_batch
from sguard.spark.state import read_durable_state, read_local_state
from sguard.spark.ttl import TTL, TTLLayoutError, with_batch_time
from sguard.statelayout import OperatorLayout, write_layout

P = 2
BATCHES = 10
T0_MS = 1_700_000_000_000
STEP_MS = 1000
SPAN_MS = 2500  # a key absent from 3 batches in a row is evicted
JUMP_MS = 600_000


def _tables(seed: int) -> list[list[pa.Table]]:
    """Per batch, per partition. Each batch draws its keys from a random third of 0..47, so
    keys go quiet for a few batches and come back; event time advances 10 per batch."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(BATCHES):
        live = rng.choice(48, 16, replace=False)
        n = 120
        k = rng.choice(live, n).astype(np.int64)
        t = pa.table({"k": k, "v": rng.integers(-50, 50, n, dtype=np.int64),
                      "ts": (b * 10 + rng.integers(0, 10, n)).astype(np.int64)})
        out.append(split_by_partition(t, "k", P, DEFAULT_KEY_GROUPS))
    return out


def _oracle(tables: list[pa.Table], clocks: list[int] | None, span: int
            ) -> tuple[list[set[tuple[int, ...]]], list[dict[int, list[int]]], int]:
    """One partition: (output rows per batch, state after each batch, keys evicted)."""
    state: dict[int, list[int]] = {}
    last: dict[int, int] = {}
    outs, states, evicted = [], [], 0
    clock: int | None = None
    for b, t in enumerate(tables):
        if clocks is not None:
            clock = clocks[b]
        elif t.num_rows:
            m = int(pc_max(t["ts"]))
            clock = m if clock is None else max(clock, m)
        if clock is not None:
            for k in [k for k, s in last.items() if s + span <= clock]:
                del state[k], last[k]
                evicted += 1
        touched = []
        for k, v in zip(t["k"].to_pylist(), t["v"].to_pylist()):
            s = state.get(k)
            if s is None:
                state[k] = [1, v, v, v]
            else:
                s[0] += 1
                s[1] += v
                s[2] = min(s[2], v)
                s[3] = max(s[3], v)
            touched.append(k)
        for k in set(touched):
            assert clock is not None
            last[k] = clock
        outs.append({(k, *state[k]) for k in set(touched)})
        states.append({k: list(s) for k, s in state.items()})
    return outs, states, evicted


def _oracle_partition(tables: list[pa.Table], clocks: list[int] | None, span: int
                      ) -> tuple[list[set[tuple[int, ...]]], list[dict[int, list[int]]], int]:
    """`_oracle` for one partition: event time is per key group (`sguard.spark.groupstate`),
    so in event mode each key group is its own oracle; processing time is the batch's."""
    if clocks is not None:
        return _oracle(tables, clocks, span)
    kgs = sorted({int(g) for t in tables for g in t["_sguard_kg"].to_pylist()})
    outs: list[set[tuple[int, ...]]] = [set() for _ in tables]
    states: list[dict[int, list[int]]] = [{} for _ in tables]
    evicted = 0
    for g in kgs:
        mine = [t.filter(pa.compute.equal(t["_sguard_kg"], g)) for t in tables]
        o, st, ev = _oracle(mine, None, span)
        evicted += ev
        for b in range(len(tables)):
            outs[b] |= o[b]
            states[b].update(st[b])
    return outs, states, evicted


def pc_max(col: Any) -> int:
    return int(np.max(col.to_numpy()))


def _config(tmp: Path, op: RunningAggregate, schema: pa.Schema, plan: FaultPlan | None
            ) -> RuntimeConfig:
    uri = str(tmp / "state")
    lay = OperatorLayout(operator=op.kind, name="op", schema={"params": op.params()},
                         num_partitions=P, key="k", extra={"arrow_schema": schema_to_json(schema)})
    write_layout(open_root(uri), lay)
    return RuntimeConfig(state_uri=uri, state_key=root_key(open_root(uri)), layout=lay,
                         operator=op, key="k", input_schema=schema,
                         output_schema=op.output_schema(schema, "k"),
                         local_dir=str(tmp / "local"), capacity_bytes=1 << 26,
                         checkpoint=CheckpointConfig(every_n_batches=3), faults=plan)


class _Clock:
    def __init__(self) -> None:
        self.ms = T0_MS

    def __call__(self) -> int:
        return self.ms


def _drive(cfg: RuntimeConfig, tables: list[list[pa.Table]], clock: _Clock,
           replay: set[int]) -> list[list[set[tuple[int, ...]]]]:
    """Run every batch (retrying failed tasks in a 'new worker', replaying the batches in
    `replay` as after a driver restart); the clock jumps ahead before every retry/replay."""
    rt = _runtime(cfg)
    outs: list[list[set[tuple[int, ...]]]] = []
    for b, parts in enumerate(tables):
        res = []
        for p, t in enumerate(parts):
            clock.ms = T0_MS + b * STEP_MS
            for _attempt in range(4):
                try:
                    res.append({tuple(r.values()) for r in
                                run_partition_batch(cfg, p, b, t).to_pylist()})
                    break
                except InjectedFault:
                    rt.partition(p)._drop()  # the worker died: the retry attaches the file
                    clock.ms += JUMP_MS
            else:
                raise AssertionError("task failed 4 times")
        if b in replay:
            clock.ms += JUMP_MS
            again = [{tuple(r.values()) for r in run_partition_batch(cfg, p, b, t).to_pylist()}
                     for p, t in enumerate(parts)]
            assert again == res, f"batch {b} replayed with other output"
        outs.append(res)
    for p in range(P):
        part = rt.partition(p)
        if part.ckpt is not None:
            part.ckpt.wait()
    for part in rt.parts.values():
        part.slot.release()
    rt.parts.clear()
    return outs


def _rows(state: dict[int, list[int]]) -> list[tuple[int, ...]]:
    return sorted((k, *s) for k, s in state.items())


@pytest.mark.parametrize("mode", ["processing", "event"])
def test_ttl_matches_oracle_through_retries_replay_and_restore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    clock = _Clock()
    monkeypatch.setattr(ttl_mod, "_wall_clock_ms", clock)
    tables = _tables(5)
    schema = tables[0][0].schema
    if mode == "processing":
        ttl, span = TTL(dt.timedelta(milliseconds=SPAN_MS)), SPAN_MS
        clocks: list[int] | None = [T0_MS + b * STEP_MS for b in range(BATCHES)]
    else:
        ttl, span, clocks = TTL(25, mode="event", time="ts"), 25, None
    (tmp_path / "faults").mkdir()
    plan = FaultPlan((Fault("raise", 3, 0, "mid"), Fault("raise", 5, 1, "end"),
                      Fault("delete_local", 8, 0, "start"), Fault("raise", 8, 1, "mid")),
                     str(tmp_path / "faults"))
    cfg = _config(tmp_path / "run", RunningAggregate(value="v", ttl=ttl), schema, plan)
    outs = _drive(cfg, tables, clock, replay={4, 6})
    assert len(list((tmp_path / "faults").glob("fired-*"))) == 4
    total_evicted = 0
    want_final: list[tuple[int, ...]] = []
    want_at: dict[int, list[tuple[int, ...]]] = {6: [], 9: []}
    for p in range(P):
        o_out, o_states, ev = _oracle_partition([tables[b][p] for b in range(BATCHES)], clocks, span)
        total_evicted += ev
        for b in range(BATCHES):
            assert outs[b][p] == o_out[b], (mode, b, p)
        want_final += _rows(o_states[-1])
        for b in want_at:
            want_at[b] += [(*r, p) for r in _rows(o_states[b])]
    assert total_evicted > 20, "the test should evict keys"
    st, _ = read_local_state(cfg.state_uri, local_dir=cfg.local_dir)
    assert sorted(tuple(r.values()) for r in st.to_pylist()) == sorted(want_final)
    durable, _ = read_durable_state(cfg.state_uri)  # restore + replay with the recorded times
    assert sorted(tuple(r.values()) for r in durable.to_pylist()) == sorted(want_final)
    root = open_root(cfg.state_uri)
    for b, want in want_at.items():
        got = pa.concat_tables([read_partition_at(root, cfg.layout, p, b) for p in range(P)])
        assert sorted(tuple(r.values()) for r in got.to_pylist()) == sorted(want), b


def test_key_expiry_index_against_a_dict(tmp_path: Path) -> None:
    """Random batches at random clock steps (some expiring several batches' log records at
    once): the map's keys are exactly the oracle's live keys, and the log's invariants hold
    after each."""
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    op = RunningAggregate(value="v", ttl=TTL(1.6))  # 1600 ms
    st: Any = op.open(PageManager(4096, 1 << 26), schema, "k")
    rng = np.random.default_rng(3)
    now, last = 0, {}
    for b in range(120):
        now += int(rng.choice([0, 7, 50, 99, 100, 101, 400, 1600, 5000]))
        keys = rng.integers(0, 300, int(rng.integers(0, 60)))
        t = with_batch_time(pa.table({"k": keys, "v": keys}, schema=schema), now)
        st.apply(t, b)
        last = {k: s for k, s in last.items() if s + 1600 > now}
        last.update({int(k): now for k in keys})
        st.expiry._check(st.map)
        assert sorted(st.map.keys().tolist()) == sorted(last), b
        assert len(st.map) == st.n_keys() == len(last)


def test_ttl_arguments_and_layout() -> None:
    with pytest.raises(ValueError, match="> 0"):
        TTL(0)
    with pytest.raises(ValueError, match="mode must be one of"):
        TTL(5, mode="wall")
    with pytest.raises(ValueError, match="needs the event-time column"):
        TTL(5, mode="event")
    with pytest.raises(TypeError, match="ttl must be"):
        RunningAggregate(value="v", ttl="1h")
    op = RunningAggregate(value="v", ttl=TTL(dt.timedelta(hours=1), "event", "ts"))
    back = operator_from_params(op.kind, op.params())
    assert isinstance(back, RunningAggregate) and back.ttl == TTL(3600.0, "event", "ts")
    assert "ttl" not in RunningAggregate(value="v").params()  # old layouts stay equal
    assert op.params()["ttl_layout"] == 2
    with pytest.raises(TTLLayoutError, match="ttl_layout=1"):
        RunningAggregate(value="v", ttl=TTL(5), ttl_layout=1)
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    with pytest.raises(SchemaChangedError, match="event-time column 'ts'"):
        op.check_input(schema, "k")
    st = RunningAggregate(value="v", ttl=dt.timedelta(seconds=1)).open(
        PageManager(4096, 1 << 24), schema, "k")
    with pytest.raises(BatchTimeMissingError, match="recorded processing time"):
        st.apply(pa.table({"k": [1], "v": [1]}, schema=schema), 0)


def test_touch_log_holds_only_the_ttl_window() -> None:
    """Many batches within one TTL: the log keeps one record per batch of the last TTL
    (200 of 50 ms in 10 s) and one entry per key and batch of them."""
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    st: Any = RunningAggregate(value="v", ttl=TTL(10.0)).open(PageManager(4096, 1 << 26),
                                                             schema, "k")
    for b in range(400):  # a batch every 50 ms over 20 s, TTL 10 s
        t = with_batch_time(pa.table({"k": [b % 37, 1000 + b], "v": [1, 1]}, schema=schema),
                            b * 50)
        st.apply(t, b)
    assert len(st.expiry.batches) == 200
    assert len(st.expiry.fifo) == 400
    st.expiry._check(st.map)
    assert sorted(st.map.keys().tolist()) == sorted(set(range(37)) | set(range(1200, 1400)))


def test_changing_ttl_on_existing_state_is_refused(tmp_path: Path) -> None:
    from sguard.spark.api import _check_layout
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    old, new = (OperatorLayout(operator="running_aggregate", name="op",
                               schema={"input": {}, "params": op.params()}, num_partitions=2,
                               key="k", extra={"arrow_schema": schema_to_json(schema)})
                for op in (RunningAggregate(value="v"),
                           RunningAggregate(value="v", ttl=TTL(60))))
    with pytest.raises(SchemaChangedError, match="ttl"):
        _check_layout(old, new, "file:///x")
    with pytest.raises(SchemaChangedError, match="ttl"):
        _check_layout(new, old, "file:///x")
    # a state URI written with TTL layout 1 (parameters without ttl_layout) is refused
    layout1 = OperatorLayout(operator="running_aggregate", name="op",
                             schema={"input": {}, "params": {k: v for k, v in
                                                             new.schema["params"].items()
                                                             if k != "ttl_layout"}},
                             num_partitions=2, key="k",
                             extra={"arrow_schema": schema_to_json(schema)})
    with pytest.raises(SchemaChangedError, match="ttl_layout"):
        _check_layout(layout1, new, "file:///x")
