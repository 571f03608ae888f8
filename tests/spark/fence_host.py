"""One "host" of the fencing tests: a process with its own local dir that drives
`sguard.spark.runtime.run_partition_batch` for partition 0, as Spark's tasks would.

    python -m tests.spark.fence_host '<json spec>'

spec: ``state_uri``, ``storage_options``, ``local_dir``, ``batches`` (a list of
``[batch, seed]``), ``stop_at`` (an `ioservice.faultpoints` point armed just
before batch ``stop_batch``, or null), ``progress_dir`` (``done-<name>-b<batch>``
is created after each batch), ``name``, ``out`` (a JSON result file). A task
that fails with `FencedError` ends the run, as a stale host's would.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ioservice import faultpoints, open_root
from sguard.spark import CheckpointConfig, FencedError, RunningAggregate
from sguard.spark.api import schema_to_json
from sguard.spark.placement import root_key
from sguard.spark.runtime import RuntimeConfig, _runtime, run_partition_batch
from sguard.statelayout import OperatorLayout, read_layout, write_layout

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def rows(batch: int, seed: int) -> pa.Table:
    """The rows of one batch (seed 0: the common history; other seeds: another attempt's)."""
    rng = np.random.default_rng([seed, batch])
    n = 300
    return pa.table({"k": rng.integers(0, 40, n, dtype=np.int64),
                     "v": rng.integers(-500, 500, n, dtype=np.int64)}, schema=SCHEMA)


def config(state_uri: str, storage_options: dict[str, Any], local_dir: str) -> RuntimeConfig:
    op = RunningAggregate(value="v")
    root = open_root(state_uri, **storage_options)
    lay = read_layout(root)
    if lay is None:
        lay = OperatorLayout(operator=op.kind, name="op", schema={"params": op.params()},
                             num_partitions=1, key="k",
                             extra={"arrow_schema": schema_to_json(SCHEMA)})
        write_layout(root, lay)
    return RuntimeConfig(state_uri=state_uri, state_key=root_key(root), layout=lay, operator=op,
                         key="k", input_schema=SCHEMA,
                         output_schema=op.output_schema(SCHEMA, "k"), local_dir=local_dir,
                         capacity_bytes=1 << 26,
                         checkpoint=CheckpointConfig(every_n_batches=1, keep=2),
                         storage_options=storage_options, metrics=False)


def main(spec: dict[str, Any]) -> int:
    cfg = config(spec["state_uri"], spec["storage_options"], spec["local_dir"])
    part = _runtime(cfg).partition(0)
    results: list[dict[str, Any]] = []
    for b, seed in spec["batches"]:
        if spec.get("stop_at") and b == spec["stop_batch"]:
            if part.ckpt is not None:
                part.ckpt.wait()  # so that this batch starts a checkpoint
            os.environ[faultpoints.ENV_POINTS] = spec["stop_at"]
        try:
            out = run_partition_batch(cfg, 0, b, rows(b, seed))
            results.append({"batch": b, "ok": True, "rows_out": out.num_rows})
        except FencedError as exc:
            results.append({"batch": b, "ok": False, "error": "FencedError", "msg": str(exc)})
            break
        finally:
            Path(spec["progress_dir"], f"done-{spec['name']}-b{b}").touch()
    err = None
    if part.ckpt is not None:
        try:
            part.ckpt.wait(600)
        except Exception as exc:  # noqa: BLE001 - reported
            err = repr(exc)
    last = part.ckpt.mgr.counters if part.ckpt is not None else {}
    Path(spec["out"]).write_text(json.dumps({"results": results, "wait_error": err,
                                             "counters": last}))
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
