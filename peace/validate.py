"""Check a schedule as a certificate, independently of the scheduler that made it.

:func:`validate_schedule` re-derives everything from the graph: every chunk of
every request is placed exactly once; each placement is a chain (pipeline)
starting at the writer through ``r`` distinct replicas other than the writer;
each hop is a real path of graph edges from ``("snd", src)`` to ``("rcv", dst)``;
the replica constraint templates hold; per timestep no edge carries more chunks
than its capacity (or than a given starting residual); costs are recomputed.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from peace.errors import InvalidScheduleError
from peace.model import Network, Vertex
from peace.placement import RACK_AWARE, ChunkPlacement, ReplicaTemplate, WriteRequest

__all__ = ["ScheduleReport", "validate_schedule"]


@dataclass(frozen=True, slots=True)
class ScheduleReport:
    """What a valid schedule certifies."""

    chunks: int
    timesteps: int
    """Number of distinct timesteps used."""
    total_cost: int
    max_edge_load: int
    """Largest number of chunks on one edge in one timestep."""


def validate_schedule(network: Network, requests: Sequence[WriteRequest],
                      placements: Sequence[ChunkPlacement],
                      templates: Sequence[ReplicaTemplate] = RACK_AWARE, *,
                      complete: bool = True,
                      capacity_by_timestep: Mapping[int, npt.NDArray[np.int64]] | None = None,
                      ) -> ScheduleReport:
    """Validate ``placements`` for ``requests`` on ``network``.

    Parameters
    ----------
    complete
        Require every chunk of every request to be placed (else: at most once).
    capacity_by_timestep
        Residual capacity each timestep started from (default: full capacity).

    Returns
    -------
    ScheduleReport

    Raises
    ------
    InvalidScheduleError
        On the first violated property, naming the request, chunk, timestep and edge.

    Notes
    -----
    Runtime complexity: O(total hop length + edges * timesteps).
    """
    by_id: dict[int, WriteRequest] = {}
    for request in requests:
        if request.request_id in by_id:
            raise InvalidScheduleError(f"duplicate request id {request.request_id}")
        by_id[request.request_id] = request
    seen: set[tuple[int, int]] = set()
    load: dict[int, dict[tuple[Vertex, Vertex], int]] = defaultdict(lambda: defaultdict(int))
    graph = network.graph
    total_cost = 0
    for pl in placements:
        where = f"request {pl.request_id} chunk {pl.chunk_index} (timestep {pl.timestep})"
        req = by_id.get(pl.request_id)
        if req is None:
            raise InvalidScheduleError(f"{where}: no such request")
        lo, hi = req.first_chunk, req.first_chunk + req.chunks
        if not lo <= pl.chunk_index < hi:
            raise InvalidScheduleError(f"{where}: chunk index outside {lo}..{hi - 1}")
        key = (pl.request_id, pl.chunk_index)
        if key in seen:
            raise InvalidScheduleError(f"{where}: chunk placed twice")
        seen.add(key)
        if pl.timestep < 0:
            raise InvalidScheduleError(f"{where}: negative timestep")
        servers = pl.servers
        if not servers or servers[0] != req.writer:
            raise InvalidScheduleError(f"{where}: chain starts at {servers[:1]}, not writer "
                                       f"{req.writer!r}")
        if len(servers) != req.replication + 1:
            raise InvalidScheduleError(f"{where}: {len(servers) - 1} replicas, wanted "
                                       f"{req.replication}")
        if len(set(servers)) != len(servers):
            raise InvalidScheduleError(f"{where}: a server appears twice in chain {servers}")
        for s in servers:
            if s not in network.server_index:
                raise InvalidScheduleError(f"{where}: unknown server {s!r}")
        idx = [network.server_index[s] for s in servers]
        racks = [int(network.rack_of[i]) for i in idx]
        for rep in range(req.replication):
            if rep >= len(templates):
                continue
            tpl = templates[rep]
            prefix = racks[: rep + 1]
            mine = racks[rep + 1]
            for pos in tpl.same_rack_as:
                if mine != prefix[pos]:
                    raise InvalidScheduleError(
                        f"{where}: replica {rep} on {servers[rep + 1]!r} is not in the rack of "
                        f"path position {pos} ({servers[:rep + 1][pos]!r})")
            for pos in tpl.other_rack_than:
                if mine == prefix[pos]:
                    raise InvalidScheduleError(
                        f"{where}: replica {rep} on {servers[rep + 1]!r} shares the rack of "
                        f"path position {pos} ({servers[:rep + 1][pos]!r})")
        if len(pl.hops) != req.replication:
            raise InvalidScheduleError(f"{where}: {len(pl.hops)} hops for {req.replication} replicas")
        cost = 0
        for h, hop in enumerate(pl.hops):
            if not hop or hop[0] != ("snd", servers[h]) or hop[-1] != ("rcv", servers[h + 1]):
                raise InvalidScheduleError(
                    f"{where}: hop {h} must run from snd {servers[h]!r} to rcv {servers[h + 1]!r}, "
                    f"got {hop[:1]}..{hop[-1:]} (chain property)")
            for u, v in zip(hop, hop[1:]):
                if not graph.has_edge(u, v):
                    raise InvalidScheduleError(f"{where}: hop {h} uses non-edge {u}->{v}")
                cost += int(graph.edges[u, v]["weight"])
                load[pl.timestep][(u, v)] += 1
        if cost != pl.cost:
            raise InvalidScheduleError(f"{where}: stated cost {pl.cost}, recomputed {cost}")
        total_cost += cost
    if complete:
        for req in requests:
            for c in range(req.first_chunk, req.first_chunk + req.chunks):
                if (req.request_id, c) not in seen:
                    raise InvalidScheduleError(f"request {req.request_id} chunk {c} never placed")
    max_load = 0
    for t, edges in load.items():
        cap = None if capacity_by_timestep is None else capacity_by_timestep.get(t)
        for (u, v), n in edges.items():
            eid = graph.edges[u, v]["eid"]
            limit = int(network.capacity[eid] if cap is None else cap[eid])
            if n > limit:
                raise InvalidScheduleError(
                    f"timestep {t}: edge {u}->{v} carries {n} chunks, capacity {limit}")
            max_load = max(max_load, n)
    return ScheduleReport(len(seen), len(load), total_cost, max_load)
