"""Fixtures for ioservice tests: a real SeaweedFS cluster and an optional HDFS URI."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from ioservice.testing import SeaweedCluster, find_weed_binary


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedCluster]:
    """A SeaweedFS cluster (master, 3 volume servers on 2 racks, filer, S3) for the session.

    Fails, never skips, when the ``weed`` binary is missing: CI installs it.
    """
    try:
        weed = find_weed_binary()
    except FileNotFoundError as exc:
        pytest.fail(f"SeaweedFS is required for the ioservice integration tests: {exc}", pytrace=False)
    cluster = SeaweedCluster(weed_binary=weed)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def seaweed_uri(seaweed: SeaweedCluster) -> str:
    """A fresh ``s3://bucket/prefix`` root on the session cluster."""
    seaweed.create_bucket("sguard-test")
    return f"s3://sguard-test/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def hdfs_uri() -> str:
    """A fresh root under ``$SGUARD_TEST_HDFS_URI``; skips when it is unset."""
    base = os.environ.get("SGUARD_TEST_HDFS_URI")
    if not base:
        pytest.skip("set SGUARD_TEST_HDFS_URI=hdfs://host:port/path to run")
    return f"{base.rstrip('/')}/{uuid.uuid4().hex[:12]}"
