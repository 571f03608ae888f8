"""sguard.spark.statecodec: state values <-> bytes (round trips, determinism, refusals, schema
evolution, Arrow), checked against PySpark's own conversions."""
from __future__ import annotations

import collections
import datetime
import decimal
import math
import re
import struct
from decimal import Decimal

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql import Row
from pyspark.sql.types import (ArrayType, BinaryType, BooleanType, ByteType, DataType, DateType,
                               DayTimeIntervalType, DecimalType, DoubleType, FloatType,
                               IntegerType, LongType, MapType, NullType, ShortType, StringType,
                               StructField, StructType, TimestampNTZType, TimestampType,
                               UserDefinedType)

from sguard.spark.errors import (SchemaChangedError, SparkStateError, StateSchemaEvolutionError,
                                 StateValueError, UnsupportedStateTypeError)
from sguard.spark.statecodec import StateCodec


def S(*fields: tuple) -> StructType:
    """S(("a", LongType()), ("b", StringType(), False), ...)"""
    return StructType([StructField(f[0], f[1], f[2] if len(f) > 2 else True) for f in fields])


def rt(schema: StructType, value: tuple, var: str = "v") -> tuple:
    c = StateCodec(var, [schema])
    b = c.encode(value)
    assert isinstance(b, bytes)
    assert c.encode(value) == b
    out = c.decode(b)
    assert type(out) is tuple
    assert c.decode(memoryview(b)) == out
    return out


INNER = S(("x", IntegerType()), ("ts", TimestampType()))

# (type, values that come back unchanged)
SAME = [
    (ByteType(), [0, -128, 127]),
    (ShortType(), [0, -2**15, 2**15 - 1]),
    (IntegerType(), [0, -2**31, 2**31 - 1]),
    (LongType(), [0, -2**63, 2**63 - 1, 1]),
    (FloatType(), [0.0, 1.5, -2.0 ** 100, float("inf"), float("-inf"), 2.0 ** -149]),
    (DoubleType(), [0.0, 0.1, -1e308, 5e-324, float("inf"), float("-inf"), 1.7976931348623157e308]),
    (BooleanType(), [True, False]),
    (StringType(), ["", "a", "héllo wörld", "日本語", "\U0001f600" * 300, "\x00"]),
    (BinaryType(), [b"", b"\x00\xff", bytes(range(256)) * 3]),
    (DecimalType(38, 18), [Decimal("0E-18"), Decimal("99999999999999999999.999999999999999999"),
                           Decimal("-99999999999999999999.999999999999999999"),
                           Decimal("0.000000000000000001"), Decimal("-1.000000000000000000")]),
    (DecimalType(10, 2), [Decimal("0.00"), Decimal("99999999.99"), Decimal("-12.30")]),
    (DecimalType(18, 0), [Decimal(10 ** 18 - 1), Decimal(-(10 ** 18 - 1))]),
    (DecimalType(19, 19), [Decimal("0.1234567890123456789"), Decimal("-0.9999999999999999999")]),
    (DateType(), [datetime.date(1970, 1, 1), datetime.date(1, 1, 1), datetime.date(9999, 12, 31),
                  datetime.date(1969, 12, 31)]),
    (TimestampType(), [datetime.datetime(1970, 1, 1), datetime.datetime(1969, 7, 20, 20, 17, 40, 123456),
                       datetime.datetime(1900, 1, 1, 0, 0, 0, 1), datetime.datetime(2262, 4, 11, 23, 47, 16, 854775),
                       datetime.datetime(1969, 12, 31, 23, 59, 59, 999999)]),
    (TimestampNTZType(), [datetime.datetime(1970, 1, 1), datetime.datetime(1, 1, 1, 0, 0, 0, 1),
                          datetime.datetime(9999, 12, 31, 23, 59, 59, 999999),
                          datetime.datetime(1969, 12, 31, 23, 59, 59, 999999)]),
    (ArrayType(LongType()), [[], [1, None, 3], [None], list(range(300))]),
    (ArrayType(LongType(), False), [[], [2**63 - 1, -2**63]]),
    (ArrayType(StringType()), [[], ["", None, "x"], ["a" * 200] * 3]),
    (ArrayType(ArrayType(IntegerType())), [[], [[], None, [1, None]]]),
    (ArrayType(BooleanType()), [[True, False, None, True] * 5]),
    (ArrayType(DecimalType(5, 2)), [[Decimal("1.00"), None, Decimal("-999.99")]]),
    (ArrayType(DateType()), [[datetime.date(2024, 2, 29), None]]),
    (ArrayType(INNER), [[Row(x=1, ts=None), None, Row(x=None, ts=datetime.datetime(2001, 1, 1))]]),
    (MapType(StringType(), LongType()), [{}, {"a": 1, "b": None, "": 0}]),
    (MapType(LongType(), INNER), [{1: Row(x=1, ts=None), 2: None}]),
    (MapType(BinaryType(), BinaryType(), False), [{b"k": b"v", b"": b""}]),
    (MapType(INNER, StringType()), [{Row(x=1, ts=None): "a"}]),
    (MapType(StringType(), MapType(IntegerType(), DoubleType())), [{"a": {1: 1.5, 2: None}, "b": {}}]),
    (INNER, [Row(x=1, ts=datetime.datetime(2020, 5, 17, 1, 2, 3, 4)), Row(x=None, ts=None)]),
    (S(("e", S())), [Row(e=Row())]),
    (NullType(), [None]),
]


@pytest.mark.parametrize("dt,values", SAME, ids=[t.simpleString()[:40] for t, _ in SAME])
def test_round_trip_each_type(dt: DataType, values: list) -> None:
    schema = S(("k", LongType(), False), ("v", dt), ("w", dt))
    for v in values:
        out = rt(schema, (7, v, None))
        assert out == (7, v, None)
        assert type(out[1]) is type(v) or (v is None)
        out = rt(schema, (7, None, v))
        assert out == (7, None, v)
        if isinstance(dt, FloatType | DoubleType):  # -0.0 == 0.0: compare the bits
            assert struct.pack("<d", out[2]) == struct.pack("<d", v)


def test_nested_structs_come_back_as_rows_with_names() -> None:
    schema = S(("a", S(("b", S(("c", LongType()), ("d", StringType()))), ("e", ArrayType(INNER)))))
    out = rt(schema, (((1, "x"), [(2, None)]),))
    assert type(out[0]) is Row and type(out[0].b) is Row and type(out[0].e[0]) is Row
    assert out[0].b.c == 1 and out[0].b.d == "x" and out[0].e[0].x == 2
    assert out[0].asDict(recursive=True) == {"b": {"c": 1, "d": "x"}, "e": [{"x": 2, "ts": None}]}


def test_python_values_as_spark_returns_them() -> None:
    schema = S(("f", FloatType()), ("d", DecimalType(10, 2)), ("b", BinaryType()),
                ("dz", DecimalType(38, 18)), ("ts", TimestampType()), ("dt", DateType()))
    out = rt(schema, (0.1, Decimal("1.555"), bytearray(b"ab"), 0,
                      datetime.datetime(2020, 1, 1, 12, tzinfo=datetime.timezone.utc),
                      datetime.datetime(2020, 3, 4, 5, 6)))
    assert out[0] == struct.unpack("<f", struct.pack("<f", 0.1))[0]  # float32, as Spark stores it
    assert out[1] == Decimal("1.56") and str(out[1]) == "1.56"  # ROUND_HALF_UP to the scale
    assert type(out[2]) is bytes and out[2] == b"ab"
    assert str(out[3]) == "0E-18"  # BigDecimal(0, 18)
    assert out[4] == TimestampType().fromInternal(TimestampType().toInternal(
        datetime.datetime(2020, 1, 1, 12, tzinfo=datetime.timezone.utc)))
    assert out[4].tzinfo is None
    assert out[5] == datetime.date(2020, 3, 4)


def test_nan_and_negative_zero() -> None:
    schema = S(("f", FloatType()), ("d", DoubleType()), ("a", ArrayType(DoubleType())))
    c = StateCodec("v", [schema])
    out = c.decode(c.encode((float("nan"), -0.0, [float("nan"), -0.0])))
    assert math.isnan(out[0]) and math.copysign(1, out[1]) == -1
    assert math.isnan(out[2][0]) and math.copysign(1, out[2][1]) == -1


def test_value_forms_and_numpy_pandas_fields() -> None:
    schema = S(("a", LongType()), ("b", DoubleType()), ("c", BooleanType()), ("d", TimestampType()),
                ("e", ArrayType(IntegerType())), ("f", StringType()))
    c = StateCodec("v", [schema])
    ts = datetime.datetime(2021, 6, 1, 10, 30, 0, 250)
    want = (5, 2.5, True, ts, [1, 2], "s")
    NT = collections.namedtuple("NT", "a b c d e f")
    forms = [want, list(want), Row(*want), Row(a=5, b=2.5, c=True, d=ts, e=[1, 2], f="s"), NT(*want),
             dict(zip("abcdef", want)),
             (np.int64(5), np.float32(2.5), np.bool_(True), pd.Timestamp(ts), np.array([1, 2], np.int32),
              np.str_("s")),
             (np.int8(5), np.float64(2.5), True, np.datetime64(ts, "us"), (np.int64(1), 2), "s")]
    b = c.encode(want)
    for f in forms:
        assert c.encode(f) == b, f
        assert c.decode(c.encode(f)) == want
    assert c.decode(b)[3] == ts and type(c.decode(b)[0]) is int
    assert c.encode({"a": 5}) == c.encode((5, None, None, None, None, None))  # a dict: by name


def test_encode_is_deterministic_and_compact() -> None:
    schema = S(("m", MapType(StringType(), LongType())), ("a", LongType()))
    c = StateCodec("v", [schema])
    m1 = {"x": 1, "y": 2, "z": None}
    m2 = {"z": None, "y": 2, "x": 1}
    assert c.encode((m1, 3)) == c.encode((m2, 3))
    assert c.decode(c.encode((m2, 3))) == (m1, 3)
    one = StateCodec("v", [S(("a", LongType(), False))])
    assert one.encode((1,)) == b"\x00" + struct.pack("<q", 1)  # version tag + the long
    nul = StateCodec("v", [S(("a", LongType()))])
    assert nul.encode((1,)) == b"\x00\x00" + struct.pack("<q", 1)  # + the null bitmap
    assert nul.encode((None,)) == b"\x00\x01" + bytes(8)
    s = StateCodec("v", [S(("s", StringType()), ("a", LongType()))])
    assert s.encode(("ab", 1)) == b"\x00\x00" + struct.pack("<q", 1) + b"\x02ab"
    assert s.encode((None, 1)) == b"\x00\x01" + struct.pack("<q", 1)


def test_many_fields_bitmaps() -> None:
    for n in (7, 8, 9, 17, 24, 33, 65, 70):
        schema = StructType([StructField(f"f{i}", LongType() if i % 3 else StringType()) for i in range(n)])
        for pat in (lambda i: None, lambda i: (i if i % 3 else str(i)),
                    lambda i: None if i % 2 else (i if i % 3 else str(i))):
            v = tuple(pat(i) for i in range(n))
            assert rt(schema, v) == v


def test_encode_many_concatenates() -> None:
    c = StateCodec("l", [S(("s", StringType()), ("a", ArrayType(LongType())))])
    vals = [("a", [1]), (None, None), ("", []), ("x" * 1000, list(range(200)))]
    b = c.encode_many(vals)
    assert b == b"".join(c.encode(v) for v in vals)
    assert c.decode_many(b) == vals
    assert c.decode_many(c.encode_many(vals[:2]) + c.encode_many(vals[2:])) == vals
    assert c.decode_many(b"") == [] and c.encode_many([]) == b""
    assert c.decode_many(memoryview(b)) == vals


BAD = [
    (S(("a", LongType())), ("x",), "a", "str"),
    (S(("a", LongType())), (1.5,), "a", "float"),
    (S(("a", LongType())), (True,), "a", "bool"),
    (S(("a", LongType())), (2 ** 63,), "a", "bigint"),
    (S(("a", IntegerType())), (2 ** 31,), "a", "int"),
    (S(("a", ByteType())), (128,), "a", "tinyint"),
    (S(("a", ShortType())), (-2 ** 15 - 1,), "a", "smallint"),
    (S(("a", FloatType())), (1e300,), "a", "float"),
    (S(("a", DoubleType())), ("1.0",), "a", "str"),
    (S(("a", DoubleType())), (Decimal(1),), "a", "Decimal"),
    (S(("a", BooleanType())), (1,), "a", "int"),
    (S(("a", StringType())), (b"x",), "a", "bytes"),
    (S(("a", StringType())), (1,), "a", "int"),
    (S(("a", StringType())), ("\ud800",), "a", "Unicode"),
    (S(("a", BinaryType())), ("x",), "a", "str"),
    (S(("a", BinaryType())), (3,), "a", "int"),
    (S(("a", DecimalType(5, 2))), (Decimal("1000"),), "a", "decimal(5,2)"),
    (S(("a", DecimalType(5, 2))), (Decimal("999.995"),), "a", "decimal(5,2)"),
    (S(("a", DecimalType(38, 0))), (Decimal("1E+38"),), "a", "decimal(38,0)"),
    (S(("a", DecimalType(5, 2))), (Decimal("NaN"),), "a", "NaN"),
    (S(("a", DecimalType(5, 2))), (1.5,), "a", "float"),
    (S(("a", DateType())), ("2020-01-01",), "a", "str"),
    (S(("a", TimestampType())), (datetime.date(2020, 1, 1),), "a", "date"),
    (S(("a", TimestampType())), (5,), "a", "int"),
    (S(("a", LongType(), False)), (None,), "a", "null"),
    (S(("a", LongType())), (1, 2), None, "2 fields"),
    (S(("a", LongType()), ("b", LongType())), (1,), None, "1 fields"),
    (S(("a", LongType())), 5, None, "int"),
    (S(("a", ArrayType(LongType()))), ([1, "x"],), "a[1]", "str"),
    (S(("a", ArrayType(LongType(), False))), ([1, None],), "a[1]", "null"),
    (S(("a", ArrayType(LongType()))), ([1, 2 ** 64],), "a[1]", "bigint"),
    (S(("a", ArrayType(LongType()))), ("abc",), "a", "str"),
    (S(("a", MapType(StringType(), LongType()))), ({"k": "v"},), "a['k']", "str"),
    (S(("a", MapType(StringType(), LongType()))), ({None: 1},), "a(key)", "null"),
    (S(("a", MapType(StringType(), LongType()))), ({1: 1},), "a(key)", "int"),
    (S(("a", MapType(StringType(), LongType(), False))), ({"k": None, "j": 1},), "a['k']", "null"),
    (S(("a", MapType(StringType(), LongType()))), ([("k", 1)],), "a", "list"),
    (S(("s", S(("t", S(("u", LongType(), False))))),), (((None,),),), "s.t.u", "null"),
    (S(("s", S(("t", LongType())))), ((1, 2),), "s", "2 fields"),
    (S(("s", S(("t", LongType())))), (5,), "s", "int"),
    (S(("s", ArrayType(S(("t", StringType()))))), ([("a",), (1,)],), "s[1].t", "int"),
    (S(("a", NullType())), (1,), "a", "void"),
]


@pytest.mark.parametrize("schema,value,field,word", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_values_are_refused_naming_var_and_field(schema: StructType, value, field, word) -> None:
    c = StateCodec("buf", [schema])
    with pytest.raises(StateValueError) as ei:
        c.encode(value)
    msg = str(ei.value)
    assert "state variable 'buf'" in msg
    if field is not None:
        assert f"field {field!r}" in msg
    assert word in msg
    assert isinstance(ei.value, SparkStateError) and isinstance(ei.value, ValueError)
    with pytest.raises(StateValueError):
        c.encode_many([value])


def test_bad_value_after_good_values_of_the_same_types() -> None:
    c = StateCodec("v", [S(("a", ByteType()), ("b", DoubleType()))])
    assert c.decode(c.encode((1, 2.0))) == (1, 2.0)
    with pytest.raises(StateValueError, match="field 'a'.*300"):
        c.encode((300, 2.0))
    with pytest.raises(StateValueError, match="field 'b'"):
        c.encode((1, 10 ** 400))


class _PointUDT(UserDefinedType):
    @classmethod
    def sqlType(cls) -> DataType:
        return ArrayType(DoubleType(), False)

    @classmethod
    def module(cls) -> str:
        return __name__


@pytest.mark.parametrize("dt,field", [
    (DayTimeIntervalType(), "a"),
    (S(("b", DayTimeIntervalType())), "a.b"),
    (ArrayType(S(("b", _PointUDT()))), "a[].b"),
    (MapType(ArrayType(LongType()), LongType()), "a"),
    (MapType(MapType(LongType(), LongType()), LongType()), "a"),
    (MapType(NullType(), LongType()), "a"),
], ids=["interval", "nested", "udt", "array-key", "map-key", "null-key"])
def test_unsupported_types_are_refused(dt: DataType, field: str) -> None:
    with pytest.raises(UnsupportedStateTypeError) as ei:
        StateCodec("buf", [S(("k", LongType()), ("a", dt))])
    assert f"state variable 'buf', field {field!r}" in str(ei.value)
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, SparkStateError)


def test_other_types_refused_and_collated_strings() -> None:
    from pyspark.sql.types import CharType, TimeType, VarcharType, YearMonthIntervalType
    for dt in (CharType(3), VarcharType(3), TimeType(), YearMonthIntervalType()):
        with pytest.raises(UnsupportedStateTypeError, match=re.escape(f"field 'x': type {dt.simpleString()}")):
            StateCodec("v", [S(("x", dt))])
    schema = S(("x", StringType("UTF8_LCASE")), ("y", ArrayType(StringType("UNICODE_CI"))))
    assert rt(schema, ("Ab", ["c", None])) == ("Ab", ["c", None])
    StateCodec.check_evolution("v", S(("x", StringType())), S(("x", StringType("UTF8_LCASE"))))


def test_many_type_combinations() -> None:
    schema = StructType([StructField(f"f{i}", LongType() if i % 2 else StringType()) for i in range(8)])
    c = StateCodec("v", [schema])
    for mask in range(256):  # more combinations than are remembered
        v = tuple(None if mask >> i & 1 else (i if i % 2 else str(i)) for i in range(8))
        assert c.decode(c.encode(v)) == v
        assert c.decode(c.encode(list(v))) == v
        assert c.encode(v) == c._codec._enc_generic(v)  # generated and field-by-field agree
    with pytest.raises(StateValueError, match="field 'f1'"):
        c.encode(("0", "1") + (None,) * 6)


def test_variant_and_duplicate_names_are_refused() -> None:
    try:
        from pyspark.sql.types import VariantType
    except ImportError:  # pragma: no cover
        pytest.skip("no VariantType")
    with pytest.raises(UnsupportedStateTypeError, match="'v'.*field 'x'.*variant"):
        StateCodec("v", [S(("x", VariantType()))])
    with pytest.raises(UnsupportedStateTypeError, match="duplicate"):
        StateCodec("v", [S(("x", LongType()), ("x", StringType()))])


# -- evolution -------------------------------------------------------------------------------

def test_evolution_add_remove_reorder_widen() -> None:
    v0 = S(("a", ByteType()), ("b", StringType()), ("c", FloatType()), ("gone", LongType()),
           ("s", S(("x", IntegerType()), ("y", StringType()))), ("arr", ArrayType(ShortType())),
           ("m", MapType(StringType(), IntegerType())), ("bin", StringType()), ("str", BinaryType()),
           ("d", DecimalType(10, 2)))
    v1 = S(("new", StringType()), ("s", S(("y", StringType()), ("z", LongType()), ("x", LongType()))),
           ("c", DoubleType()), ("b", StringType()), ("a", LongType()), ("arr", ArrayType(DoubleType())),
           ("m", MapType(StringType(), LongType())), ("bin", BinaryType()), ("str", StringType()),
           ("d", DecimalType(38, 5)))
    old = StateCodec("v", [v0])
    b = old.encode((5, "x", 1.5, 9, (7, "y"), [1, None], {"k": 3}, "héllo", b"\xffok", Decimal("1.25")))
    new = StateCodec("v", [v0, v1])
    assert new.version == 1
    out = new.decode(b)
    assert out == (None, Row(y="y", z=None, x=7), 1.5, "x", 5, [1.0, None], {"k": 3}, "héllo".encode(),
                   "\ufffdok", Decimal("1.25000"))
    assert type(out[5][0]) is float and str(out[9]) == "1.25000"
    assert out[1].__fields__ == ["y", "z", "x"]
    # current bytes carry version 1; old ones still decode
    nb = new.encode(out)
    assert nb[0] == 1 and new.decode(nb) == out
    assert new.decode_many(b + nb) == [out, out]


def test_evolution_int_to_float_and_double() -> None:
    v0 = S(("a", LongType()), ("b", IntegerType()))
    v1 = S(("a", FloatType()), ("b", DoubleType()))
    b = StateCodec("v", [v0]).encode((2 ** 53 + 1, 16777217))
    out = StateCodec("v", [v0, v1]).decode(b)
    assert out == (float(struct.unpack("<f", struct.pack("<f", 2.0 ** 53))[0]), 16777217.0)
    assert all(type(x) is float for x in out)


def test_evolution_many_versions_and_readd() -> None:
    v0 = S(("a", LongType()), ("x", StringType()))
    v1 = S(("a", LongType()))
    v2 = S(("a", LongType()), ("x", LongType()))  # x removed, then added with another type
    v3 = S(("x", DoubleType()), ("a", DoubleType()))
    b0 = StateCodec("v", [v0]).encode((1, "old"))
    b1 = StateCodec("v", [v0, v1]).encode((2,))
    b2 = StateCodec("v", [v0, v1, v2]).encode((3, 4))
    c = StateCodec("v", [v0, v1, v2, v3])
    assert c.decode(b0) == (None, 1.0)  # the string x of v0 is not the x of v2
    assert c.decode(b1) == (None, 2.0)
    assert c.decode(b2) == (4.0, 3.0)
    assert c.decode(c.encode((5, 6))) == (5.0, 6.0)


def test_evolution_nullable_and_nested_containers() -> None:
    v0 = S(("a", LongType(), False), ("arr", ArrayType(S(("p", IntegerType(), False)), False), False),
           ("m", MapType(LongType(), S(("q", StringType())), False)))
    v1 = S(("a", LongType(), True), ("arr", ArrayType(S(("p", LongType()), ("r", StringType())), True)),
           ("m", MapType(LongType(), S(("q", BinaryType()), ("w", DoubleType())), True)))
    b = StateCodec("v", [v0]).encode((1, [(2,), (3,)], {5: ("s",)}))
    out = StateCodec("v", [v0, v1]).decode(b)
    assert out == (1, [Row(p=2, r=None), Row(p=3, r=None)], {5: Row(q=b"s", w=None)})
    assert out[1][0].__fields__ == ["p", "r"]


@pytest.mark.parametrize("old,new,words", [
    (S(("a", LongType())), S(("a", IntegerType())), ["'a'", "bigint -> int"]),
    (S(("a", DoubleType())), S(("a", FloatType())), ["'a'", "double -> float"]),
    (S(("a", DoubleType())), S(("a", LongType())), ["'a'", "double -> bigint"]),
    (S(("a", LongType())), S(("a", StringType())), ["'a'", "bigint -> string"]),
    (S(("a", StringType())), S(("a", LongType())), ["'a'", "string -> bigint"]),
    (S(("a", BooleanType())), S(("a", IntegerType())), ["'a'", "boolean -> int"]),
    (S(("a", DateType())), S(("a", TimestampType())), ["'a'", "date -> timestamp"]),
    (S(("a", TimestampType())), S(("a", TimestampNTZType())), ["'a'", "timestamp -> timestamp_ntz"]),
    (S(("a", DecimalType(10, 2))), S(("a", DecimalType(10, 3))), ["'a'", "decimal(10,2) -> decimal(10,3)"]),
    (S(("a", DecimalType(10, 2))), S(("a", DecimalType(12, 1))), ["'a'", "decimal(10,2) -> decimal(12,1)"]),
    (S(("a", LongType())), S(("a", LongType(), False)), ["'a'", "nullable", "non-nullable"]),
    (S(("a", LongType())), S(("a", LongType()), ("b", LongType(), False)), ["'b'", "non-nullable"]),
    (S(("s", S(("x", IntegerType())))), S(("s", S(("x", ShortType())))), ["'s.x'", "int -> smallint"]),
    (S(("s", S(("x", IntegerType())))), S(("s", LongType())), ["'s'", "struct<x:int> -> bigint"]),
    (S(("a", ArrayType(LongType()))), S(("a", ArrayType(IntegerType()))), ["'a[]'", "bigint -> int"]),
    (S(("a", ArrayType(LongType()))), S(("a", ArrayType(LongType(), False))), ["'a[]'", "non-nullable"]),
    (S(("m", MapType(IntegerType(), LongType()))), S(("m", MapType(LongType(), LongType()))),
     ["'m'", "map key int -> bigint"]),
    (S(("m", MapType(StringType(), LongType()))), S(("m", MapType(StringType(), ByteType()))),
     ["'m[]'", "bigint -> tinyint"]),
    (S(("a", ArrayType(LongType()))), S(("a", LongType())), ["'a'", "array<bigint> -> bigint"]),
])
def test_evolution_refused(old: StructType, new: StructType, words: list[str]) -> None:
    with pytest.raises(StateSchemaEvolutionError) as ei:
        StateCodec("buf", [old, new])
    msg = str(ei.value)
    assert "state variable 'buf'" in msg
    for w in words:
        assert w in msg, msg
    assert isinstance(ei.value, SchemaChangedError) and isinstance(ei.value, ValueError)
    with pytest.raises(StateSchemaEvolutionError):
        StateCodec.check_evolution("buf", old, new)
    StateCodec.check_evolution("buf", old, old)


def test_check_evolution_accepts() -> None:
    for old, new in [
        (S(("a", ByteType())), S(("a", ShortType()))), (S(("a", ShortType())), S(("a", IntegerType()))),
        (S(("a", IntegerType())), S(("a", LongType()))), (S(("a", IntegerType())), S(("a", FloatType()))),
        (S(("a", LongType())), S(("a", DoubleType()))), (S(("a", FloatType())), S(("a", DoubleType()))),
        (S(("a", StringType())), S(("a", BinaryType()))), (S(("a", BinaryType())), S(("a", StringType()))),
        (S(("a", LongType(), False)), S(("a", LongType()))), (S(("a", LongType())), S()),
        (S(("a", LongType()), ("b", LongType())), S(("b", LongType()), ("a", LongType()))),
        (S(("a", NullType())), S(("a", StringType()))),
        (S(("a", DecimalType(10, 2))), S(("a", DecimalType(20, 4)))),
    ]:
        StateCodec.check_evolution("v", old, new)
        c = StateCodec("v", [old, new])
        assert c.version == 1


def test_unknown_version_is_refused() -> None:
    c = StateCodec("v", [S(("a", LongType()))])
    b = StateCodec("v", [S(("a", LongType())), S(("a", LongType()))]).encode((1,))
    with pytest.raises(StateValueError, match="version 1"):
        c.decode(b)


def test_many_versions_varint_tag() -> None:
    schemas = [S(("a", LongType()))] * 200
    c = StateCodec("v", schemas)
    b = c.encode((1,))
    assert b[:2] == bytes([0xC7, 0x01])  # 199
    assert c.decode(b) == (1,)
    assert c.decode(StateCodec("v", schemas[:131]).encode((2,))) == (2,)


# -- Arrow -------------------------------------------------------------------------------------

def test_to_arrow_types_and_values() -> None:
    schema = S(("a", LongType()), ("b", FloatType()), ("s", StringType()), ("bin", BinaryType()),
                ("d", DecimalType(38, 18)), ("dt", DateType()), ("ts", TimestampType()),
                ("ntz", TimestampNTZType()), ("arr", ArrayType(INNER)),
                ("m", MapType(StringType(), ArrayType(TimestampType()))), ("st", INNER), ("bo", BooleanType()))
    c = StateCodec("v", [schema])
    ts = datetime.datetime(1969, 7, 20, 20, 17, 40, 123456)
    vals = [c.decode(c.encode((1, 1.5, "x", b"\x00", Decimal("1.5"), datetime.date(2020, 1, 2), ts, ts,
                               [(1, ts), None], {"k": [ts, None]}, (2, None), True))),
            c.decode(c.encode((None,) * 12))]
    t = c.to_arrow(vals)
    assert t.schema.names == schema.names
    assert t.schema.field("a").type == pa.int64() and t.schema.field("b").type == pa.float32()
    assert t.schema.field("d").type == pa.decimal128(38, 18)
    assert t.schema.field("ts").type == pa.timestamp("us", tz="UTC")
    assert t.schema.field("ntz").type == pa.timestamp("us")
    assert t.num_rows == 2
    row = t.to_pylist()[0]
    micros = TimestampType().toInternal(ts)
    want_ts = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc) + datetime.timedelta(microseconds=micros)
    assert row["ts"] == want_ts and row["ntz"] == ts
    assert row["arr"] == [{"x": 1, "ts": want_ts}, None]
    assert row["m"] == [("k", [want_ts, None])]
    assert row["st"] == {"x": 2, "ts": None} and row["bin"] == b"\x00" and row["d"] == Decimal("1.5")
    assert t.to_pylist()[1] == dict.fromkeys(schema.names)
    assert c.to_arrow([]).num_rows == 0


# -- PySpark's own conversion ----------------------------------------------------------------

def _strategy(dt: DataType, nullable: bool) -> st.SearchStrategy:
    if isinstance(dt, ByteType):
        s = st.integers(-128, 127)
    elif isinstance(dt, ShortType):
        s = st.integers(-2 ** 15, 2 ** 15 - 1)
    elif isinstance(dt, IntegerType):
        s = st.integers(-2 ** 31, 2 ** 31 - 1)
    elif isinstance(dt, LongType):
        s = st.integers(-2 ** 63, 2 ** 63 - 1)
    elif isinstance(dt, FloatType):
        s = st.floats(width=32, allow_nan=False)
    elif isinstance(dt, DoubleType):
        s = st.floats(allow_nan=False)
    elif isinstance(dt, BooleanType):
        s = st.booleans()
    elif isinstance(dt, StringType):
        s = st.text()
    elif isinstance(dt, BinaryType):
        s = st.binary()
    elif isinstance(dt, DecimalType):
        s = st.integers(-(10 ** dt.precision) + 1, 10 ** dt.precision - 1).map(
            lambda n: Decimal(n).scaleb(-dt.scale, decimal.Context(prec=50)))
    elif isinstance(dt, DateType):
        s = st.dates()
    elif isinstance(dt, TimestampType):
        s = st.datetimes(min_value=datetime.datetime(1900, 1, 2), max_value=datetime.datetime(2200, 1, 1))
    elif isinstance(dt, TimestampNTZType):
        s = st.datetimes()
    elif isinstance(dt, ArrayType):
        s = st.lists(_strategy(dt.elementType, dt.containsNull), max_size=5)
    elif isinstance(dt, MapType):
        s = st.dictionaries(_strategy(dt.keyType, False), _strategy(dt.valueType, dt.valueContainsNull),
                            max_size=4)
    elif isinstance(dt, StructType):
        s = st.tuples(*[_strategy(f.dataType, f.nullable) for f in dt.fields])
    else:  # pragma: no cover
        raise AssertionError(dt)
    return st.one_of(st.none(), s) if nullable else s


RICH = S(("b", ByteType()), ("h", ShortType(), False), ("i", IntegerType()), ("l", LongType(), False),
         ("f", FloatType()), ("d", DoubleType()), ("bo", BooleanType()), ("s", StringType()),
         ("bin", BinaryType()), ("dec", DecimalType(38, 18)), ("dec2", DecimalType(7, 3)),
         ("dt", DateType()), ("ts", TimestampType()), ("ntz", TimestampNTZType()),
         ("arr", ArrayType(LongType())), ("arrs", ArrayType(StringType(), False)),
         ("m", MapType(StringType(), DoubleType())), ("mi", MapType(IntegerType(), INNER, False)),
         ("st", S(("x", LongType()), ("y", ArrayType(S(("z", DecimalType(5, 1)), ("w", DateType())))),
                  ("t", TimestampType()))))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_strategy(RICH, False))
def test_matches_pyspark_from_internal(value: tuple) -> None:
    c = StateCodec("v", [RICH])
    b = c.encode(value)
    assert c.encode(value) == b
    out = c.decode(b)
    spark = RICH.fromInternal(RICH.toInternal(value))
    assert out == tuple(spark)
    for ours, theirs in zip(out, spark):
        assert type(ours) is type(theirs)
    assert c.decode_many(c.encode_many([value, value])) == [out, out]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.integers(-2 ** 63, 2 ** 63 - 1)),
                          st.one_of(st.none(), st.floats(allow_nan=False)),
                          st.booleans(), st.one_of(st.none(), st.integers(-2 ** 31, 2 ** 31 - 1))),
                max_size=5))
def test_flat_fixed_round_trip(values: list[tuple]) -> None:
    schema = S(("a", LongType()), ("b", DoubleType()), ("c", BooleanType(), False), ("d", IntegerType()))
    c = StateCodec("v", [schema])
    for v in values:
        assert c.decode(c.encode(v)) == v
    assert c.decode_many(c.encode_many(values)) == values


# -- evolution, generated ----------------------------------------------------------------------

_WIDENINGS = {  # old type -> [(new type, what an old value reads as)]
    "tinyint": [(ShortType(), int), (LongType(), int), (DoubleType(), float),
                (FloatType(), lambda x: struct.unpack("<f", struct.pack("<f", x))[0])],
    "int": [(LongType(), int), (DoubleType(), float)],
    "bigint": [(DoubleType(), float), (FloatType(), lambda x: struct.unpack("<f", struct.pack("<f", x))[0])],
    "float": [(DoubleType(), float)],
    "string": [(BinaryType(), lambda x: x.encode())],
    "binary": [(StringType(), lambda x: x.decode("utf-8", "replace"))],
    "decimal(10,2)": [(DecimalType(20, 4), lambda x: x.quantize(Decimal("0.0001")))],
}
_OLD_TYPES = [ByteType(), IntegerType(), LongType(), FloatType(), StringType(), BinaryType(),
              DecimalType(10, 2), DateType(), ArrayType(IntegerType())]


@st.composite
def _evolution(draw: st.DrawFn) -> tuple[StructType, StructType, tuple, tuple]:
    n = draw(st.integers(1, 6))
    olds = [draw(st.sampled_from(_OLD_TYPES)) for _ in range(n)]
    v0 = StructType([StructField(f"f{i}", t) for i, t in enumerate(olds)])
    value = tuple(draw(_strategy(t, True)) for t in olds)
    fields, want = [], []
    for i, (t, x) in enumerate(zip(olds, value)):
        action = draw(st.sampled_from(["keep", "drop", "widen"]))
        if action == "drop":
            continue
        conv = lambda y: y  # noqa: E731
        nt = t
        if action == "widen" and t.simpleString() in _WIDENINGS:
            nt, conv = draw(st.sampled_from(_WIDENINGS[t.simpleString()]))
        if isinstance(t, ArrayType) and action == "widen":
            nt, conv = ArrayType(LongType()), lambda y: y
        fields.append(StructField(f"f{i}", nt))
        want.append((f"f{i}", None if x is None else conv(x)))
    for j in range(draw(st.integers(0, 2))):
        fields.append(StructField(f"new{j}", draw(st.sampled_from(_OLD_TYPES))))
        want.append((f"new{j}", None))
    order = draw(st.permutations(range(len(fields))))
    v1 = StructType([fields[k] for k in order])
    return v0, v1, value, tuple(want[k][1] for k in order)


@settings(max_examples=150, deadline=None)
@given(_evolution())
def test_generated_evolution(case: tuple) -> None:
    v0, v1, value, want = case
    old = StateCodec("v", [v0])
    b = old.encode(value)
    new = StateCodec("v", [v0, v1])
    out = new.decode(b)
    assert out == want
    assert new.decode(new.encode(out)) == out
    assert new.decode_many(b + new.encode(out)) == [out, out]


# -- Spark's own state -----------------------------------------------------------------------

@pytest.mark.slow
def test_same_values_as_sparks_own_state(spark, tmp_path) -> None:
    """A processor on Spark's own transformWithState state stores a value and reads it back;
    the codec gives the same Python values (types included)."""
    import json

    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    schema = S(("b", ByteType()), ("f", FloatType()), ("bin", BinaryType()), ("d", DecimalType(10, 2)),
               ("d38", DecimalType(38, 18)), ("ts", TimestampType()), ("ntz", TimestampNTZType()),
               ("dt", DateType()), ("arr", ArrayType(LongType())), ("arrs", ArrayType(INNER)),
               ("m", MapType(StringType(), INNER)), ("st", INNER), ("e", ArrayType(IntegerType())),
               ("em", MapType(StringType(), IntegerType())), ("z", DecimalType(38, 18)), ("s", StringType()),
               ("n", LongType()))
    value = (7, 0.1, b"\x00ab", Decimal("1.555"), Decimal("-12345678901234567890.123456789012345678"),
             datetime.datetime(1969, 7, 20, 20, 17, 40, 123456), datetime.datetime(1900, 1, 1, 0, 0, 0, 1),
             datetime.date(1, 1, 1), [1, None, 3], [(1, datetime.datetime(2020, 1, 1)), None],
             {"a": (2, None)}, Row(x=5, ts=None), [], {}, Decimal(0), "héllo", None)

    class Probe(StatefulProcessor):
        def init(self, handle):  # type: ignore[no-untyped-def]
            self.state = handle.getValueState("v", schema)

        def handleInputRows(self, key, rows, timerValues):  # type: ignore[no-untyped-def]
            for _ in rows:
                pass
            self.state.update(value)
            got = self.state.get()
            c = StateCodec("v", [schema])
            ours = c.decode(c.encode(value))
            same = got == ours and [type(x) for x in got] == [type(x) for x in ours] and \
                [type(x) for x in got[9]] == [type(x) for x in ours[9]]
            yield Row(k=key[0], same=same, got=repr(got), ours=repr(ours))

        def close(self) -> None:
            pass

    src = tmp_path / "in"
    src.mkdir()
    (src / "a.json").write_text(json.dumps({"k": "a"}) + "\n")
    spark.conf.set("spark.sql.streaming.stateStore.providerClass",
                   "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
    out_schema = S(("k", StringType()), ("same", BooleanType()), ("got", StringType()), ("ours", StringType()))
    rows: list = []
    try:
        q = (spark.readStream.schema("k string").json(str(src)).groupBy("k")
             .transformWithState(Probe(), out_schema, "Update", "None")
             .writeStream.foreachBatch(lambda b, _i: rows.extend(b.collect()))
             .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start())
        q.awaitTermination()
    finally:
        spark.conf.unset("spark.sql.streaming.stateStore.providerClass")
    assert len(rows) == 1
    assert rows[0].same, (rows[0].got, rows[0].ours)
