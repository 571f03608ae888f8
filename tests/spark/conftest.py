"""Fixtures of the Spark tests: one local SparkSession for the session (``local[2,4]``:
two cores, a failed task is retried up to 4 times), and generated parquet input."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.ioservice.conftest import seaweed  # noqa: F401 - the SeaweedFS cluster fixture
from tests.spark.helpers import make_input


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from sguard.spark import local_session
    s = local_session("local[2,4]", "sguard-tests", shuffle_partitions=2)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def stream_input(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """6 micro-batches (one parquet file each) of 3000 rows over 400 keys."""
    d = tmp_path_factory.mktemp("input")
    return make_input(d, batches=6, rows=3000, keys=400, seed=11)
