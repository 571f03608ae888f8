"""A full local directory fails the query with the space error, never a killed worker;
given room, the query goes on exactly once. And the default local directory is chosen
by free space."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import sguard.spark as ss
from sguard.spark.placement import choose_local_dir, default_local_dir
from tests.mmm.test_space import small_tmpfs  # the tmpfs mount, one definition
from tests.spark.helpers import make_input, running_oracle, stream


def test_default_local_dir_prefers_shm_with_room_else_disk(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    uid = os.getuid()
    with small_tmpfs(2 << 20) as shm:
        # a /dev/shm of 2 MB: too small for 64 MB of state, the disk directory is chosen
        choice = choose_local_dir(64 << 20, [str(shm), str(disk)])
        assert choice.path == os.path.join(str(disk), f"sguard-{uid}")
        assert str(shm) in choice.reason and "less than" in choice.reason
        assert default_local_dir(64 << 20, [str(shm), str(disk)]) == choice.path
        # with room to spare it is /dev/shm
        assert default_local_dir(1 << 20, [str(shm), str(disk)]) == os.path.join(
            str(shm), f"sguard-{uid}")
    # no candidate with room: the disk one with the most, never the small memory one
    assert choose_local_dir(1 << 60, ["/dev/shm", str(disk)]).path == os.path.join(
        str(disk), f"sguard-{uid}")
    with pytest.raises(FileNotFoundError, match="no writable directory"):
        choose_local_dir(1, [str(tmp_path / "missing")])


def _start(spark: Any, inp: Any, work: Path, local_dir: str) -> Any:
    out = ss.stateful(stream(spark, inp), "k", ss.RunningAggregate(value="v"),
                      str(work / "state"), 2, local_dir=local_dir)
    return (out.writeStream.format("parquet").option("path", str(work / "out"))
            .option("checkpointLocation", str(work / "ckpt")).start())


def test_query_on_a_full_local_dir_fails_with_space_error_then_completes_exactly_once(
        spark: Any, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    inp = make_input(tmp_path / "in", batches=5, rows=20_000, keys=1_000_000, seed=35)
    work = tmp_path / "work"
    with small_tmpfs(2 << 20) as small:
        q = _start(spark, inp, work, str(small))
        with pytest.raises(Exception) as info:
            try:
                q.processAllAvailable()
            finally:
                q.stop()
        msg = str(info.value)
        assert "no space for the page pool in" in msg and str(small) in msg, msg[-3000:]
        assert "bytes free" in msg
    # given room (a directory on disk), the same query goes on from its checkpointLocation
    q = _start(spark, inp, work, str(work / "local"))
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    want_rows, want_state = running_oracle(inp.tables)
    rows = sorted(tuple(r) for r in spark.read.parquet(str(work / "out")).collect())
    assert rows == want_rows  # every batch's output once: none lost, none twice
    from sguard.spark.state import read_local_state
    st, _ = read_local_state(str(work / "state"), local_dir=str(work / "local"),
                             lock_timeout_s=600)
    assert sorted(tuple(r.values()) for r in st.to_pylist()) == want_state
