"""Tests of the flow-level simulator and the baselines."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peace.baselines import Router, hdfs_placement, random_placement
from peace.errors import InfeasibleRequestError, SimulationError
from peace.model import MB, build_network, leaf_spine_topology, paper_topology
from peace.simulator import (BackgroundTraffic, BaselinePolicy, PeacePolicy, Simulation, WriteJob,
                             make_jobs, make_policy, max_min_rates, simulate, spread_writers)
from tests.peace.strategies import DECISION_S


def test_max_min_fairness_on_hand_checked_cases() -> None:
    """Classic examples: equal split, bottleneck released capacity, a flow crossing twice."""
    assert max_min_rates([[0], [0]], [10.0]).tolist() == [5.0, 5.0]
    assert max_min_rates([[0], [0, 1], [1]], [10.0, 4.0]).tolist() == [8.0, 2.0, 2.0]
    # parking lot: long flow over 3 links of 1, three one-hop flows
    r = max_min_rates([[0, 1, 2], [0], [1], [2]], [1.0, 1.0, 1.0])
    assert np.allclose(r, [0.5, 0.5, 0.5, 0.5])
    r = max_min_rates([[0, 1], [1]], [1.0, 10.0])
    assert np.allclose(r, [1.0, 9.0])
    r = max_min_rates([[0, 0], [0]], [9.0])  # crossing twice consumes twice the rate
    assert np.allclose(r, [3.0, 3.0])
    with pytest.raises(SimulationError):
        max_min_rates([[]], [1.0])


@settings(max_examples=40)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), min_size=1, max_size=8),
       st.lists(st.floats(0.5, 100.0), min_size=5, max_size=5))
def test_max_min_rates_are_feasible_and_every_flow_has_a_saturated_bottleneck(flows, caps) -> None:
    """No resource is overloaded; each flow crosses a saturated resource where it has a maximal rate."""
    rates = max_min_rates(flows, caps)
    load = np.zeros(5)
    for f, r in zip(flows, rates):
        for res in f:
            load[res] += r
    assert (load <= np.asarray(caps) * (1 + 1e-6)).all()
    for f, r in zip(flows, rates):
        assert r > 0
        ok = False
        for res in set(f):
            if load[res] >= caps[res] * (1 - 1e-6):
                others = [rr for ff, rr in zip(flows, rates) if res in ff]
                if r >= max(others) * (1 - 1e-6):
                    ok = True
        assert ok, (f, r)


def test_one_flow_on_an_empty_network_runs_at_line_rate() -> None:
    """A lone r=1 chunk runs at min(NIC, disk); r=3 chain also at the disk rate."""
    t = paper_topology(disk_bytes_per_s=200 * MB)
    r = simulate(t, [WriteJob(0, "svr1.1", 64 * MB, 0.0, 1)], "hdfs")
    assert r.makespan_s == pytest.approx(64 / 125)
    t2 = paper_topology()
    r2 = simulate(t2, [WriteJob(0, "svr1.1", 640 * MB, 0.0, 3)], "hdfs")
    assert r2.makespan_s == pytest.approx(10 * 64 / 45)
    assert r2.requests[0].service_s == pytest.approx(r2.makespan_s)


@pytest.mark.parametrize("policy", ["peace", "peace-paper", "peace-fill", "hdfs", "random",
                                    "admission"])
def test_bytes_are_conserved_for_every_policy(policy: str) -> None:
    """Each resource serves exactly size x crossings of the flows that used it; all chunks land."""
    t = paper_topology()
    jobs = make_jobs(t, 8, 200 * MB, arrival_spread_s=5.0, seed=1)
    r = simulate(t, jobs, policy, seed=4)
    assert np.allclose(r.resource_bytes, r.expected_resource_bytes, rtol=1e-6, atol=1.0)
    n = t.servers.__len__()
    disk = r.resource_bytes[2 * n: 3 * n].sum()
    assert disk == pytest.approx(8 * 200 * MB * 3, rel=1e-6)  # r copies of every byte
    for q in r.requests:
        assert q.submit_s <= q.first_start_s <= q.done_s <= q.submit_s + r.makespan_s + 1e-9
        assert q.service_s <= q.response_s + 1e-9


def test_background_traffic_slows_writes_but_conserves_write_bytes() -> None:
    """Elastic background flows share the links, so writes take longer."""
    t = leaf_spine_topology(racks=4, servers_per_rack=4, spines=2, oversubscription=4)
    jobs = make_jobs(t, 6, 256 * MB)
    quiet = simulate(t, jobs, "hdfs", seed=1)
    busy = simulate(t, jobs, "hdfs", seed=1, background=BackgroundTraffic(20, seed=3))
    assert busy.makespan_s > quiet.makespan_s
    assert np.allclose(busy.resource_bytes, busy.expected_resource_bytes, rtol=1e-6, atol=1.0)


@pytest.mark.parametrize("policy", ["peace", "peace-paper"])
def test_peace_beats_hdfs_service_time_on_the_paper_workload(policy: str) -> None:
    """16 x 512 MB on the paper's capacities: Peace's service time is far below HDFS's
    (the Figure 10 effect), for the published Algorithm 1 as well as the improved one."""
    t = paper_topology()
    jobs = make_jobs(t, 16, 512 * MB)
    h = simulate(t, jobs, "hdfs", seed=0)
    p = simulate(t, jobs, make_policy(policy, charge_decisions=DECISION_S), seed=0)
    assert 40 < h.mean_response_s < 56 and 45 < h.makespan_s < 60  # calibration (~46 s / ~53 s)
    assert p.policy == policy
    assert p.mean_service_s < 0.55 * h.mean_service_s
    assert p.makespan_s < 1.1 * h.makespan_s
    assert p.decisions > 0


def test_admission_only_trades_response_for_service_time() -> None:
    """Capping concurrent writers shortens service time but delays responses."""
    t = paper_topology()
    jobs = make_jobs(t, 12, 256 * MB)
    h = simulate(t, jobs, "hdfs", seed=0)
    a = simulate(t, jobs, BaselinePolicy("hdfs", max_active_requests=3, name="admission"), seed=0)
    assert a.mean_service_s < h.mean_service_s
    assert max(q.first_start_s for q in a.requests) > 0


def test_simulator_rejects_a_stalled_policy_and_bad_chunks() -> None:
    """A policy that never starts anything is reported, as is a repeated chunk."""

    class Idle:
        name = "idle"

        def attach(self, sim):  # noqa: ANN001
            self.sim = sim

        def on_submit(self, now, jobs):  # noqa: ANN001
            pass

        def on_chunk_done(self, now, job_id, chunk_index):  # noqa: ANN001
            pass

    t = paper_topology()
    with pytest.raises(SimulationError, match="stalled"):
        Simulation(t).run([WriteJob(0, "svr1.1", 64 * MB)], Idle())

    class Twice(Idle):
        def on_submit(self, now, jobs):  # noqa: ANN001
            self.sim.start_chunk(0, 0, [0, 1], [])
            self.sim.start_chunk(0, 0, [0, 2], [])

    with pytest.raises(SimulationError, match="repeated"):
        Simulation(t).run([WriteJob(0, "svr1.1", 64 * MB)], Twice())


def test_hdfs_placement_is_rack_aware_never_local_and_ordered_by_distance() -> None:
    """Replica 1 in the writer's rack, 2 elsewhere, 3 beside 2; pipeline nearest first."""
    net = build_network(paper_topology())
    rng = np.random.default_rng(0)
    for _ in range(200):
        w = int(rng.integers(net.n_servers))
        reps = hdfs_placement(net, w, 3, rng)
        racks = [int(net.rack_of[x]) for x in (w, *reps)]
        assert w not in reps and len(set(reps)) == 3
        assert racks[0] == racks[1] != racks[2] == racks[3]
    with pytest.raises(InfeasibleRequestError):
        hdfs_placement(net, 0, 17, rng)


def test_hdfs_consider_load_skips_busy_servers() -> None:
    """Servers with more than twice the mean active streams are never chosen."""
    net = build_network(paper_topology())
    rng = np.random.default_rng(1)
    load = np.zeros(net.n_servers, dtype=np.int64)
    load[[1, 2, 3]] = 50  # svr1.2..svr1.4 are swamped
    for _ in range(100):
        reps = hdfs_placement(net, 0, 3, rng, load=load)
        assert not {1, 2, 3} & set(reps)


def test_random_placement_is_distinct_and_excludes_the_writer() -> None:
    """Random placement never repeats a server nor picks the writer."""
    net = build_network(paper_topology())
    rng = np.random.default_rng(2)
    for w in range(net.n_servers):
        reps = random_placement(net, w, 3, rng)
        assert w not in reps and len(set(reps)) == 3


def test_router_uses_every_spine() -> None:
    """ECMP spreads inter-rack routes over all spines."""
    net = build_network(leaf_spine_topology(racks=3, servers_per_rack=2, spines=4))
    router = Router(net, np.random.default_rng(0))
    used = {net.edge_v[router.switch_path(0, 5)[0]] for _ in range(200)}
    assert used == {("sw", f"spine{i}") for i in range(4)}
    assert router.switch_path(0, 1) == []


def test_spread_writers_round_robins_racks() -> None:
    """Writers alternate between racks."""
    t = paper_topology()
    assert spread_writers(t, 3) == ["svr1.1", "svr2.1", "svr1.2"]
    assert len(set(spread_writers(t, 17))) == 17
    with pytest.raises(ValueError):
        spread_writers(t, 18)


def test_peace_decisions_cost_simulated_time() -> None:
    """Each decision's time delays its chunks: the first chunks start after the first
    timestep's decisions, decisions are serial, and what is charged is what they cost."""
    t = paper_topology()
    jobs = make_jobs(t, 4, 128 * MB)
    free = simulate(t, jobs, make_policy("peace", charge_decisions=False))
    model = make_policy("peace", charge_decisions=0.05)
    paid = simulate(t, jobs, model)
    assert free.decision_s == 0.0 and min(r.first_start_s for r in free.requests) == 0.0
    assert paid.decision_s == pytest.approx(0.05 * paid.decisions) and paid.decisions > 0
    first = min(r.first_start_s for r in paid.requests)
    assert first > 0.0 and first == pytest.approx(0.05 * round(first / 0.05))
    assert paid.makespan_s > free.makespan_s and paid.mean_response_s > free.mean_response_s
    assert paid.mean_response_s >= paid.mean_service_s  # response counts the wait
    measured = simulate(t, jobs, "peace")  # default: the measured wall time
    assert measured.decision_s > 0.0
    with pytest.raises(ValueError, match="charge_decisions"):
        PeacePolicy(charge_decisions=-1.0)
