"""Key-group routing on Spark: each row to the partition that owns its key group.

`with_key_groups` adds the int32 column `KG_COLUMN` (``_sguard_kg``), the
row's key group ``pmod(hash(c1, c2, ...), K)`` computed by the JVM (Spark's own
Murmur3, seed 42; no Python UDF), and shuffles the rows with Spark's ordinary
``repartition(P, route)``, where ``route`` is the IntegerType value
``r_{owner(kg)}`` of `sguard.keygroups.route_values`: Spark's hash partitioning
of ``r_p`` lands in ``p``, so after the shuffle ``spark_partition_id() ==
kg * P // K`` for every row (see `sguard.keygroups` for the ranges). The route
column is dropped again; the key-group column stays, for the runtime to split
each batch by key group.

The key group of a row equals `sguard.keygroups.key_group_of` of its decoded key
columns, so offline tools find the same group without Spark.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from sguard.keygroups import check_key_groups, route_values
from sguard.spark.columns import KG_COLUMN
from sguard.spark.errors import SparkStateError
from sguard.spark.keys import key_columns

__all__ = ["KG_COLUMN", "ROUTE_COLUMN", "ReservedColumnError", "key_group_column",
           "route_column", "with_key_groups"]


ROUTE_COLUMN: Final = "_sguard_route"
"""The transient int32 column the rows are repartitioned by (dropped after the shuffle)."""


class ReservedColumnError(SparkStateError, ValueError):
    """The input already has a column sguard adds (`KG_COLUMN` or `ROUTE_COLUMN`)."""


def key_group_column(key_cols: str | Sequence[str], key_groups: int) -> Any:
    """The Spark Column ``pmod(hash(key_cols...), K)`` as IntegerType (a JVM expression).

    Raises
    ------
    TypeError
        A bad `key_cols` (see `sguard.spark.keys.key_columns`) or a non-integer `key_groups`.
    sguard.keygroups.KeyGroupsError
        `key_groups` outside ``[1, MAX_KEY_GROUPS]``.
    """
    from pyspark.sql import functions as F

    k = check_key_groups(key_groups)
    cols = key_columns(key_cols)
    return F.pmod(F.hash(*[F.col(c) for c in cols]), F.lit(k)).cast("int")


def route_column(kg: Any, num_partitions: int, key_groups: int) -> Any:
    """The IntegerType Column ``r_{kg * P // K}``: Spark's ``repartition(P, it)`` sends a row
    to the partition that owns key group `kg` (a Column of ints in ``[0, K)``).

    Raises
    ------
    TypeError, sguard.keygroups.KeyGroupsError
        See `sguard.keygroups.check_key_groups`.
    """
    from pyspark.sql import functions as F

    k = check_key_groups(key_groups, num_partitions)
    P = int(num_partitions)
    # one SQL array literal (one JVM call even for P = 32768); values < 2**31 parse as INT
    routes = F.expr("array(" + ", ".join(str(int(r)) for r in route_values(P)) + ")")
    # owner = kg * P // K. The double quotient floors exactly: kg * P < 2**30 and K <= 2**15,
    # so a non-integer quotient is >= 2**-30 (relative) from the next integer, far above the
    # 2**-53 rounding of a double.
    owner = F.floor(kg.cast("long") * F.lit(P) / F.lit(k))
    return F.element_at(routes, (owner + F.lit(1)).cast("int")).cast("int")


def with_key_groups(df: Any, key_cols: str | Sequence[str], key_groups: int,
                    num_partitions: int) -> Any:
    """`df` with its key-group column, shuffled into the partitions that own the key groups.

    Parameters
    ----------
    df : pyspark.sql.DataFrame
        Batch or streaming.
    key_cols : str or sequence of str
        The key column(s), in key order (the order of the chained hash).
    key_groups : int
        ``K``, the state's number of key groups.
    num_partitions : int
        ``P <= K``.

    Returns
    -------
    pyspark.sql.DataFrame
        ``df``'s columns plus `KG_COLUMN` (int32, ``pmod(hash(key_cols...), K)``),
        ``repartition(num_partitions, route)``-ed: partition ``p`` holds exactly the rows
        whose key group lies in `sguard.keygroups.key_group_range` ``(p, P, K)``.

    Raises
    ------
    TypeError, sguard.keygroups.KeyGroupsError
        Bad `key_cols`, `key_groups` or `num_partitions` (see
        `sguard.keygroups.check_key_groups`).
    ReservedColumnError
        `df` already has a column named `KG_COLUMN` or `ROUTE_COLUMN`.
    KeyError
        A key column missing from `df`.
    """
    k = check_key_groups(key_groups, num_partitions)
    cols = key_columns(key_cols)
    names = list(df.columns)
    lower = {c.lower() for c in names}   # Spark resolves column names case-insensitively
    taken = [c for c in (KG_COLUMN, ROUTE_COLUMN) if c in lower]
    if taken:
        raise ReservedColumnError(f"the input already has column(s) {taken}: sguard adds them "
                                  f"to route rows by key group; rename them")
    missing = [c for c in cols if c not in names]
    if missing:
        raise KeyError(f"key column(s) {missing} not in the input's columns {names}")
    out = df.withColumn(KG_COLUMN, key_group_column(cols, k))
    out = out.withColumn(ROUTE_COLUMN, route_column(out[KG_COLUMN], num_partitions, k))
    return out.repartition(int(num_partitions), ROUTE_COLUMN).drop(ROUTE_COLUMN)
