"""Network model: a topology description and the directed graph Peace schedules on.

A :class:`Topology` is a frozen description: racks of servers, each rack under
one switch, switch-to-switch links (e.g. the inter-rack link, or leaf-spine
uplinks), per-edge capacities in *chunks per timestep* and the bandwidths the
simulator uses. :func:`build_network` turns it into a :class:`Network`: the
networkx ``DiGraph`` of paper Figure 5 plus flat integer arrays indexed by edge
id, so the scheduler can keep a residual as one numpy vector and never copy the
graph.

Graph (paper §5, Figure 5). Per server ``i`` four vertices ``("snd", i)``,
``("up", i)``, ``("dn", i)``, ``("rcv", i)``; per switch ``u`` one vertex
``("sw", u)``. Edges::

    snd(i) -> up(i)   cost host_cost (1)  capacity snd_up_chunks (2)   physical NIC, upstream
    up(i)  -> sw(u)   cost 0              capacity up_sw_chunks        inside the switch
    sw(u)  -> dn(i)   cost 0              capacity sw_dn_chunks        inside the switch
    dn(i)  -> rcv(i)  cost host_cost (1)  capacity dn_rcv_chunks (2)   physical NIC + disk, downstream
    sw(u)  -> sw(v)   cost link.cost (1)  capacity link.capacity_chunks  one per direction

Invariants: every capacity is a positive ``int``, every cost a non-negative
``int`` (networkx min-cost flow is exact only on integers); switch links cost at
least 1, so the graph has no zero-cost cycle; server and switch names are
unique; the switch graph is connected.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np
import numpy.typing as npt

from peace.errors import MalformedTopologyError, UnknownServerError

__all__ = [
    "MB",
    "Vertex",
    "Rack",
    "SwitchLink",
    "Topology",
    "Network",
    "build_network",
    "figure5_topology",
    "paper_topology",
    "leaf_spine_topology",
    "chunks_per_timestep",
]

#: one megabyte as the issue's calibration counts it (1 Gbps = 125 MB/s).
MB = 1_000_000

Vertex = tuple[str, str]
"""A graph vertex: ``(kind, name)`` with kind in ``snd up dn rcv sw``."""


def _check_int(value: object, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise MalformedTopologyError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class Rack:
    """Servers that share one (top-of-rack) switch."""

    name: str
    switch: str
    """Name of the switch every server of the rack is cabled to."""
    servers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SwitchLink:
    """A full-duplex cable between two switches; one graph edge per direction."""

    a: str
    b: str
    capacity_chunks: int
    """Chunks per timestep in each direction."""
    bandwidth_bytes_per_s: int
    """Line rate in each direction (used by the simulator)."""
    cost: int = 1


@dataclass(frozen=True, slots=True)
class Topology:
    """A cluster network: racks, switches, links, capacities and bandwidths.

    Raises
    ------
    MalformedTopologyError
        On duplicate names, empty racks, links to unknown switches, self links,
        non-integer or non-positive capacities, or a disconnected switch graph.
    """

    racks: tuple[Rack, ...]
    links: tuple[SwitchLink, ...] = ()
    spines: tuple[str, ...] = ()
    """Switches without servers (leaf-spine fabrics)."""
    snd_up_chunks: int = 2
    up_sw_chunks: int = 2
    sw_dn_chunks: int = 2
    dn_rcv_chunks: int = 2
    host_cost: int = 1
    nic_bytes_per_s: int = 125 * MB
    disk_bytes_per_s: int = 45 * MB
    chunk_bytes: int = 64 * MB
    name: str = "custom"
    _servers: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.racks, tuple) or not self.racks:
            raise MalformedTopologyError("a topology needs a non-empty tuple of racks")
        for what in ("snd_up_chunks", "up_sw_chunks", "sw_dn_chunks", "dn_rcv_chunks",
                     "nic_bytes_per_s", "disk_bytes_per_s", "chunk_bytes"):
            _check_int(getattr(self, what), what, 1)
        _check_int(self.host_cost, "host_cost", 0)
        servers: list[str] = []
        switches: set[str] = set()
        rack_names: set[str] = set()
        for rack in self.racks:
            if not isinstance(rack, Rack):
                raise MalformedTopologyError(f"racks must be Rack instances, got {rack!r}")
            if rack.name in rack_names:
                raise MalformedTopologyError(f"duplicate rack name {rack.name!r}")
            rack_names.add(rack.name)
            if not rack.servers:
                raise MalformedTopologyError(f"rack {rack.name!r} has no server")
            if rack.switch in switches:
                raise MalformedTopologyError(f"switch {rack.switch!r} serves two racks")
            switches.add(rack.switch)
            servers.extend(rack.servers)
        if len(set(servers)) != len(servers):
            dup = sorted({s for s in servers if servers.count(s) > 1})
            raise MalformedTopologyError(f"duplicate server names {dup}")
        for spine in self.spines:
            if spine in switches:
                raise MalformedTopologyError(f"duplicate switch name {spine!r}")
            switches.add(spine)
        seen: set[tuple[str, str]] = set()
        for link in self.links:
            if link.a not in switches or link.b not in switches:
                raise MalformedTopologyError(f"link {link.a}-{link.b} names an unknown switch")
            if link.a == link.b:
                raise MalformedTopologyError(f"self link on switch {link.a!r}")
            key = (min(link.a, link.b), max(link.a, link.b))
            if key in seen:
                raise MalformedTopologyError(f"duplicate link {link.a}-{link.b}")
            seen.add(key)
            _check_int(link.capacity_chunks, f"link {link.a}-{link.b} capacity_chunks", 1)
            _check_int(link.bandwidth_bytes_per_s, f"link {link.a}-{link.b} bandwidth", 1)
            _check_int(link.cost, f"link {link.a}-{link.b} cost", 1)
        sw_graph = nx.Graph()
        sw_graph.add_nodes_from(switches)
        sw_graph.add_edges_from((link.a, link.b) for link in self.links)
        if not nx.is_connected(sw_graph):
            raise MalformedTopologyError("the switch graph is not connected")
        object.__setattr__(self, "_servers", tuple(servers))

    @property
    def servers(self) -> tuple[str, ...]:
        """All server names, rack by rack."""
        return self._servers

    def rack_of(self, server: str) -> Rack:
        """Return the rack holding ``server``.

        Raises
        ------
        UnknownServerError
            If no rack holds it.
        """
        for rack in self.racks:
            if server in rack.servers:
                return rack
        raise UnknownServerError(f"unknown server {server!r} in topology {self.name!r}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description; :meth:`from_dict` reads it back."""
        return {
            "name": self.name,
            "racks": [{"name": r.name, "switch": r.switch, "servers": list(r.servers)}
                      for r in self.racks],
            "spines": list(self.spines),
            "links": [{"a": l.a, "b": l.b, "capacity_chunks": l.capacity_chunks,
                       "bandwidth_bytes_per_s": l.bandwidth_bytes_per_s, "cost": l.cost}
                      for l in self.links],
            "snd_up_chunks": self.snd_up_chunks, "up_sw_chunks": self.up_sw_chunks,
            "sw_dn_chunks": self.sw_dn_chunks, "dn_rcv_chunks": self.dn_rcv_chunks,
            "host_cost": self.host_cost, "nic_bytes_per_s": self.nic_bytes_per_s,
            "disk_bytes_per_s": self.disk_bytes_per_s, "chunk_bytes": self.chunk_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        """Build a topology from :meth:`to_dict`'s format.

        Raises
        ------
        MalformedTopologyError
            On missing keys, wrong types or any inconsistency.
        """
        if not isinstance(data, Mapping):
            raise MalformedTopologyError(f"a topology description is a mapping, got {type(data)}")
        try:
            racks = tuple(Rack(str(r["name"]), str(r["switch"]), tuple(str(s) for s in r["servers"]))
                          for r in data["racks"])
            links = tuple(SwitchLink(str(l["a"]), str(l["b"]), l["capacity_chunks"],
                                     l["bandwidth_bytes_per_s"], l.get("cost", 1))
                          for l in data.get("links", ()))
            extra = {k: data[k] for k in ("snd_up_chunks", "up_sw_chunks", "sw_dn_chunks",
                                          "dn_rcv_chunks", "host_cost", "nic_bytes_per_s",
                                          "disk_bytes_per_s", "chunk_bytes") if k in data}
            return cls(racks=racks, links=links, spines=tuple(data.get("spines", ())),
                       name=str(data.get("name", "custom")), **extra)
        except (KeyError, TypeError, AttributeError) as exc:
            raise MalformedTopologyError(f"malformed topology description: {exc!r}") from exc


def chunks_per_timestep(bandwidth_bytes_per_s: int, disk_bytes_per_s: int,
                        dn_rcv_chunks: int = 2) -> int:
    """Capacity in chunks per timestep of a link, scaled so a disk holds ``dn_rcv_chunks``.

    A timestep lasts about as long as a disk takes to absorb ``dn_rcv_chunks``
    concurrent chunks, so a link ``b / disk`` times faster carries that many
    times more chunks in the same timestep (at least 1).

    >>> chunks_per_timestep(125_000_000, 45_000_000)
    5
    """
    return max(1, math.floor(dn_rcv_chunks * bandwidth_bytes_per_s / disk_bytes_per_s + 1e-9))


def figure5_topology() -> Topology:
    """Paper Figure 5: two switches, two servers each, every capacity 1.

    >>> figure5_topology().servers
    ('svr1.1', 'svr1.2', 'svr2.1', 'svr2.2')
    """
    return Topology(
        racks=(Rack("rack1", "sw1", ("svr1.1", "svr1.2")), Rack("rack2", "sw2", ("svr2.1", "svr2.2"))),
        links=(SwitchLink("sw1", "sw2", 1, 125 * MB),),
        snd_up_chunks=1, up_sw_chunks=1, sw_dn_chunks=1, dn_rcv_chunks=1, name="figure5")


def paper_topology(*, rack_sizes: Sequence[int] = (9, 8), link_chunks: int | None = None,
                   snd_up_chunks: int | None = 2, dn_rcv_chunks: int = 2,
                   nic_bytes_per_s: int = 125 * MB, link_bytes_per_s: int = 125 * MB,
                   disk_bytes_per_s: int = 45 * MB, chunk_bytes: int = 64 * MB) -> Topology:
    """Paper §6.2: 17 servers in two racks (9 + 8), 1 Gbps everywhere, 45 MB/s disks.

    Parameters
    ----------
    link_chunks
        Capacity of the inter-rack link per direction, in chunks per timestep;
        by default :func:`chunks_per_timestep` of its bandwidth (5 for 125 MB/s).
    snd_up_chunks
        Capacity of each server's SND->UP edge. The paper's 2 is "conservative"
        (its HDFS client was checksum-bound at ~63 MB/s per thread, Table 8);
        ``None`` derives it from the NIC bandwidth like the link (5 for 125 MB/s),
        which is what a simulated NIC without checksum cost supports.

    Notes
    -----
    With more than two racks the rack switches form a chain.
    """
    if snd_up_chunks is None:
        snd_up_chunks = chunks_per_timestep(nic_bytes_per_s, disk_bytes_per_s, dn_rcv_chunks)
    racks = tuple(Rack(f"rack{r + 1}", f"sw{r + 1}", tuple(f"svr{r + 1}.{i + 1}" for i in range(n)))
                  for r, n in enumerate(rack_sizes))
    cap = link_chunks if link_chunks is not None else chunks_per_timestep(
        link_bytes_per_s, disk_bytes_per_s, dn_rcv_chunks)
    links = tuple(SwitchLink(f"sw{r + 1}", f"sw{r + 2}", cap, link_bytes_per_s)
                  for r in range(len(rack_sizes) - 1))
    return Topology(racks=racks, links=links, snd_up_chunks=snd_up_chunks,
                    up_sw_chunks=snd_up_chunks, sw_dn_chunks=dn_rcv_chunks,
                    dn_rcv_chunks=dn_rcv_chunks, nic_bytes_per_s=nic_bytes_per_s,
                    disk_bytes_per_s=disk_bytes_per_s, chunk_bytes=chunk_bytes,
                    name=f"paper-{sum(rack_sizes)}")


def leaf_spine_topology(*, racks: int = 40, servers_per_rack: int = 25, spines: int = 4,
                        oversubscription: float = 4.0, nic_bytes_per_s: int = 125 * MB,
                        disk_bytes_per_s: int = 45 * MB, chunk_bytes: int = 64 * MB,
                        snd_up_chunks: int | None = 2, dn_rcv_chunks: int = 2) -> Topology:
    """A two-tier leaf-spine fabric (1000 servers in 40 racks by default).

    Each leaf has one uplink to every spine; the uplinks of a leaf together carry
    ``servers_per_rack * nic / oversubscription``. ``snd_up_chunks=None``
    derives the SND->UP capacity from the NIC bandwidth (see :func:`paper_topology`).

    Raises
    ------
    MalformedTopologyError
        If a count is not a positive integer or ``oversubscription <= 0``.
    """
    for what, v in (("racks", racks), ("servers_per_rack", servers_per_rack), ("spines", spines)):
        _check_int(v, what, 1)
    if not oversubscription > 0:
        raise MalformedTopologyError(f"oversubscription must be positive, got {oversubscription}")
    if snd_up_chunks is None:
        snd_up_chunks = chunks_per_timestep(nic_bytes_per_s, disk_bytes_per_s, dn_rcv_chunks)
    uplink_bw = max(1, int(servers_per_rack * nic_bytes_per_s / (oversubscription * spines)))
    cap = chunks_per_timestep(uplink_bw, disk_bytes_per_s, dn_rcv_chunks)
    rack_t = tuple(Rack(f"rack{r}", f"leaf{r}", tuple(f"s{r}.{i}" for i in range(servers_per_rack)))
                   for r in range(racks))
    spine_names = tuple(f"spine{s}" for s in range(spines))
    links = tuple(SwitchLink(f"leaf{r}", sp, cap, uplink_bw) for r in range(racks) for sp in spine_names)
    return Topology(racks=rack_t, links=links, spines=spine_names, snd_up_chunks=snd_up_chunks,
                    up_sw_chunks=snd_up_chunks, sw_dn_chunks=dn_rcv_chunks,
                    dn_rcv_chunks=dn_rcv_chunks, nic_bytes_per_s=nic_bytes_per_s,
                    disk_bytes_per_s=disk_bytes_per_s, chunk_bytes=chunk_bytes,
                    name=f"leafspine-{racks * servers_per_rack}-os{oversubscription:g}")


class Network:
    """A :class:`Topology` compiled to Figure 5's graph plus flat edge arrays.

    Attributes
    ----------
    graph : networkx.DiGraph
        Edge attributes ``capacity`` and ``weight`` (the cost, networkx's name
        for it) and ``eid``, the index into the arrays below.
    capacity : ndarray of int64, shape (n_edges,)
        Read-only; copy it to get a fresh residual.
    cost : ndarray of int64, shape (n_edges,)
    edge_u, edge_v : list of Vertex
    server_index : dict
        Server name -> index into ``topology.servers``.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        servers = topology.servers
        self.servers: tuple[str, ...] = servers
        self.n_servers = len(servers)
        self.server_index: dict[str, int] = {s: i for i, s in enumerate(servers)}
        switch_names = [r.switch for r in topology.racks] + list(topology.spines)
        self.switch_index: dict[str, int] = {s: i for i, s in enumerate(switch_names)}
        self.switches: tuple[str, ...] = tuple(switch_names)
        self.n_racks = len(topology.racks)
        rack_of = np.empty(self.n_servers, dtype=np.int64)
        for r, rack in enumerate(topology.racks):
            for s in rack.servers:
                rack_of[self.server_index[s]] = r
        rack_of.flags.writeable = False
        self.rack_of: npt.NDArray[np.int64] = rack_of
        """Rack index of each server (rack ``r`` hangs under switch index ``r``)."""
        self.rack_members: tuple[tuple[int, ...], ...] = tuple(
            tuple(self.server_index[s] for s in rack.servers) for rack in topology.racks)

        self.edge_u: list[Vertex] = []
        self.edge_v: list[Vertex] = []
        caps: list[int] = []
        costs: list[int] = []
        self.edge_index: dict[tuple[Vertex, Vertex], int] = {}

        def add(u: Vertex, v: Vertex, cap: int, cost: int) -> int:
            eid = len(self.edge_u)
            self.edge_u.append(u)
            self.edge_v.append(v)
            caps.append(int(cap))
            costs.append(int(cost))
            self.edge_index[(u, v)] = eid
            return eid

        t = topology
        n = self.n_servers
        self.e_snd_up = np.empty(n, dtype=np.int64)
        self.e_up_sw = np.empty(n, dtype=np.int64)
        self.e_sw_dn = np.empty(n, dtype=np.int64)
        self.e_dn_rcv = np.empty(n, dtype=np.int64)
        for r, rack in enumerate(t.racks):
            sw: Vertex = ("sw", rack.switch)
            for s in rack.servers:
                i = self.server_index[s]
                self.e_snd_up[i] = add(("snd", s), ("up", s), t.snd_up_chunks, t.host_cost)
                self.e_up_sw[i] = add(("up", s), sw, t.up_sw_chunks, 0)
                self.e_sw_dn[i] = add(sw, ("dn", s), t.sw_dn_chunks, 0)
                self.e_dn_rcv[i] = add(("dn", s), ("rcv", s), t.dn_rcv_chunks, t.host_cost)
        #: adjacency of the switch graph: switch index -> [(neighbour, eid, cost)]
        self.switch_adj: list[list[tuple[int, int, int]]] = [[] for _ in switch_names]
        #: eid -> index into topology.links and direction (0: a->b, 1: b->a); only switch links
        self.link_of_edge: dict[int, tuple[int, int]] = {}
        for li, link in enumerate(t.links):
            ia, ib = self.switch_index[link.a], self.switch_index[link.b]
            e1 = add(("sw", link.a), ("sw", link.b), link.capacity_chunks, link.cost)
            e2 = add(("sw", link.b), ("sw", link.a), link.capacity_chunks, link.cost)
            self.switch_adj[ia].append((ib, e1, link.cost))
            self.switch_adj[ib].append((ia, e2, link.cost))
            self.link_of_edge[e1] = (li, 0)
            self.link_of_edge[e2] = (li, 1)
        self.n_edges = len(self.edge_u)
        capacity = np.asarray(caps, dtype=np.int64)
        capacity.flags.writeable = False
        self.capacity: npt.NDArray[np.int64] = capacity
        cost = np.asarray(costs, dtype=np.int64)
        cost.flags.writeable = False
        self.cost: npt.NDArray[np.int64] = cost
        self.up_cost = t.host_cost  # snd->up + up->sw
        self.down_cost = t.host_cost  # sw->dn + dn->rcv
        for arr in (self.e_snd_up, self.e_up_sw, self.e_sw_dn, self.e_dn_rcv):
            arr.flags.writeable = False

        g = nx.DiGraph(name=t.name)
        for s in servers:
            for kind in ("snd", "up", "dn", "rcv"):
                g.add_node((kind, s), kind=kind, server=s)
        for sname in switch_names:
            g.add_node(("sw", sname), kind="sw", switch=sname)
        for eid, (u, v) in enumerate(zip(self.edge_u, self.edge_v)):
            g.add_edge(u, v, capacity=caps[eid], weight=costs[eid], eid=eid)
        self.graph: nx.DiGraph = g

    def index(self, server: str) -> int:
        """Index of ``server``.

        Raises
        ------
        UnknownServerError
            If the topology has no such server.
        """
        try:
            return self.server_index[server]
        except KeyError:
            raise UnknownServerError(
                f"unknown server {server!r} in topology {self.topology.name!r}") from None

    def new_residual(self) -> npt.NDArray[np.int64]:
        """A fresh, writable residual capacity vector (one int per edge)."""
        return self.capacity.copy()

    def path_vertices(self, eids: Sequence[int]) -> tuple[Vertex, ...]:
        """The vertex path of consecutive edge ids."""
        if not eids:
            return ()
        return (self.edge_u[eids[0]],) + tuple(self.edge_v[e] for e in eids)

    def path_cost(self, eids: Sequence[int]) -> int:
        """Sum of the costs of ``eids``."""
        return int(sum(int(self.cost[e]) for e in eids))

    def _check(self) -> None:
        """Assert every invariant of the compiled model (O(edges))."""
        assert self.graph.number_of_edges() == self.n_edges
        for eid, (u, v) in enumerate(zip(self.edge_u, self.edge_v)):
            d = self.graph.edges[u, v]
            assert d["eid"] == eid and d["capacity"] == self.capacity[eid] >= 1
            assert d["weight"] == self.cost[eid] >= 0
        assert sorted(self.rack_of.tolist()) == sorted(
            r for r, m in enumerate(self.rack_members) for _ in m)


def build_network(topology: Topology) -> Network:
    """Compile ``topology`` into a :class:`Network` (Figure 5's graph).

    Runtime complexity: O(servers + links).

    >>> net = build_network(figure5_topology())
    >>> net.graph.number_of_nodes(), net.graph.number_of_edges()
    (18, 18)
    """
    return Network(topology)
