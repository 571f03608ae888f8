"""``sguard checkpoints ls|verify|show <uri>``: inspect the checkpoints under a storage root.

- ``ls`` lists HA units and their checkpoints with sizes and ages;
- ``verify`` reads every page of every restorable checkpoint (or of one) and
  checks its checksum; exit status 1 if any is damaged;
- ``show`` prints a manifest (the latest one, or a named checkpoint).

Exit status: 0 success, 1 damage found, 2 bad input, a root that does not
exist (it is never created) or unreachable storage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from ioservice.errors import CheckpointDamagedError, IOServiceError, StorageNotFoundError
from ioservice.format import Manifest, parse_checkpoint_name
from ioservice.fs import StorageRoot, open_root
from ioservice.recovery import CheckpointInfo, list_checkpoints, read_manifest, verify_checkpoint
from ioservice.service import IOService

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``checkpoints ls|verify|show`` to the ``sguard`` command line."""
    p = subparsers.add_parser("checkpoints", help="inspect checkpoints under a storage root",
                              description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="checkpoints_command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("uri", help="storage root: a path, file:///..., s3://bucket/prefix, "
                                    "hdfs://host:port/path")
        sp.add_argument("--haunit", help="only this HA unit")
        sp.add_argument("--s3-endpoint", help="S3 endpoint (default $SGUARD_S3_ENDPOINT)")

    ls = sub.add_parser("ls", help="list HA units and checkpoints with sizes and ages")
    common(ls)
    ls.add_argument("--all", action="store_true",
                    help="also list directories without a manifest (failed or expired)")
    ls.set_defaults(func=_cmd_ls)

    ver = sub.add_parser("verify", help="check every page checksum; exit 1 on damage")
    common(ver)
    ver.add_argument("--checkpoint", help="only this checkpoint (<haunit>-<seq>)")
    ver.add_argument("--workers", type=int, default=4, help="reader threads (default 4)")
    ver.set_defaults(func=_cmd_verify)

    show = sub.add_parser("show", help="print a manifest (default: the latest checkpoint)")
    common(show)
    show.add_argument("checkpoint", nargs="?", help="checkpoint name <haunit>-<seq>")
    show.add_argument("--pages", type=int, default=10, help="page-table rows to print (default 10)")
    show.add_argument("--json", action="store_true", help="print the raw manifest JSON")
    show.set_defaults(func=_cmd_show)


def _open(args: argparse.Namespace) -> StorageRoot:
    """Open an existing root; never creates it (inspection only).

    Raises
    ------
    StorageNotFoundError
        If the root does not exist (a mistyped path must not read as "no checkpoints").
    IOServiceError, ValueError
        From `open_root`.
    """
    root = open_root(args.uri, create=False, s3_endpoint=args.s3_endpoint)
    if not root.exists(""):
        raise StorageNotFoundError(f"storage root {root.uri} does not exist ({root.backend})")
    return root


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def _age(mtime_ns: int | None) -> str:
    if mtime_ns is None:
        return "?"
    s = max(0.0, time.time() - mtime_ns / 1e9)
    for unit, div in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= div:
            return f"{s / div:.1f}{unit}"
    return f"{s:.1f}s"


def _fail(msg: str, code: int = 2) -> int:
    print(f"sguard checkpoints: {msg}", file=sys.stderr)
    return code


def _cmd_ls(args: argparse.Namespace) -> int:
    try:
        root = _open(args)
        infos = list_checkpoints(root, args.haunit)
    except (IOServiceError, ValueError) as exc:
        return _fail(str(exc))
    if not infos:
        print(f"no checkpoints under {root.uri}")
        return 0
    by_unit: dict[str, list[CheckpointInfo]] = {}
    for c in infos:
        by_unit.setdefault(c.haunit, []).append(c)
    # read every unit's manifests first: a directory without a manifest may hold data
    # that another unit's checkpoint references (a composed checkpoint's sources)
    referenced: set[str] = set()
    table: list[tuple[str, list[CheckpointInfo], list[tuple[CheckpointInfo, str, str, str]]]] = []
    for unit, cs in by_unit.items():
        rows: list[tuple[CheckpointInfo, str, str, str]] = []
        for c in cs:
            kind, pages, state = "-", "-", "-"
            if c.has_manifest:
                try:
                    man = read_manifest(root, c.name)
                    kind = "full" if man.full else \
                        f"comp(+{man.depth})" if man.composed else f"incr(+{man.depth})"
                    pages, state = str(man.n_pages), _size(man.state_bytes)
                    referenced.update(man.referenced_checkpoints)
                except Exception as exc:  # noqa: BLE001 - a listing reports, never crashes
                    kind, state = "DAMAGED", type(exc).__name__
            rows.append((c, kind, pages, state))
        table.append((unit, cs, rows))
    for unit, cs, rows in table:
        damaged = sum(1 for _, kind, _, _ in rows if kind == "DAMAGED")
        readable = sum(1 for c, kind, _, _ in rows if c.has_manifest and kind != "DAMAGED")
        print(f"HA unit {unit}: {readable} checkpoint(s)"
              + (f", {damaged} damaged" if damaged else "")
              + f", {_size(sum(c.size_bytes for c in cs))} stored")
        print(f"  {'checkpoint':<28} {'kind':<12} {'pages':>8} {'state':>10} {'stored':>10} "
              f"{'age':>7}")
        for c, kind, pages, state in rows:
            if not c.has_manifest:
                if not args.all:
                    continue
                kind = "expired" if c.name in referenced else "partial"
                state = "(data kept)" if c.name in referenced else "(no manifest)"
            print(f"  {c.name:<28} {kind:<12} {pages:>8} {state:>10} {_size(c.size_bytes):>10} "
                  f"{_age(c.mtime_ns):>7}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    try:
        root = _open(args)
        if args.checkpoint:
            if parse_checkpoint_name(args.checkpoint) is None:
                return _fail(f"{args.checkpoint!r} is not a checkpoint name (<haunit>-<seq>)")
            names = [args.checkpoint]
        else:
            names = [c.name for c in list_checkpoints(root, args.haunit) if c.has_manifest]
    except (IOServiceError, ValueError) as exc:
        return _fail(str(exc))
    if not names:
        print(f"no checkpoints under {root.uri}")
        return 0
    damaged = 0
    with IOService(max(1, args.workers)) as io:
        for name in names:
            t0 = time.perf_counter()
            try:
                man = verify_checkpoint(root, name, io=io)
            except CheckpointDamagedError as exc:
                damaged += 1
                print(f"DAMAGED {name}: {exc}")
                continue
            except IOServiceError as exc:
                damaged += 1
                print(f"DAMAGED {name}: {exc}")
                continue
            print(f"ok      {name}: {man.n_pages} pages, {_size(man.state_bytes)} verified in "
                  f"{time.perf_counter() - t0:.2f} s")
    if damaged:
        print(f"{damaged} of {len(names)} checkpoint(s) damaged")
        return 1
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    try:
        root = _open(args)
        name = args.checkpoint
        if name is None:
            cs = [c for c in list_checkpoints(root, args.haunit) if c.has_manifest]
            units = sorted({c.haunit for c in cs})
            if not cs:
                return _fail(f"no checkpoints under {root.uri}", 1)
            if len(units) > 1:
                return _fail(f"several HA units ({', '.join(units)}): pass --haunit or a name")
            name = cs[-1].name
        elif parse_checkpoint_name(name) is None:
            return _fail(f"{name!r} is not a checkpoint name (<haunit>-<seq>)")
        if args.json:
            sys.stdout.write(root.read_bytes(f"checkpoint/{name}/manifest.json").decode("utf-8",
                                                                                       "replace"))
            sys.stdout.write("\n")
            return 0
        man = read_manifest(root, name)
    except CheckpointDamagedError as exc:
        return _fail(str(exc), 1)
    except (IOServiceError, ValueError) as exc:
        return _fail(str(exc))
    _print_manifest(man, args.pages)
    return 0


def _print_manifest(man: Manifest, n_rows: int) -> None:
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(man.created_unix_s))
    print(f"checkpoint      {man.name}")
    print(f"format_version  {man.format_version}")
    print(f"haunit / seq    {man.haunit} / {man.seq}  (snapshot {man.snapshot_id})")
    print(f"created         {created}")
    if man.composed:
        kind = f"composed from {', '.join(man.composed_from)}, depth {man.depth}"
    else:
        kind = 'full' if man.full else f'incremental, depth {man.depth}, base {man.base}'
    print(f"kind            {kind}")
    print(f"pages           {man.n_pages} x {man.page_bytes} B = {_size(man.state_bytes)}; "
          f"written here {man.n_pages_written} ({_size(man.written_bytes)})")
    seal = "and over the whole manifest" if man.format_version >= 2 else \
        "(format 1: the manifest itself is not checksummed)"
    print(f"checksum        {man.checksum_algo} per page {seal}")
    print(f"structures      {json.dumps(dict(man.structures), sort_keys=True)}")
    print(f"user_meta       {json.dumps(dict(man.user_meta), sort_keys=True)}")
    print(f"files           {len(man.files)}")
    counts: Any = np.bincount(man.pages.file, minlength=len(man.files)) if len(man.files) else []
    for i, f in enumerate(man.files):
        print(f"  [{i}] {f.path}  {_size(f.size_bytes)}  {int(counts[i])} page(s)")
    t = man.pages
    if n_rows and len(t):
        print(f"page table (first {min(n_rows, len(t))} of {len(t)} rows)")
        print(f"  {'page_id':>18} {'file':>5} {'offset':>12} {'checksum':>18}")
        for i in range(min(n_rows, len(t))):
            print(f"  {int(t.page_id[i]):#18x} {int(t.file[i]):>5} {int(t.offset[i]):>12} "
                  f"{int(t.checksum[i]):#018x}")
