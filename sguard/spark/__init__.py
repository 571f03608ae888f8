"""sguard.spark: stateful PySpark streaming operators with state in mmm pages.

A Spark user writes::

    import sguard.spark as ss
    out = ss.stateful(df, key="k", operator=ss.RunningAggregate(value="v"),
                      state_uri="file:///tmp/state", num_partitions=4)
    out.writeStream.format("parquet").option("path", "out") \\
       .option("checkpointLocation", "ckpt").start()

Modules (one concern each): `api` (the entry points), `operators` (the
operator contract and the shipped operators), `runtime` (what a task does),
`keys` (key columns of any type -> the state's integer keys), `columns` (input columns, time units, durations), `placement` (local
state files and locks), `versions` (batch versions and
rollback), `checkpointing` (asynchronous DFS checkpoints), `inputlog`
(the HAInput log), `fencing` (ownership epochs), `recovery` (rebuilding a
partition from a checkpoint and the log), `metrics` (JSON-lines metrics), `state`
(reading state back), `reader` (the durable state as a DataFrame: `read_state`),
`ttl` (state time-to-live), `processors` (PySpark StatefulProcessors on sguard state:
`transform_with_state`), `processor_state` (their state variables and timers in pages),
`vectorized` (the vectorized processor form), `hosting` (what both share), `watermark` (the query's event-time
watermark), `rescaling` (repartitioning at start-up), `cli`
(``sguard spark demo|status``), `demo` (the main job).
"""
from sguard.spark.api import local_session, stateful, stream_join
from sguard.spark.checkpointing import CheckpointConfig
from sguard.spark.errors import (FencedError, InputLogGapError, NotStreamingError, OperatorMismatchError,
                                 PartitionLockTimeout, SchemaChangedError, SparkStateError,
                                 StateAheadError, UnrecoverableStateError,
                                 UnsupportedKeyTypeError)
from sguard.spark.keys import KeyIndex, NullKeyError, key_spec
from sguard.spark.operators import (Operator, OperatorState, RunningAggregate, WindowAggregate,
                                    WindowJoin)
from sguard.spark.runtime import Fault, FaultPlan, InjectedFault
from sguard.spark.reader import BatchNotAvailableError, read_state
from sguard.spark.ttl import TTL
from sguard.spark.processors import (ProcessorOutputError, ProcessorPhaseError,
                                     transform_with_state, transform_with_state_in_pandas)
from sguard.spark.vectorized import VectorizedProcessor

__all__ = ["stateful", "stream_join", "local_session", "CheckpointConfig", "Operator",
           "OperatorState", "RunningAggregate", "WindowAggregate", "WindowJoin", "Fault",
           "FaultPlan", "InjectedFault", "read_state", "BatchNotAvailableError", "TTL",
           "SparkStateError", "UnsupportedKeyTypeError", "SchemaChangedError", "OperatorMismatchError",
           "StateAheadError", "InputLogGapError", "PartitionLockTimeout", "NotStreamingError",
           "KeyIndex", "NullKeyError", "key_spec", "FencedError", "UnrecoverableStateError",
           "transform_with_state", "transform_with_state_in_pandas", "VectorizedProcessor",
           "ProcessorOutputError", "ProcessorPhaseError"]
