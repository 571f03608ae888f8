"""Flow-level simulator of DFS checkpoint writes (paper §6.2, Figure 10).

Resources are every server's NIC send side (``tx``), NIC receive side (``rx``)
and disk, and each switch link per direction; switches are non-blocking inside.
A chunk's replication pipeline ``w -> a -> b -> c`` is *one* flow (HDFS forwards
packets down the pipeline) over ``tx(w), rx(a), disk(a), tx(a), rx(b), disk(b),
tx(b), rx(c), disk(c)`` plus the switch links of every hop (a link crossed
twice counts twice). Bandwidth is shared max-min fairly by progressive filling,
vectorized over (flow, resource) pairs with numpy; rates are recomputed at every
event (a chunk starts or ends, a request arrives). Optional background traffic
is a set of persistent, optionally rate-capped flows between random servers in
different racks.

Each policy decides when and where chunks start: :class:`PeacePolicy` drives the
online :class:`~peace.coordinator.Coordinator` (``peace``: the improved scheduler,
``peace-paper``: Algorithm 1 as published, see :mod:`peace.scheduler`; ``peace-mcf``:
the min-cost-flow variant, :mod:`peace.mcf`); :class:`BaselinePolicy` is HDFS
default placement or random placement, each writer running ``streams_per_writer``
pipelines at once (the IOService's worker threads), optionally with an admission
cap on concurrent requests ("admission only"). ``hdfs-fair`` is HDFS with the
same per-writer concurrency as Peace (its writers' SND->UP capacity, 2).

Per request the result holds the *response time* (submit -> last chunk done,
the headline: it includes any admission wait) and the *service time* (first
chunk start -> last chunk done); the makespan is the last completion minus the
first submission.

Peace's decisions cost simulated time: :class:`PeacePolicy` measures the time
the scheduler spends in each call that schedules a timestep
(:meth:`peace.scheduler.PeaceScheduler.schedule_timestep`, all bookkeeping
included) and starts that timestep's chunks that much later; decisions are
serial (one coordinator), so a decision that is due while another one runs
starts when it ends. The time is the deciding thread's CPU time
(``time.thread_time``): a coordinator's own cost, not the turns other
processes take on a shared machine (on this 2-core machine shared by ~8
benchmark runs, wall time was 3-25x the CPU time). The baselines decide nothing that takes time (HDFS picks
replicas per block in microseconds) and are not charged.

Invariants: bytes are conserved (every resource serves exactly the bytes of
the flows that crossed it, times the crossings); no resource is loaded beyond
its capacity; a flow's rate is limited by its most contended resource.

Calibration (recorded in :data:`CALIBRATION`): 64 MB chunks, 125 MB/s NICs, a
125 MB/s inter-rack link, 45 MB/s disks, 1 stream per writer (a DFS output stream writes its blocks in turn), r = 3.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from peace.baselines import Router, hdfs_placement, random_placement
from peace.coordinator import Coordinator
from peace.errors import SimulationError
from peace.model import MB, Network, Topology, build_network
from peace.placement import RACK_AWARE, ChunkPlacement, ReplicaTemplate
from peace.scheduler import Heuristics

__all__ = [
    "CALIBRATION",
    "WriteJob",
    "BackgroundTraffic",
    "RequestTimes",
    "SimResult",
    "Policy",
    "PeacePolicy",
    "BaselinePolicy",
    "Simulation",
    "max_min_rates",
    "simulate",
    "spread_writers",
    "make_jobs",
    "make_policy",
    "POLICIES",
    "PEACE_VARIANTS",
]

logger = logging.getLogger(__name__)

FloatArray: TypeAlias = npt.NDArray[np.float64]
IntArray: TypeAlias = npt.NDArray[np.int64]

#: the parameters the baseline was calibrated with (issue 4: stock HDFS ~46 s / ~53 s
#: for 16 writers x 512 MB, r = 3, on the 17-server topology).
CALIBRATION: dict[str, float] = {
    "chunk_bytes": 64 * MB,
    "nic_bytes_per_s": 125 * MB,
    "interrack_bytes_per_s": 125 * MB,
    "disk_bytes_per_s": 45 * MB,
    "replication": 3,
    "streams_per_writer": 1,
}


# --------------------------------------------------------------------------- fairness
def _progressive_filling(pair_flow: IntArray, pair_res: IntArray, pair_w: FloatArray,
                         capacity: FloatArray, active: npt.NDArray[np.bool_]) -> FloatArray:
    """Max-min fair rates of the ``active`` flows (vectorized progressive filling)."""
    n_res = len(capacity)
    rate = np.zeros(len(active))
    unfrozen = active.copy()
    pa = unfrozen[pair_flow]
    rem = capacity.astype(np.float64).copy()
    for _ in range(n_res + 1):
        if not pa.any():
            break
        load = np.bincount(pair_res[pa], weights=pair_w[pa], minlength=n_res)
        used = np.flatnonzero(load > 0)
        share = rem[used] / load[used]
        d = max(float(share.min()), 0.0)
        rate[unfrozen] += d
        rem[used] -= d * load[used]
        bott = np.zeros(n_res, dtype=bool)
        bott[used[share <= d * (1 + 1e-9) + 1e-12]] = True
        rem[bott] = 0.0
        unfrozen[pair_flow[pa & bott[pair_res]]] = False
        pa &= unfrozen[pair_flow]
    return rate


def max_min_rates(flows: Sequence[Sequence[int]], capacity: Sequence[float]) -> FloatArray:
    """Max-min fair rates of ``flows``, each a list of resource indices (repeats count twice).

    >>> max_min_rates([[0], [0, 1], [1]], [10.0, 4.0]).tolist()
    [8.0, 2.0, 2.0]

    Raises
    ------
    SimulationError
        If a flow uses no resource (its rate would be unbounded).
    """
    pf: list[int] = []
    pr: list[int] = []
    for i, f in enumerate(flows):
        if not f:
            raise SimulationError(f"flow {i} uses no resource")
        pf.extend([i] * len(f))
        pr.extend(f)
    return _progressive_filling(np.asarray(pf, dtype=np.int64), np.asarray(pr, dtype=np.int64),
                                np.ones(len(pf)), np.asarray(capacity, dtype=np.float64),
                                np.ones(len(flows), dtype=bool))


# --------------------------------------------------------------------------- values
@dataclass(frozen=True, slots=True)
class WriteJob:
    """One checkpoint write to simulate: ``size_bytes`` from ``writer`` at ``submit_s``."""

    job_id: int
    writer: str
    size_bytes: int
    submit_s: float = 0.0
    replication: int = 3


@dataclass(frozen=True, slots=True)
class BackgroundTraffic:
    """Persistent flows between random servers of different racks.

    ``rate_cap_bytes_per_s`` bounds each flow (``None``: elastic, takes its fair share).
    """

    flows: int
    rate_cap_bytes_per_s: int | None = None
    seed: int = 0


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """Timing of one simulated write request."""

    job_id: int
    writer: str
    submit_s: float
    first_start_s: float
    done_s: float

    @property
    def response_s(self) -> float:
        """Submit -> last chunk done."""
        return self.done_s - self.submit_s

    @property
    def service_s(self) -> float:
        """First chunk start -> last chunk done."""
        return self.done_s - self.first_start_s


@dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of one simulation run."""

    policy: str
    requests: tuple[RequestTimes, ...]
    makespan_s: float
    events: int
    wall_s: float
    resource_bytes: FloatArray = field(repr=False)
    """Bytes each resource served during the run (write flows only)."""
    expected_resource_bytes: FloatArray = field(repr=False)
    """Size x crossings of every completed write flow, per resource."""
    decisions: int = 0
    ms_per_decision: float = 0.0
    decision_s: float = 0.0
    """Simulated time charged for the scheduler's decisions (see the module docstring)."""

    @property
    def mean_response_s(self) -> float:
        """Mean response time over requests."""
        return float(np.mean([r.response_s for r in self.requests]))

    @property
    def mean_service_s(self) -> float:
        """Mean service time over requests."""
        return float(np.mean([r.service_s for r in self.requests]))

    def summary(self) -> dict[str, float]:
        """Headline numbers as a JSON-able dict."""
        return {"mean_response_s": self.mean_response_s, "mean_service_s": self.mean_service_s,
                "makespan_s": self.makespan_s, "requests": len(self.requests),
                "events": self.events, "wall_s": self.wall_s,
                "ms_per_decision": self.ms_per_decision, "decision_s": self.decision_s}


# --------------------------------------------------------------------------- engine
class Policy(Protocol):
    """Decides when and where chunks start (see :class:`PeacePolicy`, :class:`BaselinePolicy`)."""

    name: str

    def attach(self, sim: Simulation) -> None:
        """Bind to a simulation before it runs."""

    def on_submit(self, now: float, jobs: Sequence[WriteJob]) -> None:
        """Requests arrive (all submitted at ``now``)."""

    def on_chunk_done(self, now: float, job_id: int, chunk_index: int) -> None:
        """A chunk's whole pipeline finished."""


class Simulation:
    """Event-driven max-min fair flow simulation over a topology.

    Parameters
    ----------
    topology
        Topology or compiled network; bandwidths come from it.
    background
        Optional persistent background flows.
    """

    def __init__(self, topology: Topology | Network, *, background: BackgroundTraffic | None = None
                 ) -> None:
        self.network = topology if isinstance(topology, Network) else build_network(topology)
        net = self.network
        t = net.topology
        n = net.n_servers
        self._n = n
        self._link_base = 3 * n
        caps = [float(t.nic_bytes_per_s)] * (2 * n) + [float(t.disk_bytes_per_s)] * n
        for link in t.links:
            caps += [float(link.bandwidth_bytes_per_s)] * 2
        self._bg_specs: list[tuple[list[int], float]] = []
        if background is not None and background.flows > 0:
            rng = np.random.default_rng(background.seed)
            router = Router(net, rng)
            for _ in range(background.flows):
                src = int(rng.integers(n))
                others = np.flatnonzero(net.rack_of != net.rack_of[src])
                dst = int(rng.choice(others)) if len(others) else int((src + 1) % n)
                res = [src, n + dst] + [self._link_res(e) for e in router.switch_path(src, dst)]
                if background.rate_cap_bytes_per_s is not None:
                    res.append(len(caps))
                    caps.append(float(background.rate_cap_bytes_per_s))
                self._bg_specs.append((res, math.inf))
        self.capacity: FloatArray = np.asarray(caps, dtype=np.float64)
        self.n_resources = len(caps)
        self.now = 0.0
        # flow slots
        self._slot_rem = np.zeros(64)
        self._slot_size = np.zeros(64)
        self._slot_active = np.zeros(64, dtype=bool)
        self._slot_tag: list[tuple[int, int] | None] = [None] * 64
        self._slot_servers: list[tuple[int, ...]] = [()] * 64
        self._free: list[int] = list(range(63, -1, -1))
        self._pair_flow = np.zeros(0, dtype=np.int64)
        self._pair_res = np.zeros(0, dtype=np.int64)
        self._pair_w = np.zeros(0)
        self._pending_pairs: list[tuple[int, IntArray, FloatArray]] = []
        self._dirty = True
        self._rate = np.zeros(64)
        self.served = np.zeros(self.n_resources)
        self.expected = np.zeros(self.n_resources)
        #: active write streams touching each server (HDFS xceivers)
        self.server_streams = np.zeros(n, dtype=np.int64)
        self._jobs: dict[int, WriteJob] = {}
        self._chunks_left: dict[int, int] = {}
        self._first_start: dict[int, float] = {}
        self._done: dict[int, float] = {}
        self._started: set[tuple[int, int]] = set()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()

    # ---- resources
    def _link_res(self, eid: int) -> int:
        li, direction = self.network.link_of_edge[eid]
        return self._link_base + 2 * li + direction

    def chain_resources(self, servers: Sequence[int], switch_edges: Sequence[int]) -> list[int]:
        """Resources of one pipeline flow: sender NICs, receiver NICs and disks, switch links."""
        n = self._n
        res = [servers[0]]
        for i, s in enumerate(servers[1:]):
            res += [n + s, 2 * n + s]
            if i < len(servers) - 2:
                res.append(s)
        res += [self._link_res(e) for e in switch_edges]
        return res

    # ---- flows
    def _grow(self) -> None:
        old = len(self._slot_rem)
        new = old * 2
        for name in ("_slot_rem", "_slot_size", "_rate"):
            arr = getattr(self, name)
            grown = np.zeros(new)
            grown[:old] = arr
            setattr(self, name, grown)
        act = np.zeros(new, dtype=bool)
        act[:old] = self._slot_active
        self._slot_active = act
        self._slot_tag += [None] * old
        self._slot_servers += [()] * old
        self._free.extend(range(new - 1, old - 1, -1))

    def _add_flow(self, resources: Sequence[int], size: float, tag: tuple[int, int] | None,
                  servers: tuple[int, ...]) -> int:
        if not resources:
            raise SimulationError("a flow needs at least one resource")
        if not self._free:
            self._grow()
        slot = self._free.pop()
        res, counts = np.unique(np.asarray(resources, dtype=np.int64), return_counts=True)
        self._slot_rem[slot] = size
        self._slot_size[slot] = size
        self._slot_active[slot] = True
        self._slot_tag[slot] = tag
        self._slot_servers[slot] = servers
        self._pending_pairs.append((slot, res, counts.astype(np.float64)))
        self._dirty = True
        return slot

    def _flush_pairs(self) -> None:
        if self._pending_pairs:
            flows = [self._pair_flow]
            res = [self._pair_res]
            ws = [self._pair_w]
            for slot, r, w in self._pending_pairs:
                flows.append(np.full(len(r), slot, dtype=np.int64))
                res.append(r)
                ws.append(w)
            self._pair_flow = np.concatenate(flows)
            self._pair_res = np.concatenate(res)
            self._pair_w = np.concatenate(ws)
            self._pending_pairs.clear()

    def start_chunk(self, job_id: int, chunk_index: int, servers: Sequence[int],
                    switch_edges: Sequence[int]) -> None:
        """Start chunk ``chunk_index`` of job ``job_id`` down pipeline ``servers`` (writer first).

        Raises
        ------
        SimulationError
            If the job is unknown, the chunk index out of range or already started.
        """
        job = self._jobs.get(job_id)
        if job is None:
            raise SimulationError(f"unknown job {job_id}")
        chunk = self.network.topology.chunk_bytes
        n_chunks = max(1, math.ceil(job.size_bytes / chunk))
        if not 0 <= chunk_index < n_chunks or (job_id, chunk_index) in self._started:
            raise SimulationError(f"job {job_id}: bad or repeated chunk {chunk_index}")
        self._started.add((job_id, chunk_index))
        size = float(min(chunk, job.size_bytes - chunk_index * chunk))
        res = self.chain_resources(servers, switch_edges)
        self._add_flow(res, size, (job_id, chunk_index), tuple(servers))
        for s in servers:
            self.server_streams[s] += 1
        self._first_start.setdefault(job_id, self.now)

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at simulated time ``when`` (now if ``when`` is past), in call order."""
        heapq.heappush(self._timers, (max(when, self.now), next(self._timer_seq), fn))

    def _fire_timers(self) -> None:
        while self._timers and self._timers[0][0] <= self.now + 1e-12:
            _, _, fn = heapq.heappop(self._timers)
            fn()

    @staticmethod
    def chunks_of(job: WriteJob, chunk_bytes: int) -> int:
        """Number of chunks a job writes."""
        return max(1, math.ceil(job.size_bytes / chunk_bytes))

    # ---- main loop
    def run(self, jobs: Sequence[WriteJob], policy: Policy, *,
            on_progress: Callable[[int, int], None] | None = None,
            max_events: int = 10_000_000) -> SimResult:
        """Simulate ``jobs`` under ``policy`` until every chunk is written.

        Raises
        ------
        SimulationError
            If the policy leaves chunks unwritten with nothing in flight, or flows starve.
        """
        t0 = time.perf_counter()
        chunk = self.network.topology.chunk_bytes
        for job in jobs:
            if job.job_id in self._jobs:
                raise SimulationError(f"duplicate job id {job.job_id}")
            self._jobs[job.job_id] = job
            self._chunks_left[job.job_id] = self.chunks_of(job, chunk)
        total_chunks = sum(self._chunks_left.values())
        done_chunks = 0
        for res, size in self._bg_specs:
            self._add_flow(res, size, None, ())
        policy.attach(self)
        order = sorted(jobs, key=lambda j: (j.submit_s, j.job_id))
        ai = 0
        events = 0
        while True:
            batch: list[WriteJob] = []
            while ai < len(order) and order[ai].submit_s <= self.now + 1e-12:
                batch.append(order[ai])
                ai += 1
            if batch:
                policy.on_submit(self.now, batch)
            self._fire_timers()
            finite = self._slot_active & np.isfinite(self._slot_rem)
            if not finite.any():
                upcoming = [order[ai].submit_s] if ai < len(order) else []
                if self._timers:
                    upcoming.append(self._timers[0][0])
                if upcoming:
                    self.now = max(self.now, min(upcoming))
                    continue
                break
            if self._dirty:
                self._flush_pairs()
                self._rate = _progressive_filling(self._pair_flow, self._pair_res, self._pair_w,
                                                  self.capacity, self._slot_active)
                self._dirty = False
            rate = self._rate
            fr = rate[finite]
            if not (fr > 0).any():
                raise SimulationError(f"t={self.now:.3f}s: every write flow is starved")
            with np.errstate(divide="ignore"):
                ttf = np.where(fr > 0, self._slot_rem[finite] / np.where(fr > 0, fr, 1), np.inf)
            dt = float(ttf.min())
            if ai < len(order):
                dt = min(dt, order[ai].submit_s - self.now)
            if self._timers:
                dt = min(dt, self._timers[0][0] - self.now)
            dt = max(dt, 0.0)
            act = self._slot_active
            self._slot_rem[act] -= rate[act] * dt
            flow_bytes = rate * dt
            wmask = act & np.isfinite(self._slot_size)
            pa = wmask[self._pair_flow]
            self.served += np.bincount(self._pair_res[pa],
                                       weights=(self._pair_w * flow_bytes[self._pair_flow])[pa],
                                       minlength=self.n_resources)
            self.now += dt
            fin = np.flatnonzero(finite & (self._slot_rem <= 1e-6 * np.maximum(self._slot_size, 1.0)))
            for slot in fin.tolist():
                tag = self._slot_tag[slot]
                assert tag is not None
                self._slot_active[slot] = False
                self._slot_rem[slot] = 0.0
                for s in self._slot_servers[slot]:
                    self.server_streams[s] -= 1
                sel = self._pair_flow == slot
                np.add.at(self.expected, self._pair_res[sel], self._pair_w[sel] * self._slot_size[slot])
                keep = ~sel  # drop the pairs now: the slot may be reused by the next flow
                self._pair_flow = self._pair_flow[keep]
                self._pair_res = self._pair_res[keep]
                self._pair_w = self._pair_w[keep]
                self._free.append(slot)
                self._slot_tag[slot] = None
                self._dirty = True
                job_id, ci = tag
                self._chunks_left[job_id] -= 1
                if self._chunks_left[job_id] == 0:
                    self._done[job_id] = self.now
                done_chunks += 1
                policy.on_chunk_done(self.now, job_id, ci)
            if len(fin) and on_progress is not None:
                on_progress(done_chunks, total_chunks)
            events += 1
            if events > max_events:
                raise SimulationError(f"more than {max_events} events")
        if done_chunks != total_chunks:
            raise SimulationError(f"policy {policy.name!r} stalled: {done_chunks} of "
                                  f"{total_chunks} chunks written, nothing in flight")
        reqs = tuple(RequestTimes(j.job_id, j.writer, j.submit_s, self._first_start[j.job_id],
                                  self._done[j.job_id]) for j in sorted(jobs, key=lambda j: j.job_id))
        first_submit = min(j.submit_s for j in jobs)
        makespan = max(r.done_s for r in reqs) - first_submit
        decisions, mspd = 0, 0.0
        coord = getattr(policy, "coordinator", None)
        if coord is not None:
            st = coord.scheduler.stats()
            decisions, mspd = st.decisions, st.ms_per_decision
        return SimResult(policy.name, reqs, makespan, events, time.perf_counter() - t0,
                         self.served.copy(), self.expected.copy(), decisions, mspd,
                         float(getattr(policy, "decision_s", 0.0)))


# --------------------------------------------------------------------------- policies
class PeacePolicy:
    """Chunks start when and where the online :class:`~peace.coordinator.Coordinator` says.

    Parameters are the coordinator's (see there), and ``charge_decisions``, what
    a scheduling decision costs in simulated time before its chunks start:
    ``True`` (default) the measured CPU time of the scheduler's call; a number,
    that many seconds per replica placement decision (RSP call), a model that
    does not depend on the machine's speed (tests); ``False`` nothing.
    ``decision_s`` sums what was charged.
    """

    def __init__(self, *, templates: Sequence[ReplicaTemplate] = RACK_AWARE,
                 advance_fraction: float = 0.8, hold_inflight: bool = False, seed: int = 0,
                 variant: str | Heuristics = "improved", name: str = "peace",
                 charge_decisions: bool | float = True) -> None:
        if not isinstance(charge_decisions, bool) and not charge_decisions >= 0:
            raise ValueError(f"charge_decisions must be a bool or seconds >= 0, "
                             f"got {charge_decisions!r}")
        self.name = name
        self.charge_decisions = charge_decisions
        self.decision_s = 0.0
        self.variant = variant
        self.templates = tuple(templates)
        self.advance_fraction = advance_fraction
        self.hold_inflight = hold_inflight
        self.seed = seed
        self.coordinator: Coordinator | None = None

    def attach(self, sim: Simulation) -> None:
        """Create a fresh coordinator on the simulation's network."""
        self.sim = sim
        self.coordinator = Coordinator(sim.network, self.templates,
                                       advance_fraction=self.advance_fraction,
                                       hold_inflight=self.hold_inflight, seed=self.seed,
                                       variant=self.variant)
        self._job_of: dict[int, int] = {}
        self._rid_of: dict[int, int] = {}
        self.decision_s = 0.0
        self._busy_until = 0.0

    def on_submit(self, now: float, jobs: Sequence[WriteJob]) -> None:
        """Submit every job, then let the coordinator schedule once."""
        assert self.coordinator is not None
        chunk = self.sim.network.topology.chunk_bytes
        for job in jobs:
            rid = self.coordinator.submit(job.writer, job.replication,
                                          Simulation.chunks_of(job, chunk), poll=False)
            self._job_of[rid] = job.job_id
            self._rid_of[job.job_id] = rid
        self._decide(now, self.coordinator.poll)

    def on_chunk_done(self, now: float, job_id: int, chunk_index: int) -> None:
        """Report the completion; start whatever the coordinator assigns next."""
        assert self.coordinator is not None
        coord = self.coordinator
        self._decide(now, lambda: coord.complete(self._rid_of[job_id], chunk_index))

    def _decide(self, now: float, call: Callable[[], list[ChunkPlacement]]) -> None:
        """Run a coordinator call; its chunks start once the decision's time has passed.

        The coordinator decides one thing at a time: a decision due while an earlier one
        still runs (in simulated time) starts when that one ends.
        """
        assert self.coordinator is not None
        sched = self.coordinator.scheduler
        before = sched.stats()
        placements = call()
        after = sched.stats()
        if isinstance(self.charge_decisions, bool):
            spent = after.decision_cpu_s - before.decision_cpu_s if self.charge_decisions else 0.0
        else:
            spent = float(self.charge_decisions) * (after.decisions - before.decisions)
        if spent > 0.0:
            self._busy_until = max(now, self._busy_until) + spent
            self.decision_s += spent
        if not placements:
            return
        if self._busy_until <= now:
            self._start(placements)
        else:
            self.sim.call_at(self._busy_until, lambda: self._start(placements))

    def _start(self, placements: Sequence[ChunkPlacement]) -> None:
        net = self.sim.network
        link = net.link_of_edge
        for pl in placements:
            servers = [net.server_index[s] for s in pl.servers]
            self.sim.start_chunk(self._job_of[pl.request_id], pl.chunk_index, servers,
                                 [e for e in pl.edge_ids if e in link])


class BaselinePolicy:
    """HDFS default or random placement; optional admission cap ("admission only").

    Parameters
    ----------
    placement
        ``"hdfs"`` (:func:`~peace.baselines.hdfs_placement`) or ``"random"``.
    streams_per_writer
        Concurrent chunk pipelines per request (IOService worker threads).
    max_active_requests
        At most this many requests write at once, FIFO (``None``: no admission control).
    consider_load
        HDFS ``considerLoad``: skip servers with more than 2x the mean active streams.
    """

    def __init__(self, placement: str = "hdfs", *, streams_per_writer: int = 1,
                 max_active_requests: int | None = None, consider_load: bool = True,
                 seed: int = 0, name: str | None = None) -> None:
        if placement not in ("hdfs", "random"):
            raise ValueError(f"unknown placement {placement!r}")
        if streams_per_writer < 1:
            raise ValueError("streams_per_writer must be >= 1")
        self.placement = placement
        self.streams = streams_per_writer
        self.max_active = max_active_requests
        self.consider_load = consider_load
        self.seed = seed
        self.name = name or placement

    def attach(self, sim: Simulation) -> None:
        """Reset state for a new run."""
        self.sim = sim
        self.rng = np.random.default_rng(self.seed)
        self.router = Router(sim.network, self.rng)
        self._queue: list[WriteJob] = []
        self._next: dict[int, int] = {}
        self._total: dict[int, int] = {}
        self._left: dict[int, int] = {}
        self._jobs: dict[int, WriteJob] = {}
        self._active = 0

    def on_submit(self, now: float, jobs: Sequence[WriteJob]) -> None:
        """Queue the jobs and admit what the cap allows."""
        self._queue.extend(jobs)
        self._admit()

    def _admit(self) -> None:
        chunk = self.sim.network.topology.chunk_bytes
        while self._queue and (self.max_active is None or self._active < self.max_active):
            job = self._queue.pop(0)
            self._jobs[job.job_id] = job
            k = Simulation.chunks_of(job, chunk)
            self._total[job.job_id] = k
            self._left[job.job_id] = k
            self._next[job.job_id] = 0
            self._active += 1
            for _ in range(min(self.streams, k)):
                self._start_next(job.job_id)

    def _start_next(self, job_id: int) -> None:
        i = self._next[job_id]
        if i >= self._total[job_id]:
            return
        self._next[job_id] = i + 1
        job = self._jobs[job_id]
        net = self.sim.network
        w = net.index(job.writer)
        load = self.sim.server_streams if self.consider_load else None
        place = hdfs_placement if self.placement == "hdfs" else random_placement
        replicas = place(net, w, job.replication, self.rng, load=load)
        servers = (w, *replicas)
        self.sim.start_chunk(job_id, i, servers, self.router.chain_switch_edges(servers))

    def on_chunk_done(self, now: float, job_id: int, chunk_index: int) -> None:
        """Start the job's next chunk on the freed stream; admit the next job when done."""
        self._left[job_id] -= 1
        self._start_next(job_id)
        if self._left[job_id] == 0:
            self._active -= 1
            self._admit()


#: Peace policy name -> scheduler variant (see :data:`peace.scheduler.VARIANTS`)
PEACE_VARIANTS: dict[str, str | Heuristics] = {
    "peace": "improved",
    "peace-paper": "paper",
    "peace-fill": Heuristics(whole_requests=False),
    "peace-mcf": "mcf",
}
POLICIES = (*PEACE_VARIANTS, "hdfs", "hdfs-fair", "random", "admission")
PeacePolicyOrBaseline: TypeAlias = "PeacePolicy | BaselinePolicy"


def make_policy(name: str, *, seed: int = 0, streams_per_writer: int = 1,
                admission_cap: int = 4, advance_fraction: float = 0.8,
                hold_inflight: bool = False, fair_streams: int = 2,
                charge_decisions: bool | float = True) -> PeacePolicyOrBaseline:
    """A policy by name (see :data:`POLICIES`).

    ``peace`` is the improved scheduler, ``peace-paper`` Algorithm 1 as
    published, ``peace-mcf`` the min-cost-flow variant (:mod:`peace.mcf`),
    ``peace-fill`` the improved one without the whole-requests rule
    (a request may start below its full rate: fuller timesteps, shorter
    makespan, longer service times); ``hdfs`` (``streams_per_writer``
    pipelines per writer, 1 by default), ``hdfs-fair`` (HDFS default placement
    with ``fair_streams`` pipelines per writer: the same per-writer
    concurrency as Peace, whose writers send at most their SND->UP capacity
    of chunks at once), ``random``, ``admission`` are the baselines.
    ``charge_decisions``: see :class:`PeacePolicy` (Peace policies only).

    Raises
    ------
    ValueError
        For an unknown name.
    """
    if name in PEACE_VARIANTS:
        return PeacePolicy(seed=seed, advance_fraction=advance_fraction,
                           hold_inflight=hold_inflight, variant=PEACE_VARIANTS[name], name=name,
                           charge_decisions=charge_decisions)
    if name == "hdfs":
        return BaselinePolicy("hdfs", streams_per_writer=streams_per_writer, seed=seed)
    if name == "hdfs-fair":
        return BaselinePolicy("hdfs", streams_per_writer=fair_streams, seed=seed, name="hdfs-fair")
    if name == "random":
        return BaselinePolicy("random", streams_per_writer=streams_per_writer, seed=seed)
    if name == "admission":
        return BaselinePolicy("hdfs", streams_per_writer=streams_per_writer, seed=seed,
                              max_active_requests=admission_cap, name="admission")
    raise ValueError(f"unknown policy {name!r}; choose from {POLICIES}")


def spread_writers(topology: Topology, n: int) -> list[str]:
    """``n`` writer names taken round-robin across racks (deterministic).

    Raises
    ------
    ValueError
        If ``n`` exceeds the number of servers.
    """
    if not 0 < n <= len(topology.servers):
        raise ValueError(f"cannot pick {n} writers among {len(topology.servers)} servers")
    out: list[str] = []
    i = 0
    while len(out) < n:
        for rack in topology.racks:
            if i < len(rack.servers) and len(out) < n:
                out.append(rack.servers[i])
        i += 1
    return out


def make_jobs(topology: Topology, writers: int, size_bytes: int, *, replication: int = 3,
              arrival_spread_s: float = 0.0, seed: int = 0) -> list[WriteJob]:
    """``writers`` jobs of ``size_bytes`` each, all at t=0 or uniformly spread over a window."""
    rng = np.random.default_rng(seed)
    names = spread_writers(topology, writers)
    times = (np.sort(rng.uniform(0, arrival_spread_s, writers)) if arrival_spread_s > 0
             else np.zeros(writers))
    return [WriteJob(i, w, size_bytes, float(t), replication) for i, (w, t) in
            enumerate(zip(names, times))]


def simulate(topology: Topology | Network, jobs: Sequence[WriteJob], policy: Policy | str, *,
             background: BackgroundTraffic | None = None, seed: int = 0,
             on_progress: Callable[[int, int], None] | None = None) -> SimResult:
    """Run one simulation; ``policy`` may be a name (see :func:`make_policy`).

    Examples
    --------
    >>> from peace.model import paper_topology
    >>> t = paper_topology()
    >>> r = simulate(t, make_jobs(t, 2, 128 * MB), "hdfs")
    >>> len(r.requests), r.makespan_s > 0
    (2, True)
    """
    pol = make_policy(policy, seed=seed) if isinstance(policy, str) else policy
    return Simulation(topology, background=background).run(jobs, pol, on_progress=on_progress)
