"""Fencing with real processes standing for two hosts (issue 18).

Each trial: host A (its own local dir) runs batches 0..k-1 of partition 0 and
then batch k, and freezes itself (SIGSTOP, `ioservice.faultpoints`) at one of
four points of batch k: before a checkpoint page file, in the middle of a
page, right before the checkpoint's manifest, before the batch's input-log
file. Host B (another local dir, the same state URI) then takes the partition
over and runs batches k..k+m-1, with the same rows for batch k as A (a Spark
retry) or other rows (so a stale write would show). A is resumed either after
B finished (``new_first``) or once B finished its first batch (``old_first``).
Afterwards the state read by `read_durable_state` and the state the runtime's
own recovery rebuilds on a third host must both equal exactly B's history,
and A's batch k must have failed with `FencedError` unless it completed before
B took over. The same on ``file://`` and on S3 (SeaweedFS).

``SGUARD_FENCE_SEEDS=N`` runs N seeds per (point, order) instead of one.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from ioservice import list_checkpoints, open_root, read_manifest
from sguard.spark.fencing import epoch_of_seq
from sguard.spark.runtime import _runtime, run_partition_batch
from sguard.spark.state import read_durable_state, read_local_state
from tests.spark.fence_host import config, rows
from tests.spark.helpers import running_oracle

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
POINTS = ("page_file", "mid_page", "manifest", "inputlog")
ORDERS = ("new_first", "old_first")
SEEDS = int(os.environ.get("SGUARD_FENCE_SEEDS", "1"))
TALLY: dict[str, dict[str, int]] = {}


def _spawn(spec: dict[str, Any], log: Path, stop_dir: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), SGUARD_STOP_DIR=str(stop_dir))
    env.pop("SGUARD_STOP_AT", None)
    return subprocess.Popen([sys.executable, "-m", "tests.spark.fence_host", json.dumps(spec)],
                            cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def _wait(pred: Any, proc: subprocess.Popen[bytes], what: str, log: Path,
          timeout_s: float = 600) -> None:
    t0 = time.monotonic()
    while not pred():
        if proc.poll() is not None and not pred():
            raise AssertionError(f"{what}: host exited ({proc.returncode}) first:\n"
                                 + log.read_text()[-3000:])
        assert time.monotonic() - t0 < timeout_s, f"{what} did not happen:\n" + log.read_text()[-3000:]
        time.sleep(0.02)


def _as_rows(t: pa.Table) -> list[tuple[int, ...]]:
    cols = [t.column(c).to_pylist() for c in t.column_names]
    return sorted(zip(*cols))


def trial(tmp: Path, state_uri: str, opts: dict[str, Any], point: str, order: str,
          seed: int) -> dict[str, Any]:
    rng = np.random.default_rng([seed, POINTS.index(point), ORDERS.index(order)])
    k = int(rng.integers(2, 5))            # A's batch that freezes
    m = int(rng.integers(2, 4))            # B's batches from k on
    same_rows = bool(rng.integers(0, 2))   # B's batch k: A's rows (a retry) or other rows
    b_seed = 0 if same_rows else 1000 + seed
    ctl = tmp / "ctl"
    ctl.mkdir(parents=True)
    config(state_uri, opts, str(tmp / "C"))  # writes the layout document
    spec_a = {"state_uri": state_uri, "storage_options": opts, "local_dir": str(tmp / "A"),
              "batches": [[b, 0] for b in range(k + 1)], "stop_at": point, "stop_batch": k,
              "progress_dir": str(ctl), "name": "A", "out": str(tmp / "A.json")}
    spec_b = {"state_uri": state_uri, "storage_options": opts, "local_dir": str(tmp / "B"),
              "batches": [[k, b_seed]] + [[b, 0] for b in range(k + 1, k + m)],
              "stop_at": None, "stop_batch": -1,
              "progress_dir": str(ctl), "name": "B", "out": str(tmp / "B.json")}
    a = _spawn(spec_a, tmp / "A.log", ctl)
    b = None
    try:
        _wait(lambda: any(ctl.glob(f"stopped-{point}-*")), a, f"A stopped at {point}",
              tmp / "A.log")
        b = _spawn(spec_b, tmp / "B.log", ctl)
        if order == "new_first":
            assert b.wait(600) == 0, (tmp / "B.log").read_text()[-3000:]
        else:
            _wait(lambda: (ctl / f"done-B-b{k}").exists(), b, "B's first batch", tmp / "B.log")
        os.kill(a.pid, signal.SIGCONT)
        assert a.wait(600) == 0, (tmp / "A.log").read_text()[-3000:]
        assert b.wait(600) == 0, (tmp / "B.log").read_text()[-3000:]
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
    res_a = json.loads((tmp / "A.json").read_text())["results"]
    res_b = json.loads((tmp / "B.json").read_text())["results"]
    assert [r["ok"] for r in res_a[:k]] == [True] * k, res_a
    assert all(r["ok"] for r in res_b) and len(res_b) == m, res_b
    a_last = res_a[k]
    assert a_last["batch"] == k and (a_last["ok"] or a_last["error"] == "FencedError"), a_last

    history = [rows(x, 0) for x in range(k)] + [rows(k, b_seed)] + \
        [rows(x, 0) for x in range(k + 1, k + m)]
    _, want = running_oracle(history)
    # 1. the public reader
    got, batches = read_durable_state(state_uri, storage_options=opts)
    assert batches == {0: k + m - 1}, batches
    assert _as_rows(got) == want, (point, order, seed, "read_durable_state")
    # 2. the runtime's own recovery, on a third host, running the next batch (no rows)
    cfg = config(state_uri, opts, str(tmp / "C"))
    run_partition_batch(cfg, 0, k + m, rows(0, 0).slice(0, 0))
    rt = _runtime(cfg)
    part = rt.partition(0)
    assert part.ckpt is not None
    part.ckpt.wait(600)
    part._drop()
    part.slot.release()
    rt.parts.clear()
    local, lb = read_local_state(state_uri, local_dir=str(tmp / "C"), storage_options=opts)
    assert lb == {0: k + m}
    assert _as_rows(local) == want, (point, order, seed, "runtime recovery")
    # 3. what the stale host left (pages of a refused checkpoint, a late manifest or log
    # file) was collected by the owner's retention and trimming; claims: C's only
    root = open_root(state_uri, **opts)
    kept = [c for c in list_checkpoints(root) if c.has_manifest]
    assert len(kept) == 2 and epoch_of_seq(kept[-1].seq) == 3, [c.name for c in kept]  # C's
    referenced = {f.path for c in kept for f in read_manifest(root, c.name).files}
    on_store = {e.relpath for e in root.list_dir("checkpoint", recursive=True)
                if not e.is_dir and e.name.endswith(".pages")}
    assert on_store == referenced, sorted(on_store - referenced)  # no orphan page file
    upto = json.loads(root.read_bytes("inputlog/trimmed/g0-p0000.json"))["upto"]
    logged = [int(e.relpath.split("/")[1][1:]) for e in root.list_dir("inputlog", recursive=True)
              if e.name.endswith(".arrow")]
    assert upto >= 0 and min(logged) > upto, (upto, logged)  # every epoch's files trimmed
    return {"a_fenced": not a_last["ok"], "same_rows": same_rows}


def _tally(store: str, out: dict[str, Any]) -> None:
    t = TALLY.setdefault(store, {"trials": 0, "state_equal_oracle": 0, "stale_task_fenced": 0})
    t["trials"] += 1
    t["state_equal_oracle"] += 1
    t["stale_task_fenced"] += int(out["a_fenced"])
    print(f"fencing tally {store}: {t}")


CASES = [(p, o, s) for p in POINTS for o in ORDERS for s in range(SEEDS)]


@pytest.mark.parametrize("point,order,seed", CASES)
def test_two_hosts_file(tmp_path: Path, point: str, order: str, seed: int) -> None:
    out = trial(tmp_path, f"file://{tmp_path}/state", {}, point, order, seed)
    _tally("file", out)


@pytest.mark.seaweedfs
@pytest.mark.parametrize("point,order,seed", CASES)
def test_two_hosts_seaweedfs(tmp_path: Path, seaweed: Any, point: str, order: str,
                             seed: int) -> None:
    seaweed.create_bucket("sguard-fence")
    opts = {"s3_endpoint": seaweed.s3_endpoint, "s3_access_key": seaweed.access_key,
            "s3_secret_key": seaweed.secret_key, "timeout_s": 5.0}
    uri = f"s3://sguard-fence/{uuid.uuid4().hex[:10]}"
    out = trial(tmp_path, uri, opts, point, order, seed)
    _tally("s3", out)
