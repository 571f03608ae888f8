"""`sguard.keygroups` (numpy side): Flink's key-group ranges, key groups of every key type,
and the route values (checked with an independent pure-Python Murmur3)."""
from __future__ import annotations

import datetime as dt
import doctest

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sguard.keygroups as kgmod
from sguard.keygroups import (DEFAULT_KEY_GROUPS, MAX_KEY_GROUPS, KeyGroupsError,
                              check_key_groups, key_group_of, key_group_range, key_group_ranges,
                              owner_of, route_values)
from sguard.partitioning import PartitioningError, murmur3_hash

# -- an independent reference: Spark's Murmur3_x86_32.hashInt, one int at a time ---------------
_M = 0xFFFFFFFF


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M


def _spark_hash_int(v: int, seed: int = 42) -> int:
    """Murmur3_x86_32.hashInt(v, seed) as a signed Java int (pure Python, per value)."""
    k1 = (v & _M) * 0xCC9E2D51 & _M
    k1 = _rotl(k1, 15) * 0x1B873593 & _M
    h1 = _rotl(seed ^ k1, 13)
    h1 = (h1 * 5 + 0xE6546B64) & _M
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & _M
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & _M
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 >= 1 << 31 else h1


def test_reference_hash_matches_values_spark_printed() -> None:
    """The reference gives Spark's `SELECT hash(0), hash(1)` (the values in murmur3_hash's docs)."""
    assert [_spark_hash_int(0), _spark_hash_int(1)] == [933211791, -559580957]
    xs = np.array([0, 1, -1, 7, 2**31 - 1, -2**31, 123456], np.int32)
    assert murmur3_hash(xs).tolist() == [_spark_hash_int(int(x)) for x in xs]


# -- ranges and owners --------------------------------------------------------------------------
@given(st.data())
def test_owner_and_ranges_agree_for_every_partition(data: st.DataObject) -> None:
    """owner(kg) == p exactly on [lo(p), hi(p)): the ranges tile [0, K) in order, none empty."""
    K = data.draw(st.integers(1, MAX_KEY_GROUPS), label="K")
    P = data.draw(st.integers(1, K), label="P")
    b = key_group_ranges(P, K)
    assert b[0] == 0 and b[-1] == K and len(b) == P + 1
    sizes = np.diff(b)
    assert sizes.min() >= 1 and sizes.max() - sizes.min() <= 1   # balanced: K//P or K//P + 1
    owners = owner_of(np.arange(K), P, K)
    assert owners.dtype == np.int32
    np.testing.assert_array_equal(owners, np.repeat(np.arange(P), sizes))
    ps = {0, P - 1, *data.draw(st.lists(st.integers(0, P - 1), max_size=20), label="ps")}
    for p in ps:
        lo, hi = key_group_range(p, P, K)
        assert (lo, hi) == (b[p], b[p + 1])
        # Flink's computeKeyGroupRangeForOperatorIndex (inclusive end)
        assert lo == (p * K + P - 1) // P and hi - 1 == ((p + 1) * K - 1) // P
        assert owner_of(lo, P, K) == p == owner_of(hi - 1, P, K)
        if lo > 0:
            assert owner_of(lo - 1, P, K) == p - 1
    kg = data.draw(st.integers(0, K - 1), label="kg")
    assert owner_of(kg, P, K) == kg * P // K == int(owners[kg])


def test_examples_of_ranges() -> None:
    """A few ranges written out (P = K is the identity, P = 1 owns everything)."""
    assert [key_group_range(p, 3, 8) for p in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert [key_group_range(p, 4, 4) for p in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert key_group_range(0, 1, DEFAULT_KEY_GROUPS) == (0, DEFAULT_KEY_GROUPS)
    assert key_group_range(4, 5, 128) == (103, 128)


def test_bad_key_groups_and_partitions_are_refused() -> None:
    """Non-integers, out-of-range K, P > K, a partition or key group outside its range."""
    for bad in (1.0, "8", True, None):
        with pytest.raises(TypeError, match="key_groups"):
            check_key_groups(bad)
    for bad in (0, -1, MAX_KEY_GROUPS + 1):
        with pytest.raises(KeyGroupsError, match=rf"key_groups must be in \[1, 32768\], got {bad}"):
            check_key_groups(bad)
    assert check_key_groups(np.int64(MAX_KEY_GROUPS), 1) == MAX_KEY_GROUPS
    with pytest.raises(KeyGroupsError, match="num_partitions 9 > key_groups 8"):
        check_key_groups(8, 9)
    with pytest.raises(KeyGroupsError, match="num_partitions must be >= 1"):
        check_key_groups(8, 0)
    with pytest.raises(TypeError, match="num_partitions"):
        check_key_groups(8, 2.0)
    with pytest.raises(KeyGroupsError, match=r"partition 3 is not in \[0, 3\)"):
        key_group_range(3, 3, 8)
    with pytest.raises(KeyGroupsError, match=r"key group 8 is not in \[0, 8\)"):
        owner_of(8, 2, 8)
    with pytest.raises(KeyGroupsError, match=r"key group -1 is not in \[0, 8\)"):
        owner_of(np.array([0, -1]), 2, 8)
    with pytest.raises(TypeError, match="float64"):
        owner_of(np.array([0.0]), 2, 8)
    with pytest.raises(KeyGroupsError, match="num_partitions"):
        route_values(0)
    with pytest.raises(KeyGroupsError, match="num_partitions"):
        route_values(MAX_KEY_GROUPS + 1)
    with pytest.raises(TypeError, match="num_partitions"):
        route_values(2.0)  # type: ignore[arg-type]


# -- key groups of keys -------------------------------------------------------------------------
def _columns(n: int) -> dict[str, pa.Array]:
    """One Arrow column of every key type sguard keys state on, each with nulls."""
    rng = np.random.default_rng(5)
    null = rng.random((8, n)) < 0.15
    strs = ["".join(chr(int(c)) for c in rng.integers(32, 0x2FFF, int(rng.integers(0, 9))))
            for _ in range(n)]
    utc = dt.timezone.utc

    def m(i: int, vals: list) -> list:
        return [None if null[i][j] else v for j, v in enumerate(vals)]
    return {
        "s": pa.array(m(0, strs), pa.string()),
        "ls": pa.array(m(1, strs), pa.large_string()),
        "b": pa.array(m(2, [s.encode()[:5] for s in strs]), pa.binary()),
        "f": pa.array(m(3, [bool(x) for x in rng.integers(0, 2, n)]), pa.bool_()),
        "d": pa.array(m(4, [dt.date(1960, 1, 1) + dt.timedelta(days=int(x))
                            for x in rng.integers(0, 40000, n)]), pa.date32()),
        "t": pa.array(m(5, [dt.datetime(1965, 1, 1, tzinfo=utc) + dt.timedelta(microseconds=int(x))
                            for x in rng.integers(0, 2**51, n)]), pa.timestamp("us", tz="UTC")),
        "i8": pa.array(m(6, rng.integers(-128, 128, n).tolist()), pa.int8()),
        "i64": pa.array(m(7, rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64).tolist()),
                        pa.int64()),
    }


@pytest.mark.parametrize("cols", [["s"], ["ls"], ["b"], ["f"], ["d"], ["t"], ["i8"], ["i64"],
                                  ["s", "f"], ["i8", "s", "d"], ["t", "b", "i64"]])
@pytest.mark.parametrize("K", [1, 8, 128, MAX_KEY_GROUPS])
def test_key_group_is_pmod_of_the_chained_hash(cols: list[str], K: int) -> None:
    """key_group_of == pmod(hash(cols...), K) from a table, a mapping, or one column; nulls too."""
    table = pa.table(_columns(500))
    h = murmur3_hash(table.select(cols)).astype(np.int64)
    want = np.mod(h, K)
    got = key_group_of(table, K, cols)
    assert got.dtype == np.int32 and got.min() >= 0 and got.max() < K
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(key_group_of({c: table[c] for c in cols}, K), want)
    np.testing.assert_array_equal(key_group_of(table.select(cols), K), want)
    if len(cols) == 1:
        np.testing.assert_array_equal(key_group_of(table[cols[0]], K), want)
        np.testing.assert_array_equal(key_group_of(table, K, cols[0]), want)
    nulls = pa.table({c: pa.nulls(3, table.schema.field(c).type) for c in cols})
    assert key_group_of(nulls, K).tolist() == [42 % K] * 3   # an all-null key hashes to the seed


def test_key_group_of_numpy_columns_and_nesting() -> None:
    """numpy keys hash as Spark's types; groups of K refine those of K' when K' divides K."""
    rng = np.random.default_rng(9)
    keys = {"a": rng.integers(-2**31, 2**31, 5000).astype(np.int32),
            "b": rng.integers(-2**62, 2**62, 5000)}
    h = murmur3_hash(keys["b"], seed=murmur3_hash(keys["a"]))
    np.testing.assert_array_equal(key_group_of(keys, 128), np.mod(h.astype(np.int64), 128))
    np.testing.assert_array_equal(key_group_of(keys, 128, ["b"]),
                                  np.mod(murmur3_hash(keys["b"]).astype(np.int64), 128))
    np.testing.assert_array_equal(key_group_of(keys, 128) % 8, key_group_of(keys, 8))
    np.testing.assert_array_equal(key_group_of(np.array([0, 1], np.int32), 128),
                                  [933211791 % 128, -559580957 % 128])


def test_key_group_of_refuses_bad_arguments() -> None:
    """Missing columns, columns for a single column, bad K, unsupported key types."""
    t = pa.table({"a": [1, 2]})
    with pytest.raises(KeyError, match="'x'"):
        key_group_of(t, 8, ["a", "x"])
    with pytest.raises(KeyError, match="'x'"):
        key_group_of({"a": np.zeros(2)}, 8, "x")
    with pytest.raises(TypeError, match="single column"):
        key_group_of(np.zeros(2, np.int64), 8, "a")
    with pytest.raises(TypeError, match="at least one key column"):
        key_group_of(t, 8, [])
    with pytest.raises(KeyGroupsError, match="key_groups"):
        key_group_of(t, 0)
    with pytest.raises(PartitioningError, match="uint64"):
        key_group_of(np.zeros(2, np.uint64), 8)


# -- route values -------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [1, 2, 3, 5, 7, 8, 128, 1000])
def test_route_values_are_the_smallest_ints_spark_sends_to_each_partition(P: int) -> None:
    """pmod(hashInt(r_p), P) == p by the reference hash, and no smaller value lands in p."""
    r = route_values(P)
    assert r.dtype == np.int32 and r.shape == (P,) and not r.flags.writeable
    assert [_spark_hash_int(int(v)) % P for v in r] == list(range(P))
    upto = int(r.max())
    lands = np.mod(np.array([_spark_hash_int(v) for v in range(upto + 1)], np.int64), P)
    first = {}
    for v, p in enumerate(lands.tolist()):
        first.setdefault(p, v)
    assert [first[p] for p in range(P)] == r.tolist()


def test_route_values_exist_for_the_largest_partition_count() -> None:
    """Every one of MAX_KEY_GROUPS partitions gets a distinct non-negative route value."""
    r = route_values(MAX_KEY_GROUPS)
    assert r.min() >= 0 and len(np.unique(r)) == MAX_KEY_GROUPS
    np.testing.assert_array_equal(np.mod(murmur3_hash(r).astype(np.int64), MAX_KEY_GROUPS),
                                  np.arange(MAX_KEY_GROUPS))
    assert route_values(MAX_KEY_GROUPS) is r   # cached


def test_docstring_examples() -> None:
    """The Examples sections of sguard.keygroups run."""
    res = doctest.testmod(kgmod, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0
