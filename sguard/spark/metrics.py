"""Per batch and partition metrics, as JSON lines under the state URI.

Every task writes one record for its (batch, partition)::

    <state-uri>/metrics/p0003/b000000000042.json

(a replayed batch overwrites its record: the last attempt's is the truth) and
every durable checkpoint one record ``metrics/p0003/c000007.json``. A record
is one JSON object on one line; `read_metrics` gathers them and `summarize`
turns them into what ``sguard spark status`` prints.

Batch record fields: ``batch``, ``partition``, ``rows_in``, ``rows_out``,
``state_keys``, ``state_pages``, ``apply_ms`` (operator work),
``prepare_ms`` (checkpoint pause, 0 when none started), ``checkpoint_call_ms``
(deciding and starting a checkpoint on the task's thread: the prepare pause plus
adopting a recorded base and reading the page versions; when one started, its parts
``adopt_ms``, ``manager_ms`` (the checkpoint manager's call, its prepare pause
included) and ``versions_ms``, and ``checkpoint_base``, how its base was found),
``snapshot_ms``
(rollback point), ``log_ms`` (input log write), ``total_ms``,
``checkpoint_lag`` (batches since the last durable checkpoint),
``recovery`` (the `sguard.spark.versions.Action` value) with
``recovery_ms`` (of which ``compose_ms``: composing the partition's first
checkpoint after a start-up repartition), ``replayed_batches``, ``lock_wait_ms``,
``pid``, ``time``. With a memory budget (`sguard.spark.budget`) also, after the
batch's eviction: ``resident_bytes`` (the pool's frames in memory), ``evicted_bytes``
(the partition's pages not in memory: on the local disk only), ``state_bytes`` (its
pages), ``budget_bytes`` (what the partition may keep resident: its share of the
executor's budget), ``executor_budget_bytes``, ``evicted_frames`` (frames evicted by
the worker since it took the partition), ``batch_pages_bytes`` (pages the batch wrote
that came into memory) and ``budget_ms`` (the eviction's time).
Checkpoint records: ``checkpoint_seq``, ``batch``, ``written_bytes``,
``pages``, ``full``.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

from ioservice import StorageRoot

__all__ = ["METRICS_DIR", "write_batch_record", "write_checkpoint_record", "read_metrics",
           "summarize"]

METRICS_DIR = "metrics"
_NORMAL = frozenset({"cached", "attached", "fresh", ""})


def write_batch_record(root: StorageRoot, rec: dict[str, Any]) -> None:
    rec = dict(rec, time=time.time())
    root.write_atomic(f"{METRICS_DIR}/p{int(rec['partition']):04d}/b{int(rec['batch']):012d}.json",
                      (json.dumps(rec, sort_keys=True) + "\n").encode())


def write_checkpoint_record(root: StorageRoot, partition: int, rec: dict[str, Any]) -> None:
    rec = dict(rec, partition=partition, time=time.time())
    root.write_atomic(f"{METRICS_DIR}/p{partition:04d}/c{int(rec['checkpoint_seq']):06d}.json",
                      (json.dumps(rec, sort_keys=True) + "\n").encode())


def read_metrics(root: StorageRoot) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(batch records, checkpoint records)``, sorted by (batch, partition)."""
    batches: list[dict[str, Any]] = []
    ckpts: list[dict[str, Any]] = []
    for e in root.list_dir(METRICS_DIR, recursive=True, allow_not_found=True):
        if e.is_dir or not e.name.endswith(".json"):
            continue
        try:
            rec = json.loads(root.read_bytes(e.relpath))
        except (ValueError, OSError, Exception):  # noqa: BLE001 - a torn record is skipped
            continue
        (batches if e.name.startswith("b") else ckpts).append(rec)
    batches.sort(key=lambda r: (r.get("batch", 0), r.get("partition", 0)))
    ckpts.sort(key=lambda r: (r.get("partition", 0), r.get("checkpoint_seq", 0)))
    return batches, ckpts


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return float(s[min(len(s) - 1, int(round(q * (len(s) - 1))))])


def _total(parts: dict[int, dict[str, Any]], field: str) -> int | None:
    got = [int(r[field]) for r in parts.values() if r.get(field) is not None]
    return sum(got) if got else None


def summarize(batches: list[dict[str, Any]], ckpts: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals and per-partition latest values of the metric records."""
    parts: dict[int, dict[str, Any]] = {}
    for r in batches:
        parts[int(r["partition"])] = r
    rec = Counter(r.get("recovery", "") for r in batches)
    recoveries = [r for r in batches if r.get("recovery", "") not in _NORMAL]
    return {
        "batches": len({r["batch"] for r in batches}),
        "last_batch": max((r["batch"] for r in batches), default=None),
        "partitions": len(parts),
        "rows_in": sum(int(r.get("rows_in", 0)) for r in batches),
        "rows_out": sum(int(r.get("rows_out", 0)) for r in batches),
        "state_keys": sum(int(r.get("state_keys", 0)) for r in parts.values()),
        "state_pages": sum(int(r.get("state_pages", 0)) for r in parts.values()),
        # latest per partition; None when no partition runs under a memory budget
        "resident_bytes": _total(parts, "resident_bytes"),
        "evicted_bytes": _total(parts, "evicted_bytes"),
        "prepare_ms_mean": (sum(float(r.get("prepare_ms", 0)) for r in batches) / len(batches)
                            if batches else 0.0),
        "prepare_ms_max": max((float(r.get("prepare_ms", 0)) for r in batches), default=0.0),
        "apply_ms_p50": _pct([float(r.get("apply_ms", 0)) for r in batches], 0.5),
        "total_ms_p50": _pct([float(r.get("total_ms", 0)) for r in batches], 0.5),
        "total_ms_p99": _pct([float(r.get("total_ms", 0)) for r in batches], 0.99),
        "checkpoint_lag_max": max((int(r.get("checkpoint_lag", 0)) for r in parts.values()),
                                  default=0),
        "checkpoints": len(ckpts),
        "checkpoint_bytes": sum(int(c.get("written_bytes", 0)) for c in ckpts),
        "recovery_events": {k: v for k, v in rec.items() if k not in _NORMAL},
        "reattached": rec.get("attached", 0),
        "recoveries": [{k: r.get(k) for k in ("batch", "partition", "recovery", "reason",
                                              "recovery_ms", "replayed_batches")}
                       for r in recoveries],
    }
