"""Stream operators whose state lives in mmm structures.

`Aggregate` is the paper's running example (§6.1): per 4-byte key, the count,
the first and the last timestamp. Its state is one `mmm.HashMap`, so it is
checkpointed by freezing pages, never by serializing.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from mmm import PageManager
from mmm.structures.hashmap import HashMap

__all__ = ["Aggregate", "AGG_VALUE"]

AGG_VALUE = np.dtype([("count", "<i8"), ("first_ts", "<i8"), ("last_ts", "<i8")])
_SPEC = {"count": "count", "first_ts": ("min", "ts"), "last_ts": ("max", "ts")}


class Aggregate:
    """count / min(ts) / max(ts) per ``uint32`` key, with state in a paged hash map.

    Parameters
    ----------
    pm : PageManager
        The HA unit's page manager.
    name : str
        Structure name: the same name after a restart recovers the state.
    """

    def __init__(self, pm: PageManager, name: str = "aggregate") -> None:
        self.pm = pm
        self.state = HashMap.create(pm, name, key="<u4", value=AGG_VALUE)
        self._add = self.state.upserter(_SPEC)
        self.tuples = 0

    def process(self, keys: npt.NDArray[np.uint32], ts: npt.NDArray[np.int64]) -> None:
        """Consume one batch (the primary API: numpy columns, e.g. from Arrow)."""
        self.state.upsert(keys, {"ts": ts}, _SPEC)
        self.tuples += len(keys)

    def process_record(self, key: int, ts: int) -> None:
        """Consume one tuple (convenience; buffered internally)."""
        self._add(key, ts)
        self.tuples += 1

    def result(self) -> tuple[npt.NDArray[np.uint32], npt.NDArray[Any]]:
        """``(keys, values)`` sorted by key."""
        k, v = self.state.items()
        order = np.argsort(k)
        return k[order], v[order]


def expected_aggregate(keys: npt.NDArray[np.uint32], ts: npt.NDArray[np.int64]
                       ) -> tuple[npt.NDArray[np.uint32], npt.NDArray[Any]]:
    """The Aggregate's result computed directly with numpy (an oracle)."""
    uk, inv = np.unique(keys, return_inverse=True)
    out = np.zeros(len(uk), AGG_VALUE)
    out["count"] = np.bincount(inv, minlength=len(uk))
    lo = np.full(len(uk), np.iinfo(np.int64).max)
    hi = np.full(len(uk), np.iinfo(np.int64).min)
    np.minimum.at(lo, inv, ts)
    np.maximum.at(hi, inv, ts)
    out["first_ts"], out["last_ts"] = lo, hi
    return uk.astype(np.uint32), out
