"""peace test configuration: ``slow`` tests run only with ``--runslow`` or ``SGUARD_SLOW=1``."""
from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect ``@pytest.mark.slow`` peace tests unless asked for."""
    if os.environ.get("SGUARD_SLOW") == "1":
        return
    try:
        if config.getoption("--runslow"):
            return
    except ValueError:
        pass
    keep, drop = [], []
    for item in items:
        is_peace = "tests/peace" in str(item.fspath).replace(os.sep, "/")
        (drop if is_peace and item.get_closest_marker("slow") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
