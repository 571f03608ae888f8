"""Every mmm exception, in one hierarchy.

Each error also subclasses the built-in exception a caller would naturally
catch (``KeyError`` for a missing page, ``MemoryError`` for an exhausted pool,
``TypeError``/``ValueError`` for bad input), and its message names the thing at
fault. Every operation that raises leaves the state it was called on unchanged.
"""
from __future__ import annotations


class MmmError(Exception):
    """Base class for mmm errors."""


class PageSizeError(MmmError, ValueError):
    """A page size that is not a power of two between 4 KiB and 1 MiB."""


class SchemaError(MmmError, TypeError):
    """A record schema mmm cannot store (object fields, unsized or non-numpy types)."""


class SchemaMismatchError(MmmError, ValueError):
    """A structure reopened by name with a different kind or schema."""


class RecordTypeError(MmmError, TypeError):
    """Keys or values of the wrong dtype or shape for the structure's schema."""


class StructureNotFoundError(MmmError, KeyError):
    """An unknown structure name (or one that a rollback or load removed)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PageSetNotFoundError(MmmError, KeyError):
    """A page set id (PSID) that does not exist."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class PageSetExistsError(MmmError, ValueError):
    """A PSID asked for explicitly that another page set already uses."""


class NamespaceFullError(MmmError, RuntimeError):
    """A `Namespace` whose PSID block has no free PSID left."""


class PageNotFoundError(MmmError, KeyError):
    """A PageID that does not exist."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class PoolExhaustedError(MmmError, MemoryError):
    """The page pool has no free frame left."""


class PoolSpaceError(PoolExhaustedError):
    """The file system of a file-backed pool has no room for the frames asked for.

    Raised by an allocation (or by creating or attaching the pool) before any frame
    is handed out, so the call leaves the pool and every structure as before, exactly
    like `PoolExhaustedError`, of which it is a kind: code that handles an exhausted
    pool handles a full file system too.

    Attributes
    ----------
    directory : str
        The directory of the pool file.
    needed_bytes : int
        Bytes the pool file needed to reserve.
    free_bytes : int
        Bytes free on that file system at the time (for an unprivileged user).
    """

    def __init__(self, message: str, directory: str = "", needed_bytes: int = 0,
                 free_bytes: int = 0) -> None:
        super().__init__(message)
        self.directory = directory
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes

    def __reduce__(self) -> tuple[object, ...]:  # raised in Spark workers, shipped to the driver
        return (type(self), (str(self), self.directory, self.needed_bytes, self.free_bytes))


class PoolFileError(MmmError, OSError):
    """A pool backing file that is missing, foreign or of another geometry."""


class RollbackPointError(PoolFileError):
    """A page table to roll a pool file back to (`PagePool.attach`'s ``rollback_to``) that
    the file no longer holds: frames outside the pool, or frames holding other pages."""


class SnapshotStateError(MmmError, RuntimeError):
    """A snapshot used in a state that does not allow the operation."""


class PageFormatError(MmmError, ValueError):
    """Page bytes handed to ``load`` that are not a valid mmm page."""


class KeyFormatError(MmmError, ValueError):
    """Variable-length keys whose offsets decrease or point outside their data buffer."""


class IdNotFoundError(MmmError, KeyError):
    """A key id that is not in the key dictionary (never given, or removed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
