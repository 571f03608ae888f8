"""Every exception raised by :mod:`peace`, in one hierarchy.

Each error also subclasses the built-in a caller would naturally catch, so
``except ValueError`` keeps working for code that does not know about peace.
"""
from __future__ import annotations

__all__ = [
    "PeaceError",
    "MalformedTopologyError",
    "UnknownServerError",
    "InvalidRequestError",
    "InfeasibleRequestError",
    "TemplateError",
    "ScheduleInfeasibleError",
    "InvalidScheduleError",
    "CannotScheduleNowError",
    "UnknownRequestError",
    "CoordinatorStateError",
    "SimulationError",
    "ServiceError",
]


class PeaceError(Exception):
    """Base class for peace errors."""


class MalformedTopologyError(PeaceError, ValueError):
    """A topology description is inconsistent (duplicate names, bad capacity, dangling link...)."""


class UnknownServerError(PeaceError, KeyError):
    """A server name that the topology does not contain."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown server"


class InvalidRequestError(PeaceError, ValueError):
    """A write request with a bad field (``chunks <= 0``, ``replication <= 0``, non-integer...)."""


class InfeasibleRequestError(InvalidRequestError):
    """A request that can never be scheduled, e.g. ``r`` larger than the eligible nodes."""


class TemplateError(PeaceError, ValueError):
    """A constraint template refers to a replica that does not exist yet."""


class ScheduleInfeasibleError(PeaceError, RuntimeError):
    """Algorithm 1 made no progress on an empty network: the requests cannot be placed."""


class InvalidScheduleError(PeaceError, ValueError):
    """A schedule failed certificate checking (see :func:`peace.validate.validate_schedule`)."""


class CannotScheduleNowError(PeaceError, RuntimeError):
    """The coordinator cannot take the request now: cancel the checkpoint and retry later.

    Attributes
    ----------
    retry_after_s : float
        A hint for when a retry has a chance to be accepted.
    """

    def __init__(self, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnknownRequestError(PeaceError, KeyError):
    """A request id (or chunk index) that the coordinator never issued."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request"


class CoordinatorStateError(PeaceError, RuntimeError):
    """An operation that the request's current state forbids (e.g. completing a chunk twice)."""


class SimulationError(PeaceError, RuntimeError):
    """The flow-level simulator reached an impossible state (no progress, bad flow...)."""


class ServiceError(PeaceError, ConnectionError):
    """The local coordinator service answered with a malformed message or went away."""
