"""A processor's state variables and timers, in the pages of each key group.

`sguard.spark.processors` runs a PySpark ``StatefulProcessor`` on sguard state. Each
key group's namespace (`sguard.spark.groupstate`) holds:

``tws.heap``            a `mmm.KeyDict` used as a heap of variable-length blobs: every
                        stored value is one blob, its bytes prefixed with the variable's
                        number and the key's id (so no two live blobs are equal and the
                        dictionary never shares one between keys);
``tws.var.<n>``         one `mmm.HashMap` per state variable ``n`` (its position in the
                        layout's variable list): key id -> ``(blob, expiry)``. A value
                        state's blob is its value; a list state's blob holds every element
                        with its own expiry; a map state's blob every entry with its own
                        expiry. ``expiry`` is the earliest expiry in the blob (TTL), or
                        ``NEVER``;
``tws.timers``          key id -> ``(blob, next)``: the key's timers (sorted int64 ms), and
                        the earliest of them, so a batch finds the due ones with one
                        vectorized comparison over the map.

A batch reads the state of its keys with one lookup per variable (`GroupStore.prefetch`)
and decodes a key's value only when the processor asks for it; what the processor
changes is kept in Python for the rest of the batch and written back with one batch
write per variable (`GroupStore.write_back`). Keys touched outside the batch's rows
(timers firing) are read one at a time.

Values are encoded by `sguard.spark.statecodec.StateCodec` (a compact, deterministic
row format with the schema's version in front, never pickle), so a variable's schema
can evolve between runs (`sguard.spark.processors`).
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from mmm import HashMap, KeyDict
from sguard.spark.errors import SparkStateError

__all__ = ["NEVER", "VarSpec", "GroupStore", "ValueStateImpl", "ListStateImpl", "MapStateImpl",
           "ProcessorPhaseError"]

NEVER = np.iinfo(np.int64).max
"""The expiry of a value without TTL."""
_ENTRY = [("blob", "<i8"), ("expiry", "<i8")]
_TIMER = [("blob", "<i8"), ("next", "<i8")]
_TIMER_VAR = 0xFFFF
_U32 = struct.Struct("<I")


class ProcessorPhaseError(SparkStateError, RuntimeError):
    """A handle or state call made where Spark does not allow it (e.g. a state variable
    read outside a key's handler, a new state variable after ``init``)."""


@dataclass(frozen=True)
class VarSpec:
    """One declared state variable, as recorded in the state URI's layout.

    ``kind`` is ``"value"``, ``"list"`` or ``"map"``; ``schemas`` the JSON of every
    schema the variable had on this state URI, oldest first (a map's are its value
    schemas, ``key_schemas`` its user-key schemas); ``ttl_ms`` the TTL or None.
    """

    name: str
    kind: str
    schemas: tuple[str, ...]
    key_schemas: tuple[str, ...] = ()
    ttl_ms: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "schemas": list(self.schemas),
                "key_schemas": list(self.key_schemas), "ttl_ms": self.ttl_ms}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "VarSpec":
        return cls(d["name"], d["kind"], tuple(d["schemas"]), tuple(d.get("key_schemas", ())),
                   d.get("ttl_ms"))


def _codec(name: str, schemas: tuple[str, ...]) -> Any:
    import json

    from pyspark.sql.types import StructType

    from sguard.spark.statecodec import StateCodec
    return StateCodec(name, [StructType.fromJson(json.loads(s)) for s in schemas])


@dataclass
class _Var:
    """A variable's storage in one key group, and this batch's view of it."""

    n: int
    spec: VarSpec
    codec: Any
    key_codec: Any
    map: HashMap
    prefix_var: bytes
    # this batch: kid -> (blob id, expiry) as stored; kid -> decoded live object
    stored: dict[int, tuple[int, int]] = field(default_factory=dict)
    raw: dict[int, bytes] = field(default_factory=dict)
    live: dict[int, Any] = field(default_factory=dict)
    dirty: set[int] = field(default_factory=set)


class GroupStore:
    """The state variables and timers of one key group (module docstring)."""

    def __init__(self, ns: Any, specs: list[VarSpec], key_dtype: Any) -> None:
        self.ns = ns
        self.kdt = np.dtype(key_dtype)
        self.heap = KeyDict.create(ns, "tws.heap")
        self.vars: dict[str, _Var] = {}
        for n, s in enumerate(specs):
            m = HashMap.create(ns, f"tws.var.{n}", self.kdt, _ENTRY)
            kc = _codec(f"{s.name} (map key)", s.key_schemas) if s.kind == "map" else None
            self.vars[s.name] = _Var(n, s, _codec(s.name, s.schemas), kc, m,
                                     struct.pack("<H", n))
        self.timers = HashMap.create(ns, "tws.timers", self.kdt, _TIMER)
        self.t_stored: dict[int, tuple[int, int]] = {}
        self.t_live: dict[int, list[int]] = {}
        self.t_dirty: set[int] = set()
        self.now = -1  # the batch's processing time (TTL clock)
        self.fetched: set[int] = set()  # keys whose entries `prefetch` read (present or not)

    # -- one batch --------------------------------------------------------------------------
    def begin(self, now_ms: int) -> None:
        """Start a batch at processing time `now_ms` (the TTL clock): what expired by
        then is removed first."""
        self.now = now_ms
        self._clear()
        self._expire()
        self._clear()

    def _clear(self) -> None:
        for v in self.vars.values():
            for c in (v.stored, v.raw, v.live, v.dirty):
                c.clear()
        for c in (self.t_stored, self.t_live, self.t_dirty, self.fetched):
            c.clear()

    def prefetch(self, kids: npt.NDArray[Any]) -> None:
        """Read every variable's stored entry of keys `kids` (one lookup per variable)."""
        if not len(kids):
            return
        kids = np.asarray(kids, self.kdt)
        keys = kids.tolist()
        if self.fetched:  # keys read earlier in the batch keep what they have
            keys = [k for k in keys if k not in self.fetched]
            if not keys:
                return
            kids = np.array(keys, self.kdt)
        self.fetched.update(keys)
        for v in self.vars.values():
            found, ent = v.map.get(kids)
            if not found.any():
                continue
            sel = np.flatnonzero(found)
            blobs = ent["blob"][sel]
            data, offs, _ = self.heap.keys(blobs)
            buf = data.tobytes()
            o = offs.tolist()
            bl, ex = blobs.tolist(), ent["expiry"][sel].tolist()
            for j, i in enumerate(sel.tolist()):
                k = keys[i]
                v.stored[k] = (bl[j], ex[j])
                v.raw[k] = buf[o[j] + 10:o[j + 1]]
        self._fetch_timers(kids)

    def _fetch_timers(self, kids: npt.NDArray[Any]) -> None:
        """Read the stored timer lists of keys `kids` not read yet (one lookup); a key
        with none gets an empty list."""
        todo = [k for k in kids.tolist() if k not in self.t_live]
        if not todo:
            return
        karr = np.array(todo, self.kdt)
        found, ent = self.timers.get(karr) if len(self.timers) else (
            np.zeros(len(todo), bool), None)
        for k in todo:
            self.t_live[k] = []
        if ent is None or not found.any():
            return
        sel = np.flatnonzero(found)
        blobs = ent["blob"][sel]
        data, offs, _ = self.heap.keys(blobs)
        vals = np.asarray(data).view(np.uint8)
        o = offs.tolist()
        bl, nx = blobs.tolist(), ent["next"][sel].tolist()
        for j, i in enumerate(sel.tolist()):
            k = todo[i]
            self.t_stored[k] = (bl[j], nx[j])
            self.t_live[k] = vals[o[j] + 10:o[j + 1]].view("<i8").tolist()

    def _load(self, v: _Var, kid: int) -> None:
        """Read one key's entry of `v` (a key outside the prefetched batch)."""
        if kid in v.stored or kid in v.live or kid in self.fetched:
            return
        found, ent = v.map.get(np.array([kid], self.kdt))
        if found[0]:
            b = int(ent["blob"][0])
            data, offs, _ = self.heap.keys(np.array([b]))
            v.stored[kid] = (b, int(ent["expiry"][0]))
            v.raw[kid] = data[int(offs[0]) + 10:int(offs[1])].tobytes()

    def live(self, v: _Var, kid: int) -> Any:
        """Key `kid`'s decoded value of `v` for this batch (None: absent). A value:
        ``(expiry, tuple)``; a list: a list of ``[expiry, tuple]``; a map: a dict of
        encoded user key -> ``[expiry, key tuple, value tuple]``. Expired parts are
        dropped on decode."""
        try:
            return v.live[kid]
        except KeyError:
            pass
        self._load(v, kid)
        raw = v.raw.get(kid)
        obj: Any = None
        if raw is not None:
            obj = self._decode(v, raw)
            if self._expired_parts(v, obj):
                v.dirty.add(kid)
                if v.spec.kind == "value" or not obj:
                    obj = None
        v.live[kid] = obj
        return obj

    def _decode(self, v: _Var, raw: bytes) -> Any:
        now = self.now
        kind = v.spec.kind
        if kind == "value":
            exp = struct.unpack_from("<q", raw)[0]
            return (exp, v.codec.decode(raw[8:]))
        n = _U32.unpack_from(raw)[0]
        exps = np.frombuffer(raw, "<i8", n, 4).tolist()
        rest = raw[4 + 8 * n:]
        if kind == "list":
            vals = v.codec.decode_many(rest)
            return [[e, x] for e, x in zip(exps, vals)]
        klen = _U32.unpack_from(rest)[0]
        kb = rest[4:4 + klen]
        keys = v.key_codec.decode_many(kb)
        vals = v.codec.decode_many(rest[4 + klen:])
        _ = now
        return {v.key_codec.encode(k): [e, k, x] for e, k, x in zip(exps, keys, vals)}

    def _expired_parts(self, v: _Var, obj: Any) -> bool:
        """Drop the expired parts of a decoded value in place; True if any were."""
        if v.spec.ttl_ms is None:
            return False
        now = self.now
        kind = v.spec.kind
        if kind == "value":
            return bool(obj[0] <= now)
        if kind == "list":
            keep = [x for x in obj if x[0] > now]
            if len(keep) != len(obj):
                obj[:] = keep
                return True
            return False
        gone = [k for k, x in obj.items() if x[0] <= now]
        for k in gone:
            del obj[k]
        return bool(gone)

    def set(self, v: _Var, kid: int, obj: Any) -> None:
        v.live[kid] = obj
        v.dirty.add(kid)

    def expiry(self, v: _Var) -> int:
        return NEVER if v.spec.ttl_ms is None else self.now + v.spec.ttl_ms

    def _encode(self, v: _Var, kid: int, obj: Any) -> tuple[bytes, int] | None:
        """The blob (without prefix) and earliest expiry of a live object; None if empty."""
        kind = v.spec.kind
        if obj is None:
            return None
        if kind == "value":
            if obj[0] <= self.now and v.spec.ttl_ms is not None:
                return None
            enc = obj.enc if isinstance(obj, _Updated) else v.codec.encode(obj[1])
            return struct.pack("<q", obj[0]) + enc, obj[0]
        items = obj if kind == "list" else list(obj.values())
        if v.spec.ttl_ms is not None:
            items = [x for x in items if x[0] > self.now]
        if not items:
            return None
        exps = np.array([x[0] for x in items], np.int64)
        head = _U32.pack(len(items)) + exps.tobytes()
        if kind == "list":
            return head + v.codec.encode_many([x[1] for x in items]), int(exps.min())
        kb = v.key_codec.encode_many([x[1] for x in items])
        return (head + _U32.pack(len(kb)) + kb + v.codec.encode_many([x[2] for x in items]),
                int(exps.min()))

    def write_back(self) -> None:
        """Write every changed value and timer list of this batch into the pages."""
        for v in self.vars.values():
            if v.dirty:
                self._write_var(v)
        if self.t_dirty:
            self._write_timers()

    def _write_var(self, v: _Var) -> None:
        kids = sorted(v.dirty)
        gone: list[int] = []
        put_k: list[int] = []
        put_b: list[bytes] = []
        put_e: list[int] = []
        old: list[int] = []
        for kid in kids:
            enc = self._encode(v, kid, v.live.get(kid))
            st = v.stored.get(kid)
            if st is not None:
                old.append(st[0])
            if enc is None:
                if st is not None:
                    gone.append(kid)
                continue
            put_k.append(kid)
            put_b.append(v.prefix_var + struct.pack("<q", kid) + enc[0])
            put_e.append(enc[1])
        self._store(v.map, old, gone, put_k, put_b, put_e, "expiry")
        v.dirty.clear()

    def _store(self, m: HashMap, old: list[int], gone: list[int], put_k: list[int],
               put_b: list[bytes], put_e: list[int], efield: str) -> None:
        if old:
            self.heap.remove(np.array(old, np.int64))
        if gone:
            m.delete(np.array(gone, self.kdt))
        if put_k:
            lens = np.fromiter((len(b) for b in put_b), np.int64, len(put_b))
            offs = np.zeros(len(put_b) + 1, np.int64)
            np.cumsum(lens, out=offs[1:])
            data = np.frombuffer(b"".join(put_b), np.uint8)
            ids = np.asarray(self.heap.intern(data, offs), np.int64)
            ent = np.empty(len(put_k), [("blob", "<i8"), (efield, "<i8")])
            ent["blob"] = ids
            ent[efield] = put_e
            m.put(np.array(put_k, self.kdt), ent)

    # -- TTL clean-up -------------------------------------------------------------------------
    def _expire(self) -> None:
        """Remove what expired by now: values whole, lists' and maps' expired parts."""
        for v in self.vars.values():
            if v.spec.ttl_ms is None or len(v.map) == 0:
                continue
            k, ent = v.map.items()
            due = ent["expiry"] <= self.now
            if not due.any():
                continue
            kids = k[due]
            if v.spec.kind == "value":
                self.heap.remove(ent["blob"][due])
                v.map.delete(kids)
                continue
            self.prefetch(kids)
            for kid in kids.tolist():
                self.live(v, kid)
                v.dirty.add(kid)
            self._write_var(v)

    # -- timers -------------------------------------------------------------------------------
    def timer_list(self, kid: int) -> list[int]:
        """Key `kid`'s timers (sorted, mutable for this batch)."""
        t = self.t_live.get(kid)
        if t is not None:
            return t
        found, ent = self.timers.get(np.array([kid], self.kdt))
        t = []
        if found[0]:
            b = int(ent["blob"][0])
            self.t_stored[kid] = (b, int(ent["next"][0]))
            data, offs, _ = self.heap.keys(np.array([b]))
            t = np.frombuffer(data[int(offs[0]) + 10:int(offs[1])].tobytes(), "<i8").tolist()
        self.t_live[kid] = t
        return t

    def timers_changed(self, kid: int) -> None:
        self.t_dirty.add(kid)

    def due_timers(self, threshold: int) -> list[tuple[int, int]]:
        """``(expiry, kid)`` of every timer at or below `threshold`, in expiry order (the
        stored timers as changed by this batch so far)."""
        out: list[tuple[int, int]] = []
        seen: set[int] = set()
        if len(self.timers):
            k, ent = self.timers.items()
            due = k[ent["next"] <= threshold]
            self._fetch_timers(due)
            for kid in due.tolist():
                seen.add(kid)
                out.extend((t, kid) for t in self.timer_list(kid) if t <= threshold)
        for kid, t in self.t_live.items():
            if kid not in seen:
                out.extend((x, kid) for x in t if x <= threshold)
        out.sort()
        return out

    def _write_timers(self) -> None:
        old, gone, put_k, put_b, put_e = [], [], [], [], []
        for kid in sorted(self.t_dirty):
            t = self.t_live.get(kid, [])
            st = self.t_stored.get(kid)
            if st is not None:
                old.append(st[0])
            if not t:
                if st is not None:
                    gone.append(kid)
                continue
            put_k.append(kid)
            put_b.append(struct.pack("<Hq", _TIMER_VAR, kid) + np.array(t, "<i8").tobytes())
            put_e.append(t[0])
        self._store(self.timers, old, gone, put_k, put_b, put_e, "next")
        self.t_dirty.clear()
        self.t_stored.clear()
        self.t_live.clear()

    # -- reading everything back (read_state, tests) -------------------------------------------
    def dump_var(self, name: str) -> Iterator[tuple[int, Any]]:
        """``(kid, live object)`` of every key with a value of `name` (expired parts
        dropped, as a processor would see them now)."""
        v = self.vars[name]
        k, ent = v.map.items()
        if not len(k):
            return
        data, offs, _ = self.heap.keys(ent["blob"])
        buf, o = data.tobytes(), offs.tolist()
        for i, kid in enumerate(k.tolist()):
            obj = self._decode(v, buf[o[i] + 10:o[i + 1]])
            self._expired_parts(v, obj)
            if v.spec.kind == "value" and v.spec.ttl_ms is not None and obj[0] <= self.now:
                continue
            if obj:
                yield kid, obj

    def dump_timers(self) -> Iterator[tuple[int, list[int]]]:
        k, ent = self.timers.items()
        if not len(k):
            return
        data, offs, _ = self.heap.keys(ent["blob"])
        buf, o = data.tobytes(), offs.tolist()
        for i, kid in enumerate(k.tolist()):
            yield kid, np.frombuffer(buf[o[i] + 10:o[i + 1]], "<i8").tolist()

    def n_keys(self) -> int:
        return max([len(v.map) for v in self.vars.values()] + [len(self.timers)])


# ------------------------------------------------------------------- the state variables
class _Bound:
    """What a state variable object needs: the partition context that knows the current
    key group's store and the current key."""

    def __init__(self, ctx: Any, name: str) -> None:
        self._ctx = ctx
        self._name = name

    def _here(self) -> tuple[GroupStore, _Var, int]:
        store, kid = self._ctx.current(self._name)
        return store, store.vars[self._name], kid


class _Updated(tuple):  # type: ignore[type-arg]
    """A value state's ``(expiry, value)`` after `update`: keeps the encoded bytes for the
    write-back and decodes the value only if it is read again in the batch."""

    codec: Any
    enc: bytes
    _v: Any

    def __new__(cls, expiry: int, codec: Any, enc: bytes) -> "_Updated":
        self = tuple.__new__(cls, (expiry, None))
        self.codec, self.enc, self._v = codec, enc, None
        return self

    def __getitem__(self, i: Any) -> Any:
        if i == 1 or i == -1:
            if self._v is None:
                self._v = self.codec.decode(self.enc)
            return self._v
        return tuple.__getitem__(self, i)


class ValueStateImpl(_Bound):
    """`pyspark.sql.streaming.ValueState` on sguard state (same methods, same semantics)."""

    def exists(self) -> bool:
        store, v, kid = self._here()
        return store.live(v, kid) is not None

    def get(self) -> tuple[Any, ...] | None:
        store, v, kid = self._here()
        obj = store.live(v, kid)
        return None if obj is None else obj[1]

    def update(self, newValue: Any) -> None:
        store, v, kid = self._here()
        enc = v.codec.encode(newValue)  # validates now (a bad value fails here, named)
        store.set(v, kid, _Updated(store.expiry(v), v.codec, enc))

    def clear(self) -> None:
        store, v, kid = self._here()
        store.live(v, kid)
        store.set(v, kid, None)


class ListStateImpl(_Bound):
    """`pyspark.sql.streaming.ListState` on sguard state."""

    def exists(self) -> bool:
        store, v, kid = self._here()
        return bool(store.live(v, kid))

    def get(self) -> Iterator[tuple[Any, ...]]:
        store, v, kid = self._here()
        obj = store.live(v, kid)
        return iter([x[1] for x in obj] if obj else [])

    def _values(self, v: _Var, new: Any, what: str) -> list[Any]:
        if new is None or isinstance(new, (str, bytes)) or not hasattr(new, "__iter__"):
            raise TypeError(f"ListState {v.spec.name!r}.{what} takes a list of tuples, got "
                            f"{type(new).__name__}")
        return [v.codec.decode(v.codec.encode(x)) for x in new]

    def put(self, newState: Any) -> None:
        store, v, kid = self._here()
        vals = self._values(v, newState, "put")
        store.live(v, kid)
        e = store.expiry(v)
        store.set(v, kid, [[e, x] for x in vals] or None)

    def appendValue(self, newState: Any) -> None:
        store, v, kid = self._here()
        x = v.codec.decode(v.codec.encode(newState))
        cur = store.live(v, kid) or []
        cur.append([store.expiry(v), x])
        store.set(v, kid, cur)

    def appendList(self, newState: Any) -> None:
        store, v, kid = self._here()
        vals = self._values(v, newState, "appendList")
        cur = store.live(v, kid) or []
        e = store.expiry(v)
        cur.extend([e, x] for x in vals)
        store.set(v, kid, cur or None)

    def clear(self) -> None:
        store, v, kid = self._here()
        store.live(v, kid)
        store.set(v, kid, None)


class MapStateImpl(_Bound):
    """`pyspark.sql.streaming.MapState` on sguard state."""

    def _map(self) -> tuple[GroupStore, _Var, int, dict[bytes, Any]]:
        store, v, kid = self._here()
        return store, v, kid, store.live(v, kid) or {}

    def exists(self) -> bool:
        return bool(self._map()[3])

    def getValue(self, key: Any) -> tuple[Any, ...] | None:
        store, v, kid, m = self._map()
        e = m.get(v.key_codec.encode(key))
        return None if e is None else e[2]

    def containsKey(self, key: Any) -> bool:
        store, v, kid, m = self._map()
        return v.key_codec.encode(key) in m

    def updateValue(self, key: Any, value: Any) -> None:
        store, v, kid, m = self._map()
        kb = v.key_codec.encode(key)
        m[kb] = [store.expiry(v), v.key_codec.decode(kb), v.codec.decode(v.codec.encode(value))]
        store.set(v, kid, m)

    def iterator(self) -> Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]]:
        m = self._map()[3]
        return iter([(x[1], x[2]) for x in m.values()])

    def keys(self) -> Iterator[tuple[Any, ...]]:
        return iter([x[1] for x in self._map()[3].values()])

    def values(self) -> Iterator[tuple[Any, ...]]:
        return iter([x[2] for x in self._map()[3].values()])

    def removeKey(self, key: Any) -> None:
        store, v, kid, m = self._map()
        kb = v.key_codec.encode(key)
        if kb in m:
            del m[kb]
            store.set(v, kid, m or None)

    def clear(self) -> None:
        store, v, kid = self._here()
        store.live(v, kid)
        store.set(v, kid, None)
