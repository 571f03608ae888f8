"""Every Peace scheduler variant by name: ``improved``, ``paper`` (:mod:`peace.scheduler`), ``mcf``.

Above both :mod:`peace.scheduler` and :mod:`peace.mcf` (whose scheduler
subclasses the other), so neither imports the other back.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from peace.mcf import McfScheduler
from peace.model import Network, Topology
from peace.placement import RACK_AWARE, ReplicaTemplate
from peace.scheduler import Heuristics, PeaceScheduler

__all__ = ["SCHEDULER_VARIANTS", "make_scheduler"]

#: every variant name :func:`make_scheduler` understands
SCHEDULER_VARIANTS = ("improved", "paper", "mcf")


def make_scheduler(network: Network | Topology, templates: Sequence[ReplicaTemplate] = RACK_AWARE,
                   *, seed: int | np.random.Generator | None = None,
                   method: Literal["fast", "networkx"] = "fast",
                   variant: str | Heuristics = "improved",
                   lookahead: bool | None = None) -> PeaceScheduler:
    """A scheduler by variant name: ``improved``, ``paper`` or ``mcf`` (or a :class:`Heuristics`).

    >>> from peace.model import figure5_topology
    >>> type(make_scheduler(figure5_topology(), variant="mcf")).__name__
    'McfScheduler'

    Raises
    ------
    ValueError
        For an unknown variant name.
    """
    if variant == "mcf":
        return McfScheduler(network, templates, seed=seed, method=method, lookahead=lookahead)
    return PeaceScheduler(network, templates, seed=seed, method=method, variant=variant,
                          lookahead=lookahead)
