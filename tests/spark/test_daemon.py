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


def test_preload_bound_comes_from_the_environment(monkeypatch: Any) -> None:
    """Unset: `PRELOAD_VARIANTS_PER_KERNEL`; ``all``: no bound; a count; anything else is
    a ValueError naming the variable (the daemon then reports it and starts unpreloaded)."""
    import pytest

    from sguard.spark import daemon
    monkeypatch.delenv("SGUARD_PRELOAD_VARIANTS_PER_KERNEL", raising=False)
    assert daemon._bound_from_env() == daemon.PRELOAD_VARIANTS_PER_KERNEL
    monkeypatch.setenv("SGUARD_PRELOAD_VARIANTS_PER_KERNEL", "all")
    assert daemon._bound_from_env() is None
    monkeypatch.setenv("SGUARD_PRELOAD_VARIANTS_PER_KERNEL", "2")
    assert daemon._bound_from_env() == 2
    monkeypatch.setenv("SGUARD_PRELOAD_VARIANTS_PER_KERNEL", "-1")
    with pytest.raises(ValueError, match="SGUARD_PRELOAD_VARIANTS_PER_KERNEL"):
        daemon._bound_from_env()
