"""`sguard.spark.daemon`: the workers of `local_session` are forked from a daemon that
imported sguard, loaded its cached kernels and froze those objects out of the cyclic GC
(a reused worker runs ``gc.collect()`` after every task)."""
from __future__ import annotations

from typing import Any


def test_workers_start_with_sguard_loaded_and_frozen(spark: Any) -> None:
    def probe(batches: Any) -> Any:
        import gc
        import os
        import sys

        import pyarrow as pa
        for _ in batches:
            pass
        main = getattr(sys.modules["__main__"], "__spec__", None)
        yield pa.RecordBatch.from_pydict({
            "daemon": [getattr(main, "name", "")],
            "runtime_loaded": ["sguard.spark.runtime" in sys.modules],
            "frozen": [gc.get_freeze_count()],
            "pid": [os.getpid()]})

    rows = (spark.range(0, 2, 1, 2)
            .mapInArrow(probe, "daemon string, runtime_loaded boolean, frozen long, pid long")
            .collect())
    assert len(rows) == 2
    for r in rows:
        assert r.daemon == "sguard.spark.daemon", r
        assert r.runtime_loaded, r  # imported before the fork, not by this task
        assert r.frozen > 50_000, r  # sguard, numba, pyarrow, pyspark.worker: ~130k objects
