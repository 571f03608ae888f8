"""Tests of Algorithm 1: Figure 5, randomized shortest paths, brute force, bad input."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from peace.errors import (InfeasibleRequestError, InvalidRequestError, ScheduleInfeasibleError,
                          TemplateError, UnknownServerError)
from peace.model import build_network, figure5_topology, leaf_spine_topology, paper_topology
from peace.scheduler import RACK_AWARE, UNCONSTRAINED, PeaceScheduler, ReplicaTemplate, WriteRequest
from peace.validate import validate_schedule
from tests.peace.strategies import (allowed_servers, brute_max_chunks, brute_min_cost,
                                    request_sets, small_topologies, templates_st)

FIG5_REQUESTS = [WriteRequest("svr1.1", 2, 1, 0), WriteRequest("svr2.1", 2, 1, 1)]


def test_figure5_example_svr11_to_svr12_then_svr22_and_svr21_deferred() -> None:
    """Paper §5 (published Algorithm 1): SVR1.1 -> SVR1.2 -> SVR2.2; SVR2.1 waits for t+1."""
    net = build_network(figure5_topology())
    hits = 0
    for seed in range(40):
        s = PeaceScheduler(net, seed=seed, variant="paper")
        residual = net.new_residual()
        plan = s.schedule_timestep(FIG5_REQUESTS, residual, timestep=0)
        validate_schedule(net, FIG5_REQUESTS, plan.placements, complete=False)
        first = plan.placements[0]
        assert first.servers[:2] == ("svr1.1", "svr1.2")  # the only same-rack choice
        if first.servers == ("svr1.1", "svr1.2", "svr2.2"):
            hits += 1
            assert len(plan.placements) == 1
            assert plan.deferred == (WriteRequest("svr2.1", 2, 1, 1),)
            assert residual[net.edge_index[("sw", "sw2"), ("dn", "svr2.2")]] == 0
            assert first.hops[1] == (("snd", "svr1.2"), ("up", "svr1.2"), ("sw", "sw1"),
                                     ("sw", "sw2"), ("dn", "svr2.2"), ("rcv", "svr2.2"))
            assert first.cost == 2 + 3
            nxt = s.schedule_timestep(plan.deferred, net.new_residual(), timestep=1)
            assert [p.servers[:2] for p in nxt.placements] == [("svr2.1", "svr2.2")]
            assert nxt.placements[0].timestep == 1 and not nxt.deferred
        else:  # the other equal-cost choice leaves room for SVR2.1 in the same timestep
            assert first.servers == ("svr1.1", "svr1.2", "svr2.1")
            assert len(plan.placements) == 2
    assert 5 <= hits <= 35  # both tie-breaks happen


def test_figure5_brute_force_shows_algorithm1_is_not_optimal() -> None:
    """Both chunks fit in one timestep, which the paper's tie-break misses (it is greedy)."""
    net = build_network(figure5_topology())
    assert brute_max_chunks(net, FIG5_REQUESTS, RACK_AWARE, net.new_residual()) == 2


@pytest.mark.parametrize("method", ["fast", "networkx"])
def test_rsp_breaks_ties_uniformly(method: str) -> None:
    """The second replica lands on SVR2.1 or SVR2.2 about equally often."""
    net = build_network(figure5_topology())
    s = PeaceScheduler(net, seed=123, method=method)
    c = Counter(s.schedule_timestep([FIG5_REQUESTS[0]], net.new_residual()).placements[0].servers[2]
                for _ in range(2000))
    assert set(c) == {"svr2.1", "svr2.2"}
    assert abs(c["svr2.1"] - 1000) < 120  # > 5 sigma


def test_rsp_spreads_over_spines_and_racks_uniformly_on_leaf_spine() -> None:
    """Inter-rack replicas use every spine and every other rack."""
    net = build_network(leaf_spine_topology(racks=4, servers_per_rack=3, spines=3))
    s = PeaceScheduler(net, seed=5)
    spines: Counter[str] = Counter()
    racks: Counter[int] = Counter()
    for _ in range(600):
        pl = s.schedule_timestep([WriteRequest("s0.0", 2, 1)], net.new_residual()).placements[0]
        spines[pl.hops[1][3][1]] += 1
        racks[int(net.rack_of[net.server_index[pl.servers[2]]])] += 1
    assert set(spines) == {"spine0", "spine1", "spine2"} and min(spines.values()) > 150
    assert set(racks) == {1, 2, 3} and min(racks.values()) > 150


@settings(max_examples=40)
@given(data=st.data(), topo=small_topologies(), templates=templates_st)
def test_rsp_cost_equals_brute_force_minimum_on_random_residuals(data: st.DataObject, topo,
                                                                  templates) -> None:
    """Both RSP methods find a path iff one exists, and of minimum cost."""
    net = build_network(topo)
    residual = np.array([data.draw(st.integers(0, int(c))) for c in net.capacity], dtype=np.int64)
    z = data.draw(st.integers(0, net.n_servers - 1))
    replica = data.draw(st.integers(0, 2))
    path = [z]
    for i in range(replica):  # a plausible prefix: any distinct servers
        others = [j for j in range(net.n_servers) if j not in path]
        assume(others)
        path.append(data.draw(st.sampled_from(others)))
    try:
        from peace.scheduler import check_templates
        check_templates(templates, replica + 1)
    except TemplateError:
        assume(False)
    allowed = allowed_servers(net, templates, path, replica)
    expected = brute_min_cost(net, path[-1], allowed, residual)
    for method in ("fast", "networkx"):
        s = PeaceScheduler(net, templates, seed=data.draw(st.integers(0, 10)), method=method)
        mask = s._allowed(path, replica)
        assert sorted(np.flatnonzero(mask).tolist()) == allowed
        rsp = s._rsp_fast if method == "fast" else s._rsp_networkx
        before = residual.copy()
        q = rsp(path[-1], mask, residual)
        assert np.array_equal(before, residual)  # RSP never mutates the residual
        if expected is None:
            assert q is None
        else:
            assert q is not None
            j, eids, cost = q
            assert j in allowed and cost == expected
            assert cost == net.path_cost(eids) and all(residual[e] > 0 for e in eids)
            verts = net.path_vertices(eids)
            assert verts[0] == ("snd", net.servers[path[-1]]) and verts[-1] == ("rcv", net.servers[j])


@pytest.mark.parametrize("variant", ["improved", "paper"])
@settings(max_examples=30)
@given(data=st.data(), topo=small_topologies(max_servers=5), templates=templates_st)
def test_algorithm1_never_beats_brute_force_and_its_timestep_is_valid(variant: str,
                                                                       data: st.DataObject, topo,
                                                                       templates) -> None:
    """One timestep places at most the brute-force optimum and passes the validator."""
    net = build_network(topo)
    requests = data.draw(request_sets(topo, max_requests=2, max_r=2, max_k=2))
    s = PeaceScheduler(net, templates, seed=data.draw(st.integers(0, 1000)), variant=variant)
    feasible = []
    for r in requests:
        try:
            s.check_request(r)
            feasible.append(r)
        except InfeasibleRequestError:
            pass
    assume(feasible)
    residual = net.new_residual()
    plan = s.schedule_timestep(feasible, residual)
    validate_schedule(net, feasible, plan.placements, templates, complete=False)
    assert (residual >= 0).all()
    used = np.zeros_like(residual)
    for p in plan.placements:
        for e in p.edge_ids:
            used[e] += 1
    assert np.array_equal(residual + used, net.capacity)  # deferred chunks gave capacity back
    assert len(plan.placements) <= brute_max_chunks(net, feasible, templates, net.new_residual())
    placed = Counter(p.request_id for p in plan.placements)
    for d in plan.deferred:  # deferred = requested - placed, numbering continues
        orig = next(r for r in feasible if r.request_id == d.request_id)
        assert d.chunks == orig.chunks - placed[d.request_id]
        assert d.first_chunk == orig.first_chunk + placed[d.request_id]
    assert {d.request_id for d in plan.deferred} | set(placed) >= {r.request_id for r in feasible}


@pytest.mark.parametrize("variant", ["improved", "paper"])
@settings(max_examples=30)
@given(data=st.data(), topo=small_topologies(), templates=templates_st)
def test_offline_schedule_places_every_chunk_validly(variant: str, data: st.DataObject, topo,
                                                     templates) -> None:
    """schedule() finishes every feasible request set (improved; the published algorithm
    finishes or reports a stall); the validator certifies it."""
    net = build_network(topo)
    requests = data.draw(request_sets(topo, max_requests=3, max_r=3, max_k=3))
    s = PeaceScheduler(net, templates, seed=data.draw(st.integers(0, 1000)),
                       variant=variant, lookahead=True)
    try:
        for r in requests:
            s.check_request(r)
    except (InfeasibleRequestError, TemplateError):
        assume(False)
    if variant == "paper":
        # the published greedy chain can dead-end deterministically (see
        # test_improved.py::test_backtracking_completes_a_chain_the_published_algorithm_never_can)
        try:
            sched = s.schedule(requests)
        except ScheduleInfeasibleError:
            return
    else:
        sched = s.schedule(requests)
    report = validate_schedule(net, requests, sched.placements, templates)
    assert report.chunks == sum(r.chunks for r in requests)
    assert report.timesteps == sched.timesteps


def test_paper_workload_schedule_is_valid_and_uses_capacity_well() -> None:
    """16 writers x 8 chunks on 17 servers: valid, rack-aware, several chunks per timestep."""
    t = paper_topology()
    net = build_network(t)
    reqs = [WriteRequest(w, 3, 8, i) for i, w in enumerate(t.servers[:16])]
    s = PeaceScheduler(net, seed=0)
    sched = s.schedule(reqs)
    rep = validate_schedule(net, reqs, sched.placements)
    assert rep.chunks == 128 and rep.max_edge_load <= 5
    assert sched.timesteps <= 32  # at least 4 chunks per timestep on average
    for p in sched.placements:  # exactly one inter-rack crossing per chain
        racks = [int(net.rack_of[net.server_index[x]]) for x in p.servers]
        assert racks[0] == racks[1] != racks[2] == racks[3]


@pytest.mark.parametrize("variant", ["improved", "paper"])
def test_fast_and_networkx_methods_agree_exactly_on_two_racks(variant: str) -> None:
    """Without switch-path ties both methods consume the RNG alike: identical schedules."""
    t = paper_topology()
    reqs = [WriteRequest(w, 3, 4, i) for i, w in enumerate(t.servers[:10])]
    a = PeaceScheduler(t, seed=9, method="fast", variant=variant).schedule(reqs)
    b = PeaceScheduler(t, seed=9, method="networkx", variant=variant).schedule(reqs)
    assert a.placements == b.placements


def test_decisions_are_fast_on_1000_servers() -> None:
    """A replica placement decision on the 1000-server leaf-spine takes well under 5 ms of
    CPU (the deciding thread's CPU time: other processes on a loaded machine do not count)."""
    t = leaf_spine_topology()
    s = PeaceScheduler(t, seed=0)
    reqs = [WriteRequest(w, 3, 4, i) for i, w in enumerate(t.servers[::10])]
    s.schedule_timestep(reqs, s.network.new_residual())
    st_ = s.stats()
    assert st_.decisions >= 300 and 0 < st_.decision_cpu_s <= st_.decision_time_s * 1.5
    assert 1000 * st_.decision_cpu_s / st_.decisions < 5.0


def test_bad_requests_raise_specific_errors() -> None:
    """Unknown writer, r too large for the eligible nodes, k <= 0, bad templates."""
    s = PeaceScheduler(figure5_topology(), seed=0)
    with pytest.raises(UnknownServerError, match="svr9"):
        s.check_request(WriteRequest("svr9", 2, 1))
    with pytest.raises(UnknownServerError):
        s.schedule_timestep([WriteRequest("svr9", 2, 1)], s.network.new_residual())
    with pytest.raises(InfeasibleRequestError, match="replication 4"):
        s.check_request(WriteRequest("svr1.1", 4, 1))
    small = PeaceScheduler(paper_topology(rack_sizes=(3, 1)), seed=0)
    with pytest.raises(InfeasibleRequestError, match="templates"):
        small.check_request(WriteRequest("svr1.1", 3, 1))  # third replica must join a 1-server rack
    with pytest.raises(InvalidRequestError, match="chunks"):
        WriteRequest("svr1.1", 2, 0)
    with pytest.raises(InvalidRequestError, match="replication"):
        WriteRequest("svr1.1", -1, 1)
    with pytest.raises(InvalidRequestError):
        WriteRequest("svr1.1", 2, True)
    with pytest.raises(TemplateError):
        PeaceScheduler(figure5_topology(), (ReplicaTemplate(same_rack_as=(1,)),))
    assert issubclass(InfeasibleRequestError, ValueError)


def test_unconstrained_r3_on_figure5_uses_every_other_server() -> None:
    """With no template, r = 3 on four servers puts one replica on each other server."""
    s = PeaceScheduler(figure5_topology(), UNCONSTRAINED, seed=0)
    req = WriteRequest("svr1.1", 3, 2)
    sched = s.schedule([req])
    validate_schedule(s.network, [req], sched.placements, UNCONSTRAINED)
    assert all(sorted(p.servers[1:]) == ["svr1.2", "svr2.1", "svr2.2"] for p in sched.placements)
    assert sched.timesteps == 2  # capacity 1 everywhere: one chunk per timestep
