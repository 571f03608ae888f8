"""`sguard.spark.keygroups` on real Spark: after `with_key_groups` every row sits in the
partition that owns its key group (by Spark's `spark_partition_id()`), and the JVM's key
group equals `sguard.keygroups.key_group_of` of the same keys, for every key type."""
from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from sguard.keygroups import KeyGroupsError, key_group_of, key_group_range, owner_of
from sguard.spark.keygroups import KG_COLUMN, ROUTE_COLUMN, ReservedColumnError, with_key_groups

pyspark = pytest.importorskip("pyspark")
from pyspark.sql import functions as F  # noqa: E402

N = 600


def _keys_table(n: int) -> pa.Table:
    """Row number ``i`` and one column of every key type sguard keys state on, with nulls."""
    rng = np.random.default_rng(20)
    null = rng.random((10, n)) < 0.12
    strs = ["".join(chr(int(c)) for c in rng.integers(32, 0x2FFF, int(rng.integers(0, 9))))
            for _ in range(n)]
    utc = dt.timezone.utc

    def m(j: int, vals: list[Any]) -> list[Any]:
        return [None if null[j][r] else v for r, v in enumerate(vals)]
    return pa.table({
        "i": pa.array(np.arange(n, dtype=np.int64)),
        "s": pa.array(m(0, strs), pa.string()),
        "b": pa.array(m(1, [s.encode()[: int(rng.integers(0, 7))] for s in strs]), pa.binary()),
        "f": pa.array(m(2, [bool(x) for x in rng.integers(0, 2, n)]), pa.bool_()),
        "d": pa.array(m(3, [dt.date(1960, 1, 1) + dt.timedelta(days=int(x))
                            for x in rng.integers(0, 40000, n)]), pa.date32()),
        "t": pa.array(m(4, [dt.datetime(1965, 1, 1, tzinfo=utc) + dt.timedelta(microseconds=int(x))
                            for x in rng.integers(0, 2**51, n)]), pa.timestamp("us", tz="UTC")),
        "i8": pa.array(m(5, rng.integers(-128, 128, n).tolist()), pa.int8()),
        "i16": pa.array(m(6, rng.integers(-2**15, 2**15, n).tolist()), pa.int16()),
        "i32": pa.array(m(7, rng.integers(-2**31, 2**31, n).tolist()), pa.int32()),
        "i64": pa.array(m(8, rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64).tolist()),
                        pa.int64()),
    })


@pytest.fixture(scope="module")
def keys_df(spark: Any) -> tuple[Any, pa.Table]:
    """The key table as a Spark DataFrame (the JVM hashes it) and as Arrow (numpy hashes it)."""
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    table = _keys_table(N)
    return spark.createDataFrame(table).cache(), table


def _check_routing(df: Any, table: pa.Table, cols: list[str], cases: list[tuple[int, int]]
                   ) -> None:
    """Route `df` by `cols` for every (K, P) of `cases` (one Spark action for all of them) and
    check every row's partition and key group."""
    outs = []
    for K, P in cases:
        out = with_key_groups(df, cols, K, P)
        assert out.columns == table.column_names + [KG_COLUMN]
        assert dict(out.dtypes)[KG_COLUMN] == "int"
        outs.append(out.select("i", KG_COLUMN, F.spark_partition_id().alias("p"),
                               F.lit(K).alias("K"), F.lit(P).alias("P"), *cols))
    union = outs[0]
    for o in outs[1:]:
        union = union.unionAll(o)
    every = union.toArrow()
    for K, P in cases:
        mine = every.filter(pc.and_(pc.equal(every["K"], K), pc.equal(every["P"], P)))
        got = mine.sort_by("i")
        assert got["i"].to_pylist() == list(range(table.num_rows)), f"K={K} P={P}"
        kg = got[KG_COLUMN].to_numpy()
        where = got["p"].to_numpy()
        np.testing.assert_array_equal(where, owner_of(kg, P, K), err_msg=f"{cols} K={K} P={P}")
        for p in np.unique(where):   # each partition holds only its own range
            lo, hi = key_group_range(int(p), P, K)
            assert lo <= kg[where == p].min() and kg[where == p].max() < hi
        keys = got.select(cols)
        np.testing.assert_array_equal(key_group_of(keys, K), kg, err_msg=f"{cols} K={K}")
        np.testing.assert_array_equal(key_group_of(table.select(cols), K), kg,
                                      err_msg=f"{cols} K={K} (input table)")
        # the same keys in Arrow's 64-bit-offset layouts (large_string, large_binary)
        large = keys.cast(pa.schema([
            pa.field(f.name, pa.large_string()) if pa.types.is_string(f.type) else
            pa.field(f.name, pa.large_binary()) if pa.types.is_binary(f.type) else f
            for f in keys.schema]))
        np.testing.assert_array_equal(key_group_of(large, K), kg, err_msg=f"{cols} K={K} large")


CASES = [(K, P) for P in (1, 2, 3, 5, 7) for K in sorted({P, 8, 128})]


@pytest.mark.parametrize("cols", [["s"], ["b"], ["f"], ["d"], ["t"], ["i8"], ["i16"], ["i32"],
                                  ["i64"], ["i8", "s", "d"], ["t", "b", "i64", "i16"]],
                         ids="+".join)
def test_rows_reach_the_owner_of_their_key_group(keys_df: tuple[Any, pa.Table],
                                                 cols: list[str]) -> None:
    """spark_partition_id() == owner_of(kg) and the JVM's kg == key_group_of, for every key
    type (the hash depends on the type; K = 8 over P = 3 and K = P = 5). The routing from a
    key group to its partition does not depend on the type: the whole (K, P) matrix runs
    on a composite key below."""
    df, table = keys_df
    _check_routing(df, table, cols, [(8, 3), (5, 5)])


def test_every_partition_count_routes_by_key_group(keys_df: tuple[Any, pa.Table]) -> None:
    """P in {1, 2, 3, 5, 7} and K in {P, 8, 128}, on a composite (string, bool) key."""
    df, table = keys_df
    _check_routing(df, table, ["s", "f"], CASES)


def test_the_largest_key_group_counts_route_as_well(keys_df: tuple[Any, pa.Table]) -> None:
    """K = 32768 with P = 7 and P = K = 1000: still each row in its key group's owner."""
    df, table = keys_df
    _check_routing(df, table, ["i64", "s"], [(32768, 7), (1000, 1000)])


def test_streaming_batches_are_routed_too(spark: Any, tmp_path: Path) -> None:
    """In a streaming query each micro-batch's rows reach their key group's owner."""
    src = tmp_path / "in"
    src.mkdir()
    table = _keys_table(200).select(["i", "s", "i32"])
    pq.write_table(table, src / "part-0.parquet")
    stream = spark.readStream.schema(spark.createDataFrame(table).schema).parquet(str(src))
    seen: list[pa.Table] = []

    def batch(bdf: Any, _bid: int) -> None:
        seen.append(bdf.select("i", "s", "i32", KG_COLUMN,
                               F.spark_partition_id().alias("p")).toArrow())
    q = (with_key_groups(stream, ["s", "i32"], 128, 3).writeStream.foreachBatch(batch)
         .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start())
    q.awaitTermination()
    got = pa.concat_tables(seen).sort_by("i")
    assert got["i"].to_pylist() == list(range(200))
    kg = got[KG_COLUMN].to_numpy()
    np.testing.assert_array_equal(got["p"].to_numpy(), owner_of(kg, 3, 128))
    np.testing.assert_array_equal(key_group_of(got, 128, ["s", "i32"]), kg)


def test_bad_inputs_are_refused_before_any_job(spark: Any) -> None:
    """Reserved column names (any case), missing key columns, bad K or P raise specific errors."""
    df = spark.range(3).withColumnRenamed("id", "k")
    for taken in (KG_COLUMN, ROUTE_COLUMN, KG_COLUMN.upper()):
        with pytest.raises(ReservedColumnError, match=taken.lower()):
            with_key_groups(df.withColumn(taken, F.lit(1)), "k", 8, 2)
    with pytest.raises(KeyError, match="'x'"):
        with_key_groups(df, ["k", "x"], 8, 2)
    with pytest.raises(KeyGroupsError, match="num_partitions 9 > key_groups 8"):
        with_key_groups(df, "k", 8, 9)
    with pytest.raises(KeyGroupsError, match="key_groups must be in"):
        with_key_groups(df, "k", 0, 1)
    with pytest.raises(TypeError, match="key_groups"):
        with_key_groups(df, "k", 8.0, 2)
    with pytest.raises(TypeError, match="key must be"):
        with_key_groups(df, [], 8, 2)
