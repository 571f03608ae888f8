"""Typed and composite keys on real Spark (``local[2,4]``), with failures.

Each shipped operator runs a streaming query keyed on strings, composite keys with
nulls, dates, booleans and timestamps, while a Python worker is SIGKILLed mid-batch, a
task raises after its batch (Spark retries it) and a partition's local state is deleted
(restore from the DFS checkpoint plus the input log). The sink's rows and the final
state must equal the oracle: a plain-Python groupBy for the running aggregate, the
runtime driven without Spark and without failures for the others (itself checked
against failure-free runs and the Python groupBy in test_keys.py). Every logged row sits
in the partition that owns its key group (`sguard.keygroups`).
"""
from __future__ import annotations

import datetime as dt
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sguard.spark as ss
from ioservice import open_root
from sguard.keygroups import DEFAULT_KEY_GROUPS, key_group_of, owner_of
from sguard.spark.columns import KG_COLUMN
from sguard.spark.groupstate import split_by_partition
from sguard.spark import inputlog
from sguard.spark.operators import SIDE_COLUMN
from sguard.spark.state import read_durable_state, read_local_state
from tests.spark.helpers import HANG_S
from tests.spark.test_keys import _key_columns

pytestmark = pytest.mark.timeout(900)

P = 2
BATCHES = 4
SCHEMA = ("user string, tenant string, blob binary, flag boolean, day date, "
          "at timestamp, n int, v long, ts timestamp, side byte")


@pytest.fixture(scope="module")
def typed_input(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[pa.Table]]:
    """4 parquet files (one micro-batch each) of 800 rows with typed, nullable keys."""
    d = tmp_path_factory.mktemp("typed")
    tables = []
    for i in range(BATCHES):
        rng = np.random.default_rng([21, i])
        n = 800
        cols = _key_columns(rng, n)
        cols["tenant"] = cols["tenant"].cast(pa.string())
        ts = (i * 10_000_000 + rng.integers(0, 10_000_000, n)).astype("datetime64[us]")
        t = pa.table({**cols, "v": rng.integers(-500, 500, n, dtype=np.int64),
                      "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
                      "side": pa.array(rng.integers(0, 2, n, dtype=np.int8))})
        f = d / f"part-{i:05d}.parquet"
        pq.write_table(t, f)
        os.utime(f, (1_700_000_000 + i, 1_700_000_000 + i))
        tables.append(t)
    return d, tables


def _query(spark: Any, d: Path, work: Path, key: list[str], op: Any, faults: Any,
           partitions: int = P) -> pa.Table:
    """Run to the end of the input, restarting after a failed query; the sink's rows."""
    for attempt in range(4):
        df = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(d))
              .withColumnRenamed("side", SIDE_COLUMN))
        out = ss.stateful(df, key, op, str(work / "state"), partitions, faults=faults, key_groups=DEFAULT_KEY_GROUPS,
                          local_dir=str(work / "local"),
                          checkpoint=ss.CheckpointConfig(every_n_batches=2))
        q = (out.writeStream.format("parquet").option("path", str(work / "out"))
             .option("checkpointLocation", str(work / "ckpt")).start())
        try:
            q.processAllAvailable()
            q.stop()
            break
        except Exception:
            q.stop()
            if attempt == 3:
                raise
            time.sleep(0.2)
    return pq.read_table(str(work / "out"))


def _canon(t: pa.Table, schema: pa.Schema) -> list[dict[str, Any]]:
    t = t.select(schema.names).cast(pa.schema([f.with_nullable(True) for f in schema]))
    return t.sort_by([(c, "ascending") for c in t.column_names]).to_pylist()


def _without_spark(tmp: Path, tables: list[pa.Table], key: list[str], op: Any
                   ) -> tuple[pa.Table, pa.Table]:
    """The same batches through the runtime alone, no failures: (all output, state)."""
    from tests.spark.test_keys import _config, _run
    tables = [t.rename_columns([SIDE_COLUMN if c == "side" else c for c in t.column_names])
              for t in tables]
    parts = [split_by_partition(t, key, P, DEFAULT_KEY_GROUPS) for t in tables]
    schema = pa.schema([f.with_nullable(True) for f in tables[0].schema])
    kg = pa.field(KG_COLUMN, pa.int32(), nullable=False)
    parts = [[x.cast(schema.append(kg)) for x in ps] for ps in parts]
    outs = _run(_config(tmp, op, schema, key, P, None, 2), parts, {})
    state, _ = read_local_state(str(tmp / "state"), local_dir=str(tmp / "local"))
    return pa.concat_tables([o for ps in outs for o in ps]), state


def _running_oracle(tables: list[pa.Table], key: list[str]
                    ) -> tuple[list[tuple[Any, ...]], dict[tuple[Any, ...], list[int]]]:
    state: dict[tuple[Any, ...], list[int]] = {}
    out = []
    for t in tables:
        touched = {}
        for *k, v in zip(*(t.column(c).to_pylist() for c in key), t.column("v").to_pylist()):
            s = state.setdefault(tuple(k), [0, 0, v, v])
            s[0] += 1
            s[1] += v
            s[2], s[3] = min(s[2], v), max(s[3], v)
            touched[tuple(k)] = True
        out += [(*k, *state[k]) for k in touched]
    return out, state


def _check_placement(work: Path, key: list[str]) -> int:
    """Every logged row carries the key group `key_group_of` gives its key and is in the
    partition that owns it; rows checked."""
    root = open_root(str(work / "state"), create=False)
    n = 0
    for p in range(P):
        for b, files in inputlog.own_files(root, 0, p).items():  # every epoch's file
            for f in files:
                t = inputlog._read(root, f.relpath)
                kg = t.column(KG_COLUMN).to_numpy()
                assert (key_group_of(t.select(key), DEFAULT_KEY_GROUPS) == kg).all(), f.relpath
                assert (owner_of(kg, P, DEFAULT_KEY_GROUPS) == p).all(), (b, p, f.relpath)
                n += t.num_rows
    return n


def _faults(tmp: Path) -> ss.FaultPlan:
    (tmp / "faults").mkdir()
    return ss.FaultPlan((ss.Fault("kill", 1, 0, "mid"), ss.Fault("raise", 2, 1, "end"),
                         ss.Fault("delete_local", 3, 0, "start"),
                         ss.Fault("delete_local", 3, 1, "start")), str(tmp / "faults"))


def _fired(plan: ss.FaultPlan) -> int:
    return len([f for f in os.listdir(plan.fault_dir) if f.startswith("fired-")])


def test_running_aggregate_on_a_composite_string_key_with_nulls(
        spark: Any, typed_input: Any, tmp_path: Path) -> None:
    """key=["tenant", "user"] (nulls in both): sink rows and state equal the Python groupBy."""
    d, tables = typed_input
    key = ["tenant", "user"]
    plan = _faults(tmp_path)
    sink = _query(spark, d, tmp_path, key, ss.RunningAggregate(value="v"), plan)
    assert _fired(plan) == 4
    want_rows, want_state = _running_oracle(tables, key)
    got = sorted((tuple(r.values()) for r in sink.to_pylist()), key=repr)
    assert got == sorted(want_rows, key=repr)
    assert any(r[0] is None for r in want_rows) and any(r[1] is None for r in want_rows)
    st, _ = read_local_state(str(tmp_path / "state"), local_dir=str(tmp_path / "local"),
                             lock_timeout_s=HANG_S)  # waits for checkpoints in flight
    assert st.schema.names[:2] == key and st.schema.field("user").type == pa.string()
    assert {tuple(r[:2]): list(r[2:]) for r in (tuple(x.values()) for x in st.to_pylist())} \
        == want_state
    durable, _ = read_durable_state(str(tmp_path / "state"))
    assert durable.equals(st)
    assert _check_placement(tmp_path, key) > 0


@pytest.mark.parametrize("key,op", [
    (["day", "flag"], lambda: ss.WindowAggregate(time="ts", window=dt.timedelta(seconds=5),
                                                 value="v", lateness=2)),
    (["user", "at"], lambda: ss.WindowJoin(time="ts", window=dt.timedelta(seconds=1),
                                           value="v", lateness=3)),
    (["blob"], lambda: ss.RunningAggregate(value="v")),
])
def test_window_operators_on_date_boolean_timestamp_and_binary_keys(
        spark: Any, typed_input: Any, tmp_path: Path, key: list[str], op: Any) -> None:
    """Window aggregate on (date, boolean), join on (string, timestamp), running on binary:
    with failures, the sink and the state equal the runtime's failure-free run."""
    d, tables = typed_input
    plan = _faults(tmp_path)
    sink = _query(spark, d, tmp_path / "spark", key, op(), plan)
    assert _fired(plan) == 4
    want_out, want_state = _without_spark(tmp_path / "plain", tables, key, op())
    assert want_out.num_rows > 0
    assert _canon(sink, want_out.schema) == _canon(want_out, want_out.schema)
    st, _ = read_local_state(str(tmp_path / "spark" / "state"),
                             local_dir=str(tmp_path / "spark" / "local"), lock_timeout_s=HANG_S)
    assert st.equals(want_state)
    assert _check_placement(tmp_path / "spark", key) > 0


@pytest.mark.parametrize("key,op", [
    (["tenant", "user"], lambda: ss.RunningAggregate(value="v")),
    (["user"], lambda: ss.WindowAggregate(time="ts", window=dt.timedelta(seconds=5),
                                          value="v", lateness=2)),
])
def test_string_keyed_state_scaled_out_then_in_at_start_up(
        spark: Any, typed_input: Any, tmp_path: Path, key: list[str], op: Any) -> None:
    """P = 2 for batches 0-1, stop; P = 3 for batch 2, stop; P = 1 for batch 3: each
    restart repartitions the string-keyed state (and its key dictionaries) on the driver;
    the sink and the state equal the runtime's failure-free 2-partition run."""
    d, tables = typed_input
    live = tmp_path / "live"
    live.mkdir()
    for upto, p in ((2, 2), (3, 3), (4, 1)):
        for i in range(upto):
            f = d / f"part-{i:05d}.parquet"
            if not (live / f.name).exists():
                os.link(f, live / f.name)
        sink = _query(spark, live, tmp_path / "spark", key, op(), None, partitions=p)
    want_out, want_state = _without_spark(tmp_path / "plain", tables, key, op())
    assert _canon(sink, want_out.schema) == _canon(want_out, want_out.schema)
    # the last run's checkpoint in flight lands first (its retention and log trimming would
    # race the read): a worker holds a partition's lock until then, and this takes them
    read_local_state(str(tmp_path / "spark" / "state"), local_dir=str(tmp_path / "spark" / "local"),
                     lock_timeout_s=HANG_S)
    durable, _ = read_durable_state(str(tmp_path / "spark" / "state"))
    assert durable.equals(want_state)
    from sguard.statelayout import read_layout
    lay = read_layout(open_root(str(tmp_path / "spark" / "state"), create=False))
    assert lay is not None and (lay.generation, lay.num_partitions, lay.key) == (2, 1, key)
    assert lay.extra["keys"]["columns"] == key
