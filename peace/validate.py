"""Check a schedule as a certificate, independently of the scheduler that made it.

:func:`validate_schedule` re-derives everything from the graph: every chunk of
every request is placed exactly once; each placement is a chain (pipeline)
starting at the writer through ``r`` distinct replicas other than the writer;
each hop is a real path of graph edges from ``("snd", src)`` to ``("rcv", dst)``;
the replica constraint templates hold; costs are recomputed; and no edge carries
more chunks than its capacity, under one of the two capacity rules of Peace:

* per timestep (``hold_inflight=False``, Algorithm 1 and the coordinator's
  default): the chunks stamped with one timestep together fit the capacity (or a
  given starting residual); chunks of different timesteps may overlap in time;
* in flight (``hold_inflight=True``, the coordinator with ``hold_inflight`` or
  ``work_conserving``): at every placement, the chunks placed and not yet
  released (:class:`~peace.placement.ChunkRelease`) together fit the capacity,
  whatever their timesteps. Requests that fill a running timestep
  (``fill_on_submit``) use capacity its completed chunks freed, so a timestep's
  chunks may together exceed the capacity under this rule, never at one moment.

An online history (:meth:`peace.coordinator.Coordinator.log`) interleaves
placements and releases in the order they happened; a release must name a chunk
in flight, and in a history (any release, or ``hold_inflight``) placements never
go back to an earlier timestep; a plain list of placements may come in any order. The
coordinator's invariant checker certifies its own history with this function,
so the two share one definition of a valid schedule.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from peace.errors import InvalidScheduleError
from peace.model import Network, Vertex
from peace.placement import (RACK_AWARE, ChunkPlacement, ChunkRelease, ReplicaTemplate,
                             WriteRequest)

__all__ = ["ScheduleReport", "validate_schedule"]


@dataclass(frozen=True, slots=True)
class ScheduleReport:
    """What a valid schedule certifies."""

    chunks: int
    timesteps: int
    """Number of distinct timesteps used."""
    total_cost: int
    max_edge_load: int
    """Largest number of chunks on one edge: in one timestep (``hold_inflight=False``) or
    at one moment (``hold_inflight=True``)."""


def validate_schedule(network: Network, requests: Sequence[WriteRequest],
                      placements: Sequence[ChunkPlacement | ChunkRelease],
                      templates: Sequence[ReplicaTemplate] = RACK_AWARE, *,
                      complete: bool = True,
                      capacity_by_timestep: Mapping[int, npt.NDArray[np.int64]] | None = None,
                      hold_inflight: bool = False) -> ScheduleReport:
    """Validate ``placements`` for ``requests`` on ``network``.

    Parameters
    ----------
    placements
        Chunk placements, possibly interleaved with releases in the order they
        happened (an online history; see the module docstring).
    complete
        Require every chunk of every request to be placed (else: at most once).
    capacity_by_timestep
        Residual capacity each timestep started from (default: full capacity);
        per-timestep rule only.
    hold_inflight
        Check the in-flight rule (chunks placed and not released never exceed the
        capacity) instead of the per-timestep rule; what the coordinator guarantees
        with ``hold_inflight`` or ``work_conserving``.

    Returns
    -------
    ScheduleReport

    Raises
    ------
    InvalidScheduleError
        On the first violated property, naming the request, chunk, timestep and edge.
    ValueError
        If ``capacity_by_timestep`` is given with ``hold_inflight``.

    Notes
    -----
    Runtime complexity: O(total hop length + edges * timesteps).
    """
    if hold_inflight and capacity_by_timestep is not None:
        raise ValueError("capacity_by_timestep applies to the per-timestep rule only, "
                         "not with hold_inflight=True")
    by_id: dict[int, WriteRequest] = {}
    for request in requests:
        if request.request_id in by_id:
            raise InvalidScheduleError(f"duplicate request id {request.request_id}")
        by_id[request.request_id] = request
    seen: set[tuple[int, int]] = set()
    load: dict[int, dict[tuple[Vertex, Vertex], int]] = defaultdict(lambda: defaultdict(int))
    graph = network.graph
    total_cost = 0
    flying: dict[tuple[int, int], list[tuple[Vertex, Vertex]]] = {}
    now: dict[tuple[Vertex, Vertex], int] = defaultdict(int)
    max_now = 0
    last_t = -1
    timesteps: set[int] = set()
    history = hold_inflight or any(isinstance(pl, ChunkRelease) for pl in placements)
    for pl in placements:
        if isinstance(pl, ChunkRelease):
            used = flying.pop((pl.request_id, pl.chunk_index), None)
            if used is None:
                raise InvalidScheduleError(
                    f"request {pl.request_id} chunk {pl.chunk_index}: released but not in "
                    f"flight (never placed, or released twice)")
            for uv in used:
                now[uv] -= 1
            continue
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
        if history and pl.timestep < last_t:
            raise InvalidScheduleError(f"{where}: placed after a chunk of timestep {last_t}")
        last_t = pl.timestep
        timesteps.add(pl.timestep)
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
        chain: list[tuple[Vertex, Vertex]] = []
        for h, hop in enumerate(pl.hops):
            if not hop or hop[0] != ("snd", servers[h]) or hop[-1] != ("rcv", servers[h + 1]):
                raise InvalidScheduleError(
                    f"{where}: hop {h} must run from snd {servers[h]!r} to rcv {servers[h + 1]!r}, "
                    f"got {hop[:1]}..{hop[-1:]} (chain property)")
            for u, v in zip(hop, hop[1:]):
                if not graph.has_edge(u, v):
                    raise InvalidScheduleError(f"{where}: hop {h} uses non-edge {u}->{v}")
                cost += int(graph.edges[u, v]["weight"])
                chain.append((u, v))
        if cost != pl.cost:
            raise InvalidScheduleError(f"{where}: stated cost {pl.cost}, recomputed {cost}")
        total_cost += cost
        flying[key] = chain
        if hold_inflight:
            for uv in chain:
                now[uv] += 1
            for uv in chain:  # checked once the whole chain holds its edges
                limit = int(network.capacity[graph.edges[uv]["eid"]])
                if now[uv] > limit:
                    raise InvalidScheduleError(
                        f"{where}: edge {uv[0]}->{uv[1]} carries {now[uv]} chunks in flight, "
                        f"capacity {limit}")
                max_now = max(max_now, now[uv])
        else:
            for uv in chain:
                load[pl.timestep][uv] += 1
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
    return ScheduleReport(len(seen), len(timesteps), total_cost,
                          max_now if hold_inflight else max_load)
