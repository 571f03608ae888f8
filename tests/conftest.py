"""Shared pytest configuration: Hypothesis profiles and the one SparkSession."""
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", deadline=None, max_examples=500, stateful_step_count=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local SparkSession per test process (``local[2,4]``: two cores, a failed task is
    retried up to 4 times), shared by every test that needs one. Tests never stop it: under
    pytest-xdist a worker runs files of several directories, and ``getOrCreate`` anywhere
    returns this very session."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from sguard.spark import local_session
    s = local_session("local[2,4]", "sguard-tests", shuffle_partitions=2)
    try:
        yield s
    finally:
        s.stop()
