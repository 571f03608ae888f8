"""HashMap: an unordered map over pages, organized by linear hashing (Litwin 1980).

Layout
------
Bucket ``b`` is a chain of pages: a primary page (header flag ``PRIMARY``,
``aux0 = b``) and overflow pages linked by the header's ``next`` PageID. Inside
a page, slots form an open-addressing table probed by *groups* of 16 slots::

    [header 64 B][ctrl: S bytes][keys: S keys][values: S values]

A ctrl byte is 0 (EMPTY), 1 (TOMB, a deleted key) or ``0x80 | tag`` (FULL) where
``tag`` is 7 bits of the key's hash, as in SwissTable: a probe compares the 16
ctrl bytes of a group (gathered as two 64-bit words, SWAR) with the tag and reads
a key only where the tag matches. A page has a prime number of groups; a key's
probe starts at group ``((h >> 32) * n_groups) >> 32`` and moves by a per-key
step in ``[1, n_groups)`` from a second hash (double hashing: no clustering of
full groups); a group with an EMPTY slot ends it. A key sits in the first group of its probe sequence that had a
free slot when it was inserted, so probes find it (`_check` verifies this).
Pages of fewer than 16 slots (tests) form one group.

Header ``count`` is the number of FULL slots and ``start`` the *fill*, FULL
plus TOMB slots. A page never fills beyond ``max_fill`` < S, so every probe
meets an EMPTY slot; a key goes to an overflow page only when the last page of
its chain has no room, and fill never shrinks except when a whole bucket is
rewritten (split, merge, compaction). A probe that ends in a page with no next
page knows the key is absent; otherwise it goes on in the next page.

The file holds no directory: the bucket number is in each primary page's header,
and the level ``i`` and split pointer ``p`` follow from the number of buckets
``n = 2**i + p``. A key with hash ``h`` lives in bucket ``h mod 2**(i+1)`` if that
is below ``n``, else ``h mod 2**i``. The map splits bucket ``p`` when the mean
load exceeds ``MAX_LOAD`` (many buckets per vectorized pass when a batch brings
many new keys; a full re-addressing when it more than doubles) and merges the
last bucket into its buddy below ``MIN_LOAD``.

Every operation is vectorized over a batch: hashing (splitmix64 over the key's
bytes), probing (one round per group step over all keys still probing; about
one round at the default load), insertion (keys grouped by target group; the
``r``-th key takes the ``r``-th free slot) and aggregation (a sort-based
pre-aggregation, then one gather/scatter per value field through flat column
views, `mmm.structures.columns`). Per-record writes are buffered and applied
as a batch before any read (`HashMap.upserter`).
The in-memory index (bucket -> primary page, page -> next page, bucket -> last
page, length) is redundant with the pages and rebuilt lazily.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from mmm.errors import RecordTypeError, SchemaError
from mmm.manager import PageManager
from mmm.page import HEADER_BYTES, NIL_INT, Layout
from mmm.schema import as_schema, coerce_records, dtype_to_text
from mmm.structures.base import Structure, pad8
from mmm.structures.columns import Column
from mmm.structures.combine import CombineOp, compile_spec, input_columns, preaggregate_sorted

__all__ = ["HashMap"]

EMPTY, TOMB = 0, 1
FULL_BIT = 0x80
PRIMARY = 1
_U64 = np.uint64
_MASK32 = _U64(0xFFFFFFFF)


_ONES = _U64(0x0101010101010101)
_LOW7 = _U64(0x7F7F7F7F7F7F7F7F)
_HIGH = _U64(0x8080808080808080)


def _zero_bytes(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """0x80 in each byte of ``x`` that is zero, 0 elsewhere (exact, no borrow)."""
    return ~(((x & _LOW7) + _LOW7) | x | _LOW7)


def _group_ranks(ids: npt.NDArray[np.int64]
                 ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.int64]]:
    """``(order, rank)``: a sort of ``ids`` and each element's rank among equal ids."""
    n = len(ids)
    order = np.argsort(ids)
    s = ids[order]
    first = np.ones(n, dtype=bool)
    first[1:] = s[1:] != s[:-1]
    starts = np.flatnonzero(first)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
    return order, rank


def _prev_prime(n: int) -> int:
    """The largest prime <= n (n >= 1; 1 for n == 1)."""
    for m in range(n, 1, -1):
        if all(m % d for d in range(2, int(m ** 0.5) + 1)):
            return m
    return 1


def _widen(b: npt.NDArray[np.bool_]) -> npt.NDArray[np.uint64]:
    """All-ones words where ``b`` is True."""
    return np.where(b, ~_U64(0), _U64(0))


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 finalizer, vectorized (uint64 arithmetic wraps)."""
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def _combine1(op: str, a: Any, b: Any) -> Any:
    if op in ("count", "sum"):
        return a + b
    if op == "min":
        return np.minimum(a, b) if a.dtype.kind in "iuf" else np.where(b < a, b, a)
    if op == "max":
        return np.maximum(a, b) if a.dtype.kind in "iuf" else np.where(b > a, b, a)
    return b  # last


class HashMap(Structure):
    """A map from fixed-size keys to fixed-size values stored in pages.

    Create with `HashMap.create`. Batch methods take numpy arrays and are the
    primary API; ``m[k]``, ``m[k] = v``, ``del m[k]``, ``k in m``, ``len`` and
    iteration exist for convenience (writes made through them are buffered and
    applied as one batch before any other operation or snapshot).
    """

    KIND = "hash_map"
    MAX_LOAD = 0.6
    MIN_LOAD = 0.15
    PAGE_FILL = 0.85
    _BUFFER_LIMIT = 8192
    GROUP = 16

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def create(cls, pm: PageManager, name: str, key: npt.DTypeLike, value: npt.DTypeLike,
               *, page_slots: int | None = None) -> "HashMap":
        """Create the map ``name`` or reopen it (after a restart, load or rollback).

        Parameters
        ----------
        pm : PageManager
        name : str
            Structure name, unique in ``pm``.
        key, value : dtype-like
            Fixed-size numpy dtypes (structured or scalar, no object fields).
        page_slots : int, optional
            Slots per page (default: as many as fit); tests use tiny values.

        Raises
        ------
        SchemaError
            Object, unicode or zero-sized fields.
        SchemaMismatchError
            ``name`` exists with another kind or schema.
        """
        kdt = as_schema(key, f"hash map {name!r}: key")
        vdt = as_schema(value, f"hash map {name!r}: value")
        schema = {"key": dtype_to_text(kdt), "value": dtype_to_text(vdt)}
        obj = cls._existing(pm, name, schema)
        if obj is not None:
            return obj  # type: ignore[no-any-return]
        slots = cls._slots_for(pm.page_bytes, kdt.itemsize, vdt.itemsize, page_slots, name)
        return cls(pm, name, kdt, vdt, schema, slots)

    @staticmethod
    def _slots_for(page_bytes: int, ks: int, vs: int, page_slots: int | None, name: str) -> int:
        s = (page_bytes - HEADER_BYTES - 16) // (1 + ks + vs)
        while s > 0 and HEADER_BYTES + pad8(s) + pad8(s * ks) + s * vs > page_bytes:
            s -= 1
        if page_slots is not None:
            if not isinstance(page_slots, int) or page_slots < 2:
                raise ValueError(f"hash map {name!r}: page_slots={page_slots!r} must be >= 2")
            if page_slots > s:
                raise ValueError(f"hash map {name!r}: page_slots={page_slots} exceeds the "
                                 f"{s} slots a {page_bytes}-byte page holds")
            s = page_slots
        if s >= HashMap.GROUP:  # whole probe groups, a prime number of them
            s = HashMap.GROUP * _prev_prime(s // HashMap.GROUP)
        elif page_slots is None and s < 2:
            pass
        if s < 2:
            raise SchemaError(f"hash map {name!r}: records of {ks + vs} bytes do not fit "
                              f"two to a {page_bytes}-byte page")
        return s

    def __init__(self, pm: PageManager, name: str, kdt: np.dtype[Any], vdt: np.dtype[Any],
                 schema: dict[str, str], slots: int) -> None:
        self.key_dtype = kdt
        self.value_dtype = vdt
        self._float_key = kdt.kind == "f"
        ks = kdt.itemsize
        self._cmp_dtype = (np.dtype(f"<u{ks}") if ks in (1, 2, 4, 8) and kdt.fields is None
                           else np.dtype(f"V{ks}"))
        self._buf_kind: Any = None
        self._buf_keys: list[Any] = []
        self._buf_cols: list[list[Any]] = []
        self._upserters: dict[int, Any] = {}
        self._spec_cache: dict[int, tuple[Mapping[str, Any], tuple[CombineOp, ...]]] = {}
        super().__init__(pm, name, schema, {"page_slots": slots})
        self.S = int(self._params["page_slots"])
        if self._ps.n_pages == 1:  # new: one empty bucket
            self._gen = -1
            seq = pm.allocate(self.psid, 1, Layout.HASH)
            frame = pm.writable1(self.psid, int(seq[0]))
            pm.pool.headers["flags"][frame] = PRIMARY
            pm.pool.headers["aux0"][frame] = 0
            self._sync()

    def _views(self) -> None:
        S, kdt, vdt = self.S, self.key_dtype, self.value_dtype
        frames = self._pm.pool.frames
        self._ko = HEADER_BYTES + pad8(S)
        self._vo = self._ko + pad8(S * kdt.itemsize)
        self._ctrl = frames[:, HEADER_BYTES:HEADER_BYTES + S]
        self._keys = frames[:, self._ko:self._ko + S * kdt.itemsize].view(self._cmp_dtype)
        self._vals = frames[:, self._vo:self._vo + S * vdt.itemsize].view(vdt)
        self._hdr = self._pm.pool.headers
        self.max_fill = max(1, min(S - 1, int(S * self.PAGE_FILL)))
        self.G = min(self.GROUP, S)
        self.n_blocks = S // self.G
        self._g_range = np.arange(self.G)
        self._pb = self._pm.page_bytes
        self._u64 = frames.reshape(-1).view(np.uint64)
        self._ctrl_c = Column(frames, HEADER_BYTES, 1, np.dtype(np.uint8), S)
        self._key_c = Column(frames, self._ko, kdt.itemsize, self._cmp_dtype, S)
        vs = vdt.itemsize
        if vdt.fields is None:
            self._val_c: dict[str | None, Column] = {None: Column(frames, self._vo, vs, vdt, S)}
        else:
            self._val_c = {name: Column(frames, self._vo + off, vs, sub, S)
                           for name, (sub, off, *_r) in vdt.fields.items()}

    def _get_vals(self, f: npt.NDArray[np.int64], s: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
        out = np.empty(len(f), dtype=self.value_dtype)
        for name, col in self._val_c.items():
            if name is None:
                out[:] = col.get(f, s)
            else:
                out[name] = col.get(f, s)
        return out

    def _set_vals(self, f: npt.NDArray[np.int64], s: npt.NDArray[np.int64],
                  vals: npt.NDArray[Any]) -> None:
        for name, col in self._val_c.items():
            col.set(f, s, vals if name is None else vals[name])

    def _rebuild(self) -> None:
        if not hasattr(self, "S"):
            self.S = int(self._params["page_slots"])
        self._views()
        ps = self._ps
        seqs = ps.seqs()
        seqs = seqs[seqs != 0]
        frames = ps.frames[seqs]
        h = self._hdr
        primary = (h["flags"][frames] & PRIMARY).astype(bool)
        n = int(np.count_nonzero(primary))
        self._bucket_seq = np.full(max(n, 1), -1, dtype=np.int64)
        self._bucket_seq[h["aux0"][frames[primary]].astype(np.int64)] = seqs[primary]
        nxt = h["next"][frames]
        self._next_of = np.full(max(ps.high, 1) * 2, -1, dtype=np.int64)
        has = nxt != _U64(NIL_INT)
        self._next_of[seqs[has]] = (nxt[has] & _MASK32).astype(np.int64)
        self._last_seq = self._bucket_seq.copy()
        if has.any():  # follow every overflow chain one step per pass (chains are short)
            last = self._last_seq
            live = np.flatnonzero(last >= 0)
            while len(live):
                nxt_seq = self._next_of[last[live]]
                more = nxt_seq >= 0
                live = live[more]
                last[live] = nxt_seq[more]
        self._len = int(h["count"][frames].sum())
        self._n_buckets = n

    # -- hashing and addressing -----------------------------------------------------------------
    def _canon(self, keys: Any, what: str) -> npt.NDArray[Any]:
        """Keys as a 1-D array of the comparison dtype (validated; a copy if needed)."""
        arr = coerce_records(keys, self.key_dtype, f"hash map {self.name!r}: {what}")
        if self._float_key:
            if np.isnan(arr).any():
                raise RecordTypeError(f"hash map {self.name!r}: {what}: NaN is not a valid key")
            arr = arr + arr.dtype.type(0)  # -0.0 -> 0.0
        elif self.key_dtype.fields is not None:
            clean = np.zeros(len(arr), dtype=self.key_dtype)
            for f in self.key_dtype.names or ():
                clean[f] = arr[f]
            arr = clean
        return np.ascontiguousarray(arr).view(self._cmp_dtype)

    def _hash(self, kc: npt.NDArray[Any]) -> npt.NDArray[np.uint64]:
        if kc.dtype.kind == "u":
            return _mix(kc.astype(np.uint64))
        n, size = len(kc), kc.dtype.itemsize
        raw = np.zeros((n, pad8(size)), dtype=np.uint8)
        raw[:, :size] = kc.view(np.uint8).reshape(n, size)
        words = raw.view(np.uint64)
        h = _mix(words[:, 0])
        for j in range(1, words.shape[1]):
            h = _mix(h ^ words[:, j])
        return h

    def _bucket_of(self, h: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        n = self._n_buckets
        i = n.bit_length() - 1
        b = (h & _U64((1 << (i + 1)) - 1)).astype(np.int64)
        return np.where(b >= n, b - (1 << i), b)

    def _block_of(self, h: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        return (((h >> _U64(32)) * _U64(self.n_blocks)) >> _U64(32)).astype(np.int64)

    def _step_of(self, h: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """Group step of double hashing: in ``[1, n_groups)``, coprime with the
        (prime) number of groups, from bits independent of the home group."""
        nb = self.n_blocks
        if nb == 1:
            return np.zeros(len(h), dtype=np.int64)
        h2 = _mix(h ^ _U64(0x5851F42D4C957F2D))
        return 1 + (((h2 >> _U64(40)) * _U64(nb - 1)) >> _U64(24)).astype(np.int64)

    # -- core vectorized operations -----------------------------------------------------------------
    def _tag_of(self, h: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint8]:
        return ((h >> _U64(24)) & _U64(0x7F)).astype(np.uint8) | np.uint8(FULL_BIT)

    def _block_ctrl(self, f: npt.NDArray[np.int64], b: npt.NDArray[np.int64]
                    ) -> npt.NDArray[np.uint8]:
        """The ctrl bytes of group ``b`` of frames ``f``: an ``(n, G)`` array."""
        if self.G == 16:  # two aligned 64-bit words per group
            w = (f * self._pb + (HEADER_BYTES + 16 * b)) >> 3
            words = np.empty((len(f), 2), dtype=np.uint64)
            words[:, 0] = np.take(self._u64, w)
            words[:, 1] = np.take(self._u64, w + 1)
            return words.view(np.uint8)
        slots = (b * self.G)[:, None] + self._g_range
        return self._ctrl_c.get(f[:, None], slots)

    def _locate(self, kc: npt.NDArray[Any], h: npt.NDArray[np.uint64]
                ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Page seq and slot of each key, -1 where absent.

        Group probing: each round compares every key still probing with all
        ``G`` slots of its current block; a block with an EMPTY slot ends the
        probe in that page (then the next page of the chain, if any).
        Runtime complexity: O(n * G * blocks probed); about one block at the
        default load.
        """
        n = len(kc)
        out_seq = np.full(n, -1, dtype=np.int64)
        out_slot = np.full(n, -1, dtype=np.int64)
        if n == 0:
            return out_seq, out_slot
        idx = np.arange(n)
        q = self._bucket_seq[self._bucket_of(h)]
        b0 = self._block_of(h)
        step = self._step_of(h)
        b = b0
        k = kc
        tag = self._tag_of(h)
        frames_of, next_of, nb, G = self._ps.frames, self._next_of, self.n_blocks, self.G
        swar = G == 16
        while idx.size:
            f = frames_of[q]
            hit = np.zeros(len(idx), dtype=bool)
            pos = np.zeros(len(idx), dtype=np.int64)
            if swar:  # SWAR over the group's two ctrl words: no (n, 16) temporaries
                w = (f * self._pb + (HEADER_BYTES + 16 * b)) >> 3
                empty = np.zeros(len(idx), dtype=bool)
                rep = tag.astype(np.uint64) * _ONES
                for half in (0, 1):
                    word = np.take(self._u64, w + half)
                    empty |= _zero_bytes(word) != 0
                    m = _zero_bytes(word ^ rep)
                    cand = np.flatnonzero(m & ~_widen(hit))
                    while cand.size:
                        low = m[cand] & (~m[cand] + _U64(1))
                        p_ = (np.log2(low.astype(np.float64)).astype(np.int64) >> 3) + 8 * half
                        eq = self._key_c.get(f[cand], b[cand] * G + p_) == k[cand]
                        hit[cand[eq]] = True
                        pos[cand[eq]] = p_[eq]
                        m[cand] &= ~low
                        m[cand[eq]] = 0
                        cand = cand[m[cand] != 0]
            else:
                ctrl = self._block_ctrl(f, b)
                match = ctrl == tag[:, None]
                cand = np.flatnonzero(match.any(axis=1))
                while cand.size:  # usually one candidate; false tag matches are rare
                    p_ = match[cand].argmax(axis=1)
                    eq = self._key_c.get(f[cand], b[cand] * G + p_) == k[cand]
                    hit[cand[eq]] = True
                    pos[cand[eq]] = p_[eq]
                    miss = cand[~eq]
                    match[miss, p_[~eq]] = False
                    cand = miss[match[miss].any(axis=1)]
                empty = (ctrl == EMPTY).any(axis=1)
            if hit.any():
                out_seq[idx[hit]] = q[hit]
                out_slot[idx[hit]] = b[hit] * G + pos[hit]
            nxt = next_of[q]
            move = ~hit & empty & (nxt >= 0)
            keep = move | ~(hit | empty)
            if not keep.any():
                break
            b = np.where(move, b0, b + step)
            b[b >= nb] -= nb
            q = np.where(move, nxt, q)
            idx, q, b, b0, k, tag, step = (idx[keep], q[keep], b[keep], b0[keep], k[keep],
                                           tag[keep], step[keep])
        return out_seq, out_slot

    def _touch(self, seqs: npt.NDArray[np.int64]) -> None:
        """Run the write barrier on the distinct pages among ``seqs``."""
        if len(seqs):
            useq = np.flatnonzero(np.bincount(seqs, minlength=1))
            self._pm.writable(self.psid, useq)

    def _new_page(self, bucket: int, primary: bool) -> int:
        pm = self._pm
        seq = int(pm.allocate(self.psid, 1, Layout.HASH)[0])
        frame = pm.writable1(self.psid, seq)
        self._hdr["flags"][frame] = PRIMARY if primary else 0
        self._hdr["aux0"][frame] = bucket
        if seq >= len(self._next_of):
            grown = np.full(2 * (seq + 1), -1, dtype=np.int64)
            grown[:len(self._next_of)] = self._next_of
            self._next_of = grown
        self._next_of[seq] = -1
        return seq

    def _insert_new(self, kc: npt.NDArray[Any], h: npt.NDArray[np.uint64],
                    vals: npt.NDArray[Any]) -> None:
        """Insert keys known to be absent (distinct). Runtime complexity: O(n * probes)."""
        m = len(kc)
        if m == 0:
            return
        bucket = self._bucket_of(h)
        tgt = self._last_seq[bucket]
        hdr, S, pm = self._hdr, self.S, self._pm
        while True:  # make room: keys beyond a last page's room go to a new overflow page
            order, rank = _group_ranks(tgt)
            ts = tgt[order]
            rank = rank[order]
            room = self.max_fill - hdr["start"][self._ps.frames[ts]].astype(np.int64)
            over = rank >= room
            if not over.any():
                break
            for seq in np.unique(ts[over]).tolist():
                b = int(hdr["aux0"][self._ps.frames[seq]])
                new = self._new_page(b, primary=False)
                last = pm.writable1(self.psid, seq)
                hdr["next"][last] = (self.psid << 32) | new
                self._next_of[seq] = new
                self._last_seq[b] = new
                sel = order[over & (ts == seq)]
                tgt[sel] = new
        self._touch(tgt)
        self._place(tgt, self._block_of(h), kc, vals, self._tag_of(h), self._step_of(h))
        self._len += m

    def _place(self, tgt: npt.NDArray[np.int64], b0: npt.NDArray[np.int64],
               kc: npt.NDArray[Any], vals: npt.NDArray[Any], tags: npt.NDArray[np.uint8],
               step: npt.NDArray[np.int64]) -> None:
        """Write keys into the first block, from their home block on, with a free slot.

        One round per block step: keys are grouped by (page, block) and the
        ``r``-th key of a group takes the ``r``-th free (EMPTY or TOMB) slot of the
        block; keys beyond the block's free slots try the next block. A key thus
        sits in the first non-full block of its probe sequence, which is where
        `_locate` finds it. The caller guarantees each page has room.
        """
        G, nb = self.G, self.n_blocks
        frames_of = self._ps.frames
        idx = np.arange(len(tgt))
        b = b0.copy()
        while idx.size:
            f = frames_of[tgt[idx]]
            _, rank = _group_ranks(f * nb + b)
            if G == 16:  # free slots as bits of the two ctrl words (SWAR)
                w = (f * self._pb + (HEADER_BYTES + 16 * b)) >> 3
                m0 = ~np.take(self._u64, w) & _HIGH
                m1 = ~np.take(self._u64, w + 1) & _HIGH
                ok = rank < (np.bitwise_count(m0) + np.bitwise_count(m1))
                r = np.where(ok, rank, 0)
                sel = np.flatnonzero(r > 0)
                while sel.size:  # drop the lowest free slot r times
                    lo0 = m0[sel] != 0
                    a, c = sel[lo0], sel[~lo0]
                    m0[a] &= m0[a] - _U64(1)
                    m1[c] &= m1[c] - _U64(1)
                    r[sel] -= 1
                    sel = sel[r[sel] > 0]
                use0 = m0 != 0
                m = np.where(use0, m0, m1)
                low = m & (~m + _U64(1))
                pos = (np.log2(np.maximum(low, _U64(1)).astype(np.float64)).astype(np.int64)
                       >> 3) + np.where(use0, 0, 8)
            else:
                ctrl = self._block_ctrl(f, b)
                free = np.cumsum(ctrl < FULL_BIT, axis=1)
                ok = rank < free[:, -1]
                pos = (free > rank[:, None]).argmax(axis=1)
            w_ = np.flatnonzero(ok)
            if len(w_):
                self._commit(f[w_], b[w_] * G + pos[w_], kc[idx[w_]], vals[idx[w_]],
                             tags[idx[w_]])
            lose = ~ok
            b = b[lose] + step[idx[lose]]
            b[b >= nb] -= nb
            idx = idx[lose]

    def _commit(self, f: npt.NDArray[np.int64], slot: npt.NDArray[np.int64],
                kc: npt.NDArray[Any], vals: npt.NDArray[Any], tags: npt.NDArray[np.uint8]
                ) -> None:
        was_empty = self._ctrl_c.get(f, slot) == EMPTY
        self._ctrl_c.set(f, slot, tags)
        self._key_c.set(f, slot, kc)
        self._set_vals(f, slot, vals)
        hdr = self._hdr
        n = np.bincount(f)
        uf = np.flatnonzero(n)
        hdr["count"][uf] += n[uf].astype(np.uint32)
        e = np.bincount(f[was_empty], minlength=len(n))
        hdr["start"][uf] += e[uf].astype(np.uint32)

    def _gather_bucket(self, b: int) -> tuple[list[int], npt.NDArray[Any], npt.NDArray[Any]]:
        """Seqs of bucket ``b``'s chain and copies of its keys and values."""
        chain = []
        q = int(self._bucket_seq[b])
        while q >= 0:
            chain.append(q)
            q = int(self._next_of[q])
        fr = self._ps.frames[chain]
        full = self._ctrl[fr] >= FULL_BIT
        return chain, self._keys[fr][full], self._vals[fr][full]

    def _reset_bucket(self, chain: list[int]) -> None:
        """Empty a chain: keep the primary page, release the overflow pages."""
        pm = self._pm
        primary = chain[0]
        frame = pm.writable1(self.psid, primary)
        self._ctrl[frame] = EMPTY
        self._hdr["count"][frame] = 0
        self._hdr["start"][frame] = 0
        self._hdr["next"][frame] = NIL_INT
        self._next_of[primary] = -1
        if len(chain) > 1:
            pm.release(self.psid, np.array(chain[1:], dtype=np.int64))
            self._next_of[chain[1:]] = -1
        self._last_seq[int(self._hdr["aux0"][frame])] = primary

    def _grow_for(self, extra: int) -> None:
        """Split ahead of inserting ``extra`` keys, many buckets per vectorized pass.

        Splitting buckets ``p .. p+k-1`` at once ends in the same state as ``k``
        single splits (as long as the level does not change in between), so the
        records of all of them are gathered, their chains reset, ``k`` new
        primary pages allocated, and everything re-placed in one `_insert_new`.
        """
        target = int(np.ceil((self._len + extra) / (self.MAX_LOAD * self.S)))
        if target >= 2 * self._n_buckets and target > 2:
            self._rebuild_to(target)
            return
        while self._n_buckets < target:
            n = self._n_buckets
            i = n.bit_length() - 1
            p = n - (1 << i)
            k = min(target - n, (1 << i) - p)
            if k <= 1:
                self._split_one()
                continue
            ks, vs = [], []
            for b in range(p, p + k):
                chain, kb, vb = self._gather_bucket(b)
                self._reset_bucket(chain)
                ks.append(kb)
                vs.append(vb)
            self._add_buckets(k)
            kall, vall = np.concatenate(ks), np.concatenate(vs)
            self._len -= len(kall)
            self._insert_new(kall, self._hash(kall), vall)

    def _rebuild_to(self, n_buckets: int) -> None:
        """Re-address every record into ``n_buckets`` buckets in one pass (fast growth)."""
        ks, vs = [], []
        for b in range(self._n_buckets):
            chain, kb, vb = self._gather_bucket(b)
            self._reset_bucket(chain)
            ks.append(kb)
            vs.append(vb)
        n = self._n_buckets
        self._add_buckets(n_buckets - n)
        kall, vall = np.concatenate(ks), np.concatenate(vs)
        self._len -= len(kall)
        self._insert_new(kall, self._hash(kall), vall)

    def _add_buckets(self, k: int) -> None:
        """Allocate empty primary pages for buckets ``n .. n+k-1``."""
        n = self._n_buckets
        new = self._pm.allocate(self.psid, k, Layout.HASH)
        frames = self._pm.writable(self.psid, new)
        self._hdr["flags"][frames] = PRIMARY
        self._hdr["aux0"][frames] = np.arange(n, n + k)
        top = int(new.max()) + 1
        if top > len(self._next_of):
            grown = np.full(2 * top, -1, dtype=np.int64)
            grown[:len(self._next_of)] = self._next_of
            self._next_of = grown
        self._next_of[new] = -1
        self._bucket_seq = np.append(self._bucket_seq, new)
        self._last_seq = np.append(self._last_seq, new)
        self._n_buckets = n + k

    def _split_one(self) -> None:
        n = self._n_buckets
        i = n.bit_length() - 1
        p = n - (1 << i)
        chain, k, v = self._gather_bucket(p)
        self._reset_bucket(chain)
        new = self._new_page(n, primary=True)
        self._bucket_seq = np.append(self._bucket_seq, new)
        self._last_seq = np.append(self._last_seq, new)
        self._n_buckets = n + 1
        self._len -= len(k)
        self._insert_new(k, self._hash(k), v)

    def _merge_one(self) -> None:
        n = self._n_buckets
        last = n - 1
        chain, k, v = self._gather_bucket(last)
        self._reset_bucket(chain)
        self._pm.release(self.psid, np.array([chain[0]], dtype=np.int64))
        self._bucket_seq = self._bucket_seq[:last]
        self._last_seq = self._last_seq[:last]
        self._n_buckets = last
        self._len -= len(k)
        self._insert_new(k, self._hash(k), v)

    def _compact(self, buckets: npt.NDArray[np.int64]) -> None:
        for b in buckets.tolist():
            chain, k, v = self._gather_bucket(b)
            self._reset_bucket(chain)
            self._len -= len(k)
            self._insert_new(k, self._hash(k), v)

    def _rebalance(self) -> None:
        cap = self.S
        while self._len > self.MAX_LOAD * cap * self._n_buckets:
            self._split_one()
        while self._n_buckets > 1 and self._len < self.MIN_LOAD * cap * (self._n_buckets - 1):
            self._merge_one()

    # -- batch API -----------------------------------------------------------------------------------
    def upsert(self, keys: npt.ArrayLike, values: Any = None,
               combine: Mapping[str, Any] | None = None) -> None:
        """Aggregate input records into the map: insert new keys, combine existing ones.

        Parameters
        ----------
        keys : array_like
            One key per input record (duplicates allowed).
        values : structured array or mapping of column -> array, optional
            The input columns the combine spec reads.
        combine : dict
            ``{value_field: op or (op, input_column)}``, ops count/sum/min/max/last/first;
            see `mmm.structures.combine`.

        Runtime complexity: O(n log n) (one ``np.unique`` of the batch).
        Pages copied: at most the pages the batch touches, once per snapshot.

        Raises
        ------
        RecordTypeError
            Keys of the wrong dtype or shape, bad combine spec, missing or
            mis-sized input columns; the map is unchanged.

        Examples
        --------
        >>> import numpy as np, mmm
        >>> pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
        >>> m = mmm.HashMap.create(pm, "agg", key="<u4",
        ...                        value=[("n", "<i8"), ("lo", "<i8"), ("hi", "<i8")])
        >>> spec = {"n": "count", "lo": ("min", "ts"), "hi": ("max", "ts")}
        >>> m.upsert(np.array([7, 7, 9], "<u4"), {"ts": np.array([5, 3, 4])}, spec)
        >>> m[7].tolist()
        (2, 3, 5)
        """
        self._flush()
        self._sync()
        spec = self._spec(combine)
        kc = self._canon(keys, "keys")
        cols = input_columns(values, spec, len(kc), f"hash map {self.name!r}",
                             self.value_dtype)
        self._upsert_prepared(kc, cols, spec)

    def _spec(self, combine: Mapping[str, Any] | None) -> tuple[CombineOp, ...]:
        if combine is None:
            raise RecordTypeError(f"hash map {self.name!r}: upsert needs a combine spec")
        key = id(combine)
        hit = self._spec_cache.get(key)
        if hit is not None and hit[0] is combine:
            return hit[1]
        spec = compile_spec(self.value_dtype, combine, f"hash map {self.name!r}")
        if len(self._spec_cache) > 64:
            self._spec_cache.clear()
        self._spec_cache[key] = (combine, spec)
        return spec

    def _upsert_prepared(self, kc: npt.NDArray[Any], cols: dict[str, npt.NDArray[Any]],
                         spec: tuple[CombineOp, ...]) -> None:
        if len(kc) == 0:
            return
        stable = any(c.op in ("first", "last") for c in spec)
        order = np.argsort(kc, kind="stable" if stable else None)
        ks = kc[order]
        first = np.empty(len(ks), dtype=bool)
        first[0] = True
        np.not_equal(ks[1:], ks[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        uniq = ks[starts]
        partial = preaggregate_sorted(order, starts, spec, cols, self.value_dtype)
        h = self._hash(uniq)
        seq, slot = self._locate(uniq, h)
        found = seq >= 0
        if found.any():
            fs, sl = seq[found], slot[found]
            self._touch(fs)
            fr = self._ps.frames[fs]
            part = partial[found]
            for c in spec:
                col = self._val_c[c.field]
                if c.op == "first":
                    continue
                a, b = (col.get(fr, sl), part[c.field]) if c.op != "last" else (None, part[c.field])
                col.set(fr, sl, _combine1(c.op, a, b))
        if not found.all():
            new = ~found
            self._grow_for(int(np.count_nonzero(new)))
            h_new = h[new]
            self._insert_new(uniq[new], h_new, partial[new])
            self._rebalance()

    def put(self, keys: npt.ArrayLike, values: Any) -> None:
        """Insert or overwrite ``keys[i] -> values[i]``; for a key repeated in the batch the last wins.

        Runtime complexity: O(n log n). Pages copied: at most the pages touched.

        Raises
        ------
        RecordTypeError
            Keys or values of the wrong dtype, shape or length (map unchanged).
        """
        self._flush()
        self._sync()
        kc = self._canon(keys, "keys")
        vals = coerce_records(values, self.value_dtype, f"hash map {self.name!r}: values",
                              n=len(kc))
        self._put_prepared(kc, vals)

    def _put_prepared(self, kc: npt.NDArray[Any], vals: npt.NDArray[Any]) -> None:
        n = len(kc)
        if n == 0:
            return
        rev_u, rev_first = np.unique(kc[::-1], return_index=True)
        last = n - 1 - rev_first
        uniq, v = rev_u, vals[last]
        h = self._hash(uniq)
        seq, slot = self._locate(uniq, h)
        found = seq >= 0
        if found.any():
            self._touch(seq[found])
            self._set_vals(self._ps.frames[seq[found]], slot[found], v[found])
        if not found.all():
            new = ~found
            self._insert_new(uniq[new], h[new], v[new])
            self._rebalance()

    def get(self, keys: npt.ArrayLike, default: Any = None
            ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[Any]]:
        """Look keys up: ``(found, values)``; missing keys get ``default`` (zeros if None).

        Runtime complexity: O(n * probes). Pages copied: 0.
        """
        self._flush()
        self._sync()
        kc = self._canon(keys, "keys")
        seq, slot = self._locate(kc, self._hash(kc)) if len(kc) else (np.zeros(0, np.int64),) * 2
        found = seq >= 0
        out = np.zeros(len(kc), dtype=self.value_dtype)
        if default is not None:
            out[:] = default
        out[found] = self._get_vals(self._ps.frames[seq[found]], slot[found])
        return found, out

    def contains(self, keys: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Boolean mask: which keys are present."""
        self._flush()
        self._sync()
        kc = self._canon(keys, "keys")
        return self._locate(kc, self._hash(kc))[0] >= 0

    def delete(self, keys: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Delete keys; returns which of them were present.

        Runtime complexity: O(n log n). Pages copied: at most the pages touched.
        """
        self._flush()
        self._sync()
        kc = self._canon(keys, "keys")
        if len(kc) == 0:
            return np.zeros(0, dtype=bool)
        uniq, inverse = np.unique(kc, return_inverse=True)
        h = self._hash(uniq)
        seq, slot = self._locate(uniq, h)
        found = seq >= 0
        if found.any():
            fs, sl = seq[found], slot[found]
            self._touch(fs)
            fr = self._ps.frames[fs]
            self._ctrl_c.set(fr, sl, TOMB)
            np.subtract.at(self._hdr["count"], fr, 1)
            self._len -= int(np.count_nonzero(found))
            # rewrite buckets whose tombstones crowd out free slots
            buckets = np.unique(self._hdr["aux0"][fr].astype(np.int64))
            tomb = np.zeros(len(buckets), dtype=np.int64)
            at = np.arange(len(buckets))
            q = self._bucket_seq[buckets]
            while len(q):  # walk the touched buckets' chains, one page per bucket a step
                pf = self._ps.frames[q]
                tomb[at] += (self._hdr["start"][pf].astype(np.int64)
                             - self._hdr["count"][pf].astype(np.int64))
                q = self._next_of[q]
                at, q = at[q >= 0], q[q >= 0]
            crowded = buckets[tomb > self.S // 2]
            if len(crowded):
                self._compact(crowded)
            self._rebalance()
        return found[inverse.reshape(-1)]

    def items(self) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """All ``(keys, values)`` as two arrays, in storage order. Runtime complexity: O(pages * S)."""
        self._flush()
        self._sync()
        seqs = self._ps.seqs()
        fr = self._ps.frames[seqs[seqs != 0]]
        full = self._ctrl[fr] >= FULL_BIT
        return (self._keys[fr][full].view(self.key_dtype).copy(),
                self._vals[fr][full].copy())

    def keys(self) -> npt.NDArray[Any]:
        """All keys as an array (storage order)."""
        return self.items()[0]

    def values(self) -> npt.NDArray[Any]:
        """All values as an array (storage order)."""
        return self.items()[1]

    def clear(self) -> None:
        """Remove every key; keeps one empty bucket."""
        self._flush()
        self._sync()
        seqs = self._ps.seqs()
        seqs = seqs[seqs != 0]
        keep = int(self._bucket_seq[0])
        self._pm.release(self.psid, seqs[seqs != keep])
        self._bucket_seq = self._bucket_seq[:1]
        self._last_seq = self._bucket_seq.copy()
        self._next_of[:] = -1
        self._n_buckets = 1
        frame = self._pm.writable1(self.psid, keep)
        self._ctrl[frame] = EMPTY
        self._hdr["count"][frame] = 0
        self._hdr["start"][frame] = 0
        self._hdr["next"][frame] = NIL_INT
        self._len = 0

    # -- per-record convenience (buffered writes) ----------------------------------------------------
    def upsert_record(self, key: Any, combine: Mapping[str, Any], **inputs: Any) -> None:
        """Aggregate one input record; buffered and applied as a batch.

        For hot loops prefer `upserter`, which avoids the keyword arguments.
        Runtime complexity: amortized O(1) Python work plus the batch cost.
        """
        add = self._upserters.get(id(combine))
        if add is None or add.combine is not combine:
            add = self.upserter(combine)
        add(key, *(inputs[n] for n in add.inputs))

    def upserter(self, combine: Mapping[str, Any]) -> Any:
        """A fast per-record aggregation function ``add(key, *inputs)``.

        ``inputs`` are the values of the spec's input columns in sorted name
        order (``add.inputs``). Records are buffered and applied as one batch
        of up to 8192 records, or before any other operation on the map or a
        snapshot, so every read sees them.

        Examples
        --------
        >>> import numpy as np, mmm
        >>> pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
        >>> m = mmm.HashMap.create(pm, "u", key="<u4", value=[("n", "<i8"), ("hi", "<i8")])
        >>> add = m.upserter({"n": "count", "hi": ("max", "ts")})
        >>> add.inputs
        ('ts',)
        >>> for k, t in [(1, 5), (1, 7), (2, 1)]:
        ...     add(k, t)
        >>> m[1].tolist()
        (2, 7)
        """
        spec = self._spec(combine)
        names = tuple(sorted({c.input for c in spec if c.input is not None}))
        keys = self._buf_keys
        cols = self._buf_cols
        limit = self._BUFFER_LIMIT
        this = self

        if len(names) == 1:
            def add(key: Any, value: Any) -> None:
                if this._buf_kind is not combine:
                    this._switch_buffer(combine, 1)
                keys.append(key)
                cols[0].append(value)
                if len(keys) >= limit:
                    this._flush()
        else:
            def add(key: Any, *values: Any) -> None:  # type: ignore[misc]
                if this._buf_kind is not combine:
                    this._switch_buffer(combine, len(names))
                if len(values) != len(names):
                    raise RecordTypeError(f"hash map {this.name!r}: upserter expects "
                                          f"{len(names)} input value(s) {names}, got "
                                          f"{len(values)}")
                keys.append(key)
                for col, v in zip(cols, values):
                    col.append(v)
                if len(keys) >= limit:
                    this._flush()
        add.inputs = names  # type: ignore[attr-defined]
        add.combine = combine  # type: ignore[attr-defined]
        self._upserters[id(combine)] = add
        return add

    def _switch_buffer(self, kind: Any, n_cols: int) -> None:
        self._flush()
        if self._gen != self._pm.generation:
            self._sync()
        while len(self._buf_cols) < n_cols:
            self._buf_cols.append([])
        self._buf_kind = kind

    def __setitem__(self, key: Any, value: Any) -> None:
        if self._buf_kind != "put":
            self._switch_buffer("put", 1)
        self._buf_keys.append(key)
        self._buf_cols[0].append(value)
        if len(self._buf_keys) >= self._BUFFER_LIMIT:
            self._flush()

    def _flush(self) -> None:
        """Apply buffered per-record writes as one batch (validating them first)."""
        if not self._buf_keys:
            self._buf_kind = None
            return
        kind = self._buf_kind
        keys = list(self._buf_keys)
        cols = [list(c) for c in self._buf_cols]
        self._buf_kind = None
        del self._buf_keys[:]  # in place: upserter closures hold these lists
        for c in self._buf_cols:
            del c[:]
        self._sync()
        kc = self._canon(keys, "keys")
        if kind == "put":
            v = coerce_records(cols[0], self.value_dtype, f"hash map {self.name!r}: values",
                               n=len(kc))
            self._put_prepared(kc, v)
        else:
            spec = self._spec(kind)
            names = sorted({c.input for c in spec if c.input is not None})
            arrays = {nm: np.array(cols[i]) for i, nm in enumerate(names)}
            arrays = input_columns(arrays, spec, len(kc), f"hash map {self.name!r}",
                                   self.value_dtype)
            self._upsert_prepared(kc, arrays, spec)

    def __getitem__(self, key: Any) -> Any:
        found, v = self.get([key] if not isinstance(key, np.ndarray) else key.reshape(1))
        if not found[0]:
            raise KeyError(key)
        return v[0]

    def __delitem__(self, key: Any) -> None:
        if not self.delete([key] if not isinstance(key, np.ndarray) else key.reshape(1))[0]:
            raise KeyError(key)

    def __contains__(self, key: Any) -> bool:
        try:
            return bool(self.contains([key])[0])
        except RecordTypeError:
            return False

    def __len__(self) -> int:
        self._flush()
        self._sync()
        return self._len

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys().tolist())

    def __repr__(self) -> str:
        return (f"<HashMap {self.name!r} key={self.key_dtype} value={self.value_dtype} "
                f"len={len(self)} buckets={self._n_buckets} pages={self._ps.n_pages}>")

    # -- invariants ------------------------------------------------------------------------------------
    def _check(self) -> None:
        """Assert every invariant of the pages and the in-memory index (O(pages * S))."""
        self._flush()
        self._sync()
        self._pm._check()
        ps, hdr, S = self._ps, self._hdr, self.S
        seqs = ps.seqs()
        seqs = seqs[seqs != 0]
        fr = ps.frames[seqs]
        assert np.all(hdr["kind"][fr] == Layout.HASH)
        primary = (hdr["flags"][fr] & PRIMARY).astype(bool)
        assert int(primary.sum()) == self._n_buckets
        assert sorted(hdr["aux0"][fr[primary]].tolist()) == list(range(self._n_buckets))
        ctrl = self._ctrl[fr]
        assert np.array_equal((ctrl >= FULL_BIT).sum(1), hdr["count"][fr])
        assert np.array_equal((ctrl != EMPTY).sum(1), hdr["start"][fr])
        assert np.all(hdr["start"][fr] <= self.max_fill + 0), "page overfilled"
        assert np.all((ctrl == EMPTY).any(1)), "page without an empty slot"
        total = 0
        allkeys = []
        for b in range(self._n_buckets):
            q = int(self._bucket_seq[b])
            seen = 0
            while q >= 0:
                f = ps.frames[q]
                assert int(hdr["aux0"][f]) == b
                nxt = int(hdr["next"][f])
                if nxt != NIL_INT:
                    assert nxt >> 32 == self.psid and (nxt & 0xFFFFFFFF) == self._next_of[q]
                else:
                    assert self._next_of[q] == -1
                    assert self._last_seq[b] == q
                full = self._ctrl[f] >= FULL_BIT
                k = self._keys[f][full]
                if len(k):
                    hk = self._hash(k)
                    assert np.all(self._bucket_of(hk) == b), "key in wrong bucket"
                    assert np.array_equal(self._tag_of(hk), self._ctrl[f][full]), "bad tag"
                    blk = np.flatnonzero(full) // self.G
                    has_empty = (self._ctrl[f][:self.n_blocks * self.G]
                                 .reshape(self.n_blocks, self.G) == EMPTY).any(1)
                    for home, st, at in zip(self._block_of(hk).tolist(),
                                            self._step_of(hk).tolist(), blk.tolist()):
                        for _ in range(self.n_blocks):  # every group before the key's is full
                            if home == at:
                                break
                            assert not has_empty[home], "key unreachable by probing"
                            home = (home + st) % self.n_blocks
                        assert home == at, "key off its probe sequence"
                allkeys.append(k)
                total += int(full.sum())
                seen += 1
                q = int(self._next_of[q])
            assert seen >= 1
        assert total == self._len
        if allkeys:
            k = np.concatenate(allkeys)
            assert len(np.unique(k)) == len(k), "duplicate key"
