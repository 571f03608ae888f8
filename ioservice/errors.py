"""Every ioservice exception, in one hierarchy.

All errors derive from `IOServiceError` and also from the built-in exception a
caller would naturally catch, so ``except ValueError`` around a bad URI and
``except OSError`` around storage I/O keep working::

    IOServiceError
    ├── InvalidURIError (ValueError)
    │   └── UnsupportedURIError
    ├── InvalidNameError (ValueError)
    ├── InvalidPathError (ValueError)
    ├── StorageIOError (OSError)
    ├── StorageNotFoundError (FileNotFoundError)
    ├── StoragePermissionError (PermissionError)
    │   └── RootNotWritableError
    ├── StorageUnreachableError (ConnectionError)
    ├── BackendUnavailableError (OSError)
    └── CheckpointError
        ├── CheckpointWriteError (OSError)
        ├── CheckpointDamagedError (ValueError)
        │   └── ManifestError
        ├── CheckpointNotFoundError (FileNotFoundError)
        ├── CheckpointInProgressError (RuntimeError)
        ├── CompositionError (ValueError)
        │   ├── OverlappingRangesError
        │   ├── DuplicatePagesError
        │   └── PageSizeMismatchError
        └── CompositionConflictError (FileExistsError)

Checkpoint errors name the HA unit, the checkpoint (``<haunit>-<seq>``), the
file and the backend.

Messages name the URI, path and backend at fault.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CheckpointDamagedError",
    "CheckpointError",
    "CheckpointInProgressError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CompositionConflictError",
    "CompositionError",
    "DuplicatePagesError",
    "OverlappingRangesError",
    "PageSizeMismatchError",
    "DamagedCheckpointWarning",
    "ManifestError",
    "IOServiceError",
    "InvalidNameError",
    "InvalidPathError",
    "InvalidURIError",
    "RootNotWritableError",
    "StorageExistsError",
    "StorageIOError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "StorageUnreachableError",
    "UnsupportedURIError",
]


class IOServiceError(Exception):
    """Base class for ioservice errors."""


class InvalidURIError(IOServiceError, ValueError):
    """A storage URI is malformed (e.g. ``s3://`` without a bucket)."""


class UnsupportedURIError(InvalidURIError):
    """A storage URI has a scheme ioservice does not support (only file, s3, hdfs)."""


class InvalidNameError(IOServiceError, ValueError):
    """An HA-unit name (or other path component) is empty, contains ``/``, ``..``,
    control characters, or characters outside the portable set."""


class InvalidPathError(IOServiceError, ValueError):
    """A relative path would escape the storage root or is otherwise malformed."""


class StorageIOError(IOServiceError, OSError):
    """A storage operation failed for a reason not covered by a narrower class."""


class StorageExistsError(IOServiceError, FileExistsError):
    """A create-only write (`StorageRoot.write_new`, ``exclusive=True``) found the target there."""


class StorageNotFoundError(IOServiceError, FileNotFoundError):
    """A file, directory or bucket does not exist."""


class StoragePermissionError(IOServiceError, PermissionError):
    """The storage refused an operation for lack of permission."""


class RootNotWritableError(StoragePermissionError):
    """The storage root cannot be created or written (read-only, a file in the way,
    missing permission, missing bucket)."""


class StorageUnreachableError(IOServiceError, ConnectionError):
    """The storage endpoint cannot be reached (connection refused, timeout, DNS)."""


class BackendUnavailableError(IOServiceError, OSError):
    """The client side of a backend cannot be loaded (e.g. libhdfs or the JVM is missing)."""


class CheckpointError(IOServiceError):
    """Base class for errors of checkpoint writing, recovery and inspection."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed (a page file or its manifest); the checkpoint
    was cancelled and does not exist."""


class CheckpointDamagedError(CheckpointError, ValueError):
    """A checkpoint cannot be restored: a page fails its checksum, a page file is
    missing or short, or a page header does not match the manifest."""


class ManifestError(CheckpointDamagedError):
    """A manifest does not parse, has an unknown ``format_version`` or is inconsistent."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (restorable) checkpoint exists for an HA unit."""


class CheckpointInProgressError(CheckpointError, RuntimeError):
    """A checkpoint was requested while another one of the same HA unit is in flight."""


class CompositionError(CheckpointError, ValueError):
    """A composed checkpoint (`CheckpointManager.compose`) was refused for its input
    (malformed parts or ranges, structures that clash); nothing was written."""


class OverlappingRangesError(CompositionError):
    """Two psid ranges of a composition overlap (in one part or across parts)."""


class DuplicatePagesError(CompositionError):
    """Two parts of a composition hold the same PageID."""


class PageSizeMismatchError(CompositionError):
    """The parts of a composition (or the page manager) use different page sizes."""


class CompositionConflictError(CheckpointError, FileExistsError):
    """The HA unit already has a checkpoint that is not the requested composition
    (a rerun of the same composition returns the existing one instead)."""


class DamagedCheckpointWarning(UserWarning):
    """Recovery skipped a damaged or incomplete checkpoint and fell back to an older one."""
