"""The Peace chunk scheduler, one timestep at a time: Algorithm 1 as published, and improved.

Two variants share this module (pick one with ``PeaceScheduler(..., variant=...)``):

``"paper"`` -- Algorithm 1 exactly as published (§5)
    For each request ``(w, r, k)`` (in the given order) and each of its chunks,
    each of the ``r`` replicas takes a *randomized shortest path* (RSP) from the
    current source ``z`` (first the writer, then the previous replica: the
    replicas form a chain, i.e. an HDFS pipeline) to a server allowed by the
    replica's constraint template, on the residual graph. A chunk is scheduled
    only if all its replicas are; the capacity a partially placed chunk took is
    given back, and the rest of the request waits for the next timestep
    (``W'``). Ties among equal-cost destinations are broken uniformly at random.

``"improved"`` (default; the ``peace`` policy of the benchmark) -- Algorithm 1 plus
    seven changes, all of them only *restrict or order* the candidates of the
    same randomized shortest-path step (or, 7, drop whole requests from the end
    of a timestep), so every placement is still a
    minimum-cost path on the residual graph and capacities, templates and the
    chain property hold exactly as before (the validator checks the same
    certificate):

    1. **send look-ahead**: a replica that must forward the chunk (every replica
       but the last) may only go to a server that still has send capacity
       (residual on its SND->UP and UP->SW edges). The published RSP ignores
       this, so with capacity 2 on SND->UP a chain often reaches a replica that
       cannot forward, fails halfway, and -- Algorithm 1 line 23 -- the whole
       rest of the request is deferred;
    2. **bounded backtracking**: if a later hop of the chain still fails, the
       replica before it is re-drawn among its other candidates (at most
       ``max_backtracks`` re-draws per chunk) before giving up;
    3. **role-aware tie-break**: among equal-cost destinations, a forwarding
       replica prefers servers whose own send capacity no request near the head
       of the queue needs (no pending request, else the latest one in the
       queue), and the last replica prefers servers whose send capacity *is*
       needed (writers at the head of the queue: their receive side is
       otherwise idle). Ties that remain are broken uniformly at random. The
       published tie-break lets forwarding chains eat the send slots of the
       writers scheduled next, so each request spreads over more timesteps;
    4. **whole requests** ("scheduling all writes from the same set close
       together", §5): a request that has not started yet starts only if it
       gets its full rate this timestep -- ``min(k, writer's residual send
       capacity)`` chunks -- otherwise its chunks are given back and it waits.
       A request's service time starts with its first chunk, so a request that
       starts with one chunk and then starves is what makes service times long.
       If nothing at all could be placed that way, the pass is redone without
       this rule, so nothing that Algorithm 1 would place ever stalls;
    5. **started requests first**: requests that already have chunks written
       are served before requests that have not started (stable otherwise), so
       a started request keeps its rate until it is done;
    6. **spread receivers**: among equal-cost destinations, servers with more
       free receive slots (DN->RCV) come first, before the role-aware key: two
       chunks share a disk (and each runs at half its speed) only when they
       must;
    7. **rate-aware cut** (work conservation by the bytes, not the slots): the
       capacities count chunks per timestep as if every chunk ran at disk / 2,
       but a chunk alone on its disks runs at the full disk speed until a link
       or NIC it shares is the bottleneck. After the pass, the timestep keeps
       the prefix of its placements (cut between requests, started ones first)
       that moves the most bytes per second by the topology's bandwidths:
       ``k * min over the used edges e of bandwidth(e) / chunks on e``, every
       chunk paced by the slowest (a timestep ends when most of its chunks
       have). Filling a fifth inter-rack slot at r = 2 on the paper's network
       puts two chunks on some disks and slows the whole timestep from
       31 MB/s (link-bound, 4 chunks per direction) to 22.5 MB/s per chunk;
       the cut leaves those chunks for the next timestep. At r = 3 disks must
       be shared anyway and the full timestep moves the most bytes, so it is
       kept. Every kept placement is unchanged, so the certificate holds.

    The template look-ahead (``lookahead``: never pick a rack from which the
    remaining templates cannot be met, e.g. a one-server rack when the next
    replica must share it) is on in ``"improved"`` and off in ``"paper"``.

Individual changes can be switched with :class:`Heuristics` (ablations).

A third variant, ``"mcf"`` (:class:`peace.mcf.McfScheduler`, built by
:func:`peace.variants.make_scheduler`), plans each timestep with an integral min-cost flow and
repairs the plan into chains with the improved search.

Randomization is explicit: among all eligible destinations whose path cost is
minimal (and, in ``"improved"``, of the best tie-break class), one is drawn
uniformly; among the minimal-cost paths to it, one is drawn uniformly (by
counting shortest paths). networkx alone would break ties deterministically.

Two RSP implementations give the same distribution:

* ``"networkx"``: Dijkstra on the whole graph with a weight function that hides
  saturated edges (returns ``None``), so no residual graph is ever copied;
* ``"fast"`` (default): the same search exploiting the model's structure
  (server -> rack switch -> switch graph -> rack switch -> server): Dijkstra on
  the small switch graph, then one vectorized pass over the servers. This is
  what keeps a 1000-server decision well under a millisecond.

The residual of a timestep is one int64 vector indexed by edge id
(:meth:`peace.model.Network.new_residual`). Unlike a textbook SSP residual there
are no reverse edges: a placed chunk is never re-routed.

Invariants: every placement's ``servers`` starts with the writer, holds ``r``
distinct replicas different from the writer, hop ``i`` goes from ``servers[i]``
to ``servers[i + 1]``; the residual never goes negative. Check schedules with
:func:`peace.validate.validate_schedule`.
"""
from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import networkx as nx
import numpy as np
import numpy.typing as npt

from peace.errors import InfeasibleRequestError, ScheduleInfeasibleError
from peace.model import Network, Topology, Vertex, build_network
from peace.placement import (RACK_AWARE, UNCONSTRAINED, ChunkPlacement, ReplicaTemplate, Residual,
                             Schedule, TimestepPlan, WriteRequest, check_templates)

__all__ = [
    "ReplicaTemplate",
    "RACK_AWARE",
    "UNCONSTRAINED",
    "WriteRequest",
    "ChunkPlacement",
    "TimestepPlan",
    "Schedule",
    "SchedulerStats",
    "Heuristics",
    "VARIANTS",
    "PeaceScheduler",
    "check_templates",
]

logger = logging.getLogger(__name__)

_NO_REQUEST = 1 << 40
"""Rank of a server without a pending request (see ``PeaceScheduler._preference``)."""
_Rsp = Callable[[int, npt.NDArray[np.bool_], Residual, "npt.NDArray[np.int64] | None"],
                "tuple[int, tuple[int, ...], int] | None"]


@dataclass(frozen=True, slots=True)
class Heuristics:
    """Which of the improvements over the published Algorithm 1 are on (see the module docstring).

    >>> VARIANTS["paper"].send_lookahead, VARIANTS["improved"].send_lookahead
    (False, True)
    """

    template_lookahead: bool = True
    """Never pick a rack from which the remaining templates cannot be met."""
    send_lookahead: bool = True
    """A forwarding replica must still have send capacity (SND->UP and UP->SW)."""
    max_backtracks: int = 4
    """Re-draws per chunk of a replica whose successors found no path (0: none)."""
    role_aware_ties: bool = True
    """Equal-cost forwarders avoid the writers needed next; last replicas prefer them."""
    whole_requests: bool = True
    """An unstarted request starts only with its full per-timestep rate."""
    started_first: bool = True
    """Requests with chunks already placed go before requests that have not started."""
    spread_receivers: bool = True
    """Among equal-cost destinations prefer servers with the most free receive slots
    (before the role-aware key): chunks avoid sharing a disk when they need not."""
    rate_aware_cut: bool = True
    """Keep the prefix of a timestep's requests that moves the most bytes per second by
    the topology's bandwidths (see change 7 in the module docstring)."""


#: named variants: ``"paper"`` is Algorithm 1 as published, ``"improved"`` the default.
VARIANTS: dict[str, Heuristics] = {
    "improved": Heuristics(),
    "paper": Heuristics(template_lookahead=False, send_lookahead=False, max_backtracks=0,
                        role_aware_ties=False, whole_requests=False, started_first=False,
                        spread_receivers=False, rate_aware_cut=False),
}


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counters of a :class:`PeaceScheduler` (decisions = RSP calls)."""

    decisions: int
    failed_decisions: int
    decision_time_s: float
    """Wall time spent in :meth:`PeaceScheduler.schedule_timestep` (all bookkeeping included)."""
    chunks_placed: int
    decision_cpu_s: float = 0.0
    """CPU time of the deciding thread in :meth:`PeaceScheduler.schedule_timestep`: the
    decisions' own cost, without the turns other processes take on a shared machine."""

    @property
    def ms_per_decision(self) -> float:
        """Mean wall time of one replica placement decision, in milliseconds."""
        return 1000.0 * self.decision_time_s / self.decisions if self.decisions else 0.0


class PeaceScheduler:
    """Algorithm 1 (published or improved) over a :class:`~peace.model.Network`.

    Parameters
    ----------
    network
        A compiled network, or a :class:`~peace.model.Topology` to compile.
    templates
        One :class:`ReplicaTemplate` per replica index; replicas beyond the last
        template are only required to be distinct. Default :data:`RACK_AWARE`.
    seed
        Seed or ``numpy.random.Generator`` for the randomized shortest paths.
    method
        ``"fast"`` (structured search) or ``"networkx"`` (Dijkstra on the graph).
    variant
        ``"improved"`` (default) or ``"paper"`` (Algorithm 1 as published), or a
        :class:`Heuristics` for ablations. See the module docstring.
    lookahead
        Override the variant's template look-ahead: also exclude destinations
        from which the remaining templates cannot be met at all (e.g. a rack
        with one server for a replica whose successor must share its rack). The
        published algorithm has none and can then stall forever on such racks;
        on topologies whose racks all hold more than ``r`` servers both settings
        behave the same. ``None``: the variant's setting.

    Examples
    --------
    >>> from peace.model import figure5_topology
    >>> s = PeaceScheduler(figure5_topology(), seed=1)
    >>> plan = s.schedule_timestep([WriteRequest("svr1.1", 2, 1)], s.network.new_residual())
    >>> plan.placements[0].servers[:2]
    ('svr1.1', 'svr1.2')

    Figure 5's example: the published algorithm may send SVR1.1's second replica
    to SVR2.2 and so defer SVR2.1; the improved one sends it to SVR2.1, whose
    receive side the writer does not need, and places both chunks at once.

    >>> reqs = [WriteRequest("svr1.1", 2, 1, 0), WriteRequest("svr2.1", 2, 1, 1)]
    >>> s = PeaceScheduler(figure5_topology(), seed=1)
    >>> [p.servers for p in s.schedule_timestep(reqs, s.network.new_residual()).placements]
    [('svr1.1', 'svr1.2', 'svr2.1'), ('svr2.1', 'svr2.2', 'svr1.1')]
    """

    def __init__(self, network: Network | Topology, templates: Sequence[ReplicaTemplate] = RACK_AWARE,
                 *, seed: int | np.random.Generator | None = None,
                 method: Literal["fast", "networkx"] = "fast",
                 variant: str | Heuristics = "improved", lookahead: bool | None = None) -> None:
        self.network = network if isinstance(network, Network) else build_network(network)
        self.templates = tuple(templates)
        check_templates(self.templates, len(self.templates))
        self.rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        if method not in ("fast", "networkx"):
            raise ValueError(f"unknown RSP method {method!r}")
        self.method = method
        if isinstance(variant, Heuristics):
            h = variant
            self.variant = "custom"
        elif variant in VARIANTS:
            h = VARIANTS[variant]
            self.variant = variant
        else:
            raise ValueError(f"unknown variant {variant!r}; choose from {sorted(VARIANTS)}")
        if lookahead is not None and lookahead != h.template_lookahead:
            h = replace(h, template_lookahead=lookahead)
        if h.max_backtracks < 0:
            raise ValueError(f"max_backtracks must be >= 0, got {h.max_backtracks}")
        self.heuristics = h
        self.lookahead = h.template_lookahead
        self._rack_sizes = tuple(len(m) for m in self.network.rack_members)
        self._rack_ok_cache: dict[tuple[tuple[int, ...], int], npt.NDArray[np.bool_]] = {}
        self._completable_cache: dict[tuple[tuple[int, ...], int], bool] = {}
        self._decisions = 0
        self._failed = 0
        self._decision_time = 0.0
        self._decision_cpu = 0.0
        self._placed = 0
        net = self.network
        self._server_switch = net.rack_of  # rack r hangs under switch index r
        self._all_true = np.ones(net.n_servers, dtype=bool)
        self._edge_bw = _edge_bandwidths(net)

    # ------------------------------------------------------------------ stats
    def stats(self) -> SchedulerStats:
        """Decision counters since construction."""
        return SchedulerStats(self._decisions, self._failed, self._decision_time, self._placed,
                              self._decision_cpu)

    # ------------------------------------------------------------- validation
    def check_request(self, request: WriteRequest) -> None:
        """Reject a request that can never be scheduled, even on an empty network.

        Raises
        ------
        UnknownServerError
            If the writer is not a server of the topology.
        TemplateError
            If the templates are inconsistent for ``request.replication``.
        InfeasibleRequestError
            If no chain of ``r`` distinct servers satisfies the templates
            within the full capacities (e.g. ``r`` larger than the eligible nodes).
        """
        net = self.network
        w = net.index(request.writer)
        r = request.replication
        if r > net.n_servers - 1:
            raise InfeasibleRequestError(
                f"request {request.request_id} from {request.writer!r}: replication {r} exceeds "
                f"the {net.n_servers - 1} servers other than the writer")
        check_templates(self.templates, r)
        if self._find_chain_exhaustive(w, r) is None:
            raise InfeasibleRequestError(
                f"request {request.request_id} from {request.writer!r}: no chain of {r} replicas "
                f"satisfies the constraint templates {self.templates[:r]}")

    def _find_chain_exhaustive(self, w: int, r: int) -> list[int] | None:
        """Depth-first search for one feasible chain on the empty network (rack-level pruning)."""
        net = self.network
        residual = net.new_residual()

        def dfs(path: list[int]) -> list[int] | None:
            i = len(path) - 1
            if i == r:
                return path
            allowed = self._allowed(path, i, r)
            tried_racks: set[int] = set()
            for j in np.flatnonzero(allowed).tolist():
                # servers of one rack are interchangeable at this depth unless a later
                # template distinguishes them (it cannot: templates are rack-based)
                key = int(net.rack_of[j])
                if key in tried_racks:
                    continue
                q = self._rsp_fast(path[-1], _single(net.n_servers, j), residual)
                if q is None:
                    continue
                tried_racks.add(key)
                _, eids, _ = q
                for e in eids:
                    residual[e] -= 1
                found = dfs(path + [j])
                for e in eids:
                    residual[e] += 1
                if found is not None:
                    return found
            return None

        return dfs([w])

    # -------------------------------------------------------------- Algorithm 1
    def _allowed(self, path: Sequence[int], replica: int, replication: int = 0
                 ) -> npt.NDArray[np.bool_]:
        """Boolean mask of servers allowed for ``replica`` given the path so far (constraint c)."""
        net = self.network
        mask = self._all_true.copy()
        mask[list(path)] = False
        if replica < len(self.templates):
            tpl = self.templates[replica]
            rack_of = net.rack_of
            for idx in tpl.same_rack_as:
                mask &= rack_of == rack_of[path[idx]]
            for idx in tpl.other_rack_than:
                mask &= rack_of != rack_of[path[idx]]
        if self.lookahead and replica + 1 < replication:
            racks = tuple(int(net.rack_of[i]) for i in path)
            key = (racks, replication)
            rack_ok = self._rack_ok_cache.get(key)
            if rack_ok is None:
                rack_ok = np.array([self._completable(racks + (r,), replication)
                                    for r in range(net.n_racks)], dtype=bool)
                self._rack_ok_cache[key] = rack_ok
            mask &= rack_ok[net.rack_of]
        return mask

    def _template_ok(self, racks: tuple[int, ...]) -> bool:
        """Whether the last rack of ``racks`` meets its replica's template (rack level)."""
        i = len(racks) - 2
        if i >= len(self.templates):
            return True
        tpl = self.templates[i]
        mine = racks[-1]
        prefix = racks[:-1]
        return (all(mine == prefix[idx] for idx in tpl.same_rack_as)
                and all(mine != prefix[idx] for idx in tpl.other_rack_than))

    def _completable(self, racks: tuple[int, ...], replication: int) -> bool:
        """Whether a chain whose path so far sits in ``racks`` can get all its replicas."""
        key = (racks, replication)
        hit = self._completable_cache.get(key)
        if hit is not None:
            return hit
        if racks.count(racks[-1]) > self._rack_sizes[racks[-1]] or not self._template_ok(racks):
            ok = False
        elif len(racks) - 1 >= replication:
            ok = True
        else:
            ok = any(self._completable(racks + (r,), replication) for r in range(len(self._rack_sizes)))
        self._completable_cache[key] = ok
        return ok

    def schedule_timestep(self, requests: Iterable[WriteRequest], residual: Residual,
                          timestep: int = 0, *, base_chunks: int = 0,
                          base: npt.NDArray[np.int64] | None = None) -> TimestepPlan:
        """Run Algorithm 1 once: place what fits into ``residual`` (updated in place).

        Parameters
        ----------
        requests
            Requests in priority order (earlier requests first; with
            ``started_first`` the started ones move ahead, stably).
        residual
            Residual capacity per edge for this timestep; decremented for every
            scheduled chunk (``G <- G'``), untouched by chunks that did not fit.
        timestep
            Stamped on the placements.
        base_chunks, base
            Chunks already running on the capacity ``residual`` is left of, and their
            use of every edge (an int vector by edge id): the rate-aware cut counts
            them, and may then place nothing. Default: none (a fresh timestep).

        Returns
        -------
        TimestepPlan
            The placements ``P`` and the deferred requests ``W'``.

        Raises
        ------
        UnknownServerError
            If a writer is not in the topology.

        Notes
        -----
        Runtime complexity: O(chunks * r * (1 + max_backtracks) * (switches log switches
        + servers)), twice in the worst case with ``whole_requests``.
        """
        t_start = time.perf_counter()
        cpu_start = time.thread_time()
        h = self.heuristics
        reqs = list(requests)
        writers = [self.network.index(req.writer) for req in reqs]
        if h.started_first:
            order = ([i for i, q in enumerate(reqs) if q.first_chunk > 0]
                     + [i for i, q in enumerate(reqs) if q.first_chunk == 0])
            reqs = [reqs[i] for i in order]
            writers = [writers[i] for i in order]
        try:
            placements, deferred, rolled_back = self._pass(reqs, writers, residual, timestep,
                                                           h.whole_requests)
            if rolled_back and not placements:
                # whole_requests must never stall what Algorithm 1 would place
                placements, deferred, _ = self._pass(reqs, writers, residual, timestep, False)
            if h.rate_aware_cut and placements:
                placements, deferred = self._rate_aware_cut(reqs, placements, deferred, residual,
                                                            base_chunks, base)
        finally:
            self._decision_time += time.perf_counter() - t_start
            self._decision_cpu += time.thread_time() - cpu_start
        self._placed += len(placements)
        logger.debug("timestep %d: %d chunks placed, %d requests deferred", timestep,
                     len(placements), len(deferred))
        return TimestepPlan(timestep, tuple(placements), tuple(deferred))

    def _pass(self, reqs: Sequence[WriteRequest], writers: Sequence[int], residual: Residual,
              timestep: int, whole: bool
              ) -> tuple[list[ChunkPlacement], list[WriteRequest], int]:
        """One pass of Algorithm 1 over ``reqs``; returns placements, deferred, rollbacks."""
        net = self.network
        # rank[s]: queue position of the next request of writer s still to process this
        # pass (_NO_REQUEST if none): how soon s needs its own send capacity
        n_req = len(reqs)
        rank = np.full(net.n_servers, _NO_REQUEST, dtype=np.int64)
        next_same = [_NO_REQUEST] * n_req
        for i in range(n_req - 1, -1, -1):
            w = writers[i]
            next_same[i] = int(rank[w])
            rank[w] = i
        placements: list[ChunkPlacement] = []
        deferred: list[WriteRequest] = []
        rolled_back = 0
        for i, req in enumerate(reqs):
            w = writers[i]
            k = req.chunks
            idx = req.first_chunk
            r = req.replication
            mine: list[ChunkPlacement] = []
            target = 0
            if whole and req.first_chunk == 0:
                target = min(k, int(residual[net.e_snd_up[w]]), int(residual[net.e_up_sw[w]]))
            while k > 0:
                chain = self._place_chain(w, r, residual, rank)
                if chain is None:
                    break
                mine.append(self._placement(req, idx, timestep, chain))
                k -= 1
                idx += 1
            if mine and len(mine) < target:  # would start below its full rate: wait
                release(residual, mine)
                mine = []
                k, idx = req.chunks, req.first_chunk
                rolled_back += 1
            rank[w] = next_same[i]
            placements.extend(mine)
            if k > 0:
                deferred.append(replace(req, chunks=k, first_chunk=idx))
        return placements, deferred, rolled_back

    def _rate_aware_cut(self, reqs: Sequence[WriteRequest], placements: list[ChunkPlacement],
                        deferred: list[WriteRequest], residual: Residual, base_chunks: int = 0,
                        base: npt.NDArray[np.int64] | None = None
                        ) -> tuple[list[ChunkPlacement], list[WriteRequest]]:
        """Keep the request-aligned prefix of ``placements`` with the highest estimated
        throughput (change 7), counting ``base_chunks`` already running on ``base``; the
        rest is given back to ``residual`` and deferred."""
        bw = self._edge_bw
        counts = np.zeros(self.network.n_edges, dtype=np.int64)
        slowest = np.inf
        best_k, best_rate = len(placements), -1.0
        if base is not None and base_chunks > 0:
            counts += base
            used = counts > 0
            if used.any():
                slowest = float((bw[used] / counts[used]).min())
                best_k, best_rate = 0, base_chunks * slowest
        for k, pl in enumerate(placements, 1):
            eids = np.asarray(pl.edge_ids, dtype=np.int64)
            np.add.at(counts, eids, 1)
            slowest = min(slowest, float((bw[eids] / counts[eids]).min()))
            at_boundary = k == len(placements) or placements[k].request_id != pl.request_id
            rate = (base_chunks + k) * slowest
            if at_boundary and rate >= best_rate * (1 - 1e-9):  # ties: more chunks
                best_k, best_rate = k, rate
        if best_k == len(placements):
            return placements, deferred
        kept, dropped = placements[:best_k], placements[best_k:]
        release(residual, dropped)
        placed: dict[int, int] = {}
        for pl in kept:
            placed[pl.request_id] = placed.get(pl.request_id, 0) + 1
        out = []
        for q in reqs:
            n = placed.get(q.request_id, 0)
            if n < q.chunks:
                out.append(replace(q, chunks=q.chunks - n, first_chunk=q.first_chunk + n))
        return kept, out

    def _placement(self, req: WriteRequest, chunk_index: int, timestep: int,
                   chain: tuple[list[int], list[tuple[int, ...]], int]) -> ChunkPlacement:
        """The placement of chunk ``chunk_index`` of ``req`` along a chain from `_place_chain`."""
        net = self.network
        path, hops, cost = chain
        return ChunkPlacement(
            request_id=req.request_id, chunk_index=chunk_index, timestep=timestep,
            servers=tuple(net.servers[j] for j in path),
            hops=tuple(net.path_vertices(hp) for hp in hops), cost=cost,
            edge_ids=tuple(e for hp in hops for e in hp))

    def _place_chain(self, w: int, r: int, residual: Residual, rank: npt.NDArray[np.int64]
                     ) -> tuple[list[int], list[tuple[int, ...]], int] | None:
        """Place the ``r`` replicas of one chunk from writer ``w`` as a chain, or give up.

        ``rank``: queue position of each server's next request (role-aware tie-break).
        On success the residual holds the chain's usage; on failure it is unchanged.
        """
        net = self.network
        h = self.heuristics
        rsp: _Rsp = self._rsp_fast if self.method == "fast" else self._rsp_networkx
        ranks = rank if h.role_aware_ties else None
        path = [w]
        hops: list[tuple[int, ...]] = []
        costs: list[int] = []
        budget = h.max_backtracks

        def place(rp: int) -> bool:
            nonlocal budget
            last = rp == r - 1
            excluded: list[int] = []
            z = path[-1]
            while True:
                if residual[net.e_snd_up[z]] <= 0 or residual[net.e_up_sw[z]] <= 0:
                    self._decisions += 1  # the source cannot send: no path (what RSP returns)
                    self._failed += 1
                    return False
                allowed = self._allowed(path, rp, r)
                if excluded:
                    allowed[excluded] = False
                if h.send_lookahead and not last:
                    allowed &= ((residual[net.e_snd_up] > 0) & (residual[net.e_up_sw] > 0))
                prefer = None if ranks is None else self._preference(residual, ranks, last)
                q = rsp(z, allowed, residual, prefer)
                self._decisions += 1
                if q is None:
                    self._failed += 1
                    return False
                dest, eids, c = q
                for e in eids:
                    residual[e] -= 1
                path.append(dest)
                hops.append(eids)
                costs.append(c)
                if last or place(rp + 1):
                    return True
                for e in eids:  # the rest of the chain found no path: re-draw this replica
                    residual[e] += 1
                path.pop()
                hops.pop()
                costs.pop()
                if budget <= 0:
                    return False
                budget -= 1
                excluded.append(dest)

        if not place(0):
            return None
        return path, hops, sum(costs)

    def _preference(self, residual: Residual, rank: npt.NDArray[np.int64], last: bool
                    ) -> npt.NDArray[np.int64]:
        """Tie-break key per server, lower is better (role-aware tie-break, see module doc).

        A forwarding replica prefers servers whose own send capacity is needed
        latest (``rank``: queue position of their next request, ``_NO_REQUEST``
        if none). The last replica only receives: it prefers servers that cannot
        forward anyway -- writers still to be served this pass (soonest first),
        then servers without send capacity left -- before spare forwarders.
        """
        net = self.network
        if not last:
            out: npt.NDArray[np.int64] = -rank
        else:
            spare = ((rank == _NO_REQUEST) & (residual[net.e_snd_up] > 0)
                     & (residual[net.e_up_sw] > 0))
            out = rank + spare.astype(np.int64)
        if self.heuristics.spread_receivers:
            free = np.minimum(residual[net.e_sw_dn], residual[net.e_dn_rcv])
            out = out - free * (_NO_REQUEST << 2)
        return out

    def schedule(self, requests: Sequence[WriteRequest], *, max_timesteps: int = 100_000) -> Schedule:
        """Schedule every chunk offline: timestep after timestep, fresh capacity each time.

        Raises
        ------
        ScheduleInfeasibleError
            If a timestep on the empty network places nothing while requests remain.
        InfeasibleRequestError, UnknownServerError
            See :meth:`check_request`.
        """
        for req in requests:
            self.check_request(req)
        pending: Sequence[WriteRequest] = list(requests)
        placements: list[ChunkPlacement] = []
        t = 0
        stalls = 0
        while pending:
            if t >= max_timesteps:
                raise ScheduleInfeasibleError(f"not done after {max_timesteps} timesteps")
            plan = self.schedule_timestep(pending, self.network.new_residual(), t)
            if not plan.placements:
                stalls += 1
                if stalls > 32:
                    raise ScheduleInfeasibleError(
                        f"timestep {t}: nothing placed on an empty network for "
                        f"{len(plan.deferred)} requests (first: {plan.deferred[0]})")
                continue
            stalls = 0
            placements.extend(plan.placements)
            pending = plan.deferred
            t += 1
        return Schedule(tuple(requests), tuple(placements), t)

    # ------------------------------------------------------ randomized shortest path
    def _rsp_fast(self, z: int, allowed: npt.NDArray[np.bool_], residual: Residual,
                  prefer: npt.NDArray[np.int64] | None = None
                  ) -> tuple[int, tuple[int, ...], int] | None:
        """RSP exploiting the rack structure; returns (destination, edge ids, cost) or None."""
        net = self.network
        e_up = int(net.e_snd_up[z])
        e_sw = int(net.e_up_sw[z])
        if residual[e_up] <= 0 or residual[e_sw] <= 0:
            return None
        src_sw = int(self._server_switch[z])
        dist, preds = self._switch_dijkstra(src_sw, residual)
        ok = allowed & (residual[net.e_sw_dn] > 0) & (residual[net.e_dn_rcv] > 0)
        if not ok.any():
            return None
        sw_cost = dist[self._server_switch]
        cand_cost = np.where(ok, sw_cost, np.inf)
        best = cand_cost.min()
        if not np.isfinite(best):
            return None
        cands = np.flatnonzero(cand_cost == best)
        if prefer is not None and len(cands) > 1:
            kp = prefer[cands]
            cands = cands[kp == kp.min()]
        j = int(cands[self.rng.integers(len(cands))]) if len(cands) > 1 else int(cands[0])
        sw_path = self._random_switch_path(src_sw, int(self._server_switch[j]), preds)
        eids = (e_up, e_sw, *sw_path, int(net.e_sw_dn[j]), int(net.e_dn_rcv[j]))
        total = net.up_cost + int(best) + net.down_cost
        return j, eids, total

    def _switch_dijkstra(self, src: int, residual: Residual
                         ) -> tuple[npt.NDArray[np.float64], list[list[tuple[int, int]]]]:
        """Dijkstra on the switch graph; returns distances and all shortest-path predecessors."""
        net = self.network
        n = len(net.switches)
        dist = np.full(n, np.inf)
        dist[src] = 0.0
        preds: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        if n == 1:
            return dist, preds
        best = [float("inf")] * n
        best[src] = 0
        done = [False] * n
        heap = [(0, src)]
        adj = net.switch_adj
        while heap:
            d, u = heapq.heappop(heap)
            if done[u]:
                continue
            done[u] = True
            for v, e, c in adj[u]:
                if residual[e] <= 0 or done[v]:
                    continue
                nd = d + c
                if nd < best[v]:
                    best[v] = nd
                    preds[v] = [(u, e)]
                    heapq.heappush(heap, (nd, v))
                elif nd == best[v]:
                    preds[v].append((u, e))
        dist[:] = best
        return dist, preds

    def _random_switch_path(self, src: int, dst: int, preds: list[list[tuple[int, int]]]
                            ) -> list[int]:
        """A uniformly random shortest switch path src -> dst, as edge ids."""
        if src == dst:
            return []
        sigma: dict[int, int] = {src: 1}

        def count(v: int) -> int:
            if v not in sigma:
                sigma[v] = sum(count(u) for u, _ in preds[v])
            return sigma[v]

        count(dst)
        path: list[int] = []
        v = dst
        while v != src:
            options = preds[v]
            if len(options) == 1:
                u, e = options[0]
            else:
                weights = np.array([sigma[u] for u, _ in options], dtype=float)
                u, e = options[int(self.rng.choice(len(options), p=weights / weights.sum()))]
            path.append(e)
            v = u
        path.reverse()
        return path

    def _rsp_networkx(self, z: int, allowed: npt.NDArray[np.bool_], residual: Residual,
                      prefer: npt.NDArray[np.int64] | None = None
                      ) -> tuple[int, tuple[int, ...], int] | None:
        """RSP by Dijkstra on the whole graph; saturated edges are hidden by the weight function."""
        net = self.network
        g = net.graph
        src: Vertex = ("snd", net.servers[z])

        def weight(u: Vertex, v: Vertex, d: dict[str, int]) -> int | None:
            return None if residual[d["eid"]] <= 0 else d["weight"]

        pred, dist = nx.dijkstra_predecessor_and_distance(g, src, weight=weight)
        best = None
        cands: list[int] = []
        for j in np.flatnonzero(allowed).tolist():
            dj = dist.get(("rcv", net.servers[j]))
            if dj is None:
                continue
            if best is None or dj < best:
                best, cands = dj, [j]
            elif dj == best:
                cands.append(j)
        if best is None:
            return None
        if prefer is not None and len(cands) > 1:
            kmin = min(int(prefer[c]) for c in cands)
            cands = [c for c in cands if int(prefer[c]) == kmin]
        j = cands[int(self.rng.integers(len(cands)))] if len(cands) > 1 else cands[0]
        sigma: dict[Vertex, int] = {src: 1}

        def count(v: Vertex) -> int:
            if v not in sigma:
                sigma[v] = sum(count(u) for u in pred[v])
            return sigma[v]

        target: Vertex = ("rcv", net.servers[j])
        count(target)
        vertices = [target]
        v = target
        while v != src:
            options = pred[v]
            if len(options) == 1:
                u = options[0]
            else:
                weights = np.array([sigma[u] for u in options], dtype=float)
                u = options[int(self.rng.choice(len(options), p=weights / weights.sum()))]
            vertices.append(u)
            v = u
        vertices.reverse()
        eids = tuple(net.edge_index[(a, b)] for a, b in zip(vertices, vertices[1:]))
        return j, eids, int(best)


def release(residual: Residual, placements: Iterable[ChunkPlacement]) -> None:
    """Give the capacity of ``placements`` back to ``residual`` (in place)."""
    for pl in placements:
        for e in pl.edge_ids:
            residual[e] += 1


def _edge_bandwidths(net: Network) -> npt.NDArray[np.float64]:
    """Bytes per second of every edge: host edges the NIC (the receive edge also the disk),
    switch links their line rate; what the rate-aware cut divides among the chunks."""
    t = net.topology
    bw = np.full(net.n_edges, float(t.nic_bytes_per_s))
    bw[net.e_dn_rcv] = float(min(t.nic_bytes_per_s, t.disk_bytes_per_s))
    for e, (li, _) in net.link_of_edge.items():
        bw[e] = float(t.links[li].bandwidth_bytes_per_s)
    return bw


def _single(n: int, j: int) -> npt.NDArray[np.bool_]:
    mask = np.zeros(n, dtype=bool)
    mask[j] = True
    return mask
