"""Figure 10 experiments: run policies over a grid of workloads and plot them.

Shared by ``bench/peace_fig10.py``, ``sguard peace simulate`` and the notebook
``notebooks/peace_simulation.ipynb``, so all three report the same thing.

Every Peace variant schedules on the paper's network model (§6.2: capacity 2
on SND->UP and on DN->RCV; the inter-rack link gets 5 chunks per timestep, its
bandwidth over the disks'):

* ``peace``: the improved scheduler (default; see :mod:`peace.scheduler` for
  exactly what differs from the paper);
* ``peace-paper``: Algorithm 1 as published.

Extra variants (:data:`EXTRA_POLICIES`, not in the default grid or plot):

* ``peace-fill``: the improved scheduler without the whole-requests rule;
* ``peace-paper-nic5``: Algorithm 1 as published on a model whose SND->UP
  capacity is derived from the simulated NIC bandwidth instead (5 chunks per
  timestep for 125 MB/s against 45 MB/s disks) -- an earlier calibration, kept
  only to show how much of the published algorithm's shortfall the
  conservative capacity 2 causes.

The baselines ignore capacities. Every policy sees the same simulated
bandwidths (see :data:`peace.simulator.CALIBRATION`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from peace.model import MB, Topology, paper_topology
from peace.simulator import BackgroundTraffic, make_jobs, make_policy, simulate

__all__ = ["Row", "FIG10_POLICIES", "EXTRA_POLICIES", "ALL_POLICIES", "run_grid", "aggregate",
           "plot_figure10"]

#: the default grid: both Peace variants on the paper's capacities, and the baselines
FIG10_POLICIES = ("peace", "peace-paper", "hdfs", "random", "admission")
#: clearly labelled extras (see the module docstring)
EXTRA_POLICIES = ("peace-fill", "peace-paper-nic5")
#: every policy name understood by :func:`run_grid`
ALL_POLICIES = FIG10_POLICIES + EXTRA_POLICIES


@dataclass(frozen=True, slots=True)
class Row:
    """One simulation run of the grid."""

    policy: str
    writers: int
    size_mb: int
    seed: int
    mean_response_s: float
    mean_service_s: float
    makespan_s: float
    ms_per_decision: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return asdict(self)


def _topology_for(policy: str, base: Topology | None) -> Topology:
    if base is not None:
        return base
    return paper_topology(snd_up_chunks=None if policy == "peace-paper-nic5" else 2)


def _sim_policy(policy: str) -> str:
    return "peace-paper" if policy == "peace-paper-nic5" else policy


def run_grid(writers: Iterable[int] = (8, 12, 16), sizes_mb: Iterable[int] = (128, 256, 512),
             policies: Sequence[str] = FIG10_POLICIES, seeds: Iterable[int] = (0,), *,
             topology: Topology | None = None, replication: int = 3,
             background: BackgroundTraffic | None = None, admission_cap: int = 4,
             on_progress: Callable[[int, int], None] | None = None) -> list[Row]:
    """Simulate every (writers, size, policy, seed) combination.

    Parameters
    ----------
    policies
        Names from :data:`ALL_POLICIES` (default :data:`FIG10_POLICIES`).
    topology
        Use this topology for every policy (default: the paper's 17 servers with
        the paper's capacities; ``peace-paper-nic5`` derives SND->UP from the NIC).
    on_progress
        Called with ``(done, total)`` after each run.

    Raises
    ------
    ValueError
        For an unknown policy name.
    """
    writers, sizes_mb, seeds = list(writers), list(sizes_mb), list(seeds)
    for p in policies:
        if p not in ALL_POLICIES:
            raise ValueError(f"unknown policy {p!r}; choose from {ALL_POLICIES}")
    total = len(writers) * len(sizes_mb) * len(policies) * len(seeds)
    rows: list[Row] = []
    for w in writers:
        for size in sizes_mb:
            for policy in policies:
                topo = _topology_for(policy, topology)
                for seed in seeds:
                    jobs = make_jobs(topo, w, size * MB, replication=replication, seed=seed)
                    res = simulate(topo, jobs, make_policy(_sim_policy(policy), seed=seed,
                                                           admission_cap=admission_cap),
                                   background=background)
                    rows.append(Row(policy, w, size, seed, res.mean_response_s,
                                    res.mean_service_s, res.makespan_s, res.ms_per_decision))
                    if on_progress is not None:
                        on_progress(len(rows), total)
    return rows


def aggregate(rows: Sequence[Row]) -> dict[tuple[str, int, int], dict[str, float]]:
    """Mean over seeds of each metric, keyed by ``(policy, writers, size_mb)``."""
    groups: dict[tuple[str, int, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.policy, r.writers, r.size_mb), []).append(r)
    return {k: {"mean_response_s": float(np.mean([r.mean_response_s for r in v])),
                "mean_service_s": float(np.mean([r.mean_service_s for r in v])),
                "makespan_s": float(np.mean([r.makespan_s for r in v])),
                "runs": len(v)} for k, v in groups.items()}


def plot_figure10(rows: Sequence[Row], path: str | None = None, *, title: str | None = None) -> Any:
    """Figure 10 as bars: per-request time (response and service) and total time (makespan).

    Returns the matplotlib figure; writes a PNG if ``path`` is given (Agg backend).
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = aggregate(rows)
    policies = [p for p in ALL_POLICIES if any(k[0] == p for k in agg)]
    configs = sorted({(k[1], k[2]) for k in agg})
    labels = [f"{w}x{s}MB" for w, s in configs]
    x = np.arange(len(configs))
    width = 0.8 / max(1, len(policies))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), sharex=True)
    metrics = [("mean_response_s", "per-request response time (s)"),
               ("mean_service_s", "per-request service time (s)"),
               ("makespan_s", "total time, all writes (s)")]
    for ax, (metric, ylabel) in zip(axes, metrics):
        for i, p in enumerate(policies):
            vals = [agg.get((p, w, s), {}).get(metric, np.nan) for w, s in configs]
            ax.bar(x + (i - (len(policies) - 1) / 2) * width, vals, width, label=p)
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "Peace vs baselines (flow-level simulation, 17 servers, r = 3)")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
