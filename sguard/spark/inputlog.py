"""The input log (SGuard's HAInput, paper §3): each partition's input until a
durable checkpoint covers it.

DFS checkpoints lag behind Spark's commits, and Spark never replays a
committed batch, so after losing a host the state is rebuilt from the last
durable checkpoint plus the input since then. Each task writes its
partition's rows of batch ``b`` (the rows *after* Spark's shuffle, so exactly
what the operator consumed) before it reports success::

    <state-uri>/inputlog/b000000000042/g0-p0003.arrow     Arrow IPC file

One file per (batch, generation, partition), written even when empty, so a
replay can tell "no rows" from "missing" (`InputLogGapError`). The schema
metadata records the key column, the generation and the partition count.

Replay for partition ``q`` of a generation with ``P`` partitions reads its own
file when one exists; otherwise (a repartitioning moved keys, see
`sguard.statelayout`) it reads every file the batch has from the newest
generation that logged it (older ones' files of that batch are leftovers of a
run that never committed it) and keeps the rows whose key maps to ``q`` under
Spark's partitioner (``sguard.partitioning``), which moves the replay
position together with the keys.

Files are deleted (`trim`) once a durable checkpoint of the partition covers
their batch *and* the previous checkpoint does too, so falling back to the
previous checkpoint (a damaged latest one) still finds its input.
"""
from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ioservice import StorageRoot
from sguard.spark.errors import InputLogGapError

__all__ = ["INPUTLOG_DIR", "log_path", "write_input", "read_input", "trim", "logged_batches",
           "key_table"]

INPUTLOG_DIR = "inputlog"
_FILE_RE = re.compile(r"^g(?P<gen>\d+)-p(?P<part>\d{4,})\.arrow$")


def key_table(table: pa.Table, key: str | list[str]) -> pa.Table:
    """The key column(s) of `table`, in key order: what Spark's partitioner hashes
    (`sguard.partitioning.murmur3_hash` of a table chains over its columns)."""
    return table.select([key] if isinstance(key, str) else list(key))


def batch_dir(batch: int) -> str:
    return f"{INPUTLOG_DIR}/b{batch:012d}"


def log_path(batch: int, generation: int, partition: int) -> str:
    """Relative path of one (batch, generation, partition) log file."""
    return f"{batch_dir(batch)}/g{generation}-p{partition:04d}.arrow"


def write_input(root: StorageRoot, table: pa.Table, batch: int, generation: int, partition: int,
                num_partitions: int, key: str | list[str]) -> int:
    """Write the partition's input of `batch`; returns the bytes written.

    The file is written to a temporary name and then made visible atomically
    (`StorageRoot.write_atomic`), so a reader never sees half a file.
    """
    meta = {b"sguard.key": (key if isinstance(key, str) else json.dumps(list(key))).encode(), b"sguard.generation": str(generation).encode(),
            b"sguard.partition": str(partition).encode(),
            b"sguard.num_partitions": str(num_partitions).encode(),
            b"sguard.batch": str(batch).encode()}
    schema = table.schema.with_metadata({**(table.schema.metadata or {}), **meta})
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, schema) as w:
        w.write_table(table.replace_schema_metadata(schema.metadata))
    buf = sink.getvalue()
    root.write_atomic(log_path(batch, generation, partition), buf)
    return int(buf.size)


def _read(root: StorageRoot, relpath: str) -> pa.Table:
    data = root.read_bytes(relpath)
    return ipc.open_file(pa.py_buffer(data)).read_all()


def read_input(root: StorageRoot, batch: int, generation: int, partition: int,
               num_partitions: int, key: str | list[str]) -> pa.Table:
    """The rows partition `partition` (of `num_partitions`, generation `generation`)
    consumed in `batch`.

    Raises
    ------
    InputLogGapError
        If the batch has no log file the partition's rows can come from.
    """
    own = log_path(batch, generation, partition)
    entries = [e for e in root.list_dir(batch_dir(batch), allow_not_found=True) if not e.is_dir]
    names = {e.name: e for e in entries}
    if own.rsplit("/", 1)[1] in names:
        return _read(root, own)
    # the files of one generation only: the newest one (not above ours) that logged the
    # batch. A batch runs again under a newer generation only if the older one never
    # committed it (a query killed mid-batch, restarted with another partition count);
    # the older generation's files of it are then leftovers that must not count twice.
    gens = {e.name: int(m.group("gen")) for e in entries if (m := _FILE_RE.match(e.name))}
    newest = max((g for g in gens.values() if g <= generation), default=None)
    other = [e for e in entries if newest is not None and gens.get(e.name) == newest]
    if not other:
        raise InputLogGapError(
            f"input log of batch {batch} is missing at {root.full_path(batch_dir(batch))}: "
            f"partition {partition} cannot be rebuilt past its last durable checkpoint")
    from sguard import partitioning
    tables = [_read(root, e.relpath) for e in other]
    table = pa.concat_tables(tables)
    part = np.asarray(partitioning.partition_of(key_table(table, key), num_partitions))
    return table.filter(pa.array(part == partition))


def logged_batches(root: StorageRoot) -> list[int]:
    """Batches that have a log directory, ascending."""
    out = []
    for e in root.list_dir(INPUTLOG_DIR, allow_not_found=True):
        if e.is_dir and e.name.startswith("b") and e.name[1:].isdigit():
            out.append(int(e.name[1:]))
    return sorted(out)


def trim(root: StorageRoot, upto_batch: int, generation: int, partition: int,
         batches: list[int] | None = None) -> int:
    """Delete this partition's log files of batches ``<= upto_batch``; returns how many.

    Empty batch directories are removed too (best effort: another partition
    may be writing into one at the same time; a leftover empty directory is
    harmless).
    """
    n = 0
    for b in (batches if batches is not None else logged_batches(root)):
        if b > upto_batch:
            break
        rel = log_path(b, generation, partition)
        if root.exists(rel):
            root.delete_file(rel, missing_ok=True)
            n += 1
        try:
            if not root.list_dir(batch_dir(b), allow_not_found=True):
                root.delete_dir(batch_dir(b), missing_ok=True)
        except Exception:  # noqa: BLE001 - best effort
            pass
    return n


def describe(root: StorageRoot) -> dict[str, Any]:
    """Batches and files in the log (for ``sguard spark status``)."""
    batches = logged_batches(root)
    return {"batches": len(batches), "first": batches[0] if batches else None,
            "last": batches[-1] if batches else None}
