"""``big_state --recovery``: recovering a partition whose state is about 4x its memory
budget, against the same recovery in memory and against reading its checkpoint.

One partition of the running aggregate through the Spark runtime's batch path
(`sguard.spark.runtime.run_partition_batch`, no Spark), 4 KiB pages, 8 key groups:

1. *build* (a process of its own, no limit): every key inserted once in batches of
   100,000 under the budget, a checkpoint after every batch, and one more batch so the
   last one is durable;
2. *recover*, twice, each in a new process whose local state is empty (a new host takes
   the partition over: restore from the checkpoint, replay the input log after it, then
   the next batch): ``memory`` with no budget (the pool under /dev/shm, no limit) and
   ``budget`` under the budget on ``--dir``, inside a memory cgroup whose limit is the
   process's memory after a warm-up plus 1.1x the budget plus 64 MB (as the other modes);
3. *read*: the checkpoint directory's files read cold (``posix_fadvise(DONTNEED)`` on
   each first), the floor of any recovery from them on this disk.

Summary: ``recovery_s_budget`` (the call that recovered and applied the next batch),
``recovery_s_memory``, ``recovery_budget_over_memory``, ``recovery_budget_over_read``
(over ``checkpoint_read_s``), the runtime's own ``recovery_ms`` of each, the cgroup's
peak, limit and OOM kills, and the state's size over the budget.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MB = 1 << 20
KG = 8
BATCH = 100_000


def _cfg(work: Path, budget_mb: int | None, local: str, every: int | None = None) -> Any:
    import pyarrow as pa

    import sguard.spark as ss
    from sguard.spark.budget import MemoryBudget
    from sguard.spark.checkpointing import CheckpointConfig
    from sguard.spark.runtime import RuntimeConfig
    from sguard.statelayout import OperatorLayout
    op = ss.RunningAggregate("v", ("count", "min", "max"))
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    lay = OperatorLayout(operator=op.kind, name="big", schema={"params": op.params()},
                         num_partitions=1, key="k", key_groups=KG)
    return RuntimeConfig(
        state_uri=str(work / "state"), state_key="big", layout=lay, operator=op, key="k",
        input_schema=schema, output_schema=op.output_schema(schema, "k"), local_dir=local,
        page_bytes=4096, capacity_bytes=1 << 33,
        memory_budget=None if budget_mb is None else MemoryBudget.for_query(
            f"{budget_mb}m", None, None),
        checkpoint=CheckpointConfig(every_n_batches=every) if every else CheckpointConfig())


def _batch(keys: Any) -> Any:
    import pyarrow as pa

    from sguard.spark.groupstate import add_key_groups
    k = np.asarray(keys, dtype=np.int64)
    return add_key_groups(pa.table({"k": k, "v": np.ones(len(k), np.int64)}), "k", KG)


def build(a: argparse.Namespace) -> dict[str, Any]:
    from sguard.spark.runtime import run_partition_batch
    work = Path(a.work)
    cfg = _cfg(work, a.budget_mb, str(work / "local-build"), every=1)
    b = 0
    for i in range(0, a.keys, BATCH):
        run_partition_batch(cfg, 0, b, _batch(np.arange(i, min(a.keys, i + BATCH))))
        b += 1
    run_partition_batch(cfg, 0, b, _batch(np.arange(10)))  # batch b-1's checkpoint starts
    b += 1
    from ioservice import open_root
    from sguard.spark.checkpointing import latest_checkpoint_batch
    from sguard.spark.metrics import read_metrics
    root = open_root(cfg.state_uri)
    for _ in range(1200):  # until that checkpoint is durable
        if latest_checkpoint_batch(root, cfg.layout.haunit(0)) >= b - 2:
            break
        time.sleep(0.25)
    else:
        raise RuntimeError(f"the checkpoint of batch {b - 2} did not land in 300 s")
    last = max(read_metrics(root)[0], key=lambda r: r["batch"])
    return {"batches": b, "live_bytes": last["live_bytes"], "state_bytes": last["state_bytes"],
            "checkpoint_batch": latest_checkpoint_batch(root, cfg.layout.haunit(0))}


def recover(a: argparse.Namespace) -> dict[str, Any]:
    from ioservice import open_root
    from sguard.spark.metrics import read_metrics
    from sguard.spark.runtime import run_partition_batch
    work = Path(a.work)
    budget = a.budget_mb if a.variant == "budget" else None
    root = a.dir if budget else "/dev/shm"
    scratch = Path(tempfile.mkdtemp(prefix="recover-warm-", dir=root))
    local = tempfile.mkdtemp(prefix=f"recover-{a.variant}-", dir=root)
    try:  # a warm-up on a state of its own: kernels and imports in the base
        wcfg = _cfg(scratch, budget, str(scratch / "local"))
        for b in range(3):
            run_partition_batch(wcfg, 0, b, _batch(np.arange(b * 5000, b * 5000 + 20000)))
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()
        cfg = _cfg(work, budget, local)
        t0 = time.perf_counter()
        run_partition_batch(cfg, 0, a.batch, _batch(np.arange(10)))
        wall = time.perf_counter() - t0
        print(json.dumps({"wall_s": wall}), flush=True)  # the parent reads the cgroup
        sys.stdin.readline()
        rec = None
        for _ in range(100):
            recs = [r for r in read_metrics(open_root(cfg.state_uri))[0]
                    if r["batch"] == a.batch and r.get("pid") == os.getpid()]
            if recs:
                rec = recs[0]
                break
            time.sleep(0.1)
        assert rec is not None, "no metrics record of the recovering batch"
        return {"variant": a.variant, "recovery_s": wall, "recovery": rec["recovery"],
                "recovery_ms": rec["recovery_ms"], "replayed_batches": rec["replayed_batches"],
                "state_bytes": rec.get("state_bytes"), "live_bytes": rec.get("live_bytes"),
                "resident_bytes": rec.get("resident_bytes"),
                "evicted_bytes": rec.get("evicted_bytes")}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)


def read_cold(d: Path) -> dict[str, Any]:
    files = [p for p in d.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    n = 0
    t0 = time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as fh:
            while True:
                got = fh.read(8 << 20)
                if not got:
                    break
                n += len(got)
    return {"checkpoint_read_s": time.perf_counter() - t0, "checkpoint_bytes": n,
            "files": len(files)}


def _cmd(a: argparse.Namespace, phase: str, extra: list[str]) -> list[str]:
    return ["bench._big_state_recovery", "--phase", phase, "--work", str(a.work),
            "--dir", a.dir, "--budget-mb", str(a.budget_mb), "--keys", str(a.keys), *extra]


def run_recover(a: argparse.Namespace, variant: str, batch: int) -> dict[str, Any]:
    from bench.big_state import LimitedChild
    cmd = _cmd(a, "recover", ["--variant", variant, "--batch", str(batch)])
    res: dict[str, Any] = {}
    with LimitedChild(cmd, "sguard-big-state-recovery", variant == "budget") as c:
        if c.read() is None:
            return {"variant": variant, "failed": f"exit {c.wait()} in the warm-up"}
        if c.limited:
            res["base_bytes"] = base = c.usage()
            c.limit(int(base + 1.1 * a.budget_mb * MB + 64 * MB))
        c.say("go")
        got = c.read()
        if variant == "budget":
            res["limit"] = c.report()
        if got is None:
            res.update({"variant": variant, "failed": f"exit {c.wait()} while recovering"})
            return res
        c.say("more")
        got = c.read()
        c.wait()
        res.update(got or {"variant": variant, "failed": "no record"})
        return res


def recovery_main(a: argparse.Namespace) -> dict[str, Any]:
    a.budget_mb = a.budget_mb or (32 if a.quick else 128)
    a.keys = a.keys or int(4 * a.budget_mb * MB / 64)  # ~64 B of live pages a key: 4x
    a.work = Path(tempfile.mkdtemp(prefix="big-state-recovery-", dir=a.dir))
    try:
        from bench.big_state import LimitedChild
        with LimitedChild(_cmd(a, "build", []), "sguard-big-state-build", False) as c:
            built = c.read()
            c.wait()
        if built is None:
            raise RuntimeError("building the state failed (see above)")
        rows = {"build": built}
        for v in ("memory", "budget"):
            rows[v] = run_recover(a, v, built["batches"])
        rows["read"] = read_cold(a.work / "state" / "checkpoint")
    finally:
        shutil.rmtree(a.work, ignore_errors=True)

    def get(v: str, f: str) -> Any:
        return rows[v].get(f)
    rb, rm, rd = get("budget", "recovery_s"), get("memory", "recovery_s"), \
        rows["read"]["checkpoint_read_s"]
    summary = {
        "recovery_s_budget": rb, "recovery_s_memory": rm, "checkpoint_read_s": rd,
        "recovery_budget_over_memory": rb / rm if rb and rm else None,
        "recovery_budget_over_read": rb / rd if rb and rd else None,
        "recovery_ms_budget": get("budget", "recovery_ms"),
        "recovery_ms_memory": get("memory", "recovery_ms"),
        # the live pages (what the checkpoint holds) over the budget
        "recovery_state_over_budget": built["live_bytes"] / (a.budget_mb * MB),
        "recovery_limit": get("budget", "limit"),
        "recovery_budget_mb": a.budget_mb, "recovery_keys": a.keys}
    return {"rows": rows, "summary": summary}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("build", "recover"), required=True)
    ap.add_argument("--variant", choices=("memory", "budget"))
    ap.add_argument("--batch", type=int)
    ap.add_argument("--work", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--budget-mb", type=int, required=True)
    ap.add_argument("--keys", type=int, required=True)
    a = ap.parse_args()
    print(json.dumps(build(a) if a.phase == "build" else recover(a)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
