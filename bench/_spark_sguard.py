"""The sguard variant of `bench.spark_stateful` (wired to `sguard.spark`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def build(spark: Any, df: Any, n_keys: int, partitions: int, run_dir: Path
          ) -> tuple[Any, str, Any]:
    raise NotImplementedError("sguard.spark is not available yet")


def collect(ctx: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {}


def recovery(spark: Any, work: Path, n_keys: int, partitions: int, batches: int
             ) -> dict[str, Any]:
    raise NotImplementedError("sguard.spark is not available yet")
