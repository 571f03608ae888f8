"""The min-cost-flow bound agrees across networkx solvers and bounds Algorithm 1 and brute force."""
from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from peace.errors import InfeasibleRequestError
from peace.mincost import min_cost_flow_bound
from peace.model import build_network, figure5_topology, paper_topology
from peace.scheduler import UNCONSTRAINED, PeaceScheduler, WriteRequest
from tests.peace.strategies import brute_max_chunks, request_sets, small_topologies


def test_figure5_bound_is_two_chunks_at_cost_two_each() -> None:
    """Two writers, capacity 1: both first hops fit, intra-rack (cost 2)."""
    net = build_network(figure5_topology())
    reqs = [WriteRequest("svr1.1", 2, 1, 0), WriteRequest("svr2.1", 2, 1, 1)]
    b = min_cost_flow_bound(net, reqs)
    assert (b.max_chunks, b.min_cost) == (2, 4)


def test_paper_bound_is_limited_by_the_writers_nics() -> None:
    """16 writers with capacity 2 each: at most 32 first hops, each of cost >= 2."""
    t = paper_topology()
    net = build_network(t)
    reqs = [WriteRequest(w, 3, 8, i) for i, w in enumerate(t.servers[:16])]
    b = min_cost_flow_bound(net, reqs)
    assert b.max_chunks == 32 and b.min_cost >= 64
    plan = PeaceScheduler(net, seed=0).schedule_timestep(reqs, net.new_residual())
    assert len(plan.placements) <= b.max_chunks


@settings(max_examples=25)
@given(data=st.data(), topo=small_topologies(max_servers=5))
def test_solvers_agree_and_bound_algorithm1_and_brute_force(data: st.DataObject, topo) -> None:
    """max_flow_min_cost, network_simplex and capacity_scaling agree; bound >= optimum >= Alg. 1."""
    net = build_network(topo)
    reqs = data.draw(request_sets(topo, max_requests=2, max_r=1, max_k=2))
    a = min_cost_flow_bound(net, reqs)
    assert a == min_cost_flow_bound(net, reqs, method="network_simplex")
    assert a == min_cost_flow_bound(net, reqs, method="capacity_scaling")
    s = PeaceScheduler(net, UNCONSTRAINED, seed=data.draw(st.integers(0, 99)))
    try:
        for r in reqs:
            s.check_request(r)
    except InfeasibleRequestError:
        assume(False)
    placed = len(s.schedule_timestep(reqs, net.new_residual()).placements)
    best = brute_max_chunks(net, reqs, UNCONSTRAINED, net.new_residual())
    assert placed <= best <= a.max_chunks
