"""Recovery never gives up early (issue 18), without Spark: a damaged newest checkpoint
falls back to an older one plus the longer input log, in `read_durable_state` and in the
runtime's own recovery, and a partition is unrecoverable only when nothing rebuilds it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa
import pytest

from ioservice import list_checkpoints, open_root, read_manifest
from sguard.spark import UnrecoverableStateError
from sguard.spark.checkpointing import CheckpointConfig
from sguard.spark.runtime import _runtime, run_partition_batch
from sguard.spark.state import read_durable_state, read_local_state, read_partition_state
from tests.spark.fence_host import config, rows
from tests.spark.helpers import running_oracle

pytestmark = pytest.mark.filterwarnings("ignore::ioservice.DamagedCheckpointWarning")


def _run(tmp: Path, n: int, every: int | None) -> str:
    """Batches 0..n-1 of partition 0 on one host; returns the state URI."""
    uri = f"file://{tmp}/state"
    cfg = config(uri, {}, str(tmp / "A"))
    cfg = dataclasses.replace(cfg, checkpoint=CheckpointConfig(every_n_batches=every, keep=2))
    rt = _runtime(cfg)
    for b in range(n):
        run_partition_batch(cfg, 0, b, rows(b, 0))
        part = rt.partition(0)
        # the checkpoint this batch started lands before the next batch: the policy skips a
        # checkpoint while one is in flight, so which ones the tests find would depend on load
        if part.ckpt is not None:
            part.ckpt.wait(600)
    part = rt.partition(0)
    part._drop()
    part.slot.release()
    rt.parts.clear()
    return uri


def _damage_pages(uri: str, name: str) -> None:
    """Flip bytes in every page file the checkpoint `name` wrote itself."""
    root = open_root(uri)
    man = read_manifest(root, name)
    own = [f for f in man.files if f.path.startswith(f"checkpoint/{name}/")]
    assert own, f"{name} wrote no page file"
    for f in own:
        p = Path(root.full_path(f.path))
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        data[100] ^= 0xFF
        p.write_bytes(bytes(data))


def _committed(uri: str) -> list[str]:
    return [c.name for c in list_checkpoints(open_root(uri)) if c.has_manifest]


def _rows_of(t: pa.Table) -> list[tuple[int, ...]]:
    return sorted(zip(*[t.column(c).to_pylist() for c in t.column_names]))


def _recover_on_new_host(tmp: Path, uri: str, batch: int) -> list[tuple[int, ...]]:
    cfg = config(uri, {}, str(tmp / "C"))
    run_partition_batch(cfg, 0, batch, rows(0, 0).slice(0, 0))
    rt = _runtime(cfg)
    part = rt.partition(0)
    if part.ckpt is not None:
        part.ckpt.wait(600)
    part._drop()
    part.slot.release()
    rt.parts.clear()
    t, _ = read_local_state(uri, local_dir=str(tmp / "C"))
    return _rows_of(t)


def test_damaged_newest_checkpoint_replays_from_the_one_restored(tmp_path: Path) -> None:
    n = 7
    uri = _run(tmp_path, n, every=2)
    names = _committed(uri)
    assert len(names) == 2, names  # keep=2
    newest = names[-1]
    root = open_root(uri)
    older = int(read_manifest(root, names[0]).user_meta["batch_id"])
    _damage_pages(uri, newest)
    _, want = running_oracle([rows(b, 0) for b in range(n)])
    got, batches = read_durable_state(uri)
    assert batches == {0: n - 1}
    assert _rows_of(got) == want
    # and up to an earlier batch: the damaged newest one is not needed either
    lay = config(uri, {}, str(tmp_path / "C")).layout
    t, last = read_partition_state(root, lay, 0, upto_batch=older + 1)
    assert last == older + 1
    assert _rows_of(t) == running_oracle([rows(b, 0) for b in range(older + 2)])[1]
    assert _recover_on_new_host(tmp_path, uri, n) == want


def test_every_checkpoint_damaged_rebuilds_from_the_whole_log(tmp_path: Path) -> None:
    """One checkpoint (nothing trimmed yet), damaged: generation 0 starts from the empty
    state and replays the whole log."""
    n = 5
    uri = _run(tmp_path, n, every=3)
    names = _committed(uri)
    assert len(names) == 1, names
    _damage_pages(uri, names[0])
    _, want = running_oracle([rows(b, 0) for b in range(n)])
    got, _ = read_durable_state(uri)
    assert _rows_of(got) == want
    assert _recover_on_new_host(tmp_path, uri, n) == want


def test_unrecoverable_only_when_nothing_rebuilds_it(tmp_path: Path) -> None:
    """Both kept checkpoints damaged and the log before them trimmed: the error says so,
    naming what was tried."""
    uri = _run(tmp_path, 8, every=2)
    names = _committed(uri)
    assert len(names) == 2
    for name in names:
        _damage_pages(uri, name)
    with pytest.raises(UnrecoverableStateError, match="no checkpoint plus input log") as ei:
        read_durable_state(uri)
    assert "damaged" in str(ei.value) and "empty state" in str(ei.value)
    with pytest.raises(UnrecoverableStateError):
        _recover_on_new_host(tmp_path, uri, 8)
