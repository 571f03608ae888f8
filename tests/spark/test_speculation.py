"""Exactly-once under aggressive speculative execution on ``local-cluster`` (issue 18):
two executor JVMs, ``spark.speculation=true`` with a 50 ms check interval, quantile 0.1
and multiplier 1.1, and the executor running a paused task SIGKILLed, so that attempts of
one partition's batch overlap (a speculative copy waits for the partition while the
original holds it) and one dies mid-batch."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.spark.helpers import StreamInput
from tests.spark.test_processes import kill_executor_mid_batch

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
SPECULATION = {"spark.speculation": "true", "spark.speculation.interval": "50ms",
               "spark.speculation.quantile": "0.1", "spark.speculation.multiplier": "1.1",
               "spark.speculation.minTaskRuntime": "1ms", "spark.task.maxFailures": "8"}


def test_exactly_once_with_aggressive_speculation_and_an_executor_killed(
        stream_input: StreamInput, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), SGUARD_TEST_SPARK_CONF=json.dumps(SPECULATION))
    kill_executor_mid_batch(stream_input, tmp_path, 2, 1, env)
