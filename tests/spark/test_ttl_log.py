"""TTL layout 2 (`sguard.spark.ttl`): the key's last update in the aggregate's record and the
touch log, driven batch by batch against a plain-Python oracle: integer, string and composite
keys; clock steps of zero, small, past several batches' log records at once, and (processing
time) backwards; keys that come back after expiring; empty batches; state of TTL layout 1
refused before anything is created."""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from mmm import HashMap, PageManager, SchemaMismatchError
from sguard.spark import RunningAggregate
from sguard.spark.ttl import TTL, TTLLayoutError, with_batch_time

SPAN = 300


class _Oracle:
    """One key group's state: key -> [count, sum, min, max], key -> last update, clock."""

    def __init__(self) -> None:
        self.state: dict[Any, list[int]] = {}
        self.last: dict[Any, int] = {}
        self.clock: int | None = None
        self.evicted: set[Any] = set()

    def apply(self, keys: list[Any], vals: list[int], clock: int | None
              ) -> set[tuple[Any, ...]]:
        if clock is not None:
            self.clock = clock if self.clock is None else max(self.clock, clock)
        if self.clock is not None:
            self.evicted = {k for k, s in self.last.items() if s + SPAN <= self.clock}
            for k in self.evicted:
                del self.state[k], self.last[k]
        for k, v in zip(keys, vals):
            s = self.state.get(k)
            if s is None:
                self.state[k] = [1, v, v, v]
            else:
                s[0] += 1
                s[1] += v
                s[2] = min(s[2], v)
                s[3] = max(s[3], v)
        for k in set(keys):
            assert self.clock is not None
            self.last[k] = self.clock
        return {(*_flat(k), *self.state[k]) for k in set(keys)}


def _flat(k: Any) -> tuple[Any, ...]:
    return k if isinstance(k, tuple) else (k,)


def _key_table(kind: str, ks: np.ndarray) -> tuple[dict[str, Any], list[Any], Any]:
    if kind == "int":
        return {"k": pa.array(ks, pa.int64())}, [int(k) for k in ks], "k"
    if kind == "str":
        s = [f"user-{k}" for k in ks]
        return {"k": pa.array(s, pa.string())}, s, "k"
    a = [f"t{k % 3}" for k in ks]
    b = [int(k) // 3 for k in ks]
    return ({"a": pa.array(a, pa.string()), "b": pa.array(b, pa.int64())},
            list(zip(a, b)), ["a", "b"])


@pytest.mark.parametrize("kind", ["int", "str", "composite"])
@pytest.mark.parametrize("mode", ["processing", "event"])
def test_ttl_log_against_an_oracle(kind: str, mode: str) -> None:
    rng = np.random.default_rng({"int": 1, "str": 2, "composite": 3}[kind]
                                + (10 if mode == "event" else 0))
    ttl = TTL(SPAN / 1000) if mode == "processing" else TTL(SPAN, mode="event", time="ts")
    op = RunningAggregate(value="v", ttl=ttl)
    st: Any = None
    oracle = _Oracle()
    now = 10_000
    evicted_any = came_back = 0
    for b in range(150):
        step = int(rng.choice([0, 0, 1, 40, 99, 150, 299, 300, 301, 700, 2000, -120]))
        if mode == "event" and step < 0:
            step = 0
        now += step
        n = int(rng.choice([0, 1, 5, 30, 80]))
        ks = rng.integers(0, 120, n)
        vals = rng.integers(-50, 50, n).astype(np.int64)
        cols, okeys, key = _key_table(kind, ks)
        cols["v"] = pa.array(vals)
        if mode == "event":  # event times around `now`, some behind it
            cols["ts"] = pa.array(now - rng.integers(0, 60, n), pa.int64())
        t = pa.table(cols)
        if st is None:
            st = op.open(PageManager(4096, 1 << 26), t.schema, key)
        if mode == "processing":
            t = with_batch_time(t, now)
            clock = now
        else:
            clock = int(cols["ts"].to_numpy().max()) if n else None
        want = oracle.apply(okeys, vals.tolist(), clock)
        evicted_any += len(oracle.evicted)
        came_back += len(oracle.evicted & set(okeys))
        got = {tuple(r.values()) for r in st.apply(t, b).to_pylist()}
        assert got == want, (b, sorted(got ^ want)[:5])
        dump = {tuple(r.values()) for r in st.dump().to_pylist()}
        assert dump == {(*_flat(k), *s) for k, s in oracle.state.items()}, b
        assert st.n_keys() == len(oracle.state)
        if kind != "int":  # the key dictionary forgets evicted keys
            assert len(st.keys) == len(oracle.state), b
        st.expiry._check(st.map)
    assert evicted_any > 100 and came_back > 10, (evicted_any, came_back)


def test_state_of_ttl_layout_1_is_refused_before_anything_is_created() -> None:
    """The structures TTL layout 1 wrote (the aggregate without a stamp field, ``ttl.last``,
    ``ttl.meta``, buckets ``ttl.b.<j>``): opening them raises `TTLLayoutError` and leaves the
    page manager as it was; the map alone, opened with the new record, is a schema mismatch."""
    schema = pa.schema([("k", pa.string()), ("v", pa.int64())])
    pm = PageManager(4096, 1 << 24)
    fields = [("count", "<i8"), ("sum", "<i8"), ("min", "<i8"), ("max", "<i8")]
    agg = HashMap.create(pm, "aggregate", "<i8", fields)
    agg.upsert(np.arange(5, dtype=np.int64), {"v": np.arange(5)},
               {"count": "count", "sum": ("sum", "v"), "min": ("min", "v"),
                "max": ("max", "v")})
    stamp = np.zeros(5, [("t", "<i8")])
    HashMap.create(pm, "ttl.last", "<i8", [("t", "<i8")]).put(np.arange(5, dtype=np.int64),
                                                             stamp)
    HashMap.create(pm, "ttl.meta", "<u1", [("clock", "<i8")])
    HashMap.create(pm, "ttl.b.0", "<i8", [("t", "<i8")]).put(np.arange(5, dtype=np.int64),
                                                            stamp)
    names = sorted(pm.names())
    op = RunningAggregate(value="v", ttl=TTL(60))
    with pytest.raises(TTLLayoutError, match="TTL layout 1"):
        op.open(pm, schema, "k")
    assert sorted(pm.names()) == names  # no key dictionary, no log created
    with pytest.raises(SchemaMismatchError):
        HashMap.create(pm, "aggregate", "<i8", fields + [("_t", "<i8")])
