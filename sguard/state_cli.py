"""``sguard state repartition <state-uri> --partitions N``: scale an operator's state out or in.
``sguard state show <state-uri> [--batch-id B] [--limit N]``: print its first rows.
``sguard state convert <state-uri> [--key-groups K]``: convert a state written before key
groups (`sguard.convert`; exit status as ``repartition``'s).

Repartitions the checkpointed state of the operator under ``<state-uri>`` (see
`sguard.statelayout`) into N partitions by moving whole key groups: a Spark job
(``--master``, default ``local[2]``) with one task per new partition composes
its first checkpoint from the pages of its key groups (read only to verify
their checksums; nothing is copied), then the layout is committed as the next
generation (`sguard.rescale.repartition`, `sguard.spark.rescaling`). Partitions
a query's start-up repartition committed but no task has composed yet
(`sguard.rescale.uncomposed`) are composed first by the same kind of job, one
task per such partition; with N equal to the current count that is all it does.
A crash
leaves the old state in force; rerun the same command to complete. Restart
the Spark query with N partitions (or skip this command: ``stateful(...,
num_partitions=N)`` does the same at start-up).

Exit status: 0 done (or nothing to do), 1 storage failure mid-way (rerun),
2 bad input (nothing written).

``state show`` reads the durable state (`sguard.spark.reader`: the newest
checkpoint at or below the batch, plus the input log) with pyarrow only, one
partition after the other, without Spark and without disturbing a query
running on the same URI; it prints the rows of the first partitions until
``--limit`` rows (partition by partition, each in the operator's order).
Exit status: 0 shown, 1 storage failure, 2 bad argument or batch not available.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from ioservice.errors import IOServiceError

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``state repartition`` to the ``sguard`` command line."""
    p = subparsers.add_parser("state", help="operate on a stateful operator's state URI",
                              description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="state_command", required=True)
    rp = sub.add_parser("repartition", help="rewrite the state as N partitions (scale out/in)",
                        description=__doc__.splitlines()[0])
    rp.add_argument("uri", metavar="state-uri",
                    help="state URI: a path, file:///..., s3://bucket/prefix, hdfs://host:port/path")
    rp.add_argument("--partitions", type=int, required=True, metavar="N",
                    help="the new number of partitions (>= 1)")
    rp.add_argument("--master", default="local[2]",
                    help="the Spark master the repartition job runs on (default local[2])")
    rp.add_argument("--no-verify", dest="verify", action="store_false",
                    help="do not read the pages to check their checksums (manifests only)")
    rp.add_argument("--force", action="store_true",
                    help="write a new generation even if the state already has N partitions")
    rp.add_argument("--s3-endpoint", help="S3 endpoint (default $SGUARD_S3_ENDPOINT)")
    rp.set_defaults(func=_cmd_repartition)
    from sguard.cliargs import nonnegative_int, positive_int, set_validator
    cv = sub.add_parser("convert", help="convert a state written before key groups (layout "
                        "version 1) into the key-group layout",
                        description="Convert the state of a state URI written before key "
                                    "groups into the key-group layout, in place, as a new "
                                    "generation (same partition count). A crash leaves the "
                                    "old state in force; rerun to complete.")
    cv.add_argument("uri", metavar="state-uri",
                    help="state URI: a path, file:///..., s3://bucket/prefix, hdfs://host:port/path")
    cv.add_argument("--key-groups", type=positive_int, default=None, metavar="K",
                    help="the number of key groups: a multiple of the partition count, at most "
                         "32768 (default: 8 x the partition count); it bounds how far the "
                         "state can be scaled out")
    cv.add_argument("--s3-endpoint", help="S3 endpoint (default $SGUARD_S3_ENDPOINT)")
    cv.set_defaults(func=_cmd_convert)
    set_validator(cv, _validate_convert)
    sh = sub.add_parser("show", help="print the first rows of the durable state",
                        description="Print the first rows of the state at the newest durable "
                                    "batch (or --batch-id), one row per key (per key and "
                                    "window for window operators) plus partition_id.")
    sh.add_argument("uri", metavar="state-uri",
                    help="state URI: a path, file:///..., s3://bucket/prefix, hdfs://host:port/path")
    sh.add_argument("--batch-id", type=nonnegative_int, default=None, metavar="B",
                    help="the batch whose state to show (default: the newest durable one)")
    sh.add_argument("--limit", type=positive_int, default=20, metavar="N",
                    help="rows to print (default 20)")
    sh.add_argument("--s3-endpoint", help="S3 endpoint (default $SGUARD_S3_ENDPOINT)")
    sh.set_defaults(func=_cmd_show)


def _partitions(root: Any) -> int | None:
    from sguard.rescale import RescaleError
    from sguard.statelayout import LayoutError, read_layout
    try:
        lay = read_layout(root)
    except (LayoutError, IOServiceError, RescaleError):
        return None  # repartition names the fault
    return None if lay is None else lay.num_partitions


def _existing_root(args: argparse.Namespace, prog: str) -> Any:
    """The state URI's root, or None after one line on stderr (unreachable, or no such
    directory: nothing is created)."""
    from ioservice import open_root
    try:
        root = open_root(args.uri, create=False, s3_endpoint=args.s3_endpoint)
        if root.exists(""):
            return root
        msg = f"state URI {args.uri}: does not exist"
    except IOServiceError as exc:
        msg = str(exc)
    print(f"{prog}: {msg}", file=sys.stderr)
    return None


def _cmd_repartition(args: argparse.Namespace) -> int:
    from sguard.rescale import RescaleError, repartition, uncomposed
    from sguard.spark.rescaling import RepartitionJobError

    if args.partitions < 1:
        print(f"sguard state repartition: --partitions must be >= 1, got {args.partitions}",
              file=sys.stderr)
        return 2
    root = _existing_root(args, "sguard state repartition")
    if root is None:
        return 2
    try:
        from sguard.rescale import check
        check(root, args.partitions, force=args.force)  # every refusal before Spark starts
        # a start-up repartition's partitions no task has composed yet: composed first, as
        # a Spark job too (one task per partition), even when the count stays
        if args.partitions == _partitions(root) and not args.force and not uncomposed(root):
            res = repartition(root, args.partitions)  # nothing to do
        else:
            from sguard.spark.api import local_session
            from sguard.spark.rescaling import repartition_job
            spark = local_session(args.master, "sguard-repartition")
            try:
                res = repartition_job(spark, root, args.partitions, force=args.force,
                                      verify=args.verify,
                                      storage_options={"s3_endpoint": args.s3_endpoint}
                                      if args.s3_endpoint else None)
            finally:
                spark.stop()
    except RescaleError as exc:
        print(f"sguard state repartition: {exc}", file=sys.stderr)
        return 2
    except (IOServiceError, OSError, RepartitionJobError) as exc:
        print(f"sguard state repartition: failed, the previous state is still in force; "
              f"rerun to complete: {exc}", file=sys.stderr)
        return 1
    if not res.changed and res.composed:
        print(f"{args.uri}: already {res.num_partitions} partition(s) (generation "
              f"{res.generation}); composed the first checkpoint of {len(res.composed)} "
              f"partition(s) a start-up repartition left to their first task "
              f"({', '.join(map(str, res.composed))}) as a Spark job, in {res.seconds:.2f} s")
        return 0
    if not res.changed:
        print(f"{args.uri}: already {res.num_partitions} partition(s) (generation "
              f"{res.generation}); nothing to do (--force rewrites it)")
        return 0
    print(f"{args.uri}: {res.from_partitions} -> {res.num_partitions} partitions, generation "
          f"{res.generation}; whole key groups moved: {res.pages} pages "
          f"({res.state_bytes / 1e6:.1f} MB) re-referenced, {res.bytes_read / 1e6:.1f} MB "
          f"read to verify, 0 written, in {res.seconds:.2f} s"
          + (f" (first composed {len(res.composed)} partition(s) a start-up repartition "
             f"left uncomposed)" if res.composed else ""))
    return 0


def _validate_convert(args: argparse.Namespace) -> None:
    from sguard.cliargs import UsageError
    from sguard.keygroups import MAX_KEY_GROUPS
    if args.key_groups is not None and args.key_groups > MAX_KEY_GROUPS:
        raise UsageError(f"--key-groups must be at most {MAX_KEY_GROUPS}, got {args.key_groups}")


def _cmd_convert(args: argparse.Namespace) -> int:
    from sguard.convert import ConvertError, convert

    prog = "sguard state convert"
    root = _existing_root(args, prog)
    if root is None:
        return 2
    try:
        res = convert(root, args.key_groups)
    except ConvertError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except (IOServiceError, OSError) as exc:
        print(f"{prog}: failed, the previous state is still in force; rerun to complete: "
              f"{exc}", file=sys.stderr)
        return 1
    if not res.changed:
        print(f"{args.uri}: already in the key-group layout ({res.num_partitions} partition(s), "
              f"{res.key_groups} key groups, generation {res.generation}); nothing to do")
        return 0
    print(f"{args.uri}: converted to {res.key_groups} key groups over {res.num_partitions} "
          f"partition(s), generation {res.generation}: {res.rows} rows, "
          f"{res.bytes_read / 1e6:.1f} MB read, {res.bytes_written / 1e6:.1f} MB written, in "
          f"{res.seconds:.2f} s")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from ioservice import open_root
    from sguard.spark.reader import (BatchNotAvailableError, _available, _check_batch,
                                     read_partition_at)
    from sguard.statelayout import LayoutError, read_layout

    prog = "sguard state show"
    try:
        root = open_root(args.uri, create=False, s3_endpoint=args.s3_endpoint)
        layout = read_layout(root) if root.exists("") else None
        if layout is None:
            print(f"{prog}: error: no sguard operator state at {args.uri} "
                  f"(no sguard-operator.json)", file=sys.stderr)
            return 2
        rng = _available(root, layout)
        batch = rng[1] if args.batch_id is None else _check_batch(args.batch_id, rng, args.uri)
    except (BatchNotAvailableError, LayoutError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except (IOServiceError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    import pyarrow as pa
    parts, rows, total = [], 0, 0
    try:
        for p in range(layout.num_partitions):
            t = read_partition_at(root, layout, p, batch)
            total += t.num_rows
            if rows < args.limit:
                parts.append(t.slice(0, args.limit - rows))
                rows += parts[-1].num_rows
    except BatchNotAvailableError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except (IOServiceError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    table = pa.concat_tables(parts)
    print(f"{layout.operator} {layout.name!r} at {root.uri}: batch {batch} (durable "
          f"{rng[0]}..{rng[1]}), {layout.num_partitions} partition(s), {total} row(s); "
          f"first {table.num_rows}:")
    _print_table(table)
    return 0


def _print_table(table: Any) -> None:
    """Rows as aligned text columns."""
    names = table.column_names
    cols = [[str(v) for v in table.column(n).to_pylist()] for n in names]
    widths = [max([len(n)] + [len(v) for v in c]) for n, c in zip(names, cols)]
    print("  ".join(n.rjust(w) for n, w in zip(names, widths)))
    for i in range(table.num_rows):
        print("  ".join(c[i].rjust(w) for c, w in zip(cols, widths)))
