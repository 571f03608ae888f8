"""HashMap: an unordered map over pages, organized by linear hashing (Litwin 1980).

Layout
------
Bucket ``b`` is a chain of pages: a primary page (header flag ``PRIMARY``,
``aux0 = b``) and overflow pages linked by the header's ``next`` PageID. Inside
a page, slots form an open-addressing table probed by *groups* of 16 slots. A
map is created in layout 2, which keeps each group's bytes together, so a probe
reads its group's ctrl bytes and the matching record from neighbouring cache
lines of one 4 KiB page::

    [header 64 B][group 0][group 1]...  group = [16 ctrl][16 records: key, pad, value]

(the key is padded to 8 bytes when the value size is a multiple of 8, and the
record to 8 bytes when the key size is). Maps written before it are in layout
1 and stay in it (the ``layout`` parameter of the structure's metadata; absent
means 1), read and written by the same kernels::

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

Every operation is one pass of a compiled kernel (`mmm._kernels.hashmap`) over
the batch, in input order: hash (splitmix64 over the key's bytes), probe,
insert into the first free slot of the key's probe sequence in the last page of
its chain, and combine the row into the stored value. Splits, merges and
compactions are one kernel (`rechain`) that gathers the records of the chains
concerned and places them again. A kernel never writes a frame a snapshot
still pins and never allocates: it stops at the row that needs a page cloned,
an overflow page or a split, the Python side does that, and the kernel goes on
from that row. Per-record writes are validated when they arrive, buffered, and
applied as one batch before any read (`HashMap.upserter`).

Failed calls change nothing. Bad input is refused before any write. A batch
that may need more free frames than the pool has runs under an internal
snapshot of the map's pages: if the pool runs out, the map is rolled back to
the state before the call and `PoolExhaustedError` is raised.

The in-memory index (bucket -> primary page, page -> next page, bucket -> last
page, length) is redundant with the pages and rebuilt lazily.
"""
from __future__ import annotations

import array
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from mmm._kernels import hashmap as K
from mmm.errors import PoolExhaustedError, RecordTypeError, SchemaError
from mmm.manager import PageManager
from mmm.namespace import Namespace
from mmm.page import HEADER_BYTES, NIL_INT, Layout
from mmm.pool import HARD_PIN
from mmm.schema import as_schema, coerce_records, dtype_to_text
from mmm.structures.base import Structure, pad8
from mmm.structures.combine import CombineOp, compile_spec, input_columns

__all__ = ["HashMap"]

EMPTY, TOMB = 0, 1
FULL_BIT = 0x80
PRIMARY = 1
_U64 = np.uint64
_MASK32 = _U64(0xFFFFFFFF)


def _prev_prime(n: int) -> int:
    """The largest prime <= n (n >= 1; 1 for n == 1)."""
    for m in range(n, 1, -1):
        if all(m % d for d in range(2, int(m ** 0.5) + 1)):
            return m
    return 1


def _check_bytes_width(raw: Any, dt: np.dtype[Any], where: str) -> None:
    """Refuse fixed-width bytes values longer than the field (numpy would truncate them)."""
    if dt.kind == "S":
        if isinstance(raw, np.ndarray) and raw.dtype.kind == "S":
            if raw.dtype.itemsize <= dt.itemsize or not raw.size:
                return
            lens = np.char.str_len(raw)
        else:
            try:
                arr = np.asarray(raw)
            except (TypeError, ValueError):
                return  # coerce_records reports it
            if arr.dtype.kind != "S" or arr.dtype.itemsize <= dt.itemsize or not arr.size:
                return
            lens = np.char.str_len(arr)
        if (lens > dt.itemsize).any():
            bad = np.flatnonzero(np.ravel(lens > dt.itemsize))[0]
            raise RecordTypeError(f"{where}: a bytes value of {int(np.ravel(lens)[bad])} bytes "
                                  f"is longer than {dt} (at index {int(bad)}); it would be "
                                  f"truncated")
    elif dt.fields is not None:
        names = [n for n in dt.names or () if dt.fields[n][0].kind == "S"
                 or dt.fields[n][0].fields is not None]
        if not names:
            return
        if isinstance(raw, np.ndarray) and raw.dtype.fields is not None:
            for n in names:
                if n in (raw.dtype.names or ()):
                    _check_bytes_width(raw[n], dt.fields[n][0], f"{where}.{n}")
            return
        if isinstance(raw, tuple):
            raw = [raw]
        try:
            rows = list(raw)
        except TypeError:
            return
        for n in names:
            pos = (dt.names or ()).index(n)
            col = [r[pos] for r in rows if isinstance(r, (tuple, list)) and len(r) > pos]
            _check_bytes_width(col, dt.fields[n][0], f"{where}.{n}")


_TYPECODES = {(np.dtype(tc).kind, np.dtype(tc).itemsize): tc for tc in "bBhHiIlLqQfd"}


def _typed_buffer(dt: np.dtype[Any] | None) -> "array.array[Any] | None":
    """A C-typed append buffer for values of ``dt`` (integers checked for range by
    ``append``), or None when ``dt`` needs a Python-level check (floats keys refuse NaN,
    bytes, structures, big-endian)."""
    if dt is None or dt.fields is not None or dt.kind not in "iuf" or not dt.isnative \
            or sys.byteorder != "little":
        return None
    tc = _TYPECODES.get((dt.kind, dt.itemsize))
    return array.array(tc) if tc is not None else None


class _Filled:
    """A per-record buffer column preallocated and filled by index (`HashMap.upserter`):
    ``len`` is the writer's fill count, ``del buf[:]`` resets it."""

    __slots__ = ("arr", "count", "reset")

    def __init__(self, arr: "array.array[Any]", count: Callable[[], int],
                 reset: Callable[[], None]) -> None:
        self.arr = arr
        self.count = count
        self.reset = reset

    def __len__(self) -> int:
        return self.count()

    def __delitem__(self, _: slice) -> None:
        self.reset()


def _buffered(buf: Any) -> Any:
    """The buffered values as an array (a copy: the buffer is cleared afterwards)."""
    if isinstance(buf, _Filled):
        return np.frombuffer(buf.arr, dtype=buf.arr.typecode)[:len(buf)].copy()
    if isinstance(buf, array.array):
        return np.frombuffer(buf, dtype=buf.typecode).copy()
    return buf if buf and not isinstance(buf[0], (int, float)) else np.array(buf)


class _Never:
    """A type no value has: per-record fast paths that never apply."""


class _Lanes:
    """A compiled combine spec: op/field arrays for the kernel and the input lanes."""

    __slots__ = ("ops", "codes", "offs", "sizes", "lanes", "lidx", "aligned", "kinds",
                 "dtypes", "inputs", "spec")

    def __init__(self, spec: tuple[CombineOp, ...], vdt: np.dtype[Any], vo: int, where: str
                 ) -> None:
        n = len(spec)
        self.spec = spec
        self.ops = np.empty(n, np.int64)
        self.codes = np.empty(n, np.int64)
        self.offs = np.empty(n, np.int64)
        self.sizes = np.empty(n, np.int64)
        self.lanes = np.empty(n, np.int64)
        self.lidx = np.empty(n, np.int64)
        self.aligned = np.empty(n, np.bool_)
        self.kinds: list[int] = []
        self.dtypes: list[np.dtype[Any]] = []
        counts = [0, 0, 0, 0]
        vs = vdt.itemsize
        fields = vdt.fields
        for j, c in enumerate(spec):
            assert fields is not None
            fdt, off = fields[c.field][0], int(fields[c.field][1])
            key = f"{fdt.kind}{fdt.itemsize}"
            if fdt.kind in "iub" and fdt.subdtype is None and key in K.DTYPE_CODES:
                lane = K.L_UINT if key == "u8" else K.L_INT
                code = K.DTYPE_CODES[key]
            elif fdt.kind in "Mm":
                lane, code = K.L_INT, K.I8
            elif fdt.kind == "f" and key in ("f4", "f8"):
                lane, code = K.L_FLOAT, K.DTYPE_CODES[key]
            else:
                lane, code = K.L_BYTES, K.BYTES
                if c.op in ("count", "sum") or (c.op in ("min", "max") and fdt.kind != "S"):
                    raise RecordTypeError(
                        f"{where}: combine[{c.field!r}]: {c.op} is not supported on a field "
                        f"of dtype {fdt} (first/last are; min/max also on bytes 'S')")
            self.ops[j] = K.OP_CODES[c.op]
            self.codes[j] = code
            self.offs[j] = off
            self.sizes[j] = fdt.itemsize
            self.lanes[j] = lane
            isz = fdt.itemsize
            self.aligned[j] = lane != K.L_BYTES and (vo + off) % isz == 0 and vs % isz == 0
            if c.op == "count":
                self.lidx[j] = 0
            elif lane == K.L_BYTES:
                self.lidx[j] = counts[3]
                counts[3] += isz
            else:
                self.lidx[j] = counts[lane]
                counts[lane] += 1
            self.kinds.append(lane)
            self.dtypes.append(fdt)
        self.inputs = counts

    def columns(self, cols: Mapping[str, npt.NDArray[Any]], n: int, where: str
                ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64],
                           npt.NDArray[np.float64], npt.NDArray[np.uint8]]:
        """The input lanes of ``n`` rows (`input_columns` validated them: integers fit
        their fields, casts are same-kind)."""
        ic = np.empty((self.inputs[K.L_INT], n), np.int64)
        uc = np.empty((self.inputs[K.L_UINT], n), np.uint64)
        fc = np.empty((self.inputs[K.L_FLOAT], n), np.float64)
        bc = np.empty((n, self.inputs[K.L_BYTES]), np.uint8)
        for j, c in enumerate(self.spec):
            if c.op == "count":
                continue
            col = cols[c.input]  # type: ignore[index]
            fdt = self.dtypes[j]
            lane = self.kinds[j]
            at = int(self.lidx[j])
            if lane == K.L_INT:
                ic[at] = col.astype(fdt).view(np.int64) if fdt.kind in "Mm" else col
            elif lane == K.L_UINT:
                uc[at] = col
            elif lane == K.L_FLOAT:
                fc[at] = col.astype(fdt)
            else:
                _check_bytes_width(col, fdt, f"{where}: input column {c.input!r}")
                bc[:, at:at + fdt.itemsize] = np.ascontiguousarray(
                    col.astype(fdt)).view(np.uint8).reshape(n, fdt.itemsize)
        return ic, uc, fc, bc


class HashMap(Structure):
    """A map from fixed-size keys to fixed-size values stored in pages.

    Create with `HashMap.create`. Batch methods take numpy arrays and are the
    primary API; ``m[k]``, ``m[k] = v``, ``del m[k]``, ``k in m``, ``len`` and
    iteration exist for convenience (writes made through them are validated
    at once, buffered and applied as one batch before any other operation or
    snapshot).
    """

    KIND = "hash_map"
    MAX_LOAD = 0.6
    MIN_LOAD = 0.15
    PAGE_FILL = 0.85
    _BUFFER_LIMIT = 65536
    GROUP = 16
    LAYOUT = 2  # the page layout of new maps (module docstring)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def create(cls, pm: PageManager | Namespace, name: str, key: npt.DTypeLike, value: npt.DTypeLike,
               *, page_slots: int | None = None, expected_keys: int | None = None
               ) -> "HashMap":
        """Create the map ``name`` or reopen it (after a restart, load or rollback).

        Parameters
        ----------
        pm : PageManager or Namespace
        name : str
            Structure name, unique in ``pm``.
        key, value : dtype-like
            Fixed-size numpy dtypes (structured or scalar, no object fields).
        page_slots : int, optional
            Slots per page (default: as many as fit); tests use tiny values. A
            number only the earlier page layout holds (an old map's geometry)
            creates the map in that layout.
        expected_keys : int, optional
            A capacity hint: a new map starts with the buckets ``expected_keys``
            keys need (as a table sized up front), so filling it splits no
            bucket. Ignored when the map already exists; the map still grows
            past it, and shrinks below it only after deletes.

        Raises
        ------
        SchemaError
            Object, unicode or zero-sized fields.
        SchemaMismatchError
            ``name`` exists with another kind or schema.
        ValueError
            ``page_slots`` or ``expected_keys`` out of range (nothing created).
        PoolExhaustedError
            The pool has too few free frames for the pages ``expected_keys``
            needs (nothing created).
        """
        kdt = as_schema(key, f"hash map {name!r}: key")
        vdt = as_schema(value, f"hash map {name!r}: value")
        if expected_keys is not None and (isinstance(expected_keys, bool) or not isinstance(
                expected_keys, (int, np.integer)) or expected_keys < 0):
            raise ValueError(f"hash map {name!r}: expected_keys={expected_keys!r} must be an "
                             f"integer >= 0")
        schema = {"key": dtype_to_text(kdt), "value": dtype_to_text(vdt)}
        obj = cls._existing(pm, name, schema)
        if obj is not None:
            return obj  # type: ignore[no-any-return]
        layout = cls.LAYOUT
        if (page_slots is not None and layout != 1 and isinstance(page_slots, int)
                and page_slots > cls._slots_for(pm.page_bytes, kdt.itemsize, vdt.itemsize,
                                                None, name, layout)):
            layout = 1  # a geometry only layout 1 holds (a map rebuilt with an old map's)
        slots = cls._slots_for(pm.page_bytes, kdt.itemsize, vdt.itemsize, page_slots, name,
                               layout)
        buckets = 1
        if expected_keys and not pm.exists(name):
            buckets = max(1, math.ceil(int(expected_keys) / (cls.MAX_LOAD * slots)))
            mgr = pm.manager if isinstance(pm, Namespace) else pm
            if buckets + 2 > mgr.pool.free_frames:
                raise PoolExhaustedError(
                    f"hash map {name!r}: expected_keys={int(expected_keys)} needs {buckets} "
                    f"pages, the pool has {mgr.pool.free_frames} free frames")
        return cls(pm, name, kdt, vdt, schema, slots, buckets, layout)

    @staticmethod
    def _record_bytes(ks: int, vs: int) -> tuple[int, int]:
        """Layout 2: ``(key bytes with padding, record stride)`` of one slot."""
        kpad = pad8(ks) if vs % 8 == 0 else ks
        rs = kpad + vs
        return kpad, pad8(rs) if ks % 8 == 0 else rs

    @staticmethod
    def _page_fits(s: int, page_bytes: int, ks: int, vs: int, layout: int) -> bool:
        if layout == 1:
            return HEADER_BYTES + pad8(s) + pad8(s * ks) + s * vs <= page_bytes
        g = min(s, HashMap.GROUP)
        rs = HashMap._record_bytes(ks, vs)[1]
        return HEADER_BYTES + -(-s // g) * pad8(pad8(g) + g * rs) <= page_bytes

    @staticmethod
    def _slots_for(page_bytes: int, ks: int, vs: int, page_slots: int | None, name: str,
                   layout: int) -> int:
        if layout == 1:
            s = (page_bytes - HEADER_BYTES - 16) // (1 + ks + vs)
        else:
            rs = HashMap._record_bytes(ks, vs)[1]
            s = HashMap.GROUP * ((page_bytes - HEADER_BYTES) // (16 + HashMap.GROUP * rs))
            s = max(s, (page_bytes - HEADER_BYTES - 16) // (1 + rs))  # pages of one group
        while s > 0 and not HashMap._page_fits(s, page_bytes, ks, vs, layout):
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

    def __init__(self, pm: PageManager | Namespace, name: str, kdt: np.dtype[Any], vdt: np.dtype[Any],
                 schema: dict[str, str], slots: int, buckets: int = 1,
                 layout: int | None = None) -> None:
        self.key_dtype = kdt
        self.value_dtype = vdt
        self._float_key = kdt.kind == "f"
        ks = kdt.itemsize
        self._cmp_dtype = (np.dtype(f"<u{ks}") if ks in (1, 2, 4, 8) and kdt.fields is None
                           else np.dtype(f"V{ks}"))
        self._buf_kind: Any = None
        self._buf_keys: Any = []
        self._buf_cols: list[Any] = []
        self._buf_disarm: Callable[[], None] | None = None
        self._upserters: dict[int, Any] = {}
        self._spec_cache: dict[int, tuple[Mapping[str, Any], _Lanes]] = {}
        self._put_spec: _Lanes | None = None
        self._applying = False
        self._scratch: list[Any] | None = None
        super().__init__(pm, name, schema, {"page_slots": slots,
                                              "layout": layout or self.LAYOUT})
        if self._ps.n_pages == 1:  # new: one empty bucket
            self._gen = -1
            seq = pm.allocate(self.psid, 1, Layout.HASH)
            frame = pm.writable1(self.psid, int(seq[0]))
            pm.pool.headers["flags"][frame] = PRIMARY
            pm.pool.headers["aux0"][frame] = 0
            self._sync()
            if buckets > 1:  # sized up front (`create`'s expected_keys): empty buckets
                try:
                    while self._n_buckets < buckets:
                        self._split(buckets - self._n_buckets)
                except BaseException:
                    self.destroy()
                    raise

    def _views(self) -> None:
        S, kdt, vdt = self.S, self.key_dtype, self.value_dtype
        pool = self._pm.pool
        frames = pool.frames
        ks = self._ks = kdt.itemsize
        vs = self._vs = vdt.itemsize
        self.G = G = min(self.GROUP, S)
        if self.layout == 1:
            ko = HEADER_BYTES + pad8(S)
            vo = ko + pad8(S * ks)
            lay = (HEADER_BYTES, G, ko, G * ks, ks, vo, G * vs, vs)
        else:
            kpad, rs = self._record_bytes(ks, vs)
            gs = pad8(pad8(G) + G * rs)
            ko = HEADER_BYTES + pad8(G)
            lay = (HEADER_BYTES, gs, ko, gs, rs, ko + kpad, gs, rs)
        self._lay = np.array(lay, np.int64)
        self._ko, self._vo = lay[2], lay[5]
        sl = np.arange(S)
        hi, lo = sl >> 4, sl & 15
        self._ctrl_off = lay[0] + hi * lay[1] + lo  # byte offsets of each slot's parts
        self._key_off = lay[2] + hi * lay[3] + lo * lay[4]
        self._hdr = pool.headers
        self.max_fill = max(1, min(S - 1, int(S * self.PAGE_FILL)))
        self.n_blocks = S // self.G
        self._pb = self._pm.page_bytes
        self._flat = frames.reshape(-1)
        self._no_ops = _Lanes((), vdt, self._vo, "")
        self._W = pad8(self._ks) // 8

    def _ctrl_of(self, frames: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
        """The ctrl bytes of ``frames``: ``(len(frames), S)``, slot order (a copy)."""
        out: npt.NDArray[np.uint8] = self._pm.pool.frames[
            np.asarray(frames)[:, None], self._ctrl_off[None, :]]
        return out

    def _keys_of(self, frame: int) -> npt.NDArray[Any]:
        """The S keys of one frame (comparison dtype, slot order, a copy)."""
        f = self._pm.pool.frames[frame]
        kb = f[self._key_off[:, None] + np.arange(self._ks)[None, :]]
        return np.ascontiguousarray(kb).view(self._cmp_dtype).reshape(self.S)

    def _rebuild(self) -> None:
        # the parameters of the map in the pages (a load may bring another layout)
        self._params = self._pm.read_meta(self.psid).get("params", self._params)
        self.S = int(self._params["page_slots"])
        self.layout = int(self._params.get("layout", 1))
        self._views()
        self._no_out = np.zeros((0, self._vs), np.uint8)
        self._no_found = np.zeros(0, np.bool_)
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

    # -- keys ------------------------------------------------------------------------------------
    def _canon(self, keys: Any, what: str) -> npt.NDArray[Any]:
        """Keys as a 1-D array of the comparison dtype (validated; a copy if needed).

        Raises
        ------
        RecordTypeError
            Wrong dtype or shape, NaN float keys, bytes longer than an ``S<n>`` field.
        """
        where = f"hash map {self.name!r}: {what}"
        if self.key_dtype.kind == "S":
            try:
                kind = (keys if isinstance(keys, np.ndarray) else np.asarray(keys)).dtype.kind
            except (TypeError, ValueError) as exc:
                raise RecordTypeError(f"{where}: cannot convert to {self.key_dtype}: {exc}"
                                      ) from None
            if kind != "S" and not (kind == "f" and np.size(keys) == 0):
                raise RecordTypeError(f"{where}: keys of dtype {self.key_dtype} must be bytes, "
                                      f"not {kind!r}-kind values")
        _check_bytes_width(keys, self.key_dtype, where)
        arr = coerce_records(keys, self.key_dtype, where)
        if self._float_key:
            if np.isnan(arr).any():
                raise RecordTypeError(f"{where}: NaN is not a valid key")
            arr = arr + arr.dtype.type(0)  # -0.0 -> 0.0
        elif self.key_dtype.fields is not None:
            clean = np.zeros(len(arr), dtype=self.key_dtype)
            for f in self.key_dtype.names or ():
                clean[f] = arr[f]
            arr = clean
        return np.ascontiguousarray(arr).view(self._cmp_dtype)

    def _words(self, kc: npt.NDArray[Any]) -> tuple[npt.NDArray[np.uint64],
                                                     npt.NDArray[np.uint8]]:
        """``(kw, kb)``: keys zero-padded to 64-bit words, and the same bytes."""
        n, ks = len(kc), self._ks
        if kc.dtype.kind == "u":
            kw = (kc.view(np.uint64) if ks == 8 else kc.astype(np.uint64)).reshape(n, 1)
        else:
            raw = np.zeros((n, 8 * self._W), dtype=np.uint8)
            raw[:, :ks] = kc.view(np.uint8).reshape(n, ks)
            kw = raw.view(np.uint64)
        kw = np.ascontiguousarray(kw)
        return kw, kw.view(np.uint8)

    def _hash(self, kc: npt.NDArray[Any]) -> npt.NDArray[np.uint64]:
        out: npt.NDArray[np.uint64] = K.hash_keys(self._words(kc)[0])
        return out

    def _geo(self) -> npt.NDArray[np.int64]:
        n = self._n_buckets
        return np.concatenate((np.array(
            [n, n.bit_length() - 1, self.S, self.G, self.n_blocks, self._ko, self._vo,
             self._ks, self._vs, self._pb, self.max_fill, int(self.MAX_LOAD * self.S * n),
             self._pm.epoch], dtype=np.int64), self._lay))

    # -- page bookkeeping -----------------------------------------------------------------------------
    def _grow_next_of(self) -> None:
        high = self._ps.high
        if high > len(self._next_of):
            grown = np.full(2 * high, -1, dtype=np.int64)
            grown[:len(self._next_of)] = self._next_of
            self._next_of = grown

    def _chain(self, b: int) -> list[int]:
        out = []
        q = int(self._bucket_seq[b])
        while q >= 0:
            out.append(q)
            q = int(self._next_of[q])
        return out

    def _add_overflow(self, b: int) -> None:
        """Append an empty overflow page to bucket ``b``'s chain."""
        pm = self._pm
        last = int(self._last_seq[b])
        frame = pm.writable1(self.psid, last)  # a clone is invisible if the allocation fails
        seq = int(pm.allocate(self.psid, 1, Layout.HASH)[0])
        nf = int(self._ps.frames[seq])
        self._hdr["flags"][nf] = 0
        self._hdr["aux0"][nf] = b
        self._hdr["next"][frame] = (self.psid << 32) | seq
        self._grow_next_of()
        self._next_of[seq] = -1
        self._next_of[last] = seq
        self._last_seq[b] = seq

    def _rechain(self, src: list[int], targets: list[int], n_new: int, n_buckets: int) -> None:
        """Rewrite the chains of buckets ``src`` into ``targets`` under ``n_buckets`` buckets.

        ``n_new`` new primary pages are allocated for the last ``n_new`` targets
        (a split's images). Nothing changes if an allocation or a clone fails.
        """
        pm = self._pm
        pages = [q for b in src for q in self._chain(b)]
        new = pm.allocate(self.psid, n_new, Layout.HASH) if n_new else np.zeros(0, np.int64)
        try:
            pm.writable(self.psid, np.asarray(pages, dtype=np.int64))
        except BaseException:
            if n_new:
                pm.release(self.psid, new)
            raise
        self._grow_next_of()
        if n_buckets > len(self._bucket_seq):
            grow = n_buckets - len(self._bucket_seq)
            self._bucket_seq = np.append(self._bucket_seq, np.full(grow, -1, np.int64))
            self._last_seq = np.append(self._last_seq, np.full(grow, -1, np.int64))
        old_primary = {int(self._bucket_seq[b]) for b in src}
        primaries = [int(self._bucket_seq[b]) for b in targets[:len(targets) - n_new]
                     if int(self._bucket_seq[b]) in old_primary] + new.tolist()
        assert len(primaries) == len(targets)
        allp = np.asarray(pages + new.tolist(), dtype=np.int64)
        cap = int(self._hdr["count"][self._ps.frames[np.asarray(pages, np.int64)]].sum())
        kw, vbuf = self._gather_buffers(cap)
        spare = np.empty(len(allp), np.int64)
        geo = self._geo()
        geo[0], geo[1] = n_buckets, n_buckets.bit_length() - 1
        used, n_spare = K.rechain(allp, np.asarray(targets, np.int64),
                                  np.asarray(primaries, np.int64), self._flat, self._ps.frames,
                                  self._next_of, self._bucket_seq, self._last_seq, geo,
                                  self.psid, kw, kw.view(np.uint8), vbuf, spare)
        assert used >= 0, "rechain ran out of pages"
        if n_buckets < len(self._bucket_seq):
            self._bucket_seq = self._bucket_seq[:n_buckets].copy()
            self._last_seq = self._last_seq[:n_buckets].copy()
        self._n_buckets = n_buckets
        if n_spare > used:
            rest = spare[used:n_spare]
            self._next_of[rest] = -1
            pm.release(self.psid, rest)

    def _gather_buffers(self, cap: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint8]]:
        """`K.rechain`'s record buffers for ``cap`` records (key words zeroed). Within one
        batch (``_scratch`` not None) they are kept and reused from split to split: fresh
        memory costs a page fault per 4 KiB."""
        sc = self._scratch
        if sc is None:
            return np.zeros((cap, self._W), np.uint64), np.empty((cap, self._vs), np.uint8)
        if len(sc[0]) < cap:
            grow = max(cap, len(sc[0]) * 3 // 2)
            sc[0] = np.zeros((grow, self._W), np.uint64)
            sc[1] = np.empty((grow, self._vs), np.uint8)
        kw = sc[0][:cap]
        kw[:] = 0
        return kw, sc[1][:cap]

    def _split(self, want: int) -> None:
        """Split up to ``want`` buckets (from the split pointer, within the level)."""
        n = self._n_buckets
        lvl = n.bit_length() - 1
        p = n - (1 << lvl)
        k = max(1, min(want, (1 << lvl) - p))
        src = list(range(p, p + k))
        self._rechain(src, src + list(range(n, n + k)), k, n + k)

    def _merge_one(self) -> None:
        n = self._n_buckets
        last = n - 1
        buddy = last - (1 << (last.bit_length() - 1))
        self._rechain([last, buddy], [buddy], 0, last)

    # -- guarded mutation --------------------------------------------------------------------------
    def _need_frames(self, n_new: int) -> int:
        """Frames a mutation of ``n_new`` possibly new keys may allocate, at most."""
        ps = self._ps
        pinned = 0
        if self._pm._active:
            seqs = ps.seqs()
            pinned = int(np.count_nonzero(self._pm.pool.pins[ps.frames[seqs]] > 0))
        if n_new == 0:
            return pinned
        cap = self.MAX_LOAD * self.S
        final = max(self._n_buckets, math.ceil((self._len + n_new) / cap) + 1)
        # a split allocates one primary page per bucket it adds and may overshoot by
        # up to the number of buckets (it at most doubles them); inserts allocate an
        # overflow page per max_fill keys, plus one per chain whose last page was full
        # (chains: the existing ones and two per split bucket)
        primaries = 2 * final - self._n_buckets + 2
        overflow = min(n_new, math.ceil(n_new / self.max_fill) + final + 2 * primaries)
        return pinned + primaries + overflow + 1

    def _guarded(self, fn: Callable[[], Any], n_new: int) -> Any:
        """Run a mutation so that a `PoolExhaustedError` leaves the map as before.

        When the pool has room for the worst case the mutation runs directly
        (it cannot run out); otherwise under an internal snapshot of the map's
        pages, rolled back if the pool runs out.
        """
        pm = self._pm
        if pm.pool.free_frames >= self._need_frames(n_new):
            return fn()
        was = self._applying
        self._applying = True  # the snapshot flushes structures: not this buffer
        try:
            snap = pm.chkpt(psids=[self.psid])
        finally:
            self._applying = was
        try:
            out = fn()
        except BaseException:
            self._applying = True
            try:
                pm.rollback(snap)
            finally:
                self._applying = was
            self._sync()
            raise
        snap.release()
        return out

    # -- batch API -----------------------------------------------------------------------------------
    def upsert(self, keys: npt.ArrayLike, values: Any = None,
               combine: Mapping[str, Any] | None = None, *,
               out: npt.NDArray[Any] | None = None, returning: bool = False
               ) -> npt.NDArray[Any] | None:
        """Aggregate input records into the map: insert new keys, combine existing ones.

        Rows are applied one after another in input order (so ``first`` and
        ``last`` follow the input order), in one compiled pass.

        Parameters
        ----------
        keys : array_like
            One key per input record (duplicates allowed).
        values : structured array or mapping of column -> array, optional
            The input columns the combine spec reads.
        combine : dict
            ``{value_field: op or (op, input_column)}``, ops count/sum/min/max/last/first;
            see `mmm.structures.combine` (NaN, overflow and ordering rules there).
        out : ndarray of the value dtype, optional
            Filled per input row, in input order: row ``i`` gets its key's value
            right after row ``i`` was applied (a running aggregate; the key's
            final value is at its last row).
        returning : bool
            Allocate and return that array (as ``out`` does).

        Returns
        -------
        ndarray or None
            ``out`` (or the new array when ``returning``), else None.

        Runtime complexity: O(n) expected. Pages copied: at most the pages the
        batch touches, once per snapshot.

        Raises
        ------
        RecordTypeError
            Keys of the wrong dtype or shape (or bytes longer than the key
            field), bad combine spec, missing or mis-sized input columns, input
            values that do not fit their fields; the map is unchanged.
        PoolExhaustedError
            The pool ran out of frames; the map is unchanged.

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
        >>> m.upsert(np.array([9, 7], "<u4"), {"ts": np.array([1, 8])}, spec,
        ...          returning=True).tolist()
        [(2, 1, 4), (3, 3, 8)]
        """
        self._flush()
        self._sync()
        lanes = self._lanes(combine)
        kc = self._canon(keys, "keys")
        n = len(kc)
        where = f"hash map {self.name!r}"
        cols = input_columns(values, lanes.spec, n, where, self.value_dtype)
        lane_arrays = lanes.columns(cols, n, where)
        if out is not None:
            if (not isinstance(out, np.ndarray) or out.dtype != self.value_dtype
                    or out.shape != (n,) or not out.flags.c_contiguous
                    or not out.flags.writeable):
                raise RecordTypeError(f"{where}: out must be a writable contiguous array of "
                                      f"{n} records of {self.value_dtype}")
        elif returning:
            out = np.zeros(n, dtype=self.value_dtype)
        if n:
            self._guarded(lambda: self._upsert_rows(kc, lanes, lane_arrays, out), n)
        return out

    def _lanes(self, combine: Mapping[str, Any] | None) -> _Lanes:
        where = f"hash map {self.name!r}"
        if combine is None:
            raise RecordTypeError(f"{where}: upsert needs a combine spec")
        key = id(combine)
        hit = self._spec_cache.get(key)
        if hit is not None and hit[0] is combine:
            return hit[1]
        lanes = _Lanes(compile_spec(self.value_dtype, combine, where), self.value_dtype,
                       self._vo, where)
        if len(self._spec_cache) > 64:
            self._spec_cache.clear()
        self._spec_cache[key] = (combine, lanes)
        return lanes

    def _put_lanes(self) -> _Lanes:
        """``put`` is an upsert that copies the whole value record (``last`` over its bytes)."""
        if self._put_spec is None:
            ls = _Lanes((), self.value_dtype, self._vo, "")
            for name in ("ops", "codes", "offs", "sizes", "lanes", "lidx"):
                setattr(ls, name, np.array([0], np.int64))
            ls.ops[0], ls.codes[0], ls.lanes[0] = K.LAST, K.BYTES, K.L_BYTES
            ls.sizes[0] = self._vs
            ls.aligned = np.zeros(1, np.bool_)
            ls.inputs = [0, 0, 0, self._vs]
            self._put_spec = ls
        return self._put_spec

    def _upsert_rows(self, kc: npt.NDArray[Any], lanes: _Lanes,
                     cols: tuple[Any, Any, Any, Any], out: npt.NDArray[Any] | None) -> None:
        kw, kb = self._words(kc)
        n = len(kc)
        ob = (out.view(np.uint8).reshape(n, self._vs) if out is not None
              else np.zeros((0, self._vs), np.uint8))
        state = np.array([self._len, 0, 0], dtype=np.int64)
        len0 = self._len
        self._scratch = [np.zeros((0, self._W), np.uint64), np.empty((0, self._vs), np.uint8)]
        try:
            self._upsert_loop(kw, kb, lanes, cols, ob, state, len0)
        finally:
            self._scratch = None

    def _upsert_loop(self, kw: npt.NDArray[np.uint64], kb: npt.NDArray[np.uint8], lanes: _Lanes,
                     cols: tuple[Any, Any, Any, Any], ob: npt.NDArray[np.uint8],
                     state: npt.NDArray[np.int64], len0: int) -> None:
        ic, uc, fc, bc = cols
        pm = self._pm
        n = len(kw)
        i = 0
        bulk = soft_bulk = False
        scratch = np.empty(K.SCRATCH, np.int64)  # the kernel's; held here for its calls
        while True:
            state[0] = self._len
            code = K.rows(K.MODE_UPSERT, i, kw, kb, self._flat, self._ps.frames, self._next_of,
                          self._bucket_seq, self._last_seq, pm.pool.pins, pm.pool.undo,
                          pm.pool.undo_data, self._ps.mod,
                          self._geo(), lanes.ops, lanes.codes, lanes.offs, lanes.sizes,
                          lanes.lanes, lanes.lidx, lanes.aligned, ic, uc, fc, bc, ob,
                          self._no_found, scratch, state)
            self._len = int(state[0])
            i = int(state[1])
            if code == K.DONE:
                return
            if code == K.NEED_CLONE:
                seq = int(state[2])
                if not bulk and pm.pool.pins[self._ps.frames[seq]] >= HARD_PIN:
                    # the first hard-pinned page: un-share the rest of the batch's chains
                    bulk = True  # in one copy instead of one kernel exit per page
                    try:
                        self._unshare_touched(kw[i:])
                    except PoolExhaustedError:  # nothing changed: page by page, as needed
                        pm.writable1(self.psid, seq)
                elif not bulk and not soft_bulk:
                    # soft-pinned (an in-place snapshot): the values of keys in its pages
                    # change in place, so only the pages the batch's new keys go to (their
                    # chains' last pages) are un-shared, in one copy
                    soft_bulk = True
                    found = np.zeros(len(kw) - i, dtype=bool)
                    self._call(K.MODE_GET, 0, kw[i:], kb[i:], np.empty((0, self._vs), np.uint8),
                               found, np.zeros(3, np.int64))
                    try:
                        self._unshare_touched(kw[i:][~found], last_only=True)
                    except PoolExhaustedError:
                        pass
                    pm.writable1(self.psid, seq)  # this row's page, whatever stopped it
                else:  # (a full undo log, or a page the bulk copy did not cover)
                    pm.writable1(self.psid, seq)
            elif code == K.NEED_PAGE:
                self._add_overflow(int(state[2]))
            else:  # split ahead for the new keys the rest of the batch may bring (at the
                # rate seen so far, at most one per row): while the map is small that is
                # several levels at once, each rechaining few records
                new_rate = (self._len - len0 + 1) / (i + 1)
                ahead = math.ceil((n - i) * new_rate / (self.MAX_LOAD * self.S))
                target = self._n_buckets + max(1, ahead)
                while self._n_buckets < target:
                    self._split(target - self._n_buckets)

    def _unshare_touched(self, kw: npt.NDArray[np.uint64], last_only: bool = False) -> None:
        """Un-share the pinned pages of the chains that keys ``kw`` hash to (with
        ``last_only``: each chain's last page, where new keys go), in one bulk copy
        (one barrier call instead of a kernel exit per page).
        Pages copied: at most the pages of the touched chains still pinned."""
        pm = self._pm
        if not len(kw):
            return
        hit = np.zeros(self._n_buckets, dtype=bool)
        hit[self._bucket_of(K.hash_keys(kw))] = True
        if last_only:
            seqs = self._last_seq[np.flatnonzero(hit)]
        else:
            q = self._bucket_seq[np.flatnonzero(hit)]
            chain = [q]
            while True:  # chains are short
                q = self._next_of[q]
                q = q[q >= 0]
                if not len(q):
                    break
                chain.append(q)
            seqs = np.concatenate(chain) if len(chain) > 1 else chain[0]
        pinned = seqs[pm.pool.pins[self._ps.frames[seqs]] > 0]
        if len(pinned):
            pm.writable(self.psid, pinned)

    def put(self, keys: npt.ArrayLike, values: Any) -> None:
        """Insert or overwrite ``keys[i] -> values[i]``; for a key repeated in the batch the last wins.

        Runtime complexity: O(n). Pages copied: at most the pages touched.

        Raises
        ------
        RecordTypeError
            Keys or values of the wrong dtype, shape or length (map unchanged).
        PoolExhaustedError
            The pool ran out of frames (map unchanged).
        """
        self._flush()
        self._sync()
        kc = self._canon(keys, "keys")
        _check_bytes_width(values, self.value_dtype, f"hash map {self.name!r}: values")
        vals = coerce_records(values, self.value_dtype, f"hash map {self.name!r}: values",
                              n=len(kc))
        self._put_prepared(kc, vals)

    def _put_prepared(self, kc: npt.NDArray[Any], vals: npt.NDArray[Any]) -> None:
        n = len(kc)
        if n == 0:
            return
        bc = np.ascontiguousarray(vals).view(np.uint8).reshape(n, self._vs)
        cols = (np.empty((0, n), np.int64), np.empty((0, n), np.uint64),
                np.empty((0, n), np.float64), bc)
        lanes = self._put_lanes()
        self._guarded(lambda: self._upsert_rows(kc, lanes, cols, None), n)

    def get(self, keys: npt.ArrayLike, default: Any = None
            ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[Any]]:
        """Look keys up: ``(found, values)``; missing keys get ``default`` (zeros if None).

        Runtime complexity: O(n * probes). Pages copied: 0.
        """
        self._flush()
        self._sync()
        kc = self._canon(keys, "keys")
        n = len(kc)
        out = np.zeros(n, dtype=self.value_dtype)
        found = np.zeros(n, dtype=bool)
        if n:
            self._lookup(kc, out.view(np.uint8).reshape(n, self._vs), found)
        if default is not None:
            out[~found] = default
        return found, out

    def _call(self, mode: int, i: int, kw: npt.NDArray[np.uint64], kb: npt.NDArray[np.uint8],
              out: npt.NDArray[np.uint8], found: npt.NDArray[np.bool_],
              state: npt.NDArray[np.int64],
              expire: tuple[_Lanes, npt.NDArray[np.int64]] | None = None) -> int:
        """`K.rows` without a combine spec (get, contains, delete), or with the one field and
        bound of an expire (``MODE_EXPIRE``)."""
        ls = self._no_ops if expire is None else expire[0]
        n = len(kw)
        code: int = K.rows(mode, i, kw, kb, self._flat, self._ps.frames, self._next_of,
                           self._bucket_seq, self._last_seq, self._pm.pool.pins,
                           self._pm.pool.undo, self._pm.pool.undo_data, self._ps.mod,
                           self._geo(), ls.ops, ls.codes, ls.offs, ls.sizes, ls.lanes, ls.lidx,
                           ls.aligned,
                           np.empty((0, n), np.int64) if expire is None else expire[1],
                           np.empty((0, n), np.uint64),
                           np.empty((0, n), np.float64), np.empty((n, 0), np.uint8), out, found,
                           np.empty(K.SCRATCH, np.int64), state)
        return code

    def _lookup(self, kc: npt.NDArray[Any], out: npt.NDArray[np.uint8],
                found: npt.NDArray[np.bool_]) -> None:
        kw, kb = self._words(kc)
        self._call(K.MODE_GET, 0, kw, kb, out, found, np.zeros(3, np.int64))

    def contains(self, keys: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Boolean mask: which keys are present."""
        self._flush()
        self._sync()
        kc = self._canon(keys, "keys")
        n = len(kc)
        found = np.zeros(n, dtype=bool)
        if n:
            self._lookup(kc, np.zeros((0, self._vs), np.uint8), found)
        return found

    def delete(self, keys: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Delete keys; returns which of them were present before the call (per input key).

        Runtime complexity: O(n log n). Pages copied: at most the pages touched.

        Raises
        ------
        RecordTypeError
            Bad keys (map unchanged).
        PoolExhaustedError
            A page to clone found no free frame (map unchanged).
        """
        return self._delete(keys, None)

    def expire(self, keys: npt.ArrayLike, field: str, bound: int) -> npt.NDArray[np.bool_]:
        """Delete those of `keys` whose int64 value field `field` is at most `bound`, in one
        probe per key (a lookup and a delete at once); returns which of them were deleted
        (per input key). A key above the bound, or absent, is left as it is and its page
        is not written (not cloned from a snapshot).

        Runtime complexity: O(n log n) (O(n) for keys already sorted and distinct). Pages
        copied: at most the pages of the deleted keys.

        Raises
        ------
        RecordTypeError
            Bad keys, or `field` not an int64 field of the value (map unchanged).
        ValueError
            `bound` not an integer in the int64 range (map unchanged).
        PoolExhaustedError
            A page to clone found no free frame (map unchanged).
        """
        where = f"hash map {self.name!r}: expire"
        fields = self.value_dtype.fields
        if fields is None or field not in fields or fields[field][0] != np.dtype("<i8"):
            raise RecordTypeError(f"{where}: field {field!r} is not an int64 field of the "
                                  f"value {self.value_dtype}")
        if isinstance(bound, bool) or not isinstance(bound, (int, np.integer)) or \
                not -2 ** 63 <= int(bound) < 2 ** 63:
            raise ValueError(f"{where}: bound={bound!r} must be an int64 integer")
        lanes = _Lanes((CombineOp(field, "last", field),), self.value_dtype, self._vo, where)
        return self._delete(keys, (lanes, np.full((1, 1), int(bound), np.int64)))

    def _delete(self, keys: npt.ArrayLike,
                expire: tuple[_Lanes, npt.NDArray[np.int64]] | None) -> npt.NDArray[np.bool_]:
        self._flush()
        self._sync()
        kc = self._canon(keys, "keys")
        if len(kc) == 0:
            return np.zeros(0, dtype=bool)
        if kc.ndim == 1 and kc.dtype.kind in "iu" and bool((kc[1:] > kc[:-1]).all()):
            uniq, inverse = kc, None  # already sorted and distinct (e.g. from np.unique)
        else:
            uniq, inverse = np.unique(kc, return_inverse=True)
        found = np.zeros(len(uniq), dtype=bool)
        self._guarded(lambda: self._delete_rows(uniq, found, expire), 0)
        return found if inverse is None else found[inverse.reshape(-1)]

    def _delete_rows(self, uniq: npt.NDArray[Any], found: npt.NDArray[np.bool_],
                     expire: tuple[_Lanes, npt.NDArray[np.int64]] | None = None) -> None:
        kw, kb = self._words(uniq)
        pm = self._pm
        state = np.array([self._len, 0, 0], dtype=np.int64)
        mode = K.MODE_DELETE if expire is None else K.MODE_EXPIRE
        i = 0
        while True:
            state[0] = self._len
            code = self._call(mode, i, kw, kb, self._no_out, found, state, expire)
            self._len = int(state[0])
            i = int(state[1])
            if code == K.DONE:
                break
            pm.writable1(self.psid, int(state[2]))
        if not found.any():
            return
        # rewrite buckets whose tombstones crowd out free slots, then shrink
        h = K.hash_keys(kw[found])
        crowded = K.crowded(self._bucket_of(h), self._bucket_seq, self._next_of,
                            self._ps.frames, self._flat, self._pb, self.S // 2)
        for b in np.unique(crowded).tolist():  # the few crowded ones, each once
            self._rechain([b], [b], 0, self._n_buckets)
        self._shrink()

    def _bucket_of(self, h: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        n = self._n_buckets
        i = n.bit_length() - 1
        b = (h & _U64((1 << (i + 1)) - 1)).astype(np.int64)
        return np.where(b >= n, b - (1 << i), b)

    def _shrink(self) -> None:
        while self._n_buckets > 1 and self._len < self.MIN_LOAD * self.S * (self._n_buckets - 1):
            self._merge_one()

    def items(self) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """All ``(keys, values)`` as two arrays, in storage order. Runtime complexity: O(pages * S)."""
        self._flush()
        self._sync()
        from mmm._kernels.hashbuild import gather_full  # one compiled pass over the pages
        seqs = self._ps.seqs()
        fr = self._ps.frames[seqs[seqs != 0]]
        starts = np.zeros(len(fr) + 1, np.int64)
        np.cumsum(self._hdr["count"][fr], out=starts[1:])
        n, ks, vs = int(starts[-1]), self._ks, self._vs
        kout = np.empty((n, ks), np.uint8)
        vout = np.empty((n, vs), np.uint8)
        none = np.empty(0, np.uint64)
        gather_full(self._flat, fr, starts,
                    np.concatenate((np.array([self.S, self._ko, self._vo, ks, vs, self._pb],
                                             np.int64), self._lay)),
                    kout, vout, kout.reshape(-1).view(np.uint64) if ks == 8 else none,
                    vout.reshape(-1).view(np.uint64) if vs % 8 == 0 else none)
        return kout.view(self.key_dtype).reshape(n), vout.view(self.value_dtype).reshape(n)

    def frames_for(self, keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """The frames an operation on ``keys`` reads: every page of the chains of their
        buckets, distinct and sorted. A page cache (`mmm.pagecache.PageCache.will_use`)
        reads them in together and marks them used before the batch runs. Pages a
        following upsert adds (splits, overflow pages) are not among them. Touches no page.

        Runtime complexity: O(n log n + chain pages). Pages copied: 0.

        Raises
        ------
        RecordTypeError
            Keys of the wrong dtype or shape.
        """
        self._flush()
        self._sync()
        kc = self._canon(keys, "keys")
        if not len(kc):
            return np.zeros(0, dtype=np.int64)
        seqs = self._bucket_seq[np.unique(self._bucket_of(self._hash(kc)))]
        seqs = seqs[seqs >= 0]
        parts = [seqs]
        while len(seqs):
            seqs = self._next_of[seqs]
            seqs = seqs[seqs >= 0]
            parts.append(seqs)
        out: npt.NDArray[np.int64] = np.unique(
            self._ps.frames[np.concatenate(parts)].astype(np.int64))
        return out

    def keys(self) -> npt.NDArray[Any]:
        """All keys as an array (storage order)."""
        return self.items()[0]

    def values(self) -> npt.NDArray[Any]:
        """All values as an array (storage order)."""
        return self.items()[1]

    def clear(self) -> None:
        """Remove every key; keeps one empty bucket.

        Raises
        ------
        PoolExhaustedError
            The first bucket's page is pinned by a snapshot and no frame is
            free to clone it (map unchanged).
        """
        self._flush()
        self._sync()
        seqs = self._ps.seqs()
        seqs = seqs[seqs != 0]
        keep = int(self._bucket_seq[0])
        frame = self._pm.writable1(self.psid, keep)  # may raise: nothing changed yet
        self._pm.release(self.psid, seqs[seqs != keep])
        self._bucket_seq = self._bucket_seq[:1].copy()
        self._last_seq = self._bucket_seq.copy()
        self._next_of[:] = -1
        self._n_buckets = 1
        self._pm.pool.frames[frame, self._ctrl_off] = EMPTY
        self._hdr["count"][frame] = 0
        self._hdr["start"][frame] = 0
        self._hdr["next"][frame] = NIL_INT
        self._len = 0

    # -- per-record convenience (validated at once, buffered) ----------------------------------------
    def upsert_record(self, key: Any, combine: Mapping[str, Any], **inputs: Any) -> None:
        """Aggregate one input record; validated now, buffered and applied as a batch.

        For hot loops prefer `upserter`, which avoids the keyword arguments.
        Runtime complexity: amortized O(1) Python work plus the batch cost.

        Raises
        ------
        RecordTypeError
            A bad key, value or spec (nothing buffered).
        """
        add = self._upserters.get(id(combine))
        if add is None or add.combine is not combine:
            add = self.upserter(combine)
        try:
            vals = [inputs[n] for n in add.inputs]
        except KeyError as exc:
            raise RecordTypeError(f"hash map {self.name!r}: upsert_record needs input "
                                  f"{exc.args[0]!r} (inputs {add.inputs})") from None
        add(key, *vals)

    def _key_checker(self) -> tuple[Any, Any, Any, Callable[[Any], Any]]:
        """``(fast_type, lo, hi, slow)``: a key ``k`` with ``type(k) is fast_type and
        lo <= k <= hi`` is valid; any other goes through ``slow`` (raises if bad)."""
        kdt = self.key_dtype

        def slow(key: Any) -> Any:
            kc = self._canon([key], "key")
            return kc.view(kdt)[0] if kdt.fields is not None else kc.view(kdt)[0].item()

        if kdt.kind in "iu" and kdt.fields is None:
            info = np.iinfo(kdt)
            return int, int(info.min), int(info.max), slow
        if kdt.kind == "f" and kdt.fields is None:
            return float, -math.inf, math.inf, slow
        return _Never, 0, 0, slow

    def _value_checkers(self, lanes: _Lanes, names: tuple[str, ...]
                        ) -> list[tuple[Any, Any, Any, Callable[..., Any]]]:
        """Per input column, like `_key_checker`."""
        out: list[tuple[Any, Any, Any, Callable[..., Any]]] = []
        for name in names:
            j = next(j for j, c in enumerate(lanes.spec) if c.input == name)
            fdt = lanes.dtypes[j]
            where = f"hash map {self.name!r}: input {name!r}"

            def slow(v: Any, fdt: np.dtype[Any] = fdt, name: str = name,
                     where: str = where) -> Any:
                sub = [c for c in lanes.spec if c.input == name]
                try:
                    col = np.asarray([v])
                except (TypeError, ValueError) as exc:
                    raise RecordTypeError(f"{where}: {v!r}: {exc}") from None
                cols = input_columns({name: col}, tuple(sub), 1, where, self.value_dtype)
                sl = _Lanes(tuple(sub), self.value_dtype, self._vo, where)
                sl.columns(cols, 1, where)
                return v

            if fdt.kind in "iu" and fdt.subdtype is None:
                info = np.iinfo(fdt)
                out.append((int, int(info.min), int(info.max), slow))
            elif fdt.kind == "f":
                out.append((float, -math.inf, math.inf, slow))
            else:
                out.append((_Never, 0, 0, slow))
        return out

    def upserter(self, combine: Mapping[str, Any]) -> Any:
        """A fast per-record aggregation function ``add(key, *inputs)``.

        ``inputs`` are the values of the spec's input columns in sorted name
        order (``add.inputs``). Each record is validated when ``add`` receives
        it (a bad key or value raises `RecordTypeError` there and is not
        buffered), then buffered and applied as one batch of up to 65536
        records, or before any other operation on the map or a snapshot, so
        every read sees it. If applying the buffer fails (`PoolExhaustedError`
        at the ``add`` that meets a full buffer, or at the next read), the map
        is unchanged and the records stay buffered, to be applied by a later
        call; a record refused with `RecordTypeError` is never buffered.

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
        lanes = self._lanes(combine)
        names = tuple(sorted({c.input for c in lanes.spec if c.input is not None}))
        limit = self._BUFFER_LIMIT
        this = self
        keys: Any = _typed_buffer(self.key_dtype) if self.key_dtype.kind in "iu" else None
        cols: list[Any] = [_typed_buffer(self._input_dtype(lanes, nm)) for nm in names]
        where = f"hash map {self.name!r}"

        if keys is not None and all(c is not None for c in cols) and len(names) == 1:
            # C-validated typed buffers filled by index: an array item assignment refuses a
            # non-integer or out-of-range value (TypeError / OverflowError) and an index past
            # the end (IndexError). While another writer's buffer is active, ka / va are
            # empty arrays, so the first record raises IndexError and takes the slow path:
            # switch buffers (the other's records are applied first) and arm the real ones;
            # a full buffer takes it too (applied, then refilled from index 0). The hot path
            # is two item assignments and a count.
            tk, tv = keys.typecode, cols[0].typecode
            kempty, vempty = array.array(tk), array.array(tv)
            ka, va = kempty, vempty
            i = 0

            def count() -> int:
                return i

            def reset() -> None:
                nonlocal i
                i = 0

            kbuf = _Filled(kempty, count, reset)  # filled arrays allocated when first armed
            vbufs: list[Any] = [_Filled(vempty, count, reset)]

            def disarm() -> None:
                nonlocal ka, va
                ka, va = kempty, vempty

            def refuse(key: Any, value: Any, exc: BaseException) -> RecordTypeError:
                try:
                    array.array(tk, [key])
                except (TypeError, OverflowError) as kexc:
                    return RecordTypeError(f"{where}: key {key!r}: {kexc}")
                return RecordTypeError(f"{where}: input {names[0]!r} value {value!r}: {exc}")

            def slow(key: Any, value: Any) -> None:
                nonlocal ka, va, i
                if this._buf_keys is not kbuf:
                    this._switch_buffer(combine, kbuf, vbufs, disarm)
                    if not len(kbuf.arr):
                        kbuf.arr = array.array(tk, bytes(kempty.itemsize * limit))
                        vbufs[0].arr = array.array(tv, bytes(vempty.itemsize * limit))
                    ka, va = kbuf.arr, vbufs[0].arr
                else:  # full
                    this._flush()
                try:
                    ka[i] = key
                    va[i] = value
                except (TypeError, OverflowError) as exc:
                    raise refuse(key, value, exc) from None
                i += 1

            def add(key: Any, value: Any) -> None:
                nonlocal i
                try:
                    ka[i] = key
                    va[i] = value
                except IndexError:
                    slow(key, value)
                    return
                except (TypeError, OverflowError) as exc:
                    raise refuse(key, value, exc) from None
                i += 1
        else:
            keys, cols = [], [[] for _ in names]
            kt, klo, khi, kslow = self._key_checker()
            checks = self._value_checkers(lanes, names)

            def add(key: Any, *values: Any) -> None:  # type: ignore[misc]
                if len(values) != len(names):
                    raise RecordTypeError(f"{where}: upserter expects {len(names)} input "
                                          f"value(s) {names}, got {len(values)}")
                if not (type(key) is kt and klo <= key <= khi):
                    key = kslow(key)
                vals = list(values)
                for j, (vt, vlo, vhi, vslow) in enumerate(checks):
                    v = vals[j]
                    if not (type(v) is vt and vlo <= v <= vhi):
                        vals[j] = vslow(v)
                if this._buf_keys is not keys:
                    this._switch_buffer(combine, keys, cols)
                keys.append(key)
                for c, v in zip(cols, vals):
                    c.append(v)
                if len(keys) >= limit:
                    this._flush()
        add.inputs = names  # type: ignore[attr-defined]
        add.combine = combine  # type: ignore[attr-defined]
        self._upserters[id(combine)] = add
        return add

    def _input_dtype(self, lanes: _Lanes, name: str) -> np.dtype[Any] | None:
        """The one field dtype an input column feeds (None if it feeds several dtypes)."""
        dts = {lanes.dtypes[j] for j, c in enumerate(lanes.spec) if c.input == name}
        return dts.pop() if len(dts) == 1 else None

    def _switch_buffer(self, kind: Any, keys: Any, cols: list[Any],
                       disarm: Callable[[], None] | None = None) -> None:
        """Make ``keys``/``cols`` the active per-record buffer (the old one applied first).
        ``disarm`` is called when another buffer replaces this one (typed upserters arm
        their appends while active)."""
        self._flush()
        if len(self._buf_keys):  # the old buffer could not be applied: keep it, refuse to mix
            raise PoolExhaustedError(f"hash map {self.name!r}: {len(self._buf_keys)} buffered "
                                     f"record(s) could not be applied yet")
        if self._gen != self._pm.generation:
            self._sync()
        if self._buf_disarm is not None:
            self._buf_disarm()
        self._buf_kind = kind
        self._buf_keys = keys
        self._buf_cols = cols
        self._buf_disarm = disarm

    def __setitem__(self, key: Any, value: Any) -> None:
        kt, klo, khi, kslow = self._key_checker()
        if not (type(key) is kt and klo <= key <= khi):
            key = kslow(key)
        where = f"hash map {self.name!r}: value"
        _check_bytes_width([value] if not isinstance(value, np.ndarray) else value,
                           self.value_dtype, where)
        rec = coerce_records([value] if not isinstance(value, np.ndarray) else value.reshape(1),
                             self.value_dtype, where, n=1)
        if self._buf_kind != "put":
            self._switch_buffer("put", [], [[]])
        self._buf_keys.append(key)
        self._buf_cols[0].append(rec[0])
        if len(self._buf_keys) >= self._BUFFER_LIMIT:
            self._flush()

    def _flush(self) -> None:
        """Apply buffered per-record writes as one batch; the buffer is cleared only
        once they are in the map (if applying fails, they stay buffered). A read made
        while they are being applied (a snapshot taken between kernel calls) does
        not apply them again."""
        if not len(self._buf_keys):
            return
        if self._applying:
            return
        self._applying = True
        try:
            kind = self._buf_kind
            self._sync()
            kc = self._canon(_buffered(self._buf_keys), "keys")
            n = len(kc)
            if kind == "put":
                v = np.array(self._buf_cols[0], dtype=self.value_dtype)
                self._put_prepared(kc, v)
            else:
                lanes = self._lanes(kind)
                names = sorted({c.input for c in lanes.spec if c.input is not None})
                arrays = {nm: _buffered(self._buf_cols[i]) for i, nm in enumerate(names)}
                where = f"hash map {self.name!r}"
                arrays = input_columns(arrays, lanes.spec, n, where, self.value_dtype)
                lane_arrays = lanes.columns(arrays, n, where)
                self._guarded(lambda: self._upsert_rows(kc, lanes, lane_arrays, None), n)
        finally:
            self._applying = False
        del self._buf_keys[:]  # in place: upserter closures hold these buffers
        for c in self._buf_cols:
            del c[:]

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
        ps, hdr = self._ps, self._hdr
        seqs = ps.seqs()
        seqs = seqs[seqs != 0]
        fr = ps.frames[seqs]
        assert np.all(hdr["kind"][fr] == Layout.HASH)
        primary = (hdr["flags"][fr] & PRIMARY).astype(bool)
        assert int(primary.sum()) == self._n_buckets
        assert sorted(hdr["aux0"][fr[primary]].tolist()) == list(range(self._n_buckets))
        ctrl = self._ctrl_of(fr)
        assert np.array_equal((ctrl >= FULL_BIT).sum(1), hdr["count"][fr])
        assert np.array_equal((ctrl != EMPTY).sum(1), hdr["start"][fr])
        assert np.all(hdr["start"][fr] <= self.max_fill + 0), "page overfilled"
        assert np.all((ctrl == EMPTY).any(1)), "page without an empty slot"
        nb = self.n_blocks
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
                cf = self._ctrl_of(np.array([f]))[0]
                full = cf >= FULL_BIT
                k = self._keys_of(f)[full]
                if len(k):
                    hk = self._hash(k)
                    assert np.all(self._bucket_of(hk) == b), "key in wrong bucket"
                    tags = ((hk >> _U64(24)) & _U64(0x7F)).astype(np.uint8) | np.uint8(FULL_BIT)
                    assert np.array_equal(tags, cf[full]), "bad tag"
                    blk = np.flatnonzero(full) // self.G
                    has_empty = (cf[:nb * self.G].reshape(nb, self.G) == EMPTY).any(1)
                    homes = (((hk >> _U64(32)) * _U64(nb)) >> _U64(32)).astype(np.int64)
                    h2 = K.hash_keys((hk ^ _U64(0x5851F42D4C957F2D)).reshape(-1, 1))
                    steps = (np.zeros(len(hk), np.int64) if nb == 1 else
                             1 + (((h2 >> _U64(40)) * _U64(nb - 1)) >> _U64(24)).astype(np.int64))
                    for home, st, at in zip(homes.tolist(), steps.tolist(), blk.tolist()):
                        for _ in range(nb):  # every group before the key's has no EMPTY slot
                            if home == at:
                                break
                            assert not has_empty[home], "key unreachable by probing"
                            home = (home + st) % nb
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

    # -- bulk load -------------------------------------------------------------------------------------
    def load_distinct(self, keys: npt.ArrayLike, values: Any) -> None:
        """Fill this empty map with ``keys[i] -> values[i]``, keys all distinct, in one build.

        The result behaves exactly as ``put(keys, values)`` would (same keys,
        values, lookups, later updates; `_check` holds), but the pages are
        written bucket by bucket by a compiled kernel (`mmm._kernels.hashbuild`)
        under the final number of buckets: no split, no random probing. It is
        the way to rebuild a map from rows read elsewhere (repartitioning,
        restoring part of a checkpoint).

        Copy-on-write: the build writes only pages it allocates; the map's old
        (empty) page is released, so a snapshot taken before the call still
        sees the empty map.

        Runtime complexity: O(n). Pages copied: 0.

        Raises
        ------
        ValueError
            The map is not empty, or a key occurs twice (its index named); the
            map is unchanged.
        RecordTypeError
            Keys or values of the wrong dtype, shape or length (map unchanged).
        PoolExhaustedError
            The pool has too few free frames (map unchanged).
        """
        from mmm._kernels import hashbuild as KB
        self._flush()
        self._sync()
        where = f"hash map {self.name!r}"
        if self._len:
            raise ValueError(f"{where}: load_distinct needs an empty map, this one holds "
                             f"{self._len} key(s)")
        kc = self._canon(keys, "keys")
        _check_bytes_width(values, self.value_dtype, f"{where}: values")
        vals = coerce_records(values, self.value_dtype, f"{where}: values", n=len(kc))
        n = len(kc)
        if n == 0:
            return
        per = self.MAX_LOAD * self.S
        nbk = max(1, math.ceil(n / per))
        while int(per * nbk) < n:
            nbk += 1
        vb = np.ascontiguousarray(vals).view(np.uint8).reshape(n, self._vs)
        vw = vb.view(np.uint64) if self._vs % 8 == 0 else np.zeros((0, 1), np.uint64)
        h, order, starts, kw, vb = KB.plan(self._words(kc)[0], vb, vw, nbk,
                                           nbk.bit_length() - 1)  # sorted by bucket
        vw = vb.view(np.uint64) if self._vs % 8 == 0 else np.zeros((0, 1), np.uint64)
        chain = np.maximum(1, -(-np.diff(starts) // self.max_fill))
        first = np.zeros(nbk + 1, np.int64)
        np.cumsum(chain, out=first[1:])
        pm = self._pm
        seqs = pm.allocate(self.psid, int(first[-1]), Layout.HASH)  # may raise: nothing changed
        geo = np.concatenate((np.array([nbk, self.S, self.G, self.n_blocks, self._ko, self._vo,
                                        self._ks, self._vs, self._pb, self.max_fill], np.int64),
                              self._lay))
        state = np.zeros(1, np.int64)
        if KB.place(self._flat, self._ps.frames[seqs], first, starts, order, h, kw,
                    kw.view(np.uint8), vb, vw, geo, self.psid, seqs, state) != KB.DONE:
            pm.release(self.psid, seqs)
            raise ValueError(f"{where}: load_distinct: key at index {int(state[0])} occurs "
                             f"earlier in the batch (keys must be distinct)")
        old = self._ps.seqs()
        pm.release(self.psid, old[(old != 0) & ~np.isin(old, seqs)])
        self._rebuild()
