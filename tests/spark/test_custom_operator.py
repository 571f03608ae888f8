"""The operator contract from a developer's side: the example of sguard.spark.operators,
run through the runtime with a rollback and a restore."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import mmm
from sguard.spark.checkpointing import CheckpointConfig
from sguard.spark.operators import (Operator, OperatorState, check_key_type, column_numpy,
                                    key_dtype, register_operator)
from sguard.spark.runtime import RuntimeConfig, _runtime, run_partition_batch
from sguard.statelayout import OperatorLayout


@register_operator
class CountRows(Operator):
    kind = "count_rows"

    def params(self) -> dict[str, Any]:
        return {}

    def check_input(self, schema: pa.Schema, key: str) -> None:
        check_key_type(schema, key)

    def output_schema(self, schema: pa.Schema, key: str) -> pa.Schema:
        return pa.schema([schema.field(key), pa.field("n", pa.int64())])

    def open(self, pm: mmm.PageManager, schema: pa.Schema, key: str) -> OperatorState:
        return _CountRowsState(pm, schema, key)


class _CountRowsState(OperatorState):
    def __init__(self, pm: mmm.PageManager, schema: pa.Schema, key: str) -> None:
        self.key = key
        self.m = mmm.HashMap.create(pm, "n", key_dtype(schema, key), [("n", "<i8")])

    def apply(self, table: pa.Table, batch_id: int) -> pa.Table:
        keys = column_numpy(table, self.key)
        self.m.upsert(keys, None, {"n": "count"})
        u = np.unique(keys)
        return pa.table({self.key: u, "n": self.m.get(u)[1]["n"]})

    def dump(self) -> pa.Table:
        k, v = self.m.items()
        o = np.argsort(k)
        return pa.table({self.key: k[o], "n": v["n"][o]})


def test_custom_operator_exactly_once(tmp_path: Path) -> None:
    schema = pa.schema([("k", pa.int32())])
    op = CountRows()
    lay = OperatorLayout(operator=op.kind, name="cr", schema={}, num_partitions=1, key="k")
    cfg = RuntimeConfig(state_uri=str(tmp_path / "s"), state_key=str(tmp_path), layout=lay,
                        operator=op, key="k", input_schema=schema,
                        output_schema=op.output_schema(schema, "k"),
                        local_dir=str(tmp_path / "l"), capacity_bytes=1 << 24,
                        checkpoint=CheckpointConfig(every_n_batches=1))
    batches = [pa.table({"k": np.arange(i, i + 20, dtype=np.int32) % 7}) for i in range(5)]
    outs = [run_partition_batch(cfg, 0, b, t) for b, t in enumerate(batches)]
    assert run_partition_batch(cfg, 0, 4, batches[4]).equals(outs[4])   # replay: rolled back
    part = _runtime(cfg).partition(0)
    assert part.ckpt is not None
    part.ckpt.wait()
    part._drop()
    part.slot.wipe()                                                      # local state lost
    assert run_partition_batch(cfg, 0, 4, batches[4]).equals(outs[4])   # restored + replayed
    st = _runtime(cfg).partition(0).state
    assert st is not None
    assert st.dump()["n"].to_numpy().sum() == 100
