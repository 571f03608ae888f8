"""Key groups: keys hashed into K fixed groups, each partition owning a contiguous range.

A stateful query's keys fall into ``K`` *key groups* (Flink's "max parallelism"),
``K`` fixed when its state URI is created (`default_key_groups` unless given,
``1 <= K <= MAX_KEY_GROUPS``). State is stored by key group, so changing the
number of partitions ``P`` reassigns whole key groups and never re-hashes a row.

* A key's group is ``pmod(murmur3(key columns chained, seed 42), K)``
  (`key_group_of`): Spark SQL's ``pmod(hash(c1, c2, ...), K)``, which the Spark
  side computes on the JVM (`sguard.spark.keygroups`); this module computes the
  same on decoded keys with `sguard.partitioning.murmur3_hash` (offline tools,
  tests).
* Partition ``p`` of ``P`` owns the key groups ``[lo(p), hi(p))`` with Flink's
  formulas (`key_group_range`, `owner_of`)::

      owner(kg) = kg * P // K        lo(p) = ceil(p * K / P)        hi(p) = lo(p + 1)

  so ``owner(kg) == p`` exactly when ``lo(p) <= kg < hi(p)``; the ranges tile
  ``[0, K)`` in order, and none is empty when ``P <= K`` (`check_key_groups`).
* Rows reach their owner through Spark's own ``repartition(P, col)``:
  `route_values` gives, for each ``p``, an int32 ``r_p`` whose Spark hash lands
  in ``p`` (``pmod(hashInt(r_p), P) == p``); repartitioning by the column
  ``r_{owner(kg)}`` sends each row to the partition that owns its key group.

No pyspark import here: the runtime and the offline tools share this module.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from sguard.partitioning import SEED, murmur3_hash, pmod

__all__ = ["DEFAULT_KEY_GROUPS", "KEY_GROUPS_PER_PARTITION", "MAX_KEY_GROUPS", "default_key_groups", "KeyGroupsError", "check_key_groups",
           "key_group_range", "key_group_ranges", "owner_of", "key_group_of", "route_values"]

DEFAULT_KEY_GROUPS: Final = 16
"""K of an `OperatorLayout` made without ``key_groups`` (tools, tests); a query started
without ``key_groups=`` takes `default_key_groups` of its partition count."""

KEY_GROUPS_PER_PARTITION: Final = 8
"""`default_key_groups`: a state can scale out to 8x the partitions it started with. Each
key group of a partition costs its operator instance a call per batch (about 0.1-0.3 ms
on this machine) and its structures' first pages, so K/P stays small by default."""

MAX_KEY_GROUPS: Final = 32768
"""The largest number of key groups (Flink's bound; psid blocks of ``2**16`` per group fit)."""


def default_key_groups(num_partitions: int) -> int:
    """K for a new state URI of `num_partitions` partitions when none is given:
    ``min(MAX_KEY_GROUPS, max(num_partitions, KEY_GROUPS_PER_PARTITION * num_partitions))``."""
    return min(MAX_KEY_GROUPS, max(int(num_partitions), KEY_GROUPS_PER_PARTITION * int(num_partitions)))


class KeyGroupsError(ValueError):
    """A number of key groups (or of partitions over them) that cannot be used."""


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_key_groups(key_groups: Any, num_partitions: Any = None) -> int:
    """Validate a number of key groups ``K`` (and a partition count ``P`` over them).

    Parameters
    ----------
    key_groups : int
        ``K``, in ``[1, MAX_KEY_GROUPS]``.
    num_partitions : int, optional
        ``P``, an integer ``>= 1`` and ``<= K`` (each partition owns at least one key group).

    Returns
    -------
    int
        ``K`` as a Python int.

    Raises
    ------
    TypeError
        If `key_groups` or `num_partitions` is not an integer (bool included).
    KeyGroupsError
        If ``K`` is outside ``[1, MAX_KEY_GROUPS]``, ``P < 1``, or ``P > K``.

    Examples
    --------
    >>> check_key_groups(128, 4)
    128
    """
    if not _is_int(key_groups):
        raise TypeError(f"key_groups must be an integer, got {key_groups!r} "
                        f"({type(key_groups).__name__})")
    k = int(key_groups)
    if not 1 <= k <= MAX_KEY_GROUPS:
        raise KeyGroupsError(f"key_groups must be in [1, {MAX_KEY_GROUPS}], got {k}")
    if num_partitions is not None:
        if not _is_int(num_partitions):
            raise TypeError(f"num_partitions must be an integer, got {num_partitions!r} "
                            f"({type(num_partitions).__name__})")
        p = int(num_partitions)
        if p < 1:
            raise KeyGroupsError(f"num_partitions must be >= 1, got {p}")
        if p > k:
            raise KeyGroupsError(f"num_partitions {p} > key_groups {k}: a partition would own "
                                 f"no key group (the state's key_groups bounds its partitions)")
    return k


def key_group_range(partition: int, num_partitions: int, key_groups: int) -> tuple[int, int]:
    """The key groups ``[lo, hi)`` partition `partition` of `num_partitions` owns.

    ``lo = ceil(p * K / P)``, ``hi = ceil((p + 1) * K / P)`` (Flink's
    ``computeKeyGroupRangeForOperatorIndex``, with an exclusive end).

    Raises
    ------
    TypeError, KeyGroupsError
        See `check_key_groups`; `KeyGroupsError` also if `partition` is not in ``[0, P)``.

    Examples
    --------
    >>> [key_group_range(p, 3, 8) for p in range(3)]
    [(0, 3), (3, 6), (6, 8)]
    """
    k = check_key_groups(key_groups, num_partitions)
    P = int(num_partitions)
    if not _is_int(partition):
        raise TypeError(f"partition must be an integer, got {partition!r}")
    p = int(partition)
    if not 0 <= p < P:
        raise KeyGroupsError(f"partition {p} is not in [0, {P})")
    return -(-p * k // P), -(-(p + 1) * k // P)


def key_group_ranges(num_partitions: int, key_groups: int) -> npt.NDArray[np.int64]:
    """The boundaries ``[lo(0), lo(1), ..., lo(P) = K]`` of every partition's range, at once.

    Partition ``p`` owns ``[b[p], b[p + 1])``. Raises as `check_key_groups`.

    Examples
    --------
    >>> key_group_ranges(3, 8).tolist()
    [0, 3, 6, 8]
    """
    k = check_key_groups(key_groups, num_partitions)
    P = int(num_partitions)
    return -(-np.arange(P + 1, dtype=np.int64) * k // P)


def owner_of(key_group: Any, num_partitions: int, key_groups: int) -> Any:
    """The partition that owns each key group: ``kg * P // K``.

    Parameters
    ----------
    key_group : int or integer array
        Key groups in ``[0, K)``.

    Returns
    -------
    int, or int32 array of the same shape

    Raises
    ------
    TypeError, KeyGroupsError
        See `check_key_groups`; `KeyGroupsError` also for a key group outside ``[0, K)``.

    Examples
    --------
    >>> owner_of(np.arange(8), 3, 8).tolist()
    [0, 0, 0, 1, 1, 1, 2, 2]
    """
    k = check_key_groups(key_groups, num_partitions)
    P = int(num_partitions)
    if np.ndim(key_group) == 0:
        if not _is_int(key_group):
            raise TypeError(f"key_group must be an integer, got {key_group!r}")
        g = int(key_group)
        if not 0 <= g < k:
            raise KeyGroupsError(f"key group {g} is not in [0, {k})")
        return g * P // k
    kg = np.asarray(key_group)
    if kg.dtype.kind not in "iu":
        raise TypeError(f"key groups must be integers, got an array of {kg.dtype}")
    kg = kg.astype(np.int64)
    if kg.size and (kg.min() < 0 or kg.max() >= k):
        bad = kg[(kg < 0) | (kg >= k)][0]
        raise KeyGroupsError(f"key group {int(bad)} is not in [0, {k})")
    return (kg * P // k).astype(np.int32)


def key_group_of(keys: Any, key_groups: int, columns: str | Sequence[str] | None = None
                 ) -> npt.NDArray[np.int32]:
    """The key group of every key: ``pmod(hash(c1, c2, ...), K)`` as Spark computes it.

    Parameters
    ----------
    keys : array-like, pyarrow Array / ChunkedArray, pyarrow Table / RecordBatch, or a mapping
        One key column (any type `sguard.partitioning.murmur3_hash` takes, nulls
        included), or a table / ``{name: column}`` mapping whose `columns` (all of
        them, in order, when None) form a composite key, hashed chained: the hash of
        column ``i`` is the seed of column ``i + 1``, and a null leaves it unchanged.
    key_groups : int
        ``K`` (see `check_key_groups`).
    columns : str or sequence of str, optional
        The key columns of a table or mapping, in key order.

    Returns
    -------
    int32 array, one key group in ``[0, K)`` per row

    Runtime complexity: O(total key bytes), one compiled pass per column.

    Raises
    ------
    TypeError, KeyGroupsError
        A bad `key_groups` (see `check_key_groups`); `columns` given for a single column.
    KeyError
        A column of `columns` missing from the table or mapping.
    sguard.partitioning.PartitioningError
        A key type Spark has no hash for.

    Examples
    --------
    >>> key_group_of(np.array([0, 1], np.int32), 128).tolist()  # spark: pmod(hash(0), 128)...
    [15, 99]
    """
    k = check_key_groups(key_groups)
    if isinstance(columns, str):
        columns = [columns]
    if isinstance(keys, (pa.Table, pa.RecordBatch)):
        names = list(columns) if columns is not None else list(keys.schema.names)
        missing = [c for c in names if c not in keys.schema.names]
        if missing:
            raise KeyError(f"key column(s) {missing} not in the table's columns "
                           f"{keys.schema.names}")
        if not names:
            raise TypeError("key_group_of needs at least one key column")
        h = murmur3_hash(keys.select(names))
    elif isinstance(keys, Mapping):
        names = list(columns) if columns is not None else list(keys)
        missing = [c for c in names if c not in keys]
        if missing:
            raise KeyError(f"key column(s) {missing} not in the mapping's keys {list(keys)}")
        if not names:
            raise TypeError("key_group_of needs at least one key column")
        acc: Any = SEED
        for c in names:
            acc = murmur3_hash(keys[c], seed=acc)
        h = acc
    else:
        if columns is not None:
            raise TypeError("columns names the key columns of a table or mapping; "
                            f"keys is a single column ({type(keys).__name__})")
        h = murmur3_hash(keys)
    return pmod(h, k).astype(np.int32)


def route_values(num_partitions: int) -> npt.NDArray[np.int32]:
    """For each partition ``p``, the smallest int32 ``r_p >= 0`` that Spark sends to ``p``.

    ``pmod(hashInt(r_p, seed 42), P) == p``: a row whose IntegerType column holds
    ``r_p`` lands in partition ``p`` under ``repartition(P, column)``. The result
    is cached and read-only.

    Runtime complexity: O(P log P) hashes (a coupon collector over the hash values).

    Raises
    ------
    TypeError, KeyGroupsError
        If `num_partitions` is not an integer in ``[1, MAX_KEY_GROUPS]``.

    Examples
    --------
    >>> route_values(4).tolist()
    [12, 6, 2, 0]
    """
    if not _is_int(num_partitions):
        raise TypeError(f"num_partitions must be an integer, got {num_partitions!r}")
    P = int(num_partitions)
    if not 1 <= P <= MAX_KEY_GROUPS:
        raise KeyGroupsError(f"num_partitions must be in [1, {MAX_KEY_GROUPS}], got {P}")
    return _route_values(P)


@functools.lru_cache(maxsize=64)
def _route_values(P: int) -> npt.NDArray[np.int32]:
    """`route_values` of a validated `P` (searched in chunks of candidate values)."""
    out = np.full(P, -1, np.int64)
    left = P
    start = 0
    chunk = max(1024, 16 * P)
    while left:
        if start > np.iinfo(np.int32).max:  # unreachable for P <= MAX_KEY_GROUPS
            raise KeyGroupsError(f"no int32 value routes to some partition of {P}")
        stop = min(start + chunk, int(np.iinfo(np.int32).max) + 1)
        cand = np.arange(start, stop, dtype=np.int32)
        parts = pmod(murmur3_hash(cand), P)
        first_p, first_i = np.unique(parts, return_index=True)
        new = out[first_p] < 0
        out[first_p[new]] = cand[first_i[new]]
        left -= int(new.sum())
        start = stop
    res = out.astype(np.int32)
    res.flags.writeable = False
    return res
