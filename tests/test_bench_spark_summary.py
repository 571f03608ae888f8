"""`bench.spark_stateful`'s bookkeeping, without Spark: what the summary counts as the
checkpoint work on the critical path (the slowest partition, lock wait and the whole
checkpoint start included), the p99 ratio, and how string keys that did not run are
reported (never as a number)."""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

import pytest

from tests.test_readme import checkout


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, ModuleType]:
    monkeypatch.setattr(sys, "path", [*sys.path, str(checkout())])
    return (importlib.import_module("bench.spark_stateful"),
            importlib.import_module("bench._spark_sguard"))


def _rec(p: int, **kw: float) -> dict[str, float]:
    return {"batch": 5, "partition": p, "apply_ms": 10.0, "recovery_ms": 1.0, "total_ms": 30.0,
            "prepare_ms": 0.0, "snapshot_ms": 0.5, "log_wait_ms": 0.1, "lock_wait_ms": 0.0,
            **kw}


def test_critical_path_is_the_slowest_partition_with_lock_wait_and_checkpoint_start(
        bench: tuple[ModuleType, ModuleType], tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _, S = bench
    # partition 0 waited 40 ms for the lock; partition 1 started a checkpoint whose
    # prepare pause was 1 ms but adopting the base and reading page versions took 6 ms more
    recs = [_rec(0, lock_wait_ms=40.0),
            _rec(1, prepare_ms=1.0, checkpoint_call_ms=7.0)]
    monkeypatch.setattr(S, "read_records", lambda run_dir, expect: (recs, []))
    rows = [{"batch": 5}]
    S.collect({"run_dir": tmp_path, "partitions": 2}, rows)
    row = rows[0]
    assert row["commit_ms"] == pytest.approx(40.0 + 0.5 + 0.1)  # partition 0, not the mean
    assert row["commit_ms_mean_over_partitions"] == pytest.approx((40.6 + 7.6) / 2)
    assert row["lock_wait_ms"] == pytest.approx(40.0)
    assert row["checkpoint_start_ms"] == pytest.approx(7.0)
    assert row["start_beyond_prepare_ms"] == pytest.approx(6.0)
    assert row["checkpoint_started"] is True
    assert row["state_ms"] == pytest.approx(10.0)  # state work stays per partition


def test_records_without_checkpoint_call_fall_back_to_the_prepare_pause(
        bench: tuple[ModuleType, ModuleType]) -> None:
    _, S = bench
    c = S.critical_path_ms(_rec(0, prepare_ms=2.0))
    assert c["checkpoint_start_ms"] == 2.0 and c["start_beyond_prepare_ms"] == 0.0
    assert c["total"] == pytest.approx(2.6)


def _run(durations: list[float], ckpt: bool) -> dict[str, object]:
    return {"batches": [{"duration_ms": d, "checkpoint_started": ckpt, "commit_ms": 1.0,
                         "lock_wait_ms": 0.5} for d in durations], "checkpoints": []}


def test_p99_ratio_pools_measured_batches_and_skips_the_warm_up(
        bench: tuple[ModuleType, ModuleType]) -> None:
    M, _ = bench
    on = [_run([5000.0] + [100.0] * 9 + [300.0], True)]   # the 5 s warm-up is left out
    off = [_run([5000.0] + [100.0] * 10, False)]
    f = M.p99_fields({"sguard_ckpt_every_batch": on, "sguard_no_ckpt": off})
    import numpy as np
    want = np.percentile([100.0] * 9 + [300.0], 99) / 100.0
    assert f["spark_batch_p99_ratio_ckpt_every_batch"] == pytest.approx(want)
    assert f["spark_batch_max_ms_ckpt_every_batch"] == 300.0
    assert f["spark_batch_p99_checkpoints_started"] == "10 of 10 measured batches"
    assert M.p99_fields({"sguard_ckpt_every_batch": on, "sguard_no_ckpt": []})[
        "spark_batch_p99_ratio_ckpt_every_batch"] == "not measured"


def test_string_keys_that_did_not_run_are_reported_as_missed_not_as_numbers(
        bench: tuple[ModuleType, ModuleType]) -> None:
    M, _ = bench
    micro = {"rollback": {"rollback_plus_rebuild_ms": {"median": 0.5},
                          "rollback_ms": {"median": 0.4}}}
    s = M.build_summary({}, micro, None, {}, "not run: string keys not available")
    assert s["ratio_vs_sql_str_100k"] == "not run: string keys not available"
    assert s["str_state_work_over_int"] == "not run: string keys not available"
    assert s["targets_missed"]["ratio_vs_sql_str_100k"] == "not run: string keys not available"


def test_parse_args_refuses_unknown_extras_and_variants(
        bench: tuple[ModuleType, ModuleType], tmp_path) -> None:  # type: ignore[no-untyped-def]
    M, _ = bench
    with pytest.raises(SystemExit) as e:
        M.parse_args(["--extras", "keys,bogus", "--out", str(tmp_path)])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        M.parse_args(["--variants", "sql,nope", "--out", str(tmp_path)])
    a = M.parse_args(["--extras", "", "--variants", "sql_rocksdb,sguard", "--out", str(tmp_path)])
    assert a.extras == [] and a.variants == ["sql_rocksdb", "sguard"]
    pl = M.plan(a)
    assert pl["key_runs"] is None and pl["p99"] is None
    assert pl["batches"]["sguard"][100_000] == 16  # full runs time >= 3 checkpoints (4, 8, 12)
