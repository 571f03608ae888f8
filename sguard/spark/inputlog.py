"""The input log (SGuard's HAInput, paper §3): each partition's input until a
durable checkpoint covers it.

DFS checkpoints lag behind Spark's commits, and Spark never replays a
committed batch, so after losing a host the state is rebuilt from the last
durable checkpoint plus the input since then. Each task writes its
partition's rows of batch ``b`` (the rows *after* Spark's shuffle, so exactly
what the operator consumed) before it reports success::

    <state-uri>/inputlog/b000000000042/g0-p0003-e7.arrow     Arrow IPC file

One file per (batch, generation, partition, epoch), written even when empty,
so a replay can tell "no rows" from "missing" (`InputLogGapError`). The epoch
is the writer's ownership epoch (`sguard.spark.fencing`): writers of
different epochs never write the same file, and a replay takes, of the files
of a batch that count (`sguard.spark.fencing.FenceView.log_valid`), the one
of the highest epoch. Files without an epoch (``g0-p0003.arrow``, written
before fencing existed) are epoch 0. The schema metadata records the key
column, the generation, the partition count and the epoch.
For an operator with a processing-time TTL the metadata also records the
batch's processing time (``sguard.batch_time_ms``, `sguard.spark.ttl`): taken
when the partition's batch is first run, read back by a retry
(`recorded_batch_time_ms`) and by a replay, so every run of the batch evicts
the same keys.

Replay for partition ``q`` of a generation with ``P`` partitions reads its own
file when one exists; otherwise (a repartitioning moved keys, see
`sguard.statelayout`) it reads every file the batch has from the newest
generation that logged it (older ones' files of that batch are leftovers of a
run that never committed it; of each source partition the highest epoch) and
keeps the rows whose key group (the logged ``_sguard_kg`` column,
`sguard.spark.groupstate`; computed from the key columns for files written before
key groups, which a state converted by ``sguard state convert`` replays) ``q`` owns,
which moves the replay position together with the key groups.

Files are deleted (`trim`) once a durable checkpoint of the partition covers
their batch *and* the previous checkpoint does too, so falling back to the
previous checkpoint (a damaged latest one) still finds its input. Each trim
records how far it went (``inputlog/trimmed/g<gen>-p<part>.json``); files of
*older* generations (left by a repartitioning, read by several new
partitions) are deleted once every partition of the current generation has
trimmed past their batch.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ioservice import StorageRoot, faultpoints
from sguard.keygroups import key_group_of, owner_of
from sguard.spark.columns import KG_COLUMN
from sguard.spark.errors import InputLogGapError
from sguard.spark.fencing import FenceView

__all__ = ["INPUTLOG_DIR", "log_path", "write_input", "read_input", "trim", "logged_batches",
           "recorded_batch_time_ms", "key_table", "own_files", "LogFile"]

INPUTLOG_DIR = "inputlog"
TRIMMED_DIR = f"{INPUTLOG_DIR}/trimmed"
_FILE_RE = re.compile(r"^g(?P<gen>\d+)-p(?P<part>\d{4,})(?:-e(?P<epoch>\d+))?\.arrow$")


@dataclass(frozen=True)
class LogFile:
    batch: int
    generation: int
    partition: int
    epoch: int
    relpath: str


def key_table(table: pa.Table, key: str | list[str]) -> pa.Table:
    """The key column(s) of `table`, in key order: what Spark's partitioner hashes
    (`sguard.partitioning.murmur3_hash` of a table chains over its columns)."""
    return table.select([key] if isinstance(key, str) else list(key))


def batch_dir(batch: int) -> str:
    return f"{INPUTLOG_DIR}/b{batch:012d}"


def log_path(batch: int, generation: int, partition: int, epoch: int = 0) -> str:
    """Relative path of one (batch, generation, partition, epoch) log file (epoch 0: the
    name files had before fencing)."""
    tail = f"-e{epoch}" if epoch else ""
    return f"{batch_dir(batch)}/g{generation}-p{partition:04d}{tail}.arrow"


def _parse(batch: int, name: str, relpath: str) -> LogFile | None:
    m = _FILE_RE.match(name)
    if m is None:
        return None
    return LogFile(batch, int(m["gen"]), int(m["part"]), int(m["epoch"] or 0), relpath)


def write_input(root: StorageRoot, table: pa.Table, batch: int, generation: int, partition: int,
                num_partitions: int, key: str | list[str], epoch: int = 0) -> int:
    """Write the partition's input of `batch` as epoch `epoch`; returns the bytes written.

    The file is written to a temporary name and then made visible atomically
    (`StorageRoot.write_atomic`), so a reader never sees half a file. Only the
    holder of `epoch` writes names of that epoch (a retry of the same batch
    under the same epoch rewrites the same rows).
    """
    meta = {b"sguard.key": (key if isinstance(key, str) else json.dumps(list(key))).encode(), b"sguard.generation": str(generation).encode(),
            b"sguard.partition": str(partition).encode(),
            b"sguard.num_partitions": str(num_partitions).encode(),
            b"sguard.batch": str(batch).encode(), b"sguard.epoch": str(epoch).encode()}
    schema = table.schema.with_metadata({**(table.schema.metadata or {}), **meta})
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, schema) as w:
        w.write_table(table.replace_schema_metadata(schema.metadata))
    buf = sink.getvalue()
    faultpoints.reached("inputlog")
    root.write_atomic(log_path(batch, generation, partition, epoch), buf)
    return int(buf.size)


def _read(root: StorageRoot, relpath: str) -> pa.Table:
    data = root.read_bytes(relpath)
    return ipc.open_file(pa.py_buffer(data)).read_all()


def _best(files: list[LogFile], fence: FenceView | None) -> LogFile | None:
    """The file that counts: the highest epoch among the valid ones."""
    ok = [f for f in files if fence is None or fence.log_valid(f.epoch, f.batch)]
    return max(ok, key=lambda f: f.epoch) if ok else None


def _all_files(root: StorageRoot) -> Iterator[LogFile]:
    """Every log file under the state URI (one recursive listing)."""
    for e in root.list_dir(INPUTLOG_DIR, recursive=True, allow_not_found=True):
        parts = e.relpath.split("/")
        if e.is_dir or len(parts) != 3 or not parts[1].startswith("b") \
                or not parts[1][1:].isdigit():
            continue
        f = _parse(int(parts[1][1:]), parts[2], e.relpath)
        if f is not None:
            yield f


def own_files(root: StorageRoot, generation: int, partition: int) -> dict[int, list[LogFile]]:
    """The partition's own log files by batch (one recursive listing)."""
    out: dict[int, list[LogFile]] = {}
    for f in _all_files(root):
        if (f.generation, f.partition) == (generation, partition):
            out.setdefault(f.batch, []).append(f)
    return out


def newest_older_generation_batch(root: StorageRoot, generation: int) -> int:
    """The newest batch logged by a generation below `generation` (-1 for none): after a
    repartition, the new partitions' key groups read those files (`read_input`)."""
    return max((f.batch for f in _all_files(root) if f.generation < generation), default=-1)


def valid_batches(root: StorageRoot, generation: int, partition: int,
                  fence: FenceView | None) -> set[int]:
    """Batches for which the partition has a log file that counts."""
    return {b for b, fl in own_files(root, generation, partition).items()
            if _best(fl, fence) is not None}


def read_input(root: StorageRoot, batch: int, generation: int, partition: int,
               num_partitions: int, key: str | list[str],
               fence: FenceView | None = None, *, key_groups: int) -> pa.Table:
    """The rows partition `partition` (of `num_partitions`, generation `generation`, over
    `key_groups` key groups) consumed in `batch`; `fence` (the partition's claims) rules
    out stale writers' files. Rows of another generation's files are kept when their key
    group (the logged `KG_COLUMN`) is one the partition owns.

    Raises
    ------
    InputLogGapError
        If the batch has no log file the partition's rows can come from.
    """
    entries = [e for e in root.list_dir(batch_dir(batch), allow_not_found=True) if not e.is_dir]
    files = [f for e in entries if (f := _parse(batch, e.name, e.relpath)) is not None]
    own = [f for f in files if (f.generation, f.partition) == (generation, partition)]
    if own:
        best = _best(own, fence)
        if best is None:
            raise InputLogGapError(
                f"input log of batch {batch} at {root.full_path(batch_dir(batch))}: every file "
                f"of partition {partition} was written by a fenced (stale) owner: partition "
                f"{partition} cannot be rebuilt past this batch from here")
        return _with_kg(_read(root, best.relpath), key, key_groups)
    if any(f.generation == generation for f in files):
        # our generation ran the batch and every partition logged its own rows, even none:
        # ours is gone (trimmed after a checkpoint), and the other partitions' files are
        # no substitute (they hold none of our key groups)
        raise InputLogGapError(
            f"input log of batch {batch} at {root.full_path(batch_dir(batch))} has no file of "
            f"partition {partition} (generation {generation}): partition {partition} cannot be "
            f"rebuilt past its last durable checkpoint from here")
    # the files of one older generation only: the newest one that logged the batch. A
    # batch runs again under a newer generation only if the older one never committed it (a
    # query killed mid-batch, restarted with another partition count); the older
    # generation's files of it are then leftovers that must not count twice.
    newest = max((f.generation for f in files if f.generation < generation), default=None)
    by_part: dict[int, list[LogFile]] = {}
    for f in files:
        if f.generation == newest:
            by_part.setdefault(f.partition, []).append(f)
    if not by_part:
        raise InputLogGapError(
            f"input log of batch {batch} is missing at {root.full_path(batch_dir(batch))}: "
            f"partition {partition} cannot be rebuilt past its last durable checkpoint")

    from sguard.spark.ttl import BATCH_TIME_KEY
    tables = [_read(root, max(fl, key=lambda f: f.epoch).relpath) for _, fl in
              sorted(by_part.items())]
    table = pa.concat_tables([_with_kg(t, key, key_groups) for t in tables])
    times = [m[BATCH_TIME_KEY] for t in tables if BATCH_TIME_KEY in (m := t.schema.metadata or {})]
    if times:  # the sources ran the batch at their own times: the latest, whatever the order
        table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                               BATCH_TIME_KEY: max(times, key=int)})
    kg = np.asarray(table.column(KG_COLUMN).to_numpy(zero_copy_only=False), np.int64)
    part = owner_of(kg, num_partitions, key_groups)
    return table.filter(pa.array(part == partition))


def _with_kg(table: pa.Table, key: str | list[str], key_groups: int) -> pa.Table:
    """`table` with its `KG_COLUMN`: as logged, or, for a file written before key groups (a
    state converted by ``sguard state convert``), computed from the key columns with the
    function Spark computes it with (`sguard.keygroups.key_group_of`)."""
    if KG_COLUMN in table.column_names:
        return table
    kg = key_group_of(key_table(table, key), key_groups)
    return table.append_column(pa.field(KG_COLUMN, pa.int32(), nullable=False), pa.array(kg))


def recorded_batch_time_ms(root: StorageRoot, batch: int, generation: int, partition: int,
                           fence: FenceView | None = None) -> int | None:
    """The processing time an earlier run of this batch recorded in its log file, if any
    (`sguard.spark.ttl`): of the partition's files of the batch, the one a replay reads
    (the highest epoch that counts under `fence`)."""
    from sguard.spark.ttl import BATCH_TIME_KEY
    entries = [e for e in root.list_dir(batch_dir(batch), allow_not_found=True) if not e.is_dir]
    own = [f for e in entries if (f := _parse(batch, e.name, e.relpath)) is not None
           and (f.generation, f.partition) == (generation, partition)]
    best = _best(own, fence)
    if best is None:
        return None
    meta = ipc.open_file(pa.py_buffer(root.read_bytes(best.relpath))).schema.metadata or {}
    v = meta.get(BATCH_TIME_KEY)
    return None if v is None else int(v)


def logged_batches(root: StorageRoot) -> list[int]:
    """Batches that have a log directory, ascending."""
    out = []
    for e in root.list_dir(INPUTLOG_DIR, allow_not_found=True):
        if e.is_dir and e.name.startswith("b") and e.name[1:].isdigit():
            out.append(int(e.name[1:]))
    return sorted(out)


def trim(root: StorageRoot, upto_batch: int, generation: int, partition: int,
         num_partitions: int | None = None) -> int:
    """Delete this partition's log files (every epoch) of batches ``<= upto_batch``;
    returns how many. With `num_partitions`, record the trim and collect older
    generations' files every partition has trimmed past (`collect_old_generations`).

    Empty batch directories are removed too (best effort: another partition
    may be writing into one at the same time; a leftover empty directory is
    harmless).
    """
    n = 0
    for b, files in sorted(own_files(root, generation, partition).items()):
        if b > upto_batch:
            break
        for f in files:
            root.delete_file(f.relpath, missing_ok=True)
            n += 1
        _remove_if_empty(root, b)
    if num_partitions is not None:
        root.write_atomic(f"{TRIMMED_DIR}/g{generation}-p{partition:04d}.json",
                          json.dumps({"upto": upto_batch}).encode())
        n += collect_old_generations(root, generation, num_partitions)
    return n


def _remove_if_empty(root: StorageRoot, batch: int) -> None:
    try:
        if not root.list_dir(batch_dir(batch), allow_not_found=True):
            root.delete_dir(batch_dir(batch), missing_ok=True)
    except Exception:  # noqa: BLE001 - best effort
        pass


def collect_old_generations(root: StorageRoot, generation: int, num_partitions: int) -> int:
    """Delete log files of generations below `generation` for batches every partition of
    `generation` has trimmed past (each has a durable checkpoint, and a previous one,
    covering them); returns how many."""
    upto: list[int] = []
    for p in range(num_partitions):
        try:
            upto.append(int(json.loads(root.read_bytes(
                f"{TRIMMED_DIR}/g{generation}-p{p:04d}.json"))["upto"]))
        except Exception:  # noqa: BLE001 - a partition that never trimmed: keep everything
            return 0
    limit = min(upto)
    n = 0
    for b in logged_batches(root):
        if b > limit:
            break
        old = [e for e in root.list_dir(batch_dir(b), allow_not_found=True)
               if not e.is_dir and (f := _parse(b, e.name, e.relpath)) is not None
               and f.generation < generation]
        for e in old:
            root.delete_file(e.relpath, missing_ok=True)
            n += 1
        if old:
            _remove_if_empty(root, b)
    return n


def describe(root: StorageRoot) -> dict[str, Any]:
    """Batches and files in the log (for ``sguard spark status``)."""
    batches = logged_batches(root)
    return {"batches": len(batches), "first": batches[0] if batches else None,
            "last": batches[-1] if batches else None}
