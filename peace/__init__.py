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
"""
from peace.errors import (CannotScheduleNowError, InfeasibleRequestError, InvalidRequestError,
                          InvalidScheduleError, MalformedTopologyError, PeaceError,
                          ScheduleInfeasibleError, TemplateError, UnknownRequestError,
                          UnknownServerError)
from peace.model import (MB, Network, Rack, SwitchLink, Topology, build_network, figure5_topology,
                         leaf_spine_topology, paper_topology)
from peace.placement import (RACK_AWARE, UNCONSTRAINED, ChunkPlacement, ReplicaTemplate, Schedule,
                             TimestepPlan, WriteRequest)
from peace.scheduler import PeaceScheduler
from peace.variants import SCHEDULER_VARIANTS, make_scheduler
from peace.validate import ScheduleReport, validate_schedule
from peace.coordinator import Coordinator, RequestState, RequestStatus
from peace.mincost import FlowBound, min_cost_flow_bound

__all__ = [
    "CannotScheduleNowError", "InfeasibleRequestError", "InvalidRequestError",
    "InvalidScheduleError", "MalformedTopologyError", "PeaceError", "ScheduleInfeasibleError",
    "TemplateError", "UnknownRequestError", "UnknownServerError",
    "MB", "Network", "Rack", "SwitchLink", "Topology", "build_network", "figure5_topology",
    "leaf_spine_topology", "paper_topology",
    "RACK_AWARE", "UNCONSTRAINED", "ChunkPlacement", "PeaceScheduler", "ReplicaTemplate",
    "Schedule", "TimestepPlan", "WriteRequest", "SCHEDULER_VARIANTS", "make_scheduler",
    "ScheduleReport", "validate_schedule",
    "Coordinator", "RequestState", "RequestStatus", "FlowBound", "min_cost_flow_bound",
]
