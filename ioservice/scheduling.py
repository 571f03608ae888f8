"""The write-scheduler protocol: when a checkpoint's chunks may start, and where.

SGuard §5: a DFS-side scheduler (Peace) admits and places the chunk writes of
many HA units checkpointing at once. `ioservice` defines the protocol a
scheduler implements and never imports one; the runtime (``sguard.scheduling``)
wires Peace's coordinator service into it.

A scheduled checkpoint is split into *chunks* of at most
`WriteScheduler.chunk_bytes` (whole pages, at least one page), each written as
its own page file. The writer asks the scheduler once per checkpoint
(`WriteScheduler.begin` with a `WriteIntent`), then waits for grants
(`ScheduledWrite.next_grants`): each `ChunkGrant` lets one chunk start now
(*admission*) and may name the servers that should hold it (*placement*).
Every finished chunk is reported (`ScheduledWrite.chunk_done`), so the
scheduler can advance; the report may answer with the grants it made
possible, which start at once (one round trip per chunk, not two hops).

Placement support by filesystem
-------------------------------
* SeaweedFS lets a client choose: its master assigns file ids by data center,
  rack and node (``/dir/assign?dataCenter=&rack=&dataNode=``), and the filer
  accepts the same parameters on uploads.
* Plain S3 (including SeaweedFS's S3 gateway, which is how `ioservice.fs`
  reaches it), pyarrow's HDFS client and local files do not: the storage
  picks the replicas.

`ioservice` writes through pyarrow filesystems only, so it supports
**admission on every filesystem and placement on none**: a grant's ``servers``
are recorded on the `ioservice.manager.PendingCheckpoint` (``grants``) and
logged, not enforced. A backend that can place would read them there.

Failure handling: the scheduler is advisory. If `begin`, `next_grants` or
`chunk_done` raises, or no grant arrives within `WriteScheduler.timeout_s`
of silence (the scheduler neither grants nor answers) or within
`WriteScheduler.max_wait_s` in total, every chunk not yet started is written
at once, unscheduled, and a warning is logged: a dead or hung scheduler never
blocks an operator (it only ever talks to the scheduler from a dispatcher
thread) and never loses a checkpoint.

Schedulers by URI: `register_scheme` binds a scheme (``peace``) to a factory;
`resolve_scheduler` turns ``"peace://127.0.0.1:7000"`` into a scheduler once
the module that registers the scheme is imported (``sguard.scheduling``).
"""
from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ioservice.errors import IOServiceError

__all__ = [
    "WriteIntent",
    "ChunkGrant",
    "ScheduledWrite",
    "WriteScheduler",
    "SchedulerError",
    "UnknownSchedulerError",
    "register_scheme",
    "resolve_scheduler",
    "PLACEMENT_SUPPORT",
]

#: which filesystems honour a grant's placement through ioservice (none: see the module doc)
PLACEMENT_SUPPORT: dict[str, bool] = {"local": False, "s3": False, "hdfs": False,
                                      "seaweedfs-s3": False}


class SchedulerError(IOServiceError):
    """A write scheduler failed or is unreachable (the write falls back to unscheduled)."""


class UnknownSchedulerError(SchedulerError, ValueError):
    """A scheduler URI whose scheme nobody registered, or a malformed one."""


@dataclass(frozen=True, slots=True)
class WriteIntent:
    """What one checkpoint asks to write."""

    haunit: str
    name: str
    """Checkpoint name ``<haunit>-<seq>``."""
    n_chunks: int
    chunk_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class ChunkGrant:
    """Permission for one chunk to start now, with optional placement advice."""

    chunk_index: int
    servers: tuple[str, ...] = ()
    """Writer first, then the replicas in pipeline order (empty: no advice)."""


class ScheduledWrite(Protocol):
    """One checkpoint's conversation with the scheduler (used from one dispatcher thread)."""

    def next_grants(self, timeout_s: float) -> Sequence[ChunkGrant]:
        """Grants not delivered yet; an empty sequence if none within ``timeout_s``.

        Raises any exception if the scheduler is unreachable (the writer falls back).
        """
        ...

    def chunk_done(self, chunk_index: int) -> Sequence[ChunkGrant] | None:
        """Report that a granted chunk is written (durably closed).

        May return grants that the report made possible (the chunk's freed
        capacity): they start at once, from the reporting thread, and are then
        not delivered again by `next_grants`. ``None`` or empty: none.
        """
        ...

    def close(self) -> None:
        """Release the conversation (after success, failure or fallback). Must not raise."""
        ...


@runtime_checkable
class WriteScheduler(Protocol):
    """Admission (and placement advice) for checkpoint writes; see the module docstring."""

    chunk_bytes: int
    """Bytes per scheduled chunk (one page file each)."""
    timeout_s: float
    """Silence after which the writer stops waiting and writes unscheduled."""
    max_wait_s: float
    """Longest total wait for grants before writing the rest unscheduled."""

    def begin(self, intent: WriteIntent) -> ScheduledWrite:
        """Submit a checkpoint's chunks; raises if the scheduler is unreachable."""
        ...


SchedulerFactory = Callable[[urllib.parse.SplitResult], WriteScheduler]
_SCHEMES: dict[str, SchedulerFactory] = {}
_LOCK = threading.Lock()


def register_scheme(scheme: str, factory: SchedulerFactory) -> None:
    """Let `resolve_scheduler` build ``scheme://...`` schedulers with ``factory(parsed_uri)``."""
    with _LOCK:
        _SCHEMES[scheme.lower()] = factory


def resolve_scheduler(spec: WriteScheduler | str | None) -> WriteScheduler | None:
    """A scheduler object, None, or a URI such as ``peace://127.0.0.1:7000``.

    Raises
    ------
    UnknownSchedulerError
        For a URI without a registered scheme (import the module that registers
        it, e.g. ``sguard.scheduling`` for ``peace``), or a malformed one.
    TypeError
        For anything else.
    """
    if spec is None or spec == "" or spec == "none":
        return None
    if isinstance(spec, str):
        parsed = urllib.parse.urlsplit(spec)
        if not parsed.scheme or not parsed.netloc:
            raise UnknownSchedulerError(f"scheduler URI {spec!r}: expected scheme://host:port")
        with _LOCK:
            factory = _SCHEMES.get(parsed.scheme.lower())
        if factory is None:
            known = ", ".join(sorted(_SCHEMES)) or "none registered"
            raise UnknownSchedulerError(
                f"scheduler URI {spec!r}: unknown scheme {parsed.scheme!r} ({known}); "
                f"import the module that registers it (sguard.scheduling for peace://)")
        return factory(parsed)
    if isinstance(spec, WriteScheduler):
        return spec
    raise TypeError(f"scheduler must be a WriteScheduler, a URI or None, got {type(spec).__name__}")
