"""Figure 10 in simulation with every baseline, then a 1000-server leaf-spine with background traffic.

``python -m bench.peace_fig10 [--quick]`` writes ``bench/results/peace_fig10.json``
(top-level ``summary``) and ``bench/results/peace_fig10.png``. Every number is
computed from runs made here: the simulator (peace.simulator) runs Peace (the
online coordinator with Algorithm 1) and the baselines on the same workloads;
the per-decision time is measured on Algorithm 1 itself over the 1000-server
request set (1 warm-up, then repeats; min/median/p90/max).

Targets (issue 4): on 16 x 512 MB, Peace's mean service time <= 0.45x HDFS,
makespan <= 1.10x, mean response time <= 0.8x; on 1000 servers with background
traffic, mean service time >= 1.3x faster than HDFS at equal or better
makespan, <= 5 ms per replica placement decision.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import _harness
from peace.experiment import aggregate, plot_figure10, run_grid
from peace.model import MB, leaf_spine_topology
from peace.scheduler import PeaceScheduler, WriteRequest
from peace.simulator import CALIBRATION, BackgroundTraffic, make_jobs, make_policy, simulate

NAME = "peace_fig10"


def _ratio(agg: dict, policy: str, base: str, key: tuple[int, int], metric: str) -> float:
    return agg[(policy, *key)][metric] / agg[(base, *key)][metric]


def run_large(writers: int, seeds: Sequence[int], background_flows: int,
              oversubscription: float) -> dict[str, Any]:
    """The 1000-server leaf-spine experiment: HDFS, admission-only and Peace."""
    topo = leaf_spine_topology(oversubscription=oversubscription, snd_up_chunks=None)
    bg = BackgroundTraffic(background_flows, rate_cap_bytes_per_s=60 * MB, seed=11)
    runs: dict[str, list[dict[str, float]]] = {"hdfs": [], "admission": [], "peace": []}
    for seed in seeds:
        jobs = make_jobs(topo, writers, 512 * MB, seed=seed)
        for policy in runs:
            res = simulate(topo, jobs, make_policy(policy, seed=seed, admission_cap=writers // 4),
                           background=bg)
            runs[policy].append(res.summary())
            print(f"  1000 servers seed {seed} {policy:9s} service {res.mean_service_s:6.2f}s "
                  f"response {res.mean_response_s:6.2f}s makespan {res.makespan_s:6.2f}s "
                  f"(sim {res.wall_s:.1f}s)", flush=True)
    mean = {p: {m: float(np.mean([r[m] for r in v])) for m in v[0]} for p, v in runs.items()}
    return {"topology": topo.name, "servers": len(topo.servers), "writers": writers,
            "background_flows": background_flows, "oversubscription": oversubscription,
            "runs": runs, "mean": mean}


def time_decisions(writers: int, repeats: int) -> dict[str, Any]:
    """Wall time per replica placement decision of Algorithm 1 on the 1000-server fabric."""
    topo = leaf_spine_topology(snd_up_chunks=None)
    names = topo.servers[:: max(1, len(topo.servers) // writers)][:writers]
    reqs = [WriteRequest(w, 3, 8, i) for i, w in enumerate(names)]
    per_decision: list[float] = []
    decisions = 0
    for i in range(repeats + 1):
        sched = PeaceScheduler(topo, seed=i)
        t0 = time.perf_counter()
        sched.schedule_timestep(reqs, sched.network.new_residual())
        dt = time.perf_counter() - t0
        n = sched.stats().decisions
        if i > 0:  # the first run warms up
            per_decision.append(dt / n)
            decisions = n
    st = _harness.stats(per_decision)
    return {"decisions_per_timestep": decisions, "seconds_per_decision": st,
            "ms_per_decision_median": st["median"] * 1000}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0."""
    ap = argparse.ArgumentParser(prog="python -m bench.peace_fig10", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer seeds and writers (CI, ~1 min)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per configuration")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    seeds = list(range(args.seeds if args.seeds is not None else (2 if args.quick else 5)))
    big_writers = 200 if args.quick else 400
    big_seeds = seeds[:1] if args.quick else seeds[:3]

    print(f"Figure 10 grid, seeds {seeds}", flush=True)
    rows = run_grid(seeds=seeds)
    agg = aggregate(rows)
    key = (16, 512)
    for p in ("peace", "peace-paper-caps", "random", "admission", "hdfs"):
        a = agg[(p, *key)]
        print(f"  16x512MB {p:17s} response {a['mean_response_s']:6.2f}s service "
              f"{a['mean_service_s']:6.2f}s makespan {a['makespan_s']:6.2f}s", flush=True)

    print(f"1000 servers, {big_writers} writers x 512 MB, seeds {big_seeds}", flush=True)
    large = run_large(big_writers, big_seeds, background_flows=300, oversubscription=4.0)
    timing = time_decisions(big_writers, repeats=3 if args.quick else 5)
    lm = large["mean"]

    summary = {
        "service_ratio_vs_hdfs_16x512": _ratio(agg, "peace", "hdfs", key, "mean_service_s"),
        "makespan_ratio_vs_hdfs_16x512": _ratio(agg, "peace", "hdfs", key, "makespan_s"),
        "response_ratio_vs_hdfs_16x512": _ratio(agg, "peace", "hdfs", key, "mean_response_s"),
        "service_speedup_1000": lm["hdfs"]["mean_service_s"] / lm["peace"]["mean_service_s"],
        "makespan_ratio_vs_hdfs_1000": lm["peace"]["makespan_s"] / lm["hdfs"]["makespan_s"],
        "ms_per_decision_1000": timing["ms_per_decision_median"],
        "paper_caps_service_ratio_vs_hdfs_16x512":
            _ratio(agg, "peace-paper-caps", "hdfs", key, "mean_service_s"),
        "paper_caps_makespan_ratio_vs_hdfs_16x512":
            _ratio(agg, "peace-paper-caps", "hdfs", key, "makespan_s"),
        "paper_caps_response_ratio_vs_hdfs_16x512":
            _ratio(agg, "peace-paper-caps", "hdfs", key, "mean_response_s"),
        "admission_service_ratio_vs_hdfs_16x512":
            _ratio(agg, "admission", "hdfs", key, "mean_service_s"),
        "admission_makespan_ratio_vs_hdfs_16x512":
            _ratio(agg, "admission", "hdfs", key, "makespan_s"),
        "hdfs_mean_response_s_16x512": agg[("hdfs", *key)]["mean_response_s"],
        "hdfs_makespan_s_16x512": agg[("hdfs", *key)]["makespan_s"],
    }
    s = summary
    summary["targets_met"] = {
        "service_ratio_16x512<=0.45": s["service_ratio_vs_hdfs_16x512"] <= 0.45,
        "makespan_ratio_16x512<=1.10": s["makespan_ratio_vs_hdfs_16x512"] <= 1.10,
        "response_ratio_16x512<=0.8": s["response_ratio_vs_hdfs_16x512"] <= 0.8,
        "service_speedup_1000>=1.3": s["service_speedup_1000"] >= 1.3,
        "makespan_1000_equal_or_better": s["makespan_ratio_vs_hdfs_1000"] <= 1.0,
        "ms_per_decision_1000<=5": s["ms_per_decision_1000"] <= 5.0,
    }
    params = {"quick": args.quick, "seeds": seeds, "grid_writers": [8, 12, 16],
              "grid_sizes_mb": [128, 256, 512], "calibration": CALIBRATION,
              "large_writers": big_writers, "large_seeds": big_seeds}
    data = {"grid": [r.to_dict() for r in rows],
            "grid_mean": [{"policy": k[0], "writers": k[1], "size_mb": k[2], **v}
                          for k, v in agg.items()],
            "large": large, "decision_timing": timing,
            "wall_s": time.perf_counter() - t_start}
    path = _harness.write_result(NAME, summary, data, params)

    plt, png = _harness.figure(NAME)
    fig = plot_figure10(rows, title="Figure 10 in simulation: 17 servers (9+8), r = 3, "
                                    f"{len(seeds)} seeds")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"wrote {path} and {png} in {time.perf_counter() - t_start:.1f}s")
    for k, v in summary.items():
        print(f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
