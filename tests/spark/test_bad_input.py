"""Bad input gets a specific error naming the thing at fault, before any state is touched."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import sguard.spark as ss
from ioservice import RootNotWritableError, open_root
from sguard.statelayout import read_layout
from tests.spark.helpers import StreamInput, run_query, stream


def test_unsupported_key_type(spark: Any, stream_input: StreamInput, tmp_path: Path) -> None:
    df = stream(spark, stream_input).selectExpr("cast(k as double) as k", "v", "ts")
    with pytest.raises(ss.UnsupportedKeyTypeError, match="key column 'k' has type double"):
        ss.stateful(df, "k", ss.RunningAggregate(value="v"), str(tmp_path / "s"), 2)
    assert not (tmp_path / "s" / "sguard-operator.json").exists()


def test_missing_key_column(spark: Any, stream_input: StreamInput, tmp_path: Path) -> None:
    with pytest.raises(ss.SchemaChangedError, match="key column 'nope'"):
        ss.stateful(stream(spark, stream_input), "nope", ss.RunningAggregate(value="v"),
                    str(tmp_path / "s"), 2)


def test_batch_dataframe_refused(spark: Any, stream_input: StreamInput, tmp_path: Path) -> None:
    df = spark.read.parquet(str(stream_input.dir))
    with pytest.raises(ss.NotStreamingError, match="streaming DataFrame"):
        ss.stateful(df, "k", ss.RunningAggregate(value="v"), str(tmp_path / "s"), 2)


def test_state_uri_not_writable(spark: Any, stream_input: StreamInput, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user that ignores permissions")  # root
        with pytest.raises(RootNotWritableError, match="not writable"):
            ss.stateful(stream(spark, stream_input), "k", ss.RunningAggregate(value="v"),
                        str(ro / "state"), 2)
    finally:
        os.chmod(ro, 0o700)


def test_state_uri_is_a_file(spark: Any, stream_input: StreamInput, tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(RootNotWritableError, match="afile"):
        ss.stateful(stream(spark, stream_input), "k", ss.RunningAggregate(value="v"), str(f), 2)
    assert f.read_text() == "x"


@pytest.fixture(scope="module")
def existing_state(spark: Any, stream_input: StreamInput,
                   tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A state URI written by a finished running-aggregate query."""
    work = tmp_path_factory.mktemp("existing")
    rows, state, _ = run_query(spark, stream_input, work, ss.RunningAggregate(value="v"))
    return work, (rows, state)


def _unchanged(work: Path, before: Any) -> None:
    from sguard.spark.state import read_local_state
    st, _ = read_local_state(str(work / "state"), local_dir=str(work / "local"))
    assert [tuple(r.values()) for r in st.to_pylist()] == before[1]
    root = open_root(str(work / "state"))
    lay = read_layout(root)
    assert lay is not None and lay.operator == "running_aggregate"
    assert (lay.generation, lay.num_partitions) == (0, 2)  # not repartitioned
    from ioservice import list_haunits
    assert all(".g0." in h for h in list_haunits(root)) and not root.exists(
        "rescale-pending.json")


def test_different_operator_on_existing_state(spark: Any, stream_input: StreamInput,
                                              existing_state: Any) -> None:
    work, before = existing_state
    with pytest.raises(ss.OperatorMismatchError, match="'running_aggregate'"):
        ss.stateful(stream(spark, stream_input), "k",
                    ss.WindowAggregate(time="ts", window=10, value="v"), str(work / "state"), 2)
    _unchanged(work, before)


def test_schema_change_between_restarts(spark: Any, stream_input: StreamInput,
                                        existing_state: Any) -> None:
    work, before = existing_state
    df = stream(spark, stream_input).selectExpr("k", "cast(v as double) as v", "ts")
    with pytest.raises(ss.SchemaChangedError, match="schema changed.*'v'"):
        ss.stateful(df, "k", ss.RunningAggregate(value="v"), str(work / "state"), 2)
    with pytest.raises(ss.SchemaChangedError, match="parameters changed"):
        ss.stateful(stream(spark, stream_input), "k",
                    ss.RunningAggregate(value="v", aggs=("count",)), str(work / "state"), 2)
    # with another partition count too: refused before any repartition at start-up
    with pytest.raises(ss.SchemaChangedError, match="schema changed.*'v'"):
        ss.stateful(df, "k", ss.RunningAggregate(value="v"), str(work / "state"), 3)
    with pytest.raises(ss.OperatorMismatchError, match="'running_aggregate'"):
        ss.stateful(stream(spark, stream_input), "k",
                    ss.WindowAggregate(time="ts", window=10, value="v"), str(work / "state"), 3)
    _unchanged(work, before)


def test_restart_with_same_schema_continues(spark: Any, stream_input: StreamInput,
                                            existing_state: Any) -> None:
    """The same query restarted on its state and checkpointLocation has nothing to do and
    keeps its state."""
    work, before = existing_state
    rows, state, _ = run_query(spark, stream_input, work, ss.RunningAggregate(value="v"))
    assert (rows, state) == before


def test_bad_operator_arguments() -> None:
    with pytest.raises(ValueError, match="aggs"):
        ss.RunningAggregate(value="v", aggs=("median",))
    with pytest.raises(ValueError, match="need a value column"):
        ss.RunningAggregate(aggs=("sum",))
    with pytest.raises(ValueError, match="every_n_batches"):
        ss.CheckpointConfig(every_n_batches=0)
    with pytest.raises(ValueError, match="keep must be >= 2"):
        ss.CheckpointConfig(keep=1)
