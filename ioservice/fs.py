"""Storage roots: one `pyarrow.fs` filesystem plus a base path, chosen by URI.

A `StorageRoot` is what the checkpoint writer and recovery talk to. It hides
the differences between the backends that matter for checkpoints:

========  ==========================  ===============================================
backend   URI                         atomic publish of a small object (manifest)
========  ==========================  ===============================================
local     ``file:///abs`` or a path   write temp file, fsync, ``rename``, fsync dir
hdfs      ``hdfs://host:port/path``   write temp file, ``rename`` (HDFS rename is atomic)
s3        ``s3://bucket/prefix``      one PUT (or multipart upload): an object is
                                      invisible until its upload completes
========  ==========================  ===============================================

Every path handed to a `StorageRoot` is *relative* to the root and uses ``/``
as separator (``"checkpoint/agg0-7/manifest.json"``). Each component is
validated, so no relative path can escape the root (``..``), name the root
itself by accident (empty components), or smuggle control characters into an
object key. HA-unit names are validated more strictly by `validate_name`: they
become directory names on every backend.

Errors are translated into the `ioservice.errors` hierarchy at this boundary:
a refused or timed-out connection becomes `StorageUnreachableError`, a missing
object `StorageNotFoundError`, anything else `StorageIOError`; the message names
the backend, the URI of the root and the path. Bytes written to an output
stream are the exception: `open_output_stream` returns the raw pyarrow stream
for speed, whose ``write``/``close`` raise plain `OSError`.

Glossary: *root* — the base directory (or bucket prefix) all checkpoints live
under; *relpath* — a ``/``-separated path relative to the root; *HA unit* — a
set of operators checkpointed together (paper §3), named by a portable name.
"""

from __future__ import annotations

import logging
import os
import re
import unicodedata
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

import pyarrow as pa
import pyarrow.fs as pafs

from ioservice.errors import (
    BackendUnavailableError,
    InvalidNameError,
    InvalidPathError,
    InvalidURIError,
    IOServiceError,
    RootNotWritableError,
    StorageExistsError,
    StorageIOError,
    StorageNotFoundError,
    StoragePermissionError,
    StorageUnreachableError,
    UnsupportedURIError,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_TIMEOUT_S",
    "FileEntry",
    "MAX_NAME_CHARS",
    "StorageRoot",
    "open_root",
    "validate_name",
]

DEFAULT_TIMEOUT_S: Final = 3.0
"""Default S3 connect and request (no-progress) timeout; an unreachable endpoint
fails after at most about ``DEFAULT_MAX_ATTEMPTS * DEFAULT_TIMEOUT_S`` seconds."""

DEFAULT_MAX_ATTEMPTS: Final = 2
"""Default number of attempts per S3 request (1 retry)."""

MAX_NAME_CHARS: Final = 200
"""Longest accepted HA-unit name; leaves room for ``-<seq>`` in a 255-byte file name."""

_NAME_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._=-]*")
_TMP_PREFIX: Final = ".tmp-"
#: listings of a directory that appears meanwhile, before `StorageRoot.list_dir` gives up
_LIST_TRIES: Final = 5
_PROBE_PREFIX: Final = ".sguard-probe-"
_UNREACHABLE_MARKERS: Final = (
    "NETWORK_CONNECTION",
    "curlCode: 6,",  # could not resolve host
    "curlCode: 7,",  # could not connect
    "curlCode: 28,",  # timeout
    "Connection refused",
    "Couldn't connect",
    "Could not connect",
    "timed out",
    "HDFS connection failed",
)
_BACKEND_MISSING_MARKERS: Final = ("Unable to load libjvm", "Unable to load libhdfs",
                                   "Prior attempt to load libhdfs failed")


# ------------------------------------------------------------------------ names


_VALID_NAMES: set[str] = set()  # names `validate_name` accepted: a repeat is not re-checked


def validate_name(name: str, *, what: str = "HA unit name") -> str:
    """Check that `name` is a portable HA-unit name and return it unchanged.

    A valid name is 1 to `MAX_NAME_CHARS` characters from ``A-Z a-z 0-9 . _ = -``,
    not starting with ``.`` or ``-`` (so never ``.``, ``..`` or a hidden file).
    Such a name is a safe directory name on local filesystems, HDFS (no ``:``)
    and S3 (no characters that need URL encoding).

    Parameters
    ----------
    name : str
        The candidate name.
    what : str
        How the error message calls the name (``"HA unit name"``).

    Returns
    -------
    str
        `name`.

    Raises
    ------
    InvalidNameError
        If `name` is not a str, empty, too long, ``.``/``..``, or contains ``/``,
        ``\\``, whitespace, control or other non-portable characters; the message
        says which rule failed.

    Examples
    --------
    >>> validate_name("aggregate.p3")
    'aggregate.p3'
    >>> validate_name("../etc")
    Traceback (most recent call last):
    ...
    ioservice.errors.InvalidNameError: HA unit name '../etc' contains '/'
    """
    if type(name) is str and name in _VALID_NAMES:  # checked before (`what` only names it)
        return name
    if not isinstance(name, str):
        raise InvalidNameError(f"{what} must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidNameError(f"{what} is empty")
    for bad in ("/", "\\"):
        if bad in name:
            raise InvalidNameError(f"{what} {name!r} contains {bad!r}")
    if name in (".", ".."):
        raise InvalidNameError(f"{what} {name!r} is a relative directory reference")
    if any(unicodedata.category(ch).startswith("C") for ch in name):
        raise InvalidNameError(f"{what} {name!r} contains control characters")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidNameError(f"{what} is {len(name)} characters long (at most {MAX_NAME_CHARS})")
    if not _NAME_RE.fullmatch(name):
        raise InvalidNameError(
            f"{what} {name!r} must use only A-Z a-z 0-9 . _ = - and not start with '.' or '-'"
        )
    if len(_VALID_NAMES) >= 4096:  # bounded: a long-lived process meets many names
        _VALID_NAMES.clear()
    _VALID_NAMES.add(name)
    return name


def _check_component(part: str, relpath: str) -> None:
    """Raise InvalidPathError unless `part` is a safe single path component."""
    if not part:
        raise InvalidPathError(f"path {relpath!r} has an empty component (leading, trailing or double '/')")
    if part in (".", ".."):
        raise InvalidPathError(f"path {relpath!r} contains {part!r}: it could escape the storage root")
    if "\\" in part:
        raise InvalidPathError(f"path {relpath!r} contains a backslash")
    if any(unicodedata.category(ch).startswith("C") for ch in part):
        raise InvalidPathError(f"path {relpath!r} contains control characters")


# ---------------------------------------------------------------------- entries


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One entry of a directory listing (see `StorageRoot.list_dir`)."""

    relpath: str
    """Path relative to the storage root, ``/``-separated."""
    is_dir: bool
    size_bytes: int | None
    """File size; None for directories."""
    mtime_ns: int | None
    """Modification time in ns since the epoch when the backend reports it."""

    @property
    def name(self) -> str:
        """Last component of `relpath`."""
        return self.relpath.rsplit("/", 1)[-1]


# -------------------------------------------------------------------- the root


class StorageRoot:
    """A pyarrow filesystem and a base path under which checkpoints live.

    Build one with `open_root` from a URI, or directly around any
    `pyarrow.fs.FileSystem` (e.g. a `pyarrow.fs.PyFileSystem` over
    `ioservice.testing.FaultyFS`).

    Parameters
    ----------
    filesystem : pyarrow.fs.FileSystem
        The filesystem doing the I/O.
    base_path : str
        Root directory in `filesystem`'s own path syntax (absolute local path,
        ``bucket/prefix`` for S3, ``/path`` for HDFS). Trailing ``/`` is dropped.
    uri : str or None
        URI shown in error messages; defaults to ``<type_name>:<base_path>``.
    atomic_rename : bool or None
        Whether `filesystem` renames a file atomically (local, HDFS). None
        derives it from ``filesystem.type_name`` (wrapper handlers that name
        themselves ``<wrapper>+<inner>``, as FaultyFS does, inherit the inner
        filesystem's answer); S3 and unknown filesystems get False, which makes
        `write_atomic` write the object in place.

    Notes
    -----
    Thread safety: a StorageRoot holds no mutable state; its methods can be
    called from many I/O worker threads at once (pyarrow filesystems are
    thread safe and release the GIL during I/O).
    """

    def __init__(
        self,
        filesystem: pafs.FileSystem,
        base_path: str,
        *,
        uri: str | None = None,
        atomic_rename: bool | None = None,
    ) -> None:
        if not isinstance(filesystem, pafs.FileSystem):
            raise TypeError(f"filesystem must be a pyarrow.fs.FileSystem, got {type(filesystem).__name__}")
        base = base_path.rstrip("/") if base_path not in ("/", "") else base_path
        self.filesystem: Final = filesystem
        self.base_path: Final = base
        self.uri: Final = uri if uri is not None else f"{filesystem.type_name}:{base}"
        self._kind: Final = self.backend.rsplit("+", 1)[-1]  # FaultyFS: "py::faulty+s3" -> "s3"
        self.atomic_rename: Final = (
            atomic_rename if atomic_rename is not None else self._kind in ("local", "hdfs")
        )
        self._native_local: Final = isinstance(filesystem, pafs.LocalFileSystem)

    @property
    def backend(self) -> str:
        """The filesystem's ``type_name``: ``local``, ``s3``, ``hdfs``, ``py::faulty+local`` ..."""
        return str(self.filesystem.type_name)

    def __repr__(self) -> str:
        return f"StorageRoot({self.uri!r}, backend={self.backend!r})"

    # ----------------------------------------------------------------- paths

    def join(self, *parts: str) -> str:
        """Join path components into a relpath, validating each one.

        Parameters
        ----------
        *parts : str
            Components; each may itself contain ``/`` separators.

        Returns
        -------
        str
            The ``/``-joined relative path.

        Raises
        ------
        InvalidPathError
            If a component is empty, ``.``, ``..``, or contains a backslash or
            control characters.

        Examples
        --------
        >>> root = StorageRoot(pafs.LocalFileSystem(), "/data")
        >>> root.join("checkpoint", "agg-3", "manifest.json")
        'checkpoint/agg-3/manifest.json'
        """
        relpath = "/".join(parts)
        self._check_relpath(relpath)
        return relpath

    def full_path(self, relpath: str) -> str:
        """Return `relpath` as a path of `filesystem` (``""`` is the root itself).

        Raises
        ------
        InvalidPathError
            If `relpath` is absolute or has an unsafe component (see `join`).
        """
        self._check_relpath(relpath, allow_root=True)
        if not relpath:
            return self.base_path
        if self.base_path in ("", "/"):
            return self.base_path + relpath
        return f"{self.base_path}/{relpath}"

    def _check_relpath(self, relpath: str, *, allow_root: bool = False) -> None:
        """Raise InvalidPathError unless `relpath` is a safe relative path."""
        if not isinstance(relpath, str):
            raise InvalidPathError(f"path must be a str, got {type(relpath).__name__}")
        if relpath == "":
            if allow_root:
                return
            raise InvalidPathError(f"empty path: an operation on the storage root {self.uri} itself is not allowed")
        if relpath.startswith("/"):
            raise InvalidPathError(f"path {relpath!r} must be relative to the storage root {self.uri}")
        for part in relpath.split("/"):
            _check_component(part, relpath)

    def _relpath_of(self, full: str) -> str:
        """Inverse of `full_path` for paths returned by the filesystem."""
        if "://" in full:  # some backends answer with full URIs
            full = "/" + full.split("://", 1)[1].partition("/")[2]
        base = self.base_path.rstrip("/")
        if not base:
            return full.lstrip("/")
        if full.startswith(base + "/"):
            return full[len(base) + 1:]
        return full  # pragma: no cover - the filesystem returned a foreign path

    # ----------------------------------------------------------- error mapping

    @contextmanager
    def _translating(self, op: str, relpath: str) -> Iterator[None]:
        """Translate pyarrow/OS errors raised inside into ioservice errors."""
        try:
            yield
        except IOServiceError:
            raise
        except (OSError, pa.ArrowException) as exc:
            raise self._translate(exc, op, relpath) from exc

    def _translate(self, exc: BaseException, op: str, relpath: str) -> IOServiceError:
        """Map one exception to the narrowest ioservice error."""
        where = f"{op} {relpath or '<root>'!r} on {self.backend} root {self.uri}"
        text = str(exc)
        if any(marker in text for marker in _UNREACHABLE_MARKERS) or isinstance(exc, (ConnectionError, TimeoutError)):
            return StorageUnreachableError(f"{where}: storage unreachable: {_first_line(text)}")
        if isinstance(exc, FileNotFoundError) or "NoSuchKey" in text or "NoSuchBucket" in text:
            return StorageNotFoundError(f"{where}: not found: {_first_line(text)}")
        if isinstance(exc, PermissionError) or "ACCESS_DENIED" in text or "AccessDenied" in text:
            return StoragePermissionError(f"{where}: permission denied: {_first_line(text)}")
        return StorageIOError(f"{where}: {_first_line(text)}")

    # ------------------------------------------------------------- metadata

    def exists(self, relpath: str) -> bool:
        """True if a file or directory exists at `relpath`.

        Raises
        ------
        InvalidPathError, StorageUnreachableError, StorageIOError
        """
        path = self.full_path(relpath)
        with self._translating("stat", relpath):
            info = self.filesystem.get_file_info(path)
        found: bool = info.type != pafs.FileType.NotFound
        return found

    def size_bytes(self, relpath: str) -> int:
        """Size of the file at `relpath`.

        Raises
        ------
        StorageNotFoundError
            If there is no file at `relpath`.
        InvalidPathError, StorageUnreachableError, StorageIOError
        """
        path = self.full_path(relpath)
        with self._translating("stat", relpath):
            info = self.filesystem.get_file_info(path)
        if info.type != pafs.FileType.File or info.size is None:
            raise StorageNotFoundError(f"stat {relpath!r} on {self.backend} root {self.uri}: no such file")
        return int(info.size)

    def list_dir(self, relpath: str = "", *, recursive: bool = False,
                 allow_not_found: bool = False) -> list[FileEntry]:
        """List the entries under directory `relpath`, sorted by relpath.

        Parameters
        ----------
        relpath : str
            Directory relative to the root; ``""`` lists the root.
        recursive : bool
            Descend into subdirectories.
        allow_not_found : bool
            Return ``[]`` for a missing directory instead of raising. S3 has no
            real directories: a "directory" exists while an object lies under it,
            so portable callers pass True.

        Returns
        -------
        list of FileEntry
            Files and directories; temporary files of interrupted `write_atomic`
            calls (names starting with ``.tmp-``) are included, so retention can
            clean them up.

        Raises
        ------
        StorageNotFoundError
            If the directory does not exist and `allow_not_found` is False.
        InvalidPathError, StorageUnreachableError, StorageIOError

        Notes
        -----
        Runtime complexity: O(entries) requests on S3 (1000 keys per request).
        """
        path = self.full_path(relpath)
        selector = pafs.FileSelector(path, allow_not_found=allow_not_found, recursive=recursive)
        with self._translating("list", relpath):
            infos = self._list(selector)
        entries = [
            FileEntry(
                relpath=self._relpath_of(info.path),
                is_dir=info.type == pafs.FileType.Directory,
                size_bytes=None if info.type == pafs.FileType.Directory else info.size,
                mtime_ns=info.mtime_ns,
            )
            for info in infos
        ]
        entries.sort(key=lambda e: e.relpath)
        return entries

    def _list(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        """``get_file_info(selector)``. With ``allow_not_found``, pyarrow's local listing
        that fails with ENOENT checks whether the directory exists and, if it was created
        (by another thread or process) in between, raises the listing's ENOENT: a directory
        that appears while it is listed is listed again (a few times, then it raises)."""
        for _ in range(_LIST_TRIES - 1):
            try:
                return list(self.filesystem.get_file_info(selector))
            except FileNotFoundError:
                if not selector.allow_not_found:
                    raise
        return list(self.filesystem.get_file_info(selector))

    def create_dir(self, relpath: str) -> None:
        """Create directory `relpath` and its parents; no error if it exists.

        On S3 this writes a zero-byte directory marker (directories are implicit).

        Raises
        ------
        InvalidPathError, StoragePermissionError, StorageUnreachableError, StorageIOError
        """
        path = self.full_path(relpath)
        with self._translating("create directory", relpath):
            self.filesystem.create_dir(path, recursive=True)

    # ---------------------------------------------------------------- writes

    def open_output_stream(self, relpath: str, *, create_parents: bool = True,
                           exclusive: bool = False) -> pa.NativeFile:
        """Open a new file at `relpath` for sequential writing (truncates an old one).

        With ``exclusive=True`` an existing file is never truncated: on a local
        filesystem the file is first created with ``O_CREAT | O_EXCL`` and the
        call raises `StorageExistsError` if it is there; other backends have no
        create-only open through pyarrow (S3 has no conditional PUT), so there
        the caller must use names no other writer uses.

        Use it as a context manager; the data is complete only after ``close()``
        returns. On S3 the object becomes visible only then (multipart upload);
        on local filesystems call `sync` after closing for durability.

        Parameters
        ----------
        relpath : str
            File to write.
        create_parents : bool
            Create missing parent directories first (not needed on S3).

        Returns
        -------
        pyarrow.NativeFile
            A writable stream; its ``write`` releases the GIL. Its errors are
            raw `OSError`: wrap them where the caller knows the page and epoch.

        Notes
        -----
        A stream cannot be aborted: closing it after a failed ``write`` — which
        a ``with`` block does, and so does garbage collection — publishes the
        bytes written so far (on S3 as a complete object). Never treat the mere
        existence of a data file as proof it is complete: the manifest, written
        last with `write_atomic`, is what makes a checkpoint exist.

        Raises
        ------
        InvalidPathError, StoragePermissionError, StorageUnreachableError, StorageIOError
            When opening fails.
        """
        path = self.full_path(relpath)
        with self._translating("open for writing", relpath):
            if create_parents:
                self._create_parent(relpath)
            if exclusive and self._native_local:
                try:
                    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                except FileExistsError:
                    raise StorageExistsError(
                        f"{relpath} already exists on {self.backend} root {self.uri} "
                        f"(create-only open)") from None
            return self.filesystem.open_output_stream(path)

    def _create_parent(self, relpath: str) -> None:
        """Create the parent directory of `relpath` where directories are real."""
        if "/" in relpath and self._kind != "s3":
            self.filesystem.create_dir(self.full_path(relpath.rsplit("/", 1)[0]), recursive=True)

    def write_atomic(self, relpath: str, data: bytes | bytearray | memoryview) -> None:
        """Write a small object (a manifest) so readers see all of it or nothing.

        - *local*: write ``.tmp-<uuid>-<name>`` beside the target, fsync it,
          ``os.replace`` it over the target, fsync the directory: atomic and
          durable once this returns.
        - *HDFS* and other filesystems with atomic rename: write the temp file,
          then ``move`` it onto the target. HDFS rename does not overwrite, so an
          existing target is deleted first (a short window in which the target
          is missing; manifests are written once, so this does not arise).
        - *S3*: one direct write. An S3 object appears only when its PUT (or
          multipart upload) completes, so readers never see a partial object,
          and S3 has no rename to use anyway. pyarrow cannot abort an upload
          (closing a stream after a failed ``write`` publishes the bytes
          written so far), so on failure the target is deleted: a failed
          write leaves the target *absent*, not partial — a previous version
          is lost, which is fine for manifests, written once per checkpoint.

        Parameters
        ----------
        relpath : str
            Target file.
        data : bytes-like
            The complete contents.

        Raises
        ------
        InvalidPathError, StoragePermissionError, StorageUnreachableError, StorageIOError
            On failure; the target is then unchanged on local/HDFS (the temp
            file is removed when possible; a crash may leave a ``.tmp-`` file)
            and absent on S3 — never partial.
        """
        path = self.full_path(relpath)
        if self._native_local:
            with self._translating("atomic write", relpath):
                _write_atomic_local(path, data)
            return
        with self._translating("atomic write", relpath):
            self._create_parent(relpath)
            if not self.atomic_rename:
                self._put_or_remove(path, data)
                return

            def replace() -> None:  # HDFS's move does not overwrite
                if self._kind == "hdfs" and \
                        self.filesystem.get_file_info(path).type != pafs.FileType.NotFound:
                    self.filesystem.delete_file(path)

            self._move_from_temp(path, data, replace)

    def write_new(self, relpath: str, data: bytes | bytearray | memoryview) -> None:
        """Like `write_atomic`, but never replaces an existing file (create-only).

        - *local*: the data goes to a temp file (fsynced), which is then
          hard-linked to the target: ``link`` fails if the target exists, so of
          two writers exactly one succeeds; the directory is fsynced.
        - *HDFS*: temp file, then ``move``, which does not overwrite on HDFS.
        - *S3*: pyarrow has no conditional PUT, so this checks that the target
          is absent and then writes it: two writers racing on one name can both
          "succeed" and the later PUT wins. Callers that need fencing on S3
          must use names unique per writer (as sguard's epochs do).

        Raises
        ------
        StorageExistsError
            If the target exists (it is unchanged).
        InvalidPathError, StoragePermissionError, StorageUnreachableError, StorageIOError
        """
        path = self.full_path(relpath)
        exists_msg = f"{relpath} already exists on {self.backend} root {self.uri} (create-only write)"
        if self._native_local:
            with self._translating("create-only write", relpath):
                if not _write_new_local(path, data):
                    raise StorageExistsError(exists_msg)
            return
        with self._translating("create-only write", relpath):
            if self.filesystem.get_file_info(path).type != pafs.FileType.NotFound:
                raise StorageExistsError(exists_msg)
            self._create_parent(relpath)
            if not self.atomic_rename:
                self._put_or_remove(path, data)
                return

            def refuse() -> None:  # created meanwhile (on HDFS, move would refuse it too)
                if self.filesystem.get_file_info(path).type != pafs.FileType.NotFound:
                    raise StorageExistsError(exists_msg)

            self._move_from_temp(path, data, refuse)

    def _move_from_temp(self, path: str, data: bytes | bytearray | memoryview,
                        before_move: Callable[[], None]) -> None:
        """Write `data` to a temp file beside `path`, call `before_move` (which may
        raise), then move the temp file to `path`; the temp file is deleted on failure."""
        parent, _, name = path.rpartition("/")
        tmp = f"{parent}/{_TMP_PREFIX}{uuid.uuid4().hex}-{name}"
        try:
            with self.filesystem.open_output_stream(tmp) as out:
                out.write(data)
            before_move()
            self.filesystem.move(tmp, path)
        except BaseException:
            _delete_quietly(self.filesystem, tmp)
            raise

    def _put_or_remove(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Write `data` to `path` in one go; on any failure make sure `path` is absent.

        pyarrow cannot abort an S3 upload: closing (or garbage-collecting) a
        stream after a failed ``write`` completes the upload with the bytes
        written so far. Deleting the target afterwards turns that partial
        object into a clean absence.
        """
        out = self.filesystem.open_output_stream(path)
        try:
            out.write(data)
        except BaseException:
            try:
                out.close()
            except (OSError, pa.ArrowException):
                pass
            _delete_quietly(self.filesystem, path)
            raise
        try:
            out.close()
        except BaseException:
            _delete_quietly(self.filesystem, path)
            raise

    def sync(self, relpath: str) -> None:
        """Make a closed file durable: fsync it on a local filesystem, else no-op.

        pyarrow's local output streams do not fsync on close; this opens the
        file and fsyncs it (Linux flushes the inode's dirty pages whatever
        descriptor fsyncs), then fsyncs its directory. HDFS and S3 streams are
        durable (replicated) once ``close`` returns.

        Raises
        ------
        InvalidPathError, StorageNotFoundError, StorageIOError
        """
        path = self.full_path(relpath)
        if not self._native_local:
            return
        with self._translating("fsync", relpath):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_dir(os.path.dirname(path))

    # ----------------------------------------------------------------- reads

    def open_input_file(self, relpath: str) -> pa.NativeFile:
        """Open `relpath` for random access (``read_at``, ``seek``, ``size``).

        Raises
        ------
        StorageNotFoundError
            If the file does not exist.
        InvalidPathError, StorageUnreachableError, StorageIOError
        """
        path = self.full_path(relpath)
        with self._translating("open for reading", relpath):
            return self.filesystem.open_input_file(path)

    def read_bytes(self, relpath: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """Read a whole file, or `length` bytes from `offset`.

        Parameters
        ----------
        relpath : str
            File to read.
        offset : int
            First byte, >= 0.
        length : int or None
            Number of bytes; None reads to the end. A range past the end of the
            file returns the bytes that exist (possibly ``b""``), as ``pread``
            does: callers that need exactly `length` bytes check the result.

        Returns
        -------
        bytes

        Raises
        ------
        ValueError
            If `offset` or `length` is negative.
        StorageNotFoundError
            If the file does not exist.
        InvalidPathError, StorageUnreachableError, StorageIOError

        Notes
        -----
        A range read is one ranged GET on S3 and one positioned read elsewhere.
        """
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"read {relpath!r}: offset and length must be >= 0, got {offset}, {length}")
        path = self.full_path(relpath)
        with self._translating("read", relpath):
            if offset == 0 and length is None:
                with self.filesystem.open_input_stream(path) as stream:
                    return bytes(stream.read())
            with self.filesystem.open_input_file(path) as f:
                size = f.size()
                if offset >= size:
                    return b""
                n = size - offset if length is None else min(length, size - offset)
                f.seek(offset)
                return bytes(f.read(n))

    # --------------------------------------------------------------- deletes

    def delete_file(self, relpath: str, *, missing_ok: bool = False) -> None:
        """Delete the file at `relpath`.

        Raises
        ------
        StorageNotFoundError
            If it does not exist and `missing_ok` is False.
        InvalidPathError, StoragePermissionError, StorageUnreachableError, StorageIOError
        """
        path = self.full_path(relpath)
        try:
            with self._translating("delete", relpath):
                self.filesystem.delete_file(path)
        except StorageNotFoundError:
            if not missing_ok:
                raise

    def delete_dir(self, relpath: str, *, missing_ok: bool = True) -> None:
        """Delete directory `relpath` and everything under it.

        The root itself cannot be deleted this way (``""`` is refused).

        Raises
        ------
        InvalidPathError
            For ``""`` or an unsafe path.
        StorageNotFoundError
            If it does not exist and `missing_ok` is False.
        StoragePermissionError, StorageUnreachableError, StorageIOError
        """
        path = self.full_path(relpath)  # "" is allowed by full_path ...
        self._check_relpath(relpath)  # ... but not here
        with self._translating("delete directory", relpath):
            info = self.filesystem.get_file_info(path)
            if info.type == pafs.FileType.NotFound:
                if missing_ok:
                    return
                raise StorageNotFoundError(
                    f"delete directory {relpath!r} on {self.backend} root {self.uri}: not found"
                )
            self.filesystem.delete_dir(path)

    # ---------------------------------------------------------------- probes

    def check_writable(self) -> None:
        """Prove the root is writable: create it, write, read back and delete a probe file.

        Raises
        ------
        RootNotWritableError
            If the root cannot be created or written (read-only filesystem, a
            file where a directory should be, missing permission or bucket).
        StorageUnreachableError
            If the storage cannot be reached.
        """
        probe = f"{_PROBE_PREFIX}{uuid.uuid4().hex}"
        payload = b"sguard write probe\n"
        try:
            if self._kind != "s3":
                with self._translating("create root", ""):
                    self.filesystem.create_dir(self.base_path, recursive=True)
            with self._translating("write probe", probe):
                with self.filesystem.open_output_stream(self.full_path(probe)) as out:
                    out.write(payload)
            got = self.read_bytes(probe)
            self.delete_file(probe, missing_ok=True)
        except StorageUnreachableError:
            raise
        except IOServiceError as exc:
            raise RootNotWritableError(f"storage root {self.uri} ({self.backend}) is not writable: {exc}") from exc
        if got != payload:
            raise RootNotWritableError(
                f"storage root {self.uri} ({self.backend}): probe file read back {len(got)} of {len(payload)} bytes"
            )

    def check_reachable(self) -> None:
        """Make one cheap metadata request to the root (HEAD on S3).

        Raises
        ------
        StorageUnreachableError
            If the endpoint refuses or times out.
        StorageNotFoundError
            If the S3 bucket does not exist.
        StorageIOError
            On other failures (e.g. bad credentials).
        """
        with self._translating("reach", ""):
            info = self.filesystem.get_file_info(self.base_path.split("/", 1)[0] or "/")
        if self._kind == "s3" and info.type == pafs.FileType.NotFound:
            raise StorageNotFoundError(f"bucket of {self.uri} does not exist (create it first)")


# ------------------------------------------------------------------- open_root


def open_root(
    uri: str,
    *,
    create: bool = True,
    s3_endpoint: str | None = None,
    s3_access_key: str | None = None,
    s3_secret_key: str | None = None,
    s3_region: str = "us-east-1",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    hdfs_user: str | None = None,
    hdfs_replication: int = 3,
) -> StorageRoot:
    """Open the storage root named by `uri`.

    Parameters
    ----------
    uri : str
        ``file:///abs/path``, a plain local path (relative paths are resolved
        against the working directory; the embedded default),
        ``s3://bucket[/prefix]`` or ``hdfs://host:port/path``.
    create : bool
        Create the root directory if missing (local and HDFS; S3 prefixes are
        implicit, but the bucket must exist).
    s3_endpoint : str or None
        S3 endpoint override, ``http://host:port`` or ``host:port`` (https if no
        scheme); default ``$SGUARD_S3_ENDPOINT``, else AWS.
    s3_access_key, s3_secret_key : str or None
        Credentials; default ``$AWS_ACCESS_KEY_ID`` / ``$AWS_SECRET_ACCESS_KEY``.
        Without any, requests are anonymous (the AWS credential chain and its
        instance-metadata lookup are never consulted).
    s3_region : str
        Region sent to S3 (SeaweedFS and MinIO ignore it).
    timeout_s : float
        S3 connect timeout and no-progress request timeout, seconds.
    max_attempts : int
        S3 attempts per request (``1`` = no retry).
    hdfs_user : str or None
        HDFS user name; default from the Hadoop configuration.
    hdfs_replication : int
        HDFS replication factor of files written.

    Returns
    -------
    StorageRoot

    Raises
    ------
    UnsupportedURIError
        For a scheme other than ``file``, ``s3``, ``hdfs`` (or none).
    InvalidURIError
        For a malformed URI (empty, blank, leading or trailing whitespace,
        ``s3://`` without a bucket, ``hdfs://`` without a host, a ``file://``
        URI with a remote host, a query string).
    StorageUnreachableError
        If the S3 endpoint or HDFS namenode cannot be reached within about
        ``max_attempts * timeout_s`` seconds.
    StorageNotFoundError
        If the S3 bucket does not exist.
    RootNotWritableError
        If `create` is True and the root directory cannot be created (e.g. a
        regular file is in the way, or the filesystem is read-only).
    BackendUnavailableError
        If the HDFS client (libhdfs, a JVM) cannot be loaded.

    Examples
    --------
    >>> import tempfile
    >>> root = open_root(tempfile.mkdtemp())
    >>> root.write_atomic("checkpoint/agg-1/manifest.json", b"{}")
    >>> [e.name for e in root.list_dir("checkpoint/agg-1")]
    ['manifest.json']
    """
    if not isinstance(uri, str) or not uri.strip():
        raise InvalidURIError(f"storage URI must be a non-blank str, got {uri!r}")
    if uri != uri.strip():
        raise InvalidURIError(f"storage URI {uri!r} has leading or trailing whitespace")
    if any(unicodedata.category(ch).startswith("C") for ch in uri):
        raise InvalidURIError(f"storage URI {uri!r} contains control characters")
    scheme, sep, _ = uri.partition("://")
    if not sep:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", uri) and not os.path.exists(uri):
            raise UnsupportedURIError(
                f"storage URI {uri!r}: expected scheme://..., supported schemes are file, s3, hdfs"
            )
        return _open_local(os.path.abspath(uri), uri, create)
    scheme = scheme.lower()
    parsed = urllib.parse.urlsplit(uri)
    if parsed.query or parsed.fragment:
        raise InvalidURIError(f"storage URI {uri!r}: query strings and fragments are not supported")
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise InvalidURIError(f"file URI {uri!r} names remote host {parsed.netloc!r}; use file:///abs/path")
        path = urllib.parse.unquote(parsed.path)
        if not path.startswith("/"):
            raise InvalidURIError(f"file URI {uri!r} must hold an absolute path")
        return _open_local(os.path.normpath(path), uri, create)
    if scheme == "s3":
        return _open_s3(uri, parsed, s3_endpoint, s3_access_key, s3_secret_key, s3_region,
                        timeout_s, max_attempts)
    if scheme == "hdfs":
        return _open_hdfs(uri, parsed, create, hdfs_user, hdfs_replication)
    raise UnsupportedURIError(f"storage URI {uri!r}: unsupported scheme {scheme!r} (use file, s3 or hdfs)")


def _open_local(path: str, uri: str, create: bool) -> StorageRoot:
    """Open a local root at absolute `path`."""
    root = StorageRoot(pafs.LocalFileSystem(), path, uri=uri)
    if os.path.exists(path) and not os.path.isdir(path):
        raise RootNotWritableError(f"storage root {uri}: {path} exists and is not a directory")
    if create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise RootNotWritableError(f"storage root {uri}: cannot create directory {path}: {exc}") from exc
    return root


def _open_s3(uri: str, parsed: urllib.parse.SplitResult, endpoint: str | None,
             access_key: str | None, secret_key: str | None, region: str,
             timeout_s: float, max_attempts: int) -> StorageRoot:
    """Open an S3 root; probe the bucket once."""
    bucket = parsed.netloc
    if not bucket:
        raise InvalidURIError(f"S3 URI {uri!r} has no bucket; use s3://bucket/prefix")
    if "@" in bucket or ":" in bucket:
        raise InvalidURIError(f"S3 URI {uri!r}: credentials or ports in the URI are not supported; "
                              "pass s3_endpoint / set SGUARD_S3_ENDPOINT and AWS_* variables")
    prefix = urllib.parse.unquote(parsed.path).strip("/")
    if prefix:
        for part in prefix.split("/"):
            try:
                _check_component(part, prefix)
            except InvalidPathError as exc:
                raise InvalidURIError(f"S3 URI {uri!r}: {exc}") from exc
    endpoint = endpoint or os.environ.get("SGUARD_S3_ENDPOINT") or None
    access_key = access_key or os.environ.get("AWS_ACCESS_KEY_ID") or None
    secret_key = secret_key or os.environ.get("AWS_SECRET_ACCESS_KEY") or None
    if (access_key is None) != (secret_key is None):
        raise InvalidURIError(f"S3 root {uri}: give both an access key and a secret key, or neither")
    if max_attempts < 1 or timeout_s <= 0:
        raise ValueError(f"S3 root {uri}: need max_attempts >= 1 and timeout_s > 0")
    kwargs: dict[str, object] = {}
    where = "AWS"
    if endpoint:
        scheme = "https"
        host = endpoint
        if "://" in endpoint:
            scheme, _, host = endpoint.partition("://")
        host = host.rstrip("/")
        if scheme not in ("http", "https") or not host or "/" in host:
            raise InvalidURIError(f"S3 endpoint {endpoint!r} must look like http://host:port")
        kwargs.update(endpoint_override=host, scheme=scheme)
        where = endpoint
    if access_key is not None:
        kwargs.update(access_key=access_key, secret_key=secret_key)
    else:
        kwargs.update(anonymous=True)
    fs = pafs.S3FileSystem(
        region=region,
        connect_timeout=timeout_s,
        request_timeout=timeout_s,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=max_attempts),
        allow_bucket_creation=False,
        allow_bucket_deletion=False,
        **kwargs,
    )
    base = f"{bucket}/{prefix}" if prefix else bucket
    root = StorageRoot(fs, base, uri=f"{uri} (endpoint {where})")
    root.check_reachable()
    return root


def _open_hdfs(uri: str, parsed: urllib.parse.SplitResult, create: bool,
               user: str | None, replication: int) -> StorageRoot:
    """Open an HDFS root through pyarrow's libhdfs binding."""
    if not parsed.hostname:
        raise InvalidURIError(f"HDFS URI {uri!r} has no namenode host; use hdfs://host:port/path")
    try:
        port = parsed.port or 8020
    except ValueError as exc:
        raise InvalidURIError(f"HDFS URI {uri!r}: bad port") from exc
    path = urllib.parse.unquote(parsed.path) or "/"
    try:
        fs = pafs.HadoopFileSystem(parsed.hostname, port, user=user, replication=replication)
    except OSError as exc:
        text = str(exc)
        if any(marker in text for marker in _BACKEND_MISSING_MARKERS):
            raise BackendUnavailableError(
                f"HDFS root {uri}: the HDFS client cannot be loaded ({_first_line(text)}); "
                "set JAVA_HOME, ARROW_LIBHDFS_DIR or HADOOP_HOME and CLASSPATH "
                "(`hadoop classpath --glob`)"
            ) from exc
        raise StorageUnreachableError(f"HDFS root {uri}: cannot connect to namenode "
                                      f"{parsed.hostname}:{port}: {_first_line(text)}") from exc
    root = StorageRoot(fs, path, uri=uri)
    if create:
        try:
            fs.create_dir(path, recursive=True)
        except OSError as exc:
            err = root._translate(exc, "create root", "")
            if isinstance(err, StorageUnreachableError):
                raise err from exc
            raise RootNotWritableError(f"storage root {uri}: cannot create {path}: {exc}") from exc
    return root


# --------------------------------------------------------------------- helpers


def _first_line(text: str, limit: int = 300) -> str:
    """First line of `text`, cut to `limit` characters."""
    line = text.strip().splitlines()[0] if text.strip() else "<no message>"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _fsync_dir(path: str) -> None:
    """fsync directory `path` so a rename or create in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp_local(path: str, data: bytes | bytearray | memoryview) -> tuple[str, str]:
    """Write `data` to a fsynced temp file beside `path`; returns ``(parent, temp path)``."""
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f"{_TMP_PREFIX}{uuid.uuid4().hex}-{name}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return parent, tmp


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_atomic_local(path: str, data: bytes | bytearray | memoryview) -> None:
    """Write `data` to `path` via temp file + fsync + rename + directory fsync."""
    parent, tmp = _write_temp_local(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _fsync_dir(parent)


def _write_new_local(path: str, data: bytes | bytearray | memoryview) -> bool:
    """Create `path` with `data` unless it exists (temp file + fsync + link); False if it did."""
    parent, tmp = _write_temp_local(path, data)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        _unlink_quietly(tmp)
    _fsync_dir(parent)
    return True


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    """Best-effort delete of a temp file after a failed write."""
    try:
        fs.delete_file(path)
    except (OSError, pa.ArrowException):
        logger.debug("could not delete temp file %s", path)
