"""Fixtures of the Spark tests: generated parquet input (the SparkSession, `spark`, is
tests/conftest.py's, shared with the other directories' tests)."""
from __future__ import annotations

from typing import Any

import pytest

from tests.ioservice.conftest import seaweed  # noqa: F401 - the SeaweedFS cluster fixture
from tests.spark.helpers import make_input


@pytest.fixture(scope="session")
def stream_input(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """6 micro-batches (one parquet file each) of 3000 rows over 400 keys."""
    d = tmp_path_factory.mktemp("input")
    return make_input(d, batches=6, rows=3000, keys=400, seed=11)
