"""Keys of every type (`sguard.spark.keys`) through the runtime without Spark: the byte
encoding round trip, every shipped operator under failure schedules (outputs and state
equal to a failure-free run and to a plain-Python oracle), restore from a checkpoint plus
the input log, and a repartition of string-keyed state. The same on real Spark is in
test_keys_spark.py."""
from __future__ import annotations

import datetime as dt
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from ioservice import open_root
from mmm import PageManager
from sguard import rescale
from sguard.keygroups import DEFAULT_KEY_GROUPS
from sguard.spark.groupstate import split_by_partition
from sguard.spark import (CheckpointConfig, Fault, FaultPlan, InjectedFault, RunningAggregate,
                          WindowAggregate, WindowJoin)
from sguard.spark.api import schema_to_json
from sguard.spark.errors import SchemaChangedError, UnsupportedKeyTypeError
from sguard.spark.keys import KeyIndex, NullKeyError, decode, encode, key_spec
from sguard.spark.operators import SIDE_COLUMN, Operator
from sguard.spark.placement import root_key
from sguard.spark.runtime import RuntimeConfig, _runtime, run_partition_batch
from sguard.spark.state import read_durable_state, read_local_state
from sguard.statelayout import OperatorLayout, read_layout, write_layout

BATCHES = 6
UTC = dt.timezone.utc


def _key_columns(rng: np.random.Generator, n: int) -> dict[str, pa.Array]:
    """Key columns of every type, drawn from small pools (keys repeat), ~10% nulls."""
    def pick(pool: list[Any], typ: pa.DataType) -> pa.Array:
        vals = [pool[i] for i in rng.integers(0, len(pool), n)]
        vals = [None if rng.random() < 0.1 else v for v in vals]
        return pa.array(vals, typ)
    return {
        "user": pick([f"user-{i}" for i in range(40)] + ["", "h\u00e9llo", "\u4e2d\u6587"],
                     pa.string()),
        "tenant": pick(["acme", "globex", "initech"], pa.large_string()),
        "blob": pick([bytes([i, 0, 255 - i]) for i in range(9)] + [b""], pa.binary()),
        "flag": pick([True, False], pa.bool_()),
        "day": pick([dt.date(2024, 1, 1) + dt.timedelta(days=i) for i in range(7)],
                    pa.date32()),
        "at": pick([dt.datetime(2024, 1, 1, tzinfo=UTC) + dt.timedelta(seconds=i)
                    for i in range(11)], pa.timestamp("us", tz="UTC")),
        "n": pick(list(range(-5, 5)), pa.int32()),
    }


def test_encoding_round_trips_every_key_type_with_nulls() -> None:
    """decode(encode(key)) is the key again, for single and composite keys with nulls."""
    cols = _key_columns(np.random.default_rng(0), 500)
    t = pa.table(cols)
    for key in (["user"], ["blob"], ["flag"], ["day"], ["at"], ["n"], ["tenant", "user"],
                ["at", "blob", "flag", "n", "day", "user"]):
        spec = key_spec(t.schema, key)
        back = decode(spec, *encode(spec, t))
        for c, a in zip(key, back):
            assert a.equals(t.column(c).combine_chunks()), (key, c)


def test_equal_keys_get_equal_ids_and_nulls_are_one_group() -> None:
    """Ids are equal exactly when the (composite) keys are, nulls included."""
    t = pa.table(_key_columns(np.random.default_rng(1), 2000))
    pm = PageManager(1 << 12, 1 << 26)
    for key in (["user"], ["tenant", "user"], ["flag", "day"]):
        ki = KeyIndex(pm, key_spec(t.schema, key))
        ids = ki.ids(t)
        want: dict[tuple[Any, ...], int] = {}
        rows = list(zip(*(t.column(c).to_pylist() for c in key)))
        for r, i in zip(rows, ids.tolist()):
            assert want.setdefault(r, i) == i, (key, r)
        assert len(set(want.values())) == len(want)
        assert ki.table(ids).equals(t.select(key))
        np.testing.assert_array_equal(ki.lookup(t), ids)


def test_bad_keys_are_refused_naming_the_column() -> None:
    """Floats, nested types, missing columns and direct integer keys with nulls raise."""
    s = pa.schema([("x", pa.float64()), ("l", pa.list_(pa.int32())), ("k", pa.int64())])
    with pytest.raises(UnsupportedKeyTypeError, match="'x'.*double"):
        key_spec(s, "x")
    with pytest.raises(UnsupportedKeyTypeError, match="'l'"):
        key_spec(s, ["k", "l"])
    with pytest.raises(SchemaChangedError, match="'nope'"):
        key_spec(s, ["k", "nope"])
    with pytest.raises(TypeError, match="key must be"):
        key_spec(s, [])
    ki = KeyIndex(PageManager(1 << 12, 1 << 22), key_spec(s, "k"))
    with pytest.raises(NullKeyError, match=r"key=\['k'\]"):
        ki.ids(pa.table({"k": pa.array([1, None], pa.int64())}))


# -- the runtime under failure schedules ---------------------------------------------------------
def _batches(seed: int, key: list[str], P: int, join: bool) -> list[list[pa.Table]]:
    """Per batch, per partition: rows split by Spark's partitioner over the key columns."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(BATCHES):
        n = 300
        cols: dict[str, Any] = dict(_key_columns(rng, n))
        cols = {c: cols[c] for c in key}
        cols["v"] = rng.integers(-50, 50, n, dtype=np.int64)
        cols["ts"] = b * 100 + rng.integers(-20, 100, n, dtype=np.int64)
        if join:
            cols[SIDE_COLUMN] = rng.integers(0, 2, n, dtype=np.int8)
        t = pa.table(cols)
        out.append(split_by_partition(t, key, P, DEFAULT_KEY_GROUPS))
    return out


def _config(tmp: Path, op: Operator, schema: pa.Schema, key: list[str], P: int,
            plan: FaultPlan | None, every: int) -> RuntimeConfig:
    root = open_root(str(tmp / "state"))
    lay = read_layout(root)
    if lay is None:
        lay = OperatorLayout(operator=op.kind, name="op", schema={"params": op.params()},
                             num_partitions=P, key=key,
                             extra={"arrow_schema": schema_to_json(schema),
                                    "keys": key_spec(schema, key).describe()})
        write_layout(root, lay)
    return RuntimeConfig(state_uri=str(tmp / "state"), state_key=root_key(root), layout=lay,
                         operator=op, key=key, input_schema=schema,
                         output_schema=op.output_schema(schema, key),
                         local_dir=str(tmp / "local"), capacity_bytes=1 << 26,
                         checkpoint=CheckpointConfig(every_n_batches=every), faults=plan)


def _run(cfg: RuntimeConfig, tables: list[list[pa.Table]], actions: dict[int, str],
         first: int = 0) -> list[list[pa.Table]]:
    rt = _runtime(cfg)
    outs: list[list[pa.Table]] = []
    for b, parts in enumerate(tables, start=first):
        res: list[pa.Table] = []
        for p, t in enumerate(parts):
            for _attempt in range(4):
                try:
                    res.append(run_partition_batch(cfg, p, b, t))
                    break
                except InjectedFault:
                    if actions.get(b) == "die":
                        rt.partition(p)._drop()
            else:
                raise AssertionError("task failed 4 times")
        outs.append(res)
    for part in rt.parts.values():
        if part.ckpt is not None:
            part.ckpt.wait()
        part.slot.release()
    rt.parts.clear()
    return outs


def _oracle_running(tables: list[list[pa.Table]], key: list[str]) -> dict[tuple[Any, ...], tuple[int, int]]:
    acc: dict[tuple[Any, ...], list[int]] = defaultdict(lambda: [0, 0])
    for parts in tables:
        for t in parts:
            for *k, v in zip(*(t.column(c).to_pylist() for c in key), t.column("v").to_pylist()):
                acc[tuple(k)][0] += 1
                acc[tuple(k)][1] += v
    return {k: (a[0], a[1]) for k, a in acc.items()}


KEYS = [["user"], ["tenant", "user"], ["day", "at"], ["flag"], ["blob", "n"]]
OPS: dict[str, Any] = {
    "running": (lambda: RunningAggregate(value="v"), False),
    "window": (lambda: WindowAggregate(time="ts", window=50, value="v", lateness=30), False),
    "join": (lambda: WindowJoin(time="ts", window=15, value="v", lateness=30), True),
}


@pytest.mark.parametrize("seed", range(9))
def test_failure_schedules_with_typed_keys_equal_failure_free_and_oracle(
        tmp_path: Path, seed: int) -> None:
    """Every operator and key type: outputs and state under faults (mid-batch raise, a
    dead worker, lost local state: restore from the checkpoint plus the input log) equal
    a failure-free run; the running aggregate's state equals a plain-Python groupBy."""
    name = ["running", "window", "join"][seed % 3]
    key = KEYS[seed % len(KEYS)]
    make, join = OPS[name]
    tables = _batches(seed, key, 2, join)
    schema = tables[0][0].schema
    ref = _run(_config(tmp_path / "ref", make(), schema, key, 2, None, 3), tables, {})
    ref_state, _ = read_local_state(str(tmp_path / "ref" / "state"),
                                    local_dir=str(tmp_path / "ref" / "local"))
    (tmp_path / "faults").mkdir()
    faults = (Fault("raise", 2, seed % 2, "mid"), Fault("delete_local", 4, 0, "start"),
              Fault("delete_local", 4, 1, "start"), Fault("raise", 5, 1, "end"))
    plan = FaultPlan(faults, str(tmp_path / "faults"))
    out = _run(_config(tmp_path / "run", make(), schema, key, 2, plan, 2), tables,
               {2: "die", 5: "retry"})
    assert len(list((tmp_path / "faults").glob("fired-*"))) == len(faults)
    for b in range(BATCHES):
        for p in range(2):
            assert out[b][p].equals(ref[b][p]), (name, key, b, p)
            assert out[b][p].schema.names[:len(key)] == key or name == "window"
    state, _ = read_local_state(str(tmp_path / "run" / "state"),
                                local_dir=str(tmp_path / "run" / "local"))
    assert state.equals(ref_state) and state.num_rows > 0
    durable, _ = read_durable_state(str(tmp_path / "run" / "state"))
    assert durable.equals(ref_state)
    if name == "running":
        want = _oracle_running(tables, key)
        got = {tuple(r[c] for c in key): (r["count"], r["sum_v"]) for r in state.to_pylist()}
        assert got == want
        assert any(None in k for k in want)  # null keys took part, as their own groups


@pytest.mark.parametrize("name,via", [("running", "api"), ("window", "job"), ("join", "api")])
def test_string_keyed_state_repartitions_and_continues(request: pytest.FixtureRequest,
                                                       tmp_path: Path, name: str,
                                                       via: str) -> None:
    """2 -> 3 partitions between batches (`sguard.rescale.repartition`, or the Spark job
    ``sguard state repartition`` runs, on the suite's session: the command itself, with its
    own Spark, is run in test_rescale_spark.py): every key lands where Spark sends it (with
    its dictionary entry), the new partitions replay the log, the result equals a
    3-partition run of the same rows."""
    key = ["tenant", "user"] if name == "running" else ["user"]
    make, join = OPS[name]
    t2 = _batches(5, key, 2, join)
    t3 = _batches(5, key, 3, join)
    schema = t2[0][0].schema
    ref = _run(_config(tmp_path / "ref", make(), schema, key, 3, None, 1), t3, {})
    ref_state, _ = read_local_state(str(tmp_path / "ref" / "state"),
                                    local_dir=str(tmp_path / "ref" / "local"))
    _run(_config(tmp_path / "run", make(), schema, key, 2, None, 2), t2[:4], {})
    if via == "api":
        res = rescale.repartition(str(tmp_path / "run" / "state"), 3)
        assert res.generation == 1 and res.pages > 0
    else:
        from sguard.spark.rescaling import repartition_job
        res = repartition_job(request.getfixturevalue("spark"),
                              open_root(str(tmp_path / "run" / "state")), 3)
        assert res.generation == 1 and res.pages > 0
    cfg = _config(tmp_path / "run", make(), schema, key, 3, None, 1)
    assert cfg.layout.num_partitions == 3 and cfg.layout.key == key
    out = _run(cfg, t3[4:], {}, first=4)
    for b in range(4, BATCHES):
        for p in range(3):
            assert out[b - 4][p].equals(ref[b][p]), (b, p)
    state, _ = read_local_state(str(tmp_path / "run" / "state"),
                                local_dir=str(tmp_path / "run" / "local"))
    assert state.equals(ref_state) and state.num_rows > 0
    durable, _ = read_durable_state(str(tmp_path / "run" / "state"))
    assert durable.equals(ref_state)


def test_layouts_before_keys_and_composite_layouts_read_back(tmp_path: Path) -> None:
    """A layout without extra.keys (key a string) reads and keys an integer column
    directly; a composite key round-trips; a bad key is refused; a layout written before
    key groups (version 1) is refused naming the command that converts it."""
    import json
    from sguard.statelayout import CONVERT_COMMAND, LayoutError
    old = {"layout_version": 2, "operator": "running_aggregate", "name": "op",
           "schema": {}, "num_partitions": 2, "key": "k", "generation": 0,
           "schema_version": 1, "partitioner": "spark-murmur3", "extra": {}, "key_groups": 8}
    lay = OperatorLayout.from_json(json.dumps(old).encode())
    assert lay.key == "k" and lay.key_groups == 8
    assert key_spec(pa.schema([("k", pa.int64())]), lay.key).direct
    new = OperatorLayout(operator="running_aggregate", name="op", schema={}, num_partitions=2,
                         key=["tenant", "user"],
                         extra={"keys": {"columns": ["tenant", "user"],
                                         "types": ["string", "string"],
                                         "encoding": "dictionary"}})
    assert OperatorLayout.from_json(new.to_json()) == new
    for bad in ([], [1], 3):
        with pytest.raises(LayoutError, match="'key'"):
            OperatorLayout.from_json(json.dumps({**old, "key": bad}).encode())
    v1 = {k: v for k, v in old.items() if k != "key_groups"}
    with pytest.raises(LayoutError, match=CONVERT_COMMAND):
        OperatorLayout.from_json(json.dumps({**v1, "layout_version": 1}).encode())


@pytest.mark.parametrize("name", ["window", "join"])
def test_window_operators_forget_keys_no_open_window_holds(name: str) -> None:
    """With new user ids every batch, the key dictionary holds only the keys of the open
    windows (buffers), not every key ever seen; late rows' keys are never added."""
    make, join = OPS[name]
    pm = PageManager(1 << 12, 1 << 26)
    rng = np.random.default_rng(3)
    schema = None
    st = None
    for b in range(12):
        n = 200
        cols: dict[str, Any] = {
            "user": pa.array([f"b{b}-u{i}" for i in rng.integers(0, 50, n)], pa.string()),
            "v": rng.integers(0, 9, n, dtype=np.int64),
            "ts": b * 100 + rng.integers(0, 100, n, dtype=np.int64)}
        cols["ts"][:5] = 0  # late after the first batches: dropped, never interned
        if join:
            cols[SIDE_COLUMN] = rng.integers(0, 2, n, dtype=np.int8)
        t = pa.table(cols)
        if st is None:
            schema = t.schema
            st = make().open(pm, schema, ["user"])
        st.apply(t, b)
        held = (len(np.unique(np.concatenate([bf.to_numpy()["k"] for bf in st.buf])))
                if name == "join" else
                len(np.unique(np.concatenate([st._window(s).keys()
                                              for s in st._open_windows()]))))
        assert len(st.keys) == held, (b, len(st.keys), held)
    assert 0 < len(st.keys) < 200
