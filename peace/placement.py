"""What a Peace scheduler takes and gives: templates, requests, chunk placements, plans.

Shared by every scheduler variant (:mod:`peace.scheduler`, :mod:`peace.mcf`), the
coordinator, the validator and the simulator; it imports nothing else of ``peace``
but the errors, so every other module may import it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from peace.errors import InvalidRequestError, TemplateError
from peace.model import Vertex

__all__ = ["ReplicaTemplate", "RACK_AWARE", "UNCONSTRAINED", "check_templates", "WriteRequest",
           "ChunkPlacement", "ChunkRelease", "TimestepPlan", "Schedule", "Residual"]

Residual: TypeAlias = npt.NDArray[np.int64]
"""Residual capacity per edge id for one timestep (:meth:`peace.model.Network.new_residual`)."""


@dataclass(frozen=True, slots=True)
class ReplicaTemplate:
    """Constraint template for one replica index (paper: "constraint templates").

    Indexes refer to the chunk's path ``p`` so far: ``0`` is the writer, ``1``
    the first replica, ...; negative indexes count from the end (``-1`` is the
    current source). Every replica must also differ from every node on ``p``.

    >>> ReplicaTemplate(same_rack_as=(0,))   # same rack as the writer
    ReplicaTemplate(same_rack_as=(0,), other_rack_than=())
    """

    same_rack_as: tuple[int, ...] = ()
    other_rack_than: tuple[int, ...] = ()


#: first replica in the writer's rack, second in another rack, third beside the second
#: (HDFS's rack-aware policy with the local disk excluded, as the paper's modified HDFS).
RACK_AWARE: tuple[ReplicaTemplate, ...] = (
    ReplicaTemplate(same_rack_as=(0,)),
    ReplicaTemplate(other_rack_than=(0,)),
    ReplicaTemplate(same_rack_as=(2,)),
)
#: only "distinct from every node already on the chain".
UNCONSTRAINED: tuple[ReplicaTemplate, ...] = ()


def check_templates(templates: Sequence[ReplicaTemplate], replication: int) -> None:
    """Check every index of the templates used for ``replication`` replicas.

    Raises
    ------
    TemplateError
        If the template of replica ``i`` names a path position that does not
        exist when replica ``i`` is placed (the path then holds ``i + 1`` nodes).
    """
    for i, tpl in enumerate(templates[:replication]):
        if not isinstance(tpl, ReplicaTemplate):
            raise TemplateError(f"template {i} is not a ReplicaTemplate: {tpl!r}")
        for idx in tpl.same_rack_as + tpl.other_rack_than:
            if isinstance(idx, bool) or not isinstance(idx, int) or not -(i + 1) <= idx <= i:
                raise TemplateError(f"template of replica {i} names path position {idx!r}; "
                                    f"only {-(i + 1)}..{i} exist then")




@dataclass(frozen=True, slots=True)
class WriteRequest:
    """A write request ``(w, r, k)``: ``chunks`` chunks from ``writer``, ``replication`` copies."""

    writer: str
    replication: int
    chunks: int
    request_id: int = 0
    first_chunk: int = 0
    """Index of the first chunk still to place (a deferred request keeps its numbering)."""

    def __post_init__(self) -> None:
        for what in ("replication", "chunks"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise InvalidRequestError(
                    f"request {self.request_id} from {self.writer!r}: {what} must be a positive "
                    f"integer, got {v!r}")
        if not isinstance(self.writer, str):
            raise InvalidRequestError(f"request {self.request_id}: writer must be a server name")


@dataclass(frozen=True, slots=True)
class ChunkPlacement:
    """Where and when one chunk goes: its replication pipeline and the graph path of each hop."""

    request_id: int
    chunk_index: int
    timestep: int
    servers: tuple[str, ...]
    """Writer first, then the replicas in pipeline order."""
    hops: tuple[tuple[Vertex, ...], ...]
    """Vertex path of hop ``i``, from ``("snd", servers[i])`` to ``("rcv", servers[i + 1])``."""
    cost: int
    """Sum of the edge costs of all hops."""
    edge_ids: tuple[int, ...] = field(default=(), compare=False, repr=False)
    """All edge ids the chain uses (with repetition), for fast residual bookkeeping."""

    @property
    def writer(self) -> str:
        """The chunk's writer."""
        return self.servers[0]

    @property
    def replicas(self) -> tuple[str, ...]:
        """The replica servers in pipeline order."""
        return self.servers[1:]


@dataclass(frozen=True, slots=True)
class ChunkRelease:
    """A placed chunk stops holding its pipeline's capacity: its write completed, or its
    writer was abandoned. An online history (:meth:`peace.coordinator.Coordinator.log`)
    interleaves these with the :class:`ChunkPlacement` entries, in the order they happened."""

    request_id: int
    chunk_index: int


@dataclass(frozen=True, slots=True)
class TimestepPlan:
    """Algorithm 1's output ``(P, G, W')`` for one timestep."""

    timestep: int
    placements: tuple[ChunkPlacement, ...]
    deferred: tuple[WriteRequest, ...]
    """Requests (with their remaining chunks) left for the next timestep, in order."""


@dataclass(frozen=True, slots=True)
class Schedule:
    """A complete offline schedule: every chunk of every request, timestep by timestep."""

    requests: tuple[WriteRequest, ...]
    placements: tuple[ChunkPlacement, ...]
    timesteps: int


