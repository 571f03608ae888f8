"""`bench.spark_processors` without Spark: the processors' logic on an in-memory handle,
the plan (Spark's Python APIs run fewer batches, the buffer's at least three), and the
summary (ratio fields, the slowest partition's checkpoint work, a missing vectorized
variant reported as null with its reason, never as a number)."""
from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.test_readme import checkout

pd = pytest.importorskip("pandas")
pytest.importorskip("pyspark")


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, ModuleType]:
    monkeypatch.setattr(sys, "path", [*sys.path, str(checkout())])  # the bench is not installed
    return (importlib.import_module("bench.spark_processors"),
            importlib.import_module("bench._processors"))


class _Value:
    def __init__(self) -> None:
        self.v: tuple[Any, ...] | None = None

    def exists(self) -> bool:
        return self.v is not None

    def get(self) -> tuple[Any, ...] | None:
        return self.v

    def update(self, v: tuple[Any, ...]) -> None:
        self.v = v


class _List:
    def __init__(self) -> None:
        self.xs: list[tuple[Any, ...]] = []

    def exists(self) -> bool:
        return bool(self.xs)

    def get(self) -> Iterator[tuple[Any, ...]]:
        return iter(list(self.xs))

    def appendList(self, xs: list[tuple[Any, ...]]) -> None:
        self.xs.extend(xs)

    def clear(self) -> None:
        self.xs = []


class _Map:
    def __init__(self) -> None:
        self.d: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def containsKey(self, k: tuple[Any, ...]) -> bool:
        return k in self.d

    def updateValue(self, k: tuple[Any, ...], v: tuple[Any, ...]) -> None:
        self.d[k] = v


class _Handle:
    """One key's state (the processors under test see one key at a time)."""

    def __init__(self) -> None:
        self.ttl: dict[str, int | None] = {}
        self.timers: list[int] = []

    def getValueState(self, name: str, schema: str, ttl: int | None = None) -> _Value:
        self.ttl[name] = ttl
        return _Value()

    def getListState(self, name: str, schema: str, ttl: int | None = None) -> _List:
        return _List()

    def getMapState(self, name: str, ks: str, vs: str, ttl: int | None = None) -> _Map:
        return _Map()

    def registerTimer(self, t: int) -> None:
        self.timers.append(t)


def _pdf(vs: list[int], ids: list[int], ts_ms: list[int]) -> Any:
    return pd.DataFrame({"k": [7] * len(vs), "v": vs, "id": ids,
                         "ts": pd.to_datetime(ts_ms, unit="ms")})


def test_processors_on_an_in_memory_handle(bench: tuple[ModuleType, ModuleType]) -> None:
    _, P = bench
    h = _Handle()
    c = P.CountProcessor()
    c.init(h)
    assert h.ttl["count"] == P.COUNT_TTL_MS
    out = list(c.handleInputRows((7,), iter([_pdf([1, 2], [0, 0], [0, 1]), _pdf([3], [1], [2])]),
                                 None))
    out += list(c.handleInputRows((7,), iter([_pdf([4], [0], [3])]), None))
    assert [o.to_dict("records") for o in out] == [[{"k": 7, "count": 3}],
                                                    [{"k": 7, "count": 4}]]
    r = P.CountRowProcessor()
    r.init(_Handle())
    rows = list(r.handleInputRows((7,), iter([object(), object()]), None))
    assert rows[0].asDict() == {"k": 7, "count": 2}

    h = _Handle()
    b = P.BufferProcessor()
    b.init(h)
    assert list(b.handleInputRows((7,), iter([_pdf([5, 6], [0, 1], [1000, 4000])]), None)) == []
    list(b.handleInputRows((7,), iter([_pdf([7], [0], [9000])]), None))
    assert h.timers == [4000 + P.FLUSH_AFTER_MS]  # one timer, when the buffer started
    flushed = list(b.handleExpiredTimer((7,), None, None))
    assert flushed[0].to_dict("records") == [{"k": 7, "count": 3, "sum": 18}]
    assert list(b.handleExpiredTimer((7,), None, None)) == []  # cleared: nothing to emit

    d = P.DedupProcessor()
    d.init(_Handle())
    first = list(d.handleInputRows((7,), iter([_pdf([1, 2, 3], [4, 4, 5], [0, 1, 2])]), None))
    assert first[0].to_dict("records") == [{"k": 7, "id": 4, "v": 1}, {"k": 7, "id": 5, "v": 3}]
    assert list(d.handleInputRows((7,), iter([_pdf([9], [5], [3])]), None)) == []


def test_plan_runs_spark_fewer_batches(bench: tuple[ModuleType, ModuleType]) -> None:
    B, _ = bench
    a = B.parse_args(["--quick", "--out", "/tmp/unused-bench-out"])
    pl = B.plan(a)
    assert pl["batches"]["sguard_pandas_value"][100_000] == 6
    assert pl["batches"]["spark_pandas_value"][100_000] < 6
    assert pl["batches"]["spark_pandas_list"][100_000] >= 3
    assert all(pl["reps"][v][k] >= 1 for v in a.variants for k in a.keys)
    with pytest.raises(SystemExit):
        B.parse_args(["--variants", "nope", "--out", "/tmp/unused-bench-out"])


def _run(variant: str, rate_ms: float, commit: float | None = None) -> dict[str, Any]:
    bs = [{"batch": i, "rows": 1000, "duration_ms": rate_ms, "state_ms": 1.0,
           "commit_ms": commit} for i in range(4)]
    return {"variant": variant, "batches": bs}


def test_summary_ratios_checkpoint_and_missing_vectorized(
        bench: tuple[ModuleType, ModuleType]) -> None:
    B, _ = bench
    a = B.parse_args(["--keys", "100000", "--out", "/tmp/unused-bench-out"])
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {100_000: {v: [] for v in a.variants}}
    runs[100_000]["spark_pandas_value"] = [_run("spark_pandas_value", 1000.0)]
    runs[100_000]["sguard_pandas_value"] = [_run("sguard_pandas_value", 50.0, 2.0),
                                            _run("sguard_pandas_value", 100.0, 2.0)]
    runs[100_000]["sguard_pandas_map"] = [_run("sguard_pandas_map", 100.0, 7.0)]
    missing = {"sguard_vectorized_value": "no VectorizedProcessor"}
    s, _ = B.summarize(a, runs, {"spark_pandas_map_100000": "RuntimeError: boom"}, missing)
    assert s["processor_ratio_vs_spark_pandas_value_100k"] == pytest.approx(15.0)  # median rate 15k vs 1k rows/s
    assert s["processor_ratio_vs_spark_pandas_map_100k"] is None
    assert s["processor_ratio_vs_spark_pandas_map_100k_why_null"] == "RuntimeError: boom"
    assert s["vectorized_ratio_vs_spark_pandas_value_100k"] is None
    assert s["vectorized_missing"] == "no VectorizedProcessor"
    assert s["checkpoint_ms_on_critical_path"] == pytest.approx(7.0)  # the worst variant
    assert s["targets_missed"]["checkpoint_ms_on_critical_path"].startswith("7 vs")
    assert "processor_ratio_vs_spark_pandas_value_100k" not in s["targets_missed"]
    assert s["targets_missed"]["vectorized_ratio_vs_spark_pandas_value_100k"].startswith(
        "not measured: no VectorizedProcessor")
