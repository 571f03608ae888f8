"""Run with the PREVIOUS sguard (test_convert.V1_COMMIT, layout_version 1) on PYTHONPATH: build the
version-1 state of each scenario the way its runtime did (rows split by Spark's
``pmod(murmur3(key), P)``), checkpointing every few batches, each checkpoint landing
before the next batch (so the same batches on any machine, whatever its load;
partition 0 also after its last batch, so the partitions end at different batches),
and write each batch's outputs to ``<dir>/out-b<b>-p<p>.arrow``.

Usage: python _old_state_builder.py '<json list of scenarios>'; a scenario is
``{"dir": ..., "data": ..., "op": "running" | "window", "batches": N, "every": n, "P": P}``.
"""
from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.ipc as ipc

from ioservice import open_root
from sguard.partitioning import partition_of
from sguard.spark import CheckpointConfig, RunningAggregate, WindowAggregate
from sguard.spark.api import schema_to_json
from sguard.spark.keys import key_spec
from sguard.spark.placement import root_key
from sguard.spark.runtime import RuntimeConfig, _runtime, run_partition_batch
from sguard.statelayout import LAYOUT_VERSION, OperatorLayout, write_layout

assert LAYOUT_VERSION == 1, "run with the previous sguard on PYTHONPATH"


def build(sc: dict) -> None:
    P = sc["P"]
    op = (RunningAggregate(value="v") if sc["op"] == "running"
          else WindowAggregate(time="ts", window=50, value="v", lateness=150))
    tables = [ipc.open_file(f"{sc['data']}/b{b}.arrow").read_all() for b in range(sc["batches"])]
    schema = tables[0].schema
    uri = f"{sc['dir']}/state"
    lay = OperatorLayout(operator=op.kind, name="op", schema={"params": op.params()},
                         num_partitions=P, key="k",
                         extra={"arrow_schema": schema_to_json(schema),
                                "keys": key_spec(schema, "k").describe()})
    root = open_root(uri)
    write_layout(root, lay)
    cfg = RuntimeConfig(state_uri=uri, state_key=root_key(root), layout=lay, operator=op,
                        key="k", input_schema=schema, output_schema=op.output_schema(schema, "k"),
                        local_dir=f"{sc['dir']}/local-old", capacity_bytes=1 << 26,
                        checkpoint=CheckpointConfig(every_n_batches=sc["every"]))
    rt = _runtime(cfg)
    for b, t in enumerate(tables):
        part = partition_of(t.select(["k"]), P)
        for p in range(P):
            out = run_partition_batch(cfg, p, b, t.filter(pa.array(part == p)))
            with ipc.new_file(f"{sc['dir']}/out-b{b}-p{p}.arrow", out.schema) as w:
                w.write_table(out)
            # the checkpoint this batch started lands before the next batch: a checkpoint
            # still in flight would make the policy skip one, so which batches the
            # partitions end at (and which logs they trimmed) would depend on the load
            rt.partition(p).ckpt.wait()
    for p in range(P):
        part = rt.partition(p)
        part.ckpt.wait()
        if p == 0:  # partition 0 checkpoints its final state, the others stay behind
            pending = part.ckpt.checkpoint(len(tables) - 1, force=True)
            assert pending is not None
            pending.result()
            part.ckpt.wait()
        part.slot.release()


if __name__ == "__main__":
    for sc in json.loads(sys.argv[1]):
        build(sc)
