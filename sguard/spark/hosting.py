"""What the operators that run user code share (`sguard.spark.processors`,
`sguard.spark.vectorized`): parsing Spark schemas, output errors, a base operator."""
from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from sguard.spark.errors import SparkStateError
from sguard.spark.operators import Operator

__all__ = ["HostedOperator", "ProcessorOutputError", "parse_struct"]


class ProcessorOutputError(SparkStateError, ValueError):
    """A processor's output does not fit its ``output_schema``."""


def parse_struct(spark: Any, schema: Any, what: str) -> Any:
    """A pyspark StructType from a StructType or a DDL string (parsed by Spark)."""
    from pyspark.sql.types import StructType
    if isinstance(schema, StructType):
        return schema
    if isinstance(schema, str):
        st = spark._parse_ddl(schema)
        if not isinstance(st, StructType):
            raise TypeError(f"{what}: {schema!r} is not a struct schema")
        return st
    raise TypeError(f"{what} must be a StructType or a DDL string, got {type(schema).__name__}")


class HostedOperator(Operator):
    """What the operators that host user code (a processor, `sguard.spark.vectorized`)
    share: equality by parameters and the processor's class (a worker keeps its runtime
    across tasks of the same query), a recorded processing time, an output schema given as
    Spark JSON."""

    output_schema_json: str
    processor: Any

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, HostedOperator) and type(other) is type(self)
                and self.params() == other.params()
                and type(self.processor) is type(other.processor))

    def __hash__(self) -> int:
        return hash(json.dumps(self.params(), sort_keys=True))

    @property
    def needs_batch_time(self) -> bool:
        return True

    def arrow_output_schema(self) -> pa.Schema:
        from pyspark.sql.pandas.types import to_arrow_schema
        from pyspark.sql.types import StructType
        return to_arrow_schema(StructType.fromJson(json.loads(self.output_schema_json)),
                               timezone="UTC")

    def output_schema(self, schema: pa.Schema, key: Any) -> pa.Schema:
        return self.arrow_output_schema()
