"""``sguard state show`` and `sguard.spark.reader` without Spark: state written by the runtime
(driven batch by batch), read back at several batches and compared with the operator applied
in-process; bad arguments answer with one line and exit status 2 before any work."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from ioservice import open_root
from mmm import PageManager
from sguard.spark.groupstate import open_state
from sguard.cli import main
from sguard.spark.reader import (BatchNotAvailableError, available_batches, read_partition_at,
                                 state_schema)
from tests.spark.test_runtime_schedules import BATCHES, OPS, P, _config, _run, _tables


@pytest.fixture(scope="module", params=sorted(OPS))
def written(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Any]:
    """(operator name, runtime config, per-batch partition tables) of a finished run."""
    name = request.param
    make, join = OPS[name]
    tables = _tables(2, join)
    cfg = _config(tmp_path_factory.mktemp(name), make(), tables[0][0].schema, None, 3)
    _run(cfg, tables, {})
    return name, cfg, tables


def _reference(cfg: Any, tables: Any, batch: int, *, ordered: bool = False
               ) -> list[tuple[Any, ...]]:
    """The operator applied in-process: rows with partition_id (dump order if `ordered`)."""
    rows = []
    for p in range(P):
        st = open_state(cfg.operator, PageManager(1 << 16, 1 << 26), cfg.input_schema, "k",
                        cfg.layout.key_group_range(p))
        for b in range(batch + 1):
            st.apply(tables[b][p], b)
        rows += [(*r.values(), p) for r in st.dump().to_pylist()]
    return rows if ordered else sorted(rows)


def test_read_partition_at_every_available_batch(written: Any) -> None:
    name, cfg, tables = written
    root = open_root(cfg.state_uri)
    before = _durable(root, cfg)
    lo, hi = available_batches(cfg.state_uri)
    assert hi == BATCHES - 1 and lo <= hi - 2, (lo, hi)  # the older checkpoint is still there
    schema = state_schema(cfg.layout)
    for b in range(lo, hi + 1):
        got = pa.concat_tables([read_partition_at(root, cfg.layout, p, b) for p in range(P)])
        assert got.schema == schema
        assert sorted(tuple(r.values()) for r in got.to_pylist()) == _reference(cfg, tables, b)
    # `lo` is the oldest batch every partition reaches: at least one partition (the one
    # whose checkpoints were trimmed furthest, which depends on when each asynchronous
    # checkpoint landed) cannot be rebuilt one batch earlier, and says so by name
    refused = []
    for p in range(P):
        try:
            read_partition_at(root, cfg.layout, p, lo - 1)
        except BatchNotAvailableError as exc:
            assert f"batch {lo - 1}: partition {p}" in str(exc), str(exc)
            refused.append(p)
    assert refused, (f"every partition could be rebuilt at batch {lo - 1}, below {lo}: "
                     f"{_durable(root, cfg)} (before the reads: {before})")


def _durable(root: Any, cfg: Any) -> str:
    """Each partition's checkpoints' batches and the logged batches (for a failure)."""
    from sguard.spark import inputlog
    from sguard.spark.reader import _logged, _points
    pts = {p: [pt.batch for pt in _points(root, cfg.layout, p)] for p in range(P)}
    return f"checkpoints {pts}, logged {_logged(root, cfg.layout, inputlog.logged_batches(root))}"


def test_state_show_prints_the_first_rows(written: Any, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    name, cfg, tables = written
    assert main(["state", "show", cfg.state_uri, "--limit", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"batch {BATCHES - 1}" in out[0] and f"{P} partition(s)" in out[0]
    header, rows = out[1].split(), out[2:]
    assert header == state_schema(cfg.layout).names
    assert len(rows) == 4
    want = _reference(cfg, tables, BATCHES - 1, ordered=True)[:4]  # partition 0 first
    assert [tuple(int(x) for x in r.split()) for r in rows] == want
    assert f"{len(_reference(cfg, tables, BATCHES - 1))} row(s)" in out[0]
    assert main(["state", "show", cfg.state_uri, "--batch-id", str(BATCHES - 2)]) == 0
    assert f"batch {BATCHES - 2}" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize("args, message", [
    (["--limit", "0"], "--limit: must be a positive integer"),
    (["--limit", "x"], "--limit: must be an integer"),
    (["--batch-id", "-1"], "--batch-id: must be an integer >= 0"),
    (["--batch-id", "999"], "batch 999 is not available"),
])
def test_state_show_bad_arguments(written: Any, args: list[str], message: str) -> None:
    _, cfg, _ = written
    r = subprocess.run([sys.executable, "-m", "sguard", "state", "show", cfg.state_uri, *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stdout == ""


def test_state_show_without_state(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "sguard", "state", "show", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "no sguard operator state" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_durable_range_stops_at_a_gap() -> None:
    """A partition's range is the newest unbroken run: batches 0..1 from the empty start,
    batch 2's log gone, 4..6 from the checkpoint of batch 4."""
    from sguard.spark.reader import _partition_range, _Point
    logged = {0: {0, 1}, 1: {0, 1}, 3: {1}, 5: {0, 1}, 6: {0}}
    pts = [_Point(-1, None), _Point(4, 7)]
    assert _partition_range(pts, logged, 0) == (4, 6)
    assert _partition_range(pts, logged, 1) == (4, 5)
    assert _partition_range([_Point(-1, None)], {}, 0) is None


def test_nothing_durable_yet(tmp_path: Path) -> None:
    from sguard.statelayout import OperatorLayout, write_layout
    uri = str(tmp_path / "state")
    write_layout(open_root(uri), OperatorLayout(operator="running_aggregate", name="op",
                                                key="k", num_partitions=2,
                                                schema={"params": {"value": "v"}}))
    with pytest.raises(BatchNotAvailableError, match="partition 0 has no durable batch yet"):
        available_batches(uri)
