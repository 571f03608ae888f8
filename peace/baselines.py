"""Baseline replica placements to compare Peace against.

* :func:`hdfs_placement`: HDFS's default rack-aware policy as the paper ran it
  (§6.2, footnote 6: the local disk is never a replica): replica 1 on a random
  node of the writer's rack, replica 2 on a random node of another rack,
  replica 3 on a random node of replica 2's rack, further replicas anywhere with
  at most 2 per rack; nodes with more than 2x the mean active streams are
  skipped (HDFS ``considerLoad``); the pipeline is ordered greedily by network
  distance, nearest first. No admission control: that is the simulator
  policy's business (see :class:`peace.simulator.BaselinePolicy`).
* :func:`random_placement`: ``r`` distinct random servers other than the writer,
  pipelined in the order drawn.
* :class:`Router`: equal-cost multipath routing between racks (a uniformly
  random shortest switch path, as ECMP hashing spreads flows).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from peace.errors import InfeasibleRequestError
from peace.model import Network
from peace.scheduler import PeaceScheduler

__all__ = ["hdfs_placement", "random_placement", "Router"]

IntArray: TypeAlias = npt.NDArray[np.int64]


def _pick(rng: np.random.Generator, cands: Sequence[int] | IntArray) -> int:
    return int(cands[int(rng.integers(len(cands)))])


def _not_overloaded(cands: IntArray, load: IntArray | None) -> IntArray:
    """HDFS considerLoad: drop nodes with more than twice the mean load, unless that drops all."""
    if load is None or len(cands) == 0:
        return cands
    mean = float(load.mean())
    keep = cands[load[cands] <= 2.0 * mean] if mean > 0 else cands
    return keep if len(keep) else cands


def hdfs_placement(network: Network, writer: int, replication: int, rng: np.random.Generator,
                   *, load: IntArray | None = None) -> tuple[int, ...]:
    """Replica servers (indices) of one chunk in pipeline order, as stock HDFS picks them.

    Parameters
    ----------
    network
        The compiled topology.
    writer
        Index of the writing server (never a replica).
    replication
        Number of replicas ``r``.
    rng
        Randomness source.
    load
        Active streams per server (HDFS xceiver count); ``None`` disables considerLoad.

    Raises
    ------
    InfeasibleRequestError
        If fewer than ``r`` servers other than the writer exist.

    Notes
    -----
    Runtime complexity: O(servers) per replica.
    """
    n = network.n_servers
    if replication > n - 1:
        raise InfeasibleRequestError(f"replication {replication} > {n - 1} other servers")
    rack_of = network.rack_of
    chosen: list[int] = []
    taken = np.zeros(n, dtype=bool)
    taken[writer] = True

    def choose(mask: npt.NDArray[np.bool_]) -> int | None:
        cands = np.flatnonzero(mask & ~taken)
        if len(cands) == 0:
            return None
        return _pick(rng, _not_overloaded(cands, load))

    everywhere = np.ones(n, dtype=bool)
    # replica 1: the writer's rack (local node excluded), else anywhere
    first = choose(rack_of == rack_of[writer])
    if first is None:
        first = choose(everywhere)
    assert first is not None
    chosen.append(first)
    taken[first] = True
    if replication >= 2:
        second = choose(rack_of != rack_of[first])
        if second is None:
            second = choose(everywhere)
        assert second is not None
        chosen.append(second)
        taken[second] = True
    if replication >= 3:
        third = choose(rack_of == rack_of[chosen[1]])
        if third is None:
            third = choose(everywhere)
        assert third is not None
        chosen.append(third)
        taken[third] = True
    while len(chosen) < replication:
        per_rack = np.bincount(rack_of[chosen], minlength=network.n_racks)
        nxt = choose(per_rack[rack_of] < 2)
        if nxt is None:
            nxt = choose(everywhere)
        assert nxt is not None
        chosen.append(nxt)
        taken[nxt] = True
    # pipeline: nearest first, greedily from the previous node (HDFS getPipeline)
    order: list[int] = []
    left = list(chosen)
    cur = writer
    while left:
        same = [x for x in left if rack_of[x] == rack_of[cur]]
        nxt_node = same[0] if same else left[0]
        order.append(nxt_node)
        left.remove(nxt_node)
        cur = nxt_node
    return tuple(order)


def random_placement(network: Network, writer: int, replication: int, rng: np.random.Generator,
                     *, load: IntArray | None = None) -> tuple[int, ...]:
    """``r`` distinct uniformly random servers other than the writer, in the order drawn.

    Raises
    ------
    InfeasibleRequestError
        If fewer than ``r`` servers other than the writer exist.
    """
    n = network.n_servers
    if replication > n - 1:
        raise InfeasibleRequestError(f"replication {replication} > {n - 1} other servers")
    others = np.delete(np.arange(n), writer)
    return tuple(int(x) for x in rng.choice(others, size=replication, replace=False))


class Router:
    """Uniformly random shortest switch paths on the full network (ECMP).

    >>> from peace.model import build_network, paper_topology
    >>> net = build_network(paper_topology())
    >>> r = Router(net, np.random.default_rng(0))
    >>> [net.edge_u[e] for e in r.switch_path(0, 16)]
    [('sw', 'sw1')]
    """

    def __init__(self, network: Network, rng: np.random.Generator) -> None:
        self.network = network
        self._helper = PeaceScheduler(network, (), seed=rng, lookahead=False)
        self._full = network.new_residual()
        self._cache: dict[int, list[list[tuple[int, int]]]] = {}

    def switch_path(self, src: int, dst: int) -> list[int]:
        """Switch-link edge ids from server ``src``'s switch to server ``dst``'s switch."""
        a = int(self.network.rack_of[src])
        b = int(self.network.rack_of[dst])
        if a == b:
            return []
        preds = self._cache.get(a)
        if preds is None:
            _, preds = self._helper._switch_dijkstra(a, self._full)
            self._cache[a] = preds
        return self._helper._random_switch_path(a, b, preds)

    def chain_switch_edges(self, servers: Sequence[int]) -> list[int]:
        """Switch-link edge ids of every hop of a pipeline ``servers`` (writer first)."""
        out: list[int] = []
        for u, v in zip(servers, servers[1:]):
            out.extend(self.switch_path(u, v))
        return out
