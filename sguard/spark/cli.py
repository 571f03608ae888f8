"""``sguard spark demo`` and ``sguard spark status <state-uri>``."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``spark`` subcommand to the ``sguard`` parser."""
    p = sub.add_parser("spark", help="stateful Spark streaming: the demo and state status",
                       description="Stateful PySpark streaming with state in mmm pages.")
    ss = p.add_subparsers(dest="spark_command", required=True)
    d = ss.add_parser("demo", help="run the main job: a local Spark streaming pipeline with "
                      "injected failures, checked against a failure-free run")
    from sguard.spark.demo import add_arguments
    add_arguments(d)
    d.set_defaults(func=_demo)
    s = ss.add_parser("status", help="show the state and metrics under a state URI")
    s.add_argument("state_uri", help="the operator's state URI (file://, s3://, hdfs://)")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--s3-endpoint", help="S3 endpoint (host:port) for s3:// URIs")
    s.set_defaults(func=_status)


def _demo(args: argparse.Namespace) -> int:
    from sguard.spark.demo import run_demo, validate
    err = validate(args)
    if err is not None:
        print(f"sguard spark demo: error: {err}", file=sys.stderr)
        return 2
    return run_demo(args)


def _status(args: argparse.Namespace) -> int:
    from ioservice import IOServiceError, list_checkpoints, open_root
    from sguard.spark import inputlog
    from sguard.spark.metrics import read_metrics, summarize
    from sguard.statelayout import LayoutError, read_layout
    opts = {"s3_endpoint": args.s3_endpoint} if args.s3_endpoint else {}
    try:
        root = open_root(args.state_uri, create=False, **opts)
        layout = read_layout(root)
    except (IOServiceError, LayoutError) as exc:
        print(f"sguard spark status: error: {exc}", file=sys.stderr)
        return 2
    if layout is None:
        print(f"sguard spark status: error: no sguard operator state at {args.state_uri} "
              f"(no sguard-operator.json)", file=sys.stderr)
        return 2
    batches, ckpts = read_metrics(root)
    summ = summarize(batches, ckpts)
    parts = []
    for p in range(layout.num_partitions):
        infos = [c for c in list_checkpoints(root, layout.haunit(p)) if c.has_manifest]
        last_p = [r for r in batches if r["partition"] == p]
        parts.append({"partition": p, "checkpoints": len(infos),
                      "latest_checkpoint": infos[-1].name if infos else None,
                      "last_batch": last_p[-1]["batch"] if last_p else None,
                      "state_keys": last_p[-1].get("state_keys") if last_p else None,
                      "checkpoint_lag": last_p[-1].get("checkpoint_lag") if last_p else None,
                      # with a memory budget (`sguard.spark.budget`), else None
                      **{f: last_p[-1].get(f) if last_p else None
                         for f in ("resident_bytes", "evicted_bytes", "budget_bytes")}})
    il = inputlog.describe(root)
    out: dict[str, Any] = {"state_uri": root.uri, "operator": layout.operator, "name": layout.name,
           "key": layout.key, "num_partitions": layout.num_partitions,
           "generation": layout.generation, "input_log": il,
           "summary": summ, "partitions": parts}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{layout.operator} {layout.name!r} on {root.uri}: key {layout.key!r}, "
          f"{layout.num_partitions} partitions, generation {layout.generation}")
    print(f"  batches {summ['batches']} (last {summ['last_batch']}), rows in {summ['rows_in']}, "
          f"rows out {summ['rows_out']}")
    print(f"  state: {summ['state_keys']} keys in {summ['state_pages']} pages"
          + ("" if summ["resident_bytes"] is None else
             f"; {summ['resident_bytes']} bytes resident, {summ['evicted_bytes']} evicted "
             f"to local disk"))
    print(f"  batch time p50 {summ['total_ms_p50']:.1f} ms, p99 {summ['total_ms_p99']:.1f} ms; "
          f"operator p50 {summ['apply_ms_p50']:.1f} ms; prepare pause mean "
          f"{summ['prepare_ms_mean']:.2f} ms, max {summ['prepare_ms_max']:.2f} ms")
    print(f"  checkpoints {summ['checkpoints']}, {summ['checkpoint_bytes']} bytes written, "
          f"checkpoint lag max {summ['checkpoint_lag_max']} batches")
    print(f"  input log: {il['batches']} batches ({il['first']}..{il['last']})")
    ev = summ["recovery_events"]
    print(f"  recovery events: {ev if ev else 'none'}; re-attaches {summ['reattached']}")
    for r in summ["recoveries"]:
        print(f"    batch {r['batch']} partition {r['partition']}: {r['recovery']} "
              f"in {r['recovery_ms']:.1f} ms, replayed {r['replayed_batches']} - {r['reason']}")
    for pp in parts:
        print(f"  p{pp['partition']}: last batch {pp['last_batch']}, keys {pp['state_keys']}, "
              f"checkpoints {pp['checkpoints']} (latest {pp['latest_checkpoint']}), "
              f"lag {pp['checkpoint_lag']}"
              + ("" if pp["resident_bytes"] is None else
                 f", resident {pp['resident_bytes']} of budget {pp['budget_bytes']} bytes, "
                 f"evicted {pp['evicted_bytes']}"))
    return 0
