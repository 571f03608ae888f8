"""``sguard peace ...``: simulate Figure 10, print a schedule, serve the coordinator.

Subcommands:

* ``sguard peace simulate [--writers 8 12 16] [--sizes-mb 128 256 512] [--policies ...]
  [--seeds N] [--plot out.png] [--json out.json]``: the Figure 10 experiment with a
  progress bar;
* ``sguard peace schedule --topology {figure5,paper,PATH.json} --request W,R,K ...
  [--variant {improved,paper}]``: run the scheduler offline and print (and
  validate) the schedule;
* ``sguard peace serve [--host 127.0.0.1] [--port 0] [--topology ...] [--variant ...]``:
  the local coordinator service (runs until interrupted, or ``--serve-s`` seconds).

``--variant improved`` (default) is the improved scheduler, ``paper`` Algorithm 1
as published (see :mod:`peace.scheduler`), ``mcf`` the min-cost-flow variant
(:mod:`peace.mcf`). ``simulate --policies`` includes the fair baseline
``hdfs-fair`` (HDFS with Peace's per-writer concurrency) and ``--replication 2 3``.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from typing import Any

from peace.argtypes import fraction, nonnegative_int, output_file, port, positive_float, positive_int
from peace.errors import PeaceError
from peace.model import Topology, figure5_topology, paper_topology

__all__ = ["register", "load_topology"]


def load_topology(spec: str) -> Topology:
    """``figure5``, ``paper`` (capacity 2), ``paper-bw`` (bandwidth-derived) or a JSON file.

    Raises
    ------
    MalformedTopologyError
        If the JSON file does not describe a valid topology.
    FileNotFoundError
        If the file does not exist.
    """
    if spec == "figure5":
        return figure5_topology()
    if spec == "paper":
        return paper_topology()
    if spec == "paper-bw":
        return paper_topology(snd_up_chunks=None)
    with open(spec, encoding="utf-8") as fh:
        return Topology.from_dict(json.load(fh))


def _cmd_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from peace.experiment import Row, aggregate, plot_figure10, run_grid

    n_servers = len(paper_topology().servers)
    if max(args.writers) > n_servers:
        print(f"sguard peace simulate: error: argument --writers: at most {n_servers} (the "
              f"paper topology's servers), got {max(args.writers)}", file=sys.stderr)
        return 2
    seeds = list(range(args.seeds))
    levels = list(dict.fromkeys(args.replication))
    total = len(args.writers) * len(args.sizes_mb) * len(args.policies) * len(seeds) * len(levels)
    with tqdm(total=total, desc="peace simulate", unit="run", disable=args.no_progress) as bar:
        def progress(done: int, _total: int) -> None:
            bar.update(done - bar.n)

        rows: list[Row] = []
        try:
            for r in levels:
                base = len(rows)

                def progress_r(done: int, _total: int, base: int = base) -> None:
                    progress(base + done, total)

                rows += run_grid(args.writers, args.sizes_mb, args.policies, seeds,
                                 replication=r, on_progress=progress_r)
        except (ValueError, PeaceError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(f"{'r':>2s} {'policy':18s} {'writers':>7s} {'size_mb':>7s} {'response_s':>10s} "
          f"{'service_s':>9s} {'makespan_s':>10s}")
    for r in levels:
        agg = aggregate(rows, r)
        for (policy, w, size), m in sorted(agg.items(),
                                           key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
            fair = agg.get(("hdfs-fair", w, size))
            vs = "" if fair is None or policy == "hdfs-fair" else (
                f"  vs hdfs-fair: service x{m['mean_service_s'] / fair['mean_service_s']:.2f} "
                f"makespan x{m['makespan_s'] / fair['makespan_s']:.2f} "
                f"response x{m['mean_response_s'] / fair['mean_response_s']:.2f}")
            print(f"{r:2d} {policy:18s} {w:7d} {size:7d} {m['mean_response_s']:10.2f} "
                  f"{m['mean_service_s']:9.2f} {m['makespan_s']:10.2f}{vs}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": [r.to_dict() for r in rows]}, fh, indent=1)
    if args.plot:
        plot_figure10(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _parse_request(text: str) -> tuple[str, int, int]:
    try:
        writer, r, k = text.split(",")
        return writer, int(r), int(k)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a request is WRITER,R,K, got {text!r}") from None


def _cmd_schedule(args: argparse.Namespace) -> int:
    from peace.placement import WriteRequest
    from peace.variants import make_scheduler
    from peace.validate import validate_schedule

    try:
        topo = load_topology(args.topology)
        sched = make_scheduler(topo, seed=args.seed, variant=args.variant)
        reqs = [WriteRequest(w, r, k, i) for i, (w, r, k) in enumerate(args.request)]
        schedule = sched.schedule(reqs)
        report = validate_schedule(sched.network, reqs, schedule.placements)
    except (PeaceError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for pl in schedule.placements:
        print(f"t={pl.timestep} request {pl.request_id} chunk {pl.chunk_index}: "
              f"{' -> '.join(pl.servers)} (cost {pl.cost})")
    print(f"{report.chunks} chunks in {report.timesteps} timesteps, total cost "
          f"{report.total_cost}; certificate valid")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from peace.coordinator import Coordinator
    from peace.service import CoordinatorServer

    try:
        topo = load_topology(args.topology)
        server = CoordinatorServer(Coordinator(topo, seed=args.seed, variant=args.variant,
                                               advance_fraction=args.advance_fraction,
                                               max_pending_requests=args.max_pending,
                                               work_conserving=args.work_conserving),
                                   host=args.host, port=args.port)
    except (PeaceError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with server:
        host, port = server.address
        print(f"peace coordinator on {host}:{port} ({topo.name})", flush=True)
        deadline: Any = None if args.serve_s is None else time.monotonic() + args.serve_s
        try:
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.1)
        except KeyboardInterrupt:
            pass
    return 0


_SIMULATE_EPILOG = """\
example:
  sguard peace simulate --writers 8 --sizes-mb 128 --plot fig10.png   # about a minute
  sguard peace simulate --writers 8 12 16 --sizes-mb 128 256 512 --seeds 3 --json runs.json
"""

_SCHEDULE_EPILOG = """\
example:
  sguard peace schedule --request svr1.1,2,1 --request svr2.1,2,1
  sguard peace schedule --topology paper --variant paper --request svr1.1,3,4
"""

_SERVE_EPILOG = """\
example:
  sguard peace serve --port 7077            # until Ctrl-C
  sguard peace serve --serve-s 60           # any free port, for one minute
"""


def register(subparsers: Any) -> None:
    """Add the ``peace`` subcommand (and its leaves) to the top-level ``sguard`` parser."""
    from peace.experiment import ALL_POLICIES, FIG10_POLICIES
    from peace.variants import SCHEDULER_VARIANTS

    raw = argparse.RawDescriptionHelpFormatter
    peace = subparsers.add_parser(
        "peace", help="Peace DFS write scheduler: simulate, schedule, serve",
        description=textwrap.fill(
            "The Peace scheduler of replicated DFS writes (SGuard section 5): simulate "
            "Figure 10, print a schedule, or serve the online coordinator."),
        epilog="example:\n  sguard peace simulate --writers 8 --sizes-mb 128 --plot fig10.png",
        formatter_class=raw)
    sub = peace.add_subparsers(dest="peace_command", required=True, metavar="COMMAND",
                               title="commands")

    sim = sub.add_parser(
        "simulate", help="Figure 10 in simulation (Peace vs baselines)",
        description=textwrap.fill(
            "Simulate every (writers, size, policy, seed) combination on the paper's "
            "17-server topology and print mean response, service time and makespan; "
            "optionally plot Figure 10. All outputs are checked before the simulation "
            "starts."), epilog=_SIMULATE_EPILOG, formatter_class=raw)
    sim.add_argument("--writers", type=positive_int, nargs="+", default=[8, 12, 16],
                     help="numbers of concurrent writers, at most 17 (default: %(default)s)")
    sim.add_argument("--sizes-mb", type=positive_int, nargs="+", default=[128, 256, 512],
                     help="checkpoint size per writer in MB (default: %(default)s)")
    sim.add_argument("--policies", nargs="+", default=list(FIG10_POLICIES), choices=ALL_POLICIES,
                     help="peace = improved scheduler, peace-paper = Algorithm 1 as published, "
                          "peace-mcf = min-cost-flow plan per timestep (all on the paper's "
                          "capacity 2); hdfs-fair = HDFS with Peace's per-writer concurrency "
                          "(2 pipelines), hdfs = 1 pipeline per writer; default: %(default)s")
    sim.add_argument("--replication", type=int, nargs="+", default=[3], choices=[1, 2, 3, 4],
                     help="replication levels to simulate (default: %(default)s)")
    sim.add_argument("--seeds", type=positive_int, default=1,
                     help="runs per configuration (default %(default)s)")
    sim.add_argument("--plot", metavar="PNG", type=output_file,
                     help="write the Figure 10 plot here (its directory must exist)")
    sim.add_argument("--json", metavar="PATH", type=output_file,
                     help="write every run as JSON here (its directory must exist)")
    sim.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    sim.set_defaults(func=_cmd_simulate)

    sch = sub.add_parser(
        "schedule", help="run the scheduler offline and print the schedule",
        description=textwrap.fill(
            "Schedule the given write requests once, print each chunk's pipeline and "
            "check the schedule with the independent validator."),
        epilog=_SCHEDULE_EPILOG, formatter_class=raw)
    sch.add_argument("--topology", default="figure5",
                     help="figure5, paper, paper-bw or a JSON topology file (default %(default)s)")
    sch.add_argument("--request", type=_parse_request, action="append", required=True,
                     metavar="WRITER,R,K",
                     help="a write request: writer server, replication R, chunks K (repeatable)")
    sch.add_argument("--seed", type=nonnegative_int, default=0,
                     help="tie-breaking seed (default %(default)s)")
    sch.add_argument("--variant", choices=SCHEDULER_VARIANTS, default="improved",
                     help="improved (default), paper (Algorithm 1 as published) or mcf "
                          "(min-cost-flow plan per timestep)")
    sch.set_defaults(func=_cmd_schedule)

    srv = sub.add_parser(
        "serve", help="serve the online coordinator on a local TCP port",
        description=textwrap.fill(
            "Serve the online Peace coordinator (JSON lines over TCP) until interrupted "
            "or for --serve-s seconds."), epilog=_SERVE_EPILOG, formatter_class=raw)
    srv.add_argument("--topology", default="paper",
                     help="figure5, paper, paper-bw or a JSON topology file (default %(default)s)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    srv.add_argument("--port", type=port, default=0,
                     help="TCP port, 0 = any free port (default %(default)s)")
    srv.add_argument("--seed", type=nonnegative_int, default=0,
                     help="tie-breaking seed (default %(default)s)")
    srv.add_argument("--variant", choices=SCHEDULER_VARIANTS, default="improved",
                     help="improved (default), paper (Algorithm 1 as published) or mcf "
                          "(min-cost-flow plan per timestep)")
    srv.add_argument("--advance-fraction", type=fraction, default=0.8,
                     help="fraction of a timestep's chunks done before the next one is "
                          "scheduled, in (0, 1] (default %(default)s)")
    srv.add_argument("--work-conserving", action="store_true",
                     help="no timestep barrier: every completion schedules pending chunks into "
                          "the capacity chunks in flight do not hold")
    srv.add_argument("--max-pending", type=positive_int, default=None,
                     help="refuse new requests beyond this many pending (default: no limit)")
    srv.add_argument("--serve-s", type=positive_float, default=None,
                     help="stop after this many seconds (default: run until Ctrl-C)")
    srv.set_defaults(func=_cmd_serve)
