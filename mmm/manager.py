"""PageManager: page sets, the page table, the write barrier, snapshots and recovery.

This is the Page Manager of the paper (Tables 1 and 4) in Pythonic form:

=========================  ===============================================
paper                      here
=========================  ===============================================
``create(PSID)``           `PageManager.create` (returns a new PSID)
``destroy(PSID)``          `PageManager.destroy`
``allocate(PSID)``         `PageManager.allocate` (``n`` pages at once)
``release(Page*)``         `PageManager.release`
``resolve(PageID)``        `PageManager.resolve` / `PageManager.page`
``exists(PSID)``           `PageManager.exists` (by structure name)
``recover(PSID)``          `PageManager.recover` (by structure name)
``clone(Page*)``           `PageManager.clone` (done by the write barrier)
``chkpt(name, PSIDs)``     `PageManager.chkpt` -> `Snapshot`
``load(name)``             `PageManager.begin_load` -> `Loader` (pages in any order)
=========================  ===============================================

The page table of a page set is a numpy array ``seq -> frame``, so data
structures resolve many pages in one vectorized gather. Every write goes
through the *write barrier* `PageManager.writable`, which clones pages a
snapshot still pins (copy-on-write) and records the modification epoch used
for incremental snapshots.

Each page set's super page (sequence 0) holds the structure's name, kind,
schema and metadata as JSON, so the catalog ``name -> PSID`` is rebuilt from
the pages themselves after a load or a re-attach: nothing else is persisted.
"""
from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from mmm._kernels.pages import copy_frames, group_pages
from mmm.errors import (PageFormatError, PageNotFoundError, PageSetExistsError,
                        PageSetNotFoundError, SchemaMismatchError, SnapshotStateError,
                        StructureNotFoundError)
from mmm.page import (DEFAULT_PAGE_BYTES, HEADER_BYTES, HEADER_DTYPE, NIL_INT, PAGE_MAGIC,
                      Layout, decode_meta, encode_meta, make_page_id, split_page_id)
from mmm.pool import DEFAULT_CAPACITY_BYTES, LIVE, PagePool
from mmm.snapshot import Snapshot, SnapshotState

__all__ = ["PageManager", "PageSet", "Loader"]

_MAX_NAME = 200
PSID_LIMIT = 1 << 32
"""PSIDs are in ``[1, PSID_LIMIT)`` (a PageID keeps the PSID in its upper 32 bits)."""


class PageSet:
    """The pages of one page set (one data structure).

    ``frames[seq]`` is the frame of page ``seq`` (-1 if none); ``mod[seq]`` the
    epoch of its last modification. ``version`` changes whenever ``frames``
    does (allocation, release, a copy-on-write clone), so structures may cache
    frames they gathered from it.
    """

    __slots__ = ("psid", "frames", "mod", "n_pages", "free_seqs", "high", "name", "meta",
                 "durable_epoch", "version", "__weakref__")

    def __init__(self, psid: int, name: str) -> None:
        self.psid = psid
        self.name = name
        self.frames = np.full(8, -1, dtype=np.int64)
        self.mod = np.zeros(8, dtype=np.int64)
        self.n_pages = 0
        self.free_seqs: list[int] = []
        self.high = 0
        self.meta: dict[str, Any] = {}
        self.durable_epoch = 0
        self.version = 0

    def _grow(self, need: int) -> None:
        if need <= len(self.frames):
            return
        size = max(need, 2 * len(self.frames))
        frames = np.full(size, -1, dtype=np.int64)
        frames[:len(self.frames)] = self.frames
        mod = np.zeros(size, dtype=np.int64)
        mod[:len(self.mod)] = self.mod
        self.frames, self.mod = frames, mod

    def seqs(self) -> npt.NDArray[np.int64]:
        """Sequence numbers of the pages in use."""
        return np.flatnonzero(self.frames[:self.high] >= 0)

    def _recompute_free(self) -> None:
        used = self.frames[:len(self.frames)] >= 0
        self.high = int(np.flatnonzero(used).max()) + 1 if used.any() else 0
        self.free_seqs = np.flatnonzero(~used[:self.high]).tolist()[::-1]
        self.n_pages = int(np.count_nonzero(used))


class PageManager:
    """Pages of all the data structures of one operator / HA unit.

    Parameters
    ----------
    page_bytes : int
        Page size: a power of two between 4 KiB and 1 MiB (default 64 KiB).
    capacity_bytes : int
        Memory the pages may use; allocation beyond it raises `PoolExhaustedError`.
    path : str, optional
        Back the pages with this file (e.g. under ``/dev/shm``) so that
        `PageManager.attach` in a new process sees them.

    Examples
    --------
    >>> import numpy as np, mmm
    >>> pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    >>> counts = mmm.HashMap.create(pm, "counts", key="<u4", value=[("n", "<i8")])
    >>> counts.upsert(np.array([1, 2, 1], "<u4"), combine={"n": "count"})
    >>> int(counts[1]["n"])
    2
    >>> snap = pm.chkpt()          # freezes pages; no bytes copied
    >>> counts.upsert(np.array([1], "<u4"), combine={"n": "count"})
    >>> pm.rollback(snap)          # back to the snapshot
    >>> int(counts[1]["n"])
    2
    """

    def __init__(self, page_bytes: int = DEFAULT_PAGE_BYTES,
                 capacity_bytes: int = DEFAULT_CAPACITY_BYTES, path: str | None = None,
                 *, _pool: PagePool | None = None) -> None:
        self.pool = _pool if _pool is not None else PagePool(page_bytes, capacity_bytes, path)
        self.page_bytes = self.pool.page_bytes
        self._sets: dict[int, PageSet] = {}
        self._names: dict[str, int] = {}
        self._objects: dict[str, weakref.ReferenceType[Any]] = {}
        self._next_psid = 1  # automatic PSIDs: the next candidate (used ones are skipped)
        self._psid_order: list[int] = []  # PSIDs of _sets, sorted (`psids_between`)
        self.generation = 0
        self.epoch = 1
        self._active: set[int] = set()
        self._snapshot_seq = 0
        self._lock = threading.Lock()
        self._flush_hooks: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.stats_pages_cloned = 0
        self._stage_spare: npt.NDArray[np.uint8] | None = None  # see `_stage_buffer`
        self._templates: dict[int, npt.NDArray[Any]] = {}  # see `_header_template`
        if _pool is not None:
            self._adopt(np.flatnonzero(self.pool.state == LIVE), dedupe=True)

    @classmethod
    def attach(cls, path: str, page_bytes: int = DEFAULT_PAGE_BYTES) -> "PageManager":
        """Re-attach the file-backed pages a previous process left in ``path``.

        The page table and catalog are rebuilt from the page headers; when a
        crash interrupted a copy-on-write, the newer copy of a page wins.

        Raises
        ------
        PoolFileError
            If the file is missing or not a pool of ``page_bytes`` pages.
        """
        return cls.over(PagePool.attach(path, page_bytes))

    @classmethod
    def over(cls, pool: PagePool) -> "PageManager":
        """A manager of the pages an existing pool holds: typically one just attached
        (`PagePool.attach`, with a mapping kept from an earlier attach or a page table to
        roll back to), or one filled by copying pages into its frames.

        The page table and catalog are rebuilt from the headers of the pool's LIVE
        frames, as `attach` does: when a crash interrupted a copy-on-write, the newer
        copy of a page wins and the other frame is freed. The pool then belongs to
        this manager: no other manager may use it.

        Runtime complexity: O(live frames).
        """
        return cls(_pool=pool)

    def flush(self) -> None:
        """Push buffered per-record operations into pages, and a file-backed
        pool's bytes to its file."""
        self._flush_structures()
        self.pool.flush()

    def close(self) -> None:
        """Flush; the manager stays usable."""
        self.flush()

    # -- page sets ---------------------------------------------------------------------
    def _header_template(self, kind: int) -> npt.NDArray[Any]:
        """A new page's header (one record, kept per layout kind): magic, ``kind``, the
        pool's clock as version, NIL links; `allocate` then sets the PageIDs."""
        t = self._templates.get(kind)
        if t is None:
            t = np.zeros(1, HEADER_DTYPE)
            t["magic"], t["kind"], t["prev"], t["next"] = PAGE_MAGIC, kind, NIL_INT, NIL_INT
            self._templates[kind] = t
        t["version"] = self.pool.clock
        return t

    def _get(self, psid: int) -> PageSet:
        try:
            return self._sets[psid]
        except KeyError:
            raise PageSetNotFoundError(f"page set {psid} does not exist") from None

    def create(self, name: str, meta: dict[str, Any] | None = None, *,
               psid: int | None = None) -> int:
        """Create a page set named ``name`` with its super page; return its PSID.

        Parameters
        ----------
        name : str
            Structure name, unique in this manager.
        meta : dict, optional
            JSON-able metadata stored in the super page.
        psid : int, optional
            The PSID to use, ``1 <= psid < 2**32``. Default: the next free one
            above the last PSID given automatically (PSIDs taken explicitly are
            skipped; amortized O(1)), so ordinary structures keep small PSIDs.

        Raises
        ------
        ValueError
            If the name is empty, too long, not a string, or already in use, or
            ``psid`` is not an int in ``[1, 2**32)``.
        PageSetExistsError
            If ``psid`` is already in use (the message names its structure).
        """
        _check_name(name)
        if name in self._names:
            raise ValueError(f"a structure named {name!r} already exists "
                             f"(page set {self._names[name]})")
        auto = psid is None
        if auto:
            psid = self._free_psid()
        else:
            psid = _check_psid(psid)
            if psid in self._sets:
                raise PageSetExistsError(
                    f"page set {psid} is already in use by structure "
                    f"{self._sets[psid].name!r}; cannot create {name!r} with it")
        ps = PageSet(psid, name)
        self._sets[psid] = ps
        try:
            seq = self.allocate(psid, 1, Layout.SUPER)[0]
        except BaseException:
            del self._sets[psid]
            raise
        assert seq == 0
        if auto:
            self._next_psid = psid + 1
        self._names[name] = psid
        bisect.insort(self._psid_order, psid)
        self.write_meta(psid, dict(meta or {}, name=name))
        return psid

    def _free_psid(self) -> int:
        """The next automatic PSID: the counter, past any PSID in use."""
        p = self._next_psid
        while p in self._sets:
            p += 1
        if p >= PSID_LIMIT:
            p = 1  # wrapped: the lowest free one (never in practice)
            while p in self._sets:
                p += 1
            if p >= PSID_LIMIT:
                raise PageSetExistsError("every PSID is in use")
        return p

    def psids_between(self, lo: int, hi: int) -> list[int]:
        """The PSIDs in use in ``[lo, hi)``, sorted. Runtime: O(log page sets + result)."""
        order = self._psid_order
        return order[bisect.bisect_left(order, lo):bisect.bisect_left(order, hi)]

    def destroy(self, psid: int) -> None:
        """Destroy a page set and free its pages (pinned ones once persisted)."""
        ps = self._get(psid)
        frames = ps.frames[ps.seqs()]
        self.pool.free(frames)
        del self._sets[psid]
        self._names.pop(ps.name, None)
        self._objects.pop(ps.name, None)
        order = self._psid_order
        del order[bisect.bisect_left(order, psid)]
        ps.high = 0
        ps.n_pages = 0

    def exists(self, name: str) -> bool:
        """True if a structure (page set) with this name exists."""
        return name in self._names

    def recover(self, name: str) -> int:
        """PSID of the existing structure ``name``.

        Raises
        ------
        StructureNotFoundError
            If no structure has that name.
        """
        try:
            return self._names[name]
        except KeyError:
            raise StructureNotFoundError(
                f"no structure named {name!r}; existing: {sorted(self._names)}") from None

    def names(self) -> list[str]:
        """Names of all structures, sorted."""
        return sorted(self._names)

    def page_set(self, psid: int) -> PageSet:
        """The `PageSet` object of ``psid`` (internal to structures).

        Raises
        ------
        PageSetNotFoundError
        """
        return self._get(psid)

    # -- pages ---------------------------------------------------------------------------
    def allocate(self, psid: int, n: int = 1, kind: int = Layout.RAW, *,
                 zero: bool = True) -> npt.NDArray[np.int64]:
        """Allocate ``n`` zeroed pages in page set ``psid``; return their sequence numbers.

        Their headers carry the PageID, layout ``kind`` and a new version.
        ``zero=False``: only the headers are written, for a caller that writes every
        other byte of the new pages at once (`PagePool.allocate`).
        Runtime complexity: O(n).

        Raises
        ------
        PageSetNotFoundError
            If ``psid`` does not exist.
        PoolExhaustedError
            If the pool has fewer than ``n`` free frames (nothing allocated).
        """
        ps = self._get(psid)
        frames = self.pool.allocate(n, zero=zero)
        fs = ps.free_seqs
        take = min(n, len(fs))
        if take == n:  # all recycled: the common case
            seqs = np.array(fs[len(fs) - take:], dtype=np.int64)
        else:
            seqs = np.empty(n, dtype=np.int64)
            seqs[:take] = fs[len(fs) - take:]
            seqs[take:] = np.arange(ps.high, ps.high + n - take)
            ps.high += n - take
            ps._grow(ps.high)
        del fs[len(fs) - take:]
        ps.frames[seqs] = frames
        ps.version += 1
        ps.mod[seqs] = self.epoch
        ps.n_pages += n
        self.pool.clock += 1
        h = self.pool.headers
        h[frames] = self._header_template(kind)  # magic, kind, version, NIL links
        h["page_id"][frames] = seqs.view(np.uint64) | np.uint64(psid << 32)
        return seqs

    def release(self, psid: int, seqs: npt.ArrayLike) -> None:
        """Release pages of a page set (their frames are freed once no snapshot pins them).

        Raises
        ------
        PageNotFoundError
            If a page does not exist (nothing is released).
        """
        ps = self._get(psid)
        seqs = np.atleast_1d(np.asarray(seqs, dtype=np.int64))
        if not len(seqs):
            return
        sl = seqs.tolist()  # (min and max of a list: a page or two is the usual release)
        if min(sl) <= 0 or max(sl) >= ps.high:
            self._check_seqs(ps, seqs)  # raises for a page that does not exist
            raise ValueError(f"page set {psid}: the super page (seq 0) is released only by destroy")
        frames = ps.frames[seqs]
        if min(frames.tolist()) < 0:
            self._check_seqs(ps, seqs)
        ps.frames[seqs] = -1
        ps.version += 1
        ps.n_pages -= len(sl)
        ps.free_seqs.extend(sorted(sl, reverse=True))
        self.pool.free(frames)

    def _check_seqs(self, ps: PageSet, seqs: npt.NDArray[np.int64]) -> None:
        bad = (seqs < 0) | (seqs >= ps.high)
        if not bad.any():
            bad = ps.frames[seqs] < 0
        if bad.any():
            s = int(seqs[np.flatnonzero(bad)[0]])
            raise PageNotFoundError(
                f"page {make_page_id(ps.psid, s) if s >= 0 else s:#x} (page set {ps.psid}, "
                f"seq {s}) does not exist")

    def resolve(self, page_id: int) -> int:
        """Frame index of a PageID (``(psid << 32) | seq``).

        Raises
        ------
        PageNotFoundError
        """
        psid, seq = split_page_id(page_id)
        ps = self._sets.get(psid)
        if ps is None or seq >= ps.high or ps.frames[seq] < 0:
            raise PageNotFoundError(f"page {int(page_id):#x} (page set {psid}, seq {seq}) "
                                    f"does not exist")
        return int(ps.frames[seq])

    def page(self, page_id: int) -> npt.NDArray[np.uint8]:
        """Read-only view of a page's bytes (use `writable` before writing)."""
        v: npt.NDArray[np.uint8] = self.pool.frames[self.resolve(page_id)].view()
        v.flags.writeable = False
        return v

    def header(self, psid: int, seq: int) -> Any:
        """The header record of a page (a numpy void; read it, do not write it)."""
        return self.pool.headers[self._get(psid).frames[seq]]

    # -- the write barrier -----------------------------------------------------------------
    def writable(self, psid: int, seqs: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Make pages writable and return their frames: the copy-on-write barrier.

        A page that an active snapshot pins is first cloned into a new frame
        (the page table then points to the clone); every page is stamped with
        the current epoch for incremental snapshots. Pages copied: at most
        ``len(seqs)`` (none when no snapshot is active).

        Raises
        ------
        PoolExhaustedError
            If a clone needs a frame and none is free (nothing changed).
        """
        ps = self._sets[psid]
        frames = ps.frames[seqs]
        if self._active:
            pinned = self.pool.pins[frames] > 0
            if pinned.any():
                frames = frames.copy()
                frames[pinned] = self._clone(ps, seqs[pinned], frames[pinned])
        ps.mod[seqs] = self.epoch
        return frames

    def writable1(self, psid: int, seq: int) -> int:
        """Scalar `writable`: the frame of one page, cloned if pinned."""
        ps = self._sets[psid]
        frame = int(ps.frames[seq])
        if self._active and self.pool.pins[frame] > 0:
            frame = self._clone1(ps, seq, frame)
        ps.mod[seq] = self.epoch
        return frame

    def _clone1(self, ps: PageSet, seq: int, old: int) -> int:
        """Scalar `_clone` (the per-page copy-on-write of the compiled kernels' path)."""
        pool = self.pool
        new = pool.allocate1()  # overwritten right away
        pool.frames[new] = pool.frames[old]
        pool.clock += 1
        pool.headers["version"][new] = pool.clock
        ps.frames[seq] = new
        ps.version += 1
        pool.orphan1(old)
        self.stats_pages_cloned += 1
        return new

    def clone(self, page_id: int) -> int:
        """Copy a page into a new frame that replaces it in its page set; return the frame."""
        psid, seq = split_page_id(page_id)
        self.resolve(page_id)
        ps = self._sets[psid]
        return int(self._clone(ps, np.array([seq]), ps.frames[[seq]])[0])

    def _clone(self, ps: PageSet, seqs: npt.NDArray[np.int64],
               old: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        new = self.pool.allocate(len(old), zero=False)  # overwritten right away
        copy_frames(self.pool.frames, old, new)  # without the GIL
        self.pool.clock += 1
        self.pool.headers["version"][new] = self.pool.clock
        ps.frames[seqs] = new
        ps.version += 1
        self.pool.orphan(old)
        self.stats_pages_cloned += len(old)
        return new

    # -- metadata in super pages --------------------------------------------------------------
    def write_meta(self, psid: int, meta: dict[str, Any]) -> None:
        """Store a JSON-able dict in the super page of ``psid``.

        Raises
        ------
        ValueError
            If the encoded metadata does not fit in one page.
        """
        ps = self._get(psid)
        body = encode_meta(meta)
        room = self.page_bytes - HEADER_BYTES
        if len(body) > room:
            raise ValueError(f"page set {psid} ({ps.name!r}): metadata of {len(body)} bytes "
                             f"does not fit a {self.page_bytes}-byte super page")
        frame = self.writable1(psid, 0)
        area = self.pool.frames[frame, HEADER_BYTES:]
        area[:len(body)] = np.frombuffer(body, dtype=np.uint8)
        area[len(body):len(body) + 8] = 0
        ps.meta = meta

    def read_meta(self, psid: int) -> dict[str, Any]:
        """The metadata dict of a page set (cached copy of its super page)."""
        return self._get(psid).meta

    # -- structures ------------------------------------------------------------------------------
    def open_structure(self, name: str, kind: str, schema: dict[str, str],
                       params: dict[str, Any], *, psid: int | None = None) -> tuple[int, bool]:
        """Find or create the page set of structure ``name``: ``(psid, created)``.

        ``psid`` is the PSID a new page set gets (see `create`); an existing
        structure must already have it.

        Raises
        ------
        SchemaMismatchError
            If ``name`` exists with another kind or schema, or another PSID than ``psid``.
        PageSetExistsError
            If ``name`` is new and ``psid`` is in use.
        """
        self._flush_structures()
        if name in self._names:
            have = self._names[name]
            if psid is not None and _check_psid(psid) != have:
                raise SchemaMismatchError(
                    f"structure {name!r} exists with page set {have}, not {psid}")
            psid = have
            meta = self._sets[psid].meta
            if meta.get("kind") != kind:
                raise SchemaMismatchError(
                    f"structure {name!r} exists as a {meta.get('kind')}, not a {kind}")
            old = meta.get("schema", {})
            if old != schema:
                diffs = [f"{k}: stored {old.get(k)} vs requested {schema.get(k)}"
                         for k in sorted(set(old) | set(schema)) if old.get(k) != schema.get(k)]
                raise SchemaMismatchError(
                    f"structure {name!r} exists with another schema ({'; '.join(diffs)})")
            return psid, False
        return self.create(name, {"kind": kind, "schema": schema, "params": params,
                                  "state": {}}, psid=psid), True

    def _register(self, name: str, obj: Any) -> None:
        self._objects[name] = weakref.ref(obj)
        if hasattr(obj, "_flush"):
            self._flush_hooks.add(obj)

    def _lookup_object(self, name: str) -> Any:
        ref = self._objects.get(name)
        return ref() if ref is not None else None

    def flush_structures(self) -> None:
        """Push every open structure's buffered per-record operations into its pages.

        The pool's bytes are not written to its file (`flush` does both): what a
        caller about to read pages directly, or to freeze them without `chkpt`,
        needs. Runtime complexity: O(buffered operations).
        """
        for obj in list(self._flush_hooks):
            obj._flush()

    _flush_structures = flush_structures

    def page_sets(self) -> list[tuple[int, PageSet]]:
        """Every page set as ``(psid, PageSet)``, by increasing PSID.

        A `PageSet` gives its pages' sequence numbers (``seqs()``) and frames
        (``frames[seqs]``), for callers that compare pages (versions, checksums)
        across the whole manager. The list is a copy; the page sets are live.
        Runtime complexity: O(page sets).
        """
        return [(psid, self._sets[psid]) for psid in self._psid_order]

    # -- snapshots ----------------------------------------------------------------------------------
    def chkpt(self, psids: Iterable[int] | None = None,
              names: Iterable[str] | None = None, *, in_place: bool = False) -> Snapshot:
        """Freeze the pages of the chosen page sets (all by default) and return a `Snapshot`.

        No page bytes are copied or serialized: the page tables are copied and
        the frames pinned; later writes clone pinned pages (copy-on-write).
        Runtime complexity: O(pages). Pages copied: 0.

        With ``in_place`` the frames are pinned softly: the compiled kernels then
        update a record of a frozen page in place after logging its old bytes,
        instead of cloning the page, and the snapshot's readers see the frozen
        bytes (`mmm.snapshot`). Such a snapshot is for writing out, not a
        rollback point (`rollback` refuses it), and its frames are not stable
        bytes for anyone reading them directly.

        A checkpoint's writer may stage pages (`Snapshot.plan_staging`): copy them
        out in a background thread and release their frames early.

        Raises
        ------
        PageSetNotFoundError, StructureNotFoundError
            If a PSID or name does not exist (nothing is frozen).
        """
        self._flush_structures()
        chosen = set(self._sets) if psids is None and names is None else set()
        if psids is not None:
            for p in psids:
                self._get(int(p))
                chosen.add(int(p))
        if names is not None:
            for n in names:
                chosen.add(self.recover(n))
        order = sorted(chosen)
        ids, frames, changed, mods = [], [], [], []
        for psid in order:
            ps = self._sets[psid]
            seqs = ps.seqs()
            ids.append((np.uint64(psid) << np.uint64(32)) | seqs.astype(np.uint64))
            frames.append(ps.frames[seqs])
            mods.append(ps.mod[seqs])
            changed.append(mods[-1] > ps.durable_epoch)
        page_ids = np.concatenate(ids) if ids else np.zeros(0, np.uint64)
        fr = np.concatenate(frames) if frames else np.zeros(0, np.int64)
        ch = np.concatenate(changed) if changed else np.zeros(0, bool)
        log0 = self.pool.reset_undo() if not self._active else int(self.pool.undo[0])
        snap = Snapshot(self, self.epoch, tuple(order), page_ids, fr, ch,
                        {self._sets[p].name: p for p in order}, in_place=bool(in_place),
                        log_start=log0)
        self.pool.pin(fr, snap._weight)
        snap.covers_all = chosen == set(self._sets)
        self._active.add(snap.snapshot_id)
        self.epoch += 1
        return snap

    def _stage_buffer(self, rows: int) -> npt.NDArray[np.uint8]:
        """The spare staging buffer (`Snapshot.stage_planned`) when it has ``rows`` rows,
        else a new one. Any thread."""
        with self._lock:
            buf, self._stage_spare = self._stage_spare, None
        if buf is None or len(buf) < rows:
            buf = np.empty((rows, self.page_bytes), dtype=np.uint8)
        return buf

    def _stage_buffer_done(self, buf: npt.NDArray[np.uint8]) -> None:
        """Keep the largest staging buffer given back, for the next checkpoint."""
        with self._lock:
            if self._stage_spare is None or len(buf) > len(self._stage_spare):
                self._stage_spare = buf

    def _snapshot_done(self, snap: Snapshot) -> None:
        self._active.discard(snap.snapshot_id)
        if snap.state is SnapshotState.COMPLETED:
            for psid in snap.psids:
                ps = self._sets.get(psid)
                if ps is not None:
                    ps.durable_epoch = max(ps.durable_epoch, snap.snapshot_id)

    def rollback(self, snap: Snapshot) -> None:
        """Roll the live state of the snapshot's page sets back to it (cheap, in memory).

        Page sets created after a snapshot of *all* page sets are destroyed.
        The snapshot is consumed (RELEASED). Pages copied: 0. Only the pages
        written since the snapshot count as changed for the next incremental
        checkpoint; the others keep their state (a rolled-back batch costs the
        next checkpoint the pages it touched, not the whole state).

        Raises
        ------
        SnapshotStateError
            If the snapshot is not ACTIVE or some of its pages were already
            persisted and released (their frames may have been reused).
        """
        if snap._pm is not self:
            raise SnapshotStateError(f"snapshot {snap.snapshot_id} belongs to another manager")
        snap._require_active("roll back")
        if snap.in_place:
            raise SnapshotStateError(
                f"snapshot {snap.snapshot_id} was taken in place (chkpt(in_place=True)): its "
                f"frames may have been updated, so it is not a rollback point")
        if snap.n_staged:
            raise SnapshotStateError(
                f"snapshot {snap.snapshot_id}: {snap.n_staged} page(s) were already staged "
                f"and released; only an unstaged snapshot is a rollback point")
        if snap._n_persisted:
            raise SnapshotStateError(
                f"snapshot {snap.snapshot_id}: {snap._n_persisted} page(s) were already "
                f"persisted and released; only an unpersisted snapshot is a rollback point")
        self._flush_structures()
        if snap.covers_all:
            for psid in [p for p in self._sets if p not in snap.psids]:
                self.destroy(psid)  # created after the snapshot
        psid_of = (snap.page_ids >> np.uint64(32)).astype(np.int64)
        seq_of = (snap.page_ids & np.uint64(0xFFFFFFFF)).astype(np.int64)
        for psid in snap.psids:
            sel = psid_of == psid
            seqs, frames = seq_of[sel], snap._frames[sel]
            old = self._sets.get(psid)
            # a page keeps its modification epoch (and stays unchanged for the next
            # incremental checkpoint) when nothing wrote it since the snapshot: the same
            # frame (a write to a pinned page clones it) and no later stamp; every other
            # page, the ones the rolled-back work touched, is marked changed
            mod = np.full(len(seqs), self.epoch, dtype=np.int64)
            durable = 0
            if old is not None:
                live = old.frames[old.seqs()]
                self.pool.free(live[~np.isin(live, frames)])
                self._names.pop(old.name, None)
                inr = seqs < len(old.frames)
                same = np.zeros(len(seqs), dtype=bool)
                same[inr] = (old.frames[seqs[inr]] == frames[inr]) & \
                    (old.mod[seqs[inr]] <= snap.snapshot_id)
                mod[same] = old.mod[seqs[same]]
                durable = old.durable_epoch
            ps = PageSet(psid, "")
            self._sets[psid] = ps
            ps._grow(int(seqs.max()) + 1)
            ps.frames[seqs] = frames
            ps.mod[seqs] = mod
            ps.durable_epoch = durable
            ps._recompute_free()
            with self.pool._lock:
                self.pool.state[frames] = LIVE
            ps.meta = decode_meta(self.pool.frames[ps.frames[0], HEADER_BYTES:])
            ps.name = str(ps.meta["name"])
            self._names[ps.name] = psid
        self._next_psid = 1  # the lowest free PSID next (skipping those in use)
        self._psid_order = sorted(self._sets)
        snap.release()
        self.generation += 1

    # -- loading ---------------------------------------------------------------------------------------
    def begin_load(self) -> "Loader":
        """Start loading pages (from a checkpoint): replaces all current state.

        Returns a `Loader`; call `Loader.add` from any number of threads as
        pages arrive, in any order, then `Loader.finish`.
        """
        for psid in list(self._sets):
            self.destroy(psid)
        self.pool.reset_if_empty()  # consecutive frames: pages can be read straight into them
        return Loader(self)

    def load(self, pages: Iterable[npt.ArrayLike]) -> None:
        """Replace all state with the given pages (Table 4's ``load``), in any order.

        A convenience over `begin_load` for pages already in memory; I/O code
        that reads pages in parallel uses the `Loader` directly.

        Raises
        ------
        PageFormatError
            If the bytes are not whole pages, a PageID repeats, or a page set
            has no super page (nothing is loaded).
        """
        loader = self.begin_load()
        try:
            for chunk in pages:
                loader.add(chunk)
        except BaseException:
            loader.abort()
            raise
        loader.finish()

    def _adopt(self, frames: npt.NDArray[np.int64], dedupe: bool,
               ids: npt.NDArray[np.uint64] | None = None) -> None:
        """Build page sets and the catalog from pages already in ``frames``.

        One sort of the PageIDs and one compiled pass (`mmm._kernels.pages.group_pages`)
        that finds repeated PageIDs and the page-set boundaries; then one slice
        assignment per page set. ``ids``: the frames' PageIDs when the caller has them
        (a `Loader` takes them as the pages arrive), else read from the headers here.
        """
        h = self.pool.headers
        frames = np.asarray(frames, dtype=np.int64)
        if ids is None:
            ids = h["page_id"][frames]
        order = np.argsort(ids, kind="stable")  # pages arrive mostly in PageID order
        # versions decide only between copies of one PageID (``dedupe``)
        keep, lose, starts, dup = group_pages(ids, h["version"][frames] if dedupe else ids,
                                              order, dedupe)
        if dup >= 0:
            raise PageFormatError(f"page {int(ids[dup]):#x} appears more than once in the load")
        if len(lose):
            self.pool.free(frames[lose])
        frames, ids = frames[keep], ids[keep]
        psids = (ids >> np.uint64(32)).astype(np.int64)
        seqs = (ids & np.uint64(0xFFFFFFFF)).astype(np.int64)
        sets: dict[int, PageSet] = {}
        names: dict[str, int] = {}
        for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
            psid = int(psids[a])
            s, f = seqs[a:b], frames[a:b]
            if s[0] != 0:
                raise PageFormatError(f"page set {psid} has no super page (seq 0) among its "
                                      f"{len(s)} pages")
            try:
                meta = decode_meta(self.pool.frames[int(f[0]), HEADER_BYTES:])
            except (ValueError, UnicodeDecodeError) as exc:
                raise PageFormatError(f"page set {psid}: unreadable super page ({exc})") from None
            ps = PageSet(psid, str(meta.get("name")))
            ps._grow(int(s[-1]) + 1)
            ps.frames[s] = f
            ps._recompute_free()
            ps.meta = meta
            sets[psid] = ps
            names[ps.name] = psid
        self._sets.clear()
        self._names.clear()
        self._sets.update(sets)
        self._names.update(names)
        self._next_psid = 1  # the lowest free PSID next (skipping those in use)
        self._psid_order = sorted(self._sets)
        self.generation += 1

    # -- accounting ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Pool statistics plus page sets, active snapshots and pages cloned."""
        out = self.pool.stats()
        out.update(page_sets=len(self._sets), active_snapshots=len(self._active),
                   pages_cloned=self.stats_pages_cloned,
                   values_written_in_place=self.pool.undo_records)
        return out

    def _check(self) -> None:
        """Assert every invariant of the page tables and the pool (O(pages))."""
        self.pool._check()
        seen: set[int] = set()
        h = self.pool.headers
        for psid, ps in self._sets.items():
            seqs = ps.seqs()
            assert ps.n_pages == len(seqs), (psid, ps.n_pages, len(seqs))
            frames = ps.frames[seqs]
            assert not (set(frames.tolist()) & seen), "frame in two page tables"
            seen.update(frames.tolist())
            assert np.all(self.pool.state[frames] == LIVE)
            assert np.all(h["magic"][frames] == PAGE_MAGIC)
            want = (np.uint64(psid) << np.uint64(32)) | seqs.astype(np.uint64)
            assert np.array_equal(h["page_id"][frames], want), f"page set {psid}: header ids"
            assert set(ps.free_seqs) == set(range(ps.high)) - set(seqs.tolist())
            assert self._names[ps.name] == psid
        assert self._psid_order == sorted(self._sets)
        assert len(self._names) == len(self._sets)
        assert len(seen) == int(np.count_nonzero(self.pool.state == LIVE))


def _check_psid(psid: Any) -> int:
    if isinstance(psid, (bool, np.bool_)) or not isinstance(psid, (int, np.integer)) \
            or not 1 <= int(psid) < PSID_LIMIT:
        raise ValueError(f"psid {psid!r}: must be an int with 1 <= psid < 2**32")
    return int(psid)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME:
        raise ValueError(f"structure name {name!r}: must be a non-empty string of at most "
                         f"{_MAX_NAME} characters")


class Loader:
    """Places pages into free frames as they arrive, in any order (thread-safe).

    Created by `PageManager.begin_load`. `finish` rebuilds the page table and
    the catalog; structures then come back through their create-by-name call.
    """

    def __init__(self, pm: PageManager) -> None:
        self._pm = pm
        self._frames: list[npt.NDArray[np.int64]] = []
        # the PageIDs of _frames' pages, read as they arrive (by the reading thread, while
        # the headers are in its cache): `finish` need not walk every frame's header again
        self._ids: list[npt.NDArray[np.uint64]] = []
        self._lock = threading.Lock()
        self._done = False

    def add(self, pages: npt.ArrayLike) -> None:
        """Place pages (bytes or an array of whole pages) into free frames.

        Raises
        ------
        PageFormatError
            If the length is not a multiple of the page size or a page has no
            valid header (nothing from this call is kept).
        PoolExhaustedError
            If the pool is full.
        """
        pb = self._pm.page_bytes
        buf = np.frombuffer(pages, dtype=np.uint8) if isinstance(pages, (bytes, bytearray,
                                                                         memoryview)) \
            else np.asarray(pages, dtype=np.uint8)
        if buf.size % pb:
            raise PageFormatError(f"{buf.size} bytes is not a whole number of "
                                  f"{pb}-byte pages")
        buf = buf.reshape(-1, pb)
        hdr = buf[:, :HEADER_BYTES].copy().view(HEADER_DTYPE)[:, 0]
        bad = np.flatnonzero(hdr["magic"] != PAGE_MAGIC)
        if len(bad):
            raise PageFormatError(f"page {int(bad[0])} of this batch has no page header "
                                  f"(magic {int(hdr['magic'][bad[0]]):#x})")
        if self._done:
            raise SnapshotStateError("loader already finished")
        frames = self._pm.pool.allocate(len(buf), zero=False)  # overwritten right away
        self._pm.pool.frames[frames] = buf
        with self._lock:
            self._frames.append(frames)
            self._ids.append(hdr["page_id"].copy())

    def reserve(self, n: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8] | None]:
        """Take ``n`` free frames to read pages straight into (zero-copy loading).

        Returns the frames and, when they are consecutive, a writable
        ``(n, page_bytes)`` view of them to read into; otherwise None (read
        elsewhere, then `place`). Finish with `commit`, `place` or `unreserve`.
        Thread-safe.

        Raises
        ------
        PoolExhaustedError
            If fewer than ``n`` frames are free.
        SnapshotStateError
            If the loader already finished.
        """
        if self._done:
            raise SnapshotStateError("loader already finished")
        frames = self._pm.pool.allocate(n, zero=False)
        if n and int(frames[-1]) - int(frames[0]) == n - 1 and \
                (n == 1 or bool(np.all(np.diff(frames) == 1))):
            f0 = int(frames[0])
            return frames, self._pm.pool.frames[f0:f0 + n]
        return frames, None

    def place(self, frames: npt.NDArray[np.int64], pages: npt.NDArray[np.uint8]) -> None:
        """Copy pages into reserved frames (when `reserve` lent no view), then `commit`."""
        self._pm.pool.frames[frames] = pages
        self.commit(frames)

    def commit(self, frames: npt.NDArray[np.int64]) -> None:
        """Keep reserved frames whose bytes now hold whole pages.

        Raises
        ------
        PageFormatError
            If a frame has no page header (the frames are freed).
        """
        h = self._pm.pool.headers  # (a gather per field: numpy gathers whole header
        magic = h["magic"][frames]  # records several times slower)
        bad = np.flatnonzero(magic != PAGE_MAGIC)
        if len(bad):
            self._pm.pool.free(frames)
            raise PageFormatError(f"page {int(bad[0])} of this batch has no page header "
                                  f"(magic {int(magic[bad[0]]):#x})")
        ids = h["page_id"][frames]
        with self._lock:
            self._frames.append(frames)
            self._ids.append(ids)

    def unreserve(self, frames: npt.NDArray[np.int64]) -> None:
        """Give reserved frames back (e.g. their bytes failed a checksum)."""
        self._pm.pool.free(frames)

    def finish(self) -> None:
        """Rebuild the page tables and catalog from the loaded pages.

        Raises
        ------
        PageFormatError
            If a PageID appears twice or a page set lacks its super page
            (all loaded pages are freed again).
        """
        with self._lock:
            self._done = True
            frames = np.concatenate(self._frames) if self._frames else np.zeros(0, np.int64)
            ids = np.concatenate(self._ids) if self._ids else np.zeros(0, np.uint64)
        try:
            self._pm._adopt(frames, dedupe=False, ids=ids)
        except PageFormatError:
            self._pm.pool.free(frames)
            self._pm._sets.clear()
            self._pm._names.clear()
            self._pm._psid_order = []
            raise

    def abort(self) -> None:
        """Free every page loaded so far."""
        with self._lock:
            self._done = True
            for f in self._frames:
                self._pm.pool.free(f)
            self._frames.clear()
            self._ids.clear()
