"""The daemon preloads the kernel variants workloads used (`sguard.spark.daemon`'s record),
not every variant numba's cache holds.

Each step runs in a fresh interpreter sharing one numba cache directory and one record
file, as a worker, a unit-test process and a new daemon would."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

_CALL = textwrap.dedent("""
    import json, sys
    import numpy as np
    from mmm._kernels import pages
    from sguard.spark import daemon
    dtype, record = sys.argv[1], sys.argv[2]
    if record != "-":  # a worker that loaded what it preloaded nothing of
        daemon.preload(daemon.PRELOAD_VARIANTS_PER_KERNEL, record=record)
    frames = np.zeros((4, 64), np.uint8)
    pages.copy_frames(frames, np.array([0, 1], dtype), np.array([2, 3], dtype))
    print(json.dumps({"recorded": daemon.record_used(record) if record != "-" else None,
                      "again": daemon.record_used(record) if record != "-" else None}))
""")

_DAEMON = textwrap.dedent("""
    import json, sys
    from mmm._kernels import pages
    from sguard.spark import daemon
    bound = None if sys.argv[2] == "all" else int(sys.argv[2])
    loaded, kernels = daemon.preload(bound, record=sys.argv[1])
    print(json.dumps({"loaded": loaded, "kernels": kernels,
                      "copy_frames": [str(tuple(s)) for s in pages.copy_frames.signatures],
                      "recorded_after": daemon.record_used(sys.argv[1])}))
""")


def _run(code: str, cache: Path, *args: str) -> Any:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    env.pop("SGUARD_KERNEL_RECORD", None)
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                         text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_daemon_preloads_what_workers_used_not_all_the_cache_holds(tmp_path: Path) -> None:
    cache, record = tmp_path / "numba-cache", str(tmp_path / "record.json")
    # a worker of a workload loads (compiles here) the int32 variant: it is recorded
    worker = _run(_CALL, cache, "int32", record)
    assert worker["recorded"] >= 1 and worker["again"] == 0  # recorded once, then nothing new
    doc = json.loads(Path(record).read_text())  # plain JSON: no pickle
    assert Path(record).stat().st_mode & 0o777 == 0o644  # readable by every user of the install
    name = "mmm._kernels.pages.copy_frames"
    assert doc["format"] == 1 and list(doc["kernels"][name]) == [
        s for s in doc["kernels"][name] if "int32" in s]
    # later, another process (a unit test) compiles the int64 variant: the newest in the cache
    _run(_CALL, cache, "int64", "-")
    # with no record the daemon would take the newest cached variant...
    blind = _run(_DAEMON, cache, str(tmp_path / "none.json"), "1")
    assert len(blind["copy_frames"]) == 1 and "int64" in blind["copy_frames"][0]
    # ...with the record, only what the workload used, though the cache holds both
    got = _run(_DAEMON, cache, record, "all")
    assert len(got["copy_frames"]) == 1 and "int32" in got["copy_frames"][0]
    assert got["loaded"] == 1 and got["recorded_after"] == 0  # preloaded counts as known
    # a worker of that daemon that needs the int64 variant loads it and records it, newest
    again = _run(_CALL, cache, "int64", record)
    assert again["recorded"] == 1
    order = json.loads(Path(record).read_text())["kernels"][name]
    assert len(order) == 2
    from sguard.spark.daemon import read_record
    rec = read_record(record)
    assert rec is not None and "int64" in rec[name][0] and "int32" in rec[name][1]
    both = _run(_DAEMON, cache, record, "all")
    assert len(both["copy_frames"]) == 2 and both["loaded"] == 2


def test_a_damaged_or_foreign_record_is_no_record(tmp_path: Path) -> None:
    from sguard.spark.daemon import read_record
    path = tmp_path / "record.json"
    assert read_record(str(path)) is None
    for text in ("{not json", "[1, 2]", '{"format": 2, "kernels": {}}',
                 '{"format": 1, "kernels": []}'):
        path.write_text(text)
        assert read_record(str(path)) is None, text
    path.write_text('{"format": 1, "kernels": {"k": {"(a,)": 1.0, "(b,)": 3.0, "x": "y"}}}')
    assert read_record(str(path)) == {"k": ["(b,)", "(a,)"]}


def test_the_record_goes_with_numbas_cache(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    from sguard.spark import daemon
    monkeypatch.delenv("SGUARD_KERNEL_RECORD", raising=False)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert daemon.record_path() == str(tmp_path / "sguard-kernel-variants.json")
    monkeypatch.setenv("SGUARD_KERNEL_RECORD", str(tmp_path / "r.json"))
    assert daemon.record_path() == str(tmp_path / "r.json")


def test_workers_record_the_variants_their_tasks_loaded(spark: Any) -> None:
    """A task of `local_session`'s workers runs a kernel variant; after the task its worker
    has it in the record the next daemon reads, unless its daemon had preloaded it (from
    the record, or, when the daemon started before there was one, as one of the newest
    cached variants: preloaded variants count as known)."""
    def probe(batches: Any) -> Any:
        import numpy as np
        import pyarrow as pa
        import pyspark.worker

        from mmm._kernels import pages
        from sguard.spark import daemon
        for _ in batches:
            pass
        # uint16: a variant no warm-up compiles (not in sguard/kernel_variants.json), so on a
        # fresh install no daemon preloaded it and the record is what this checks
        preloaded = any("uint16" in str(s) for s in pages.copy_frames.signatures)
        frames = np.zeros((4, 64), np.uint8)
        pages.copy_frames(frames, np.array([0], np.uint16), np.array([1], np.uint16))
        yield pa.RecordBatch.from_pydict({
            "recording": [hasattr(pyspark.worker.main, "__wrapped__")],
            "path": [daemon.record_path()], "preloaded": [preloaded]})

    rows = (spark.range(0, 1, 1, 1)
            .mapInArrow(probe, "recording boolean, path string, preloaded boolean").collect())
    assert len(rows) == 1 and rows[0].recording, rows
    if rows[0].preloaded:
        return
    from sguard.spark.daemon import read_record
    name = "mmm._kernels.pages.copy_frames"
    deadline = time.monotonic() + 120  # written once the task has returned
    while True:
        rec = read_record(rows[0].path) or {}
        if any("uint16" in s for s in rec.get(name, [])):
            break
        assert time.monotonic() < deadline, f"not recorded in {rows[0].path}: {rec.get(name)}"
        time.sleep(0.2)
