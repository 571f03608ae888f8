"""Recovery: find the latest restorable checkpoint of an HA unit and load it (paper §4.4).

A checkpoint is a *candidate* when its directory holds a manifest. Candidates
are tried newest first: the manifest must parse (`Manifest.from_json`) and
name the checkpoint it lies in, every file it references must exist and be
long enough, and every page read must match its checksum and PageID. Pages go
into the page manager (`mmm.PageManager.begin_load`) as they arrive, from
several reader threads, in any order; the page table and catalog are rebuilt
by `mmm.Loader.finish`, and structures come back through their normal
create-by-name call (their indexes are rebuilt lazily).

A damaged candidate is skipped with a `DamagedCheckpointWarning` (and a log
warning) naming it, and the next older one is tried. Incremental checkpoints
need no special handling: the manifest's page table already points at the
pages kept in earlier checkpoints' directories.

An unreachable storage is *not* damage: it raises at once instead of
silently falling back to an older checkpoint.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ioservice.errors import (
    CheckpointDamagedError,
    CheckpointNotFoundError,
    IOServiceError,
    ManifestError,
    StorageIOError,
    StorageNotFoundError,
    DamagedCheckpointWarning,
)
from ioservice.format import CHECKPOINT_DIR, MANIFEST_NAME, Manifest, ManifestHeader, \
    check_psid_ranges, checkpoint_dir, parse_checkpoint_name, parse_manifest_header
from ioservice.fs import StorageRoot, validate_name
from ioservice.service import IOService, ProgressFn
from mmm.errors import PageFormatError
from mmm.manager import PageManager

logger = logging.getLogger(__name__)

__all__ = ["CheckpointInfo", "list_checkpoints", "list_haunits", "read_manifest",
           "read_manifest_header", "restore", "verify_checkpoint"]


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One checkpoint directory found under a root (see `list_checkpoints`)."""

    name: str
    haunit: str
    seq: int
    has_manifest: bool
    """False for a failed or interrupted checkpoint, or one whose manifest
    retention removed while later checkpoints still reference its files."""
    size_bytes: int
    """Bytes of all files in the directory."""
    n_files: int
    mtime_ns: int | None
    """Newest modification time in the directory, when the backend reports it."""

    @property
    def directory(self) -> str:
        """``checkpoint/<name>``."""
        return checkpoint_dir(self.name)


def list_checkpoints(root: StorageRoot, haunit: str | None = None) -> list[CheckpointInfo]:
    """Every checkpoint directory under `root` (of `haunit` only, if given), oldest first.

    Runtime complexity: one recursive listing of ``checkpoint/``.

    Raises
    ------
    InvalidNameError
        If `haunit` is not a valid name.
    StorageUnreachableError, StorageIOError
    """
    if haunit is not None:
        validate_name(haunit)
    entries = root.list_dir(CHECKPOINT_DIR, recursive=True, allow_not_found=True)
    files: dict[str, list[tuple[str, int, int | None]]] = defaultdict(list)
    for e in entries:
        parts = e.relpath.split("/")
        if len(parts) < 2 or parse_checkpoint_name(parts[1]) is None:
            continue
        if e.is_dir:
            files.setdefault(parts[1], [])
        elif len(parts) == 3:
            files[parts[1]].append((parts[2], e.size_bytes or 0, e.mtime_ns))
    out = []
    for name, fl in files.items():
        parsed = parse_checkpoint_name(name)
        assert parsed is not None
        if haunit is not None and parsed[0] != haunit:
            continue
        mt = [m for _, _, m in fl if m is not None]
        out.append(CheckpointInfo(name, parsed[0], parsed[1],
                                  any(n == MANIFEST_NAME for n, _, _ in fl),
                                  sum(s for _, s, _ in fl), len(fl), max(mt) if mt else None))
    out.sort(key=lambda c: (c.haunit, c.seq))
    return out


def list_haunits(root: StorageRoot) -> list[str]:
    """Names of the HA units with at least one checkpoint directory, sorted.

    Raises
    ------
    StorageUnreachableError, StorageIOError
    """
    return sorted({c.haunit for c in list_checkpoints(root)})


def read_manifest(root: StorageRoot, name: str) -> Manifest:
    """Read and validate the manifest of checkpoint `name` (``<haunit>-<seq>``).

    Raises
    ------
    StorageNotFoundError
        If the checkpoint has no manifest.
    ManifestError
        If it does not parse, or describes another checkpoint than `name`.
    InvalidPathError
        If `name` is not a valid path component.
    StorageUnreachableError, StorageIOError
    """
    path = f"{checkpoint_dir(name)}/{MANIFEST_NAME}"
    where = f"manifest {path} on {root.backend} root {root.uri}"
    data = root.read_bytes(path)
    man = Manifest.from_json(data, where=where)
    if man.name != name:
        raise ManifestError(f"{where}: describes checkpoint {man.name!r}, not {name!r}")
    return man


HEADER_FIRST_BYTES = 16 << 10
"""`read_manifest_header`'s first ranged read (it doubles until the header is in)."""


def read_manifest_header(root: StorageRoot, name: str, *,
                         first_bytes: int | None = None) -> ManifestHeader:
    """The header of checkpoint `name`'s manifest (`ioservice.format.ManifestHeader`):
    its small fields (``user_meta`` included), read from a prefix of the file (ranged
    reads, the first of `first_bytes`, default `HEADER_FIRST_BYTES`, doubling), so that
    memory and bytes read are O(header) and not O(pages). Not validated as a whole:
    parse the manifest (`read_manifest`) before using its pages.

    Raises
    ------
    StorageNotFoundError
        If the checkpoint has no manifest.
    ManifestError
        If the header does not parse or describes another checkpoint than `name`.
    StorageUnreachableError, StorageIOError
    """
    path = f"{checkpoint_dir(name)}/{MANIFEST_NAME}"
    where = f"manifest {path} on {root.backend} root {root.uri}"
    n = max(256, HEADER_FIRST_BYTES if first_bytes is None else first_bytes)
    data = b""
    while True:  # each read continues where the last one ended
        data += root.read_bytes(path, offset=len(data), length=n - len(data))
        head = parse_manifest_header(data, where=where, complete=len(data) < n)
        if head is not None:
            break
        n *= 2
    if head.name != name:
        raise ManifestError(f"{where}: describes checkpoint {head.name!r}, not {name!r}")
    return head


def _check_files(root: StorageRoot, man: Manifest) -> None:
    """Raise CheckpointDamagedError unless every referenced file exists and is long enough."""
    by_dir: dict[str, dict[str, int]] = {}
    for f in man.files:
        d = f.path.rsplit("/", 1)[0]
        if d not in by_dir:
            by_dir[d] = {e.relpath: e.size_bytes or 0
                         for e in root.list_dir(d, allow_not_found=True) if not e.is_dir}
        size = by_dir[d].get(f.path)
        if size is None:
            raise CheckpointDamagedError(
                f"checkpoint {man.name}: page file {f.path} is missing on {root.backend} "
                f"root {root.uri}")
        if size < f.size_bytes:
            raise CheckpointDamagedError(
                f"checkpoint {man.name}: page file {f.path} has {size} bytes, the manifest "
                f"says {f.size_bytes} (on {root.backend} root {root.uri})")


def _prefetch_local(root: StorageRoot, name: str) -> None:
    """Ask the kernel to start reading checkpoint `name`'s own page files (local
    storage only), from a background thread, so the disk is busy while the
    manifest is parsed and checked; the reads that follow find the pages
    arriving. Best effort: any error is ignored (the reads will report it)."""
    if not root._native_local:
        return
    try:
        paths = [root.full_path(e.relpath) for e in
                 root.list_dir(checkpoint_dir(name), allow_not_found=True)
                 if not e.is_dir and e.relpath.endswith(".pages")]
    except IOServiceError:
        return

    def run() -> None:
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    if paths and hasattr(os, "posix_fadvise"):
        threading.Thread(target=run, name="sguard-prefetch", daemon=True).start()


def verify_checkpoint(root: StorageRoot, name: str, *, io: IOService | None = None,
                      on_progress: ProgressFn | None = None) -> Manifest:
    """Read every page of checkpoint `name` and check its checksum and PageID.

    Returns
    -------
    Manifest
        The verified checkpoint's manifest.

    Raises
    ------
    CheckpointDamagedError
        (including `ManifestError`) naming the checkpoint, file and page at fault.
    StorageNotFoundError
        If it has no manifest.
    StorageUnreachableError, StorageIOError
    """
    man = read_manifest(root, name)
    _check_files(root, man)
    own = io is None
    io = io or IOService()
    try:
        io.read_pages(root, man, lambda pages: None, on_progress=on_progress)
    finally:
        if own:
            io.shutdown()
    return man


def restore(pm: PageManager, root: StorageRoot, haunit: str, *, io: IOService | None = None,
            before_seq: int | None = None, on_progress: ProgressFn | None = None,
            psid_ranges: Sequence[tuple[int, int]] | None = None) -> Manifest:
    """Load the latest restorable checkpoint of `haunit` into `pm`, replacing its state.

    Parameters
    ----------
    pm : mmm.PageManager
        Receives the pages (all its current state is dropped).
    root : StorageRoot
        Where the checkpoints live.
    haunit : str
        HA unit name.
    io : IOService, optional
        Reader threads (default: a temporary 4-thread service).
    before_seq : int, optional
        Only consider checkpoints with a smaller sequence number.
    on_progress : callable, optional
        ``on_progress(pages_done, pages_total)`` per candidate, from reader threads.
    psid_ranges : sequence of (int, int), optional
        A *partial restore*: load only the pages whose page set id lies in one
        of these half-open ranges ``[lo, hi)`` (`ioservice.format.check_psid_ranges`),
        reading and verifying only their bytes and checking only the files they
        lie in (damage elsewhere in the checkpoint goes unnoticed, by design).
        Default: every page.

    Returns
    -------
    Manifest
        The checkpoint loaded; its ``user_meta`` holds what the operator stored
        (e.g. input positions to replay from). After the load, every page of
        `pm` counts as unchanged: this checkpoint is the base of the next
        incremental one. After a partial restore it is the selection
        (`Manifest.select_psids`: the selected rows, files and structures, the
        checkpoint's name and ``user_meta``), not the manifest on storage.

    Raises
    ------
    CheckpointNotFoundError
        If `haunit` has no checkpoint (`pm` is then untouched), or every
        candidate is damaged (each one was reported by a
        `DamagedCheckpointWarning`; `pm` is then empty, whichever stage the
        candidates failed at: its previous state may already have been
        replaced by a candidate's pages, so it is never half kept).
    InvalidNameError
        If `haunit` is not a valid name (None, empty or blank included: an
        HA unit is always named, so another unit's checkpoint is never loaded).
    ValueError
        If a checkpoint's page size differs from `pm`'s, or `psid_ranges` is
        malformed or has overlapping ranges (then nothing is read).
    StorageUnreachableError
        If the storage cannot be reached (no fallback: older checkpoints
        would be just as unreachable).
    mmm.PoolExhaustedError
        If the pool cannot hold the checkpoint.

    Notes
    -----
    Runtime complexity: O(pages) plus the reads; pages are checksummed and
    copied into frames once.
    """
    validate_name(haunit)  # None would list every HA unit's checkpoints
    ranges = None if psid_ranges is None else check_psid_ranges(psid_ranges, "psid_ranges")
    cands = [c for c in list_checkpoints(root, haunit)
             if c.has_manifest and (before_seq is None or c.seq < before_seq)]
    if not cands:
        raise CheckpointNotFoundError(f"HA unit {haunit!r} has no checkpoint under "
                                      f"{root.uri} ({root.backend})")
    own = io is None
    io = io or IOService()
    skipped: list[str] = []
    try:
        for c in reversed(cands):
            try:
                if ranges is None:  # a partial restore reads only some of the files
                    _prefetch_local(root, c.name)
                man = read_manifest(root, c.name)
                if ranges is not None:
                    man = man.select_psids(ranges)
                if man.page_bytes != pm.page_bytes:
                    raise ValueError(f"checkpoint {c.name} on {root.uri} holds {man.page_bytes}-byte "
                                     f"pages; the page manager uses {pm.page_bytes}-byte pages")
                _check_files(root, man)
                loader = pm.begin_load()
                try:
                    io.read_pages(root, man, loader.add, on_progress=on_progress)
                    loader.finish()
                except BaseException:
                    loader.abort()
                    raise
            except (CheckpointDamagedError, PageFormatError, StorageNotFoundError,
                    StorageIOError) as exc:
                msg = (f"checkpoint {c.name} of HA unit {haunit!r} on {root.backend} root "
                       f"{root.uri} is damaged or incomplete, skipping it: {exc}")
                logger.warning("%s", msg)
                warnings.warn(msg, DamagedCheckpointWarning, stacklevel=2)
                skipped.append(c.name)
                continue
            logger.info("restored checkpoint %s (%d pages, %d B) from %s", man.name,
                        man.n_pages, man.state_bytes, root.uri)
            return man
    finally:
        if own:
            io.shutdown()
    pm.begin_load().abort()  # the documented outcome: empty, as after a damaged load
    raise CheckpointNotFoundError(
        f"HA unit {haunit!r}: no restorable checkpoint under {root.uri} ({root.backend}); "
        f"damaged: {', '.join(skipped)}")
