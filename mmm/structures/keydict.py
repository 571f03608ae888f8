"""KeyDict: exact variable-length byte keys <-> dense int64 ids, in pages.

State operators key their maps on int64; a `KeyDict` gives every distinct
byte string (a utf8 string, a binary value, an encoded composite key) an id
of its own, so string keys reuse the integer path. Keys are never hashed into
a smaller space: two different byte strings never share an id; equal 64-bit
hashes are told apart by comparing bytes.

Layout
------
One page set; every page after the super page has a *role* (header ``flags``)
and an ordinal within its role (header ``aux0``):

control   one page: counters (ids allocated, live keys, free-id list head,
          chunk bump pointer, free-chunk list head, the null key's id, index
          slots used and deleted, index generation, size and slot bytes)
record    ``id -> record`` (fixed 32 bytes, ``id // per_page`` is the ordinal):
          the key's 64-bit hash, its length, and its bytes inline when at most
          20 bytes long, else the first of a chain of chunks
chunk     64-byte chunks (56 key bytes and the next chunk) for longer keys; a
          key of any length spans as many chunks (and pages) as it needs
index     an open-addressing table (linear probing) of 8-byte slots (the id and
          32 bits of the key's hash) over all the index pages of the current
          generation (``aux1``), at most 70% used (deleted slots count); it is
          rebuilt into new pages, twice as large, when a new key would pass that

Format 2 (today's) has 8-byte index slots; format 1 had 32-byte ones (the full
hash, the id and a key of up to 15 bytes). Records and chunks are the same in
both, and the index is redundant with the records: a dictionary restored from a
format-1 checkpoint rebuilds its index in format 2 on its first intern, lookup or
remove (the control page's slot-bytes word, 0 in format 1, tells them apart).

Ids are dense: a new key takes the most recently removed id, else the next
one; within a batch, new keys get ids in order of first appearance, so a
replay of the same calls from the same state gives the same ids. The null key
(``valid[i] == False``) is one key with an id of its own, like Spark's
``groupBy`` null group. Removed keys' records and chunks go to free lists
that later keys reuse; the record and chunk pages at the end that hold no key
any more go back to the pool (the high mark and the chunk bump pointer come
down, the free lists lose what was past them), and the index is rebuilt
smaller once most of it is deleted slots.

Why this design: finding an existing key costs a hash over its bytes, one
index slot and its record: 32 hash bits in the slot mean a different key
almost never costs a record read, and the record holds the full hash, the
length and a key of up to 20 bytes; a longer key also reads its chunks. Rows
are hashed and their slots, then the records their slots name, then a long
key's first chunk prefetched 32 at a time, so the misses overlap. An id is an
array position, so ``keys(ids)`` is a gather. Fixed-size records and chunks
need no compaction: space is reused through free lists, deterministically,
and ids never move (they are the keys of the state); only pages at the end
that hold no key go back (a key left near the end keeps its page).
Cost in memory: 32 bytes of record per key, 8-byte index slots at 35-70% load
(11-23 bytes per key; 32-byte slots, 46-91 bytes, in format 1), and 64 bytes
per started 56 bytes of a key longer than 20 bytes. At most 2**32 - 2 ids.

Every operation is a compiled kernel pass (`mmm._kernels.keydict`) over the
batch, in input order. A kernel never writes a page a snapshot pins and never
allocates: it stops before a row that needs a page cloned, a new record or
chunk page, or a larger index; the Python side does that and the kernel goes
on from that row. Failed calls change nothing: bad input is refused before
any write, and a batch that may need more frames than the pool has free runs
under an internal snapshot, rolled back on `PoolExhaustedError`.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from mmm._kernels import keydict as K
from mmm.errors import IdNotFoundError, KeyFormatError, RecordTypeError
from mmm.manager import PageManager
from mmm.namespace import Namespace
from mmm.page import HEADER_BYTES, Layout
from mmm.structures.base import Structure

__all__ = ["KeyDict"]

R_CONTROL, R_RECORD, R_CHUNK, R_INDEX = 1, 2, 3, 4
_FULL_MASK = (1 << 64) - 1
_MAX_KEY = (1 << 32) - 3


class KeyDict(Structure):
    """Exact variable-length byte keys <-> dense int64 ids, stored in pages.

    Create with `KeyDict.create`. Keys come in Arrow's string/binary layout:
    a uint8 ``data`` buffer, ``offsets`` (int32 or int64, ``n + 1`` entries,
    not necessarily starting at 0) and an optional ``valid`` mask (False: the
    null key).

    Examples
    --------
    >>> import numpy as np, mmm
    >>> pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    >>> kd = mmm.KeyDict.create(pm, "users")
    >>> data = np.frombuffer(b"alicebobalice", np.uint8)
    >>> kd.intern(data, np.array([0, 5, 8, 13], np.int32)).tolist()
    [0, 1, 0]
    >>> kd.lookup(np.frombuffer(b"bobeve", np.uint8), np.array([0, 3, 6])).tolist()
    [1, -1]
    >>> d, o, v = kd.keys(np.array([1, 0]))
    >>> [bytes(d[o[i]:o[i + 1]]) for i in range(2)]
    [b'bob', b'alice']
    """

    KIND = "key_dict"
    MAX_LOAD = 0.7
    FORMAT = 2  # the index layout of new dictionaries (module docstring)

    @classmethod
    def create(cls, pm: PageManager | Namespace, name: str, *, _hash_mask: int | None = None) -> "KeyDict":
        """Create the dictionary ``name`` or reopen it (after a restart, load or rollback).

        ``_hash_mask`` is a test hook: the hash is ANDed with it (0 makes every key
        collide); it is stored with the dictionary and applies when reopened.

        Raises
        ------
        SchemaMismatchError
            ``name`` exists as another kind of structure.
        """
        schema = {"key": "bytes", "id": "<i8"}
        obj = cls._existing(pm, name, schema)
        if obj is not None:
            return obj  # type: ignore[no-any-return]
        mask = _FULL_MASK if _hash_mask is None else int(_hash_mask) & _FULL_MASK
        return cls(pm, name, schema, mask)

    def __init__(self, pm: PageManager | Namespace, name: str, schema: dict[str, str], mask: int) -> None:
        self._ctl_seq = -1
        super().__init__(pm, name, schema, {"hash_mask": str(mask), "format": self.FORMAT})
        self._mask = int(self._params["hash_mask"])
        if self._ctl_seq < 0:  # new: the control page and a one-page index
            self._gen = -1
            ctl = int(pm.allocate(self.psid, 1, Layout.RAW)[0])
            idx = int(pm.allocate(self.psid, 1, Layout.RAW)[0])
            h = pm.pool.headers
            fc, fi = int(self._ps.frames[ctl]), int(self._ps.frames[idx])
            h["flags"][fc] = R_CONTROL
            h["flags"][fi] = R_INDEX
            h["aux0"][fi] = 0
            h["aux1"][fi] = 0
            c = self._ctl_view(fc)
            c[K.C_IPAGES] = 1
            c[K.C_SLOTB] = K.SLOT
            self._sync()

    # -- page bookkeeping ---------------------------------------------------------------------
    def _ctl_view(self, frame: int) -> npt.NDArray[np.int64]:
        v: npt.NDArray[np.int64] = self._pm.pool.frames[
            frame, HEADER_BYTES:HEADER_BYTES + 8 * K.N_CTL].view(np.int64)
        return v

    def _ctl(self) -> npt.NDArray[np.int64]:
        """The control counters (read them; writes go through the kernels or `_ctl_w`)."""
        return self._ctl_view(int(self._ps.frames[self._ctl_seq]))

    def _ctl_w(self) -> npt.NDArray[np.int64]:
        """The control counters, writable (the page un-shared first)."""
        return self._ctl_view(self._pm.writable1(self.psid, self._ctl_seq))

    def _rebuild(self) -> None:
        ps = self._ps
        seqs = ps.seqs()
        seqs = seqs[seqs != 0]
        h = self._pm.pool.headers
        fr = ps.frames[seqs]
        role = h["flags"][fr].astype(np.int64)
        ordn = h["aux0"][fr].astype(np.int64)
        ctl = seqs[role == R_CONTROL]
        self._ctl_seq = int(ctl[0]) if len(ctl) else -1
        self._pb = self._pm.page_bytes
        self._flat = self._pm.pool.frames.reshape(-1)
        room = self._pb - HEADER_BYTES
        self._rpp = room // K.REC
        self._cpp = room // K.CHUNK
        self._spp = room // K.SLOT

        def by_ordinal(sel: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
            out = np.full(len(np.flatnonzero(sel)), -1, np.int64)
            o = ordn[sel]
            out[o] = seqs[sel]
            assert np.all(out >= 0), f"key dict {self.name!r}: a gap in its page ordinals"
            return out

        self._rseqs = by_ordinal(role == R_RECORD)
        self._cseqs = by_ordinal(role == R_CHUNK)
        if self._ctl_seq < 0:
            self._iseqs = self._stale_index = np.zeros(0, np.int64)
            return
        gen = int(self._ctl()[K.C_IGEN])
        self._iseqs = by_ordinal((role == R_INDEX) & (h["aux1"][fr].astype(np.int64) == gen))
        self._stale_index = seqs[(role == R_INDEX) & (h["aux1"][fr].astype(np.int64) != gen)]

    def _geo(self) -> npt.NDArray[np.int64]:
        cap = len(self._iseqs) * self._spp
        m = self._mask
        return np.array([self._pb, self._rpp, self._cpp, self._spp, cap,
                         m - (1 << 64) if m >= 1 << 63 else m, self._pm.epoch, self._ctl_seq,
                         int(cap * self.MAX_LOAD), len(self._rseqs), len(self._cseqs),
                         K.magic(self._rpp), K.magic(self._cpp), K.magic(self._spp)], np.int64)

    def _add_pages(self, role: int, n: int) -> None:
        pm = self._pm
        seqs = pm.allocate(self.psid, n, Layout.RAW)  # may raise: nothing changed
        h = pm.pool.headers
        fr = self._ps.frames[seqs]
        h["flags"][fr] = role
        if role == R_RECORD:
            h["aux0"][fr] = np.arange(len(self._rseqs), len(self._rseqs) + n)
            self._rseqs = np.concatenate([self._rseqs, seqs])
        else:
            h["aux0"][fr] = np.arange(len(self._cseqs), len(self._cseqs) + n)
            self._cseqs = np.concatenate([self._cseqs, seqs])

    def _upgrade(self) -> None:
        """Rebuild a format-1 index (32-byte slots) into today's (the records and chunks
        are the same in both formats); a no-op on a format-2 dictionary."""
        if int(self._ctl()[K.C_SLOTB]) != K.SLOT:
            self._reindex(int(self._ctl()[K.C_LIVE]))

    def _reindex(self, want: int) -> None:
        """Rebuild the index into new pages sized for ``want`` keys at ``MAX_LOAD / 2``."""
        pm = self._pm
        c = self._ctl()
        n_pages = max(1, math.ceil(2 * want / (self._spp * self.MAX_LOAD)))
        gen = int(c[K.C_IGEN]) + 1
        new = pm.allocate(self.psid, n_pages, Layout.RAW)  # fresh, zeroed: an empty table
        try:
            cw = self._ctl_w()
        except BaseException:
            pm.release(self.psid, new)
            raise
        h = pm.pool.headers
        fr = self._ps.frames[new]
        h["flags"][fr] = R_INDEX
        h["aux0"][fr] = np.arange(n_pages)
        h["aux1"][fr] = gen
        used = K.rebuild_index(self._flat, self._ps.frames, self._rseqs, new,
                               int(c[K.C_HIGH]), self._geo())
        old = np.concatenate([self._iseqs, self._stale_index])
        cw[K.C_IGEN] = gen
        cw[K.C_IPAGES] = n_pages
        cw[K.C_SLOTB] = K.SLOT
        cw[K.C_USED] = used
        cw[K.C_TOMBS] = 0
        self._iseqs = new
        self._stale_index = np.zeros(0, np.int64)
        if len(old):
            pm.release(self.psid, old)

    # -- input ---------------------------------------------------------------------------------
    def _input(self, data: Any, offsets: Any, valid: Any, what: str
               ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[Any], npt.NDArray[np.bool_], bool,
                          int, int]:
        """Validated ``(data, offsets, valid, has_valid, n, longest key)``.

        Raises
        ------
        RecordTypeError
            An argument of the wrong type, dtype, shape or length (named).
        KeyFormatError
            Offsets that decrease or point outside ``data``.
        """
        where = f"key dict {self.name!r}: {what}"
        if isinstance(data, np.ndarray):
            if data.dtype != np.uint8 or data.ndim != 1:
                raise RecordTypeError(f"{where}: data must be a 1-D uint8 array, got "
                                      f"{data.ndim}-D {data.dtype}")
            data = np.ascontiguousarray(data)
        else:
            try:
                data = np.frombuffer(memoryview(data).cast("B"), np.uint8)
            except (TypeError, ValueError) as exc:
                raise RecordTypeError(f"{where}: data must be a 1-D uint8 array or a bytes-like "
                                      f"buffer, got {type(data).__name__} ({exc})") from None
        if not isinstance(offsets, np.ndarray) or offsets.ndim != 1 or \
                offsets.dtype not in (np.dtype("<i4"), np.dtype("<i8")) or len(offsets) < 1:
            desc = (f"{offsets.ndim}-D {offsets.dtype} of length {len(offsets)}"
                    if isinstance(offsets, np.ndarray) and offsets.ndim else
                    type(offsets).__name__)
            raise RecordTypeError(f"{where}: offsets must be a 1-D int32 or int64 array of n + 1 "
                                  f"entries, got {desc}")
        offsets = np.ascontiguousarray(offsets)
        n = len(offsets) - 1
        if valid is None:
            vmask = np.zeros(0, np.bool_)
        else:
            if not isinstance(valid, np.ndarray) or valid.dtype != np.bool_ or valid.ndim != 1:
                raise RecordTypeError(f"{where}: valid must be None or a 1-D bool array, got "
                                      f"{type(valid).__name__}"
                                      f"{' of ' + str(valid.dtype) if isinstance(valid, np.ndarray) else ''}")
            if len(valid) != n:
                raise RecordTypeError(f"{where}: valid has {len(valid)} entries, offsets "
                                      f"describe {n} keys")
            vmask = np.ascontiguousarray(valid)
        if n == 0:
            return data, offsets, vmask, valid is not None, 0, 0
        res = np.zeros(1, np.int64)
        bad = int(K.scan_offsets(offsets, len(data), res))
        if bad == -2:
            raise KeyFormatError(f"{where}: offsets span [{int(offsets[0])}, {int(offsets[-1])}], "
                                 f"outside the {len(data)} bytes of data")
        if bad >= 0:
            raise KeyFormatError(f"{where}: offsets decrease at index {bad} "
                                 f"({int(offsets[bad])} -> {int(offsets[bad + 1])})")
        longest = int(res[0])
        if longest > _MAX_KEY:
            raise KeyFormatError(f"{where}: a key of {longest} bytes is longer than the "
                                 f"{_MAX_KEY} a key dict holds")
        return data, offsets, vmask, valid is not None, n, longest

    def _ids(self, ids: Any, what: str) -> npt.NDArray[np.int64]:
        where = f"key dict {self.name!r}: {what}"
        arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
        if arr.ndim != 1 or not (arr.dtype.kind in "iu" or (arr.size == 0 and arr.dtype.kind == "f")):
            raise RecordTypeError(f"{where}: ids must be a 1-D integer array, got "
                                  f"{arr.ndim}-D {arr.dtype}")
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise IdNotFoundError(f"{where}: id {int(arr.max())} does not exist")
        return np.ascontiguousarray(arr, dtype=np.int64)

    def _lengths(self, ids: npt.NDArray[np.int64], what: str) -> npt.NDArray[np.int64]:
        lens = np.empty(len(ids), np.int64)
        bad = K.key_lengths(ids, self._flat, self._ps.frames, self._rseqs,
                            self._geo(), int(self._ctl()[K.C_HIGH]), lens)
        if bad >= 0:
            raise IdNotFoundError(f"key dict {self.name!r}: {what}: id {int(ids[bad])} (at "
                                  f"index {bad}) is not in the dictionary")
        return lens

    # -- guarded mutation ---------------------------------------------------------------------
    def _need_frames(self, n_new: int, chunks: int) -> int:
        """Frames a call that may add ``n_new`` keys using ``chunks`` chunks may allocate."""
        ps = self._ps
        pinned = 0
        if self._pm._active:
            seqs = ps.seqs()
            pinned = int(np.count_nonzero(self._pm.pool.pins[ps.frames[seqs]] > 0))
        live = int(self._ctl()[K.C_LIVE])
        index = 2 * math.ceil(2 * (live + n_new) / (self._spp * self.MAX_LOAD)) + 2
        return (pinned + math.ceil(n_new / self._rpp) + 1 + math.ceil(chunks / self._cpp) + 1
                + index)

    def _guarded(self, fn: Any, need: int) -> Any:
        """Run a mutation so that a `PoolExhaustedError` leaves the dictionary as before."""
        pm = self._pm
        if pm.pool.free_frames >= need:
            return fn()
        snap = pm.chkpt(psids=[self.psid])
        try:
            out = fn()
        except BaseException:
            pm.rollback(snap)
            self._sync()
            raise
        snap.release()
        return out

    # -- batch API --------------------------------------------------------------------------------
    def intern(self, data: Any, offsets: npt.NDArray[Any],
               valid: npt.NDArray[np.bool_] | None = None) -> npt.NDArray[np.int64]:
        """The id of each key, giving new keys new ids (in order of first appearance).

        Parameters
        ----------
        data : uint8 array (or a bytes-like buffer)
            The keys' bytes, concatenated.
        offsets : int32 or int64 array of ``n + 1`` entries
            Key ``i`` is ``data[offsets[i]:offsets[i + 1]]`` (Arrow layout; ``offsets[0]``
            may be non-zero).
        valid : bool array of ``n`` entries, optional
            False marks the null key (one id of its own; its bytes are ignored).

        Returns
        -------
        int64 array of ``n`` ids.

        Runtime complexity: O(total key bytes) expected. Pages copied: at most the
        pages written, once per snapshot.

        Raises
        ------
        RecordTypeError, KeyFormatError
            Bad input (the argument named); nothing changed.
        PoolExhaustedError
            The pool ran out of frames; nothing changed.
        """
        self._sync()
        data, offs, vmask, has_valid, n, longest = self._input(data, offsets, valid, "intern")
        out = np.empty(n, np.int64)
        if n == 0:
            return out
        chunks = math.ceil(int(offs[-1] - offs[0]) / K.CDATA) + n if longest > K.INLINE else 0
        high = int(self._ctl()[K.C_HIGH])
        if high + n > K.MAX_IDS and high - len(self) + n > K.MAX_IDS:
            raise KeyFormatError(f"key dict {self.name!r}: intern: {n} keys could take ids past "
                                 f"the {K.MAX_IDS} a key dict holds")

        def run() -> None:
            self._upgrade()
            self._run(K.MODE_INTERN, data, offs, vmask, has_valid, longest, out)
        self._guarded(run, self._need_frames(n, chunks))
        return out

    def lookup(self, data: Any, offsets: npt.NDArray[Any],
               valid: npt.NDArray[np.bool_] | None = None) -> npt.NDArray[np.int64]:
        """The id of each key, -1 where absent; changes nothing (arguments as `intern`), but
        for the first call on a dictionary restored from format 1, which rebuilds its index
        in today's format.

        Raises
        ------
        RecordTypeError, KeyFormatError
            Bad input (the argument named).
        PoolExhaustedError
            Rebuilding a format-1 index found too few frames; nothing changed.
        """
        self._sync()
        data, offs, vmask, has_valid, n, longest = self._input(data, offsets, valid, "lookup")
        out = np.empty(n, np.int64)
        if n:
            self._guarded(self._upgrade, self._need_frames(0, 0))
            self._run(K.MODE_LOOKUP, data, offs, vmask, has_valid, longest, out)
        return out

    def _run(self, mode: int, data: npt.NDArray[np.uint8], offs: npt.NDArray[Any],
             vmask: npt.NDArray[np.bool_], has_valid: bool, longest: int,
             out: npt.NDArray[np.int64]) -> None:
        pm = self._pm
        n = len(out)
        scratch = np.empty(K.SCRATCH + max(1, -(-longest // K.CDATA)), np.int64)
        state = np.zeros(2, np.int64)
        flat = self._flat
        i = 0
        n_before = int(self._ctl()[K.C_LIVE])
        db = data.ctypes.data  # `data` stays referenced here while the kernel reads it
        while True:
            code = K.intern_rows(mode, i, db, len(data), offs, vmask, has_valid, flat,
                                 self._ps.frames,
                                 self._ps.mod, pm.pool.pins, self._rseqs, self._cseqs,
                                 self._iseqs, self._geo(), out, scratch, state)
            i = int(state[0])
            if code == K.DONE:
                return
            assert mode == K.MODE_INTERN, "a lookup asked to write"
            if code == K.NEED_CLONE:
                pm.writable1(self.psid, int(state[1]))
            elif code == K.NEED_PAGE_REC:
                self._add_pages(R_RECORD, 1)
            elif code == K.NEED_PAGE_CHUNK:
                self._add_pages(R_CHUNK, -(-int(state[1]) // self._cpp))
            else:  # NEED_GROW: room for the new keys the rest of the batch may bring
                c = self._ctl()
                live = int(c[K.C_LIVE])
                rate = (live - n_before + 1) / (i + 1)
                self._reindex(live + int(rate * (n - i)))  # at least doubles

    def keys(self, ids: npt.ArrayLike) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64],
                                                npt.NDArray[np.bool_]]:
        """``(data, offsets, valid)`` of the keys of ``ids`` (Arrow layout, offsets from 0).

        Raises
        ------
        IdNotFoundError
            An id that is not in the dictionary (named with its index).
        RecordTypeError
            ``ids`` not a 1-D integer array.
        """
        self._sync()
        arr = self._ids(ids, "keys")
        lens = self._lengths(arr, "keys")
        valid = lens >= 0
        offs = np.zeros(len(arr) + 1, np.int64)
        np.cumsum(np.maximum(lens, 0), out=offs[1:])
        data = np.empty(int(offs[-1]), np.uint8)
        if len(arr):
            K.gather_keys(arr, self._flat, self._ps.frames, self._rseqs,
                          self._cseqs, self._geo(), offs, data)
        return data, offs, valid

    def remove(self, ids: npt.ArrayLike) -> None:
        """Forget the keys of ``ids`` (repeats allowed); their ids and space are reused
        by later keys, and interning the same bytes again gives a (possibly other) id.

        Raises
        ------
        IdNotFoundError
            An id that is not in the dictionary; nothing removed.
        RecordTypeError
            ``ids`` not a 1-D integer array.
        PoolExhaustedError
            A page to clone found no free frame; nothing removed.
        """
        self._sync()
        arr = self._ids(ids, "remove")
        self._lengths(arr, "remove")
        if not len(arr):
            return
        order = np.unique(arr)[::-1].copy()  # the smallest removed id is reused first
        self._guarded(lambda: self._remove(order), self._need_frames(0, 0))

    def _remove(self, order: npt.NDArray[np.int64]) -> None:
        self._upgrade()
        pm = self._pm
        state = np.zeros(2, np.int64)
        flat = self._flat
        i = 0
        while True:
            code = K.remove_rows(i, order, flat, self._ps.frames, self._ps.mod, pm.pool.pins,
                                 self._rseqs, self._cseqs, self._iseqs, self._geo(), state)
            i = int(state[0])
            if code == K.DONE:
                break
            pm.writable1(self.psid, int(state[1]))
        c = self._ctl()
        cap = len(self._iseqs) * self._spp
        keys = int(c[K.C_USED]) - int(c[K.C_TOMBS])
        if int(c[K.C_TOMBS]) > keys or (len(self._iseqs) > 1 and keys < cap * self.MAX_LOAD / 8):
            self._reindex(keys)
        if self._trim_records():
            self._trim_chunks()

    def _relink(self, seqs: npt.NDArray[np.int64], per_page: int, item: int, next_off: int,
                word: int, limit: int) -> None:
        """Drop the entries ``>= limit`` from the free list whose head is control word
        ``word`` (`K.relink_free`), un-sharing the pages it writes."""
        pm = self._pm
        while True:
            q = int(K.relink_free(self._flat, self._ps.frames, pm.pool.pins, self._ps.mod, seqs,
                                  per_page, K.magic(per_page), item, next_off, self._pb,
                                  pm.epoch, self._ctl_seq, word, limit))
            if q < 0:
                return
            pm.writable1(self.psid, q)

    def _trim_records(self) -> bool:
        """Give the record pages at the end whose ids are all free back to the pool: the
        high mark comes down to the first id of the last page still holding a key, and
        the free id list loses the ids past it (the others keep their order). Returns
        whether pages were given back."""
        rpp = self._rpp
        high = int(self._ctl()[K.C_HIGH])
        n = -(-high // rpp)
        pool = self._pm.pool.frames
        while n > 0:
            f = int(self._ps.frames[self._rseqs[n - 1]])
            lenf = pool[f, HEADER_BYTES:HEADER_BYTES + rpp * K.REC].view(np.uint32)
            if np.any(lenf[K.LENF_OFF // 4::K.REC // 4][:high - (n - 1) * rpp]):
                break
            n -= 1
        if n * rpp >= high or n == len(self._rseqs):
            return False
        self._ctl_w()[K.C_HIGH] = min(high, n * rpp)
        self._relink(self._rseqs, rpp, K.REC, 8, K.C_FREEID, n * rpp)
        gone = self._rseqs[n:]
        self._rseqs = self._rseqs[:n].copy()
        self._pm.release(self.psid, gone)
        return True

    def _trim_chunks(self) -> None:
        """Give the chunk pages at the end whose chunks are all free back to the pool (as
        `_trim_records`: the bump pointer comes down, the free chunk list loses the chunks
        past it)."""
        c = self._ctl()
        bump = int(c[K.C_CBUMP])
        if not bump:
            return
        free = K.free_chunk_marks(self._flat, self._ps.frames, self._cseqs, self._geo(),
                                  int(c[K.C_FREECH]), bump)
        used = np.flatnonzero(~free)
        new_bump = int(used[-1]) + 1 if len(used) else 0
        n = -(-new_bump // self._cpp)
        if n == len(self._cseqs):
            return
        self._ctl_w()[K.C_CBUMP] = new_bump
        self._relink(self._cseqs, self._cpp, K.CHUNK, K.CDATA, K.C_FREECH, new_bump)
        gone = self._cseqs[n:]
        self._cseqs = self._cseqs[:n].copy()
        self._pm.release(self.psid, gone)

    def __len__(self) -> int:
        self._sync()
        return int(self._ctl()[K.C_LIVE])

    def items(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8],
                             npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """``(ids, data, offsets, valid)`` of every key, ids ascending."""
        self._sync()
        high = int(self._ctl()[K.C_HIGH])
        ids = np.flatnonzero(K.live_mask(self._flat, self._ps.frames,
                                         self._rseqs, self._geo(), high)).astype(np.int64)
        data, offs, valid = self.keys(ids)
        return ids, data, offs, valid

    def memory(self) -> dict[str, int]:
        """Bytes of pages by role: ``index``, ``records``, ``chunks`` and ``other`` (the
        control and super pages), whole pages counted."""
        self._sync()
        pb = self._pb
        index, recs, chunks = len(self._iseqs), len(self._rseqs), len(self._cseqs)
        return {"index": index * pb, "records": recs * pb, "chunks": chunks * pb,
                "other": (self._ps.n_pages - index - recs - chunks) * pb}

    def __repr__(self) -> str:
        return f"<KeyDict {self.name!r} len={len(self)} pages={self._ps.n_pages}>"

    # -- invariants ---------------------------------------------------------------------------------
    def _check(self) -> None:
        """Assert every invariant of the pages and counters (O(pages), Python loops)."""
        self._sync()
        self._pm._check()
        c = self._ctl().copy()
        pool = self._pm.pool.frames
        fr_of = self._ps.frames
        high = int(c[K.C_HIGH])
        assert high <= len(self._rseqs) * self._rpp

        def rec(rid: int) -> npt.NDArray[np.uint8]:
            f = int(fr_of[self._rseqs[rid // self._rpp]])
            o = HEADER_BYTES + (rid % self._rpp) * K.REC
            out: npt.NDArray[np.uint8] = pool[f, o:o + K.REC]
            return out

        def chunk(ch: int) -> npt.NDArray[np.uint8]:
            f = int(fr_of[self._cseqs[ch // self._cpp]])
            o = HEADER_BYTES + (ch % self._cpp) * K.CHUNK
            out: npt.NDArray[np.uint8] = pool[f, o:o + K.CHUNK]
            return out

        lenf = [int(rec(r)[K.LENF_OFF:K.LENF_OFF + 4].view(np.uint32)[0]) for r in range(high)]
        live = [r for r in range(high) if lenf[r] != 0]
        assert len(live) == int(c[K.C_LIVE])
        nulls = [r for r in live if lenf[r] == K.NULL_LEN]
        assert len(nulls) <= 1
        assert int(c[K.C_NULL]) == (nulls[0] + 1 if nulls else 0)
        # free ids: a list through the free records, covering exactly them
        free, f = [], int(c[K.C_FREEID])
        while f:
            free.append(f - 1)
            assert lenf[f - 1] == 0 and len(free) <= high
            f = int(rec(f - 1)[8:16].view(np.int64)[0])
        assert sorted(free) == [r for r in range(high) if lenf[r] == 0]
        # chunks: live chains and the free list partition the chunks in use
        used_ch: list[int] = []
        keys: dict[bytes, int] = {}
        key_of: dict[int, bytes] = {}
        data, offs, valid = self.keys(np.asarray(live, np.int64))
        for j, r in enumerate(live):
            if lenf[r] == K.NULL_LEN:
                continue
            L = lenf[r] - 1
            kb = bytes(data[offs[j]:offs[j + 1]])
            assert len(kb) == L
            assert kb not in keys, "a key with two ids"
            keys[kb] = r
            key_of[r] = kb
            h = K.hash_keys(np.frombuffer(kb, np.uint8), np.array([0, L]), np.uint64(self._mask))
            assert int(rec(r)[:8].view(np.uint64)[0]) == int(h[0]), "stored hash"
            if L > K.INLINE:
                ch = int(rec(r)[8:16].view(np.int64)[0]) - 1
                for _ in range(-(-L // K.CDATA)):
                    used_ch.append(ch)
                    ch = int(chunk(ch)[K.CDATA:].view(np.int64)[0]) - 1
                assert ch == -1, "chunk chain longer than its key"
        f = int(c[K.C_FREECH])
        while f:
            used_ch.append(f - 1)
            assert len(used_ch) <= int(c[K.C_CBUMP])
            f = int(chunk(f - 1)[K.CDATA:].view(np.int64)[0])
        assert sorted(used_ch) == list(range(int(c[K.C_CBUMP]))), "chunks lost or shared"
        assert int(c[K.C_CBUMP]) <= len(self._cseqs) * self._cpp
        # index: each non-null key once, with its hash bits, reachable from its home slot
        assert len(self._iseqs) == int(c[K.C_IPAGES]) and int(c[K.C_SLOTB]) == K.SLOT
        cap = len(self._iseqs) * self._spp
        words = np.concatenate([pool[int(fr_of[q]), HEADER_BYTES:HEADER_BYTES +
                                     self._spp * K.SLOT].view(np.uint64)
                                for q in self._iseqs])
        tag = (words & np.uint64(0xFFFFFFFF)).astype(np.int64)
        assert int(np.count_nonzero(tag != 0)) == int(c[K.C_USED])
        assert int(np.count_nonzero(tag == K.TOMB)) == int(c[K.C_TOMBS])
        assert not np.any(words[tag == K.TOMB] >> np.uint64(32)), "a deleted slot's hash bits"
        assert int(c[K.C_USED]) <= cap * self.MAX_LOAD
        full = (tag != 0) & (tag != K.TOMB)
        assert sorted((tag[full] - 1).tolist()) == sorted(keys.values())
        slots = np.flatnonzero(full)
        homes = np.empty(len(slots), np.int64)
        for j, g in enumerate(slots.tolist()):
            rid = int(tag[g]) - 1
            h = int(rec(rid)[:8].view(np.uint64)[0])
            assert int(words[g]) >> 32 == h & 0xFFFFFFFF, "slot's hash bits"
            homes[j] = ((h >> 32) * cap) >> 32
        # no empty slot between a key's home and its slot (cyclically): the home lies after
        # the last empty slot before the key's slot (O(slots), whatever the clusters' length)
        empty = np.flatnonzero(tag == 0)
        if len(empty) and len(slots):
            at = np.searchsorted(empty, slots) - 1          # the last empty slot before each
            last = np.where(at >= 0, empty[at], empty[-1] - cap)
            assert np.all((slots - homes) % cap < slots - last), "key unreachable by probing"
