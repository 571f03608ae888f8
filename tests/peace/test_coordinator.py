"""Tests of the online coordinator and its local service."""
from __future__ import annotations

import dataclasses
import math
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from peace.coordinator import Coordinator, RequestState
from peace.errors import (CannotScheduleNowError, CoordinatorStateError, InfeasibleRequestError,
                          InvalidRequestError, InvalidScheduleError, UnknownRequestError,
                          UnknownServerError)
from peace.model import figure5_topology, paper_topology
from peace.placement import ChunkRelease
from peace.scheduler import ChunkPlacement, WriteRequest
from peace.service import CoordinatorClient, CoordinatorServer
from peace.validate import validate_schedule


def _requests_of(c: Coordinator) -> list[WriteRequest]:
    return c.requests()


def test_timestep_advances_only_when_80_percent_of_its_writes_complete() -> None:
    """With n chunks in timestep 0, the next timestep starts at ceil(0.8 n) completions."""
    t = paper_topology()
    c = Coordinator(t, seed=3)
    got: list[ChunkPlacement] = []
    for w in t.servers[:12]:
        c.submit(w, 3, 4, on_assign=got.append, poll=False)
    first = c.poll()
    assert first == got and c.timestep == 0
    n = len(first)
    need = math.ceil(0.8 * n)
    assert 4 <= n < 48
    for i, pl in enumerate(first[:need]):
        assert c.timestep == 0
        new = c.complete(pl.request_id, pl.chunk_index)
        c._check()
        if i < need - 1:
            assert new == []
    assert c.timestep == 1 and len(got) > n  # the need-th completion opened timestep 1
    assert all(p.timestep == 1 for p in got[n:])


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_advance_fraction_is_configurable(fraction: float) -> None:
    """The rule uses the configured fraction."""
    t = paper_topology()
    c = Coordinator(t, seed=1, advance_fraction=fraction)
    for w in t.servers[:10]:
        c.submit(w, 3, 4, poll=False)
    first = c.poll()
    need = math.ceil(fraction * len(first))
    for pl in first[:need - 1]:
        c.complete(pl.request_id, pl.chunk_index)
    assert c.timestep == 0
    c.complete(first[need - 1].request_id, first[need - 1].chunk_index)
    assert c.timestep == 1


def test_all_chunks_complete_and_every_timestep_is_a_valid_schedule() -> None:
    """Driving completions to the end places every chunk once within per-timestep capacity."""
    t = paper_topology()
    c = Coordinator(t, seed=7)
    for w in t.servers[:16]:
        c.submit(w, 3, 8, poll=False)
    placed: list[ChunkPlacement] = list(c.poll())
    while c.in_flight():
        pl = c.in_flight()[0]
        placed.extend(c.complete(pl.request_id, pl.chunk_index))
        c._check()
    validate_schedule(c.network, _requests_of(c), placed)
    assert all(c.status(r).state is RequestState.DONE for r in range(16))
    assert c.stats().completed_chunks == 128


def test_hold_inflight_keeps_the_residual_of_stragglers() -> None:
    """With hold_inflight, a timestep plus its stragglers never exceed capacity."""
    t = figure5_topology()
    c = Coordinator(t, seed=0, hold_inflight=True, advance_fraction=0.5)
    for w in t.servers:
        c.submit(w, 1, 3, poll=False)
    c.poll()
    for _ in range(40):
        fl = c.in_flight()
        if not fl:
            break
        usage: dict[int, int] = {}
        for p in fl:
            for e in p.edge_ids:
                usage[e] = usage.get(e, 0) + 1
        assert all(n <= c.network.capacity[e] for e, n in usage.items())
        c.complete(fl[-1].request_id, fl[-1].chunk_index)
        c._check()
    assert not c.in_flight()


def _usage(c: Coordinator) -> dict[int, int]:
    usage: dict[int, int] = {}
    for p in c.in_flight():
        for e in p.edge_ids:
            usage[e] = usage.get(e, 0) + 1
    return usage


def test_work_conserving_grants_on_every_completion() -> None:
    """Work-conserving: each completion that frees a writer slot starts its next chunk at
    once, where the timestep barrier waits for 80 % of the timestep."""
    t = paper_topology()  # 2 chunks per writer
    w = t.servers[0]
    barrier = Coordinator(t, seed=0)
    conserving = Coordinator(t, seed=0, work_conserving=True)
    for c in (barrier, conserving):
        c.submit(w, 1, 6)
    first_b, first_c = barrier.in_flight(), conserving.in_flight()
    cap = len(first_c)
    assert cap == len(first_b) >= 2 and cap < 6  # the writer's capacity binds
    pl = first_b[0]
    assert barrier.complete(pl.request_id, pl.chunk_index) == []  # 1 of cap < 80 %
    for _ in range(6 - cap):  # every completion hands the freed slot to the next chunk
        pl = conserving.in_flight()[0]
        new = conserving.complete(pl.request_id, pl.chunk_index)
        assert len(new) == 1 and len(conserving.in_flight()) == cap
        conserving._check()
    while conserving.in_flight():
        pl = conserving.in_flight()[0]
        assert conserving.complete(pl.request_id, pl.chunk_index) == []
    assert conserving.status(0).state is RequestState.DONE


@given(seed=st.integers(0, 2**16), order=st.randoms(use_true_random=False))
@settings(max_examples=25, deadline=None)
def test_work_conserving_never_exceeds_capacity_and_finishes_everything(seed: int,
                                                                         order: object) -> None:
    """Completions in any order: in-flight usage stays within capacity, no capacity stays
    idle that a waiting chunk could use, and every chunk is placed once."""
    import random
    assert isinstance(order, random.Random)
    t = paper_topology()
    c = Coordinator(t, seed=seed, work_conserving=True)
    for w in t.servers[:12]:
        c.submit(w, 3, 4, poll=False)
    placed = list(c.poll())
    while c.in_flight():
        usage = _usage(c)
        assert all(n <= c.network.capacity[e] for e, n in usage.items())
        fl = c.in_flight()
        pl = fl[order.randrange(len(fl))]
        placed.extend(c.complete(pl.request_id, pl.chunk_index))
        c._check()
        waiting = [r for r in range(12) if c.status(r).assigned < c.status(r).chunks]
        if waiting and not c.in_flight():  # idle network with work waiting: never
            raise AssertionError(f"requests {waiting} wait on an idle network")
    assert sorted((p.request_id, p.chunk_index) for p in placed) == \
        [(r, k) for r in range(12) for k in range(4)]
    assert all(c.status(r).state is RequestState.DONE for r in range(12))


def test_cannot_schedule_now_then_retry_succeeds() -> None:
    """A full queue rejects with CannotScheduleNowError; the retry after progress is accepted."""
    t = paper_topology()
    c = Coordinator(t, seed=0, max_pending_requests=1)
    a = c.submit("svr1.1", 3, 2)  # scheduled at once: no longer waiting
    c.submit("svr1.2", 3, 2, poll=False)  # waits (not polled)
    with pytest.raises(CannotScheduleNowError, match="retry"):
        c.submit("svr1.3", 3, 2, poll=False)
    assert c.stats().rejected_requests == 1
    for pl in c.in_flight():
        c.complete(pl.request_id, pl.chunk_index)
    assert c.status(a).state is RequestState.DONE
    rid = c.submit("svr1.3", 3, 2)  # svr1.2 got scheduled when timestep 0 finished
    assert c.status(rid).state in (RequestState.QUEUED, RequestState.ACTIVE)


def test_bad_input_raises_specific_errors() -> None:
    """Unknown writer, r too large, k <= 0, unknown request or chunk, double completion."""
    c = Coordinator(figure5_topology(), seed=0)
    with pytest.raises(UnknownServerError):
        c.submit("ghost", 2, 1)
    with pytest.raises(InfeasibleRequestError):
        c.submit("svr1.1", 4, 1)
    with pytest.raises(InvalidRequestError):
        c.submit("svr1.1", 2, 0)
    with pytest.raises(UnknownRequestError):
        c.complete(99, 0)
    rid = c.submit("svr1.1", 2, 1)
    with pytest.raises(UnknownRequestError):
        c.complete(rid, 5)
    c.complete(rid, 0)
    with pytest.raises(CoordinatorStateError, match="not in flight"):
        c.complete(rid, 0)
    with pytest.raises(ValueError):
        Coordinator(figure5_topology(), advance_fraction=0.0)


class CoordinatorMachine(RuleBasedStateMachine):
    """Random submissions and completions keep the coordinator's invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.topology = paper_topology(rack_sizes=(3, 3), link_chunks=2)
        self.c = Coordinator(self.topology, seed=0, advance_fraction=0.6)
        self.placed: list[ChunkPlacement] = []

    @rule(w=st.integers(0, 5), k=st.integers(1, 4), r=st.integers(1, 3))
    def submit(self, w: int, k: int, r: int) -> None:
        self.c.submit(self.topology.servers[w], r, k, on_assign=self.placed.append)

    @precondition(lambda self: bool(self.c.in_flight()))
    @rule(i=st.integers(0, 100))
    def complete(self, i: int) -> None:
        fl = self.c.in_flight()
        pl = fl[i % len(fl)]
        self.c.complete(pl.request_id, pl.chunk_index)

    @invariant()
    def consistent(self) -> None:
        self.c._check()
        validate_schedule(self.c.network, _requests_of(self.c), self.placed, complete=False)
        if not self.c.in_flight():  # nothing in flight => nothing left waiting
            assert self.c.stats().pending_requests == 0


TestCoordinatorMachine = CoordinatorMachine.TestCase
TestCoordinatorMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


def test_service_serves_concurrent_clients_until_every_chunk_is_written() -> None:
    """Eight writer threads over 127.0.0.1 each get and complete all their chunks."""
    t = paper_topology()
    c = Coordinator(t, seed=2)
    written: list[dict] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    with CoordinatorServer(c) as server:
        assert server.address[0] == "127.0.0.1"

        def writer(name: str) -> None:
            try:
                with CoordinatorClient(server.address) as cl:
                    def write(a: dict) -> None:
                        assert a["servers"][0] == name and len(a["servers"]) == 4
                        with lock:
                            written.append(a)
                    cl.write_all(name, 3, 6, write, timeout_s=600)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(w,)) for w in t.servers[:8]]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=600)
        assert not errors, errors
        with CoordinatorClient(server.address) as cl:
            stats = cl.stats()
    assert len(written) == 48 and stats["completed_chunks"] == 48
    assert len({(a["request_id"], a["chunk_index"]) for a in written}) == 48
    hist = c.history()
    assert sorted((p.request_id, p.chunk_index, p.servers) for p in hist) == sorted(
        (a["request_id"], a["chunk_index"], tuple(a["servers"])) for a in written)
    validate_schedule(c.network, c.requests(), hist)
    c._check()


def test_service_hands_grants_over_in_submit_and_complete_replies_once() -> None:
    """Work-conserving over the wire: submit's reply carries the first grants, each
    complete(take=True) the grant its freed slot made; wait never repeats one."""
    t = paper_topology()  # 2 chunks in flight per writer
    c = Coordinator(t, seed=0, work_conserving=True)
    with CoordinatorServer(c) as server, CoordinatorClient(server.address) as cl, \
            CoordinatorClient(server.address) as reporter:
        rid, first = cl.submit_and_grants("svr1.1", 2, 5)
        assert [a["chunk_index"] for a in first] == [0, 1]
        assert cl.wait(rid, timeout_s=0.0)["assignments"] == []  # nothing new, nothing twice
        seen = [a["chunk_index"] for a in first]
        todo = list(seen)
        while todo:
            k = todo.pop(0)
            got = reporter.complete(rid, k, take=True)
            seen += [a["chunk_index"] for a in got]
            todo += [a["chunk_index"] for a in got]
        assert sorted(seen) == list(range(5)) and len(seen) == 5
        assert cl.wait(rid, timeout_s=0.0)["assignments"] == []
        assert c.status(rid).state is RequestState.DONE
        # the plain forms keep working: submit() keeps its grants for the next wait()
        rid2 = cl.submit("svr1.2", 2, 1)
        assert [a["chunk_index"] for a in cl.wait(rid2, timeout_s=0.0)["assignments"]] == [0]
        assert reporter.complete(rid2, 0) == []


def test_service_maps_errors_back_to_peace_exceptions() -> None:
    """Bad requests over the wire raise the same exception classes as in process."""
    c = Coordinator(paper_topology(), seed=0, max_pending_requests=1)
    with CoordinatorServer(c) as server, CoordinatorClient(server.address) as cl:
        with pytest.raises(UnknownServerError):
            cl.submit("ghost", 3, 1)
        with pytest.raises(InvalidRequestError):
            cl.submit("svr1.1", 3, 0)
        with pytest.raises(InvalidRequestError):
            cl.call(op="submit", writer="svr1.1", replication="3", chunks=1)
        with pytest.raises(UnknownRequestError):
            cl.complete(42, 0)
        with pytest.raises(ValueError, match="unknown op"):
            cl.call(op="fly")
        cl.submit("svr1.1", 3, 1)
        c.submit("svr1.2", 3, 1, poll=False)
        with pytest.raises(CannotScheduleNowError):
            cl.submit("svr1.3", 3, 1)
    with pytest.raises(ValueError):
        CoordinatorServer(c, host="0.0.0.0")


def test_requests_arriving_during_a_timestep_fill_its_spare_capacity() -> None:
    """A timestep begun by the first of several checkpoints takes the later arrivals at once
    (same timestep, counted by its advance rule, capacities never exceeded); without
    ``fill_on_submit`` they wait for 80 % of the first one's chunks."""
    from peace.model import paper_topology
    from peace.simulator import spread_writers
    from peace.validate import validate_schedule

    topo = paper_topology()
    writers = spread_writers(topo, 4)
    for fill in (True, False):
        c = Coordinator(topo, seed=0, fill_on_submit=fill)
        first = c.submit(writers[0], 2, 2)
        assert c.stats().timestep == 0 and c.status(first).assigned == 2
        later = [c.submit(w, 2, 2) for w in writers[1:]]
        assigned = [c.status(rid).assigned for rid in later]
        assert c.stats().timestep == 0
        if fill:
            assert assigned == [2, 2, 2]
            assert {p.timestep for p in c.history()} == {0}
        else:
            assert assigned == [0, 0, 0]
        validate_schedule(c.network, c.requests(), c.history(), complete=False)
        c._check()
        c.complete(first, 0)
        c.complete(first, 1)  # timestep 0 reaches its 80 %
        if not fill:
            assert c.stats().timestep == 1 and all(c.status(r).assigned == 2 for r in later)


class HoldInflightMachine(CoordinatorMachine):
    """The same with ``hold_inflight`` (and fills): the history certifies under the
    in-flight rule after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.c = Coordinator(self.topology, seed=0, advance_fraction=0.6, hold_inflight=True)

    @invariant()
    def consistent(self) -> None:
        self.c._check()
        validate_schedule(self.c.network, self.c.requests(), self.c.log(), complete=False,
                          hold_inflight=True)


TestHoldInflightMachine = HoldInflightMachine.TestCase
TestHoldInflightMachine.settings = settings(max_examples=25, stateful_step_count=30,
                                            deadline=None)


def _fill_after_a_completion() -> Coordinator:
    """hold_inflight: a writer's two chunks fill its link (2 chunks) in timestep 0; one
    completes (timestep 0 still runs, advance_fraction=1); a new request of the same writer
    takes the freed slot in timestep 0."""
    t = paper_topology()  # 2 chunks per writer link
    c = Coordinator(t, seed=0, hold_inflight=True, advance_fraction=1.0)
    w = t.servers[0]
    first = c.submit(w, 1, 2)
    assert c.status(first).assigned == 2
    c.complete(first, 0)
    assert c.timestep == 0
    second = c.submit(w, 1, 1)
    assert c.status(second).assigned == 1 and c.timestep == 0
    return c


def test_validator_accepts_a_filled_timestep_that_never_overloads_in_flight() -> None:
    """Three chunks of one timestep cross a 2-chunk link, never more than two at once: the
    coordinator's history certifies under its rule (in flight), not per timestep."""
    c = _fill_after_a_completion()
    log = c.log()
    assert sum(isinstance(e, ChunkRelease) for e in log) == 1
    assert {p.timestep for p in c.history()} == {0} and len(c.history()) == 3
    report = validate_schedule(c.network, c.requests(), log, hold_inflight=True)
    assert report.max_edge_load == 2 and report.chunks == 3 and report.timesteps == 1
    assert c.certify(complete=True) == report
    with pytest.raises(InvalidScheduleError, match="carries 3 chunks, capacity 2"):
        validate_schedule(c.network, c.requests(), c.history())  # per timestep: 3 > 2
    c._check()


def test_validator_rejects_a_history_that_overloads_a_link_in_flight() -> None:
    """The same placements without the release in between put three chunks at once on the
    writer's 2-chunk link: rejected, naming the chunk and the edge."""
    c = _fill_after_a_completion()
    overloading = [e for e in c.log() if not isinstance(e, ChunkRelease)]
    with pytest.raises(InvalidScheduleError,
                       match=r"request 1 chunk 0 \(timestep 0\): edge .* carries 3 chunks in "
                             r"flight, capacity 2"):
        validate_schedule(c.network, c.requests(), overloading, hold_inflight=True)
    # the release moved after the third placement: overloaded just as well
    log = c.log()
    moved = [e for e in log if not isinstance(e, ChunkRelease)] + [ChunkRelease(0, 0)]
    with pytest.raises(InvalidScheduleError, match="in flight, capacity 2"):
        validate_schedule(c.network, c.requests(), moved, hold_inflight=True)


def test_validator_rejects_inconsistent_histories() -> None:
    """A release of a chunk not in flight, and a placement back in an earlier timestep."""
    c = _fill_after_a_completion()
    log = c.log()
    with pytest.raises(InvalidScheduleError, match="request 0 chunk 0: released but not in"):
        validate_schedule(c.network, c.requests(), log + [ChunkRelease(0, 0)],
                          hold_inflight=True)
    with pytest.raises(InvalidScheduleError, match="released but not in flight"):
        validate_schedule(c.network, c.requests(), [ChunkRelease(1, 0)] + log,
                          hold_inflight=True)
    first, *rest = [e for e in log if isinstance(e, ChunkPlacement)]
    later = dataclasses.replace(first, timestep=1)
    with pytest.raises(InvalidScheduleError, match="placed after a chunk of timestep 1"):
        validate_schedule(c.network, c.requests(), [later, *rest], hold_inflight=True)
    with pytest.raises(ValueError, match="capacity_by_timestep"):
        validate_schedule(c.network, c.requests(), log, hold_inflight=True,
                          capacity_by_timestep={})


@given(seed=st.integers(0, 2**16), order=st.randoms(use_true_random=False),
       fill=st.booleans(), conserving=st.booleans())
@settings(max_examples=20, deadline=None)
def test_every_history_the_coordinator_produces_certifies(seed: int, order: object, fill: bool,
                                                          conserving: bool) -> None:
    """Submissions between completions in any order, with and without fills and the
    work-conserving mode: the whole history certifies under the coordinator's rule."""
    import random
    assert isinstance(order, random.Random)
    t = paper_topology(rack_sizes=(3, 3), link_chunks=2)
    c = Coordinator(t, seed=seed, hold_inflight=True, fill_on_submit=fill,
                    work_conserving=conserving, advance_fraction=0.6)
    n = 0
    for step in range(40):
        fl = c.in_flight()
        if n < 10 and (not fl or order.random() < 0.4):
            c.submit(t.servers[order.randrange(6)], order.randint(1, 3), order.randint(1, 4))
            n += 1
        elif fl:
            pl = fl[order.randrange(len(fl))]
            c.complete(pl.request_id, pl.chunk_index)
    while c.in_flight():
        pl = c.in_flight()[0]
        c.complete(pl.request_id, pl.chunk_index)
    report = c.certify(complete=True)
    assert report.chunks == sum(r.chunks for r in c.requests())
    assert report.max_edge_load <= int(c.network.capacity.max())
