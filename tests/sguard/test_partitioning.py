"""`sguard.partitioning` against real Spark: the hash and the partition of every key."""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from sguard.partitioning import PartitioningError, murmur3_hash, partition_of, spark_type_of

pyspark = pytest.importorskip("pyspark")
from pyspark.sql import DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql import types as T  # noqa: E402


def _random_columns(seed: int, n: int) -> list[tuple[str, Any, list[Any], Any]]:
    """(name, spark type, python values, numpy/arrow column) for every supported key type."""
    rng = np.random.default_rng(seed)
    ints = rng.integers(-2**31, 2**31, n).astype(np.int32)
    ints[:3] = [0, -1, 2**31 - 1]
    longs = rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64)
    longs[:3] = [0, -1, -2**63]
    dbl = rng.normal(scale=1e6, size=n)
    dbl[:6] = [0.0, -0.0, np.inf, -np.inf, 1.5, -1.5]
    flt = dbl.astype(np.float32)
    strs = ["".join(chr(int(c)) for c in rng.integers(32, 0x2FFF, int(rng.integers(0, 13))))
            for _ in range(n)]
    strs[:6] = ["", "a", "ab", "abc", "abcd", "\u00e9\u00e9\u00e9"]
    raw = [s.encode() for s in strs]
    smallint = rng.integers(-2**15, 2**15, n).astype(np.int16)
    u32 = rng.integers(0, 2**32, n).astype(np.uint32)
    return [
        ("int", T.IntegerType(), [int(x) for x in ints], ints),
        ("long", T.LongType(), [int(x) for x in longs], longs),
        ("double", T.DoubleType(), [float(x) for x in dbl], dbl),
        ("float", T.FloatType(), [float(x) for x in flt], flt),
        ("short", T.ShortType(), [int(x) for x in smallint], smallint),
        ("uint32 as long", T.LongType(), [int(x) for x in u32], u32),
        ("string/arrow", T.StringType(), strs, pa.array(strs, pa.string())),
        ("string/object", T.StringType(), strs, np.array(strs, dtype=object)),
        ("binary/S", T.BinaryType(), raw, np.array(raw, dtype=f"S{max(map(len, raw)) + 3}")),
        ("binary/large", T.BinaryType(), raw, pa.array(raw, pa.large_binary())),
    ]


def _frame(spark: SparkSession, typ: Any, values: list[Any]) -> DataFrame:
    rows = [(i, v) for i, v in enumerate(values)]
    schema = T.StructType([T.StructField("i", T.LongType()), T.StructField("k", typ)])
    return spark.createDataFrame(rows, schema)


@pytest.mark.parametrize("seed", [0])
def test_hash_and_partition_match_spark_on_random_keys(spark: SparkSession, seed: int) -> None:
    """hash(k) and spark_partition_id() after repartition(P, k) equal ours for every key."""
    for name, typ, values, column in _random_columns(seed, 400):
        df = _frame(spark, typ, values)
        got = df.select("i", F.hash("k").alias("h")).orderBy("i").collect()
        want = np.array([r.h for r in got], np.int32)
        ours = murmur3_hash(column)
        bad = np.flatnonzero(ours != want)
        assert not len(bad), f"{name}: hash differs at {values[bad[0]]!r}: {ours[bad[0]]} vs {want[bad[0]]}"
        for P in (1, 3, 8):
            rows = df.repartition(P, "k").select("i", F.spark_partition_id().alias("p")).collect()
            where = np.empty(len(values), np.int64)
            where[[r.i for r in rows]] = [r.p for r in rows]
            np.testing.assert_array_equal(partition_of(column, P), where, err_msg=f"{name} P={P}")


def test_nan_negative_zero_and_nulls_go_where_spark_sends_them(spark: SparkSession) -> None:
    """-0.0 with 0.0, every NaN with the canonical NaN, a null to pmod(42, P)."""
    nans = np.array([np.nan, -np.nan, 0.0, -0.0], np.float64)
    nans.view(np.uint64)[1] = 0x7FF0000000000001  # a non-canonical NaN
    df = spark.createDataFrame([(0, float("nan")), (1, 0.0), (2, -0.0), (3, None)],
                               "i long, k double")
    want = {r.i: r.h for r in df.select("i", F.hash("k").alias("h")).collect()}
    h = murmur3_hash(nans)
    assert h[0] == h[1] == want[0]
    assert h[2] == h[3] == want[1] == want[2]
    nullable = pa.array([None, "a", None], pa.string())
    assert murmur3_hash(nullable).tolist()[0] == want[3] == 42
    assert partition_of(nullable, 5).tolist()[2] == 42 % 5


def test_fixed_width_bytes_hash_without_their_padding() -> None:
    """An S<n> key hashes as its bytes up to the trailing NULs, whatever the width."""
    a = np.array([b"", b"a", b"abcde"], dtype="S5")
    b = np.array([b"", b"a", b"abcde"], dtype="S16")
    np.testing.assert_array_equal(murmur3_hash(a), murmur3_hash(b))
    np.testing.assert_array_equal(murmur3_hash(a), murmur3_hash(pa.array([b"", b"a", b"abcde"])))


def test_pmod_nests_across_partition_counts() -> None:
    """pmod(h, P) == pmod(pmod(h, M), P) when P divides M (what rescale's routing relies on)."""
    keys = np.random.default_rng(3).integers(-2**62, 2**62, 50_000)
    for P, M in [(2, 4), (3, 12), (1, 7), (4, 8)]:
        np.testing.assert_array_equal(partition_of(keys, M) % P, partition_of(keys, P))


def test_unsupported_key_types_and_partition_counts_are_refused() -> None:
    """uint64, structured and complex keys, and P < 1 raise errors naming the fault."""
    with pytest.raises(PartitioningError, match="uint64"):
        partition_of(np.zeros(3, np.uint64), 2)
    with pytest.raises(PartitioningError, match="structured"):
        spark_type_of([("a", "<i4"), ("b", "<i4")])
    with pytest.raises(PartitioningError, match="complex"):
        murmur3_hash(np.zeros(2, np.complex128))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_partitions"):
            partition_of(np.zeros(3, np.int64), bad)  # type: ignore[arg-type]


def _typed_keys(n: int) -> tuple[T.StructType, list[tuple[Any, ...]], pa.Table]:
    """Rows of every key type sguard.spark keys state on, each column with nulls."""
    import datetime as dt
    rng = np.random.default_rng(7)
    utc = dt.timezone.utc
    rows = []
    for i in range(n):
        null = rng.random(5) < 0.15
        s = "".join(chr(int(c)) for c in rng.integers(32, 0x2FFF, int(rng.integers(0, 9))))
        rows.append((i,
                     None if null[0] else s,
                     None if null[1] else s.encode()[: int(rng.integers(0, 7))],
                     None if null[2] else bool(rng.integers(0, 2)),
                     None if null[3] else dt.date(1960, 1, 1) + dt.timedelta(
                         days=int(rng.integers(0, 40000))),
                     None if null[4] else dt.datetime(1965, 1, 1, tzinfo=utc) + dt.timedelta(
                         microseconds=int(rng.integers(0, 2**51)))))
    schema = T.StructType([T.StructField("i", T.LongType()), T.StructField("s", T.StringType()),
                           T.StructField("b", T.BinaryType()),
                           T.StructField("f", T.BooleanType()),
                           T.StructField("d", T.DateType()),
                           T.StructField("t", T.TimestampType())])
    cols = list(zip(*rows))
    table = pa.table({"i": pa.array(cols[0], pa.int64()), "s": pa.array(cols[1], pa.string()),
                      "b": pa.array(cols[2], pa.binary()), "f": pa.array(cols[3], pa.bool_()),
                      "d": pa.array(cols[4], pa.date32()),
                      "t": pa.array(cols[5], pa.timestamp("us", tz="UTC"))})
    return schema, rows, table


@pytest.mark.parametrize("cols", [["s"], ["b"], ["f"], ["d"], ["t"], ["s", "f"],
                                  ["f", "s", "d"], ["t", "b", "s"], ["d", "i"]])
def test_typed_nullable_and_composite_keys_go_where_spark_sends_them(
        spark: SparkSession, cols: list[str]) -> None:
    """spark_partition_id() after repartition(P, *cols) equals ours, nulls and composites too."""
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    schema, rows, table = _typed_keys(300)
    df = spark.createDataFrame(rows, schema)
    got = df.select("i", F.hash(*cols).alias("h")).orderBy("i").collect()
    want = np.array([r.h for r in got], np.int32)
    np.testing.assert_array_equal(murmur3_hash(table.select(cols)), want, err_msg=str(cols))
    for P in (3, 8):
        rows_p = df.repartition(P, *cols).select("i", F.spark_partition_id().alias("p")).collect()
        where = np.empty(len(rows), np.int64)
        where[[r.i for r in rows_p]] = [r.p for r in rows_p]
        np.testing.assert_array_equal(partition_of(table.select(cols), P), where,
                                      err_msg=f"{cols} P={P}")
    if len(cols) > 1:  # an all-null composite key hashes to the seed
        nulls = pa.table({c: pa.nulls(2, table.schema.field(c).type) for c in cols})
        assert murmur3_hash(nulls).tolist() == [42, 42]
