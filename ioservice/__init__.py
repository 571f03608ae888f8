"""ioservice: page and checkpoint I/O to any pyarrow filesystem (SGuard paper §3, §4.4, §5).

This package currently holds the storage layer the checkpoint writer and
recovery build on:

`ioservice.fs`
    `open_root` resolves a URI (``file://`` or a local path — the embedded
    default —, ``s3://bucket/prefix`` with an endpoint override,
    ``hdfs://host:port/path``) to a `StorageRoot`: a `pyarrow.fs.FileSystem`
    plus a base path, with safe path joining, HA-unit name validation, output
    streams, atomic manifest writes, listings, whole/range reads, deletes and
    writability/reachability probes.
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
"""

from ioservice.errors import (
    BackendUnavailableError,
    InvalidNameError,
    InvalidPathError,
    InvalidURIError,
    IOServiceError,
    RootNotWritableError,
    StorageIOError,
    StorageNotFoundError,
    StoragePermissionError,
    StorageUnreachableError,
    UnsupportedURIError,
)
from ioservice.fs import FileEntry, StorageRoot, open_root, validate_name

__all__ = [
    "BackendUnavailableError",
    "FileEntry",
    "IOServiceError",
    "InvalidNameError",
    "InvalidPathError",
    "InvalidURIError",
    "RootNotWritableError",
    "StorageIOError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "StorageRoot",
    "StorageUnreachableError",
    "UnsupportedURIError",
    "open_root",
    "validate_name",
]
