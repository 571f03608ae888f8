"""ioservice: page and checkpoint I/O to any pyarrow filesystem (SGuard paper §3, §4.4, §5).

Modules:

`ioservice.fs`
    `open_root` resolves a URI (``file://`` or a local path — the embedded
    default —, ``s3://bucket/prefix`` with an endpoint override,
    ``hdfs://host:port/path``) to a `StorageRoot`: a `pyarrow.fs.FileSystem`
    plus a base path, with safe path joining, HA-unit name validation, output
    streams, atomic manifest writes, listings, whole/range reads, deletes and
    writability/reachability probes.
`ioservice.format`
    The checkpoint layout ``<root>/checkpoint/<haunit>-<seq>/`` (one page file
    per worker, ``manifest.json`` written last) and the versioned `Manifest`.
`ioservice.service`
    `IOService`: worker threads writing a snapshot's pages in large sequential
    writes and reading them back in parallel, verifying per-page checksums.
`ioservice.recovery`
    `restore` (latest restorable checkpoint, falling back past damaged ones),
    `list_checkpoints`, `read_manifest`, `verify_checkpoint`.
`ioservice.manager`
    `CheckpointManager`: the five steps of §3 for one HA unit, policies,
    incremental and composed checkpoints, retention; `sweep_unreferenced`
    collects dead HA units' directories nothing references any more.
`ioservice.cli`
    ``sguard checkpoints ls|verify|show``.
`ioservice.errors`
    One exception hierarchy rooted at `IOServiceError`.
`ioservice.testing`
    `FaultyFS` (fault injection over any pyarrow filesystem) and
    `SeaweedCluster` (a real replicated SeaweedFS cluster on 127.0.0.1).
    Not imported here: import it explicitly in tests.

Glossary
--------
root
    The directory (or S3 bucket prefix) all checkpoints live under.
relpath
    A ``/``-separated path relative to the root; validated component by component.
HA unit
    A set of operators checkpointed together (paper §3); its name becomes a
    directory name, so it must pass `validate_name`.
manifest
    The small object written last, atomically, that makes a checkpoint exist
    (`StorageRoot.write_atomic`).
checkpoint
    ``<haunit>-<seq>``: a directory of page files plus its manifest; a *full*
    one holds every page, an *incremental* one references unchanged pages in
    earlier checkpoints (its *base* chain).
page file
    Whole pages back to back, written by one I/O worker (``w000.pages``).
persisted
    A page whose bytes were handed to storage: mmm unpins its frame.
"""

from ioservice.errors import (
    BackendUnavailableError,
    CheckpointDamagedError,
    CheckpointError,
    CheckpointInProgressError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CompositionConflictError,
    CompositionError,
    DamagedCheckpointWarning,
    DuplicatePagesError,
    OverlappingRangesError,
    PageSizeMismatchError,
    ManifestError,
    InvalidNameError,
    InvalidPathError,
    InvalidURIError,
    IOServiceError,
    RootNotWritableError,
    StorageIOError,
    StorageExistsError,
    StorageNotFoundError,
    StoragePermissionError,
    StorageUnreachableError,
    UnsupportedURIError,
)
from ioservice.format import FORMAT_VERSION, Manifest, ManifestHeader, PageFile, PageTable
from ioservice.fs import FileEntry, StorageRoot, open_root, validate_name
from ioservice.manager import (CheckpointManager, CheckpointPolicy, CheckpointState,
                               PendingCheckpoint, composed_manifest, sweep_unreferenced)
from ioservice.recovery import (CheckpointInfo, list_checkpoints, list_haunits, read_manifest,
                                read_manifest_header, restore, verify_checkpoint)
from ioservice.service import IOService, ReadResult, WriteResult

__all__ = [
    "BackendUnavailableError",
    "CheckpointDamagedError",
    "CheckpointError",
    "CheckpointInProgressError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointPolicy",
    "CheckpointState",
    "CheckpointWriteError",
    "CompositionConflictError",
    "CompositionError",
    "composed_manifest",
    "DamagedCheckpointWarning",
    "DuplicatePagesError",
    "OverlappingRangesError",
    "PageSizeMismatchError",
    "FORMAT_VERSION",
    "IOService",
    "Manifest",
    "ManifestHeader",
    "ManifestError",
    "PageFile",
    "PageTable",
    "PendingCheckpoint",
    "ReadResult",
    "WriteResult",
    "list_checkpoints",
    "list_haunits",
    "read_manifest",
    "read_manifest_header",
    "restore",
    "sweep_unreferenced",
    "verify_checkpoint",
    "FileEntry",
    "IOServiceError",
    "InvalidNameError",
    "InvalidPathError",
    "InvalidURIError",
    "RootNotWritableError",
    "StorageIOError",
    "StorageExistsError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "StorageRoot",
    "StorageUnreachableError",
    "UnsupportedURIError",
    "open_root",
    "validate_name",
]
