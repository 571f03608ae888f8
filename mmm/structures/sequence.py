"""Paged sequences: `PagedList` and `PagedDeque` (paper Table 3: doubly linked pages).

A sequence is a doubly linked list of *sequence pages* (`Layout.SEQUENCE`) in
one page set, plus the set's super page (seq 0) that holds the name, kind,
record schema and ``params = {"page_slots": S}``.

Page layout
-----------
header ``count``   records in the page
header ``start``   first used slot: the records occupy slots ``[start, start + count)``,
                   so both ends of a page grow and shrink in O(1)
header ``prev``    PageID (``(psid << 32) | seq``) of the previous page, ``NIL`` for the head
header ``next``    PageID of the next page, ``NIL`` for the tail
record area        ``S`` slots of the record dtype, right after the 64-byte header;
                   ``S = (page_bytes - 64) // itemsize`` unless ``page_slots`` overrides it

Links are full PageIDs (never frame numbers), so pages loaded into another
page manager, or re-attached, keep their meaning. The head is *not* stored in
the super page: it is the one sequence page whose ``prev`` is ``NIL``, found
when the in-memory index is rebuilt. So the super page is written only at
creation, and an operation writes (and, under a snapshot, clones) only the
pages whose bytes it changes.

In-memory index (redundant, rebuilt lazily by ``_rebuild`` after a rollback,
load or re-attach): ``_seqs`` the page seqs in list order, ``_cnt`` their
counts, ``_cum`` the cumulative counts (computed on demand, for
``np.searchsorted`` index lookups), ``_len``.

Invariants (asserted by ``_check``)
-----------------------------------
* the pages of the set are the super page and exactly the pages of ``_seqs``;
  every one of the latter has kind SEQUENCE and its own PageID;
* ``prev``/``next`` are consistent both ways, ``NIL`` exactly at the ends;
* ``start + count <= S`` on every page; counts equal ``_cnt`` and sum to ``len``;
* no page is empty, except the single remaining page of an empty sequence:
  pages that become empty are released, but the last one is kept so that a
  window buffer that drains and refills does not allocate a page each time
  (a sequence that never held a record has no page at all);
* the cached cumulative counts, when present, match the pages.

Memory: deletions in the middle merge a page into a neighbour when their
records fit one page; a full page that receives an `insert` is split in two.

Every write goes through the page manager's write barrier
(`PageManager.writable`), so pages frozen by a snapshot are cloned, never
written in place.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any, ClassVar, Self

import numpy as np
import numpy.typing as npt

from mmm._kernels.pages import chain_order, copy_rows_in, copy_rows_out
from mmm._kernels.sequence import append_rows, count_before
from mmm.errors import (PageFormatError, PoolExhaustedError, RecordTypeError, SchemaError,
                        SchemaMismatchError, StructureNotFoundError)
from mmm.manager import PageManager
from mmm.namespace import Namespace
from mmm.page import HEADER_BYTES, NIL_INT, Layout
from mmm.schema import as_schema, coerce_records, dtype_to_text
from mmm.structures.base import Structure
from mmm.structures.record import (COUNT_WORD, START_WORD, pool_views, record_struct,
                                   scalar_code, typed_view)

__all__ = ["PagedList", "PagedDeque"]

_NIL = np.uint64(NIL_INT)
_SEQ_MASK = np.uint64(0xFFFFFFFF)


class _PagedSequence(Structure):
    """Shared implementation of `PagedList` and `PagedDeque` (see the module docstring)."""

    KIND: ClassVar[str] = "sequence"

    # -- creation -------------------------------------------------------------------------
    @classmethod
    def create(cls, pm: PageManager | Namespace, name: str, dtype: npt.DTypeLike, *,
               page_slots: int | None = None) -> Self:
        """Create the sequence ``name`` with record dtype ``dtype``, or reopen it.

        Calling ``create`` again with the same name (also after a rollback, a
        load from a checkpoint or a re-attach) returns the sequence with its
        contents; while it is open, the same object is returned.

        Parameters
        ----------
        pm : PageManager or Namespace
            The page manager that holds the pages.
        name : str
            Structure name, unique within ``pm``.
        dtype : dtype-like
            Record schema: a numpy scalar or structured dtype without object
            or unicode fields.
        page_slots : int, optional
            Records per page (at least 2). Defaults to as many as fit a page;
            tests use tiny values so page boundaries are crossed often. When
            reopening, ``None`` means "as stored".

        Raises
        ------
        SchemaError
            If ``dtype`` has object or unicode fields, is not a dtype, or a
            record does not fit twice in a page.
        SchemaMismatchError
            If ``name`` exists as another kind, with another schema or another
            ``page_slots``.
        ValueError
            If ``page_slots`` is out of range or the name is invalid.

        Runtime complexity: O(pages) when reopening after a rollback or load, else O(1).
        Pages copied: 0.
        """
        dt = as_schema(dtype, f"{cls.KIND} {name!r} record")
        schema = {"record": dtype_to_text(dt)}
        max_slots = (pm.page_bytes - HEADER_BYTES) // dt.itemsize
        if max_slots < 2:
            raise SchemaError(f"{cls.KIND} {name!r}: a record of {dt.itemsize} bytes does not "
                              f"fit twice in a {pm.page_bytes}-byte page")
        if page_slots is not None:
            if (isinstance(page_slots, bool) or not isinstance(page_slots, (int, np.integer))
                    or not 2 <= page_slots <= max_slots):
                raise ValueError(f"{cls.KIND} {name!r}: page_slots={page_slots!r} must be an "
                                 f"integer in [2, {max_slots}] for {dt.itemsize}-byte records "
                                 f"in {pm.page_bytes}-byte pages")
            page_slots = int(page_slots)
        obj: Self | None = cls._existing(pm, name, schema)
        if obj is not None:
            obj._check_slots(page_slots)
            return obj
        if pm.exists(name):
            meta = pm.read_meta(pm.recover(name))
            if meta.get("kind") == cls.KIND and meta.get("schema") == schema:
                stored = int(meta.get("params", {}).get("page_slots", 0))
                if page_slots is not None and stored != page_slots:
                    raise SchemaMismatchError(
                        f"{cls.KIND} {name!r} exists with page_slots={stored}, "
                        f"not {page_slots}")
        return cls(pm, name, dt, schema, page_slots or max_slots)

    def __init__(self, pm: PageManager | Namespace, name: str, dt: np.dtype[Any], schema: dict[str, str],
                 page_slots: int) -> None:
        """Use `create`."""
        self._dt = dt
        self._what = f"{self.KIND} {name!r}"
        self._S = 0
        self._fgen = -1  # generation of the end-page cache (see `_fast`); -1: none
        super().__init__(pm, name, schema, {"page_slots": int(page_slots)})

    def _check_slots(self, page_slots: int | None) -> None:
        """Raise SchemaMismatchError if ``page_slots`` is given and differs from the stored one."""
        self._sync()
        if page_slots is not None and page_slots != self._S:
            raise SchemaMismatchError(f"{self._what} exists with page_slots={self._S}, "
                                      f"not {page_slots}")

    def _sync(self) -> None:
        """As `Structure._sync`, but a destroyed sequence raises StructureNotFoundError
        (the base would resolve its old PSID, which a later rollback may give to another set).
        Every operation but the per-record end operations starts here, so this also drops
        the end-page cache of `_fast` (the operation may move, clone or release those pages)."""
        self._fgen = -1
        if self._gen == -2:
            raise StructureNotFoundError(f"{self._what} was destroyed")
        super()._sync()

    def _flush(self) -> None:
        """Called by the page manager before a snapshot, a rollback or a load: drop the
        end-page cache, whose pages a snapshot is about to share (copy-on-write)."""
        self._fgen = -1

    def _views(self) -> None:
        """Build the 2-D record view and header column views over the whole pool (once)."""
        S = int(self._params["page_slots"])
        self._S = S
        pool = self._pm.pool
        isz = self._dt.itemsize
        self._R = pool.frames[:, HEADER_BYTES:HEADER_BYTES + S * isz].view(self._dt)
        if self._R.ndim == 3:  # subarray dtype at top level is not a record view
            raise SchemaError(f"{self._what}: dtype {self._dt} must be a scalar or structured "
                              f"dtype, not a subarray")
        # the per-record end operations (`_fast`): records as Python tuples / numbers
        self._rs = record_struct(self._dt)
        self._scalar = self._dt.fields is None
        if self._rs is None:
            self._fast_types: tuple[type, ...] = ()
        elif not self._scalar:
            self._fast_types = (tuple,)
        else:
            self._fast_types = (int,) if self._dt.kind in "iu" else (int, float)
        self._mvB, self._mvI = pool_views(pool.frames)
        # `popleft_before`: the fields it reads in plain Python (None: the whole scalar record)
        self._fget: dict[str | None, tuple[Any, int, tuple[type, ...]]] = {}
        if self._rs is not None:
            fields = [(None, self._dt, 0)] if self._dt.fields is None else \
                [(nm, self._dt.fields[nm][0], self._dt.fields[nm][1]) for nm in self._dt.names or ()]
            for nm, fdt, off in fields:
                code = scalar_code(fdt)
                assert code is not None  # the record has a struct twin
                self._fget[nm] = (struct.Struct("<" + code).unpack_from, off,
                                  (int,) if fdt.kind in "iu" else (int, float))
        self._pb = pool.page_bytes
        self._pw = pool.page_bytes // 4
        self._cbprep: dict[str | None, tuple[Any, ...]] = {}  # `_count_prep`'s, per field
        h = pool.headers
        self._hk, self._hc, self._hs = h["kind"], h["count"], h["start"]
        self._hp, self._hn, self._hid = h["prev"], h["next"], h["page_id"]

    # -- in-memory index ----------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Walk the links from the head page; rebuild ``_seqs``, ``_cnt``, ``_len``."""
        if self._S == 0:
            self._views()
        ps = self._ps
        seqs = ps.seqs()
        seqs = seqs[seqs != 0]
        self._cum: npt.NDArray[np.int64] | None = None
        if len(seqs) == 0:
            self._seqs = np.zeros(0, np.int64)
            self._cnt = np.zeros(0, np.int64)
            self._len = 0
            return
        frames = ps.frames[seqs]
        bad = self._hk[frames] != Layout.SEQUENCE
        if bad.any():
            raise PageFormatError(f"{self._what}: page seq {int(seqs[bad][0])} has layout "
                                  f"{int(self._hk[frames][bad][0])}, not SEQUENCE")
        order, heads, visited = chain_order(seqs, self._hp[frames], self._hn[frames])
        if heads != 1:
            raise PageFormatError(f"{self._what}: {heads} head pages (prev = NIL) among "
                                  f"{len(seqs)} pages")
        if visited != len(seqs):
            raise PageFormatError(f"{self._what}: next links do not form one chain over the "
                                  f"{len(seqs)} pages (broken after {visited})")
        self._seqs = order
        self._cnt = self._hc[ps.frames[order]].astype(np.int64)
        self._len = int(self._cnt.sum())

    def _cumc(self) -> npt.NDArray[np.int64]:
        """Cumulative counts ``[0, c0, c0+c1, ...]`` (recomputed when invalidated)."""
        cum = self._cum
        if cum is None:
            cum = np.zeros(len(self._cnt) + 1, np.int64)
            np.cumsum(self._cnt, out=cum[1:])
            self._cum = cum
        return cum

    def _pid(self, seqs: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
        """PageIDs of ``seqs``."""
        return (np.uint64(self.psid) << np.uint64(32)) | seqs.astype(np.uint64)

    def _frame(self, p: int) -> int:
        """Current frame of the page at list position ``p`` (read only)."""
        return int(self._ps.frames[self._seqs[p]])

    # -- per-record end operations: the end-page cache ---------------------------------------------
    # `append`, `pop`, `popleft`, `s[0]`, `s[-1]` and their ``*_item`` forms work on the head and
    # tail pages through `_fast`: each end is a list ``[frame, start, count, writable, seq]``
    # (the same list when one page is both ends), records move with `struct` through
    # memoryviews over the pool, and the header fields, ``_cnt`` and ``_len`` are updated
    # in place at once, so every other operation sees exact state. The cache lives until
    # any other operation (`_sync`) or a snapshot, rollback or load (`_flush`) drops it:
    # ``writable`` is True only for a page that passed the write barrier since the cache
    # was built, so a page frozen by a snapshot is cloned before its first write.
    def _fast(self) -> bool:
        """Build the end-page cache; False if the sequence has no page."""
        self._sync()
        seqs, cnt = self._seqs, self._cnt
        n = len(seqs)
        if n == 0:
            return False
        frames = self._ps.frames

        def end(p: int) -> list[Any]:
            seq = int(seqs[p])
            f = int(frames[seq])
            return [f, int(self._hs[f]), int(cnt[p]), False, seq]

        self._H = end(0)
        self._T = self._H if n == 1 else end(n - 1)
        self._np = n
        self._nb = (int(cnt[1]), int(cnt[-2])) if n > 2 else (0, 0)  # the ends' neighbours
        self._cmv = typed_view(cnt, "q")
        self._fgen = self._pm.generation
        return True

    def _wend(self, E: list[Any]) -> int:
        """Pass an end page through the write barrier (cloned if a snapshot shares it)."""
        f = self._pm.writable1(self.psid, E[4])
        E[0] = f
        E[3] = True
        return f

    def _end(self, back: bool, pop: bool, item: bool) -> Any:
        """The first (last with ``back``) record, removed with ``pop``: a Python value
        (`record_struct` order) with ``item``, else a numpy record (a copy).

        Runtime complexity: O(1). Pages copied: at most 1 (plus as `_delete` when the
        end page is released or merged with its neighbour).
        """
        if self._fgen == self._pm.generation or self._fast():
            E = self._T if back else self._H
            c = E[2]
            if c > 1 or (c == 1 and not pop):
                S = self._S
                ok = not pop or self._np == 1 or 2 * c - 2 >= S
                if not ok:  # the page may merge with its neighbour (as `_maybe_merge`)
                    nb = (self._H[2] if back else self._T[2]) if self._np == 2 else \
                        self._nb[1 if back else 0]
                    ok = c - 1 + nb > S
                rs = self._rs
                if ok and (rs is not None or not item):
                    f, st = E[0], E[1]
                    slot = st + c - 1 if back else st
                    if item:
                        out = rs.unpack_from(self._mvB,  # type: ignore[union-attr]
                                             f * self._pb + HEADER_BYTES + slot * self._dt.itemsize)
                        rec: Any = out[0] if self._scalar else out
                    else:
                        rec = self._R[f, slot].copy()
                    if pop:
                        if not E[3]:
                            f = self._wend(E)
                        w = f * self._pw
                        if not back:
                            E[1] = st + 1
                            self._mvI[w + START_WORD] = st + 1
                        E[2] = c - 1
                        self._mvI[w + COUNT_WORD] = c - 1
                        self._cmv[self._np - 1 if back else 0] = c - 1
                        self._len -= 1
                        self._cum = None
                    return rec
        self._sync()
        if not self._len:
            raise IndexError(f"pop from an empty {self._what}" if pop else
                             f"{self._what}: index {-1 if back else 0} out of range for "
                             f"length 0")
        j = self._len - 1 if back else 0
        rec = self._read(j, j + 1)[0]
        if pop:
            self._delete(j, j + 1)
        return rec.item() if item else rec

    # -- validation -------------------------------------------------------------------------------
    def _records(self, values: Any) -> np.ndarray:
        """Coerce a batch of records to a 1-D array of the schema (RecordTypeError otherwise)."""
        if isinstance(values, (list, tuple)) and len(values) == 0:
            return np.empty(0, self._dt)  # np.asarray([]) would be float64
        try:
            arr = coerce_records(values, self._dt, self._what)
        except RecordTypeError:
            raise
        except (TypeError, ValueError, OverflowError) as exc:  # schema.py lets OverflowError out
            raise RecordTypeError(f"{self._what}: cannot convert to records of {self._dt}: "
                                  f"{exc}") from None
        if arr.dtype != self._dt:
            raise RecordTypeError(f"{self._what}: records of dtype {arr.dtype}, "
                                  f"expected {self._dt}")
        return arr

    def _one(self, rec: Any) -> np.ndarray:
        """Coerce one record to a length-1 array of the schema."""
        if self._dt.fields is not None:
            if isinstance(rec, np.void) or (isinstance(rec, np.ndarray) and rec.ndim == 0):
                rec = np.asarray(rec).reshape(1)
            elif not isinstance(rec, (tuple, np.ndarray)):
                raise RecordTypeError(f"{self._what}: a record must be a tuple or a numpy "
                                      f"record of {self._dt}, not {type(rec).__name__}")
        elif np.ndim(rec) != 0:
            raise RecordTypeError(f"{self._what}: expected one {self._dt} value, got shape "
                                  f"{np.shape(rec)}")
        arr = self._records(rec)
        if len(arr) != 1:
            raise RecordTypeError(f"{self._what}: expected one record, got {len(arr)}")
        return arr

    def _index(self, i: Any, *, what: str = "index") -> int:
        """Normalize an integer index into ``[0, len)`` (IndexError otherwise)."""
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"{self._what}: {what} must be an integer, not {type(i).__name__}")
        n = self._len
        j = int(i) + n if i < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"{self._what}: {what} {int(i)} out of range for length {n}")
        return j

    def _count_arg(self, n: Any, op: str) -> int:
        """Validate a record count argument ``0 <= n <= len``."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"{self._what}: {op} count must be an integer, "
                            f"not {type(n).__name__}")
        if n < 0:
            raise ValueError(f"{self._what}: {op}({int(n)}): count must be >= 0")
        if n > self._len:
            raise IndexError(f"{self._what}: {op}({int(n)}) from a sequence of "
                             f"{self._len} records")
        return int(n)

    # -- low-level page operations -------------------------------------------------------------
    def _read(self, a: int, b: int) -> np.ndarray:
        """Records ``[a, b)`` as a new array (one compiled copy over the pages)."""
        out = np.empty(max(b - a, 0), self._dt)
        if b > a:
            fr, first, cnt = self._spans(a, b, writable=False)
            copy_rows_out(self._pm.pool.frames, fr, first, cnt, HEADER_BYTES, self._dt.itemsize,
                          out.view(np.uint8))
        return out

    def _spans(self, a: int, b: int, writable: bool
               ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(frames, first slots, counts)`` of the pages holding records ``[a, b)`` (``b > a``),
        in order; with ``writable`` the pages pass the write barrier first."""
        cum = self._cumc()
        p0 = int(np.searchsorted(cum, a, "right")) - 1
        p1 = int(np.searchsorted(cum, b - 1, "right")) - 1
        seqs = self._seqs[p0:p1 + 1]
        frames = self._pm.writable(self.psid, seqs) if writable else self._ps.frames[seqs]
        first = self._hs[frames].astype(np.int64)
        cnt = self._cnt[p0:p1 + 1].copy()
        lo = a - int(cum[p0])
        first[0] += lo
        cnt[-1] = b - int(cum[p1])
        cnt[0] -= lo
        return frames, first, cnt

    def _slot(self, j: int) -> tuple[int, int]:
        """``(list position, slot)`` of global index ``j`` (in ``[0, len)``)."""
        cum = self._cumc()
        p = int(cum.searchsorted(j, "right")) - 1
        f = int(self._ps.frames[self._seqs[p]])
        return p, int(self._hs[f]) + j - int(cum[p])

    def _gather(self, idx: npt.NDArray[np.int64]) -> np.ndarray:
        """Records at global indices ``idx`` (already in ``[0, len)``): one vectorized gather."""
        cum = self._cumc()
        p = np.searchsorted(cum, idx, "right") - 1
        frames = self._ps.frames[self._seqs[p]]
        slots = self._hs[frames].astype(np.int64) + (idx - cum[p])
        out: np.ndarray = self._R[frames, slots]
        return out

    def _write(self, a: int, arr: np.ndarray) -> None:
        """Overwrite records ``[a, a + len(arr))`` in place (no resize)."""
        if len(arr):
            fr, first, cnt = self._spans(a, a + len(arr), writable=True)
            copy_rows_in(self._pm.pool.frames, fr, first, cnt, HEADER_BYTES, self._dt.itemsize,
                         np.ascontiguousarray(arr).view(np.uint8))

    def _alloc(self, k: int, zero: bool = True
               ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Allocate ``k`` sequence pages: ``(seqs, frames)``; ``zero=False`` for a caller
        that writes every byte after the header (`PageManager.allocate`)."""
        if k == 0:
            z = np.zeros(0, np.int64)
            return z, z
        seqs = self._pm.allocate(self.psid, k, Layout.SEQUENCE, zero=zero)
        return seqs, self._pm.writable(self.psid, seqs)

    def _relink(self, lo: int, hi: int) -> None:
        """Rewrite prev/next of list positions ``[lo, hi)`` where they differ from the order.

        A plain loop: an operation relinks a handful of pages (the ones around a block
        it added or dropped), where a dozen numpy calls would cost ~20 µs."""
        seqs = self._seqs
        n = len(seqs)
        lo, hi = max(lo, 0), min(hi, n)
        if lo >= hi:
            return
        a = max(lo - 1, 0)
        near = seqs[a:min(hi + 1, n)].tolist()
        top = int(self.psid) << 32
        fr, hp, hn = self._ps.frames, self._hp, self._hn
        fix: list[tuple[int, int, int]] = []
        for p in range(lo, hi):
            seq = near[p - a]
            want_prev = top | near[p - 1 - a] if p > 0 else NIL_INT
            want_next = top | near[p + 1 - a] if p < n - 1 else NIL_INT
            f = int(fr[seq])
            if int(hp[f]) != want_prev or int(hn[f]) != want_next:
                fix.append((seq, want_prev, want_next))
        if len(fix) == 1:  # the usual case: one neighbour (scalar write barrier)
            seq, want_prev, want_next = fix[0]
            f = self._pm.writable1(self.psid, seq)
            hp[f] = want_prev
            hn[f] = want_next
        elif fix:  # one write barrier for all (it raises before any change)
            frames = self._pm.writable(self.psid, np.array([x[0] for x in fix], np.int64))
            for f, (_, want_prev, want_next) in zip(frames.tolist(), fix):
                hp[f] = want_prev
                hn[f] = want_next

    def _ensure_frames(self, k: int, positions: list[int]) -> None:
        """Raise PoolExhaustedError before mutating if ``k`` new pages plus clones of the
        pinned pages among list ``positions`` (the pages an operation may write) do not fit."""
        need = k
        if self._pm._active and positions:
            n = len(self._seqs)
            pos = sorted({p for p in positions if 0 <= p < n})
            if pos:
                frames = self._ps.frames[self._seqs[pos]]
                need += int(np.count_nonzero(self._pm.pool.pins[frames] > 0))
        free = self._pm.pool.free_frames
        if need > free:  # a full file system raises `PoolSpaceError` here
            self._pm.pool.reserve_frames(need)
            free = self._pm.pool.free_frames
        if need > free:
            raise PoolExhaustedError(
                f"{self._what}: the operation needs up to {need} free page(s) "
                f"({k} new, {need - k} copy-on-write clone(s)), the pool has {free}")

    def _set(self, p: int, frame: int, start: int, count: int) -> None:
        """Write start/count of the (writable) page at position ``p`` and its cached count."""
        self._hs[frame] = start
        self._hc[frame] = count
        self._cnt[p] = count

    def _drop_pages(self, lo: int, hi: int) -> None:
        """Remove list positions ``[lo, hi)`` (their records are gone), release them, relink."""
        if hi <= lo:
            return
        gone = self._seqs[lo:hi]
        self._seqs = np.concatenate([self._seqs[:lo], self._seqs[hi:]])
        self._cnt = np.concatenate([self._cnt[:lo], self._cnt[hi:]])
        self._cum = None
        self._pm.release(self.psid, gone)
        self._relink(lo - 1, lo + 1)

    def _append_block(self, arr: np.ndarray) -> None:
        """Append ``arr`` at the tail: fill the tail page, then whole new pages (the copies,
        counts and links in one compiled pass, `append_rows`)."""
        n, S = len(arr), self._S
        if n == 0:
            return
        npg = len(self._seqs)
        m = st = c = 0
        tail = tail_seq = -1
        if npg:
            tail_seq = int(self._seqs[-1])
            tail = int(self._ps.frames[tail_seq])
            st, c = int(self._hs[tail]), int(self._cnt[-1])
            if c == 0:
                st = 0
            m = min(S - st - c, n)
        k = -(-(n - m) // S)
        self._ensure_frames(k, [npg - 1])
        new, fn = self._alloc(k, zero=False)  # `append_rows` writes (or zeroes) every byte
        counts = np.full(k, S, np.int64)
        if k:
            counts[-1] = n - m - (k - 1) * S
        if npg and (m or k):  # the tail page is written (records, or its next link)
            tail = self._pm.writable1(self.psid, tail_seq)
            if c == 0:
                self._hs[tail] = 0
        append_rows(self._pm.pool.frames, self._hc, self._hp, self._hn, tail, tail_seq,
                    st + c, m, fn, new, counts, np.uint64(int(self.psid) << 32), HEADER_BYTES,
                    self._dt.itemsize, np.ascontiguousarray(arr).view(np.uint8).reshape(-1))
        if m:
            self._cnt[-1] = c + m
        if k:
            self._seqs = np.concatenate([self._seqs, new])
            self._cnt = np.concatenate([self._cnt, counts])
        self._len += n
        self._cum = None

    def _prepend_block(self, arr: np.ndarray) -> None:
        """Insert ``arr`` (in order) before the head: fill the head page's front, then new pages."""
        n, S, R = len(arr), self._S, self._R
        if n == 0:
            return
        has = len(self._seqs) > 0
        m = st = c = 0
        if has:
            f = self._frame(0)
            st, c = int(self._hs[f]), int(self._hc[f])
            if c == 0:
                st = S
            m = min(st, n)
        k = -(-(n - m) // S)
        self._ensure_frames(k, [0])
        new, fn = self._alloc(k)
        if m:
            f = self._pm.writable1(self.psid, int(self._seqs[0]))
            R[f, st - m:st] = arr[n - m:]
            self._set(0, f, st - m, c + m)
        if k:
            rest = arr[:n - m]
            r0 = len(rest) - (k - 1) * S
            R[fn[0], S - r0:] = rest[:r0]
            if k > 1:
                R[fn[1:]] = rest[r0:].reshape(k - 1, S)
            counts = np.full(k, S, np.int64)
            counts[0] = r0
            starts = np.zeros(k, np.int64)
            starts[0] = S - r0
            self._hs[fn] = starts
            self._hc[fn] = counts
            self._seqs = np.concatenate([new, self._seqs])
            self._cnt = np.concatenate([counts, self._cnt])
            self._relink(0, k + 1)
        self._len += n
        self._cum = None

    def _delete(self, a: int, b: int, last: tuple[int, int] | None = None) -> None:
        """Delete records ``[a, b)``; release emptied pages, merge small neighbours.
        ``last``: for ``a == 0``, the list position of record ``b - 1`` and how many of
        its page's records go, when the caller knows them (no search)."""
        if b <= a:
            return
        if a == 0 and last is not None:
            p0, lo, (p1, hi) = 0, 0, last
        else:
            cum = self._cumc()
            p0 = int(np.searchsorted(cum, a, "right")) - 1
            p1 = int(np.searchsorted(cum, b - 1, "right")) - 1
            lo = a - int(cum[p0])            # records of page p0 kept before the hole
            hi = b - int(cum[p1])            # records of page p1 removed
        self._ensure_frames(0, [p0 - 2, p0 - 1, p0, p0 + 1, p1 - 1, p1, p1 + 1, p1 + 2])
        R, psid, pm = self._R, self.psid, self._pm
        c1 = int(self._cnt[p1])
        whole = len(self._seqs) == p1 - p0 + 1 and lo == 0 and hi == c1
        if whole:  # everything goes: keep the head page, empty
            f = pm.writable1(psid, int(self._seqs[0]))
            self._set(0, f, 0, 0)
            self._drop_pages(1, len(self._seqs))
            self._len = 0
            self._cum = None
            return
        if p0 == p1:
            if lo == 0 and hi == c1:
                self._drop_pages(p0, p0 + 1)
                touched = []
            else:
                f = pm.writable1(psid, int(self._seqs[p0]))
                st = int(self._hs[f])
                gap = hi - lo
                if lo == 0:
                    st += gap
                elif hi == c1:
                    pass
                elif lo < c1 - hi:  # move the prefix right over the hole
                    R[f, st + gap:st + hi] = R[f, st:st + lo].copy()
                    st += gap
                else:               # move the suffix left over the hole
                    R[f, st + lo:st + c1 - gap] = R[f, st + hi:st + c1].copy()
                self._set(p0, f, st, c1 - gap)
                touched = [p0]
        else:
            keep0, keep1 = lo > 0, hi < c1
            if keep0:
                f = pm.writable1(psid, int(self._seqs[p0]))
                self._set(p0, f, int(self._hs[f]), lo)
            if keep1:
                f = pm.writable1(psid, int(self._seqs[p1]))
                self._set(p1, f, int(self._hs[f]) + hi, c1 - hi)
            d_lo = p0 + (1 if keep0 else 0)
            d_hi = p1 + (0 if keep1 else 1)
            self._drop_pages(d_lo, d_hi)
            touched = ([d_lo - 1] if keep0 else []) + ([d_lo] if keep1 else [])
        self._len -= b - a
        self._cum = None
        for p in sorted(touched, reverse=True):
            self._maybe_merge(p)

    def _maybe_merge(self, p: int) -> None:
        """Merge the page at position ``p`` with a neighbour if their records fit one page."""
        if p >= len(self._seqs):
            return
        S, cnt = self._S, self._cnt
        c = int(cnt[p])
        if 2 * c >= S:
            return
        if p + 1 < len(cnt) and c + int(cnt[p + 1]) <= S:
            self._merge_pair(p)
        elif p > 0 and c + int(cnt[p - 1]) <= S:
            self._merge_pair(p - 1)

    def _merge_pair(self, p: int) -> None:
        """Merge the pages at positions ``p`` and ``p + 1`` into the fuller one; drop the other."""
        S, R, pm, psid = self._S, self._R, self._pm, self.psid
        cl, cr = int(self._cnt[p]), int(self._cnt[p + 1])
        fl, fr = self._frame(p), self._frame(p + 1)
        sl, sr = int(self._hs[fl]), int(self._hs[fr])
        if cl >= cr:  # keep the left page, move the right page's records into it
            f = pm.writable1(psid, int(self._seqs[p]))
            if sl + cl + cr <= S:
                R[f, sl + cl:sl + cl + cr] = R[fr, sr:sr + cr]
            else:
                both = np.concatenate([R[f, sl:sl + cl], R[fr, sr:sr + cr]])
                R[f, :cl + cr] = both
                sl = 0
            self._set(p, f, sl, cl + cr)
            self._drop_pages(p + 1, p + 2)
        else:         # keep the right page, move the left page's records into it
            f = pm.writable1(psid, int(self._seqs[p + 1]))
            if sr >= cl:
                R[f, sr - cl:sr] = R[fl, sl:sl + cl]
                sr -= cl
            else:
                both = np.concatenate([R[fl, sl:sl + cl], R[f, sr:sr + cr]])
                R[f, :cl + cr] = both
                sr = 0
            self._set(p + 1, f, sr, cl + cr)
            self._drop_pages(p, p + 1)
        self._cum = None

    def _insert1(self, i: int, arr: np.ndarray) -> None:
        """Insert one record before global index ``i`` (``0 < i < len``); split a full page."""
        S, R, pm, psid = self._S, self._R, self._pm, self.psid
        cum = self._cumc()
        p = int(np.searchsorted(cum, i, "right")) - 1
        off = i - int(cum[p])
        c = int(self._cnt[p])
        self._ensure_frames(int(c == S), [p, p + 1])
        if c == S:  # split: the upper half moves to a new page after p
            new, fn = self._alloc(1)
            f = pm.writable1(psid, int(self._seqs[p]))
            st = int(self._hs[f])
            half = S // 2
            q = int(fn[0])
            R[q, :S - half] = R[f, st + half:st + S]
            self._hs[q] = 0
            self._hc[q] = S - half
            self._seqs = np.insert(self._seqs, p + 1, new[0])
            self._cnt = np.insert(self._cnt, p + 1, S - half)
            self._set(p, f, st, half)
            self._relink(p, p + 3)
            if off > half:
                p, off = p + 1, off - half
            c = int(self._cnt[p])
        f = pm.writable1(psid, int(self._seqs[p]))
        st = int(self._hs[f])
        back, front = S - st - c, st
        if back and (not front or c - off <= off):
            R[f, st + off + 1:st + c + 1] = R[f, st + off:st + c].copy()
        else:
            R[f, st - 1:st + off - 1] = R[f, st:st + off].copy()
            st -= 1
        R[f, st + off] = arr[0]
        self._set(p, f, st, c + 1)
        self._len += 1
        self._cum = None

    # -- public API: size and reading ---------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype[Any]:
        """The record dtype."""
        return self._dt

    @property
    def page_slots(self) -> int:
        """Records per page (``S``)."""
        self._sync()
        return self._S

    def __len__(self) -> int:
        """Number of records. Runtime complexity: O(1)."""
        if self._gen != self._pm.generation:  # keeps the end-page cache (see `_fast`)
            self._sync()
        return self._len

    def __bool__(self) -> bool:
        if self._gen != self._pm.generation:
            self._sync()
        return self._len > 0

    def __repr__(self) -> str:
        try:
            n: Any = len(self)
        except Exception:  # a destroyed structure still has a repr
            n = "?"
        return f"<{type(self).__name__} {self.name!r} len={n} dtype={self._dt} S={self._S}>"

    def to_numpy(self) -> np.ndarray:
        """All records as a new 1-D array of the record dtype.

        Runtime complexity: O(n). Pages copied: 0.
        """
        self._sync()
        return self._read(0, self._len)

    def head(self, n: int) -> np.ndarray:
        """The first ``min(n, len)`` records as a new array.

        Runtime complexity: O(n + pages touched). Pages copied: 0.
        """
        self._sync()
        n = max(0, min(int(n), self._len))
        return self._read(0, n)

    def tail(self, n: int) -> np.ndarray:
        """The last ``min(n, len)`` records as a new array.

        Runtime complexity: O(n + pages touched). Pages copied: 0.
        """
        self._sync()
        n = max(0, min(int(n), self._len))
        return self._read(self._len - n, self._len)

    def take(self, indices: npt.ArrayLike) -> np.ndarray:
        """Records at integer ``indices`` (negative ones count from the end), as a new array.

        One vectorized gather: ``np.searchsorted`` on the cumulative counts
        finds each index's page. Runtime complexity: O(k log pages + pages).

        Raises
        ------
        IndexError
            If an index is out of range (nothing is read).
        TypeError
            If ``indices`` are not integers.
        """
        self._sync()
        idx = np.asarray(indices)
        if idx.size == 0:
            return np.empty(idx.shape, self._dt)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"{self._what}: indices must be integers, not {idx.dtype}")
        idx = idx.astype(np.int64)
        n = self._len
        bad = (idx < -n) | (idx >= n)
        if bad.any():
            raise IndexError(f"{self._what}: index {int(idx[bad].flat[0])} out of range for "
                             f"length {n}")
        idx = np.where(idx < 0, idx + n, idx)
        return self._gather(idx.reshape(-1)).reshape(idx.shape)

    def __getitem__(self, key: Any) -> Any:
        """``s[i]`` one record (a copy); ``s[a:b:k]`` or ``s[int_array]`` a new array.

        Runtime complexity: O(log pages) for one record, O(k + pages touched)
        for a slice. Pages copied: 0.

        Raises
        ------
        IndexError
            If an integer index is out of range.
        """
        if type(key) is int and (key == 0 or key == -1):
            return self._end(key == -1, False, False)  # the ends: O(1), no page lookup
        self._sync()
        if isinstance(key, slice):
            a, b, step = key.indices(self._len)
            if step == 1:
                return self._read(a, b)
            idx = np.arange(a, b, step, dtype=np.int64)
            if len(idx) == 0:
                return np.empty(0, self._dt)
            lo, hi = int(idx.min()), int(idx.max()) + 1
            return self._read(lo, hi)[idx - lo]
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            p, slot = self._slot(self._index(key))
            return self._R[int(self._ps.frames[self._seqs[p]]), slot].copy()
        if isinstance(key, (np.ndarray, list)):
            return self.take(key)
        raise TypeError(f"{self._what}: indices must be integers, slices or integer arrays, "
                        f"not {type(key).__name__}")

    def __iter__(self) -> Iterator[Any]:
        """Iterate over records (copies), one page slice at a time.

        Mutating the sequence during iteration gives unspecified results.
        """
        self._sync()
        R = self._R
        for seq in self._seqs.tolist():
            f = int(self._ps.frames[seq])
            st, c = int(self._hs[f]), int(self._hc[f])
            yield from R[f, st:st + c].copy()

    # -- public API: writing in place ---------------------------------------------------------------
    def __setitem__(self, key: Any, value: Any) -> None:
        """``s[i] = record``, or ``s[a:b] = records`` of the same length (no resize).

        Runtime complexity: O(log pages) for one record, O(k + pages touched)
        for a slice. Pages copied: at most the pages written (when a snapshot pins them).

        Raises
        ------
        IndexError
            If ``i`` is out of range.
        RecordTypeError
            If the value has the wrong dtype or shape (or a slice of another length).
        ValueError
            For extended slices (step other than 1).
        """
        self._sync()
        if isinstance(key, slice):
            a, b, step = key.indices(self._len)
            if step != 1:
                raise ValueError(f"{self._what}: slice assignment supports step 1 only")
            b = max(a, b)
            arr = self._records(value)
            if len(arr) != b - a:
                raise RecordTypeError(f"{self._what}: cannot assign {len(arr)} records to a "
                                      f"slice of {b - a} (slice assignment does not resize)")
            self._write(a, arr)
            return
        p, slot = self._slot(self._index(key))
        arr = self._one(value)
        f = self._pm.writable1(self.psid, int(self._seqs[p]))
        self._R[f, slot] = arr[0]

    # -- public API: growing ---------------------------------------------------------------------------
    def extend(self, records: Any) -> None:
        """Append ``records`` at the end (the primary batch API).

        ``records`` is a structured array of the schema (or one with the same
        field names), a sequence of tuples, or for scalar schemas anything numpy
        casts safely to the dtype.

        Runtime complexity: O(k + k/S). Pages copied: at most 1 (the tail page,
        if a snapshot pins it).

        Raises
        ------
        RecordTypeError
            If the records have the wrong dtype or shape (nothing is appended).
        PoolExhaustedError
            If the pool cannot hold the new pages (nothing is appended).
        """
        self._sync()
        self._append_block(self._records(records))

    def append(self, record: Any) -> None:
        """Append one record (a tuple for a structured schema, a number for a scalar one,
        or a numpy record). See `extend`.

        Runtime complexity: O(1). Pages copied: at most 1.

        Raises
        ------
        RecordTypeError
            If the record has the wrong type, shape or field values (nothing is added).
        """
        self._add(True, record)

    def _add(self, back: bool, record: Any) -> None:
        """`append` (``back``) or `appendleft` of one record: written with `struct` into
        the room at that end of the end page, else (no room, an empty sequence, another
        record type or a value `struct` refuses) by `_append_block` / `_prepend_block`,
        which validate it as `extend` does."""
        if type(record) in self._fast_types and (
                self._fgen == self._pm.generation or self._fast()):
            E = self._T if back else self._H
            f, st, c = E[0], E[1], E[2]
            if c == 0:  # the one empty page of an empty sequence: start over at its edge
                st = 0 if back else self._S
            slot = st + c if back else st - 1
            if 0 <= slot < self._S:
                if not E[3]:
                    f = self._wend(E)
                rs = self._rs
                try:
                    off = f * self._pb + HEADER_BYTES + slot * self._dt.itemsize
                    if self._scalar:
                        rs.pack_into(self._mvB, off, record)  # type: ignore[union-attr]
                    else:
                        rs.pack_into(self._mvB, off, *record)  # type: ignore[union-attr]
                except (struct.error, OverflowError, TypeError):
                    pass  # numpy decides (it casts what `struct` refuses, or raises)
                else:  # the slot was outside the records: a failed pack left no trace
                    w = f * self._pw
                    if not back or c == 0:
                        st = slot if not back else st
                        E[1] = st
                        self._mvI[w + START_WORD] = st
                    E[2] = c + 1
                    self._mvI[w + COUNT_WORD] = c + 1
                    self._cmv[self._np - 1 if back else 0] = c + 1
                    self._len += 1
                    self._cum = None
                    return
        self._sync()
        if back:
            self._append_block(self._one(record))
        else:
            self._prepend_block(self._one(record))

    def extendleft(self, records: Any) -> None:
        """Add ``records`` at the front, as `collections.deque.extendleft` does.

        Like ``deque.extendleft``, the records end up in *reverse* order at the
        front (each is added to the left in turn); ``s.extendleft(a[::-1])``
        prepends ``a`` as a block. Accepted types: see `extend`.

        Runtime complexity: O(k + k/S). Pages copied: at most 1.

        Raises
        ------
        RecordTypeError
            If the records have the wrong dtype or shape (nothing is added).
        PoolExhaustedError
            If the pool cannot hold the new pages (nothing is added).
        """
        self._sync()
        self._prepend_block(self._records(records)[::-1])

    def appendleft(self, record: Any) -> None:
        """Add one record at the front. Runtime complexity: O(1). Pages copied: at most 1."""
        self._add(False, record)

    def insert(self, i: int, record: Any) -> None:
        """Insert one record before index ``i`` (clamped like `list.insert`).

        A full page is split in two first.
        Runtime complexity: O(S + log pages) (+ O(pages) for a split).
        Pages copied: at most 2.

        Raises
        ------
        RecordTypeError
            If the record has the wrong dtype or shape.
        TypeError
            If ``i`` is not an integer.
        """
        self._sync()
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"{self._what}: insert index must be an integer, "
                            f"not {type(i).__name__}")
        arr = self._one(record)
        n = self._len
        j = int(i) + n if i < 0 else int(i)
        j = min(max(j, 0), n)
        if j == n:
            self._append_block(arr)
        elif j == 0:
            self._prepend_block(arr)
        else:
            self._insert1(j, arr)

    # -- public API: shrinking ------------------------------------------------------------------------
    def pop(self, n: int | None = None) -> Any:
        """Remove and return the last record, or with ``n`` the last ``n`` records.

        ``pop()`` returns one record (a numpy scalar or ``np.void`` copy);
        ``pop(n)`` returns an array of the last ``n`` records *in sequence order*
        (``s[-n:]``), so ``s.extend(s.pop(n))`` is a no-op.

        Runtime complexity: O(n + n/S). Pages copied: at most 3 (the end page, and
        when pages are released or merged, a neighbour and its link partner).

        Raises
        ------
        IndexError
            If the sequence has fewer than ``n`` records (or is empty for ``pop()``).
        ValueError
            If ``n < 0``.
        """
        if n is None:
            return self._end(True, True, False)
        self._sync()
        n = self._count_arg(n, "pop")
        out = self._read(self._len - n, self._len)
        self._delete(self._len - n, self._len)
        return out

    def popleft(self, n: int | None = None) -> Any:
        """Remove and return the first record, or with ``n`` the first ``n`` records (in order).

        Runtime complexity: O(n + n/S + pages). Pages copied: at most 3 (as `pop`).

        Raises
        ------
        IndexError
            If the sequence has fewer than ``n`` records (or is empty).
        ValueError
            If ``n < 0``.
        """
        if n is None:
            return self._end(False, True, False)
        self._sync()
        n = self._count_arg(n, "popleft")
        out = self._read(0, n)
        self._delete(0, n)
        return out

    def pop_item(self) -> Any:
        """Remove and return the last record as a plain Python value: a tuple of Python
        numbers for a structured schema (as ``np.void.item()``), a number for a scalar one.

        The per-record form of `pop`: no numpy object is created.
        Runtime complexity: O(1). Pages copied: as `pop`.

        Raises
        ------
        IndexError
            If the sequence is empty.
        """
        return self._end(True, True, True)

    def popleft_item(self) -> Any:
        """Remove and return the first record as a plain Python value (see `pop_item`).

        Runtime complexity: O(1). Pages copied: as `popleft`.

        Raises
        ------
        IndexError
            If the sequence is empty.
        """
        return self._end(False, True, True)

    def item(self, i: int) -> Any:
        """Record ``i`` as a plain Python value (see `pop_item`); ``s.item(0)`` and
        ``s.item(-1)`` are the per-record peeks at the ends.

        Runtime complexity: O(1) at the ends, else O(log pages). Pages copied: 0.

        Raises
        ------
        IndexError
            If ``i`` is out of range.
        """
        if type(i) is int and (i == 0 or i == -1):
            return self._end(i == -1, False, True)
        return self[i].item()

    def evict(self, n: int) -> int:
        """Drop up to ``n`` records from the front without returning them; return how many.

        Runtime complexity: O(pages touched). Pages copied: at most 3 (as `pop`).

        Raises
        ------
        ValueError
            If ``n < 0``.
        """
        self._sync()
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"{self._what}: evict count must be an integer, "
                            f"not {type(n).__name__}")
        if n < 0:
            raise ValueError(f"{self._what}: evict({int(n)}): count must be >= 0")
        n = min(int(n), self._len)
        self._delete(0, n)
        return n

    def evict_before(self, bound: Any, field: str | None = None) -> int:
        """Drop every record at the front whose ``field`` is ``< bound``; return how many.

        The window-buffer eviction: the sequence must be nondecreasing in
        ``field`` (for scalar schemas, in the values themselves; ``field`` is then
        ``None``). The last record of every page is gathered in one step and
        searched with ``np.searchsorted``, then the boundary page is searched.

        Runtime complexity: O(pages) gather + O(log S). Pages copied: at most 3 (as `pop`).

        Raises
        ------
        RecordTypeError
            If ``field`` is not a field of the schema, or missing for a
            structured schema, or given for a scalar one.
        """
        self._sync()
        n, page, k = self._count_before(bound, field, "evict_before")
        if n:  # the last record evicted: the whole page before `page`, or k of `page`
            self._delete(0, n, (page, k) if k else (page - 1, int(self._cnt[page - 1])))
        return n

    def popleft_before(self, bound: Any, field: str | None = None) -> list[Any]:
        """Remove and return the records at the front whose ``field`` is ``< bound``, as a
        list of plain Python values (see `pop_item`): the per-record window eviction.

        `evict_before` that returns what it evicts, for a per-record operator that must
        also drop the evicted records from an index. Typically it returns zero or one
        record, without creating a numpy object (schemas with a `struct` twin, a Python
        int bound, or int/float for a float field).

        Runtime complexity: O(records returned), else as `evict_before`. Pages copied:
        as `evict_before`.

        Raises
        ------
        RecordTypeError
            As `evict_before`.
        """
        fg = self._fget.get(field) if self._S else None
        if (fg is not None and type(bound) in fg[2]
                and (self._fgen == self._pm.generation or self._fast())):
            H = self._H
            c = H[2]
            f, st = H[0], H[1]
            isz = self._dt.itemsize
            a = f * self._pb + HEADER_BYTES + st * isz
            get, mv, n = fg[0], self._mvB, 0
            off = a + fg[1]
            while n < c and get(mv, off)[0] < bound:
                n += 1
                off += isz
            if n == 0:
                return []
            rest = c - n
            S = self._S
            if rest and (self._np == 1 or 2 * rest >= S or rest + (
                    self._T[2] if self._np == 2 else self._nb[0]) > S):
                out = list(self._rs.iter_unpack(mv[a:a + n * isz]))  # type: ignore[union-attr]
                if not H[3]:
                    f = self._wend(H)
                w = f * self._pw
                H[1] = st + n
                H[2] = rest
                self._mvI[w + START_WORD] = st + n
                self._mvI[w + COUNT_WORD] = rest
                self._cmv[0] = rest
                self._len -= n
                self._cum = None
                return [r[0] for r in out] if self._scalar else out
        self._sync()
        n = self._count_before(bound, field, "popleft_before")[0]
        recs = self._read(0, n)
        self._delete(0, n)
        return recs.tolist()  # type: ignore[no-any-return]

    def _count_before(self, bound: Any, field: str | None, op: str) -> tuple[int, int, int]:
        """How many records at the front have ``field < bound`` (see `evict_before`), and
        where the first one kept is: ``(n, list position, index in its page)``."""
        prep = self._cbprep.get(field)
        if prep is None:
            prep = self._count_prep(field, op)
        colk, fdt, kv, mode, imin, imax = prep
        if not self._len:
            return 0, 0, 0
        # the bound in the field's dtype; "< bound" becomes "<= q" when the cast rounded down
        if type(bound) is int and imax is not None and kv.kind != "V":  # the common case
            if bound > imax:
                return self._len, len(self._seqs), 0
            if bound <= imin:
                return 0, 0, 0
            q, right = np.array((bound,), kv), False
        else:
            bnd = np.asarray(bound)
            if imax is not None and bnd.dtype.kind in "iuf" and bnd.ndim == 0:
                if bnd > imax:
                    return self._len, len(self._seqs), 0
                if bnd <= imin:
                    return 0, 0, 0
            qf = bnd.astype(fdt).reshape(1)
            right = bool(qf[0] < bnd)
            q = qf.view(np.uint8).reshape(1, fdt.itemsize) if kv.kind == "V" else qf.view(kv)
        total, page, k = count_before(colk, self._ps.frames, self._seqs, self._hs, self._cnt, q,
                                      right, mode)
        return int(total), int(page), int(k)

    def _count_prep(self, field: str | None, op: str) -> tuple[Any, ...]:
        """What `_count_before` needs of ``field``, checked, and kept for the next call:
        ``(column in kernel form, field dtype, key dtype, compare mode, integer bounds)``."""
        if self._dt.fields is not None:
            if field is None or field not in self._dt.fields:
                raise RecordTypeError(f"{self._what}: {op} needs one of the fields "
                                      f"{self._dt.names}, not {field!r}")
            col = self._R[field]
        else:
            if field is not None:
                raise RecordTypeError(f"{self._what}: scalar records have no field {field!r}")
            col = self._R
        if col.ndim != 2:
            raise RecordTypeError(f"{self._what}: field {field!r} is not a scalar field")
        fdt = col.dtype
        imin = imax = None
        if fdt.kind in "iu":
            info = np.iinfo(fdt)
            imin, imax = int(info.min), int(info.max)
        native = fdt.byteorder in "=|" or (fdt.byteorder == "<") == np.little_endian
        if fdt.kind in "biufMm" and native:
            kv = np.dtype("<i8") if fdt.kind in "Mm" else np.dtype(np.uint8) \
                if fdt.kind == "b" else fdt
            prep = (col.view(kv), fdt, kv, 0, imin, imax)
        else:  # byte strings and non-native byte orders: byte rows (mmm._kernels.ordered)
            w = fdt.itemsize
            off = HEADER_BYTES + (self._dt.fields[field][1] if self._dt.fields and field else 0)
            fb = self._pm.pool.frames
            colk = np.lib.stride_tricks.as_strided(fb[:, off:], (fb.shape[0], self._S, w),
                                                   (fb.strides[0], self._dt.itemsize, 1))
            mode = 0 if fdt.kind in "Su" else 2 if fdt.kind == "f" else 1
            prep = (colk, fdt, np.dtype(f"V{w}"), mode, imin, imax)
        self._cbprep[field] = prep
        return prep

    def __delitem__(self, key: Any) -> None:
        """``del s[i]`` or ``del s[a:b]`` (step 1); emptied pages are released and small
        neighbours merged.

        Runtime complexity: O(S + pages). Pages copied: at most 6 (the two boundary
        pages, a merge partner of each, and the pages whose links the merges change).

        Raises
        ------
        IndexError
            If ``i`` is out of range.
        ValueError
            For extended slices.
        """
        self._sync()
        if isinstance(key, slice):
            a, b, step = key.indices(self._len)
            if step != 1:
                raise ValueError(f"{self._what}: slice deletion supports step 1 only")
            self._delete(a, max(a, b))
            return
        j = self._index(key)
        self._delete(j, j + 1)

    def clear(self) -> None:
        """Remove every record; all pages but one are released.

        Runtime complexity: O(pages). Pages copied: at most 1 (the page kept).
        """
        self._sync()
        self._delete(0, self._len)

    # -- invariants ----------------------------------------------------------------------------------
    def _check(self) -> None:
        """Assert every invariant of the module docstring and of the page manager (O(n))."""
        self._pm._check()
        self._sync()
        ps, S = self._ps, self._S
        seqs = self._seqs
        assert ps.n_pages == 1 + len(seqs), (ps.n_pages, len(seqs))
        assert set(ps.seqs().tolist()) == {0, *seqs.tolist()}, "page set vs cached order"
        assert len(np.unique(seqs)) == len(seqs)
        h = self._pm.pool.headers
        assert h["kind"][ps.frames[0]] == Layout.SUPER
        assert self._pm.read_meta(self.psid)["params"]["page_slots"] == S
        frames = ps.frames[seqs]
        assert np.all(self._hk[frames] == Layout.SEQUENCE), "page kinds"
        pids = self._pid(seqs)
        assert np.array_equal(self._hid[frames], pids), "page ids"
        if len(seqs):
            want_prev = np.r_[_NIL, pids[:-1]].astype(np.uint64)
            want_next = np.r_[pids[1:], _NIL].astype(np.uint64)
            assert np.array_equal(self._hp[frames], want_prev), "prev links"
            assert np.array_equal(self._hn[frames], want_next), "next links"
        cnt = self._hc[frames].astype(np.int64)
        st = self._hs[frames].astype(np.int64)
        assert np.all(st + cnt <= S), "start + count > page_slots"
        assert np.array_equal(cnt, self._cnt), "cached counts"
        assert int(cnt.sum()) == self._len, "counts do not sum to len"
        if len(seqs) > 1:
            assert np.all(cnt > 0), "empty page in a multi-page sequence"
        if self._cum is not None:
            assert np.array_equal(self._cum, np.r_[0, np.cumsum(cnt)]), "cumulative counts"


class PagedList(_PagedSequence):
    """A list of fixed-schema records in doubly linked pages (paper Table 3: List).

    Batch operations on numpy arrays are the primary API (`extend`, `pop`,
    slicing, `take`, slice assignment and deletion); per-record operations
    (``s[i]``, ``s[i] = r``, ``del s[i]``, `insert`, `append`, iteration) are
    conveniences. Both ends are O(1) per record, so the deque operations
    (`extendleft`, `popleft`, `evict`, ...) work here too. See the module
    docstring for the page layout and invariants.

    Examples
    --------
    >>> import numpy as np, mmm
    >>> from mmm.structures.sequence import PagedList
    >>> pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    >>> xs = PagedList.create(pm, "xs", "<i8", page_slots=4)
    >>> xs.extend(np.arange(10))
    >>> xs.insert(2, 99)
    >>> del xs[0]
    >>> xs[:5]
    array([ 1, 99,  2,  3,  4])
    >>> snap = pm.chkpt()
    >>> xs.clear()
    >>> pm.rollback(snap)
    >>> len(xs)
    10
    """

    KIND: ClassVar[str] = "list"


class PagedDeque(_PagedSequence):
    """A double-ended queue of fixed-schema records in linked pages: the window buffer.

    Same operations as `PagedList`; the typical use is `extend` at the back
    and `evict_before` (a timestamp bound) or `evict`/`popleft` (a count) at
    the front. A deque and a list are distinct kinds: one cannot be reopened
    as the other.

    Examples
    --------
    >>> import numpy as np, mmm
    >>> from mmm.structures.sequence import PagedDeque
    >>> pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    >>> win = PagedDeque.create(pm, "win", [("ts", "<i8"), ("key", "<u4")])
    >>> win.extend(np.array([(1, 7), (2, 8), (5, 7)], dtype=win.dtype))
    >>> win.evict_before(3, "ts")
    2
    >>> win.to_numpy()["key"]
    array([7], dtype=uint32)
    """

    KIND: ClassVar[str] = "deque"
