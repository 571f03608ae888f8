"""A state URI written before key groups (layout_version 1) is refused by `stateful` and
`read_state` with a message naming ``sguard state convert``, and nothing is written to it
(the conversion itself: tests/sguard/test_convert.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sguard.spark import RunningAggregate, read_state, stateful
from sguard.statelayout import CONVERT_COMMAND, LAYOUT_FILE, LayoutError
from tests.spark.helpers import stream


def _v1_state(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / LAYOUT_FILE).write_text(json.dumps(
        {"layout_version": 1, "operator": "running_aggregate", "name": "running_aggregate",
         "schema": {"params": RunningAggregate(value="v").params()}, "num_partitions": 2,
         "key": "k", "generation": 0, "schema_version": 1, "partitioner": "spark-murmur3",
         "extra": {}}))
    return d


def test_v1_state_refused_naming_the_convert_command(spark: Any, stream_input: Any,
                                                     tmp_path: Path) -> None:
    d = _v1_state(tmp_path / "state")
    before = sorted(p.name for p in d.rglob("*"))
    with pytest.raises(LayoutError, match=CONVERT_COMMAND):
        stateful(stream(spark, stream_input), "k", RunningAggregate(value="v"), str(d))
    with pytest.raises(LayoutError, match=CONVERT_COMMAND):
        read_state(spark, str(d))
    assert sorted(p.name for p in d.rglob("*")) == before
