"""Tests of the topology description and Figure 5's graph model."""
from __future__ import annotations

import pytest
from hypothesis import given

from peace.errors import MalformedTopologyError, UnknownServerError
from peace.model import (MB, Rack, SwitchLink, Topology, build_network, chunks_per_timestep,
                         figure5_topology, leaf_spine_topology, paper_topology)
from tests.peace.strategies import small_topologies


def test_figure5_graph_has_costs_of_figure5() -> None:
    """Host links cost 1, switch-internal edges cost 0, every capacity is 1."""
    net = build_network(figure5_topology())
    g = net.graph
    assert g.edges[("snd", "svr1.1"), ("up", "svr1.1")]["weight"] == 1
    assert g.edges[("up", "svr1.1"), ("sw", "sw1")]["weight"] == 0
    assert g.edges[("sw", "sw2"), ("dn", "svr2.2")]["weight"] == 0
    assert g.edges[("dn", "svr2.2"), ("rcv", "svr2.2")]["weight"] == 1
    assert g.edges[("sw", "sw1"), ("sw", "sw2")]["weight"] == 1
    assert g.has_edge(("sw", "sw2"), ("sw", "sw1"))
    assert set(net.capacity.tolist()) == {1}
    assert g.number_of_nodes() == 4 * 4 + 2


def test_paper_topology_has_17_servers_in_racks_of_9_and_8_with_capacity_2_on_host_links() -> None:
    """§6.2: two racks (9 + 8), capacity 2 on SND->UP and DN->RCV."""
    t = paper_topology()
    assert [len(r.servers) for r in t.racks] == [9, 8]
    net = build_network(t)
    assert net.capacity[net.e_snd_up].tolist() == [2] * 17
    assert net.capacity[net.e_dn_rcv].tolist() == [2] * 17
    assert t.links[0].bandwidth_bytes_per_s == 125 * MB
    assert t.links[0].capacity_chunks == 5


def test_leaf_spine_scales_uplinks_with_oversubscription() -> None:
    """1000 servers in 40 racks; uplink bandwidth shrinks as oversubscription grows."""
    t1 = leaf_spine_topology(oversubscription=1.0)
    t4 = leaf_spine_topology(oversubscription=4.0)
    assert len(t4.servers) == 1000 and len(t4.racks) == 40 and len(t4.spines) == 4
    assert t1.links[0].bandwidth_bytes_per_s == 4 * t4.links[0].bandwidth_bytes_per_s
    assert t1.links[0].capacity_chunks > t4.links[0].capacity_chunks >= 1
    net = build_network(t4)
    assert net.graph.number_of_nodes() == 4000 + 44


def test_chunks_per_timestep_is_an_integer_at_least_one() -> None:
    """Capacity conversion rounds down and never reaches zero."""
    assert chunks_per_timestep(125 * MB, 45 * MB, 2) == 5
    assert chunks_per_timestep(1, 45 * MB, 2) == 1
    assert isinstance(chunks_per_timestep(90 * MB, 45 * MB, 2), int)


@pytest.mark.parametrize("kwargs, match", [
    (dict(racks=()), "non-empty"),
    (dict(racks=(Rack("a", "sw", ("x",)), Rack("a", "sw2", ("y",)))), "duplicate rack"),
    (dict(racks=(Rack("a", "sw", ("x",)), Rack("b", "sw2", ("x",)))), "duplicate server"),
    (dict(racks=(Rack("a", "sw", ()),)), "no server"),
    (dict(racks=(Rack("a", "sw", ("x",)), Rack("b", "sw2", ("y",)))), "not connected"),
    (dict(racks=(Rack("a", "sw", ("x",)),), links=(SwitchLink("sw", "zz", 1, 1),)), "unknown switch"),
    (dict(racks=(Rack("a", "sw", ("x",)),), snd_up_chunks=0), "snd_up_chunks"),
    (dict(racks=(Rack("a", "sw", ("x",)),), dn_rcv_chunks=1.5), "dn_rcv_chunks"),
    (dict(racks=(Rack("a", "sw", ("x",)), Rack("b", "sw2", ("y",))),
          links=(SwitchLink("sw", "sw2", 1, 1, cost=0),)), "cost"),
])
def test_malformed_topology_raises_malformed_topology_error(kwargs: dict, match: str) -> None:
    """Every inconsistency is a MalformedTopologyError (a ValueError)."""
    with pytest.raises(MalformedTopologyError, match=match):
        Topology(**kwargs)
    assert issubclass(MalformedTopologyError, ValueError)


def test_from_dict_rejects_missing_keys_and_round_trips() -> None:
    """to_dict/from_dict round-trip; a missing key is a MalformedTopologyError."""
    t = paper_topology()
    assert Topology.from_dict(t.to_dict()) == t
    with pytest.raises(MalformedTopologyError):
        Topology.from_dict({"racks": [{"name": "a"}]})
    with pytest.raises(MalformedTopologyError):
        Topology.from_dict([1, 2])  # type: ignore[arg-type]


def test_unknown_server_lookup_raises_unknown_server_error() -> None:
    """Looking up a server that does not exist names it."""
    net = build_network(figure5_topology())
    with pytest.raises(UnknownServerError, match="nope"):
        net.index("nope")
    with pytest.raises(KeyError):
        figure5_topology().rack_of("nope")


@given(small_topologies())
def test_every_generated_network_satisfies_its_invariants(t: Topology) -> None:
    """_check holds for random topologies; capacities are read-only ints."""
    net = build_network(t)
    net._check()
    assert net.capacity.dtype.kind == "i" and not net.capacity.flags.writeable
    assert net.n_servers == len(t.servers) <= 6
