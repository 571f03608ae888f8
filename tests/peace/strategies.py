"""Hypothesis strategies and brute-force oracles for small peace networks (<= 6 servers),
and the decision-time model the simulation tests charge."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import networkx as nx
import numpy as np
from hypothesis import strategies as st

from peace.model import MB, Network, Rack, SwitchLink, Topology, build_network
from peace.scheduler import RACK_AWARE, UNCONSTRAINED, ReplicaTemplate, WriteRequest

#: seconds charged per replica placement decision in simulation tests (``charge_decisions``):
#: a fixed model so that a verdict never depends on the machine's speed; the measured cost
#: is ~0.15 ms on the paper's 17 servers (bench.peace_fig10 charges the measured time)
DECISION_S = 0.0002


@st.composite
def small_topologies(draw: st.DrawFn, max_servers: int = 6) -> Topology:
    """1-3 racks, at most ``max_servers`` servers, capacities 1-3, switches in a chain or star."""
    n_racks = draw(st.integers(1, 3))
    sizes = []
    left = max_servers
    for r in range(n_racks):
        hi = max(1, min(3, left - (n_racks - r - 1)))
        n = draw(st.integers(1, hi))
        sizes.append(n)
        left -= n
    racks = tuple(Rack(f"r{r}", f"sw{r}", tuple(f"s{r}.{i}" for i in range(n)))
                  for r, n in enumerate(sizes))
    cap = st.integers(1, 3)
    spine = n_racks == 3 and draw(st.booleans())
    if spine:
        links = tuple(SwitchLink(f"sw{r}", "core", draw(cap), 125 * MB, draw(st.integers(1, 2)))
                      for r in range(n_racks))
        spines: tuple[str, ...] = ("core",)
    else:
        links = tuple(SwitchLink(f"sw{r}", f"sw{r + 1}", draw(cap), 125 * MB, draw(st.integers(1, 2)))
                      for r in range(n_racks - 1))
        spines = ()
    return Topology(racks=racks, links=links, spines=spines, snd_up_chunks=draw(cap),
                    up_sw_chunks=draw(cap), sw_dn_chunks=draw(cap), dn_rcv_chunks=draw(cap))


templates_st = st.sampled_from([RACK_AWARE, UNCONSTRAINED, (ReplicaTemplate(other_rack_than=(0,)),)])


@st.composite
def request_sets(draw: st.DrawFn, topology: Topology, max_requests: int = 3, max_r: int = 2,
                 max_k: int = 2) -> list[WriteRequest]:
    """Requests with distinct ids from writers of ``topology``."""
    n = draw(st.integers(1, max_requests))
    writers = st.sampled_from(topology.servers)
    return [WriteRequest(draw(writers), draw(st.integers(1, max_r)), draw(st.integers(1, max_k)), i)
            for i in range(n)]


def allowed_servers(net: Network, templates: Sequence[ReplicaTemplate], path: Sequence[int],
                    replica: int) -> list[int]:
    """Servers a replica may go to, recomputed naively."""
    out = []
    for j in range(net.n_servers):
        if j in path:
            continue
        if replica < len(templates):
            t = templates[replica]
            rj = net.rack_of[j]
            if any(rj != net.rack_of[path[i]] for i in t.same_rack_as):
                continue
            if any(rj == net.rack_of[path[i]] for i in t.other_rack_than):
                continue
        out.append(j)
    return out


def all_hop_paths(net: Network, z: int, j: int, residual: np.ndarray) -> list[tuple[int, ...]]:
    """Every simple path snd(z) -> rcv(j) using only edges with residual > 0, as edge ids."""
    g = net.graph
    out = []
    for vp in nx.all_simple_paths(g, ("snd", net.servers[z]), ("rcv", net.servers[j])):
        eids = tuple(net.edge_index[(a, b)] for a, b in zip(vp, vp[1:]))
        if all(residual[e] > 0 for e in eids):
            out.append(eids)
    return out


def brute_min_cost(net: Network, z: int, allowed: Sequence[int], residual: np.ndarray) -> int | None:
    """Minimum cost of any residual path from snd(z) to an allowed rcv."""
    best = None
    for j in allowed:
        for p in all_hop_paths(net, z, j, residual):
            c = sum(int(net.cost[e]) for e in p)
            best = c if best is None or c < best else best
    return best


def brute_max_chunks(net: Network, requests: Sequence[WriteRequest],
                     templates: Sequence[ReplicaTemplate], residual: np.ndarray) -> int:
    """Maximum number of chunks any schedule can place in one timestep (exhaustive)."""
    chunks = [(net.server_index[r.writer], r.replication) for r in requests for _ in range(r.chunks)]

    def chains(w: int, r: int, res: np.ndarray):
        def rec(path: list[int], used: list[int]):
            i = len(path) - 1
            if i == r:
                yield list(used)
                return
            for j in allowed_servers(net, templates, path, i):
                for p in all_hop_paths(net, path[-1], j, res):
                    for e in p:
                        res[e] -= 1
                    if all(res[e] >= 0 for e in p):
                        yield from rec(path + [j], used + list(p))
                    for e in p:
                        res[e] += 1
        yield from rec([w], [])

    best = 0

    def search(i: int, placed: int, res: np.ndarray) -> None:
        nonlocal best
        if placed + (len(chunks) - i) <= best:
            return
        if i == len(chunks):
            best = max(best, placed)
            return
        w, r = chunks[i]
        seen: set[tuple[int, ...]] = set()
        for used in list(chains(w, r, res)):  # materialize: chains() mutates res while yielding
            key = tuple(sorted(used))
            if key in seen:
                continue
            seen.add(key)
            for e in used:
                res[e] -= 1
            search(i + 1, placed + 1, res)
            for e in used:
                res[e] += 1
        search(i + 1, placed, res)

    search(0, 0, residual.copy())
    return best
