"""Peace's coordinator service in the checkpoint write path (sguard.scheduling), with real
coordinator processes: many partitions at once, a killed and a hung coordinator, the demo."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mmm
from ioservice import CheckpointManager
from ioservice.scheduling import UnknownSchedulerError, resolve_scheduler
from mmm.structures.hashmap import HashMap
from peace.model import Rack, SwitchLink, Topology
from peace.service import CoordinatorClient
from sguard.scheduling import PeaceWriteScheduler, scheduler_from_uri, start_coordinator

ROOT = Path(__file__).resolve().parents[2]
PAGE = 4096
# the limits after which a write falls back to unscheduled writes, as hang guards: a test
# that asserts every chunk was granted must not depend on the machine's load
NO_FALLBACK = "?chunk_mb=0.03125&timeout_s=600&max_wait_s=3600"


def _state(seed: int, n: int = 20_000) -> tuple[mmm.PageManager, HashMap]:
    pm = mmm.PageManager(page_bytes=PAGE, capacity_bytes=64 << 20)
    m = HashMap.create(pm, "m", key="<u4", value="<i8")
    rng = np.random.default_rng(seed)
    m.put(rng.integers(0, 1 << 30, n).astype("<u4"), rng.integers(0, 1 << 40, n))
    return pm, m


def _digest(m: HashMap) -> list[Any]:
    k, v = m.items()
    order = np.argsort(k, kind="stable")
    return [np.asarray(k)[order].tolist(), np.asarray(v)[order].tolist()]


def _restore_digest(root: str, haunit: str) -> list[Any]:
    pm = mmm.PageManager(page_bytes=PAGE, capacity_bytes=64 << 20)
    with CheckpointManager(pm, root, haunit) as mgr:
        assert mgr.restore() is not None
    return _digest(HashMap.create(pm, "m", key="<u4", value="<i8"))


def _one_writer_topology() -> Topology:
    """Two racks of two servers, every capacity 1: one chunk in flight per writer."""
    return Topology(racks=(Rack("rack1", "sw1", ("a1", "a2")), Rack("rack2", "sw2", ("b1", "b2"))),
                    links=(SwitchLink("sw1", "sw2", 1, 125_000_000),), snd_up_chunks=1,
                    up_sw_chunks=1, sw_dn_chunks=1, dn_rcv_chunks=1, name="tiny")


@pytest.mark.parametrize("conserving", [False, True], ids=["barrier", "work-conserving"])
def test_many_partitions_checkpoint_through_the_coordinator_process(tmp_path: Path,
                                                                    conserving: bool) -> None:
    """Eight partitions (threads) checkpoint at once through one coordinator process: every
    chunk is granted with a rack-aware pipeline, reported, and every checkpoint restores.
    Work-conserving: the coordinator runs in its own session and hands grants over in the
    replies to completion reports."""
    with start_coordinator("paper", work_conserving=conserving, own_session=conserving) as coord:
        assert (os.getsid(coord.pid) != os.getsid(0)) == conserving
        root = str(tmp_path)
        digests: dict[str, list[Any]] = {}
        grants: dict[str, Any] = {}
        errors: list[BaseException] = []

        def partition(i: int) -> None:
            try:
                pm, m = _state(i)
                with CheckpointManager(pm, root, f"part{i}",
                                       scheduler=coord.uri + NO_FALLBACK) as mgr:
                    p = mgr.checkpoint()
                    assert p is not None
                    man = p.result(600)
                    assert p.fallback is None, p.fallback
                    grants[f"part{i}"] = (len(man.files), p.grants)
                    digests[f"part{i}"] = _digest(m)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=partition, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors
        with CoordinatorClient(coord.address) as c:
            stats = c.stats()
            racks = c.call(op="servers")["racks"]
        total = sum(n for n, _ in grants.values())
        assert stats["completed_chunks"] == total and stats["in_flight_chunks"] == 0
        rack_of = {s: r for r, members in racks.items() for s in members}
        for n_files, gs in grants.values():
            assert n_files >= 2 and sorted(g.chunk_index for g in gs) == list(range(n_files))
            for g in gs:  # writer, then 3 replicas: same rack, other rack, beside the second
                w, a, b, c3 = g.servers
                assert rack_of[a] == rack_of[w] != rack_of[b] == rack_of[c3]
                assert len({w, a, b, c3}) == 4
        writers = {gs[0].servers[0] for _, gs in grants.values()}
        assert len({rack_of[w] for w in writers}) == 2  # the hash spreads partitions over racks
    for haunit, d in digests.items():
        assert _restore_digest(root, haunit) == d


def _block_writer(coord_address: tuple[str, int], writer: str) -> CoordinatorClient:
    """Take the writer's only send slot with a chunk that is never completed: later
    requests of that writer wait in the coordinator's queue."""
    blocker = CoordinatorClient(coord_address, timeout_s=600)
    rid = blocker.submit(writer, 1, 1)
    assert blocker.wait(rid, timeout_s=600)["assignments"]  # a hang guard
    return blocker


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_dead_or_hung_coordinator_falls_back_without_blocking_or_losing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str) -> None:
    """The checkpoint waits for admission behind a blocked writer; the coordinator process is
    then SIGKILLed (or SIGSTOPped): checkpoint() never blocks, the write falls back to
    unscheduled after the timeout, commits, restores, and the fallback is logged."""
    coord = start_coordinator(_one_writer_topology())
    try:
        blocker = _block_writer(coord.address, "a1")
        pm, m = _state(7)
        # timeout_s is what this test is about (a hung coordinator is given up after it);
        # max_wait_s (no grant for so long) must not fire while the request is queued
        uri = coord.uri + "?writer=a1&replication=2&chunk_mb=0.03125&timeout_s=6&max_wait_s=3600"
        with caplog.at_level(logging.WARNING, logger="ioservice.service"):
            with CheckpointManager(pm, str(tmp_path), "unit", scheduler=uri) as mgr:
                p = mgr.checkpoint()
                assert p is not None
                with CoordinatorClient(coord.address) as c:  # our request is queued, not granted
                    t0 = time.monotonic()
                    while c.stats()["pending_requests"] == 0:
                        assert time.monotonic() - t0 < 600, "the request never reached it"
                        time.sleep(0.01)
                    st = c.call(op="status", request_id=1)
                    assert st["state"] == "QUEUED" and st["assigned"] == 0
                assert not p.done()
                os.kill(coord.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
                man = p.result(600)
                assert p.grants == () and p.fallback is not None
                assert mgr.schedule_counters == {"scheduled": 1, "unscheduled_fallbacks": 1}
                m.put(np.array([1, 2], "<u4"), np.array([3, 4]))  # the operator keeps going
                q = mgr.checkpoint()  # the next checkpoint also falls back, it does not hang
                assert q is not None
                q.result(600)
                assert q.fallback is not None
        assert man.n_pages == p.n_pages
        assert "write scheduler unavailable" in caplog.text
        blocker.close()
    finally:
        if how == "hang" and coord.alive():
            os.kill(coord.pid, signal.SIGCONT)
        coord.stop()
    assert _restore_digest(str(tmp_path), "unit") == _digest(m)


def test_peace_uri_parsing_and_errors() -> None:
    """peace:// URIs carry writer, replication, chunk size and timeouts; bad ones are rejected."""
    s = resolve_scheduler("peace://127.0.0.1:7000?writer=svr1.1&replication=2&chunk_mb=4"
                          "&timeout_s=1.5&max_wait_s=9")
    assert isinstance(s, PeaceWriteScheduler)
    assert (s.address, s.writer, s.replication, s.chunk_bytes, s.timeout_s, s.max_wait_s) == \
        (("127.0.0.1", 7000), "svr1.1", 2, 4 << 20, 1.5, 9.0)
    assert scheduler_from_uri(s.uri).uri == s.uri
    with pytest.raises(UnknownSchedulerError, match="unknown parameter"):
        scheduler_from_uri("peace://127.0.0.1:7000?color=red")
    with pytest.raises(UnknownSchedulerError, match="HOST:PORT"):
        scheduler_from_uri("peace://127.0.0.1")
    with pytest.raises(UnknownSchedulerError):
        scheduler_from_uri("peace://127.0.0.1:7000?replication=zero")


def test_demo_checkpoints_through_the_coordinator_with_one_option(tmp_path: Path) -> None:
    """`sguard demo --scheduler peace://...`: the demo's checkpoints go through the coordinator
    (its completed-chunk counter grows) and the demo still recovers exactly once."""
    with start_coordinator("paper") as coord:
        cmd = [sys.executable, "-m", "sguard", "demo", "--batches", "40", "--batch", "50000",
               "--groups", "20000", "--checkpoint-every", "4", "--kill-at", "32", "--root",
               str(tmp_path / "data"), "--page-bytes", "4096", "--json",
               "--scheduler", coord.uri + "?chunk_mb=0.25&timeout_s=600&max_wait_s=3600"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert out.returncode == 0, out.stdout + out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["recovered_ok"] and result["final_ok"]
        with CoordinatorClient(coord.address) as c:
            assert c.stats()["completed_chunks"] >= 2
        assert "write scheduler unavailable" not in out.stderr
