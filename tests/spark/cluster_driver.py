"""A Spark driver for the subprocess tests: ``python -m tests.spark.cluster_driver
<master> <input-dir> <work-dir> [fault ...]`` with faults as ``kind:batch:partition:point``.

Runs the running aggregate over the input to its end (restarting the query from its
checkpointLocation if it fails), then writes the sink rows and the final local state
to ``<work-dir>/result.json``. ``SGUARD_TEST_SPARK_CONF`` (a JSON object) adds Spark
settings (e.g. speculation); ``SGUARD_TEST_PARTITIONS`` sets the state partitions (2).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    master, inp, work = argv[0], Path(argv[1]), Path(argv[2])
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import sguard.spark as ss
    from tests.spark.helpers import StreamInput, run_query
    faults = [ss.Fault(k, int(b), int(p), pt) for k, b, p, pt in (f.split(":") for f in argv[3:])]
    (work / "faults").mkdir(parents=True, exist_ok=True)
    plan = ss.FaultPlan(tuple(faults), str(work / "faults")) if faults else None
    conf = json.loads(os.environ.get("SGUARD_TEST_SPARK_CONF", "{}"))
    spark = ss.local_session(master, "sguard-test-driver", shuffle_partitions=2, conf=conf)
    rows, state, failures = run_query(spark, StreamInput(inp, []), work,
                                      ss.RunningAggregate(value="v"), faults=plan,
                                      partitions=int(os.environ.get("SGUARD_TEST_PARTITIONS", "2")))
    (work / "result.json").write_text(json.dumps({"rows": rows, "state": state,
                                                  "failures": failures}))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
