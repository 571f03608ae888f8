"""OrderedMap: a sorted map over pages — B+-tree leaves in pages, inner levels in memory.

Layout
------
Every record lives in a *leaf* page (`Layout.BTREE_LEAF`), structure of arrays::

    [header 64 B][keys: S keys, sorted][values: S values]

Header ``count`` is the number of records (slots ``0..count-1`` are used; the
rest are garbage) and ``prev``/``next`` are the PageIDs of the neighbouring
leaves in key order (``NIL`` at the ends). The leaves form one doubly linked
chain that holds every key exactly once, ascending within and across leaves.

The inner levels of the B+-tree are *not* pages: the map keeps a redundant
in-memory *fence index* — the leaf sequence numbers in key order, each leaf's
first key (its fence) and count — and rebuilds it lazily from the chain after a
rollback, load or re-attach (paper §4.3: redundant in-memory structures "can be
rebuilt lazily"). Nothing but leaves and the super page is persisted, so a
checkpoint holds no index pages and copy-on-write never clones inner nodes.

Why not a T-tree (the paper's choice)
-------------------------------------
A T-tree node holds a sorted array *and* parent/left/right links, so every
search is a chain of per-node key comparisons and pointer hops — in Python, one
interpreter round trip per level, and rotations rewrite (and under
copy-on-write, clone) up to three pages per rebalance. Here a batch of ``n``
keys finds its leaves and slots in one compiled pass (`mmm._kernels.ordered`):
a binary search over the fences (with 64 KiB pages, 1 GB of state is ~16k
leaves: the whole "inner tree" is one 128 KiB array), then over the leaf's
keys; inserts into leaves with room are merged in place in one more pass; range
scans and ordered iteration copy contiguous sorted runs of consecutive leaves
instead of walking a tree in order. Leaf splits and merges
only touch the leaf, its new siblings and their two neighbours (links).
The price: the fence index costs O(leaves) memory and an O(leaves) array
insert/delete when leaves split or vanish (a ``memmove`` of ~128 KiB at 1 GB of
state, rare next to record updates), and it is rebuilt (O(leaves) header reads)
after a rollback or load.

Invariants (checked by `OrderedMap._check`)
-------------------------------------------
* the chain from the head (``prev == NIL``) visits every leaf page of the page
  set exactly once, with ``prev``/``next`` consistent, and equals the index order;
* keys are strictly increasing within and across leaves (no duplicates, no NaN/NaT);
* ``0 < count <= S`` for every leaf, except that a map with one leaf may have
  ``count == 0`` (an empty map keeps one empty leaf);
* the index's counts equal the headers' counts and sum to ``len``; the fence of
  each leaf equals its first key.

Leaves split evenly on overflow (into as many leaves as needed for a batch);
appends beyond the largest key fill leaves completely instead (time-ordered
state such as windows then uses full pages). On deletion an emptied leaf is
released and a leaf left less than half full is merged into it with its right
neighbour when both fit one page.

Every page write — keys, values and header fields — goes through the write
barrier `PageManager.writable`, once per operation for all pages it touches.
An operation that raises leaves the map unchanged.
"""
from __future__ import annotations

import struct
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from mmm._kernels import ordered as _ko
from mmm._kernels.pages import chain_order, copy_rows_out
from mmm.errors import PageFormatError, RecordTypeError, SchemaError
from mmm.manager import PageManager
from mmm.namespace import Namespace
from mmm.page import HEADER_BYTES, NIL_INT, Layout
from mmm.schema import as_schema, coerce_records, dtype_to_text
from mmm.structures.base import Structure, pad8
from mmm.structures.combine import (CombineOp, compile_spec, input_columns, merge_into,
                                    preaggregate_sorted)
from mmm.structures.record import (COUNT_WORD, cast, pool_views, record_struct, scalar_code,
                                   typed_view)

__all__ = ["OrderedMap"]

_U64 = np.uint64
_NIL = _U64(NIL_INT)
_MASK32 = _U64(0xFFFFFFFF)
_KEY_KINDS = "biufSMm"

Bound = Any  # a key (scalar) or None


class OrderedMap(Structure):
    """A map with sorted scalar keys and fixed-size values, stored in pages.

    Create with `OrderedMap.create`. Batch methods take numpy arrays and are the
    primary API; ``m[k]``, ``m[k] = v``, ``del m[k]``, ``k in m``, ``len`` and
    iteration (in key order) exist for convenience and run as batches of one.

    Examples
    --------
    >>> import numpy as np, mmm
    >>> from mmm.structures.ordered_map import OrderedMap
    >>> pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    >>> m = OrderedMap.create(pm, "win", key="<i8", value=[("n", "<i8")])
    >>> m.put(np.array([30, 10, 20]), np.array([(3,), (1,), (2,)], m.value_dtype))
    >>> m.range(10, 30)[0].tolist()
    [10, 20]
    >>> snap = pm.chkpt()                  # freeze; no bytes copied
    >>> m.pop_range(None, 25)[0].tolist()  # evict the window's head
    [10, 20]
    >>> pm.rollback(snap)
    >>> m.keys().tolist()
    [10, 20, 30]
    """

    KIND = "ordered_map"

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def create(cls, pm: PageManager | Namespace, name: str, key: npt.DTypeLike, value: npt.DTypeLike,
               *, page_slots: int | None = None) -> "OrderedMap":
        """Create the ordered map ``name`` or reopen it (after a restart, load or rollback).

        Parameters
        ----------
        pm : PageManager or Namespace
        name : str
            Structure name, unique in ``pm``.
        key : dtype-like
            A scalar numpy dtype with a total order: bool, integer, float,
            fixed bytes (``'S'``), datetime64 or timedelta64.
        value : dtype-like
            Any fixed-size numpy dtype (structured or scalar, no object fields).
            `upsert` needs a structured one.
        page_slots : int, optional
            Records per leaf page (default: as many as fit); tests use tiny
            values. A reopened map keeps the value it was created with.

        Runtime complexity: O(1) to create, O(leaves) to reopen lazily.
        Pages copied: 0.

        Raises
        ------
        SchemaError
            A structured, subarray, complex, object or unicode key dtype; object,
            unicode or subarray value dtypes; records that do not fit two to a page.
        SchemaMismatchError
            ``name`` exists with another kind or schema.
        ValueError
            ``page_slots`` below 2 or above what a page holds.
        """
        where = f"ordered map {name!r}"
        kdt = as_schema(key, f"{where}: key")
        if kdt.fields is not None or kdt.subdtype is not None or kdt.kind not in _KEY_KINDS:
            raise SchemaError(f"{where}: key dtype {kdt} is not an ordered scalar type "
                              f"(bool, int, uint, float, bytes 'S', datetime64, timedelta64)")
        vdt = as_schema(value, f"{where}: value")
        if vdt.subdtype is not None:
            raise SchemaError(f"{where}: value dtype {vdt} is a subarray; wrap it in a "
                              f"structured field, e.g. [('v', {vdt.base.str!r}, {vdt.shape})]")
        schema = {"key": dtype_to_text(kdt), "value": dtype_to_text(vdt)}
        obj = cls._existing(pm, name, schema)
        if obj is not None:
            return obj  # type: ignore[no-any-return]
        slots = cls._slots_for(pm.page_bytes, kdt.itemsize, vdt.itemsize, page_slots, where)
        return cls(pm, name, kdt, vdt, schema, slots)

    @staticmethod
    def _slots_for(page_bytes: int, ks: int, vs: int, page_slots: int | None, where: str) -> int:
        """Records per leaf: as many as fit, or ``page_slots`` if given and it fits."""
        s = (page_bytes - HEADER_BYTES) // (ks + vs)
        while s > 0 and HEADER_BYTES + pad8(s * ks) + s * vs > page_bytes:
            s -= 1
        if page_slots is not None:
            if (not isinstance(page_slots, (int, np.integer)) or isinstance(page_slots, bool)
                    or page_slots < 2):
                raise ValueError(f"{where}: page_slots={page_slots!r} must be an int >= 2")
            if page_slots > s:
                raise ValueError(f"{where}: page_slots={page_slots} exceeds the {s} records "
                                 f"a {page_bytes}-byte page holds")
            s = int(page_slots)
        if s < 2:
            raise SchemaError(f"{where}: records of {ks + vs} bytes do not fit two to a "
                              f"{page_bytes}-byte page")
        return s

    def __init__(self, pm: PageManager | Namespace, name: str, kdt: np.dtype[Any], vdt: np.dtype[Any],
                 schema: dict[str, str], slots: int) -> None:
        self.key_dtype = kdt
        self.value_dtype = vdt
        self._where = f"ordered map {name!r}"
        self._version = 0
        self._fgen = -1  # generation of the per-record cache (see `_fast`); -1: none
        self._spec_cache: dict[int, tuple[Any, tuple[CombineOp, ...]]] = {}
        super().__init__(pm, name, schema, {"page_slots": slots})
        if self._ps.n_pages == 1:  # new: the empty map has one empty leaf
            pm.allocate(self.psid, 1, Layout.BTREE_LEAF)
            self._gen = -1
            self._sync()

    def _views(self) -> None:
        """2-D views over the whole arena: ``_K[frame, slot]``, ``_V[frame, slot]``."""
        S, kdt, vdt = self.S, self.key_dtype, self.value_dtype
        frames = self._pm.pool.frames
        ko = HEADER_BYTES
        vo = ko + pad8(S * kdt.itemsize)
        if vo + S * vdt.itemsize > self._pm.page_bytes:
            raise PageFormatError(f"{self._where}: {S} slots of {kdt.itemsize}+{vdt.itemsize} "
                                  f"bytes do not fit {self._pm.page_bytes}-byte pages")
        ks, vs = kdt.itemsize, vdt.itemsize
        self._K = frames[:, ko:ko + S * ks].view(kdt)
        if kdt.kind in "iu":
            info = np.iinfo(kdt)
            self._kmin, self._kmax = int(info.min), int(info.max)
        self._V = frames[:, vo:vo + S * vs].view(vdt)
        self._hdr = self._pm.pool.headers
        self._hcount = self._hdr["count"]
        self._frames = frames
        self._ko, self._ks, self._vo, self._vs = ko, ks, vo, vs
        # the keys as the kernels compare them (see mmm._kernels.ordered)
        # native numeric keys: typed views; 'S' and non-native byte orders: byte rows
        native = kdt.byteorder in "=|" or (kdt.byteorder == "<") == (np.little_endian)
        self._kbytes = kdt.kind == "S" or not native
        self._kmode = 0 if kdt.kind in "Su" else 2 if kdt.kind == "f" else 1
        if self._kbytes:
            self._KK = np.lib.stride_tricks.as_strided(
                frames[:, ko:], (frames.shape[0], S, ks), (frames.strides[0], ks, 1))
        else:
            self._kview = np.dtype("<i8") if kdt.kind in "Mm" else \
                np.dtype(np.uint8) if kdt.kind == "b" else kdt
            self._KK = self._K.view(self._kview)
        self._q1 = np.zeros(1, kdt)        # one-key buffers of the range bounds
        self._q2 = np.zeros(1, kdt)
        self._q1k = self._kq(self._q1)
        self._q2k = self._kq(self._q2)
        # the per-record paths (`_fast`): Python keys and values through memoryviews
        # (integer and float64 keys only: a float32 key would need rounding first)
        kcode = scalar_code(kdt) if kdt.kind in "iu" or kdt.str in ("<f8", "=f8") else None
        self._vrs = record_struct(vdt)
        self._mvB, self._mvI = pool_views(frames)
        self._pb, self._pw = self._pm.page_bytes, self._pm.page_bytes // 4
        self._kcode = kcode if self._vrs is not None else None
        self._ktype: type = int if kdt.kind in "iu" else float
        self._kzero: Any = 0 if kdt.kind in "iu" else 0.0  # key + 0.0 turns -0.0 into 0.0
        self._klo: Any
        self._khi: Any
        if kdt.kind in "iu":
            self._klo, self._khi = self._kmin, self._kmax
        else:
            self._klo, self._khi = -np.inf, np.inf  # NaN fails both comparisons
        if self._kcode is not None:
            self._mvK = cast(self._mvB, self._kcode)
        vcode = scalar_code(vdt)
        self._vscalar = vdt.fields is None
        self._mvV = cast(self._mvB, vcode) if vcode and vcode != "e" else None
        self._vtypes: tuple[type, ...] = (tuple,) if not self._vscalar else \
            (int,) if vdt.kind in "iu" else (int, float)
        self._lf_for: tuple[int, Any, Any] = (-1, None, None)
        self._fk_for: tuple[Any, Any] = (None, None)

    def _rebuild(self) -> None:
        """Rebuild the fence index from the leaf chain (O(leaves))."""
        self._fgen = -1
        if not hasattr(self, "S"):
            self.S = int(self._params["page_slots"])
            self._views()
        ps, h = self._ps, self._hdr
        seqs = ps.seqs()
        seqs = seqs[seqs != 0]
        self._seqs = np.zeros(0, np.int64)
        self._counts = np.zeros(0, np.int64)
        self._fence = np.zeros(0, self.key_dtype)
        self._n = 0
        self._version += 1
        if len(seqs) == 0:
            return  # only between creating the super page and the first leaf
        frames = ps.frames[seqs]
        if np.any(h["kind"][frames] != Layout.BTREE_LEAF):
            raise PageFormatError(f"{self._where}: page set {self.psid} holds non-leaf pages")
        order, heads, visited = chain_order(seqs, h["prev"][frames], h["next"][frames])
        if heads != 1:
            raise PageFormatError(f"{self._where}: {heads} leaves have no predecessor "
                                  f"(expected exactly one head)")
        if visited != len(seqs):
            raise PageFormatError(f"{self._where}: the leaf chain visits {visited} of "
                                  f"{len(seqs)} leaves")
        self._seqs = np.asarray(order, dtype=np.int64)
        fr = ps.frames[self._seqs]
        self._counts = h["count"][fr].astype(np.int64)
        self._fence = self._K[fr, 0].copy()
        self._n = int(self._counts.sum())

    def _kq(self, keys: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Canonical keys (or fences) in the kernels' form: a typed 1-D array, or
        ``(n, itemsize)`` uint8 rows for byte keys. A view when ``keys`` is contiguous."""
        keys = np.ascontiguousarray(keys)
        if self._kbytes:
            return keys.view(np.uint8).reshape(len(keys), self._ks)
        return keys.view(self._kview)

    def _lf(self) -> npt.NDArray[np.int64]:
        """Frames of the leaves in key order (cached until the page table or index changes)."""
        ps = self._ps
        v, seqs, lf = self._lf_for
        if v != ps.version or seqs is not self._seqs:
            lf = ps.frames[self._seqs]
            self._lf_for = (ps.version, self._seqs, lf)
        return lf  # type: ignore[no-any-return]

    def _fk(self) -> npt.NDArray[Any]:
        """The fences in the kernels' form (a view: in-place fence updates show through)."""
        fence, fk = self._fk_for
        if fence is not self._fence:
            fk = self._kq(self._fence)
            self._fk_for = (self._fence, fk)
        return fk  # type: ignore[no-any-return]

    # -- input validation -------------------------------------------------------------------------
    def _canon(self, keys: Any, what: str = "keys") -> npt.NDArray[Any]:
        """Keys as a 1-D array of the key dtype (validated; a copy if needed)."""
        where = f"{self._where}: {what}"
        kdt = self.key_dtype
        try:
            raw = keys if isinstance(keys, np.ndarray) else np.asarray(keys)
        except (TypeError, ValueError) as exc:
            raise RecordTypeError(f"{where}: cannot convert to {kdt}: {exc}") from None
        if raw.dtype.fields is not None:
            raise RecordTypeError(f"{where}: structured keys {raw.dtype} for key dtype {kdt}")
        arr = coerce_records(raw, kdt, where)
        if raw.dtype != kdt and raw.dtype.kind in "SMm" and raw.size:
            back = arr.astype(raw.dtype)
            if not np.array_equal(back, raw.reshape(-1)):
                raise RecordTypeError(f"{where}: {raw.dtype} keys do not fit {kdt} without "
                                      f"truncation")
        if kdt.kind == "f":
            if np.isnan(arr).any():
                raise RecordTypeError(f"{where}: NaN is not a valid key")
            if (arr == 0).any():
                arr = np.where(arr == 0, kdt.type(0), arr).astype(kdt)  # -0.0 -> 0.0
        elif kdt.kind in "Mm" and np.isnat(arr).any():
            raise RecordTypeError(f"{where}: NaT is not a valid key")
        return arr

    def _values(self, values: Any, n: int) -> npt.NDArray[Any]:
        if isinstance(values, np.ndarray) and values.ndim == 0 and self.value_dtype.names:
            values = values.reshape(1)
        return coerce_records(values, self.value_dtype, f"{self._where}: values", n=n)

    def _spec(self, combine: Mapping[str, Any] | None) -> tuple[CombineOp, ...]:
        if combine is None:
            raise RecordTypeError(f"{self._where}: upsert needs a combine spec")
        hit = self._spec_cache.get(id(combine))
        if hit is not None and hit[0] is combine:
            return hit[1]
        spec = compile_spec(self.value_dtype, combine, self._where)
        if len(self._spec_cache) > 64:
            self._spec_cache.clear()
        self._spec_cache[id(combine)] = (combine, spec)
        return spec

    # -- search (compiled: mmm._kernels.ordered) ----------------------------------------------------
    def _locate(self, keys: npt.NDArray[Any], ascending: bool = False
                ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """``(leaf index, slot, found)`` of each key; slot is the lower bound in its leaf.

        One compiled pass: a binary search over the fences, then over the leaf's keys.
        """
        li, pos, found = _ko.locate(self._KK, self._lf(), self._counts, self._fk(),
                                    self._kq(keys), self._kmode)
        return li, pos, found

    def _bound1(self, x: Bound, what: str) -> bool:
        """Put range bound ``x`` into the one-key buffer ``what`` (q1 or q2); False if None."""
        if x is None:
            return False
        buf = self._q1 if what == "q1" else self._q2
        buf[0] = self._key1(x) if not isinstance(x, (list, np.ndarray)) else \
            self._canon([x], "range bound")[0]
        return True

    def _span(self, lo: Bound, hi: Bound, inclusive: tuple[bool, bool]
              ) -> tuple[int, int, int, int, int]:
        """``(leaf a, first slot, leaf b, end slot, n)`` of the records in the range:
        leaf ``a`` from its slot ``p0`` through leaf ``b`` up to its slot ``p1``."""
        if not isinstance(inclusive, tuple) or len(inclusive) != 2:
            raise ValueError(f"{self._where}: inclusive={inclusive!r} must be a pair of bools")
        has_lo = self._bound1(lo, "q1")
        has_hi = self._bound1(hi, "q2")
        return _ko.span(self._KK, self._lf(), self._counts,  # type: ignore[no-any-return]
                        self._fk(), self._q1k, has_lo, not inclusive[0],
                        self._q2k, has_hi, bool(inclusive[1]), self._kmode)

    def _gather(self, a: int, p0: int, b: int, p1: int, n: int, want_keys: bool = True,
                want_values: bool = True) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """Copies of the keys and values of a `_span`, out of the leaves in one pass each."""
        keys = np.empty(n if want_keys else 0, self.key_dtype)
        vals = np.empty(n if want_values else 0, self.value_dtype)
        if n == 0:
            return keys, vals
        fr = self._lf()[a:b + 1]
        first = np.zeros(b - a + 1, np.int64)
        cnt = self._counts[a:b + 1].copy()
        first[0] = p0
        cnt[-1] = p1
        cnt[0] -= p0
        if want_keys:
            copy_rows_out(self._frames, fr, first, cnt, self._ko, self._ks, keys.view(np.uint8))
        if want_values:
            copy_rows_out(self._frames, fr, first, cnt, self._vo, self._vs, vals.view(np.uint8))
        return keys, vals

    def _read(self, i: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """Copies of the records of leaf ``i``."""
        f = self._ps.frames[self._seqs[i]]
        c = self._counts[i]
        return self._K[f, :c].copy(), self._V[f, :c].copy()

    # -- the one writer ----------------------------------------------------------------------------
    def _commit(self, plan: dict[int, tuple[npt.NDArray[Any], npt.NDArray[Any]]], *,
                pack_full: frozenset[int] = frozenset(), merge: bool = False,
                scatter: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64],
                               npt.NDArray[Any]] | None = None) -> None:
        """Give leaves ``plan[i]`` as their new sorted records, splitting, merging and
        releasing leaves and fixing links; ``scatter = (seqs, slots, values)`` overwrites
        values in other leaves in place.

        All new pages are allocated and all touched pages made writable before the
        first byte is written, so a `PoolExhaustedError` leaves the map unchanged.
        """
        assert not (merge and scatter is not None)
        self._fgen = -1  # leaves move, split or are cloned: drop the per-record cache
        pm, ps, S, psid = self._pm, self._ps, self.S, self.psid
        L = len(self._seqs)
        out: dict[int, list[tuple[npt.NDArray[Any], npt.NDArray[Any]]]] = {}
        for i in sorted(plan):
            if i in out:
                continue  # merged into its left neighbour
            k, v = plan[i]
            n = len(k)
            if merge and 0 < n and 2 * n < S:
                j = i + 1
                while j in plan and len(plan[j][0]) == 0:  # skip leaves being emptied
                    out[j] = []
                    j += 1
                if j < L:
                    k2, v2 = plan[j] if j in plan else self._read(j)
                    if n + len(k2) <= S:
                        k, v = np.concatenate([k, k2]), np.concatenate([v, v2])
                        n = len(k)
                        out[j] = []
            if n == 0:
                out[i] = []
            elif n <= S:
                out[i] = [(k, v)]
            else:
                if i in pack_full:
                    cuts = np.arange(S, n, S)
                else:
                    parts = -(-n // S)
                    sizes = np.full(parts, n // parts)
                    sizes[:n % parts] += 1
                    cuts = np.cumsum(sizes)[:-1]
                out[i] = list(zip(np.split(k, cuts), np.split(v, cuts)))
        idx = np.array(sorted(out), dtype=np.int64)
        m = np.array([len(out[int(i)]) for i in idx], dtype=np.int64)
        if L + int((m - 1).sum()) == 0:  # everything deleted: keep one empty leaf
            out[int(idx[0])] = [(np.zeros(0, self.key_dtype), np.zeros(0, self.value_dtype))]
            m[0] = 1
        n_new = int(np.maximum(m - 1, 0).sum())
        released = self._seqs[idx[m == 0]]
        structural = n_new > 0 or len(released) > 0

        # phase 1: allocate, plan the new order and links, make everything writable
        alloc = pm.allocate(psid, n_new, Layout.BTREE_LEAF) if n_new else np.zeros(0, np.int64)
        chunks: list[tuple[int, int, tuple[npt.NDArray[Any], npt.NDArray[Any]]]] = []
        link_seqs = link_prev = link_next = np.zeros(0, np.int64)
        if structural:
            reps = np.ones(L, dtype=np.int64)
            reps[idx] = m
            offs = np.cumsum(reps) - reps
            order = np.repeat(self._seqs, reps)
            new_counts = np.repeat(self._counts, reps)
            new_fence = np.repeat(self._fence, reps)
            a = 0
            cand = []
            for i, mi in zip(idx.tolist(), m.tolist()):
                o = int(offs[i])
                for c in range(mi):
                    seq = int(self._seqs[i]) if c == 0 else int(alloc[a + c - 1])
                    order[o + c] = seq
                    chunks.append((seq, o + c, out[i][c]))
                a += max(mi - 1, 0)
                cand.append(np.arange(o - 1, o + mi + 1))
            Ln = len(order)
            pid = (_U64(psid) << _U64(32)) | order.astype(_U64)
            want_prev = np.full(Ln, _NIL, dtype=_U64)
            want_prev[1:] = pid[:-1]
            want_next = np.full(Ln, _NIL, dtype=_U64)
            want_next[:-1] = pid[1:]
            c_pos = np.unique(np.concatenate(cand))
            c_pos = c_pos[(c_pos >= 0) & (c_pos < Ln)]
            cf = ps.frames[order[c_pos]]
            dirty = c_pos[(self._hdr["prev"][cf] != want_prev[c_pos])
                          | (self._hdr["next"][cf] != want_next[c_pos])]
            link_seqs, link_prev, link_next = order[dirty], want_prev[dirty], want_next[dirty]
        else:
            for i in idx.tolist():
                chunks.append((int(self._seqs[i]), i, out[i][0]))
        touch = [np.array([c[0] for c in chunks], dtype=np.int64), link_seqs]
        if scatter is not None:
            touch.append(scatter[0])
        try:
            pm.writable(psid, np.unique(np.concatenate(touch)))
        except BaseException:
            if n_new:
                pm.release(psid, alloc)
            raise

        # phase 2: write (frames re-read after the barrier)
        K, V, hdr, frames = self._K, self._V, self._hdr, ps.frames
        counts = new_counts if structural else self._counts
        fence = new_fence if structural else self._fence
        for seq, pos, (k, v) in chunks:
            f = frames[seq]
            n = len(k)
            K[f, :n] = k
            V[f, :n] = v
            hdr["count"][f] = n
            counts[pos] = n
            if n:
                fence[pos] = k[0]
        if scatter is not None:
            V[frames[scatter[0]], scatter[1]] = scatter[2]
        if len(link_seqs):
            lf = frames[link_seqs]
            hdr["prev"][lf] = link_prev
            hdr["next"][lf] = link_next
        if len(released):
            pm.release(psid, released)
        if structural:
            self._seqs, self._counts, self._fence = order, new_counts, new_fence
        self._n = int(self._counts.sum())
        self._version += 1

    def _write_sorted(self, uk: npt.NDArray[Any], uv: npt.NDArray[Any],
                      located: tuple[Any, Any, Any] | None = None) -> None:
        """Insert or overwrite distinct, ascending keys ``uk`` with values ``uv``."""
        self._fgen = -1  # leaves are rewritten or cloned: drop the per-record cache
        li, pos, found = located if located is not None else self._locate(uk, True)
        n, L, S = len(uk), len(self._seqs), self.S
        starts = np.flatnonzero(np.r_[True, li[1:] != li[:-1]])
        ends = np.r_[starts[1:], n]
        leaves = li[starts].astype(np.int64)
        ins = np.add.reduceat((~found).astype(np.int64), starts)
        over = self._counts[leaves] + ins > S  # these leaves split: `_commit` plans them
        seqs = self._seqs[leaves[~over]]
        cnt = self._counts[leaves[~over]].copy()
        self._pm.writable(self.psid, seqs)  # before any change: may raise PoolExhaustedError
        if over.any():
            plan = {}
            pack_full = set()
            for a, b in zip(starts[over].tolist(), ends[over].tolist()):
                i = int(li[a])
                ek, ev = self._read(i)
                fm, p = found[a:b], pos[a:b]
                ev[p[fm]] = uv[a:b][fm]
                ip = p[~fm]
                plan[i] = (np.insert(ek, ip, uk[a:b][~fm]), np.insert(ev, ip, uv[a:b][~fm]))
                if i == L - 1 and ip[0] == len(ek):
                    pack_full.add(i)  # pure append at the map's end: fill leaves completely
            self._commit(plan, pack_full=frozenset(pack_full))
        if len(seqs) == 0:
            return
        # the leaves with room: one compiled in-place merge (seqs keep their leaves)
        fits = np.repeat(~over, ends - starts)
        group = np.repeat(np.arange(len(seqs)), (ends - starts)[~over])
        frames = self._ps.frames[seqs]
        kb = np.ascontiguousarray(uk[fits]).view(np.uint8).reshape(-1, self._ks)
        vb = np.ascontiguousarray(uv[fits]).view(np.uint8).reshape(-1, self._vs)
        _ko.merge_into_leaves(self._frames, frames, cnt, group, pos[fits], found[fits],
                              self._ko, self._ks, self._vo, self._vs, kb, vb)
        idx = leaves[~over] if not over.any() else np.flatnonzero(np.isin(self._seqs, seqs))
        self._hdr["count"][frames] = cnt
        self._counts[idx] = cnt
        self._fence[idx] = self._K[frames, 0]
        self._n = int(self._counts.sum())
        self._version += 1

    # -- batch API ---------------------------------------------------------------------------------
    def put(self, keys: npt.ArrayLike, values: Any) -> None:
        """Insert or overwrite ``keys[i] -> values[i]``; a key repeated in the batch: last wins.

        Parameters
        ----------
        keys : array_like
            Keys (any order, duplicates allowed) castable to the key dtype.
        values : array_like
            One value per key: an array of the value dtype (or with the same
            field names), or a sequence of tuples.

        Runtime complexity: O(n log n + n log S + touched leaves * S), plus
        O(leaves) when leaves split. Pages copied: at most the leaves touched
        plus, per split leaf, its right neighbour (its ``prev`` link), once per
        snapshot; new leaves are fresh pages, not copies.

        Raises
        ------
        RecordTypeError
            Keys or values of the wrong dtype, shape or length, NaN/NaT keys.
        PoolExhaustedError
            No frame for a split or clone. In both cases the map is unchanged.
        """
        self._sync()
        k = self._canon(keys)
        v = self._values(values, len(k))
        if len(k) == 0:
            return
        order = np.argsort(k, kind="stable")
        sk = k[order]
        last = np.ones(len(sk), dtype=bool)
        last[:-1] = sk[1:] != sk[:-1]
        self._write_sorted(sk[last], v[order[last]])

    def upsert(self, keys: npt.ArrayLike, values: Any = None,
               combine: Mapping[str, Any] | None = None) -> None:
        """Aggregate input records into the map: insert new keys, combine existing ones.

        Parameters
        ----------
        keys : array_like
            One key per input record (duplicates allowed).
        values : structured array or mapping of column -> array, optional
            The input columns the combine spec reads (may hold columns that are
            not value fields, e.g. ``{"ts": ts}``).
        combine : dict
            ``{value_field: op or (op, input_column)}``, ops count/sum/min/max/
            last/first; see `mmm.structures.combine`. Needs a structured value
            dtype. Fields not named are zero on insert and unchanged on update.

        Runtime complexity: O(n log n) (one stable sort) plus the cost of `put`.
        Pages copied: as `put`.

        Raises
        ------
        RecordTypeError
            Keys of the wrong dtype or shape, a scalar value dtype, a bad combine
            spec, missing or mis-sized input columns; the map is unchanged.

        Examples
        --------
        >>> import numpy as np, mmm
        >>> from mmm.structures.ordered_map import OrderedMap
        >>> pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
        >>> m = OrderedMap.create(pm, "agg", key="<u4",
        ...                       value=[("n", "<i8"), ("lo", "<i8"), ("hi", "<i8")])
        >>> spec = {"n": "count", "lo": ("min", "ts"), "hi": ("max", "ts")}
        >>> m.upsert(np.array([7, 7, 9], "<u4"), {"ts": np.array([5, 3, 4])}, spec)
        >>> m[7].tolist()
        (2, 3, 5)
        """
        self._sync()
        spec = self._spec(combine)
        k = self._canon(keys)
        cols = input_columns(values, spec, len(k), self._where, self.value_dtype)
        if len(k) == 0:
            return
        order = np.argsort(k, kind="stable")  # stable: "first"/"last" follow batch order
        sk = k[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        uniq = sk[starts]
        new = preaggregate_sorted(order, starts, spec, cols, self.value_dtype)
        li, pos, found = self._locate(uniq, True)
        if found.any():
            fr = self._ps.frames[self._seqs[li[found]]]
            new[found] = merge_into(self._V[fr, pos[found]], new[found], spec)
        self._write_sorted(uniq, new, (li, pos, found))

    def get(self, keys: npt.ArrayLike, default: Any = None
            ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[Any]]:
        """Look keys up: ``(found, values)``; missing keys get ``default`` (zeros if None).

        Runtime complexity: O(n log leaves + n log S). Pages copied: 0.

        Raises
        ------
        RecordTypeError
            Keys of the wrong dtype or shape.
        """
        self._sync()
        k = self._canon(keys)
        out = np.zeros(len(k), dtype=self.value_dtype)
        if default is not None:
            out[:] = default
        if len(k) == 0:
            return np.zeros(0, dtype=bool), out
        li, pos, found = self._locate(k)
        if found.any():
            out[found] = self._V[self._ps.frames[self._seqs[li[found]]], pos[found]]
        return found, out

    def contains(self, keys: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Boolean mask: which keys are present. Runtime complexity: as `get`. Pages copied: 0."""
        self._sync()
        k = self._canon(keys)
        return self._locate(k)[2] if len(k) else np.zeros(0, dtype=bool)

    def delete(self, keys: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Delete keys; return which were present (a repeated key is True each time).

        Runtime complexity: O(n log n + touched leaves * S), plus O(leaves) when
        leaves are released. Pages copied: at most three per leaf touched (the
        leaf, a merge neighbour's successor and a released leaf's predecessor,
        whose links change), once per snapshot.

        Raises
        ------
        RecordTypeError
            Keys of the wrong dtype or shape (map unchanged).
        """
        self._sync()
        k = self._canon(keys)
        if len(k) == 0:
            return np.zeros(0, dtype=bool)
        li, pos, found = self._locate(k)
        if not found.any():
            return found
        code = np.unique(li[found].astype(np.int64) * self.S + pos[found])
        leaf, slot = code // self.S, code % self.S
        starts = np.flatnonzero(np.r_[True, leaf[1:] != leaf[:-1]])
        plan = {}
        for a, b in zip(starts.tolist(), np.r_[starts[1:], len(leaf)].tolist()):
            i = int(leaf[a])
            ek, ev = self._read(i)
            keep = np.ones(len(ek), dtype=bool)
            keep[slot[a:b]] = False
            plan[i] = (ek[keep], ev[keep])
        self._commit(plan, merge=True)
        return found

    def range(self, lo: Bound = None, hi: Bound = None, *,
              inclusive: tuple[bool, bool] = (True, False)
              ) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """Keys and values with ``lo <= key < hi`` (bounds per ``inclusive``), in key order.

        ``None`` leaves a side unbounded. Returns copies.
        Runtime complexity: O(log leaves + log S + leaves spanned * S).
        Pages copied: 0.

        Raises
        ------
        RecordTypeError
            A bound of the wrong dtype.
        """
        self._sync()
        return self._gather(*self._span(lo, hi, inclusive))

    def pop_range(self, lo: Bound = None, hi: Bound = None, *,
                  inclusive: tuple[bool, bool] = (True, False)
                  ) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """Delete and return the records of `range` (window eviction).

        Leaves wholly inside the range are released without being rewritten.
        Runtime complexity: as `range` plus O(leaves) when leaves are released.
        Pages copied: at most 3 (boundary leaves that keep records, and leaves
        whose links change), however many leaves the range spans.

        Raises
        ------
        RecordTypeError
            A bound of the wrong dtype (map unchanged).
        """
        self._sync()
        a, pa, b, pb, n = self._span(lo, hi, inclusive)
        keys, vals = self._gather(a, pa, b, pb, n)
        if n == 0:
            return keys, vals
        empty = (np.zeros(0, self.key_dtype), np.zeros(0, self.value_dtype))
        plan = {i: empty for i in range(a + 1, b)}
        ka, va = self._read(a)
        if a == b:
            plan[a] = (np.concatenate([ka[:pa], ka[pb:]]), np.concatenate([va[:pa], va[pb:]]))
        else:
            kb, vb = self._read(b)
            plan[a] = (ka[:pa], va[:pa])
            plan[b] = (kb[pb:], vb[pb:])
        self._commit(plan, merge=True)
        return keys, vals

    def clear(self) -> None:
        """Delete every record; one empty leaf remains. Pages copied: at most 1."""
        self._sync()
        if self._n == 0:
            return
        empty = (np.zeros(0, self.key_dtype), np.zeros(0, self.value_dtype))
        self._commit({i: empty for i in range(len(self._seqs))})

    def items(self) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """All ``(keys, values)`` in key order (copies).

        Runtime complexity: O(leaves * S). Pages copied: 0.
        """
        return self.range()

    def keys(self) -> npt.NDArray[Any]:
        """All keys in ascending order (a copy).

        Runtime complexity: O(leaves * S). Pages copied: 0.
        """
        self._sync()
        return self._gather(*self._span(None, None, (True, False)), want_values=False)[0]

    def values(self) -> npt.NDArray[Any]:
        """All values in key order (a copy).

        Runtime complexity: O(leaves * S). Pages copied: 0.
        """
        self._sync()
        return self._gather(*self._span(None, None, (True, False)), want_keys=False)[1]

    def min_key(self) -> Any:
        """The smallest key. Runtime complexity: O(1). Pages copied: 0.

        Raises
        ------
        ValueError
            If the map is empty.
        """
        self._sync()
        if self._n == 0:
            raise ValueError(f"{self._where} is empty: no min_key")
        return self._K[self._ps.frames[self._seqs[0]], 0]

    def max_key(self) -> Any:
        """The largest key. Runtime complexity: O(1). Pages copied: 0.

        Raises
        ------
        ValueError
            If the map is empty.
        """
        self._sync()
        if self._n == 0:
            raise ValueError(f"{self._where} is empty: no max_key")
        return self._K[self._ps.frames[self._seqs[-1]], self._counts[-1] - 1]

    # -- per-record operations ---------------------------------------------------------------------
    # ``m[k] = v``, ``del m[k]``, ``m[k]``, ``k in m`` and `range_lists` with Python int keys
    # (float for float64 keys) and values run in plain Python (`mmm.structures.record`):
    # `bisect` over memoryviews of the fences and of the leaf's keys, memoryview slice moves
    # (memmove) within the leaf, no numpy object. The header count, ``_counts``, ``_fence``
    # and ``_n`` are written in place at once, so every other operation sees exact state.
    # `_fast` caches the leaf frames and which leaves passed the write barrier since it was
    # built; the writers (`_commit`, `_write_sorted`), a rebuild and a snapshot, rollback or
    # load (`_flush`) drop the cache, so a leaf a snapshot shares is cloned before its first
    # write. What this path does not handle (other key or value types, a leaf that splits,
    # merges or empties, a fence that moves) is a batch of one.
    def _flush(self) -> None:
        """Called by the page manager before a snapshot, a rollback or a load."""
        self._fgen = -1

    def _fast(self) -> bool:
        """Build the per-record cache; False if the schema has no plain-Python path.

        Per leaf (in key order): its frame (``_lfl``), the index of its first key in the
        key memoryview (``_kbl``), the byte offset of its values (``_vbl``) and whether
        it passed the write barrier since the cache was built (``_wl``)."""
        self._sync()
        if self._kcode is None:
            return False
        lfl: list[int] = self._lf().tolist()
        self._lfl = lfl
        self._kbl = [(f * self._pb + self._ko) // self._ks for f in lfl]
        self._vbl = [f * self._pb + self._vo for f in lfl]
        self._wl = [False] * len(lfl)
        self._cmv = typed_view(self._counts, "q")
        self._fmv = typed_view(self._fence, self._kcode)
        self._fgen = self._pm.generation
        return True

    def _at(self, key: Any) -> tuple[int, int, bool, Any] | None:
        """``(leaf index, lower-bound slot, found, key)`` of a Python key on the per-record
        path (the key as stored: ``-0.0`` becomes ``0.0``), or None if ``key`` takes the
        batch path (another type, out of range, NaN, or a schema without this path)."""
        if (type(key) is self._ktype and self._klo <= key <= self._khi
                and (self._fgen == self._pm.generation or self._fast())):
            k = key + self._kzero
            kbl = self._kbl
            i = bisect_right(self._fmv, k, 1, len(kbl)) - 1
            b = kbl[i]
            c = self._cmv[i]
            p = bisect_left(self._mvK, k, b, b + c) - b
            return i, p, p < c and self._mvK[b + p] == k, k
        return None

    def _wleaf(self, i: int) -> None:
        """Pass leaf ``i`` through the write barrier (cloned if a snapshot shares it)."""
        f = self._pm.writable1(self.psid, int(self._seqs[i]))
        self._lfl[i] = f
        self._kbl[i] = (f * self._pb + self._ko) // self._ks
        self._vbl[i] = f * self._pb + self._vo
        self._wl[i] = True

    def _key1(self, key: Any) -> Any:
        """One key (a range bound) as a numpy scalar of the key dtype, validated as
        `_canon` does."""
        kdt = self.key_dtype
        t = type(key)
        if t is int and kdt.kind in "iu":
            if self._kmin <= key <= self._kmax:
                return kdt.type(key)
        elif t is float and kdt.kind == "f":
            if key == key:  # not NaN
                return kdt.type(key + 0.0)  # -0.0 -> 0.0
        elif t is bytes and kdt.kind == "S":
            if len(key) <= kdt.itemsize:
                return kdt.type(key)
        elif isinstance(key, np.generic) and key.dtype == kdt and kdt.kind not in "fMm":
            return key
        return self._canon(self._one(key))[0]

    @staticmethod
    def _one(key: Any) -> Any:
        return key.reshape(1) if isinstance(key, np.ndarray) else [key]

    def __getitem__(self, key: Any) -> Any:
        """The value of ``key`` (a numpy scalar or record, a copy).

        Runtime complexity: O(log leaves + log S). Pages copied: 0.

        Raises
        ------
        KeyError
            If ``key`` is absent.
        RecordTypeError
            If ``key`` has the wrong dtype.
        """
        at = self._at(key)
        if at is not None:
            i, p, found, _ = at
            if not found:
                raise KeyError(key)
            return self._V[self._lfl[i], p:p + 1].copy()[0]
        hit, v = self.get(self._one(key))
        if not hit[0]:
            raise KeyError(key)
        return v[0]

    def __setitem__(self, key: Any, value: Any) -> None:
        """Insert or overwrite one record.

        Runtime complexity: O(log leaves + S) (a memmove within the leaf).
        Pages copied: at most 1, or as `put` when the leaf splits.

        Raises
        ------
        RecordTypeError
            If the key or value has the wrong type (the map is unchanged).
        """
        if type(value) in self._vtypes and (at := self._at(key)) is not None:
            rs = self._vrs
            try:
                vb = rs.pack(value) if self._vscalar else rs.pack(*value)  # type: ignore[union-attr]
            except (struct.error, OverflowError, TypeError):
                vb = None  # numpy decides: it casts what `struct` refuses, or raises
            i, p, found, k = at
            c = self._cmv[i]
            if vb is not None and (found or c < self.S):
                if not self._wl[i]:
                    self._wleaf(i)
                vs = self._vs
                va = self._vbl[i] + p * vs
                if not found:
                    K, mv = self._mvK, self._mvB
                    kp = self._kbl[i] + p
                    if p < c:  # memmove the records after p one slot up
                        n = c - p
                        K[kp + 1:kp + 1 + n] = K[kp:kp + n]
                        mv[va + vs:va + vs + n * vs] = mv[va:va + n * vs]
                    K[kp] = k
                    self._mvI[self._lfl[i] * self._pw + COUNT_WORD] = c + 1
                    self._cmv[i] = c + 1
                    self._n += 1
                    if p == 0:
                        self._fmv[i] = k
                self._mvB[va:va + vs] = vb
                self._version += 1
                return
        self.put(self._one(key), value.reshape(1) if isinstance(value, np.ndarray) else [value])

    def __delitem__(self, key: Any) -> None:
        """Delete one key. Pages copied: at most 1 (or as `delete` when leaves merge).

        Raises
        ------
        KeyError
            If ``key`` is absent.
        RecordTypeError
            If ``key`` has the wrong dtype.
        """
        at = self._at(key)
        if at is not None:
            i, p, found, _ = at
            if not found:
                raise KeyError(key)
            c = self._cmv[i]
            if not (c == 1 or (c - 1 < self.S // 2 and len(self._lfl) > 1) or (p == 0 and i > 0)):
                if not self._wl[i]:
                    self._wleaf(i)
                kp = self._kbl[i] + p
                n = c - 1 - p
                if n:  # memmove the records after p one slot down
                    K, mv, vs = self._mvK, self._mvB, self._vs
                    va = self._vbl[i] + p * vs
                    K[kp:kp + n] = K[kp + 1:kp + 1 + n]
                    mv[va:va + n * vs] = mv[va + vs:va + vs + n * vs]
                self._mvI[self._lfl[i] * self._pw + COUNT_WORD] = c - 1
                self._cmv[i] = c - 1
                self._n -= 1
                if p == 0:
                    self._fmv[i] = self._mvK[kp]
                self._version += 1
                return
            # the leaf may merge or empty, or its fence moves: the batch path handles it
        if not self.delete(self._one(key))[0]:
            raise KeyError(key)

    def __contains__(self, key: Any) -> bool:
        at = self._at(key)
        if at is not None:
            return at[2]
        try:
            return bool(self.contains(self._one(key))[0])
        except RecordTypeError:
            return False

    def range_lists(self, lo: Bound = None, hi: Bound = None, *,
                    inclusive: tuple[bool, bool] = (True, False)) -> tuple[list[Any], list[Any]]:
        """`range` as two Python lists ``(keys, values)``: the per-record form.

        Values are Python numbers for a scalar value dtype, tuples (as
        ``np.void.item()``) for a structured one. With Python int bounds (float for
        float64 keys) no numpy object is created.

        Runtime complexity: O(log leaves + log S + records). Pages copied: 0.

        Raises
        ------
        RecordTypeError
            A bound of the wrong dtype.
        ValueError
            ``inclusive`` is not a pair.
        """
        kt, klo, khi = self._ktype, self._klo, self._khi
        if ((lo is None or (type(lo) is kt and klo <= lo <= khi))
                and (hi is None or (type(hi) is kt and klo <= hi <= khi))
                and type(inclusive) is tuple and len(inclusive) == 2
                and (self._fgen == self._pm.generation or self._fast())):
            kbl, cmv, K = self._kbl, self._cmv, self._mvK
            L = len(kbl)
            a = p0 = 0
            b = L - 1
            p1 = cmv[b]
            if lo is not None:
                lo += self._kzero
                a = bisect_right(self._fmv, lo, 1, L) - 1
                base = kbl[a]
                p0 = (bisect_left if inclusive[0] else bisect_right)(
                    K, lo, base, base + cmv[a]) - base
            if hi is not None:
                hi += self._kzero
                b = bisect_right(self._fmv, hi, 1, L) - 1
                base = kbl[b]
                # gallop from the lower bound (a short range costs a probe or two), then
                # bisect the bracket: K[< j] are in the range, K[probe] is not
                j = base + (p0 if b == a else 0)
                end = base + cmv[b]
                probe, step, right = j, 1, inclusive[1]
                while probe < end and (K[probe] <= hi if right else K[probe] < hi):
                    j = probe + 1
                    probe = j + step
                    step <<= 1
                p1 = (bisect_right if right else bisect_left)(K, hi, j, min(probe, end)) - base
            if a == b:
                return self._run(a, p0, p1)
            keys: list[Any] = []
            vals: list[Any] = []
            for leaf in range(a, b + 1):
                kk, vv = self._run(leaf, p0 if leaf == a else 0, p1 if leaf == b else cmv[leaf])
                keys += kk
                vals += vv
            return keys, vals
        k, v = self.range(lo, hi, inclusive=inclusive)
        return k.tolist(), v.tolist()

    def _run(self, i: int, s: int, e: int) -> tuple[list[Any], list[Any]]:
        """Keys and values of slots ``[s, e)`` of leaf ``i`` as Python lists (cache built)."""
        if e <= s:
            return [], []
        kb = self._kbl[i]
        vb = self._vbl[i]
        vs = self._vs
        if self._mvV is not None:
            return (self._mvK[kb + s:kb + e].tolist(),
                    self._mvV[vb // vs + s:vb // vs + e].tolist())
        vals = list(self._vrs.iter_unpack(self._mvB[vb + s * vs:vb + e * vs]))  # type: ignore[union-attr]
        return self._mvK[kb + s:kb + e].tolist(), [v[0] for v in vals] if self._vscalar else vals

    def __len__(self) -> int:
        self._sync()
        return self._n

    def __iter__(self) -> Iterator[Any]:
        """Keys in ascending order (numpy scalars), one leaf copied at a time.

        Raises
        ------
        RuntimeError
            If the map changes during iteration.
        """
        self._sync()
        ver, gen = self._version, self._pm.generation
        for i in range(len(self._seqs)):
            for k in self._read(i)[0]:
                yield k
                if self._version != ver or self._pm.generation != gen:
                    raise RuntimeError(f"{self._where} changed during iteration")

    def __repr__(self) -> str:
        self._sync()
        return (f"<OrderedMap {self.name!r} key={self.key_dtype} value={self.value_dtype} "
                f"len={self._n} leaves={len(self._seqs)} slots={self.S}>")

    # -- invariants --------------------------------------------------------------------------------
    def _check(self) -> None:
        """Assert every invariant of the leaves, their chain and the fence index (O(leaves * S))."""
        self._sync()
        self._pm._check()
        ps, hdr, S, psid = self._ps, self._hdr, self.S, self.psid
        seqs = ps.seqs()
        leaves = seqs[seqs != 0]
        L = len(self._seqs)
        assert L >= 1, "no leaf"
        assert len(np.unique(self._seqs)) == L, "leaf twice in the index"
        assert np.array_equal(np.sort(self._seqs), leaves), "index and page set disagree"
        fr = ps.frames[self._seqs]
        assert np.all(hdr["kind"][fr] == Layout.BTREE_LEAF)
        pid = (_U64(psid) << _U64(32)) | self._seqs.astype(_U64)
        prev, nxt = hdr["prev"][fr], hdr["next"][fr]
        assert prev[0] == _NIL and nxt[-1] == _NIL, "chain ends"
        assert np.array_equal(prev[1:], pid[:-1]), "prev links"
        assert np.array_equal(nxt[:-1], pid[1:]), "next links"
        cnt = hdr["count"][fr].astype(np.int64)
        assert np.array_equal(cnt, self._counts), "index counts"
        assert np.all(cnt <= S), "leaf overfull"
        assert L == 1 or np.all(cnt > 0), "empty leaf in a map of several leaves"
        assert self._n == int(cnt.sum())
        assert len(self._fence) == L
        nonempty = cnt > 0
        assert np.array_equal(self._fence[nonempty], self._K[fr[nonempty], 0]), "fences"
        keys = self.keys()
        assert len(keys) == self._n
        assert np.all(keys[1:] > keys[:-1]), "keys not strictly increasing"
        if self.key_dtype.kind == "f":
            assert not np.isnan(keys).any()
        elif self.key_dtype.kind in "Mm":
            assert not np.isnat(keys).any()
        fresh = self.__class__.__new__(self.__class__)
        fresh.__dict__.update(self.__dict__)
        fresh._rebuild()
        assert np.array_equal(fresh._seqs, self._seqs), "chain order differs from the index"
