"""Min-cost-flow formulation of one timestep, to compare Algorithm 1 against.

One unit of flow is the first hop of one chunk: a super source ``s`` feeds each
writer's ``snd`` vertex with as many units as it has chunks, every ``rcv``
vertex drains into a super sink ``d``, and every graph edge keeps its residual
capacity and cost. The maximum flow is therefore an upper bound on the number
of chunks any schedule can start in the timestep (whatever ``r``: each chunk
needs at least its first hop), and its minimum cost a lower bound on the cost
of those first hops. The relaxation drops the chain, distinctness and template
constraints (and allows a writer to reach its own ``rcv``), so it is a bound,
exact only in that relaxed sense; networkx solves it exactly on integers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import networkx as nx
import numpy as np
import numpy.typing as npt

from peace.model import Network
from peace.placement import WriteRequest

__all__ = ["FlowBound", "min_cost_flow_bound"]


@dataclass(frozen=True, slots=True)
class FlowBound:
    """Result of :func:`min_cost_flow_bound`."""

    max_chunks: int
    """Upper bound on the chunks that can start this timestep."""
    min_cost: int
    """Minimum total cost of that many first hops."""


def min_cost_flow_bound(network: Network, requests: Sequence[WriteRequest],
                        residual: npt.NDArray[np.int64] | None = None, *,
                        method: Literal["max_flow_min_cost", "network_simplex",
                                        "capacity_scaling"] = "max_flow_min_cost") -> FlowBound:
    """Solve the relaxed one-timestep placement as a min-cost max-flow.

    Parameters
    ----------
    method
        ``max_flow_min_cost`` (one call), or first the max flow then a min-cost
        flow of exactly that value with ``network_simplex`` or ``capacity_scaling``.

    Raises
    ------
    UnknownServerError
        If a writer is not in the topology.

    Notes
    -----
    Builds one graph per call (not per decision). Runtime: that of networkx's solver.
    """
    res = network.capacity if residual is None else residual
    h = nx.DiGraph()
    for eid, (u, v) in enumerate(zip(network.edge_u, network.edge_v)):
        if res[eid] > 0:
            h.add_edge(u, v, capacity=int(res[eid]), weight=int(network.cost[eid]))
    supply: dict[str, int] = {}
    for req in requests:
        network.index(req.writer)
        supply[req.writer] = supply.get(req.writer, 0) + int(req.chunks)
    total = sum(supply.values())
    for w, k in supply.items():
        h.add_edge("s", ("snd", w), capacity=k, weight=0)
    for s in network.servers:
        h.add_edge(("rcv", s), "d", capacity=total, weight=0)
    h.add_nodes_from(["s", "d"])
    if method == "max_flow_min_cost":
        flow = nx.max_flow_min_cost(h, "s", "d")
        value = sum(flow["s"].values())
        return FlowBound(int(value), int(nx.cost_of_flow(h, flow)))
    value = int(nx.maximum_flow_value(h, "s", "d"))
    nx.set_node_attributes(h, 0, "demand")
    h.nodes["s"]["demand"] = -value
    h.nodes["d"]["demand"] = value
    if method == "network_simplex":
        cost, _ = nx.network_simplex(h)
    elif method == "capacity_scaling":
        cost, _ = nx.capacity_scaling(h)
    else:
        raise ValueError(f"unknown method {method!r}")
    return FlowBound(value, int(cost))
