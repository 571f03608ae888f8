"""The on-disk checkpoint format: directory layout, page files, the manifest.

Layout (paper §5: ``/checkpoint/chkpt_id``, ``chkpt_id`` = HA unit + sequence)::

    <root>/checkpoint/<haunit>-<seq>/w000.pages     pages written by I/O worker 0
    <root>/checkpoint/<haunit>-<seq>/w001.pages     ... one file per worker
    <root>/checkpoint/<haunit>-<seq>/manifest.json  written last, atomically

A *page file* is nothing but whole pages back to back (each page carries its
own 64-byte header with its PageID; mmm pages are their own serialization).

The *manifest* is a JSON document (no pickle) with a ``format_version``, the
checkpoint's identity, the structures it holds (``name -> psid``), the
operator's ``user_meta`` (e.g. input positions, for trimming upstream logs),
the list of page files it references and the *page table*: one row per page,
stored as four little-endian numpy columns, base64-encoded, with an xxh3
checksum of their bytes:

==========  =======  ==================================================
column      dtype    meaning
==========  =======  ==================================================
page_id     ``<u8``  the page's PageID, sorted and unique
file        ``<u4``  index into ``files`` (which names the checkpoint
                     directory the page lives in)
offset      ``<u8``  byte offset of the page in that file
checksum    ``<u8``  xxh3_64 of the page's ``page_bytes`` bytes
==========  =======  ==================================================

Every page is ``page_bytes`` long (one field of the manifest). An incremental
checkpoint writes only the pages that changed since its base checkpoint and
references the others where they already lie, in earlier checkpoints'
directories: the ``files`` list then names files of several checkpoints.

The whole document is sealed by ``document_xxh3_64``: the xxh3_64 of every
other field in canonical JSON (`document_checksum`: sorted keys, no
whitespace, ASCII). So no field, ``user_meta`` included (the input positions
recovery replays from), can change undetected, whatever the file's layout.

Invariants (checked by `Manifest.from_json`): every field is present, of its
type and in range (no unknown field); ``full`` means no base and depth 0, an
incremental checkpoint names an earlier checkpoint of its HA unit as base; the
page table is sorted by page_id without duplicates; every row's file index is
valid; every page is page-aligned and lies inside its file's recorded size; the
checksum of the columns matches; the document checksum matches. Any damage to
the bytes raises `ManifestError`, never another exception.

*Composed* checkpoints (version 3): a checkpoint of one HA unit made of
page-table rows of other checkpoints, chosen by page set id (psid) ranges
(`ioservice.manager.CheckpointManager.compose`). It writes no page: it
references the source checkpoints' files where they lie, in other HA units'
directories. Its manifest names its sources in ``composed_from`` (a non-empty,
sorted list of checkpoint names, not its own) and has ``full`` false, no
``base``, any ``depth`` (the deepest source's chain) and no file in its own
directory. An incremental checkpoint may take a composed one as its base
(its files then name other HA units' directories too). Every other rule
stands: a full checkpoint still references only its own files, an
incremental one still names an earlier checkpoint of its own HA unit.

Format versions: ``1`` (before the document checksum) is still read: its
fields are checked as above, but nothing seals them. ``2`` adds
``document_xxh3_64``. A version-1 manifest that carries the field is refused
(it would otherwise switch the seal off by a downgrade). ``3`` adds the
required field ``composed_from`` (``[]`` for a checkpoint that is not
composed). Writers write version 2 for every checkpoint that is not composed
(so a reader that predates version 3 still reads them) and version 3 for a
composed one (such a reader refuses it by its version instead of misreading
it); an incremental checkpoint may build on a version-1 base.

A checkpoint *exists* only when its manifest does; page files without a
manifest are leftovers of a failed or interrupted checkpoint.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import time
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import xxhash

from ioservice._checksum import b64decode_strict, xxh3_rows
from ioservice.errors import InvalidNameError, ManifestError
from ioservice.fs import validate_name
from mmm.page import MAX_PAGE_BYTES, MIN_PAGE_BYTES

__all__ = [
    "CHECKPOINT_DIR",
    "CHECKSUM_ALGO",
    "DOCUMENT_CHECKSUM_KEY",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Manifest",
    "ManifestHeader",
    "PageFile",
    "PageTable",
    "COMPOSED_FORMAT_VERSION",
    "checkpoint_dir",
    "checkpoint_name",
    "check_psid_ranges",
    "psid_mask",
    "document_checksum",
    "page_checksums",
    "page_file_name",
    "parse_checkpoint_name",
    "parse_manifest_header",
    "page_table_decodes",
]

FORMAT_VERSION: Final = 2
"""Version of the manifest format written for every checkpoint that is not
composed. Version 2 added the document checksum (`DOCUMENT_CHECKSUM_KEY`);
readers also accept version 1 manifests (written by sguard before it), whose
page table is checksummed but whose other fields are not, and version 3
(`COMPOSED_FORMAT_VERSION`), and refuse every other version."""
COMPOSED_FORMAT_VERSION: Final = 3
"""Version written for a composed checkpoint: version 2 plus the field
``composed_from`` (see the module docstring)."""
DOCUMENT_CHECKSUM_KEY: Final = "document_xxh3_64"
"""Manifest field holding `document_checksum` of every other field (version >= 2)."""
CHECKPOINT_DIR: Final = "checkpoint"
"""Directory under the storage root that holds every checkpoint."""
MANIFEST_NAME: Final = "manifest.json"
"""The manifest's file name inside a checkpoint directory."""
CHECKSUM_ALGO: Final = "xxh3_64"
"""Per-page checksum algorithm."""

_READABLE_VERSIONS: Final = (1, 2, 3)
_KIND: Final = "sguard-checkpoint"
_FIELDS: Final = frozenset({
    "format_version", "kind", "haunit", "seq", "name", "snapshot_id", "created_unix_s",
    "page_bytes", "checksum_algo", "full", "depth", "base", "structures", "user_meta", "files",
    "page_table"})
_MAX_SEQ: Final = 10**18 - 1  # a checkpoint name holds at most 18 digits
_MAX_U63: Final = 2**63 - 1
_MAX_U32: Final = 2**32 - 1
_MAX_U31: Final = 2**31 - 1
_MAX_FILE_BYTES: Final = 2**62  # no sum of an offset and a page size can wrap a uint64
_MAX_PAGES: Final = 2**40
_MAX_SOURCES: Final = 1 << 20
_PSID_LIMIT: Final = 1 << 32  # a psid is the high 32 bits of a PageID
_NAME_RE: Final = re.compile(r"^(?P<haunit>.+)-(?P<seq>[0-9]{1,18})$")
_COLUMNS: Final = (("page_id", "<u8"), ("file", "<u4"), ("offset", "<u8"), ("checksum", "<u8"))


# ----------------------------------------------------------------------- names


def checkpoint_name(haunit: str, seq: int) -> str:
    """The checkpoint id ``<haunit>-<seq>`` (paper §5: HA unit id + sequence number).

    Raises
    ------
    InvalidNameError
        If `haunit` is not a valid HA-unit name (see `ioservice.fs.validate_name`).
    ValueError
        If `seq` is negative.

    Examples
    --------
    >>> checkpoint_name("agg0", 7)
    'agg0-7'
    """
    validate_name(haunit)
    if not isinstance(seq, int) or seq < 0:
        raise ValueError(f"checkpoint sequence number must be an int >= 0, got {seq!r}")
    return f"{haunit}-{seq}"


def parse_checkpoint_name(name: str) -> tuple[str, int] | None:
    """Split ``<haunit>-<seq>`` into its parts; None if `name` is not a checkpoint id.

    Examples
    --------
    >>> parse_checkpoint_name("win-a-12")
    ('win-a', 12)
    >>> parse_checkpoint_name("notes.txt") is None
    True
    """
    m = _NAME_RE.match(name)
    if m is None:
        return None
    try:
        validate_name(m["haunit"])
    except InvalidNameError:
        return None
    return m["haunit"], int(m["seq"])


def checkpoint_dir(name: str) -> str:
    """Relative path of checkpoint `name`'s directory: ``checkpoint/<name>``."""
    return f"{CHECKPOINT_DIR}/{name}"


def page_file_name(worker: int, tag: str | None = None) -> str:
    """File name written by I/O worker `worker`: ``w000.pages``, ``w001.pages`` ...;
    with a `tag` (a writer's unique id): ``w000-<tag>.pages``."""
    if tag is None:
        return f"w{worker:03d}.pages"
    if not re.fullmatch(r"[A-Za-z0-9_.]{1,64}", tag):
        raise ValueError(f"page file tag must be 1-64 of [A-Za-z0-9_.], got {tag!r}")
    return f"w{worker:03d}-{tag}.pages"


def page_checksums(pages: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    """xxh3_64 of each row of a C-contiguous ``(n, page_bytes)`` uint8 array.

    One compiled call without the GIL (`ioservice._checksum.xxh3_rows`: xxHash's
    own C function, so the digests are exactly ``xxhash.xxh3_64_intdigest``'s).
    Runtime complexity: O(bytes), about 20 GB/s.
    """
    return xxh3_rows(pages)


def check_psid_ranges(ranges: Any, what: str = "psid ranges") -> list[tuple[int, int]]:
    """Validate page set id ranges and return them sorted.

    A range ``(lo, hi)`` is half-open: psids ``lo <= psid < hi``, with
    ``0 <= lo < hi <= 2**32`` (a psid is a PageID's high 32 bits).

    Raises
    ------
    ValueError
        If `ranges` is not a sequence of ``(lo, hi)`` int pairs in range, or two
        of its ranges overlap (the message names them and `what`).

    Examples
    --------
    >>> check_psid_ranges([(5, 9), (1, 3)])
    [(1, 3), (5, 9)]
    """
    if isinstance(ranges, (str, bytes)) or not hasattr(ranges, "__iter__"):
        raise ValueError(f"{what} must be a sequence of (lo, hi) pairs, got {_short(ranges)}")
    out = []
    for r in ranges:
        try:
            lo, hi = r
        except (TypeError, ValueError):
            raise ValueError(f"{what}: {_short(r)} is not a (lo, hi) pair") from None
        if not (isinstance(lo, (int, np.integer)) and isinstance(hi, (int, np.integer))) \
                or isinstance(lo, bool) or isinstance(hi, bool) \
                or not 0 <= int(lo) < int(hi) <= _PSID_LIMIT:
            raise ValueError(f"{what}: range {_short(r)} is not (lo, hi) ints with "
                             f"0 <= lo < hi <= 2**32")
        out.append((int(lo), int(hi)))
    out.sort()
    for a, b in zip(out, out[1:]):
        if b[0] < a[1]:
            raise ValueError(f"{what}: ranges {a} and {b} overlap")
    return out


def psid_mask(page_ids: npt.NDArray[np.uint64],
              ranges: list[tuple[int, int]]) -> npt.NDArray[np.bool_]:
    """True where a page's psid (``page_id >> 32``) lies in one of `ranges` (sorted,
    disjoint: `check_psid_ranges`). Runtime complexity: O(n log r), vectorized."""
    if not ranges or not len(page_ids):
        return np.zeros(len(page_ids), dtype=bool)
    psid = (np.asarray(page_ids, dtype=np.uint64) >> np.uint64(32)).astype(np.int64)
    lo = np.array([r[0] for r in ranges], dtype=np.int64)
    hi = np.array([r[1] for r in ranges], dtype=np.int64)
    k = np.searchsorted(lo, psid, side="right") - 1
    return (k >= 0) & (psid < hi[np.maximum(k, 0)])


# ------------------------------------------------------------------ manifest


@dataclass(frozen=True, slots=True)
class PageFile:
    """One page file a manifest references."""

    path: str
    """Path relative to the storage root: ``checkpoint/<name>/w000.pages``."""
    size_bytes: int
    """Size of the file as written."""

    @property
    def checkpoint(self) -> str:
        """Name of the checkpoint directory the file lies in."""
        return self.path.split("/")[1]


@dataclass(frozen=True, slots=True, eq=False)
class PageTable:
    """Where each page of a checkpoint lies: four aligned numpy columns (see module doc)."""

    page_id: npt.NDArray[np.uint64]
    file: npt.NDArray[np.uint32]
    offset: npt.NDArray[np.uint64]
    checksum: npt.NDArray[np.uint64]

    def __len__(self) -> int:
        return len(self.page_id)

    @classmethod
    def empty(cls) -> PageTable:
        """A table without pages."""
        return cls(np.zeros(0, np.uint64), np.zeros(0, np.uint32), np.zeros(0, np.uint64),
                   np.zeros(0, np.uint64))

    def take(self, idx: npt.NDArray[np.intp]) -> PageTable:
        """Rows `idx` as a new table."""
        return PageTable(self.page_id[idx], self.file[idx], self.offset[idx], self.checksum[idx])

    @staticmethod
    def concat(tables: list[PageTable]) -> PageTable:
        """Rows of all `tables`, sorted by page_id."""
        if not tables:
            return PageTable.empty()
        t = PageTable(*(np.concatenate([getattr(x, c) for x in tables]) for c, _ in _COLUMNS))
        order = np.argsort(t.page_id, kind="stable")
        return t.take(order)

    def lookup(self, page_ids: npt.NDArray[np.uint64]) -> npt.NDArray[np.intp]:
        """Row of each of `page_ids`, -1 where absent. Runtime complexity: O(n log m)."""
        pos = np.searchsorted(self.page_id, page_ids)
        pos_c = np.minimum(pos, max(len(self.page_id) - 1, 0))
        found = (pos < len(self.page_id)) & (self.page_id[pos_c] == page_ids) if len(self) \
            else np.zeros(len(page_ids), bool)
        return np.where(found, pos_c, -1).astype(np.intp)


@dataclass(frozen=True, slots=True, eq=False)
class Manifest:
    """The record that makes a checkpoint exist. See the module docstring for the format.

    Build one with the writer (`ioservice.manager.CheckpointManager`) or parse one
    with `Manifest.from_json`.
    """

    haunit: str
    seq: int
    snapshot_id: int
    page_bytes: int
    full: bool
    """True when every page was written by this checkpoint (no references)."""
    depth: int
    """Incremental checkpoints since the last full one (0 for a full checkpoint; for a
    composed one, its deepest source's depth)."""
    base: str | None
    """The checkpoint an incremental one is relative to; None for a full or composed one."""
    files: tuple[PageFile, ...]
    pages: PageTable
    structures: Mapping[str, int]
    """``name -> psid`` of the structures in the checkpoint."""
    user_meta: Mapping[str, Any] = field(default_factory=dict)
    """JSON-able data the operator supplied (e.g. input positions)."""
    created_unix_s: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    checksum_algo: str = CHECKSUM_ALGO
    composed_from: tuple[str, ...] = ()
    """Names of the checkpoints a composed checkpoint's rows come from (sorted);
    empty for one that is not composed."""

    # -- derived ---------------------------------------------------------------------
    @property
    def composed(self) -> bool:
        """True for a composed checkpoint (see the module docstring)."""
        return bool(self.composed_from)

    @property
    def name(self) -> str:
        """``<haunit>-<seq>``."""
        return f"{self.haunit}-{self.seq}"

    @property
    def directory(self) -> str:
        """``checkpoint/<name>``."""
        return checkpoint_dir(self.name)

    @property
    def manifest_path(self) -> str:
        """``checkpoint/<name>/manifest.json``."""
        return f"{self.directory}/{MANIFEST_NAME}"

    @property
    def n_pages(self) -> int:
        """Pages in the checkpoint (written here or referenced)."""
        return len(self.pages)

    @property
    def state_bytes(self) -> int:
        """Bytes of state the checkpoint restores."""
        return len(self.pages) * self.page_bytes

    @property
    def own_files(self) -> tuple[PageFile, ...]:
        """Files this checkpoint wrote (in its own directory)."""
        return tuple(f for f in self.files if f.checkpoint == self.name)

    @property
    def written_bytes(self) -> int:
        """Bytes this checkpoint wrote."""
        return sum(f.size_bytes for f in self.own_files)

    @property
    def n_pages_written(self) -> int:
        """Pages this checkpoint wrote itself."""
        own = np.array([f.checkpoint == self.name for f in self.files], dtype=bool)
        return int(np.count_nonzero(own[self.pages.file])) if len(self.files) else 0

    @property
    def referenced_checkpoints(self) -> tuple[str, ...]:
        """Names of every checkpoint directory holding pages of this checkpoint."""
        return tuple(sorted({f.checkpoint for f in self.files}))

    def select_psids(self, ranges: Any) -> Manifest:
        """This checkpoint restricted to the pages whose psid lies in `ranges`.

        The result keeps this checkpoint's identity (haunit, seq, name,
        user_meta ...), holds only the selected rows, only the files they lie in
        and only the structures whose psid is selected: what a partial restore
        reads (`ioservice.recovery.restore` ``psid_ranges``). It describes no
        manifest on storage; never write it. Runtime complexity: O(pages).

        Raises
        ------
        ValueError
            For bad or overlapping `ranges` (`check_psid_ranges`).
        """
        rs = check_psid_ranges(ranges)
        keep = np.flatnonzero(psid_mask(self.pages.page_id, rs))
        sub = self.pages.take(keep)
        used = np.unique(sub.file)
        remap = np.zeros(len(self.files), dtype=np.uint32)
        remap[used] = np.arange(len(used), dtype=np.uint32)
        sub = PageTable(sub.page_id, remap[sub.file], sub.offset, sub.checksum)
        structs = {k: v for k, v in self.structures.items()
                   if psid_mask(np.array([int(v) << 32], np.uint64), rs)[0]}
        return dataclasses.replace(self, files=tuple(self.files[i] for i in used.tolist()),
                                   pages=sub, structures=structs)

    def same_content(self, other: Manifest) -> bool:
        """True when `other` restores exactly what this checkpoint does and records
        the same data: equal in every field but haunit, seq, name, creation time
        and format version (how an idempotent rerun of a composition is recognized)."""
        a, b = self.pages, other.pages
        return (self.page_bytes == other.page_bytes and self.full == other.full
                and self.depth == other.depth and self.base == other.base
                and self.snapshot_id == other.snapshot_id
                and self.composed_from == other.composed_from
                and self.files == other.files
                and _canon(self.structures) == _canon(other.structures)
                and _canon(self.user_meta) == _canon(other.user_meta)
                and len(a) == len(b)
                and all(np.array_equal(getattr(a, c), getattr(b, c)) for c, _ in _COLUMNS))

    # -- encoding ------------------------------------------------------------------------
    def to_json(self) -> bytes:
        """Encode as UTF-8 JSON, sealed with the document checksum: version
        `FORMAT_VERSION`, or `COMPOSED_FORMAT_VERSION` for a composed checkpoint.
        Runtime complexity: O(pages), vectorized."""
        cols = {}
        digest = xxhash.xxh3_64()
        for name, dt in _COLUMNS:
            raw = np.ascontiguousarray(getattr(self.pages, name), dtype=dt).tobytes()
            digest.update(raw)
            cols[name] = [dt, base64.b64encode(raw).decode("ascii")]
        doc: dict[str, Any] = {
            "format_version": COMPOSED_FORMAT_VERSION if self.composed else FORMAT_VERSION,
            "kind": _KIND,
            "haunit": self.haunit,
            "seq": self.seq,
            "name": self.name,
            "snapshot_id": self.snapshot_id,
            "created_unix_s": self.created_unix_s,
            "page_bytes": self.page_bytes,
            "checksum_algo": self.checksum_algo,
            "full": self.full,
            "depth": self.depth,
            "base": self.base,
            # as a reader will parse them (tuples become lists, int keys strings)
            "structures": json.loads(json.dumps(dict(self.structures))),
            "user_meta": json.loads(json.dumps(dict(self.user_meta), allow_nan=False)),
            "files": [{"path": f.path, "size_bytes": f.size_bytes} for f in self.files],
            "page_table": {"n_pages": len(self.pages), "encoding": "base64",
                           "columns": cols, "xxh3_64": digest.hexdigest()},
        }
        if self.composed:
            doc["composed_from"] = list(self.composed_from)
        doc[DOCUMENT_CHECKSUM_KEY] = document_checksum(doc)
        return json.dumps(doc, indent=1, allow_nan=False).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Parse and validate a manifest (this format version or version 1).

        Parameters
        ----------
        data : bytes
            The manifest file's contents.
        where : str
            How error messages name the manifest (path, backend).

        Raises
        ------
        ManifestError
            For *any* damage: not JSON (also NaN, infinities, nesting too deep,
            integers too long), another ``format_version``, a missing, unknown,
            mistyped or out-of-range field, an inconsistent page table, or a
            document checksum that does not match; the message says which.
            Never another exception for any bytes.
        """
        try:
            return cls._parse(data, where)
        except ManifestError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
                RecursionError) as exc:  # a net under the checks below: bytes are untrusted
            raise ManifestError(f"{where}: malformed manifest ({type(exc).__name__}: "
                                f"{str(exc)[:200]})") from None

    @classmethod
    def _parse(cls, data: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(data, parse_constant=_no_constant, parse_float=_finite_float)
        except RecursionError:
            raise ManifestError(f"{where}: not valid JSON (nested too deeply)") from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits
            raise ManifestError(f"{where}: not valid JSON ({str(exc)[:200]})") from None
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(doc).__name__}")
        version = doc.get("format_version")
        if type(version) is not int or version not in _READABLE_VERSIONS:
            raise ManifestError(f"{where}: format_version {_short(version)} is not supported "
                                f"(this sguard reads versions "
                                f"{', '.join(map(str, _READABLE_VERSIONS))})")
        allowed = _FIELDS | ({DOCUMENT_CHECKSUM_KEY} if version >= 2 else set()) \
            | ({"composed_from"} if version >= 3 else set())
        unknown = sorted(set(doc) - allowed)
        if unknown:
            raise ManifestError(f"{where}: unknown field(s) "
                                f"{', '.join(_short(k, 40) for k in unknown[:5])} "
                                f"in a version {version} manifest")

        def get(key: str, typ: type | tuple[type, ...]) -> Any:
            if key not in doc:
                raise ManifestError(f"{where}: field {key!r} is missing")
            val = doc[key]
            if not isinstance(val, typ) or (isinstance(val, bool) and bool not in
                                            (typ if isinstance(typ, tuple) else (typ,))):
                raise ManifestError(f"{where}: field {key!r} has type {type(val).__name__}")
            return val

        def get_int(key: str, lo: int, hi: int) -> int:
            val: int = get(key, int)
            if not lo <= val <= hi:
                raise ManifestError(f"{where}: field {key!r} is {_short(val)}, outside "
                                    f"[{lo}, {hi}]")
            return val

        if get("kind", str) != _KIND:
            raise ManifestError(f"{where}: field 'kind' is {_short(doc['kind'])}, not {_KIND!r}")
        haunit = get("haunit", str)
        try:
            validate_name(haunit)
        except InvalidNameError as exc:
            raise ManifestError(f"{where}: {exc}") from None
        seq = get_int("seq", 0, _MAX_SEQ)
        if get("name", str) != f"{haunit}-{seq}":
            raise ManifestError(f"{where}: field 'name' {_short(doc['name'])} does not match "
                                f"haunit and seq ({haunit}-{seq})")
        page_bytes = get_int("page_bytes", MIN_PAGE_BYTES, MAX_PAGE_BYTES)
        if page_bytes & (page_bytes - 1):
            raise ManifestError(f"{where}: page_bytes {page_bytes} is not a power of two")
        snapshot_id = get_int("snapshot_id", 0, _MAX_U63)
        algo = get("checksum_algo", str)
        if algo != CHECKSUM_ALGO:
            raise ManifestError(f"{where}: unknown checksum_algo {_short(algo)}")
        full = get("full", bool)
        depth = get_int("depth", 0, _MAX_U31)
        if "base" not in doc:
            raise ManifestError(f"{where}: field 'base' is missing")
        base = doc["base"]
        composed_from: tuple[str, ...] = ()
        if version >= 3:
            srcs = get("composed_from", list)
            if len(srcs) > _MAX_SOURCES or not all(
                    isinstance(x, str) and parse_checkpoint_name(x) is not None for x in srcs):
                raise ManifestError(f"{where}: field 'composed_from' must list checkpoint "
                                    f"names, got {_short(srcs)}")
            if srcs != sorted(set(srcs)) or f"{haunit}-{seq}" in srcs:
                raise ManifestError(f"{where}: field 'composed_from' must be sorted, unique "
                                    f"and not name the checkpoint itself, got {_short(srcs)}")
            composed_from = tuple(srcs)
        if composed_from:
            if full or base is not None:
                raise ManifestError(f"{where}: a composed checkpoint has full {full} and base "
                                    f"{_short(base)} (expected false and none)")
        elif full:
            if base is not None or depth != 0:
                raise ManifestError(f"{where}: a full checkpoint has base {_short(base)} and "
                                    f"depth {depth} (expected none and 0)")
        else:
            parsed_base = parse_checkpoint_name(base) if isinstance(base, str) else None
            if parsed_base is None or parsed_base[0] != haunit or parsed_base[1] >= seq \
                    or depth < 1:
                raise ManifestError(f"{where}: an incremental checkpoint needs an earlier "
                                    f"checkpoint of {haunit!r} as base and depth >= 1, got "
                                    f"base {_short(base)}, depth {depth}")
        created = get("created_unix_s", (int, float))
        if not 0 <= created < 1e13:
            raise ManifestError(f"{where}: created_unix_s {_short(created)} is out of range")
        structures = get("structures", dict)
        for k, v in structures.items():
            if not (k and type(v) is int and 0 <= v <= _MAX_U32):
                raise ManifestError(f"{where}: 'structures' must map names to page set ids "
                                    f"(0 .. {_MAX_U32}), got {_short(k)}: {_short(v)}")
        user_meta = get("user_meta", dict)
        files = []
        for i, f in enumerate(get("files", list)):
            if not (isinstance(f, dict) and set(f) == {"path", "size_bytes"}
                    and isinstance(f["path"], str) and type(f["size_bytes"]) is int):
                raise ManifestError(f"{where}: files[{i}] must be exactly a str 'path' and "
                                    f"an int 'size_bytes'")
            parts = f["path"].split("/")
            if len(parts) != 3 or parts[0] != CHECKPOINT_DIR or parse_checkpoint_name(parts[1]) is None \
                    or parts[2] in ("", ".", "..") or parts[2].startswith(".") \
                    or any(unicodedata.category(ch).startswith("C") or ch == "\\"
                           for ch in parts[2]):
                raise ManifestError(f"{where}: files[{i}] path {_short(f['path'])} is not "
                                    f"{CHECKPOINT_DIR}/<haunit>-<seq>/<file>")
            size = f["size_bytes"]
            if not 0 <= size <= _MAX_FILE_BYTES or size % page_bytes:
                raise ManifestError(f"{where}: files[{i}] size_bytes {_short(size)} is not a "
                                    f"multiple of {page_bytes} in [0, {_MAX_FILE_BYTES}]")
            files.append(PageFile(f["path"], size))
        pages = _decode_table(get("page_table", dict), where)
        man = cls(haunit=haunit, seq=seq, snapshot_id=snapshot_id,
                  page_bytes=page_bytes, full=full, depth=depth,
                  base=base, files=tuple(files), pages=pages, structures=structures,
                  user_meta=user_meta, created_unix_s=float(created),
                  format_version=version, checksum_algo=algo, composed_from=composed_from)
        man.validate(where)
        if version >= 2:
            want = get(DOCUMENT_CHECKSUM_KEY, str)
            body = {k: v for k, v in doc.items() if k != DOCUMENT_CHECKSUM_KEY}
            if document_checksum(body) != want:
                raise ManifestError(f"{where}: document checksum mismatch (the manifest is "
                                    f"damaged or was altered)")
        return man

    def validate(self, where: str = "manifest") -> None:
        """Check the page table's invariants (see module docstring).

        Raises
        ------
        ManifestError
        """
        t = self.pages
        n = len(t)
        if n and np.any(t.page_id[1:] <= t.page_id[:-1]):
            raise ManifestError(f"{where}: page table is not sorted by unique page_id")
        if n and not self.files:
            raise ManifestError(f"{where}: {n} pages but no files")
        if n:
            if int(t.file.max()) >= len(self.files):
                raise ManifestError(f"{where}: page table names file {int(t.file.max())} "
                                    f"of {len(self.files)}")
            pb = np.uint64(self.page_bytes)
            if np.any(t.offset % pb):
                i = int(np.flatnonzero(t.offset % pb)[0])
                raise ManifestError(f"{where}: page {int(t.page_id[i]):#x} at offset "
                                    f"{int(t.offset[i])} is not page-aligned")
            sizes = np.array([min(max(f.size_bytes, 0), _MAX_FILE_BYTES) for f in self.files],
                             dtype=np.uint64)[t.file]
            # no wrap-around: compare offset with size - page_bytes only where size >= page_bytes
            bad = np.flatnonzero((sizes < pb) | (t.offset > sizes - np.minimum(sizes, pb)))
            if len(bad):
                i = int(bad[0])
                raise ManifestError(
                    f"{where}: page {int(t.page_id[i]):#x} at offset {int(t.offset[i])} lies "
                    f"beyond the end of {self.files[int(t.file[i])].path} "
                    f"({self.files[int(t.file[i])].size_bytes} bytes)")
        if self.full and any(f.checkpoint != self.name for f in self.files):
            raise ManifestError(f"{where}: a full checkpoint references other checkpoints' files")
        if self.composed and any(f.checkpoint == self.name for f in self.files):
            raise ManifestError(f"{where}: a composed checkpoint has files in its own "
                                f"directory (it writes none)")


_HEADER_END: Final = b'\n "files": '
"""Where a manifest's header ends: `Manifest.to_json` writes the top-level fields in a
fixed order, one per line at indent 1, the O(K) ones (``structures``, ``user_meta``)
before the O(files) ``files`` and the O(pages) ``page_table``. A raw newline never
occurs inside a JSON string, so this text occurs once, at the top level."""


@dataclass(frozen=True, slots=True)
class ManifestHeader:
    """A manifest's small fields, read without its file list and page table
    (`parse_manifest_header`): what a planner needs to choose checkpoints, in O(fields)
    memory whatever the state's size. *Not* validated as a whole (the document checksum
    needs the whole file): whoever uses the checkpoint parses it in full
    (`Manifest.from_json`) and checks it against the header it planned with."""

    haunit: str
    seq: int
    page_bytes: int
    format_version: int
    user_meta: Mapping[str, Any]

    @property
    def name(self) -> str:
        """``<haunit>-<seq>``."""
        return f"{self.haunit}-{self.seq}"


def parse_manifest_header(prefix: bytes, *, where: str = "manifest",
                          complete: bool = False) -> ManifestHeader | None:
    """The header of a manifest from a prefix of its bytes (`ManifestHeader`).

    Returns None when `prefix` does not reach the end of the header yet (read more);
    with `complete` (`prefix` is the whole file) a manifest without the usual layout
    is parsed in full instead.

    Raises
    ------
    ManifestError
        The header is not a manifest's (not JSON, a field missing or mistyped,
        another format version or kind, name and haunit/seq disagree).
    """
    end = prefix.find(_HEADER_END)
    if end < 0:
        if not complete:
            return None
        man = Manifest.from_json(prefix, where=where)  # an unusual layout: parse it all
        return ManifestHeader(man.haunit, man.seq, man.page_bytes, man.format_version,
                              man.user_meta)
    try:
        doc = json.loads(prefix[:end].rstrip().removesuffix(b",") + b"\n}",
                         parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{where}: header is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: header is not a JSON object")
    version, kind, haunit, seq = (doc.get(k) for k in ("format_version", "kind", "haunit",
                                                        "seq"))
    if type(version) is not int or version not in _READABLE_VERSIONS or kind != _KIND:
        raise ManifestError(f"{where}: format_version {_short(version)} / kind "
                            f"{_short(kind)} is not a readable sguard manifest")
    page_bytes, meta = doc.get("page_bytes"), doc.get("user_meta")
    if not (isinstance(haunit, str) and type(seq) is int and 0 <= seq <= _MAX_SEQ
            and doc.get("name") == f"{haunit}-{seq}" and type(page_bytes) is int
            and MIN_PAGE_BYTES <= page_bytes <= MAX_PAGE_BYTES and isinstance(meta, dict)):
        raise ManifestError(f"{where}: header fields haunit/seq/name/page_bytes/user_meta "
                            f"are missing or mistyped")
    return ManifestHeader(haunit, seq, page_bytes, version, meta)


def document_checksum(doc: Mapping[str, Any]) -> str:
    """xxh3_64 (hex) of a manifest document in canonical JSON form (sorted keys,
    no whitespace, ASCII), without the `DOCUMENT_CHECKSUM_KEY` field itself.

    The canonical form depends only on the parsed document, so the checksum
    covers every field (``user_meta`` included) whatever the file's layout.
    The page table's base64 column texts enter only by their length: their
    bytes are sealed by the table's own ``xxh3_64`` (which the document
    checksum covers) and must be canonical base64, so the seal stays O(files)
    instead of re-encoding megabytes of columns. Runtime complexity: O(fields).

    Raises
    ------
    ValueError
        If `doc` holds NaN or infinities; TypeError if it is not JSON data.
    """
    body = {k: v for k, v in doc.items() if k != DOCUMENT_CHECKSUM_KEY}
    table = body.get("page_table")
    if isinstance(table, dict) and isinstance(table.get("columns"), dict):
        cols = {name: [col[0], len(col[1])]
                if isinstance(col, list) and len(col) == 2 and isinstance(col[1], str) else col
                for name, col in table["columns"].items()}
        body["page_table"] = {**table, "columns": cols}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)
    return xxhash.xxh3_64_hexdigest(text.encode("ascii"))


def _canon(val: Any) -> str:
    """Canonical JSON text of `val` (as a reader would parse it)."""
    return json.dumps(json.loads(json.dumps(dict(val), allow_nan=False)), sort_keys=True,
                      separators=(",", ":"))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a manifest")


def _finite_float(text: str) -> float:
    val = float(text)
    if not math.isfinite(val):
        raise ValueError(f"number {text[:40]} is out of range")
    return val


def _short(val: Any, limit: int = 60) -> str:
    """repr of a (possibly huge) value from a damaged manifest, cut to `limit` chars."""
    if isinstance(val, int) and not isinstance(val, bool) and abs(val) > 10**40:
        return f"an integer of {len(str(abs(val)))} digits"
    text = repr(val)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_decodes = [0]


def page_table_decodes() -> int:
    """How many page tables this process has decoded (`Manifest.from_json`): a counter
    for tests that check a code path reads no page table (e.g. a driver's)."""
    return _decodes[0]


def _decode_table(sec: dict[str, Any], where: str) -> PageTable:
    """Decode and verify the page_table section."""
    _decodes[0] += 1
    try:
        if set(sec) != {"n_pages", "encoding", "columns", "xxh3_64"}:
            raise TypeError(f"fields {sorted(sec)[:8]}")
        n = sec["n_pages"]
        cols = sec["columns"]
        want = sec["xxh3_64"]
        if sec["encoding"] != "base64" or type(n) is not int or not 0 <= n <= _MAX_PAGES \
                or not isinstance(cols, dict) or set(cols) != {c for c, _ in _COLUMNS} \
                or not isinstance(want, str):
            raise TypeError("bad header")
        digest = xxhash.xxh3_64()
        arrays = {}
        for name, dt in _COLUMNS:
            col = cols[name]
            if not (isinstance(col, list) and len(col) == 2 and isinstance(col[0], str)
                    and isinstance(col[1], str)):
                raise TypeError(f"column {name!r} is not [dtype, base64 text]")
            got_dt, text = col
            if got_dt != dt:
                raise ManifestError(f"{where}: page_table column {name!r} has dtype {_short(got_dt)}, "
                                    f"expected {dt!r}")
            if len(text) > 4 * (n * 8 // 3 + 4):
                raise ValueError(f"column {name!r} is longer than {n} rows")
            raw = b64decode_strict(text)  # base64.b64decode(text, validate=True), faster
            # one text per column bytes: validated base64 of the right length whose last
            # quantum (the only one with unused bits) re-encodes to itself
            tail = len(raw) % 3 or 3
            if len(text) != 4 * -(-len(raw) // 3) or (
                    raw and base64.b64encode(raw[-tail:]) != text[-4:].encode("ascii")):
                raise ValueError(f"column {name!r} is not canonical base64")
            digest.update(raw)
            arr = np.frombuffer(raw, dtype=dt)
            if len(arr) != n:
                raise ManifestError(f"{where}: page_table column {name!r} has {len(arr)} rows, "
                                    f"expected {n}")
            arrays[name] = arr.astype(np.dtype(dt).newbyteorder("="), copy=False)
    except ManifestError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{where}: malformed page_table section ({exc!r})") from None
    if digest.hexdigest() != want:
        raise ManifestError(f"{where}: page_table checksum mismatch (the manifest is damaged)")
    return PageTable(arrays["page_id"], arrays["file"], arrays["offset"], arrays["checksum"])
