"""A running aggregate's batch output: one row per distinct key, its value after the batch."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

import mmm
from sguard.spark import RunningAggregate
from sguard.spark.operators import _last_rows, upsert_returning

INT_TYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(INT_TYPES), st.lists(st.integers(), max_size=300),
       st.integers(1, 40))
def test_last_rows_is_the_last_row_of_each_key_in_first_appearance_order(
        dt: type, raw: list[int], spread: int) -> None:
    info = np.iinfo(dt)
    keys = np.array([info.min + (x % spread) if x % 3 else info.max - (x % spread)
                     for x in raw], dtype=dt)
    k64 = keys.view(np.int64) if keys.dtype.itemsize == 8 else keys.astype(np.int64)
    rows = _last_rows(np.ascontiguousarray(k64))
    want_keys: list[int] = []
    last: dict[int, int] = {}
    for i, k in enumerate(keys.tolist()):
        if k not in last:
            want_keys.append(k)
        last[k] = i
    assert keys[rows].tolist() == want_keys
    assert rows.tolist() == [last[k] for k in want_keys]


def test_upsert_returning_matches_a_dict_over_batches() -> None:
    pm = mmm.PageManager(4096, 1 << 24)
    m = mmm.HashMap.create(pm, "m", key="<i8", value=[("n", "<i8"), ("s", "<i8")])
    rng = np.random.default_rng(3)
    oracle: dict[int, tuple[int, int]] = {}
    for _ in range(20):
        keys = rng.integers(-500, 500, 700).astype(np.int64)
        vals = rng.integers(-9, 9, 700).astype(np.int64)
        uk, got = upsert_returning(m, keys, {"v": vals}, {"n": "count", "s": ("sum", "v")})
        for k, v in zip(keys.tolist(), vals.tolist()):
            n, s = oracle.get(k, (0, 0))
            oracle[k] = (n + 1, s + v)
        assert sorted(uk.tolist()) == sorted(set(keys.tolist()))
        assert [(int(a), int(b)) for a, b in zip(got["n"], got["s"])] == \
            [oracle[k] for k in uk.tolist()]


def test_running_aggregate_emits_each_touched_key_once() -> None:
    pm = mmm.PageManager(4096, 1 << 24)
    schema = pa.schema([("k", pa.int32()), ("v", pa.int64())])
    st_ = RunningAggregate(value="v").open(pm, schema, "k")
    out = st_.apply(pa.table({"k": pa.array([3, -1, 3, 7, -1, 3], pa.int32()),
                              "v": pa.array([1, 2, 3, 4, 5, 6], pa.int64())}), 0)
    rows = sorted(zip(out.column("k").to_pylist(), out.column("sum_v").to_pylist()))
    assert rows == [(-1, 7), (3, 10), (7, 4)]
