"""peace: the SGuard DFS write scheduler (paper §5, §6.2).

Glossary
--------
chunk
    The DFS unit of a write (64 MB by default); a request writes ``k`` chunks.
replica
    One copy of a chunk; ``r`` replicas form a chain (pipeline): writer -> replica 1 -> ...
timestep
    A scheduling round; edge capacities count chunks per timestep.
residual
    Capacity left on each edge in the current timestep (an int64 vector by edge id).
template
    A per-replica-index constraint (same rack as / other rack than a path position).
request
    ``(writer, replication, chunks)``, the paper's ``(w, r, k)``.
service time / response time
    first chunk start -> last chunk done / submit -> last chunk done.

The names below load on first use (PEP 562), so importing one light module
(``peace.errors``, ``peace.argtypes``) does not pull in networkx and the
schedulers.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peace.coordinator import Coordinator, RequestState, RequestStatus
    from peace.errors import (CannotScheduleNowError, InfeasibleRequestError, InvalidRequestError,
                              InvalidScheduleError, MalformedTopologyError, PeaceError,
                              ScheduleInfeasibleError, TemplateError, UnknownRequestError,
                              UnknownServerError)
    from peace.mincost import FlowBound, min_cost_flow_bound
    from peace.model import (MB, Network, Rack, SwitchLink, Topology, build_network,
                             figure5_topology, leaf_spine_topology, paper_topology)
    from peace.placement import (RACK_AWARE, UNCONSTRAINED, ChunkPlacement, ChunkRelease,
                                 ReplicaTemplate, Schedule, TimestepPlan, WriteRequest)
    from peace.scheduler import PeaceScheduler
    from peace.validate import ScheduleReport, validate_schedule
    from peace.variants import SCHEDULER_VARIANTS, make_scheduler

_WHERE: dict[str, str] = {
    **dict.fromkeys(("CannotScheduleNowError", "InfeasibleRequestError", "InvalidRequestError",
                     "InvalidScheduleError", "MalformedTopologyError", "PeaceError",
                     "ScheduleInfeasibleError", "TemplateError", "UnknownRequestError",
                     "UnknownServerError"), "peace.errors"),
    **dict.fromkeys(("MB", "Network", "Rack", "SwitchLink", "Topology", "build_network",
                     "figure5_topology", "leaf_spine_topology", "paper_topology"), "peace.model"),
    **dict.fromkeys(("RACK_AWARE", "UNCONSTRAINED", "ChunkPlacement", "ChunkRelease",
                     "ReplicaTemplate",
                     "Schedule", "TimestepPlan", "WriteRequest"), "peace.placement"),
    "PeaceScheduler": "peace.scheduler",
    "SCHEDULER_VARIANTS": "peace.variants", "make_scheduler": "peace.variants",
    "ScheduleReport": "peace.validate", "validate_schedule": "peace.validate",
    **dict.fromkeys(("Coordinator", "RequestState", "RequestStatus"), "peace.coordinator"),
    "FlowBound": "peace.mincost", "min_cost_flow_bound": "peace.mincost",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Load an exported name from its module on first use."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'peace' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
