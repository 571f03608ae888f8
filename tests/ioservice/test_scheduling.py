"""The write-scheduler protocol in the checkpoint path (ioservice.scheduling).

The schedulers here are small but complete implementations of the protocol
(ioservice never imports peace; the Peace coordinator is tested through
``sguard.scheduling`` in tests/sguard/test_scheduling.py).
"""
from __future__ import annotations

import logging
import threading
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

import pytest

from ioservice import CheckpointManager
from ioservice.scheduling import (ChunkGrant, UnknownSchedulerError, WriteIntent, WriteScheduler,
                                  register_scheme, resolve_scheduler)
from mmm.manager import PageManager
from tests.ioservice.ckpt_helpers import PAGE_BYTES, mutate, new_pm, open_structures, state_of


class SlotScheduler:
    """Admission with ``slots`` chunks in flight over all writers, FIFO by request."""

    # the limits after which the writer falls back to unscheduled writes are hang guards
    # here (a test that asserts no fallback must not depend on the machine's load)
    def __init__(self, slots: int, chunk_bytes: int = 4 * PAGE_BYTES, *, timeout_s: float = 600.0,
                 max_wait_s: float = 600.0) -> None:
        self.slots, self.chunk_bytes = slots, chunk_bytes
        self.timeout_s, self.max_wait_s = timeout_s, max_wait_s
        self.cond = threading.Condition()
        self.queue: list[list[int]] = []  # per request: chunks not granted yet
        self.inflight = 0
        self.max_inflight = 0
        self.granted = 0
        self.done = 0
        self.intents: list[WriteIntent] = []

    def begin(self, intent: WriteIntent) -> SlotWrite:
        with self.cond:
            self.intents.append(intent)
            todo = list(range(intent.n_chunks))
            self.queue.append(todo)
        return SlotWrite(self, todo)


class SlotWrite:
    def __init__(self, owner: SlotScheduler, todo: list[int]) -> None:
        self.owner, self.todo = owner, todo

    def next_grants(self, timeout_s: float) -> Sequence[ChunkGrant]:
        o = self.owner
        with o.cond:
            o.cond.wait_for(lambda: not self.todo or (o.inflight < o.slots
                                                      and o.queue and o.queue[0] is self.todo),
                            timeout_s)
            out = []
            while self.todo and o.inflight < o.slots and o.queue and o.queue[0] is self.todo:
                out.append(ChunkGrant(self.todo.pop(0), ("me", "a", "b")))
                o.inflight += 1
                o.granted += 1
                o.max_inflight = max(o.max_inflight, o.inflight)
            if not self.todo and o.queue and o.queue[0] is self.todo:
                o.queue.pop(0)
                o.cond.notify_all()
            return out

    def chunk_done(self, chunk_index: int) -> None:
        o = self.owner
        with o.cond:
            o.inflight -= 1
            o.done += 1
            o.cond.notify_all()

    def close(self) -> None:
        pass


class HandoverScheduler(SlotScheduler):
    """`SlotScheduler` whose completion reports answer with the request's next grant."""

    def __init__(self, slots: int) -> None:
        super().__init__(slots)
        self.handed = 0

    def begin(self, intent: WriteIntent) -> HandoverWrite:
        with self.cond:
            self.intents.append(intent)
            todo = list(range(intent.n_chunks))
            self.queue.append(todo)
        return HandoverWrite(self, todo)


class HandoverWrite(SlotWrite):
    def chunk_done(self, chunk_index: int) -> Sequence[ChunkGrant]:
        o = self.owner
        assert isinstance(o, HandoverScheduler)
        with o.cond:  # one hold (the lock is reentrant): the freed slot goes to the report,
            super().chunk_done(chunk_index)  # never to a dispatcher woken in between
            if not (self.todo and o.inflight < o.slots and o.queue and o.queue[0] is self.todo):
                return []
            o.inflight += 1
            o.granted += 1
            o.handed += 1
            o.max_inflight = max(o.max_inflight, o.inflight)
            grant = ChunkGrant(self.todo.pop(0), ("me",))
            if not self.todo:
                o.queue.pop(0)
                o.cond.notify_all()
            return [grant]


def test_grants_returned_by_a_completion_report_start_once(tmp_path: Path) -> None:
    """A scheduler may answer a chunk's report with the next grant: that chunk starts from
    the report (not again from the dispatcher), the slot limit holds, the checkpoint is whole."""
    sched = HandoverScheduler(slots=1)  # one chunk at a time: each report hands the next one
    pm = new_pm()
    s = open_structures(pm)
    for step in range(4):
        mutate(s, step)
    with CheckpointManager(pm, str(tmp_path), "p0", scheduler=sched) as mgr:
        p = mgr.checkpoint()
        assert p is not None
        man = p.result(600)
        state = state_of(s)
    n = sched.intents[0].n_chunks
    assert n >= 3 and len(man.files) == n
    assert sched.handed == n - 1  # every chunk after the first came with a report
    assert sched.max_inflight == 1 and sched.granted == sched.done == n
    assert sorted(g.chunk_index for g in p.grants) == list(range(n))
    assert p.fallback is None
    assert _restored_state(str(tmp_path), "p0") == state


def _restored_state(root: str, haunit: str) -> dict[str, str]:
    pm = new_pm()
    with CheckpointManager(pm, root, haunit) as mgr:
        assert mgr.restore() is not None
        return state_of(open_structures(pm))


def test_chunks_start_only_when_granted_across_concurrent_writers(tmp_path: Path) -> None:
    """Four HA units checkpoint at once through 3 slots: never more than 3 chunks in flight,
    every chunk granted and reported, each checkpoint one file per chunk, restorable."""
    sched = SlotScheduler(slots=3)
    assert isinstance(sched, WriteScheduler)
    root = str(tmp_path)
    states: dict[str, dict[str, str]] = {}
    errors: list[BaseException] = []

    def partition(i: int) -> None:
        try:
            pm = new_pm()
            s = open_structures(pm)
            for step in range(3):
                mutate(s, 10 * i + step)
            with CheckpointManager(pm, root, f"p{i}", scheduler=sched) as mgr:
                p = mgr.checkpoint()
                assert p is not None
                man = p.result(600)
                states[f"p{i}"] = state_of(s)
                assert p.scheduled and p.fallback is None
                assert len(man.files) == len(p.grants) >= 2
                assert sorted(g.chunk_index for g in p.grants) == list(range(len(man.files)))
                assert mgr.schedule_counters == {"scheduled": 1, "unscheduled_fallbacks": 0}
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=partition, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert 1 <= sched.max_inflight <= 3
    assert sched.granted == sched.done == sum(i.n_chunks for i in sched.intents)
    assert all(i.chunk_bytes == 4 * PAGE_BYTES for i in sched.intents)
    for haunit, state in states.items():
        assert _restored_state(root, haunit) == state


class FailingBegin(SlotScheduler):
    def begin(self, intent: WriteIntent) -> SlotWrite:
        raise ConnectionRefusedError("scheduler is down")


def test_unreachable_scheduler_falls_back_and_logs(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """begin() raising: the checkpoint is written unscheduled, committed, logged and counted."""
    pm = new_pm()
    s = open_structures(pm)
    mutate(s, 1)
    with caplog.at_level(logging.WARNING, logger="ioservice.service"):
        with CheckpointManager(pm, str(tmp_path), "u", scheduler=FailingBegin(1)) as mgr:
            p = mgr.checkpoint()
            assert p is not None
            p.result(600)
            assert p.fallback is not None and "scheduler is down" in p.fallback
            assert mgr.schedule_counters["unscheduled_fallbacks"] == 1
    assert "write scheduler unavailable" in caplog.text
    assert _restored_state(str(tmp_path), "u") == state_of(s)


class HungScheduler(SlotScheduler):
    """Grants nothing and never returns from next_grants until released."""

    def __init__(self) -> None:
        super().__init__(1, timeout_s=0.2)
        self.release = threading.Event()
        self.entered = threading.Event()

    def begin(self, intent: WriteIntent) -> HungWrite:
        return HungWrite(self)


class HungWrite:
    def __init__(self, owner: HungScheduler) -> None:
        self.owner = owner

    def next_grants(self, timeout_s: float) -> Sequence[ChunkGrant]:
        self.owner.entered.set()
        self.owner.release.wait()
        return []

    def chunk_done(self, chunk_index: int) -> None:
        raise AssertionError("no chunk was granted")

    def close(self) -> None:
        pass


def test_hung_scheduler_never_blocks_the_operator_nor_loses_the_checkpoint(tmp_path: Path) -> None:
    """A scheduler call that never returns: checkpoint() returns at once, the watchdog
    writes everything unscheduled, the checkpoint commits while the call still hangs."""
    sched = HungScheduler()
    pm = new_pm()
    s = open_structures(pm)
    mutate(s, 2)
    try:
        with CheckpointManager(pm, str(tmp_path), "h", scheduler=sched) as mgr:
            p = mgr.checkpoint()
            assert p is not None and not sched.release.is_set()
            man = p.result(600)
            assert not sched.release.is_set()  # committed while the scheduler still hangs
            assert sched.entered.is_set() and p.grants == ()
            assert p.fallback is not None and "did not return" in p.fallback
            assert man.n_pages == p.n_pages
    finally:
        sched.release.set()
    assert _restored_state(str(tmp_path), "h") == state_of(s)


class BreaksAfterFirst(SlotScheduler):
    """Reporting a finished chunk fails (the scheduler died mid-write)."""

    def begin(self, intent: WriteIntent) -> SlotWrite:
        w = super().begin(intent)

        def boom(chunk_index: int) -> None:
            raise BrokenPipeError("scheduler went away")

        w.chunk_done = boom  # type: ignore[method-assign]
        return w


def test_scheduler_dying_mid_write_writes_the_rest_unscheduled(tmp_path: Path) -> None:
    """One slot; the first chunk's report fails: the remaining chunks start unscheduled."""
    sched = BreaksAfterFirst(1)
    pm = new_pm()
    s = open_structures(pm)
    for step in range(3):
        mutate(s, step)
    with CheckpointManager(pm, str(tmp_path), "d", scheduler=sched) as mgr:
        p = mgr.checkpoint()
        assert p is not None
        man = p.result(600)
        assert len(man.files) >= 2 and len(p.grants) < len(man.files)
        assert p.fallback is not None and "went away" in p.fallback
    assert _restored_state(str(tmp_path), "d") == state_of(s)


def test_resolve_scheduler_by_uri_and_errors(tmp_path: Path) -> None:
    """A registered scheme builds the scheduler; unknown schemes and types are specific errors."""
    made: list[str] = []

    def factory(parsed: urllib.parse.SplitResult) -> WriteScheduler:
        made.append(parsed.netloc)
        return SlotScheduler(int(dict(urllib.parse.parse_qsl(parsed.query))["slots"]))

    register_scheme("slots-test", factory)
    sched = resolve_scheduler("slots-test://local?slots=2")
    assert isinstance(sched, SlotScheduler) and sched.slots == 2 and made == ["local"]
    assert resolve_scheduler(None) is None and resolve_scheduler(sched) is sched
    with pytest.raises(UnknownSchedulerError, match="unknown scheme"):
        resolve_scheduler("nope://127.0.0.1:1")
    with pytest.raises(UnknownSchedulerError, match="scheme://"):
        resolve_scheduler("not a uri")
    with pytest.raises(TypeError):
        resolve_scheduler(42)  # type: ignore[arg-type]
    pm: PageManager = new_pm()
    with pytest.raises(UnknownSchedulerError):
        CheckpointManager(pm, str(tmp_path), "x", scheduler="nope://h:1")


def test_unscheduled_default_is_unchanged(tmp_path: Path) -> None:
    """Without a scheduler: one file per worker, nothing scheduled."""
    pm = new_pm()
    s = open_structures(pm)
    mutate(s, 3)
    with CheckpointManager(pm, str(tmp_path), "n", n_workers=2) as mgr:
        p = mgr.checkpoint()
        assert p is not None
        man = p.result(600)
        assert not p.scheduled and p.grants == () and p.fallback is None
        assert len(man.files) == 2 and mgr.schedule_counters["scheduled"] == 0
