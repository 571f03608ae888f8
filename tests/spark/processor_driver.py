"""A Spark driver for the processor failure tests: ``python -m tests.spark.processor_driver
<master> <input-dir> <work-dir> [fault ...]`` with faults as ``kind:batch:partition:point``.

Runs `KitchenSink` (every state kind, event-time timers, initial state) through
`sguard.spark.transform_with_state_in_pandas` over the input to its end, restarting the
query from its checkpointLocation if it fails. The foreachBatch sink writes each batch's
sorted rows to ``<work-dir>/out/<batch>.json`` and appends ``<batch> <pid>`` to
``<work-dir>/out/emitted`` (which driver process emitted which batch, replays included);
``<work-dir>/result.json`` (the number of failed query runs) says the driver finished.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    master, inp, work = argv[0], Path(argv[1]), Path(argv[2])
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import sguard.spark as ss
    from tests.spark.test_processors import (INITIAL, KITCHEN_OUT, SCHEMA, KitchenSink,
                                             _stream, sort_rows)
    faults = [ss.Fault(k, int(b), int(p), pt) for k, b, p, pt in (f.split(":") for f in argv[3:])]
    (work / "faults").mkdir(parents=True, exist_ok=True)
    (work / "out").mkdir(parents=True, exist_ok=True)
    plan = ss.FaultPlan(tuple(faults), str(work / "faults")) if faults else None
    spark = ss.local_session(master, "sguard-test-processors", shuffle_partitions=2)

    def sink(bdf: Any, bid: int) -> None:
        rows = sort_rows(tuple(r) for r in bdf.collect())
        f = work / "out" / f"{bid}.json"
        f.with_suffix(".tmp").write_text(json.dumps(rows))
        os.replace(f.with_suffix(".tmp"), f)
        with open(work / "out" / "emitted", "a") as fh:
            fh.write(f"{bid} {os.getpid()}\n")

    failures = 0
    while True:
        init = spark.createDataFrame(INITIAL, "k long, start long")
        out = ss.transform_with_state_in_pandas(
            _stream(spark, inp, SCHEMA, "2 seconds"), "k", KitchenSink(), KITCHEN_OUT,
            "Update", "EventTime", f"file://{work}/state", 2, initial_state=init,
            faults=plan, local_dir=str(work / "local"))
        q = (out.writeStream.foreachBatch(sink).option("checkpointLocation", str(work / "ckpt"))
             .trigger(availableNow=True).start())
        try:
            q.awaitTermination()
            if q.exception() is None:
                break
            raise RuntimeError(str(q.exception()))
        except Exception:
            failures += 1
            q.stop()
            if failures > 3:
                raise
            time.sleep(0.2)
    (work / "result.json").write_text(json.dumps({"failures": failures}))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
