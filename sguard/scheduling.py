"""Peace's coordinator in the checkpoint write path (SGuard §5), through ``ioservice``'s protocol.

`PeaceWriteScheduler` implements `ioservice.scheduling.WriteScheduler` on top
of the coordinator service of :mod:`peace.service` (newline-delimited JSON over
TCP on 127.0.0.1): each checkpoint becomes one request ``(writer, r, k)`` of
``k`` chunks, and each chunk starts when the coordinator assigns it. Importing
this module registers the ``peace://`` scheme, so any
`ioservice.CheckpointManager` takes the coordinator "with one option"::

    import sguard.scheduling                      # registers peace://
    with start_coordinator("paper") as coord:     # a real coordinator process
        mgr = CheckpointManager(pm, root, "agg0", scheduler=coord.uri)

URI form: ``peace://127.0.0.1:PORT[?writer=NAME&replication=3&chunk_mb=8&timeout_s=5&max_wait_s=120]``.
``writer`` is the server of the coordinator's topology this HA unit writes
from (default: one chosen by a stable hash of the HA unit name among the
topology's servers, so many partitions spread over the racks).

Placement: the coordinator's pipeline (``servers``) arrives with every grant
and is recorded on the checkpoint (`ioservice.manager.PendingCheckpoint.grants`);
the pyarrow filesystems ``ioservice`` writes through cannot honour it (see
`ioservice.scheduling`), so on those the coordinator provides admission only.

Failure: a coordinator that is dead (connection refused or reset) or hung (no
reply within ``timeout_s``) makes the write fall back to unscheduled writes,
logged by ``ioservice``; the operator never waits on the coordinator.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ioservice.scheduling import (ChunkGrant, SchedulerError, UnknownSchedulerError, WriteIntent,
                                  register_scheme)
from peace.errors import CannotScheduleNowError
from peace.model import Topology
from peace.service import CoordinatorClient

__all__ = ["PeaceWriteScheduler", "CoordinatorProcess", "start_coordinator", "scheduler_from_uri"]

logger = logging.getLogger(__name__)


class PeaceWriteScheduler:
    """A `ioservice.scheduling.WriteScheduler` backed by a Peace coordinator service.

    Parameters
    ----------
    address
        ``(host, port)`` of a :class:`peace.service.CoordinatorServer`.
    writer
        Server name of the coordinator's topology this writer is (default: by
        a stable hash of the HA unit name).
    replication
        Replicas per chunk asked from the coordinator.
    chunk_bytes
        Bytes per scheduled chunk (one page file each).
    timeout_s
        Longest silence of the coordinator (connect, submit, each reply)
        before the write falls back to unscheduled.
    max_wait_s
        Longest total wait for grants of one checkpoint.

    Raises
    ------
    ValueError
        For a non-positive size or timeout, or replication < 1.
    """

    def __init__(self, address: tuple[str, int], *, writer: str | None = None,
                 replication: int = 3, chunk_bytes: int = 8 << 20, timeout_s: float = 5.0,
                 max_wait_s: float = 120.0) -> None:
        if chunk_bytes < 1 or timeout_s <= 0 or max_wait_s <= 0 or replication < 1:
            raise ValueError("chunk_bytes, timeout_s, max_wait_s and replication must be positive")
        self.address = (str(address[0]), int(address[1]))
        self.writer = writer
        self.replication = int(replication)
        self.chunk_bytes = int(chunk_bytes)
        self.timeout_s = float(timeout_s)
        self.max_wait_s = float(max_wait_s)
        self._servers: list[str] | None = None
        self._lock = threading.Lock()

    @property
    def uri(self) -> str:
        """``peace://host:port?...`` reproducing this scheduler."""
        q: dict[str, object] = {"replication": self.replication, "chunk_mb": self.chunk_bytes / (1 << 20),
             "timeout_s": self.timeout_s, "max_wait_s": self.max_wait_s}
        if self.writer is not None:
            q["writer"] = self.writer
        return f"peace://{self.address[0]}:{self.address[1]}?{urllib.parse.urlencode(q)}"

    def __repr__(self) -> str:
        return f"<PeaceWriteScheduler {self.uri}>"

    def _connect(self) -> CoordinatorClient:
        try:
            return CoordinatorClient(self.address, timeout_s=self.timeout_s)
        except OSError as exc:
            raise SchedulerError(f"peace coordinator {self.address[0]}:{self.address[1]} "
                                 f"unreachable: {exc}") from exc

    def writer_for(self, haunit: str, client: CoordinatorClient) -> str:
        """The writer name of ``haunit`` (the configured one, or a stable hash pick)."""
        if self.writer is not None:
            return self.writer
        with self._lock:
            servers = self._servers
        if servers is None:
            servers = client.servers()
            with self._lock:
                self._servers = servers
        return servers[zlib.crc32(haunit.encode()) % len(servers)]

    def begin(self, intent: WriteIntent) -> _PeaceWrite:
        """Submit the checkpoint as one request of ``intent.n_chunks`` chunks.

        Raises
        ------
        SchedulerError
            If the coordinator is unreachable, hung or rejects the request.
        """
        client = self._connect()
        try:
            writer = self.writer_for(intent.haunit, client)
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    rid = client.submit(writer, self.replication, intent.n_chunks)
                    break
                except CannotScheduleNowError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        except Exception as exc:
            client.close()
            if isinstance(exc, SchedulerError):
                raise
            raise SchedulerError(f"peace coordinator {self.address}: submitting {intent.name} "
                                 f"failed: {exc!r}") from exc
        logger.debug("checkpoint %s: peace request %d (%s, r=%d, k=%d)", intent.name, rid, writer,
                     self.replication, intent.n_chunks)
        return _PeaceWrite(self, client, rid)


class _PeaceWrite:
    """One checkpoint's request: long-polls on one connection, reports on another."""

    def __init__(self, owner: PeaceWriteScheduler, client: CoordinatorClient, rid: int) -> None:
        self.owner = owner
        self.rid = rid
        self._wait = client
        self._report: CoordinatorClient | None = None
        self._lock = threading.Lock()

    def next_grants(self, timeout_s: float) -> Sequence[ChunkGrant]:
        self._wait.set_timeout(timeout_s + self.owner.timeout_s)
        reply = self._wait.wait(self.rid, timeout_s=timeout_s)
        if reply.get("failed"):
            raise SchedulerError(f"peace request {self.rid} failed: {reply['failed']}")
        return _grants(reply["assignments"])

    def chunk_done(self, chunk_index: int) -> Sequence[ChunkGrant]:
        """Report the chunk; returns the grants its freed capacity brought (start them now)."""
        with self._lock:
            if self._report is None:
                self._report = self.owner._connect()
            got = self._report.complete(self.rid, chunk_index, take=True)
        return _grants(got)

    def close(self) -> None:
        with self._lock:
            clients = [c for c in (self._wait, self._report) if c is not None]
            self._report = None
        for c in clients:
            try:
                c.close()
            except OSError:
                pass


def _grants(assignments: Sequence[dict[str, Any]]) -> list[ChunkGrant]:
    """Wire assignments as `ChunkGrant` objects."""
    return [ChunkGrant(int(a["chunk_index"]), tuple(str(s) for s in a["servers"]))
            for a in assignments]


def scheduler_from_uri(parsed: urllib.parse.SplitResult | str) -> PeaceWriteScheduler:
    """Build a `PeaceWriteScheduler` from ``peace://host:port?...``.

    Raises
    ------
    UnknownSchedulerError
        For another scheme, a missing port or a bad query parameter.
    """
    if isinstance(parsed, str):
        parsed = urllib.parse.urlsplit(parsed)
    if parsed.scheme != "peace":
        raise UnknownSchedulerError(f"not a peace:// URI: {parsed.geturl()!r}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError as exc:
        raise UnknownSchedulerError(f"scheduler URI {parsed.geturl()!r}: {exc}") from None
    if not host or port is None:
        raise UnknownSchedulerError(f"scheduler URI {parsed.geturl()!r}: expected peace://HOST:PORT")
    q = dict(urllib.parse.parse_qsl(parsed.query))
    known = {"writer", "replication", "chunk_mb", "timeout_s", "max_wait_s"}
    unknown = set(q) - known
    if unknown:
        raise UnknownSchedulerError(f"scheduler URI {parsed.geturl()!r}: unknown parameter(s) "
                                    f"{sorted(unknown)}; known: {sorted(known)}")
    try:
        return PeaceWriteScheduler(
            (host, port), writer=q.get("writer"), replication=int(q.get("replication", 3)),
            chunk_bytes=int(float(q.get("chunk_mb", 8)) * (1 << 20)),
            timeout_s=float(q.get("timeout_s", 5.0)), max_wait_s=float(q.get("max_wait_s", 120.0)))
    except ValueError as exc:
        raise UnknownSchedulerError(f"scheduler URI {parsed.geturl()!r}: {exc}") from None


register_scheme("peace", scheduler_from_uri)


class CoordinatorProcess:
    """A Peace coordinator service in its own process (``sguard peace serve``), on 127.0.0.1.

    Use as a context manager or call :meth:`stop`. ``pid`` lets tests kill or
    stop (SIGSTOP) it.
    """

    def __init__(self, popen: subprocess.Popen[bytes], address: tuple[str, int],
                 topology_file: str | None) -> None:
        self.popen = popen
        self.address = address
        self._topology_file = topology_file

    @property
    def pid(self) -> int:
        """Process id of the coordinator."""
        return self.popen.pid

    @property
    def uri(self) -> str:
        """``peace://127.0.0.1:PORT`` for `ioservice.CheckpointManager(scheduler=...)`."""
        return f"peace://{self.address[0]}:{self.address[1]}"

    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen.poll() is None

    def stop(self, grace_s: float = 2.0) -> None:
        """Terminate (then kill) the process; idempotent."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5.0)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        if self._topology_file is not None:
            try:
                os.unlink(self._topology_file)
            except OSError:
                pass
            self._topology_file = None

    def __enter__(self) -> CoordinatorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the starting thread exits (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_coordinator(topology: str | Topology = "paper", *, variant: str = "improved",
                      port: int = 0, advance_fraction: float = 0.8, seed: int = 0,
                      work_conserving: bool = False, own_session: bool = False,
                      startup_timeout_s: float = 60.0) -> CoordinatorProcess:
    """Start ``sguard peace serve`` in a new process and wait for its address.

    Parameters
    ----------
    topology
        ``figure5``, ``paper``, ``paper-bw``, a JSON file, or a
        :class:`~peace.model.Topology` (written to a temporary JSON file).
    variant
        Scheduler variant: ``improved``, ``paper`` or ``mcf``.
    work_conserving
        No timestep barrier: every completion schedules waiting chunks into the
        capacity the chunks in flight leave (`peace.coordinator.Coordinator`).
    own_session
        Run the coordinator in a process session of its own (Linux: killed when the
        starting thread exits). With the kernel's autogroup scheduling a session
        gets its own CPU share, so a coordinator started by a process full of
        busy threads still answers promptly, as a coordinator on its own host
        would.

    Raises
    ------
    RuntimeError
        If the process exits or prints no address within ``startup_timeout_s``.
    """
    tfile: str | None = None
    if isinstance(topology, Topology):
        fd, tfile = tempfile.mkstemp(prefix="peace-topology-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(topology.to_dict(), fh)
        spec = tfile
    else:
        spec = topology
    cmd = [sys.executable, "-m", "sguard", "peace", "serve", "--topology", spec, "--host",
           "127.0.0.1", "--port", str(port), "--variant", variant, "--advance-fraction",
           str(advance_fraction), "--seed", str(seed)]
    if work_conserving:
        cmd.append("--work-conserving")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env, start_new_session=own_session,
                             preexec_fn=_die_with_parent if own_session else None)
    found: list[tuple[str, int]] = []
    lines: list[str] = []

    def read() -> None:
        assert popen.stdout is not None
        for raw in popen.stdout:
            line = raw.decode("utf-8", "replace").strip()
            lines.append(line)
            if line.startswith("peace coordinator on ") and not found:
                hostport = line.split()[3]
                host, _, p = hostport.rpartition(":")
                found.append((host, int(p)))

    reader = threading.Thread(target=read, name="peace-coordinator-log", daemon=True)
    reader.start()
    deadline = time.monotonic() + startup_timeout_s
    while not found:
        if popen.poll() is not None or time.monotonic() > deadline:
            if popen.poll() is None:
                popen.kill()
                popen.wait(5.0)
            if tfile is not None:
                os.unlink(tfile)
            raise RuntimeError(f"peace coordinator did not start (exit {popen.returncode}): "
                               + " | ".join(lines[-10:]))
        time.sleep(0.02)
    logger.info("peace coordinator process %d on %s:%d", popen.pid, *found[0])
    return CoordinatorProcess(popen, found[0], tfile)
