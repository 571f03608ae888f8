"""The operator contract from a developer's side: the example of sguard.spark.operators,
run through the runtime with a rollback and a restore, keyed on an integer, a string and
a composite key with nulls."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import mmm
from sguard.spark.checkpointing import CheckpointConfig
from sguard.spark.operators import (KeyIndex, Operator, OperatorState, key_spec,
                                    register_operator)
from sguard.spark.runtime import RuntimeConfig, _runtime, run_partition_batch
from sguard.statelayout import OperatorLayout


@register_operator
class CountRows(Operator):
    kind = "count_rows"

    def params(self) -> dict[str, Any]:
        return {}

    def check_input(self, schema: pa.Schema, key: Any) -> None:
        key_spec(schema, key)

    def output_schema(self, schema: pa.Schema, key: Any) -> pa.Schema:
        return pa.schema(key_spec(schema, key).fields + [pa.field("n", pa.int64())])

    def open(self, pm: mmm.PageManager, schema: pa.Schema, key: Any) -> OperatorState:
        return _CountRowsState(pm, schema, key)


class _CountRowsState(OperatorState):
    def __init__(self, pm: mmm.PageManager, schema: pa.Schema, key: Any) -> None:
        self.keys = KeyIndex.open(pm, schema, key)
        self.m = mmm.HashMap.create(pm, "n", self.keys.dtype, [("n", "<i8")])
        self.names = [f.name for f in self.keys.fields] + ["n"]

    def apply(self, table: pa.Table, batch_id: int) -> pa.Table:
        ids = self.keys.ids(table)
        self.m.upsert(ids, None, {"n": "count"})
        u = np.unique(ids)
        return self._table(u, self.m.get(u)[1]["n"])

    def dump(self) -> pa.Table:
        k, v = self.m.items()
        o = self.keys.order(k)
        return self._table(k[o], v["n"][o])

    def _table(self, ids: Any, n: Any) -> pa.Table:
        return pa.Table.from_arrays(self.keys.arrays(ids) + [pa.array(n)], self.names)


def _batches(key: Any) -> list[pa.Table]:
    out = []
    for i in range(5):
        k = np.arange(i, i + 20, dtype=np.int32) % 7
        if key == "k":
            out.append(pa.table({"k": k}))
            continue
        user = pa.array([None if x == 3 else f"u{x}" for x in k.tolist()], pa.string())
        tenant = pa.array([None if x % 2 else "t" for x in k.tolist()], pa.string())
        out.append(pa.table({"tenant": tenant, "user": user}))
    return out


@pytest.mark.parametrize("key", ["k", "user", ["tenant", "user"]])
def test_custom_operator_exactly_once(tmp_path: Path, key: Any) -> None:
    """Rolled back and replayed, then restored from the checkpoint: the same output, and
    the state's keys come back with their names and types (null keys their own group)."""
    batches = _batches(key)
    schema = batches[0].schema
    op = CountRows()
    lay = OperatorLayout(operator=op.kind, name="cr", schema={}, num_partitions=1, key=key)
    cfg = RuntimeConfig(state_uri=str(tmp_path / "s"), state_key=str(tmp_path), layout=lay,
                        operator=op, key=key, input_schema=schema,
                        output_schema=op.output_schema(schema, key),
                        local_dir=str(tmp_path / "l"), capacity_bytes=1 << 24,
                        checkpoint=CheckpointConfig(every_n_batches=1))
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
    dump = st.dump()
    assert dump["n"].to_numpy().sum() == 100
    assert dump.schema.names[:-1] == ([key] if isinstance(key, str) else key)
    want: dict[Any, int] = {}
    for t in batches:
        for r in zip(*(t.column(c).to_pylist() for c in dump.schema.names[:-1])):
            want[r] = want.get(r, 0) + 1
    got = {tuple(r[:-1]): r[-1] for r in (tuple(x.values()) for x in dump.to_pylist())}
    assert got == want
