"""The coordinator as a small local service: newline-delimited JSON over TCP.

Writers in other processes (e.g. Spark executors) talk to one
:class:`~peace.coordinator.Coordinator` through :class:`CoordinatorServer`,
bound to ``127.0.0.1`` by default. One JSON object per line each way::

    {"op": "submit", "writer": "svr1.1", "replication": 3, "chunks": 8}
        -> {"ok": true, "request_id": 0, "assignments": [...]}
        -> {"ok": false, "error": "CannotScheduleNowError", "message": "...", "retry_after_s": 0.0}
    {"op": "wait", "request_id": 0, "timeout_s": 5}
        -> {"ok": true, "assignments": [{"chunk_index": 0, "timestep": 0,
                                          "servers": [...], "cost": 5}, ...],
            "state": "ACTIVE", "completed": 0, "chunks": 8}
    {"op": "complete", "request_id": 0, "chunk_index": 0}   -> {"ok": true}
    {"op": "complete", ..., "take": true}   -> {"ok": true, "assignments": [...]}
    {"op": "status", "request_id": 0} / {"op": "stats"}     -> {"ok": true, ...}
    {"op": "servers"}  -> {"ok": true, "servers": [...], "racks": {"rack1": [...], ...}}

A request whose submitting connection closes before it is done is
*abandoned* (:meth:`~peace.coordinator.Coordinator.abandon`): its queued
chunks are dropped and its in-flight chunks release their capacity, so a
writer that dies (or gives up and writes unscheduled) never stalls the others.
Keep the submitting connection open until every chunk is reported.

``submit`` returns the assignments made at once (the same objects ``wait``
returns; they are not delivered again), so a request admitted right away
costs one round trip; likewise ``complete`` with ``"take": true`` returns the
request's assignments that completion (or anything before it) made, so a
writer starts its next chunk from the reply without waiting for its long poll
to wake. ``wait`` is a long poll: it returns the assignments not yet delivered to that
request as soon as there is at least one (or the request is finished), or an
empty list after ``timeout_s``. Errors carry the exception class name;
:class:`CoordinatorClient` raises the same :mod:`peace.errors` class again.
"""
from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

from peace import errors as _errors
from peace.coordinator import Coordinator, RequestState
from peace.errors import PeaceError, ServiceError
from peace.placement import ChunkPlacement

__all__ = ["CoordinatorServer", "CoordinatorClient", "placement_to_json"]

logger = logging.getLogger(__name__)

_MAX_LINE = 1 << 20


def placement_to_json(pl: ChunkPlacement) -> dict[str, Any]:
    """The wire form of one chunk assignment."""
    return {"request_id": pl.request_id, "chunk_index": pl.chunk_index, "timestep": pl.timestep,
            "servers": list(pl.servers), "cost": pl.cost}


class _Mailbox:
    """Assignments of one request not yet delivered to its writer."""

    def __init__(self) -> None:
        self.items: list[ChunkPlacement] = []
        self.failed: str | None = None


class CoordinatorServer:
    """Serve a :class:`Coordinator` on ``host:port`` (``port=0``: any free port).

    Use as a context manager, or call :meth:`start` and :meth:`close`.

    Raises
    ------
    ValueError
        If ``host`` is not a loopback address and ``allow_remote`` is false.
    """

    def __init__(self, coordinator: Coordinator, host: str = "127.0.0.1", port: int = 0, *,
                 allow_remote: bool = False) -> None:
        if not allow_remote and host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"refusing to bind {host!r}: pass allow_remote=True")
        self.coordinator = coordinator
        self._boxes: dict[int, _Mailbox] = {}
        self._cond = threading.Condition()
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            disable_nagle_algorithm = True

            def handle(self) -> None:
                mine: list[int] = []  # requests submitted on this connection
                try:
                    self._serve(mine)
                finally:
                    outer._abandon(mine)

            def _serve(self, mine: list[int]) -> None:
                while True:
                    try:
                        line = self.rfile.readline(_MAX_LINE)
                    except OSError:
                        return
                    if not line:
                        return
                    try:
                        msg = json.loads(line)
                        if not isinstance(msg, dict):
                            raise ValueError("a message is a JSON object")
                        reply = outer._dispatch(msg)
                        if msg.get("op") == "submit" and reply.get("ok"):
                            mine.append(int(reply["request_id"]))
                    except PeaceError as exc:
                        reply = {"ok": False, "error": type(exc).__name__, "message": str(exc),
                                 "retry_after_s": getattr(exc, "retry_after_s", None)}
                    except (ValueError, KeyError, TypeError) as exc:
                        reply = {"ok": False, "error": "ValueError",
                                 "message": f"bad message: {exc!r}"}
                    try:
                        self.wfile.write((json.dumps(reply) + "\n").encode())
                        self.wfile.flush()
                    except OSError:
                        return

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._server = Server((host, port), Handler)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the server listens on."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> CoordinatorServer:
        """Serve in a background thread; returns self."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="peace-service",
                                        daemon=True)
        self._thread.start()
        logger.info("peace coordinator serving on %s:%d", *self.address)
        return self

    def close(self) -> None:
        """Stop serving and release the socket."""
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> CoordinatorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _abandon(self, request_ids: list[int]) -> None:
        """The connection that submitted these requests closed: drop the unfinished ones."""
        for rid in request_ids:
            try:
                self.coordinator.abandon(rid)
            except PeaceError as exc:  # pragma: no cover - ids come from this server
                logger.warning("abandoning request %d failed: %s", rid, exc)
        with self._cond:
            for rid in request_ids:
                self._boxes.pop(rid, None)
            self._cond.notify_all()

    # ------------------------------------------------------------------ ops
    def _dispatch(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        c = self.coordinator
        if op == "submit":
            # register the mailbox before the coordinator can call back
            with self._cond:
                holder = _Mailbox()

            def on_assign(pl: ChunkPlacement) -> None:
                with self._cond:
                    self._boxes.setdefault(pl.request_id, holder).items.append(pl)
                    self._cond.notify_all()

            def on_fail(request_id: int, err: Exception) -> None:
                with self._cond:
                    self._boxes.setdefault(request_id, holder).failed = f"{type(err).__name__}: {err}"
                    self._cond.notify_all()

            rid = c.submit(_str(msg, "writer"), _int(msg, "replication"), _int(msg, "chunks"),
                           on_assign=on_assign, on_fail=on_fail)
            with self._cond:
                box = self._boxes.setdefault(rid, holder)
                items, box.items = box.items, []
            return {"ok": True, "request_id": rid,
                    "assignments": [placement_to_json(p) for p in items]}
        if op == "wait":
            rid = _int(msg, "request_id")
            timeout = float(msg.get("timeout_s", 10.0))
            status = c.status(rid)  # raises UnknownRequestError
            deadline = time.monotonic() + max(0.0, min(timeout, 300.0))
            with self._cond:
                box = self._boxes.setdefault(rid, _Mailbox())
                while not box.items and box.failed is None:
                    st = c.status(rid)
                    if st.assigned == st.chunks or st.state is RequestState.FAILED:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                items, box.items = box.items, []
                failed = box.failed
            status = c.status(rid)
            return {"ok": True, "assignments": [placement_to_json(p) for p in items],
                    "state": status.state.name, "completed": status.completed,
                    "chunks": status.chunks, "failed": failed}
        if op == "complete":
            rid = _int(msg, "request_id")
            c.complete(rid, _int(msg, "chunk_index"))  # assignments reach the mailboxes now
            if not msg.get("take"):
                return {"ok": True}
            with self._cond:
                kept = self._boxes.get(rid)
                items = [] if kept is None else kept.items
                if kept is not None:
                    kept.items = []
            return {"ok": True, "assignments": [placement_to_json(p) for p in items]}
        if op == "status":
            st = c.status(_int(msg, "request_id"))
            return {"ok": True, "request_id": st.request_id, "writer": st.writer,
                    "chunks": st.chunks, "assigned": st.assigned, "completed": st.completed,
                    "state": st.state.name}
        if op == "servers":
            topo = c.network.topology
            return {"ok": True, "servers": list(topo.servers), "topology": topo.name,
                    "racks": {r.name: list(r.servers) for r in topo.racks}}
        if op == "stats":
            s = c.stats()
            return {"ok": True, "timestep": s.timestep, "pending_requests": s.pending_requests,
                    "in_flight_chunks": s.in_flight_chunks, "completed_chunks": s.completed_chunks,
                    "rejected_requests": s.rejected_requests}
        raise ValueError(f"unknown op {op!r}")


def _int(msg: dict[str, Any], key: str) -> int:
    v = msg[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _errors.InvalidRequestError(f"field {key!r} must be an integer, got {v!r}")
    return v


def _str(msg: dict[str, Any], key: str) -> str:
    v = msg[key]
    if not isinstance(v, str):
        raise _errors.InvalidRequestError(f"field {key!r} must be a string, got {v!r}")
    return v


class CoordinatorClient:
    """A writer's connection to a :class:`CoordinatorServer` (one per thread).

    Raises the :mod:`peace.errors` class named by the server on errors, and
    :class:`~peace.errors.ServiceError` if the connection breaks.
    """

    def __init__(self, address: tuple[str, int], *, timeout_s: float = 30.0) -> None:
        self._sock = socket.create_connection(address, timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = self._sock.makefile("rwb")
        self._early: dict[int, list[dict[str, Any]]] = {}

    def close(self) -> None:
        """Close the connection."""
        try:
            self._file.close()
        finally:
            self._sock.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, **msg: Any) -> dict[str, Any]:
        """Send one message and return the reply; raise its error if it is one."""
        try:
            self._file.write((json.dumps(msg) + "\n").encode())
            self._file.flush()
            line = self._file.readline(_MAX_LINE)
        except OSError as exc:
            raise ServiceError(f"peace service connection failed: {exc}") from exc
        if not line:
            raise ServiceError("peace service closed the connection")
        try:
            reply: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ServiceError(f"malformed reply {line[:80]!r}") from exc
        if not reply.get("ok"):
            name = reply.get("error", "PeaceError")
            cls = getattr(_errors, name, None)
            message = reply.get("message", "")
            if isinstance(cls, type) and issubclass(cls, PeaceError):
                if cls is _errors.CannotScheduleNowError:
                    raise cls(message, retry_after_s=float(reply.get("retry_after_s") or 0.0))
                raise cls(message)
            raise ValueError(message)
        return reply

    def set_timeout(self, timeout_s: float | None) -> None:
        """Socket timeout of every later call (None: wait forever)."""
        self._sock.settimeout(timeout_s)

    def servers(self) -> list[str]:
        """The coordinator topology's server names (the valid writers)."""
        return [str(s) for s in self.call(op="servers")["servers"]]

    def submit(self, writer: str, replication: int, chunks: int) -> int:
        """Submit a request; returns its id (see :meth:`Coordinator.submit` for errors).

        Assignments made at once are kept and returned by the next :meth:`wait`.
        """
        rid, first = self.submit_and_grants(writer, replication, chunks)
        if first:
            self._early.setdefault(rid, []).extend(first)
        return rid

    def submit_and_grants(self, writer: str, replication: int,
                          chunks: int) -> tuple[int, list[dict[str, Any]]]:
        """Submit a request; returns its id and the assignments made at once."""
        reply = self.call(op="submit", writer=writer, replication=replication, chunks=chunks)
        return int(reply["request_id"]), list(reply.get("assignments", ()))

    def wait(self, request_id: int, timeout_s: float = 10.0) -> dict[str, Any]:
        """Long-poll for new assignments of ``request_id`` (first those `submit` received)."""
        early = self._early.pop(request_id, None)
        if early:
            return {"ok": True, "assignments": early, "failed": None}
        return self.call(op="wait", request_id=request_id, timeout_s=timeout_s)

    def complete(self, request_id: int, chunk_index: int, *, take: bool = False
                 ) -> list[dict[str, Any]]:
        """Report a finished chunk; with ``take``, returns the request's assignments not yet
        delivered (they are then not returned by :meth:`wait`), else ``[]``."""
        reply = self.call(op="complete", request_id=request_id, chunk_index=chunk_index,
                          **({"take": True} if take else {}))
        return list(reply.get("assignments", ()))

    def stats(self) -> dict[str, Any]:
        """Coordinator counters."""
        return self.call(op="stats")

    def write_all(self, writer: str, replication: int, chunks: int,
                  write_chunk: Callable[[dict[str, Any]], None], *, timeout_s: float = 60.0,
                  retries: int = 50, retry_sleep_s: float = 0.02) -> int:
        """Submit (retrying on "cannot schedule now"), write every chunk when told, report each.

        ``write_chunk`` receives each assignment (``servers``: the pipeline) and
        performs the write. Returns the request id.

        Raises
        ------
        CannotScheduleNowError
            If still rejected after ``retries`` attempts.
        ServiceError
            If no assignment arrives within ``timeout_s``.
        """
        for attempt in range(retries + 1):
            try:
                rid = self.submit(writer, replication, chunks)
                break
            except _errors.CannotScheduleNowError:
                if attempt == retries:
                    raise
                time.sleep(retry_sleep_s)
        done = 0
        deadline = time.monotonic() + timeout_s
        while done < chunks:
            reply = self.wait(rid, timeout_s=min(5.0, max(0.0, deadline - time.monotonic())))
            if reply.get("failed"):
                raise ServiceError(f"request {rid} failed: {reply['failed']}")
            for a in reply["assignments"]:
                write_chunk(a)
                self.complete(rid, a["chunk_index"])
                done += 1
            if not reply["assignments"] and time.monotonic() > deadline:
                raise ServiceError(f"request {rid}: no assignment within {timeout_s} s")
        return rid
