"""A memory budget in real Spark queries (`sguard.spark.budget` wired into the runtime):
state that outgrows the budget mid-run is evicted to the pool files on local disk and the
output equals the oracle's; a batch that cannot fit fails with an error naming the
partition, its size and the budget, and the query recovers exactly once with a larger
budget; a Python worker killed (SIGKILL) while pages are being evicted loses nothing."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import sguard.spark as ss
from ioservice import open_root
from sguard.spark.metrics import read_metrics
from mmm.pagecache import BudgetError, is_memory_fs
from tests.spark.helpers import (StreamInput, every_batch, landed_metrics, last_batch,
                                 make_input_spec,
                                 run_query, running_oracle, stream)

PB = 4096  # the smallest page: many pages for little state
PARTS = 2


def _input(d: Path, spec: list[tuple[int, int, int]], seed: int) -> StreamInput:
    """One parquet file per batch: ``(rows, lowest key, highest key + 1)`` each."""
    d.mkdir()
    return make_input_spec(d, spec, seed)


def _growing(d: Path) -> StreamInput:
    """7 batches, each 800 new keys (twice each): every partition's state grows by about
    70 KB a batch while one batch writes well under 256 KB of pages."""
    return _input(d, [(1600, 800 * i, 800 * (i + 1)) for i in range(7)], seed=33)


def _on_disk(p: Path) -> None:
    if is_memory_fs(str(p)):
        pytest.fail(f"{p} is on a memory file system: a memory budget needs a disk "
                    f"(point pytest's --basetemp to one)")


def _status(uri: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "sguard", "spark", "status", uri, "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    got: dict[str, Any] = json.loads(out.stdout)
    return got


def _check_evicted(work: Path, budget: int, *, settled: bool = True) -> list[dict[str, Any]]:
    """Every batch record carries the residency figures; the state outgrew the budget,
    pages were evicted, and ``sguard spark status`` shows resident and evicted bytes per
    partition: each partition's latest record. With `settled` (no worker died), pages are
    still evicted after the last batch; after kills a partition's allowance may be the
    whole budget (a dead worker's ledger entry no longer counts), so its state may fit.
    Returns the batch records."""
    last = last_batch(work)
    batches, _ = landed_metrics(open_root(str(work / "state")), every_batch(last, PARTS))
    assert all(r["executor_budget_bytes"] == budget for r in batches)
    assert all(r["budget_bytes"] >= budget // PARTS for r in batches)
    assert max(r["state_bytes"] for r in batches) > budget // PARTS  # outgrew its share
    assert max(r["evicted_frames"] for r in batches) > 0
    st = _status(str(work / "state"))
    assert st["summary"]["resident_bytes"] > 0
    assert st["summary"]["evicted_bytes"] > 0 or not settled
    # each partition's figures are those of a record of its last batch (a retried task's
    # record may land after `batches` was read)
    again, _ = read_metrics(open_root(str(work / "state")))
    for pp in st["partitions"]:
        assert pp["budget_bytes"] >= budget // PARTS
        recs = {(r["resident_bytes"], r["evicted_bytes"], r["budget_bytes"]) for r in again
                if (r["partition"], r["batch"]) == (pp["partition"], pp["last_batch"])}
        assert (pp["resident_bytes"], pp["evicted_bytes"], pp["budget_bytes"]) in recs, (pp, recs)
    assert sum(pp["evicted_bytes"] for pp in st["partitions"]) == st["summary"]["evicted_bytes"]
    text = subprocess.run([sys.executable, "-m", "sguard", "spark", "status",
                           str(work / "state")], capture_output=True, text=True, timeout=300,
                          check=True).stdout
    assert re.search(r"p0: .*resident \d+ of budget \d+ bytes, evicted \d+", text), text
    return batches


def test_state_outgrows_budget_exactly_as_oracle(spark: Any, tmp_path: Path) -> None:
    _on_disk(tmp_path)
    inp = _growing(tmp_path / "in")
    budget = 512 << 10
    rows, state, failures = run_query(spark, inp, tmp_path, ss.RunningAggregate("v"),
                                      durable=True, partitions=PARTS, page_bytes=PB,
                                      capacity_bytes=64 << 20, memory_budget="512k",
                                      restarts=0)
    assert failures == 0
    assert (rows, state) == running_oracle(inp.tables)
    # the executors' live pools (PB-byte pages, partly evicted to disk) hold the same state
    from sguard.spark.state import read_local_state
    local, _ = read_local_state(str(tmp_path / "state"), local_dir=str(tmp_path / "local"))
    assert [tuple(r.values()) for r in local.to_pylist()] == state
    recs = _check_evicted(tmp_path, budget)
    # pages went to disk only once the state had outgrown the partition's share
    first = min(r["batch"] for r in recs if r["evicted_bytes"] > 0)
    assert first > 0
    # and the later batches' pages came back in together before they ran (frames_for)
    assert sum(r["read_ahead_frames"] for r in recs if r["batch"] > first) > 0, recs


def test_working_set_too_large_then_larger_budget(spark: Any, tmp_path: Path) -> None:
    _on_disk(tmp_path)
    # two small batches fit; the third writes about 100 KB of pages per partition
    inp = _input(tmp_path / "in", [(200, 0, 100), (200, 0, 100), (4000, 0, 5000),
                                   (400, 0, 5000)], seed=7)
    uri, local = str(tmp_path / "state"), str(tmp_path / "local")

    def start(budget: str) -> Any:
        # one key group per partition: a batch runs one key group at a time within the
        # budget (test_a_batch_larger_than_the_budget_runs_one_key_group_at_a_time), so the
        # error needs one key group larger than the partition's share
        out = ss.stateful(stream(spark, inp), "k", ss.RunningAggregate("v"), uri, PARTS,
                          local_dir=local, page_bytes=PB, capacity_bytes=64 << 20,
                          memory_budget=budget, key_groups=PARTS)
        return (out.writeStream.format("parquet").option("path", str(tmp_path / "out"))
                .option("checkpointLocation", str(tmp_path / "ckpt")).start())

    q = start("64k")
    try:
        with pytest.raises(Exception) as info:
            q.processAllAvailable()
    finally:
        q.stop()
    msg = str(info.value)
    assert "WorkingSetTooLargeError" in msg, msg[:2000]
    m = re.search(r"partition ([01]) of 'running_aggregate' \(generation 0\) at \S+: one batch "
                  r"touched (\d+) bytes of pages, more than the (\d+) bytes it may keep in "
                  r"memory \(executor memory budget 65536 bytes shared by \d partition\(s\); "
                  r"state (\d+) bytes\)", msg)
    assert m is not None, msg[:2000]
    assert int(m.group(2)) > int(m.group(3)) and int(m.group(4)) >= int(m.group(2))
    assert last_batch(tmp_path) == 1  # batches 0 and 1 committed, 2 did not

    q = start("8m")  # the same query, a larger budget: it goes on from batch 2
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    rows = sorted(tuple(r) for r in spark.read.parquet(str(tmp_path / "out")).collect())
    assert rows == running_oracle(inp.tables)[0]  # every batch's output once
    batches, _ = landed_metrics(open_root(uri), every_batch(3, PARTS))
    assert {r["executor_budget_bytes"] for r in batches if r["batch"] >= 2} == {8 << 20}


def test_a_batch_larger_than_the_budget_runs_one_key_group_at_a_time(
        spark: Any, tmp_path: Path) -> None:
    """A batch whose pages are several times the partition's share (the input of the test
    above, under its 64 KB budget): with the default key groups the partition brings
    itself within its share between key groups and reads each one's pages in together;
    output and durable state equal the oracle's, and the records say so."""
    _on_disk(tmp_path)
    inp = _input(tmp_path / "in", [(200, 0, 100), (200, 0, 100), (4000, 0, 5000),
                                   (400, 0, 5000)], seed=7)
    rows, state, failures = run_query(spark, inp, tmp_path, ss.RunningAggregate("v"),
                                      durable=True, partitions=PARTS, page_bytes=PB,
                                      capacity_bytes=64 << 20, memory_budget="64k",
                                      restarts=0)
    assert failures == 0
    assert (rows, state) == running_oracle(inp.tables)
    recs, _ = landed_metrics(open_root(str(tmp_path / "state")), every_batch(3, PARTS))
    big = [r for r in recs if r["batch"] == 2]
    assert all(r["budget_rounds_in_batch"] > 0 for r in big), big
    assert max(r["state_bytes"] for r in big) > 3 * (64 << 10) // PARTS
    assert all(r["resident_bytes"] <= r["budget_bytes"] for r in recs)
    assert sum(r["read_ahead_frames"] for r in recs) > 0


def test_bad_budget_and_tmpfs_local_dir(spark: Any, tmp_path: Path) -> None:
    inp = _input(tmp_path / "in", [(10, 0, 5)], seed=1)
    with pytest.raises(BudgetError, match="memory_budget: '12 apples' is not a size"):
        ss.stateful(stream(spark, inp), "k", ss.RunningAggregate("v"), str(tmp_path / "s"),
                    1, memory_budget="12 apples")
    spark.conf.set("sguard.memoryBudget", "-3m")
    try:
        with pytest.raises(BudgetError, match="sguard.memoryBudget: '-3m' is not a size"):
            ss.stateful(stream(spark, inp), "k", ss.RunningAggregate("v"),
                        str(tmp_path / "s"), 1)
    finally:
        spark.conf.unset("sguard.memoryBudget")
    if os.path.isdir("/dev/shm") and is_memory_fs("/dev/shm"):
        with pytest.raises(BudgetError, match="local_dir /dev/shm/x is on a memory file"):
            ss.stateful(stream(spark, inp), "k", ss.RunningAggregate("v"),
                        str(tmp_path / "s"), 1, memory_budget="1g", local_dir="/dev/shm/x")
    assert not (tmp_path / "s" / "sguard-operator.json").exists()  # nothing written


def test_worker_killed_while_evicting(spark: Any, tmp_path: Path) -> None:
    _on_disk(tmp_path)
    inp = _growing(tmp_path / "in")
    (tmp_path / "faults").mkdir()
    # two kills once the state has outgrown the budget, then partition 0's local state
    # lost: it restores a state larger than its share from its checkpoint, and the
    # restored pages do not count as the batch's
    plan = ss.FaultPlan((ss.Fault("kill", 4, 0, "mid"), ss.Fault("kill", 5, 1, "end"),
                         ss.Fault("delete_local", 6, 0, "start")), str(tmp_path / "faults"))
    rows, state, _ = run_query(spark, inp, tmp_path, ss.RunningAggregate("v"),
                               durable=True, partitions=PARTS, page_bytes=PB,
                               capacity_bytes=64 << 20, memory_budget=512 << 10, faults=plan)
    assert len(os.listdir(plan.fault_dir)) == 3  # every fault fired
    assert (rows, state) == running_oracle(inp.tables)
    recs = {(r["batch"], r["partition"]): r
            for r in _check_evicted(tmp_path, 512 << 10, settled=False)}
    r6 = recs[(6, 0)]
    # the local state lost at batch 6's start was restored from the checkpoint. When
    # Spark ran the batch again after that first attempt had applied part of it (the
    # restore done), the record is the retry's, which rolls back what that attempt wrote
    retried = (r6["recovery"] == "rolled_back_file"
               and "partly applied by another attempt" in r6["reason"])
    assert r6["recovery"] == "restored" or retried, (r6["recovery"], r6["reason"])
    assert r6["state_bytes"] > (512 << 10) // PARTS  # larger than its share
