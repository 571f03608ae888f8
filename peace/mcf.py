"""``peace-mcf``: each timestep's replica chains decided by an integral min-cost flow.

:class:`McfScheduler` is a :class:`~peace.scheduler.PeaceScheduler` whose pass
over the queue is planned by one min-cost flow (networkx ``network_simplex``,
exact on integers) and then *repaired* into concrete chains by the improved
scheduler's randomized shortest-path search, so every placement satisfies the
chain, distinct-node, template and capacity constraints exactly (the validator
checks the same certificate as for the other variants).

Formulation (one unit of flow = one chunk, all of its replicas)::

    S --> G(rack, class) --> H(rack) --> X(rack) --> sw(u) --...--> sw(v) --> A(rack') --> T(rack') --> D
      \\_________________________________ bypass (cost BIG) ___________________________________/

* ``G(R, c)``: the requests of writers in rack ``R`` that have started
  (``c = 0``) or not (``c = 1``), aggregated (*rack-level aggregation*: the
  network has O(racks + switch links) nodes whatever the number of writers).
  ``S -> G`` has capacity ``sum(min(k_i, residual send slots of w_i))`` and
  cost 0 for started requests, :data:`UNSTARTED_COST` otherwise -- the flow
  *favours finishing writers*.
* ``G -> H(R')`` for every rack ``R'`` template 0 allows relative to ``R``
  (the writer's own rack under :data:`~peace.scheduler.RACK_AWARE`).
  ``H(R)`` is the head replica's rack. Its capacity is the rack's pool of
  forwarding slots (``sum`` over its servers of ``min`` of their four
  residual host edges), or of receive slots when ``r = 1``.
* ``H(R) -> X(R) -> sw(...)``: the head forwards out of its rack over the
  switch links (capacity = residual chunks per timestep, cost = link cost x
  :data:`LINK_COST`); ``sw(v) -> A(R')`` enters rack ``R'``; and
  ``H(R) -> T(R)`` directly if template 1 allows the tail in the head's rack.
* ``T(R')`` is the tail's rack (replicas 2 and 3 under RACK_AWARE). Its
  capacity is ``min(forwarding slots, receive slots // 2)`` for ``r >= 3``,
  receive slots for ``r = 2``. ``T -> D`` is split into tiers of increasing
  cost (convex): the flow *balances racks*.
* A bypass ``S -> D`` of cost :data:`BIG` lets one ``network_simplex`` call
  return the maximum flow of minimum cost.

What is exact: the integral optimum of this network (networkx's network
simplex on integer capacities and costs), i.e. how many chunks each rack
class starts and which tail rack and switch path each takes, subject to the
residual capacity of every switch link and to the rack pools.

What is relaxed, and why: a rack's servers are pooled (a server's send slot
may be counted both as a writer's and as a forwarder's, and the head and tail
pools of one rack are not shared), a single-commodity flow cannot remember
that a unit left rack ``R`` so it may re-enter ``R`` through another switch,
and replicas beyond the third are not modelled. The exact problem (chains of
distinct servers, shared per-server send and receive slots, templates) is an
integral multi-commodity path problem, NP-hard in general and far too slow for
5 ms per decision at 1000 servers; the pooled rack-level network keeps the
flow tiny and exact where it matters most (inter-rack links and rack balance).

Balancing inside a rack is left to the repair search's tie-break: the
improved heuristics spread receivers (among equal-cost servers, the one with
the most free receive slots first), so two chunks share a disk only when they
must.

Repair: the plan is turned into chains request by request (started first,
then queue order). Each planned chunk is placed by the improved scheduler's
chain search with the head and tail racks as hints; if the hinted chain does
not exist on the real residual (the relaxation over-promised), the chain is
searched without hints, and if that fails too the chunk waits. Then a fill
pass offers every request's remaining chunks to the same search (capacity the
pooled plan did not see). The improved scheduler's whole-requests rule
applies -- an unstarted request that would start below its full rate gives its
chunks back -- with one exception (``partial_starts``): at most one request
per writer rack and pass may start below its full rate when the other chunks
of the pass already share a receiving disk. Chunks then run at disk / 2
anyway, so the spare send and link slots cost no placed chunk any rate and
shorten the makespan; while no disk is shared (e.g. r = 2 on the paper's
topology, with the receiver-spreading tie-break) whole requests keep every
chunk on an undivided disk, which is faster still. Every chain therefore comes from the same constrained
shortest-path search as ``peace``, which is why the validator always passes.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import networkx as nx
import numpy as np
import numpy.typing as npt

from peace.model import Network, Topology
from peace.placement import RACK_AWARE, ChunkPlacement, ReplicaTemplate, Residual, WriteRequest
from peace.scheduler import _NO_REQUEST, Heuristics, PeaceScheduler, release

__all__ = ["McfScheduler", "UNSTARTED_COST", "LINK_COST", "BIG", "FlowPlan"]

#: cost of a chunk of a request that has not started yet (started requests: 0)
UNSTARTED_COST = 1000
#: cost per unit of switch-link cost
LINK_COST = 10
#: cost of the bypass edge: larger than any real path
BIG = 1_000_000
_TIERS = 6

FlowPlan = dict[int, list[tuple[int, int]]]
"""Request position -> planned (head rack, tail rack or -1) per chunk."""


class McfScheduler(PeaceScheduler):
    """The ``mcf`` variant: a min-cost-flow plan per timestep, repaired into chains.

    Parameters are those of :class:`~peace.scheduler.PeaceScheduler`;
    ``variant`` picks the heuristics of the repair search (default: the
    improved ones). ``partial_starts`` (default True): see the module docstring.

    Examples
    --------
    >>> from peace.model import figure5_topology
    >>> s = McfScheduler(figure5_topology(), seed=0)
    >>> reqs = [WriteRequest("svr1.1", 2, 1, 0), WriteRequest("svr2.1", 2, 1, 1)]
    >>> len(s.schedule_timestep(reqs, s.network.new_residual()).placements)
    2
    """

    def __init__(self, network: Network | Topology, templates: Sequence[ReplicaTemplate] = RACK_AWARE,
                 *, seed: int | np.random.Generator | None = None,
                 method: Literal["fast", "networkx"] = "fast",
                 variant: str | Heuristics = "improved", lookahead: bool | None = None,
                 partial_starts: bool = True) -> None:
        super().__init__(network, templates, seed=seed, method=method, variant=variant,
                         lookahead=lookahead)
        self.variant = "mcf"
        self.partial_starts = partial_starts
        self._hint: tuple[int, ...] | None = None
        self.flow_time_s = 0.0
        """Wall time spent building and solving the flow networks."""
        self.flow_solves = 0

    # ------------------------------------------------------------------ hints
    def _allowed(self, path: Sequence[int], replica: int, replication: int = 0
                 ) -> npt.NDArray[np.bool_]:
        mask = super()._allowed(path, replica, replication)
        hint = self._hint
        if hint is not None and replica < len(hint) and hint[replica] >= 0:
            mask &= self.network.rack_of == hint[replica]
        return mask

    # ------------------------------------------------------------------- plan
    def _pools(self, residual: Residual) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64],
                                                  npt.NDArray[np.int64]]:
        """Per server: send slots, receive slots, forwarding slots (min of both)."""
        net = self.network
        send = np.minimum(residual[net.e_snd_up], residual[net.e_up_sw])
        recv = np.minimum(residual[net.e_sw_dn], residual[net.e_dn_rcv])
        return send, recv, np.minimum(send, recv)

    def _rack_allowed(self, template_index: int, positions: Sequence[int]) -> npt.NDArray[np.bool_]:
        """Racks template ``template_index`` allows given the racks of earlier path positions."""
        net = self.network
        ok = np.ones(net.n_racks, dtype=bool)
        if template_index < len(self.templates):
            tpl = self.templates[template_index]
            racks = np.arange(net.n_racks)
            for idx in tpl.same_rack_as:
                if -len(positions) <= idx < len(positions) and positions[idx] >= 0:
                    ok &= racks == positions[idx]
            for idx in tpl.other_rack_than:
                if -len(positions) <= idx < len(positions) and positions[idx] >= 0:
                    ok &= racks != positions[idx]
        return ok

    def plan(self, reqs: Sequence[WriteRequest], writers: Sequence[int],
             residual: Residual) -> FlowPlan:
        """Solve the timestep's min-cost flow; return the planned racks per request position.

        Runtime: one ``network_simplex`` on O(racks * tiers + switch links) edges.
        """
        t0 = time.perf_counter()
        try:
            return self._plan(reqs, writers, residual)
        finally:
            self.flow_time_s += time.perf_counter() - t0
            self.flow_solves += 1

    def _plan(self, reqs: Sequence[WriteRequest], writers: Sequence[int],
              residual: Residual) -> FlowPlan:
        net = self.network
        if not reqs:
            return {}
        send, recv, fwd = self._pools(residual)
        rack_of = net.rack_of
        n_racks = net.n_racks
        fwd_r = np.bincount(rack_of, weights=fwd, minlength=n_racks).astype(np.int64)
        recv_r = np.bincount(rack_of, weights=recv, minlength=n_racks).astype(np.int64)
        r_max = max(q.replication for q in reqs)
        # requests grouped by (writer rack, started?, replication)
        groups: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for i, (q, w) in enumerate(zip(reqs, writers)):
            groups[(int(rack_of[w]), 0 if q.first_chunk > 0 else 1, q.replication)].append(i)
        g = nx.MultiDiGraph()
        total = 0
        head_cap = fwd_r if r_max > 1 else recv_r
        for rack in range(n_racks):
            if head_cap[rack] > 0:
                _tiers(g, ("H", rack), ("Hout", rack), int(head_cap[rack]), 1)
        for (rack, cls, r), members in groups.items():
            cap = sum(min(reqs[i].chunks, int(send[writers[i]])) for i in members)
            if cap <= 0:
                continue
            total += cap
            gnode = ("G", rack, cls, r)
            g.add_edge("S", gnode, capacity=cap, weight=cls * UNSTARTED_COST)
            heads = np.flatnonzero(self._rack_allowed(0, (rack,)))
            for h in heads.tolist():
                if head_cap[h] > 0:
                    g.add_edge(gnode, ("H", h), capacity=cap, weight=0)
        if total == 0:
            return {}
        # heads to tails: replication 1 ends at the head; otherwise leave the rack or stay
        r1_only = r_max == 1
        tail_cap = recv_r if r_max == 2 else np.minimum(fwd_r, recv_r // 2)
        for rack in range(n_racks):
            if head_cap[rack] <= 0:
                continue
            hout = ("Hout", rack)
            if r1_only:
                g.add_edge(hout, "D", capacity=int(head_cap[rack]), weight=0)
                continue
            tails = self._rack_allowed(1, (rack, rack))
            if tails[rack] and tail_cap[rack] > 0:
                g.add_edge(hout, ("T", rack), capacity=int(head_cap[rack]), weight=0)
            if tails.sum() - int(tails[rack]) > 0:
                g.add_edge(hout, ("X", rack), capacity=int(head_cap[rack]), weight=0)
                sw = int(self._server_switch[net.rack_members[rack][0]])
                for v, e, c in net.switch_adj[sw]:
                    if residual[e] > 0:
                        g.add_edge(("X", rack), ("sw", v), capacity=int(residual[e]),
                                   weight=LINK_COST * c, eid=e)
        if not r1_only:
            for u, adj in enumerate(net.switch_adj):
                for v, e, c in adj:
                    if residual[e] > 0:
                        g.add_edge(("sw", u), ("sw", v), capacity=int(residual[e]),
                                   weight=LINK_COST * c, eid=e)
            for rack in range(n_racks):
                if tail_cap[rack] <= 0:
                    continue
                sw = int(self._server_switch[net.rack_members[rack][0]])
                g.add_edge(("sw", sw), ("A", rack), capacity=int(tail_cap[rack]), weight=0)
                g.add_edge(("A", rack), ("T", rack), capacity=int(tail_cap[rack]), weight=0)
                _tiers(g, ("T", rack), "D", int(tail_cap[rack]), 1)
        g.add_edge("S", "D", capacity=total, weight=BIG)
        g.add_node("S", demand=-total)
        g.add_node("D", demand=total)
        _, flow = nx.network_simplex(g)
        return self._decompose(flow, groups, reqs, writers, send, r1_only)

    def _decompose(self, flow: dict[Any, dict[Any, dict[int, int]]],
                   groups: dict[tuple[int, int, int], list[int]], reqs: Sequence[WriteRequest],
                   writers: Sequence[int], send: npt.NDArray[np.int64], r1_only: bool) -> FlowPlan:
        """Split the aggregate flow into (head, tail) racks per request, in queue order."""
        left: dict[Any, dict[Any, int]] = {
            u: {v: sum(ks.values()) for v, ks in nbrs.items() if sum(ks.values()) > 0}
            for u, nbrs in flow.items()}

        def take(u: Any, v: Any) -> None:
            left[u][v] -= 1
            if left[u][v] == 0:
                del left[u][v]

        def tail_from(head: int) -> int:
            """Walk one unit from ``Hout(head)`` to a tail rack (or -1 for r = 1)."""
            if r1_only:
                return -1
            node: Any = ("Hout", head)
            left_rack = False
            while True:
                options = left.get(node, {})
                nxt = next((v for v in options if v != ("A", head)), None)
                if nxt is None:
                    nxt = next(iter(options), None)
                if nxt is None:
                    return -1
                take(node, nxt)
                if isinstance(nxt, tuple) and nxt[0] == "X":
                    left_rack = True
                if isinstance(nxt, tuple) and nxt[0] == "T":
                    # a unit that left the rack and came back is an artefact of the
                    # single-commodity relaxation: no tail hint, the repair search decides
                    return -1 if left_rack and int(nxt[1]) == head else int(nxt[1])
                node = nxt

        plan: FlowPlan = {}
        for key, members in groups.items():
            gnode = ("G", *key)
            out = left.get(gnode, {})
            heads: list[int] = []
            for h, n in list(out.items()):
                heads.extend([int(h[1])] * n)
            out.clear()
            # each head unit passes H -> tiers -> Hout; consume them in order
            pos = 0
            for i in sorted(members):
                want = min(reqs[i].chunks, int(send[writers[i]]))
                mine: list[tuple[int, int]] = []
                while want > 0 and pos < len(heads):
                    h = heads[pos]
                    pos += 1
                    _consume_tier(left, ("H", h), ("Hout", h))
                    mine.append((h, tail_from(h)))
                    want -= 1
                if mine:
                    plan[i] = mine
        return plan

    # ------------------------------------------------------------------ repair
    def _pass(self, reqs: Sequence[WriteRequest], writers: Sequence[int], residual: Residual,
              timestep: int, whole: bool
              ) -> tuple[list[ChunkPlacement], list[WriteRequest], int]:
        """Plan by min-cost flow, repair into chains, fill; returns placements, deferred, rollbacks."""
        net = self.network
        n_req = len(reqs)
        plan = self.plan(reqs, writers, residual)
        rank = np.full(net.n_servers, _NO_REQUEST, dtype=np.int64)
        for i in range(n_req - 1, -1, -1):
            rank[writers[i]] = i
        placed: list[list[ChunkPlacement]] = [[] for _ in range(n_req)]
        targets = [min(q.chunks, int(residual[net.e_snd_up[w]]), int(residual[net.e_up_sw[w]]))
                   if whole and q.first_chunk == 0 else 0 for q, w in zip(reqs, writers)]
        rolled_back = 0
        gave_up = [False] * n_req

        def shared_disk(i: int) -> bool:
            """Whether the other requests' chunks already share a receiving disk this pass."""
            used = net.capacity[net.e_dn_rcv] - residual[net.e_dn_rcv]
            mine = np.zeros(net.n_edges, dtype=np.int64)
            for pl in placed[i]:
                for e in pl.edge_ids:
                    mine[e] += 1
            return bool(((used - mine[net.e_dn_rcv]) >= 2).any())

        def place(i: int, hint: tuple[int, ...] | None) -> bool:
            q, w = reqs[i], writers[i]
            if len(placed[i]) >= q.chunks:
                return False
            self._hint = hint
            try:
                chain = self._place_chain(w, q.replication, residual, rank)
            finally:
                self._hint = None
            if chain is None:
                return False
            placed[i].append(self._placement(q, q.first_chunk + len(placed[i]), timestep, chain))
            return True

        partial_racks: set[int] = set()

        def settle(i: int) -> None:
            """Whole-requests rule: an unstarted request below its full rate gives back,
            unless it may start partially (see ``partial_starts``)."""
            nonlocal rolled_back
            if placed[i] and len(placed[i]) < targets[i]:
                rack = int(net.rack_of[writers[i]])
                if self.partial_starts and rack not in partial_racks and shared_disk(i):
                    partial_racks.add(rack)
                    return
                release(residual, placed[i])
                placed[i] = []
                gave_up[i] = True
                rolled_back += 1

        for i in range(n_req):  # repair: planned chunks with their racks as hints
            for head, tail in plan.get(i, ()):
                hint = (head, tail) if tail >= 0 else (head,)
                if not place(i, hint) and not place(i, None):
                    break
            if len(placed[i]) < targets[i]:  # top up to full rate before judging
                while len(placed[i]) < targets[i] and place(i, None):
                    pass
            settle(i)
        for i in range(n_req):  # fill: capacity the pooled plan did not see
            if gave_up[i]:
                continue
            before = len(placed[i])
            while place(i, None):
                pass
            if before == 0:
                settle(i)
        placements: list[ChunkPlacement] = []
        deferred: list[WriteRequest] = []
        for i, q in enumerate(reqs):
            placements.extend(placed[i])
            k = q.chunks - len(placed[i])
            if k > 0:
                deferred.append(replace(q, chunks=k, first_chunk=q.first_chunk + len(placed[i])))
        return placements, deferred, rolled_back


def _tiers(g: nx.MultiDiGraph, u: Any, v: Any, cap: int, step_cost: int) -> None:
    """``u -> v`` as up to :data:`_TIERS` parallel edges of rising cost (convex, balances load)."""
    size = max(1, -(-cap // _TIERS))
    left = cap
    tier = 0
    while left > 0:
        c = min(size, left)
        g.add_edge(u, v, capacity=c, weight=tier * step_cost)
        left -= c
        tier += 1


def _consume_tier(left: dict[Any, dict[Any, int]], u: Any, v: Any) -> None:
    """Take one unit off ``u -> v`` in the residual flow map (tiers are parallel edges)."""
    out = left.get(u)
    if out is not None and out.get(v, 0) > 0:
        out[v] -= 1
        if out[v] == 0:
            del out[v]
