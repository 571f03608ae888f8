"""The online Peace coordinator (end of paper §5).

Writers submit requests ``(w, r, k)`` at any time. The coordinator runs
Algorithm 1 (the improved variant by default, ``variant="paper"`` for the
published one; see :mod:`peace.scheduler`) once per timestep over the pending
requests (oldest first), tells
each writer through its callback when (timestep) and where (pipeline) each chunk
goes, and tracks completions. A timestep ends once ``advance_fraction``
(default 0.8, as in §6.2) of *its* chunk writes have completed; the next one is
then scheduled on the residual network: full capacity minus what the chunks
still in flight hold (``hold_inflight=True``) or full capacity (``False``, the
default and the paper's literal reading: the straggling 20 % overlap the next
timestep, which keeps the network busy; in simulation it gives both shorter
service times and a shorter makespan).

Requests that arrive while a timestep runs are not left waiting for the next
one if the current timestep still has capacity (``fill_on_submit``, default
on): they are scheduled at once into what is left of the current timestep's
residual (stamped with its index and counted by its advance rule), so a
timestep begun by the first of several near-simultaneous checkpoints does not
leave the network idle until its chunks are 80 % done. Older waiting requests
are not retried there (the residual only shrank since they were refused).

``work_conserving=True`` drops the timestep barrier: chunks in flight hold
their capacity (as with ``hold_inflight``) and every completion schedules the
pending requests at once into what it freed, so no capacity stays idle while a
request waits (each decision is then a timestep of its own). This suits a live
system whose chunk times vary; the 80 % rule of the paper waits for
stragglers. A request that cannot be taken now
(the queue is at ``max_pending_requests``) gets :class:`CannotScheduleNowError`
so the writer cancels its checkpoint and retries.

Thread-safe: one lock guards the state; callbacks run outside it, so a callback
may call :meth:`Coordinator.complete`. For writers in other processes see
:mod:`peace.service`.

Which capacity rule a schedule keeps is the validator's definition
(:func:`peace.validate.validate_schedule`): with ``hold_inflight`` (or
``work_conserving``) the chunks in flight never exceed any edge's capacity, at
any moment; without it each timestep's chunks, fills included, fit the capacity
together. :meth:`Coordinator.log` is the history that
:meth:`Coordinator.certify` checks against that rule.

Invariants (checked by :meth:`Coordinator._check`): every in-flight chunk was
assigned in a timestep ``<= timestep``; the held usage equals the sum of the
in-flight chunks' edges and never exceeds capacity when ``hold_inflight``;
a request is DONE exactly when all its chunks completed; the history certifies.
"""
from __future__ import annotations

import enum
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from peace.errors import (CannotScheduleNowError, CoordinatorStateError, ScheduleInfeasibleError,
                          UnknownRequestError)
from peace.model import Network, Topology, build_network
from peace.placement import (RACK_AWARE, ChunkPlacement, ChunkRelease, ReplicaTemplate,
                             WriteRequest)
from peace.scheduler import Heuristics
from peace.validate import ScheduleReport, validate_schedule
from peace.variants import make_scheduler

__all__ = ["RequestState", "RequestStatus", "CoordinatorStats", "Coordinator"]

logger = logging.getLogger(__name__)

RequestState = enum.Enum("RequestState", "QUEUED ACTIVE DONE FAILED")
"""QUEUED: no chunk assigned yet; ACTIVE: some assigned; DONE: all completed; FAILED: dropped."""

AssignCallback = Callable[[ChunkPlacement], None]
FailCallback = Callable[[int, Exception], None]


@dataclass(frozen=True, slots=True)
class RequestStatus:
    """A snapshot of one request's progress."""

    request_id: int
    writer: str
    replication: int
    chunks: int
    assigned: int
    completed: int
    state: RequestState


@dataclass(frozen=True, slots=True)
class CoordinatorStats:
    """Counters of a :class:`Coordinator`."""

    timestep: int
    """Index of the current timestep (-1 before the first)."""
    pending_requests: int
    in_flight_chunks: int
    completed_chunks: int
    rejected_requests: int
    decisions: int
    ms_per_decision: float


class _Record:
    """Mutable bookkeeping of one request (private)."""

    __slots__ = ("request", "state", "assigned", "completed", "on_assign", "on_fail")

    def __init__(self, request: WriteRequest, on_assign: AssignCallback | None,
                 on_fail: FailCallback | None) -> None:
        self.request = request
        self.state = RequestState.QUEUED
        self.assigned = 0
        self.completed = 0
        self.on_assign = on_assign
        self.on_fail = on_fail


class Coordinator:
    """Online Peace scheduling of DFS chunk writes.

    Parameters
    ----------
    topology
        The cluster (a :class:`~peace.model.Topology` or compiled network).
    templates
        Replica constraint templates (default :data:`~peace.scheduler.RACK_AWARE`).
    advance_fraction
        Fraction of a timestep's chunk writes that must complete before the
        next timestep is scheduled; in ``(0, 1]``.
    hold_inflight
        Whether chunks still in flight keep their capacity in the next timestep.
    max_pending_requests
        Reject submissions with :class:`CannotScheduleNowError` while this many
        requests wait for their first chunk (``None``: never reject).
    seed
        Seed of the randomized shortest paths.
    work_conserving
        Schedule on every completion into the capacity not held by chunks in
        flight (implies ``hold_inflight``; ``advance_fraction`` is then unused).
    method, variant, lookahead
        Passed to :class:`~peace.scheduler.PeaceScheduler`: ``variant="improved"``
        (default), ``"paper"`` (Algorithm 1 as published) or ``"mcf"`` (:mod:`peace.mcf`).

    Raises
    ------
    ValueError
        If ``advance_fraction`` is outside ``(0, 1]``.

    Examples
    --------
    >>> from peace.model import figure5_topology
    >>> c = Coordinator(figure5_topology(), seed=0)
    >>> got = []
    >>> rid = c.submit("svr1.1", 2, 1, on_assign=got.append)
    >>> got[0].servers[:2], c.stats().timestep
    (('svr1.1', 'svr1.2'), 0)
    >>> _ = c.complete(rid, 0); c.status(rid).state.name
    'DONE'
    """

    def __init__(self, topology: Topology | Network,
                 templates: Sequence[ReplicaTemplate] = RACK_AWARE, *,
                 advance_fraction: float = 0.8, hold_inflight: bool = False,
                 max_pending_requests: int | None = None,
                 seed: int | np.random.Generator | None = None,
                 method: Literal["fast", "networkx"] = "fast",
                 variant: str | Heuristics = "improved", lookahead: bool | None = None,
                 fill_on_submit: bool = True, work_conserving: bool = False) -> None:
        if not 0.0 < advance_fraction <= 1.0:
            raise ValueError(f"advance_fraction must be in (0, 1], got {advance_fraction}")
        if max_pending_requests is not None and max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {max_pending_requests}")
        self.network = topology if isinstance(topology, Network) else build_network(topology)
        self.templates = tuple(templates)
        self.scheduler = make_scheduler(self.network, templates, seed=seed,
                                        method=method, variant=variant, lookahead=lookahead)
        self.advance_fraction = advance_fraction
        self.work_conserving = bool(work_conserving)
        self.hold_inflight = hold_inflight or self.work_conserving
        self.max_pending_requests = max_pending_requests
        self.fill_on_submit = fill_on_submit
        self._lock = threading.RLock()
        self._records: dict[int, _Record] = {}
        self._next_id = 0
        self._pending: list[WriteRequest] = []
        self._fresh: set[int] = set()
        """Ids of requests submitted since the last scheduling decision."""
        self._residual: npt.NDArray[np.int64] | None = None
        """What is left of the current timestep's capacity (``hold_inflight=False``)."""
        self._inflight: dict[tuple[int, int], ChunkPlacement] = {}
        self._held = np.zeros(self.network.n_edges, dtype=np.int64)
        self._timestep = -1
        self._ts_scheduled = 0
        self._ts_done = 0
        self._completed_chunks = 0
        self._rejected = 0
        self._feasible_cache: set[tuple[str, int]] = set()
        self._history: list[ChunkPlacement] = []
        self._log: list[ChunkPlacement | ChunkRelease] = []

    # ------------------------------------------------------------------ API
    def submit(self, writer: str, replication: int, chunks: int, *,
               on_assign: AssignCallback | None = None, on_fail: FailCallback | None = None,
               poll: bool = True) -> int:
        """Queue a write request; returns its request id.

        Parameters
        ----------
        on_assign
            Called once per chunk with its :class:`~peace.scheduler.ChunkPlacement`
            (when: ``timestep``; where: ``servers``), outside the coordinator's lock.
        on_fail
            Called with ``(request_id, error)`` if the request is dropped.
        poll
            Schedule right away if a timestep can start (``False`` batches
            several submissions before one :meth:`poll`).

        Raises
        ------
        InvalidRequestError
            If ``replication`` or ``chunks`` is not a positive integer.
        UnknownServerError
            If ``writer`` is not a server of the topology.
        InfeasibleRequestError
            If no placement can ever satisfy the templates (``r`` too large...).
        CannotScheduleNowError
            If ``max_pending_requests`` requests already wait: cancel and retry.
        """
        with self._lock:
            req = WriteRequest(writer, replication, chunks, self._next_id)
            key = (writer, replication)
            if key not in self._feasible_cache:
                self.scheduler.check_request(req)
                self._feasible_cache.add(key)
            waiting = sum(1 for r in self._pending
                          if self._records[r.request_id].state is RequestState.QUEUED)
            if self.max_pending_requests is not None and waiting >= self.max_pending_requests:
                self._rejected += 1
                raise CannotScheduleNowError(
                    f"cannot schedule a write from {writer!r} now: {waiting} requests already "
                    f"wait (max {self.max_pending_requests}); cancel the checkpoint and retry",
                    retry_after_s=0.0)
            self._next_id += 1
            self._records[req.request_id] = _Record(req, on_assign, on_fail)
            self._pending.append(req)
            self._fresh.add(req.request_id)
            logger.debug("request %d from %s: r=%d k=%d queued", req.request_id, writer,
                         replication, chunks)
        if poll:
            self.poll()
        return req.request_id

    def poll(self) -> list[ChunkPlacement]:
        """Start the next timestep if the current one reached ``advance_fraction``.

        Returns
        -------
        list of ChunkPlacement
            The chunks assigned now (also delivered through the callbacks).
        """
        fired: list[tuple[_Record, ChunkPlacement]] = []
        failed: list[tuple[_Record, Exception]] = []
        with self._lock:
            placements = self._advance_locked(fired, failed)
        self._fire(fired, failed)
        return placements

    def complete(self, request_id: int, chunk_index: int) -> list[ChunkPlacement]:
        """Record that a chunk's pipeline finished; may start the next timestep.

        Returns
        -------
        list of ChunkPlacement
            Chunks assigned as a consequence (see :meth:`poll`).

        Raises
        ------
        UnknownRequestError
            If the request id or chunk index was never issued.
        CoordinatorStateError
            If that chunk is not in flight (not assigned yet, or completed already).
        """
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None:
                raise UnknownRequestError(f"unknown request id {request_id}")
            req = rec.request
            if not 0 <= chunk_index < req.chunks:
                raise UnknownRequestError(
                    f"request {request_id} has chunks 0..{req.chunks - 1}, not {chunk_index}")
            pl = self._inflight.pop((request_id, chunk_index), None)
            if pl is None:
                raise CoordinatorStateError(
                    f"request {request_id} chunk {chunk_index} is not in flight "
                    f"(state {rec.state.name}, {rec.completed} of {req.chunks} completed)")
            for e in pl.edge_ids:
                self._held[e] -= 1
            self._log.append(ChunkRelease(request_id, chunk_index))
            if pl.timestep == self._timestep:
                self._ts_done += 1
            rec.completed += 1
            self._completed_chunks += 1
            if rec.completed == req.chunks:
                rec.state = RequestState.DONE
                logger.debug("request %d done", request_id)
        return self.poll()

    def abandon(self, request_id: int) -> list[ChunkPlacement]:
        """Drop a request whose writer went away: its queued chunks are forgotten and its
        in-flight chunks release their capacity and count as finished for the timestep rule
        (a dead writer must not stall everybody else). No-op for a finished request.

        Returns
        -------
        list of ChunkPlacement
            Chunks assigned as a consequence (see :meth:`poll`).

        Raises
        ------
        UnknownRequestError
            If the request id was never issued.
        """
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None:
                raise UnknownRequestError(f"unknown request id {request_id}")
            if rec.state in (RequestState.DONE, RequestState.FAILED):
                return []
            self._pending = [q for q in self._pending if q.request_id != request_id]
            for key in [k for k in self._inflight if k[0] == request_id]:
                pl = self._inflight.pop(key)
                for e in pl.edge_ids:
                    self._held[e] -= 1
                self._log.append(ChunkRelease(*key))
                if pl.timestep == self._timestep:
                    self._ts_done += 1
            rec.state = RequestState.FAILED
            logger.warning("request %d from %s abandoned (%d of %d chunks completed)", request_id,
                           rec.request.writer, rec.completed, rec.request.chunks)
        return self.poll()

    def status(self, request_id: int) -> RequestStatus:
        """Progress of one request.

        Raises
        ------
        UnknownRequestError
            If the id was never issued.
        """
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None:
                raise UnknownRequestError(f"unknown request id {request_id}")
            r = rec.request
            return RequestStatus(r.request_id, r.writer, r.replication, r.chunks, rec.assigned,
                                 rec.completed, rec.state)

    def stats(self) -> CoordinatorStats:
        """Counters: timestep, queue, in flight, completed, rejected, decisions."""
        with self._lock:
            s = self.scheduler.stats()
            return CoordinatorStats(self._timestep, len(self._pending), len(self._inflight),
                                    self._completed_chunks, self._rejected, s.decisions,
                                    s.ms_per_decision)

    @property
    def timestep(self) -> int:
        """Index of the current timestep (-1 before the first)."""
        return self._timestep

    def history(self) -> list[ChunkPlacement]:
        """Every chunk placement ever assigned, in order (a certificate for the validator)."""
        with self._lock:
            return list(self._history)

    def log(self) -> list[ChunkPlacement | ChunkRelease]:
        """Every placement and every release (a completion, or an abandoned request's chunk
        in flight), in the order they happened: the history `certify` checks."""
        with self._lock:
            return list(self._log)

    def certify(self, *, complete: bool = False) -> ScheduleReport:
        """Check the history so far with :func:`peace.validate.validate_schedule` under this
        coordinator's capacity rule (``hold_inflight``) and templates.

        Parameters
        ----------
        complete
            Also require every chunk of every request to be placed (fails for a request
            that was abandoned or dropped).

        Raises
        ------
        InvalidScheduleError
            If the history breaks the rule (a coordinator bug).

        Notes
        -----
        Runtime complexity: O(history * hop length + edges * timesteps).
        """
        with self._lock:
            log, reqs = list(self._log), [rec.request for rec in self._records.values()]
        return validate_schedule(self.network, reqs, log, self.templates, complete=complete,
                                 hold_inflight=self.hold_inflight)

    def requests(self) -> list[WriteRequest]:
        """Every accepted request, as submitted."""
        with self._lock:
            return [rec.request for rec in self._records.values()]

    def in_flight(self) -> list[ChunkPlacement]:
        """Chunks assigned but not completed, oldest timestep first."""
        with self._lock:
            return sorted(self._inflight.values(), key=lambda p: (p.timestep, p.request_id,
                                                                  p.chunk_index))

    # ------------------------------------------------------------- internals
    def _can_advance(self) -> bool:
        if self.work_conserving or self._timestep < 0 or self._ts_scheduled == 0:
            return True
        return self._ts_done >= math.ceil(self.advance_fraction * self._ts_scheduled - 1e-9)

    def _advance_locked(self, fired: list[tuple[_Record, ChunkPlacement]],
                        failed: list[tuple[_Record, Exception]]) -> list[ChunkPlacement]:
        if not self._pending:
            return []
        if not self._can_advance():
            return self._fill_locked(fired)
        attempts = 1 if self._inflight else 16
        plan = None
        for _ in range(attempts):
            if self.hold_inflight:
                residual = self.network.new_residual() - self._held
                base, n_base = self._held, len(self._inflight)
            else:
                residual = self.network.new_residual()
                base, n_base = None, 0
            plan = self.scheduler.schedule_timestep(self._pending, residual, self._timestep + 1,
                                                    base_chunks=n_base, base=base)
            if plan.placements:
                break
        assert plan is not None
        if not plan.placements:
            if not self._inflight:  # nothing will ever free capacity: drop the head request
                head = self._pending.pop(0)
                rec = self._records[head.request_id]
                rec.state = RequestState.FAILED
                err = ScheduleInfeasibleError(
                    f"request {head.request_id} from {head.writer!r}: no chunk placeable on the "
                    f"empty network after {attempts} randomized attempts")
                failed.append((rec, err))
                logger.warning("%s", err)
                return self._advance_locked(fired, failed)
            return []
        self._timestep += 1
        self._ts_scheduled = len(plan.placements)
        self._ts_done = 0
        self._pending = list(plan.deferred)
        self._residual = residual
        self._fresh.clear()
        self._assign_locked(plan.placements, fired)
        logger.info("timestep %d: %d chunks scheduled, %d requests deferred", self._timestep,
                    len(plan.placements), len(plan.deferred))
        return list(plan.placements)

    def _fill_locked(self, fired: list[tuple[_Record, ChunkPlacement]]) -> list[ChunkPlacement]:
        """Schedule requests submitted since the last decision into the current timestep."""
        fresh = [q for q in self._pending if q.request_id in self._fresh]
        self._fresh.clear()
        if not fresh or not self.fill_on_submit or self._timestep < 0:
            return []
        if self.hold_inflight:
            residual = self.network.new_residual() - self._held
        else:
            assert self._residual is not None
            residual = self._residual
        used = self.network.capacity - residual
        plan = self.scheduler.schedule_timestep(fresh, residual, self._timestep,
                                                base_chunks=self._chunks_running(), base=used)
        if not plan.placements:
            return []
        fresh_ids = {q.request_id for q in fresh}
        left = {q.request_id: q for q in plan.deferred}
        self._pending = [left.get(q.request_id, q) for q in self._pending
                         if q.request_id not in fresh_ids or q.request_id in left]
        self._ts_scheduled += len(plan.placements)
        self._assign_locked(plan.placements, fired)
        logger.info("timestep %d: %d more chunks for requests that arrived during it",
                    self._timestep, len(plan.placements))
        return list(plan.placements)

    def _chunks_running(self) -> int:
        """Chunks that share the capacity a new placement of this timestep would join."""
        return len(self._inflight) if self.hold_inflight else self._ts_scheduled

    def _assign_locked(self, placements: Sequence[ChunkPlacement],
                       fired: list[tuple[_Record, ChunkPlacement]]) -> None:
        self._history.extend(placements)
        self._log.extend(placements)
        for pl in placements:
            self._inflight[(pl.request_id, pl.chunk_index)] = pl
            for e in pl.edge_ids:
                self._held[e] += 1
            rec = self._records[pl.request_id]
            rec.assigned += 1
            rec.state = RequestState.ACTIVE
            fired.append((rec, pl))

    @staticmethod
    def _fire(fired: list[tuple[_Record, ChunkPlacement]],
              failed: list[tuple[_Record, Exception]]) -> None:
        for rec, pl in fired:
            if rec.on_assign is not None:
                rec.on_assign(pl)
        for rec, err in failed:
            if rec.on_fail is not None:
                rec.on_fail(rec.request.request_id, err)

    def _check(self) -> None:
        """Assert every invariant (O(in flight * hop length + edges))."""
        with self._lock:
            held = np.zeros_like(self._held)
            for (rid, c), pl in self._inflight.items():
                assert pl.request_id == rid and pl.chunk_index == c
                assert pl.timestep <= self._timestep
                for e in pl.edge_ids:
                    held[e] += 1
            assert np.array_equal(held, self._held)
            if self.hold_inflight:
                assert (self._held <= self.network.capacity).all()
            assert 0 <= self._ts_done <= self._ts_scheduled
            for rid, rec in self._records.items():
                assert (rec.state is RequestState.DONE) == (rec.completed == rec.request.chunks)
                if rec.state is RequestState.FAILED:
                    assert all(k[0] != rid for k in self._inflight)
                assert rec.completed <= rec.assigned <= rec.request.chunks
            self.certify()

