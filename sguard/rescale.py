"""Repartition an operator's state by moving whole key groups (Flink's key groups, SEEP §3.2).

The state under a state URI (`sguard.statelayout`) is kept by key group: K key
groups fixed when the URI was created, partition ``p`` of ``P`` owning the
contiguous range ``OperatorLayout.key_group_range(p)``, and every page of a key
group ``kg`` in a page set whose PSID lies in its block ``[(kg + 1) << 16,
(kg + 2) << 16)`` (`sguard.spark.groupstate`). The same page ids hold in any
partition. So `repartition` of generation ``g`` (``P`` partitions) into ``P'``
partitions of generation ``g + 1`` never reads a row:

1. *plan* (nothing written; the driver's only reads): the layout exists,
   ``1 <= P' <= K``, the newest checkpoint of every source partition has a
   manifest whose *header* (`ioservice.read_manifest_header`: the small fields,
   ``user_meta`` included, read from a prefix of the file) says it belongs to
   this operator, generation and partition and has this page size. The driver
   never reads a page table, so its memory and reads are O(P + K), not O(state);
2. *mark*: ``rescale-pending.json`` records the generation being built (a rerun
   deletes that generation's leftovers; HA units of ``g + 1`` without the
   marker were not made by a repartition and are refused, never deleted);
3. *compose*, one task per target partition ``t`` (threads here, or Spark
   tasks over the executors: `sguard.spark.rescaling`): the task parses and
   validates in full the manifests of the sources holding ``t``'s key groups
   (falling back to an older checkpoint when one does not parse, as a restore
   does), and their page-table rows whose PSID lies in ``t``'s key groups become
   the first checkpoint of ``t``'s HA unit, a *composed* checkpoint that
   references the source page files where they lie
   (`ioservice.compose_checkpoint`); with ``verify`` the task first reads and
   checksums exactly those pages (``t``'s key groups only), so a damaged source
   page fails the repartition instead of the state;
4. *commit*: `sguard.statelayout.write_layout` with ``generation + 1`` and
   ``P'`` (the driver's only write besides the marker). Before it the old
   generation is the state, after it the new one is.

Old generations' checkpoint directories stay as long as a live manifest
references them; `sweep_old_generations` deletes the rest.

Committed lazily (a query's start-up)
-------------------------------------
``repartition(..., lazy=True)`` skips step 3: the commit writes the new layout
with the sources record of step 1 in ``extra["compose_from"]``
(`pending_sources`: each source partition's planned checkpoint and its older
ones). The first task of each new partition that finds no checkpoint in its HA
unit composes it there (`compose_loaded`, which loads the pages as it verifies
them; `compose_if_pending` only composes; both as `compose_target`, falling back
to an older source checkpoint past a damaged page, since the old layout is no
longer there to go back to), then restores it. So no Spark job runs before
the query starts. Until every new partition has composed, the sweep deletes
nothing (`uncomposed`), readers build the missing composition in memory and load
it (`load_pending`, `restore_piece`; past a damaged source page they fall back
exactly as the composing task does, so they read the composition it writes and
replay the same longer log tail), and a further repartition composes the missing
partitions first (`complete_pending`; a Spark job under ``sguard state
repartition``, even to the same count).

Replay positions move with the key groups
-----------------------------------------
Source partitions may have been checkpointed after different batches. A
composed checkpoint's ``user_meta`` records, besides ``operator, name,
generation, partition, num_partitions`` and ``batch_id`` (the smallest batch of
any of its key groups), ``"kg_batches": [[lo, hi, b], ...]``: key groups
``[lo, hi)`` include every batch up to ``b``. After restoring it, the runtime
replays each logged batch ``x > batch_id`` keeping the rows whose key group
(the logged ``_sguard_kg`` column) is at a batch below ``x``
(`KeyGroupPositions.needs`), then checkpoints as usual, which drops the
positions.

Parallel recovery (SEEP §4.2): `restore_piece` restores piece ``j`` of ``k`` of
one partition: a contiguous share of its key groups, reading only their pages.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ioservice import (IOService, Manifest, ManifestHeader, StorageRoot, list_checkpoints,
                       list_haunits, open_root, read_manifest, read_manifest_header)
from ioservice.errors import CheckpointDamagedError, IOServiceError, StorageNotFoundError
from sguard.statelayout import (LAYOUT_FILE, PSID_SHIFT, LayoutError, OperatorLayout,
                                key_group_psids, parse_haunit_name, read_layout, write_layout)

logger = logging.getLogger(__name__)

__all__ = ["MARKER_FILE", "PENDING_KEY", "KILL_ENV", "pending_sources", "pending_task",
           "uncomposed", "compose_if_pending", "compose_loaded", "complete_pending",
           "pending_manifest", "load_pending", "load_manifest", "RescaleError", "RescaleResult",
           "KeyGroupPositions", "TargetTask", "SourcePlan", "check", "plan", "compose_target",
           "repartition", "restore_piece", "psid_ranges", "sweep_old_generations",
           "piece_range"]

MARKER_FILE: Final = "rescale-pending.json"
PENDING_KEY: Final = "compose_from"
"""The layout's ``extra`` key of a lazily committed repartition's sources (`pending_sources`)."""
KILL_ENV: Final = "SGUARD_RESCALE_KILL_AT"
"""Test hook: ``<point>[:<n>]`` SIGKILLs the process the n-th time it passes `point`;
``<point>[:<n>]@first-attempt`` only in a Spark task's first attempt (its retry lives)."""


class RescaleError(ValueError):
    """The state cannot be repartitioned as asked (nothing was written)."""


def psid_ranges(lo: int, hi: int) -> list[tuple[int, int]]:
    """The PSID range of key groups ``[lo, hi)``, as `ioservice` takes it."""
    return [key_group_psids(lo, hi)] if hi > lo else []


def piece_range(kg_range: tuple[int, int], pieces: int, piece: int) -> tuple[int, int]:
    """Piece `piece` of `pieces` of the key groups `kg_range`: a contiguous share."""
    lo, hi = kg_range
    n = hi - lo
    return lo + piece * n // pieces, lo + (piece + 1) * n // pieces


@dataclass(frozen=True)
class KeyGroupPositions:
    """Which batch each key group's state includes: ``[(lo, hi, batch), ...]``."""

    ranges: tuple[tuple[int, int, int], ...]

    @classmethod
    def from_user_meta(cls, meta: Mapping[str, Any]) -> KeyGroupPositions:
        """From a checkpoint's ``user_meta`` (``kg_batches``, else every key group of
        ``key_groups`` at ``batch_id``)."""
        raw = meta.get("kg_batches")
        if raw is None:
            lo, hi = meta["key_groups"]
            raw = [[lo, hi, meta.get("batch_id", -1)]]
        try:
            ranges = tuple((int(a), int(b), int(c)) for a, b, c in raw)
        except (TypeError, ValueError):
            raise RescaleError(f"damaged kg_batches in a checkpoint: {raw!r}") from None
        return cls(ranges)

    def restrict(self, lo: int, hi: int) -> KeyGroupPositions:
        """The positions of key groups ``[lo, hi)`` only."""
        out = [(max(a, lo), min(b, hi), c) for a, b, c in self.ranges if max(a, lo) < min(b, hi)]
        return KeyGroupPositions(tuple(out))

    @property
    def min_batch_id(self) -> int:
        return min((c for _, _, c in self.ranges), default=-1)

    def uniform(self) -> bool:
        """True when every key group is at the same batch."""
        return len({c for _, _, c in self.ranges}) <= 1

    def batch_of(self, kg: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
        """The batch each key group of `kg` is at (-1 for one not covered)."""
        out = np.full(len(kg), -1, np.int64)
        for a, b, c in self.ranges:
            out[(kg >= a) & (kg < b)] = c
        return out

    def needs(self, kg: npt.NDArray[Any], batch_id: int) -> npt.NDArray[np.bool_]:
        """Which rows (by key group) of logged batch `batch_id` the state has not seen."""
        return self.batch_of(np.asarray(kg)) < batch_id

    def to_json(self) -> list[list[int]]:
        return [list(r) for r in self.ranges]


@dataclass(frozen=True, slots=True)
class RescaleResult:
    """What `repartition` did."""

    from_generation: int
    generation: int
    from_partitions: int
    num_partitions: int
    haunits: tuple[str, ...]
    pages: int
    """Pages the new generation's checkpoints reference (none copied)."""
    state_bytes: int
    bytes_read: int
    """Page bytes read to verify them (0 without ``verify``)."""
    seconds: float
    phases_s: dict[str, float] = field(default_factory=dict)
    """Seconds: ``plan_s``, ``compose_s`` (the tasks, wall clock), ``commit_s``."""
    changed: bool = True
    composed: tuple[int, ...] = ()
    """Partitions of a lazily committed layout composed first (`complete_pending`): the
    layout's, before any new generation."""


@dataclass(frozen=True)
class TargetTask:
    """One target partition's work: small and picklable, for a thread or a Spark task."""

    uri: str
    storage_options: tuple[tuple[str, Any], ...]
    layout: str
    """The *new* generation's layout document (JSON)."""
    sources: tuple[str, ...]
    """The source checkpoints' names, by source partition ("": none)."""
    target: int
    verify: bool
    io_workers: int = 4
    older: tuple[tuple[str, ...], ...] = ()
    """By source partition, its older checkpoints (newest first): used when the planned
    one's manifest does not parse in full."""
    fallback: bool = False
    """Also fall back to an older source checkpoint when verifying the planned one's pages
    finds one damaged (a lazily committed repartition, where the layout is committed
    already: an older checkpoint plus a longer replay of the log is then the state, as in
    a recovery; a repartition job fails instead, and the old generation stays)."""


# -- kill points (tests) --------------------------------------------------------------------------
_passes: dict[str, int] = {}


def _kill_point(point: str) -> None:
    """SIGKILL this process when `KILL_ENV` names `point` (optionally its n-th pass)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    spec, _, only = spec.partition("@")
    name, _, nth = spec.partition(":")
    if name != point:
        return
    if only == "first-attempt":
        from pyspark import TaskContext
        ctx = TaskContext.get()
        if ctx is None or ctx.attemptNumber() > 0:
            return
    _passes[point] = _passes.get(point, 0) + 1
    if _passes[point] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


# -- plan (reads only) ------------------------------------------------------------------------------
def _open(root: StorageRoot | str) -> StorageRoot:
    if isinstance(root, StorageRoot):
        return root
    try:
        return open_root(root, create=False)
    except IOServiceError as exc:
        raise RescaleError(f"state URI {root}: {exc}") from None


def _layout(root: StorageRoot) -> OperatorLayout:
    try:
        layout = read_layout(root)
    except LayoutError as exc:
        raise RescaleError(str(exc)) from None
    except IOServiceError as exc:
        raise RescaleError(f"state URI {root.uri}: {exc}") from None
    if layout is None:
        raise RescaleError(f"state URI {root.uri}: no sguard operator state there "
                           f"(no {LAYOUT_FILE})")
    return layout


def _newest_manifest(root: StorageRoot, haunit: str) -> Manifest | None:
    """The newest checkpoint of `haunit` whose manifest parses, or None."""
    for c in reversed([c for c in list_checkpoints(root, haunit) if c.has_manifest]):
        try:
            return read_manifest(root, c.name)
        except (IOServiceError, ValueError) as exc:
            logger.warning("skipping checkpoint %s: %s", c.name, exc)
    return None


def _newest_headers(root: StorageRoot, haunit: str
                    ) -> tuple[ManifestHeader | None, tuple[str, ...]]:
    """The header of `haunit`'s newest checkpoint whose manifest header parses (None: no
    checkpoint), and the older checkpoints' names (newest first: a task falls back to
    them if that manifest's page table turns out damaged). Reads O(header) bytes."""
    names = [c.name for c in reversed(list_checkpoints(root, haunit)) if c.has_manifest]
    for i, name in enumerate(names):
        try:
            return read_manifest_header(root, name), tuple(names[i + 1:])
        except (IOServiceError, ValueError) as exc:
            logger.warning("skipping checkpoint %s: %s", name, exc)
    return None, ()


def _check_source(layout: OperatorLayout, p: int, man: Manifest | ManifestHeader) -> None:
    meta = man.user_meta
    want = {"operator": layout.operator, "name": layout.name, "generation": layout.generation,
            "partition": p, "num_partitions": layout.num_partitions}
    bad = {k: meta.get(k) for k, v in want.items() if meta.get(k) != v}
    if bad:
        raise RescaleError(f"checkpoint {man.name} is not partition {p} of generation "
                           f"{layout.generation} of {layout.name!r} (it says {bad})")
    if list(meta.get("key_groups", [])) != list(layout.key_group_range(p)):
        raise RescaleError(f"checkpoint {man.name} holds key groups {meta.get('key_groups')}, "
                           f"not partition {p}'s {list(layout.key_group_range(p))}")


@dataclass(frozen=True)
class SourcePlan:
    """What the driver knows of one source partition: O(header), never its page table."""

    header: ManifestHeader | None
    """Its newest checkpoint's manifest header (None: no checkpoint yet)."""
    older: tuple[str, ...] = ()
    """Its older checkpoints, newest first (a task's fallbacks)."""

    @property
    def name(self) -> str:
        return self.header.name if self.header is not None else ""


def plan(root: StorageRoot | str) -> tuple[OperatorLayout, list[SourcePlan]]:
    """The layout and each source partition's newest checkpoint (`SourcePlan`).

    Reads the layout, the checkpoint listings and each source's newest manifest
    *header* only (`ioservice.read_manifest_header`): O(P + K) bytes and memory
    whatever the state's size. The page tables are parsed and validated by the
    target tasks (`compose_target`), each reading only the sources it takes.

    Raises
    ------
    RescaleError
        No layout, or a source checkpoint of another operator, generation, partition or
        page size.
    """
    sroot = _open(root)
    layout = _layout(sroot)
    srcs = [SourcePlan(*_newest_headers(sroot, layout.haunit(p)))
            for p in range(layout.num_partitions)]
    sizes = {s.header.page_bytes for s in srcs if s.header is not None}
    if len(sizes) > 1:
        raise RescaleError(f"state URI {sroot.uri}: the partitions' checkpoints have "
                           f"different page sizes {sorted(sizes)}")
    for p, s in enumerate(srcs):
        if s.header is not None:
            _check_source(layout, p, s.header)
    return layout, srcs


def _positions(layout: OperatorLayout, p: int, man: Manifest | None) -> KeyGroupPositions:
    lo, hi = layout.key_group_range(p)
    if man is None:
        return KeyGroupPositions(((lo, hi, -1),))
    return KeyGroupPositions.from_user_meta(man.user_meta).restrict(lo, hi)


# -- one target (a thread or a Spark task) ---------------------------------------------------------------
def _source_candidates(root: StorageRoot, old: OperatorLayout, p: int, name: str,
                       older: Sequence[str]) -> Iterator[Manifest]:
    """Source partition `p`'s planned checkpoint `name`, then each of `older`, those whose
    manifest parses and validates in full (page table included; the driver read only a
    header), each checked to be partition `p`'s of the old generation."""
    for cand in (name, *older):
        try:
            man = read_manifest(root, cand)
        except (IOServiceError, ValueError) as exc:
            logger.warning("skipping checkpoint %s: %s", cand, exc)
            continue
        _check_source(old, p, man)
        yield man


def _source_manifest(root: StorageRoot, old: OperatorLayout, p: int, name: str,
                     older: Sequence[str], verify: Callable[[Manifest], int] | None = None,
                     fallback: bool = False) -> tuple[Manifest | None, int]:
    """Source partition `p`'s checkpoint to compose from (None: it has none) and the bytes
    `verify` read: the planned one, or the newest of `older` that parses (and, with
    `fallback`, whose pages `verify` finds undamaged)."""
    from mmm.errors import PageFormatError
    if not name:
        return None, 0
    for man in _source_candidates(root, old, p, name, older):
        if verify is None:
            return man, 0
        try:
            return man, verify(man)
        except (CheckpointDamagedError, PageFormatError, StorageNotFoundError) as exc:
            if not fallback:
                raise
            logger.warning("source checkpoint %s is damaged, trying an older one: %s",
                           man.name, exc)
    raise RescaleError(f"no checkpoint of source partition {p} "
                       f"{'is undamaged' if verify and fallback else 'parses'} ({name} and "
                       f"{len(older)} older)")


def _target_parts(task: TargetTask, root: StorageRoot, io: IOService
                  ) -> tuple[list[tuple[Manifest, list[tuple[int, int]]]], dict[str, Any],
                             int | None, int]:
    """Target ``task.target``'s composition, nothing written: ``(parts, user_meta,
    page_bytes, bytes read to verify)`` (the sources' manifests parsed in full; with
    ``verify`` the pages taken read and checksummed)."""
    new = OperatorLayout.from_json(task.layout.encode())
    old = replace(new, generation=new.generation - 1, num_partitions=len(task.sources))
    t = task.target
    lo, hi = new.key_group_range(t)
    parts: list[tuple[Manifest, list[tuple[int, int]]]] = []
    kg_batches: list[tuple[int, int, int]] = []
    read, page_bytes = 0, None
    for p, name in enumerate(task.sources):
        a, b = max(lo, old.key_group_range(p)[0]), min(hi, old.key_group_range(p)[1])
        if a >= b:
            continue  # no key group of t was in p
        ranges = psid_ranges(a, b)

        def verify(man: Manifest, ranges: list[tuple[int, int]] = ranges) -> int:
            sel = man.select_psids(ranges)  # read and checksum exactly the pages taken
            io.read_pages(root, sel, lambda pages: None)
            return sel.n_pages * sel.page_bytes

        man, nread = _source_manifest(root, old, p, name,
                                      task.older[p] if p < len(task.older) else (),
                                      verify if task.verify else None, task.fallback)
        read += nread
        kg_batches.extend(_positions(old, p, man).restrict(a, b).ranges)
        if man is None:
            continue
        parts.append((man, ranges))
        page_bytes = man.page_bytes
    positions = KeyGroupPositions(tuple(sorted(kg_batches)))
    meta = {"operator": new.operator, "name": new.name, "generation": new.generation,
            "partition": t, "num_partitions": new.num_partitions, "key_groups": [lo, hi],
            "psid_shift": PSID_SHIFT, "batch_id": positions.min_batch_id,
            "rescaled_from": old.num_partitions}
    if not positions.uniform():
        meta["kg_batches"] = positions.to_json()
    return parts, meta, page_bytes, read


def compose_target(task: TargetTask) -> dict[str, Any]:
    """Write target partition ``task.target``'s first checkpoint (module docstring, step 3).

    Idempotent: a rerun (a retried Spark task) finds its composed checkpoint and
    returns; a run killed before the manifest was written left nothing a rerun
    trips on (the manifest is written last, create-only). Returns ``{"pages",
    "state_bytes", "bytes_read", "files"}`` (counters, and the paths of the page files
    the checkpoint references: O(files), for the sweep).
    """
    from ioservice import CheckpointManager
    from mmm import PageManager

    root = open_root(task.uri, create=False, **dict(task.storage_options))
    new = OperatorLayout.from_json(task.layout.encode())
    t = task.target
    io = IOService(task.io_workers)
    try:
        parts, meta, page_bytes, read = _target_parts(task, root, io)
        _kill_point("compose")
        pm = PageManager(page_bytes or (1 << 16), 1 << 20)
        mgr = CheckpointManager(pm, root, new.haunit(t), io=io, check_root=False,
                                exclusive=True)
        try:
            if parts:
                man = mgr.compose(parts, user_meta=meta)
            else:  # no source had a checkpoint: an empty one, whose log replays from batch 0
                pending = mgr.checkpoint(meta, full=True)
                assert pending is not None
                man = pending.result()
        finally:
            mgr.close()
            pm.close()
        _kill_point("composed")
    finally:
        io.shutdown()
    return {"pages": man.n_pages, "state_bytes": man.state_bytes, "bytes_read": read,
            "files": [f.path for f in man.files]}


def _run_threads(tasks: Sequence[TargetTask]) -> list[dict[str, Any]]:
    with cf.ThreadPoolExecutor(max(1, min(len(tasks), os.cpu_count() or 1))) as ex:
        return list(ex.map(compose_target, tasks))


# -- marker and cleanup ---------------------------------------------------------------------------
def _generation_haunits(root: StorageRoot, name: str, generation: int) -> list[str]:
    out = []
    for hu in list_haunits(root):
        parsed = parse_haunit_name(hu)
        if parsed is not None and parsed[0] == name and parsed[1] == generation:
            out.append(hu)
    return out


def _read_marker(root: StorageRoot) -> dict[str, Any] | None:
    try:
        doc = json.loads(root.read_bytes(MARKER_FILE))
    except StorageNotFoundError:
        return None
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _delete_generation(root: StorageRoot, name: str, generation: int) -> int:
    n = 0
    for hu in _generation_haunits(root, name, generation):
        for c in list_checkpoints(root, hu):
            root.delete_dir(c.directory, missing_ok=True)
            n += 1
    return n


def sweep_old_generations(root: StorageRoot | str, *,
                          live_files: Sequence[str] | None = None) -> int:
    """Delete the checkpoint directories of generations older than the layout's that no
    live checkpoint references any more; returns how many were deleted (none while a
    partition of a lazily committed layout has not composed yet). `live_files`:
    every file the layout's generation's checkpoints reference, when known (then no
    manifest is read; see `ioservice.sweep_unreferenced`)."""
    from ioservice import sweep_unreferenced
    sroot = _open(root)
    layout = _layout(sroot)
    if uncomposed(sroot, layout):  # a lazily committed layout: the sources are still needed
        return 0
    dead: list[str] = []
    live: list[str] = []
    for hu in list_haunits(sroot):
        parsed = parse_haunit_name(hu)
        if parsed is None or parsed[0] != layout.name:
            continue
        (live if parsed[1] == layout.generation else dead if parsed[1] < layout.generation
         else []).append(hu)
    return len(sweep_unreferenced(sroot, dead, live, live_files=live_files)) if dead else 0


# -- a repartition committed before its composition (lazy) ---------------------------------------
def pending_sources(layout: OperatorLayout) -> dict[str, Any] | None:
    """The sources record of a repartition committed lazily (``repartition(lazy=True)``),
    or None: ``{"from_partitions", "sources", "older", "verify"}``, what the
    `TargetTask` of every new partition needs."""
    doc = layout.extra.get(PENDING_KEY)
    return doc if isinstance(doc, dict) else None


def _without_pending(layout: OperatorLayout) -> OperatorLayout:
    return replace(layout, extra={k: v for k, v in layout.extra.items() if k != PENDING_KEY})


def pending_task(layout: OperatorLayout, target: int, uri: str,
                 storage_options: Mapping[str, Any] | None = None, *,
                 io_workers: int = 4) -> TargetTask:
    """The `TargetTask` that composes partition `target` of a lazily committed layout."""
    doc = pending_sources(layout)
    if doc is None:
        raise RescaleError(f"generation {layout.generation} of {layout.name!r} has no "
                           f"pending composition")
    try:
        sources = tuple(str(x) for x in doc["sources"])
        older = tuple(tuple(str(y) for y in x) for x in doc.get("older", ()))
    except (KeyError, TypeError) as exc:
        raise RescaleError(f"damaged {PENDING_KEY} record in the layout of "
                           f"{layout.name!r}: {exc}") from None
    return TargetTask(uri, tuple(sorted((storage_options or {}).items())),
                      _without_pending(layout).to_json().decode(), sources, target,
                      bool(doc.get("verify", True)), io_workers, older, fallback=True)


def _has_checkpoint(root: StorageRoot, haunit: str) -> bool:
    return any(c.has_manifest for c in list_checkpoints(root, haunit))


def uncomposed(root: StorageRoot | str, layout: OperatorLayout | None = None) -> list[int]:
    """The partitions of a lazily committed layout that have not composed their first
    checkpoint yet (none for any other layout): one listing per partition."""
    sroot = _open(root)
    layout = layout or _layout(sroot)
    if pending_sources(layout) is None:
        return []
    return [t for t in range(layout.num_partitions)
            if not _has_checkpoint(sroot, layout.haunit(t))]


def compose_if_pending(root: StorageRoot, layout: OperatorLayout, target: int, *,
                       storage_options: Mapping[str, Any] | None = None,
                       io_workers: int = 4) -> bool:
    """Compose partition `target`'s first checkpoint if its layout was committed lazily
    and its HA unit has no checkpoint yet (what a query's first task of the partition
    does before restoring); True if it composed. Safe to repeat and to race: the
    composition is deterministic and its manifest is created, never replaced."""
    if pending_sources(layout) is None or _has_checkpoint(root, layout.haunit(target)):
        return False
    compose_target(pending_task(layout, target, root.uri, storage_options,
                                io_workers=io_workers))
    return True


def compose_loaded(mgr: Any, root: StorageRoot, layout: OperatorLayout, target: int, *,
                   storage_options: Mapping[str, Any] | None = None,
                   io: IOService | None = None) -> tuple[bool, Manifest | None]:
    """`compose_if_pending` for the query's task that then restores the partition, reading
    each page once: the composition is built in memory (the sources' manifests only),
    its pages are loaded into ``mgr``'s page manager and checksummed (`load_manifest`),
    and only then is its manifest written, through ``mgr`` (`CheckpointManager.compose`:
    the task's own manager, so the owner's fencing check guards it, and it becomes the
    base of the next checkpoint). Killed anywhere, a retry finds either no manifest
    (and composes again) or the composition (and restores it).

    Returns ``(composed, loaded)``: whether the partition was pending, and the composed
    checkpoint when its pages are in the page manager now (None: restore it as usual;
    after a damaged page the sources were verified one by one and the composition
    written past the damage, `compose_target`, but not loaded).
    """
    from ioservice import composed_manifest
    from mmm.errors import PageFormatError
    if pending_sources(layout) is None or _has_checkpoint(root, layout.haunit(target)):
        return False, None
    task = pending_task(layout, target, root.uri, storage_options)
    own = io is None
    io = io or IOService(task.io_workers)
    try:
        parts, meta, _, _ = _target_parts(replace(task, verify=False), root, io)
        if parts:
            man = composed_manifest(parts, mgr.pm.page_bytes, layout.haunit(target),
                                    user_meta=meta)
            try:
                load_manifest(mgr.pm, root, man, io=io)
            except (CheckpointDamagedError, PageFormatError, StorageNotFoundError) as exc:
                logger.warning("partition %d: composing from damaged sources (%s); verifying "
                               "them one by one", target, exc)
            else:
                _kill_point("compose")
                got = mgr.compose(parts, user_meta=meta)
                _kill_point("composed")
                return True, got
    finally:
        if own:
            io.shutdown()
    # no page to take (an empty checkpoint), or past the damage: each source verified,
    # whatever the record's ``verify`` (a reader falls back the same way, `load_pending`)
    compose_target(replace(task, verify=True))
    return True, None


def complete_pending(root: StorageRoot | str, *,
                     run: Callable[[Sequence[TargetTask]], list[dict[str, Any]]] | None = None,
                     storage_options: Mapping[str, Any] | None = None) -> list[int]:
    """Compose every partition of a lazily committed layout that has not composed yet
    (``run``: as in `repartition`); returns which were."""
    sroot = _open(root)
    layout = _layout(sroot)
    todo = uncomposed(sroot, layout)
    if todo:
        (run or _run_threads)([pending_task(layout, t, sroot.uri, storage_options)
                               for t in todo])
    return todo


def pending_manifest(root: StorageRoot, layout: OperatorLayout, target: int, *,
                     verified: bool = False, io: IOService | None = None) -> Manifest | None:
    """The composition partition `target` of a lazily committed layout would write,
    built in memory (nothing written), or None when the partition is not pending (not
    lazily committed, or composed already). For readers: load it with `load_manifest`,
    or better with `load_pending`, which falls back past a damaged source page.

    Without `verified` no page is read: each source's planned checkpoint is taken. With
    it, each source's pages that `target` takes are read and checksummed first and a
    damaged one makes that source fall back to its newest older checkpoint whose pages
    are whole: the composition the partition's first task writes after finding the
    damage (`compose_loaded`), so its ``batch_id``/``kg_batches`` say which longer log
    tail to replay.

    Raises
    ------
    RescaleError
        With `verified`: a source with no undamaged checkpoint left.
    """
    from ioservice import composed_manifest
    if pending_sources(layout) is None or _has_checkpoint(root, layout.haunit(target)):
        return None
    task = replace(pending_task(layout, target, root.uri), verify=verified)
    own = io is None
    io = io or IOService(1 if not verified else task.io_workers)
    try:
        parts, meta, page_bytes, _ = _target_parts(task, root, io)
    finally:
        if own:
            io.shutdown()
    if not parts:  # composed at commit time (`repartition`); vanished: nothing to read
        return None
    return composed_manifest(parts, page_bytes or (1 << 16), layout.haunit(target),
                             user_meta=meta)


def load_pending(pm: Any, root: StorageRoot, layout: OperatorLayout, target: int, *,
                 pending: Manifest | None = None,
                 psid_ranges: Sequence[tuple[int, int]] | None = None,
                 io: IOService | None = None) -> Manifest | None:
    """A reader's `compose_loaded`: load the composition of partition `target` of a lazily
    committed layout into `pm` (only the pages of `psid_ranges`, when given), nothing
    written, and return it (as `Manifest.select_psids` restricted; None: the partition
    is not pending, `pm` untouched).

    `pending` is its `pending_manifest` when the caller has it already. A damaged
    source page (a checksum, page format or missing file) makes it fall back the way the
    partition's first task does: the sources are verified one by one, each damaged one
    replaced by its newest older checkpoint whose pages are whole (`pending_manifest`
    with ``verified``), and that composition is loaded; its ``batch_id`` and
    ``kg_batches`` are the older positions, so a reader replaying the input log after it
    (`sguard.spark.recovery`) replays the longer tail and rebuilds the state the query
    does.

    Raises
    ------
    RescaleError
        A source with no undamaged checkpoint left (`pm` then empty).
    ioservice.IOServiceError
        Storage failures other than damage (`pm` then empty).
    """
    from mmm.errors import PageFormatError
    pend = pending if pending is not None else pending_manifest(root, layout, target)
    if pend is None:
        return None

    def load(man: Manifest) -> Manifest:
        sel = man if psid_ranges is None else man.select_psids(list(psid_ranges))
        return load_manifest(pm, root, sel, io=io)
    try:
        return load(pend)
    except (CheckpointDamagedError, PageFormatError, StorageNotFoundError) as exc:
        logger.warning("partition %d: reading its composition through damaged sources (%s); "
                       "verifying them one by one", target, exc)
    verified = pending_manifest(root, layout, target, verified=True, io=io)
    if verified is None:  # composed meanwhile: its own checkpoint is the state now
        raise StorageNotFoundError(f"partition {target} of {layout.name!r} composed while "
                                   f"being read; read it again")
    return load(verified)


def load_manifest(pm: Any, root: StorageRoot, man: Manifest, *,
                  io: IOService | None = None) -> Manifest:
    """Load the pages of `man` (e.g. a `pending_manifest`) into `pm`, replacing its state;
    the pages are checksummed. Raises what `IOService.read_pages` raises (`pm` then
    empty)."""
    own = io is None
    io = io or IOService()
    loader = pm.begin_load()
    try:
        io.read_pages(root, man, loader.add)
        loader.finish()
    except BaseException:
        loader.abort()
        raise
    finally:
        if own:
            io.shutdown()
    return man


# -- refusals (nothing written) --------------------------------------------------------------------
def _check_count(num_partitions: Any) -> int:
    if not isinstance(num_partitions, (int, np.integer)) or isinstance(num_partitions, bool) \
            or num_partitions < 1:
        raise RescaleError(f"--partitions must be an integer >= 1, got {num_partitions!r}")
    return int(num_partitions)


def _check_target(root: StorageRoot, layout: OperatorLayout, num_partitions: int) -> None:
    if num_partitions > layout.key_groups:
        raise RescaleError(f"--partitions {num_partitions} exceeds the state's "
                           f"{layout.key_groups} key groups (fixed when the state URI was "
                           f"created)")


def _foreign(root: StorageRoot, generation: int, leftovers: Sequence[str]) -> RescaleError:
    return RescaleError(f"state URI {root.uri}: HA units of generation {generation} exist "
                        f"({', '.join(leftovers[:3])}{'...' if len(leftovers) > 3 else ''}) "
                        f"but no repartition made them ({MARKER_FILE} missing); "
                        f"refusing to touch them")


def check(root: StorageRoot | str, num_partitions: int, *, force: bool = False
          ) -> OperatorLayout:
    """Every refusal `repartition` would raise before writing anything (`RescaleError`),
    without writing anything: for callers that start expensive work (a Spark session)
    only for a repartition that can run. Returns the layout."""
    num_partitions = _check_count(num_partitions)
    sroot = _open(root)
    if isinstance(root, str) and not sroot.exists(""):
        raise RescaleError(f"state URI {root}: does not exist")
    layout, _ = plan(sroot)
    _check_target(sroot, layout, num_partitions)
    if num_partitions == layout.num_partitions and not force:
        return layout  # a no-op
    marker = _read_marker(sroot)
    if marker is not None and marker.get("to_generation", -1) <= layout.generation:
        marker = None
    leftovers = _generation_haunits(sroot, layout.name, layout.generation + 1)
    if leftovers and marker is None:
        raise _foreign(sroot, layout.generation + 1, leftovers)
    return layout


# -- public API ----------------------------------------------------------------------------------
def repartition(root: StorageRoot | str, num_partitions: int, *, force: bool = False,
                verify: bool = True, io_workers: int = 4,
                run: Callable[[Sequence[TargetTask]], list[dict[str, Any]]] | None = None,
                storage_options: Mapping[str, Any] | None = None,
                on_progress: Callable[[str], None] | None = None,
                lazy: bool = False) -> RescaleResult:
    """Repartition the operator state under `root` into `num_partitions` partitions by
    moving whole key groups (module docstring).

    Parameters
    ----------
    root : StorageRoot or str
        The state URI (see `sguard.statelayout`).
    num_partitions : int
        ``1 <= P' <= K`` (the layout's key groups).
    force : bool
        Write a new generation even when P' equals P.
    verify : bool
        Read and checksum each target's pages before composing it (default). Without
        it nothing but manifests is read.
    run : callable, optional
        Runs the `TargetTask` list and returns each task's result in order (default:
        threads of this process; `sguard.spark.rescaling` passes one that runs them as
        Spark tasks over the executors).
    storage_options : mapping, optional
        `ioservice.open_root` options the tasks open the state URI with.
    on_progress : callable, optional
        Called with a short message per phase.
    lazy : bool
        Commit the new layout with the sources record (`pending_sources`) instead of
        composing first: each new partition composes its first checkpoint when it
        first needs it (`compose_if_pending`, in the query's first task; readers see
        it through `pending_manifest`). Only targets that would take no page are
        composed here (an empty checkpoint each). The old generation is not swept:
        `sweep_old_generations` keeps it while a partition has not composed.
        Without it, a layout committed lazily before is completed first (`run`), so
        a repartition never reads a partition that has no checkpoint yet as empty.

    Raises
    ------
    RescaleError
        Unknown state URI or no layout there, P' out of range, sources of another
        operator or generation, leftovers of generation ``g + 1`` not made by a
        repartition. Nothing was written.
    ioservice.IOServiceError
        Storage failures (a damaged source page with ``verify``); the old generation is
        still the state and a rerun completes.
    """
    t0 = time.perf_counter()
    num_partitions = _check_count(num_partitions)
    sroot = _open(root)
    if isinstance(root, str) and not sroot.exists(""):
        raise RescaleError(f"state URI {root}: does not exist")
    say = on_progress or (lambda msg: None)
    done = complete_pending(sroot, run=run, storage_options=storage_options)
    if done:  # an earlier lazy repartition's partitions that never ran: their sources
        say(f"composed {len(done)} partition(s) of the committed generation first")
    layout, sources = plan(sroot)
    g, P, K = layout.generation, layout.num_partitions, layout.key_groups
    _check_target(sroot, layout, num_partitions)
    marker = _read_marker(sroot)
    if marker is not None and marker.get("to_generation", -1) <= g:
        sroot.delete_file(MARKER_FILE, missing_ok=True)  # a committed run's leftover
        marker = None
    if num_partitions == P and not force:
        return RescaleResult(g, g, P, P, tuple(layout.haunit(p) for p in range(P)), 0, 0, 0,
                             time.perf_counter() - t0, changed=False, composed=tuple(done))
    leftovers = _generation_haunits(sroot, layout.name, g + 1)
    if leftovers and marker is None:
        raise _foreign(sroot, g + 1, leftovers)
    new = replace(_without_pending(layout), generation=g + 1, num_partitions=num_partitions)
    phases = {"plan_s": time.perf_counter() - t0}
    _kill_point("validated")
    say(f"planned {P} -> {num_partitions} partitions over {K} key groups")
    doc = {"from_generation": g, "to_generation": g + 1, "num_partitions": num_partitions,
           "created_unix_s": time.time()}
    sroot.write_atomic(MARKER_FILE, json.dumps(doc).encode())
    _kill_point("marked")
    if leftovers:  # an interrupted run's: start over (its sources may have moved on since)
        n = _delete_generation(sroot, layout.name, g + 1)
        say(f"removed {n} checkpoint(s) of an interrupted repartition")
    _kill_point("cleaned")
    t1 = time.perf_counter()
    opts = tuple(sorted((storage_options or {}).items()))
    tasks = [TargetTask(sroot.uri, opts, new.to_json().decode(),
                        tuple(s.name for s in sources), t, verify, io_workers,
                        tuple(s.older for s in sources)) for t in range(num_partitions)]
    if lazy:  # compose now only the targets that take no page (no reads: an empty checkpoint)
        old = replace(layout, num_partitions=P)
        empty = [tk for tk in tasks if not any(
            s.name and max(new.key_group_range(tk.target)[0], old.key_group_range(p)[0])
            < min(new.key_group_range(tk.target)[1], old.key_group_range(p)[1])
            for p, s in enumerate(sources))]
        results = _run_threads(empty) if empty else []
        new = replace(new, extra={**new.extra, PENDING_KEY: {
            "from_partitions": P, "sources": [s.name for s in sources],
            "older": [list(s.older) for s in sources], "verify": verify}})
    else:
        results = (run or _run_threads)(tasks)
    phases["compose_s"] = time.perf_counter() - t1
    say(f"composed {len(results)} partition(s) of generation {g + 1}")
    _kill_point("before_commit")
    t2 = time.perf_counter()
    write_layout(sroot, new)
    _kill_point("committed")
    sroot.delete_file(MARKER_FILE, missing_ok=True)
    phases["commit_s"] = time.perf_counter() - t2
    if lazy:  # the sources stay until every new partition has composed (the sweep checks)
        logger.info("repartitioned %s: %d -> %d partitions (generation %d), composed lazily",
                    sroot.uri, P, num_partitions, g + 1)
        return RescaleResult(g, g + 1, P, num_partitions,
                             tuple(new.haunit(t) for t in range(num_partitions)),
                             sum(r["pages"] for r in results), 0, 0,
                             time.perf_counter() - t0, phases, composed=tuple(done))
    try:  # the old generation's checkpoints that no new one references
        # the new generation's checkpoints are the ones the tasks just composed: their file
        # lists came back with the results, so the driver reads no manifest here
        known = all(isinstance(r.get("files"), list) for r in results)
        sweep_old_generations(sroot, live_files=[f for r in results for f in r["files"]]
                              if known else None)
    except (IOServiceError, OSError) as exc:
        logger.warning("repartitioned %s, but cleaning the old generation failed: %s",
                       sroot.uri, exc)
    logger.info("repartitioned %s: %d -> %d partitions (generation %d)", sroot.uri, P,
                num_partitions, g + 1)
    return RescaleResult(g, g + 1, P, num_partitions,
                         tuple(new.haunit(t) for t in range(num_partitions)),
                         sum(r["pages"] for r in results), sum(r["state_bytes"] for r in results),
                         sum(r["bytes_read"] for r in results), time.perf_counter() - t0, phases,
                         composed=tuple(done))


def restore_piece(root: StorageRoot | str, partition: int, pieces: int, piece: int,
                  pm: Any, *, io: IOService | None = None) -> tuple[tuple[int, int],
                                                                     KeyGroupPositions]:
    """Restore piece `piece` of `pieces` of one partition into `pm` (parallel recovery).

    The piece is a contiguous share of the partition's key groups (`piece_range`); only
    their pages are read. The caller replays the logged rows of those key groups that
    `KeyGroupPositions.needs`.

    Returns
    -------
    ((lo, hi), KeyGroupPositions)
        The piece's key groups and where each is.

    Raises
    ------
    RescaleError
        Bad arguments or state.
    """
    from ioservice import restore

    sroot = _open(root)
    layout = _layout(sroot)
    P = layout.num_partitions
    if not 0 <= partition < P:
        raise RescaleError(f"partition {partition} out of range for {P} partitions")
    if not (isinstance(pieces, int) and pieces >= 1 and 0 <= piece < pieces):
        raise RescaleError(f"piece {piece!r} of {pieces!r}: need pieces >= 1 and "
                           f"0 <= piece < pieces")
    lo, hi = piece_range(layout.key_group_range(partition), pieces, piece)
    # not composed yet: its pages where they lie in the sources (past a damaged one, as
    # the partition's first task composes it)
    man = load_pending(pm, sroot, layout, partition, psid_ranges=psid_ranges(lo, hi), io=io)
    if man is None:
        man = restore(pm, sroot, layout.haunit(partition), io=io,
                      psid_ranges=psid_ranges(lo, hi))
    return (lo, hi), _positions(layout, partition, man).restrict(lo, hi)


