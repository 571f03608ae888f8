"""Shared helpers for the checkpoint tests: a state of every structure, a
deterministic mutation, a canonical digest (the oracle), and roots.

Also runnable as a script (``python -m tests.ioservice.ckpt_helpers``), the
"new process" of the recovery and kill -9 tests:

- ``recover <uri> <haunit> <out.json>``: restore the HA unit into a fresh page
  manager and write the manifest name, its ``user_meta`` and the digest;
- ``loop <uri> <haunit>``: restore (or start fresh) and checkpoint forever,
  mutating the state between checkpoints (killed by the parent).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import xxhash

import mmm
from ioservice import CheckpointManager, CheckpointPolicy, StorageRoot, open_root, restore
from ioservice.testing import FaultyFS
from mmm.structures.hashmap import HashMap
from mmm.structures.ordered_map import OrderedMap
from mmm.structures.sequence import PagedDeque, PagedList

REPO = Path(__file__).resolve().parents[2]
PAGE_BYTES = 4096
CAPACITY = 64 << 20
COUNT_DT = np.dtype([("n", "<i8"), ("s", "<f8")])
INDEX_DT = np.dtype([("v", "<i8")])
LOG_DT = np.dtype([("ts", "<i8"), ("x", "<f4")])
STEP_KEY = np.uint64(2**63)  # the counts entry that stores the step number


def new_pm() -> mmm.PageManager:
    """A small page manager (4 KiB pages) so that state spans many pages."""
    return mmm.PageManager(page_bytes=PAGE_BYTES, capacity_bytes=CAPACITY)


def open_structures(pm: mmm.PageManager) -> dict[str, Any]:
    """Create or reopen one structure of each kind."""
    return {
        "counts": HashMap.create(pm, "counts", key="<u8", value=COUNT_DT),
        "index": OrderedMap.create(pm, "index", key="<i8", value=INDEX_DT),
        "log": PagedList.create(pm, "log", LOG_DT),
        "window": PagedDeque.create(pm, "window", "<i8"),
    }


def mutate(s: dict[str, Any], step: int, n: int = 300) -> None:
    """Apply the deterministic mutation number `step` to every structure."""
    rng = np.random.default_rng(step)
    keys = rng.integers(0, 20_000, n).astype("<u8")
    s["counts"].upsert(keys, {"x": rng.random(n)}, {"n": "count", "s": ("sum", "x")})
    s["counts"].put(np.array([STEP_KEY], "<u8"), np.array([(step, 0.0)], COUNT_DT))
    if step % 3 == 2:
        s["counts"].delete(rng.integers(0, 20_000, n // 3).astype("<u8"))
    ik = rng.integers(-50_000, 50_000, n // 2).astype("<i8")
    s["index"].put(ik, np.array(list(zip(ik * 2 + step)), INDEX_DT))
    if step % 4 == 3:
        s["index"].delete(rng.integers(-50_000, 50_000, n // 4).astype("<i8"))
    recs = np.zeros(n // 3, LOG_DT)
    recs["ts"] = step
    recs["x"] = rng.random(n // 3)
    s["log"].extend(recs)
    s["window"].extend(np.arange(n // 2, dtype="<i8") + step * 1000)
    if len(s["window"]) > 2 * n:
        s["window"].popleft(n // 2)


def state_of(s: dict[str, Any]) -> dict[str, str]:
    """Canonical digest of each structure's contents (the oracle)."""
    k, v = s["counts"].items()
    order = np.argsort(k, kind="stable")
    ik, iv = s["index"].items()
    out = {
        "counts": _h(k[order], v[order]),
        "index": _h(ik, iv),
        "log": _h(s["log"].to_numpy()),
        "window": _h(s["window"].to_numpy()),
    }
    out["lens"] = json.dumps([len(k), len(ik), len(s["log"]), len(s["window"])])
    return out


def step_of(s: dict[str, Any]) -> int:
    """The step number stored in the state itself."""
    found, v = s["counts"].get(np.array([STEP_KEY], "<u8"))
    return int(v["n"][0]) if found[0] else -1


def _h(*arrays: np.ndarray) -> str:
    d = xxhash.xxh3_128()
    for a in arrays:
        d.update(np.ascontiguousarray(a).tobytes())
        d.update(str(a.dtype).encode())
    return d.hexdigest()


def faulty_root(inner: pafs.FileSystem, base: str, **faults: Any) -> tuple[StorageRoot, FaultyFS]:
    """A StorageRoot over ``FaultyFS(inner, **faults)``."""
    handler = FaultyFS(inner, **faults)
    return StorageRoot(pafs.PyFileSystem(handler), base), handler


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child Python process that imports the repository."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def recover_in_subprocess(uri: str, haunit: str, out: Path, env: dict[str, str] | None = None,
                          timeout_s: float = 600) -> dict[str, Any]:
    """Run ``recover`` in a new process; return what it reported."""
    proc = subprocess.run([sys.executable, "-m", "tests.ioservice.ckpt_helpers", "recover", uri,
                           haunit, str(out)], cwd=REPO, env=child_env(env),
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["stderr"] = proc.stderr
    return result


def _die_on_nth(n: int) -> Any:
    """A FaultyFS write hook that SIGKILLs this process on the n-th write call to a page file
    after it is set (so the kill lands inside a page file, never in a manifest)."""
    count = [0]

    def hook(path: str) -> None:
        if not path.endswith(".pages"):
            return
        count[0] += 1
        if count[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def _main(argv: list[str]) -> int:
    cmd, uri, haunit = argv[:3]
    root = open_root(uri)
    if cmd == "recover":
        pm = new_pm()
        man = restore(pm, root, haunit)
        s = open_structures(pm)
        Path(argv[3]).write_text(json.dumps({"name": man.name, "user_meta": dict(man.user_meta),
                                             "state": state_of(s), "step": step_of(s)}))
        return 0
    if cmd == "loop":
        latency_s = float(os.environ.get("SGUARD_TEST_LATENCY_S", "0"))
        die_on = int(os.environ.get("SGUARD_TEST_DIE_ON_WRITE", "0"))
        handler = None
        if latency_s or die_on:  # widen the checkpoint window the parent's SIGKILL should hit
            root, handler = faulty_root(root.filesystem, root.base_path, latency_s=latency_s)
        pm = new_pm()
        policy = CheckpointPolicy(full_every=3, keep=2)
        mgr = CheckpointManager(pm, root, haunit, policy=policy, n_workers=2)
        man = mgr.restore()
        s = open_structures(pm)
        step = 0
        if man is not None:
            step = int(man.user_meta["step"]) + 1
            assert step_of(s) == step - 1, (step_of(s), man.user_meta)
        first = True
        while True:
            mutate(s, step)
            mgr.checkpoint({"step": step}).result()
            if first:  # tells the parent this run is past start-up (it times its kill from here)
                print("committed", flush=True)
                first = False
                if die_on and handler is not None:  # SIGKILL itself inside its die_on-th write
                    handler.on_write = _die_on_nth(die_on)
            step += 1
    raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
