"""Exceptions of the Spark runtime: each names the thing at fault."""
from __future__ import annotations

__all__ = ["SparkStateError", "UnsupportedKeyTypeError", "SchemaChangedError",
           "OperatorMismatchError", "StateAheadError",
           "InputLogGapError", "PartitionLockTimeout", "NotStreamingError", "BatchTimeMissingError",
           "FencedError", "UnrecoverableStateError",
           "UnsupportedStateTypeError", "StateSchemaEvolutionError", "StateValueError"]


class SparkStateError(Exception):
    """Base class of the errors of `sguard.spark`."""


class UnsupportedKeyTypeError(SparkStateError, TypeError):
    """The key column has a type the state structures cannot key on."""


class SchemaChangedError(SparkStateError, ValueError):
    """The stream's schema or the operator's parameters differ from the existing state's."""


class OperatorMismatchError(SparkStateError, ValueError):
    """The state URI holds the state of another operator."""


class StateAheadError(SparkStateError, RuntimeError):
    """The durable state includes batches Spark has not committed (a foreign checkpointLocation)."""


class InputLogGapError(SparkStateError, RuntimeError):
    """A batch needed for replay is missing from the input log."""


class PartitionLockTimeout(SparkStateError, TimeoutError):
    """Another process held a partition's lock for too long."""


class NotStreamingError(SparkStateError, RuntimeError):
    """The operator ran outside a streaming micro-batch (no batch id)."""


class BatchTimeMissingError(SparkStateError, KeyError):
    """A processing-time TTL got a batch without its recorded processing time."""


class FencedError(SparkStateError, RuntimeError):
    """This task attempt no longer owns its partition (a newer attempt or host claimed a
    higher epoch, `sguard.spark.fencing`): what it would commit is refused, and the task
    fails so that its result never counts."""


class UnrecoverableStateError(InputLogGapError):
    """No checkpoint plus input log rebuilds a partition's state (each way is named)."""


class UnsupportedStateTypeError(SparkStateError, TypeError):
    """A state variable's schema has a type that state values cannot hold (the variable and
    the field are named)."""


class StateSchemaEvolutionError(SchemaChangedError):
    """A state variable's schema changed in a way its stored values cannot follow (the variable,
    the field and the old and new types are named)."""


class StateValueError(SparkStateError, ValueError):
    """A value given to a state variable does not fit its schema (the variable and the field
    are named)."""
