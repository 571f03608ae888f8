"""Figure 10 experiments: run policies over a grid of workloads and plot them.

Shared by ``bench/peace_fig10.py``, ``sguard peace simulate`` and the notebook
``notebooks/peace_simulation.ipynb``, so all three report the same thing.

Every Peace variant schedules on the paper's network model (§6.2: capacity 2
on SND->UP and on DN->RCV; the inter-rack link gets 5 chunks per timestep, its
bandwidth over the disks'):

* ``peace``: the improved scheduler (default; see :mod:`peace.scheduler` for
  exactly what differs from the paper);
* ``peace-paper``: Algorithm 1 as published;
* ``peace-mcf``: each timestep planned by a min-cost flow (:mod:`peace.mcf`).

Baselines (they ignore capacities):

* ``hdfs``: HDFS default placement, 1 pipeline per writer (a DFS output
  stream writes its blocks in turn);
* ``hdfs-fair``: HDFS default placement with the *same concurrency per
  writer as Peace* (the SND->UP capacity, 2 on the paper's model): the like-
  for-like comparison, reported first;
* ``random``: random placement; ``admission``: HDFS with at most 4 requests
  writing at once.

Extra variants (:data:`EXTRA_POLICIES`, not in the default grid or plot):

* ``peace-fill``: the improved scheduler without the whole-requests rule;
* ``peace-paper-nic5``: Algorithm 1 as published on a model whose SND->UP
  capacity is derived from the simulated NIC bandwidth instead (5 chunks per
  timestep for 125 MB/s against 45 MB/s disks) -- an earlier calibration, kept
  only to show how much of the published algorithm's shortfall the
  conservative capacity 2 causes.

Every policy sees the same simulated bandwidths (see
:data:`peace.simulator.CALIBRATION`). :func:`fluid_bounds` gives lower bounds
on makespan and service time that no policy can beat in the simulator.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from peace.model import MB, Topology, paper_topology
from peace.simulator import BackgroundTraffic, make_jobs, make_policy, simulate

__all__ = ["Row", "FIG10_POLICIES", "EXTRA_POLICIES", "ALL_POLICIES", "PEACE_POLICIES",
           "run_grid", "aggregate", "plot_figure10", "fluid_bounds"]

#: the Peace variants of the default grid
PEACE_POLICIES = ("peace", "peace-paper", "peace-mcf")
#: the default grid: the Peace variants on the paper's capacities, and the baselines
FIG10_POLICIES = (*PEACE_POLICIES, "hdfs-fair", "hdfs", "random", "admission")
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
    replication: int = 3
    decision_s: float = 0.0
    """Simulated seconds charged for Peace's decisions (0 for the baselines)."""

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
                    pol = make_policy(_sim_policy(policy), seed=seed, admission_cap=admission_cap,
                                      fair_streams=topo.snd_up_chunks)
                    res = simulate(topo, jobs, pol, background=background)
                    rows.append(Row(policy, w, size, seed, res.mean_response_s,
                                    res.mean_service_s, res.makespan_s, res.ms_per_decision,
                                    replication, res.decision_s))
                    if on_progress is not None:
                        on_progress(len(rows), total)
    return rows


def aggregate(rows: Sequence[Row], replication: int | None = None
              ) -> dict[tuple[str, int, int], dict[str, float]]:
    """Mean over seeds of each metric, keyed by ``(policy, writers, size_mb)``.

    ``replication``: keep only rows of that replication level (default: all rows,
    which must then share one level).

    Raises
    ------
    ValueError
        If ``replication`` is None and the rows mix replication levels.
    """
    if replication is not None:
        rows = [r for r in rows if r.replication == replication]
    elif len({r.replication for r in rows}) > 1:
        raise ValueError("rows mix replication levels; pass replication=")
    groups: dict[tuple[str, int, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.policy, r.writers, r.size_mb), []).append(r)
    return {k: {"mean_response_s": float(np.mean([r.mean_response_s for r in v])),
                "mean_service_s": float(np.mean([r.mean_service_s for r in v])),
                "makespan_s": float(np.mean([r.makespan_s for r in v])),
                "decision_s": float(np.mean([r.decision_s for r in v])),
                "runs": len(v)} for k, v in groups.items()}


def fluid_bounds(topology: Topology, writers: int, size_bytes: int, replication: int
                 ) -> dict[str, float]:
    """Fluid lower bounds for ``writers`` x ``size_bytes`` written at t = 0 (writers spread
    round-robin over the racks, rack-aware placement, no local replica).

    * ``disk_s``: all ``r`` copies over the sum of the disk bandwidths;
    * ``nic_s``: each chunk is sent ``r`` times (writer, then ``r - 1`` forwards),
      over the sum of the NIC send bandwidths;
    * ``interrack_s``: every chunk crosses from its writer's rack at least once
      (the second replica is in another rack), so each rack's uplink carries its
      writers' bytes; the busiest rack's bytes over its link bandwidth (racks
      with one link each, as in the paper's topology; 0 otherwise);
    * ``makespan_s``: the largest of the three;
    * ``service_s``: one request alone at the rate ``streams`` pipelines get
      when each chunk is limited by one disk shared ``dn_rcv_chunks`` ways
      (Peace's model), ``size / (streams * disk / dn_rcv_chunks)`` -- the
      service time Peace's capacities allow, not a bound for every policy.

    >>> from peace.model import paper_topology, MB
    >>> b = fluid_bounds(paper_topology(), 16, 512 * MB, 3)
    >>> round(b["disk_s"], 1), round(b["interrack_s"], 1)
    (32.1, 32.8)
    """
    from peace.simulator import spread_writers

    t = topology
    n = len(t.servers)
    total = writers * size_bytes
    disk_s = total * replication / (n * t.disk_bytes_per_s)
    nic_s = total * replication / (n * t.nic_bytes_per_s)
    inter = 0.0
    if len(t.racks) > 1:
        per_rack: dict[str, int] = {}
        for w in spread_writers(t, writers):
            per_rack[t.rack_of(w).switch] = per_rack.get(t.rack_of(w).switch, 0) + size_bytes
        for sw, nbytes in per_rack.items():
            links = [l for l in t.links if sw in (l.a, l.b)]
            if len(links) == 1:
                inter = max(inter, nbytes / links[0].bandwidth_bytes_per_s)
    streams = t.snd_up_chunks
    service = size_bytes / (streams * t.disk_bytes_per_s / t.dn_rcv_chunks)
    return {"disk_s": disk_s, "nic_s": nic_s, "interrack_s": inter,
            "makespan_s": max(disk_s, nic_s, inter), "peace_model_service_s": service}


def plot_figure10(rows: Sequence[Row], path: str | None = None, *, title: str | None = None) -> Any:
    """Figure 10 as bars: per-request time (response and service) and total time (makespan).

    Returns the matplotlib figure; writes a PNG if ``path`` is given (Agg backend).
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r.replication for r in rows}, reverse=True)
    fig, axes_grid = plt.subplots(len(levels), 3, figsize=(16, 4.8 * len(levels)), squeeze=False)
    metrics = [("mean_response_s", "per-request response time (s)"),
               ("mean_service_s", "per-request service time (s)"),
               ("makespan_s", "total time, all writes (s)")]
    for level, axes in zip(levels, axes_grid):
        agg = aggregate(rows, level)
        policies = [p for p in ALL_POLICIES if any(k[0] == p for k in agg)]
        configs = sorted({(k[1], k[2]) for k in agg})
        labels = [f"{w}x{s}MB" for w, s in configs]
        x = np.arange(len(configs))
        width = 0.8 / max(1, len(policies))
        for ax, (metric, ylabel) in zip(axes, metrics):
            for i, p in enumerate(policies):
                vals = [agg.get((p, w, s), {}).get(metric, np.nan) for w, s in configs]
                ax.bar(x + (i - (len(policies) - 1) / 2) * width, vals, width, label=p,
                       hatch="//" if p == "hdfs-fair" else None)
            ax.set_xticks(x)
            ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
            ax.set_ylabel(f"r = {level}: {ylabel}")
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend(fontsize=8)
    fig.suptitle(title or "Peace vs baselines (flow-level simulation, 17 servers); hdfs-fair: "
                          "HDFS with Peace's per-writer concurrency")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
