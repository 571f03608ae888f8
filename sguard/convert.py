"""Convert a state URI written before key groups (layout version 1) into the key-group layout.

``sguard state convert <state-uri> [--key-groups K]`` (`convert`). A version-1
state URI holds, per partition ``s`` of ``P``, one page manager whose structures
have top-level names (``aggregate``, ``win.100``, ``keydict``...) and hold the keys
Spark's ``repartition(P, key)`` sent there: ``pmod(murmur3(key), P) == s``. The
key-group layout (`sguard.statelayout`, `sguard.spark.groupstate`) keeps each of
``K`` key groups' structures in its own namespace (``kg00042/aggregate``, PSIDs in
the key group's block), partition ``q`` owning the contiguous key groups
``key_group_range(q, P, K)``.

``K`` must be a multiple of ``P`` (default: 8 x ``P``, `default_key_groups`): then ``pmod(h, K)`` determines ``pmod(h, P)``,
so every key group's keys come from exactly one old partition, ``kg mod P``. The
new layout keeps ``P`` (its partition ``q`` gathers the key groups of its range
from the old partitions they lie in) and the conversion is one pass:

1. *validate* (nothing written): a version-1 layout document, ``K``, and every old
   partition's newest checkpoint (this operator, generation and partition; one
   replay position; the same page size; structures the routing rules know, read
   from their super pages alone); the batch ``B`` the new state will be at: the
   last batch every old partition has logged (`_common_batch`);
2. *mark*: ``rescale-pending.json`` (`sguard.rescale.MARKER_FILE`, the marker a
   repartition uses) records the generation being built; a rerun deletes that
   generation's leftovers, and HA units of it without the marker are refused;
3. *split*: each old partition's checkpoint is restored into a private page
   manager and brought to batch ``B`` by replaying its input log with the
   operator opened as the previous sguard opened it (on the whole partition: one
   watermark per partition), so the state agrees with every output the old query
   delivered; then every structure's rows are routed by key group
   (``pmod(murmur3(key), K)``, dictionary ids through their decoded keys) with one
   counting sort, and each key group's rows are bulk-written into
   ``groupstate.namespace(pm_q, kg)`` of the new partition ``q`` that owns it
   (per-partition maps the routing rules replicate, the event-time ``meta``
   watermark and the TTL clock, are copied into every key group of the partition);
4. *checkpoint* each new partition in full under generation ``g + 1``'s HA unit,
   with the runtime's ``user_meta`` (``key_groups``, ``psid_shift``, ``batch_id``
   ``B``);
5. *commit*: `sguard.statelayout.write_layout` of the version-2 document
   (generation ``g + 1``, ``key_groups=K``). Before it the old state is in force
   (and refused by the runtime, naming this command), after it the new one is.
   Nothing of generation ``g`` is ever modified or deleted.

Convert a query that stopped after committing a batch (a clean stop, or a crash
followed by one batch of the previous sguard): then every partition logged that
batch, and it is ``B``. If every partition logged a batch Spark did not commit, the
restarted query finds its state ahead of Spark (`StateAheadError`). Batches logged
after ``B`` by some partitions only are replayed by the runtime after the
conversion, computing each old row's key group (`sguard.spark.inputlog.read_input`).

Why replay before converting: an event-time operator's watermark was per partition
and is now per key group, so replaying old batches after the conversion could close
windows at other batches than the old query did (emitting some twice). Each key
group starts from its old partition's watermark (later rows advance it per key
group), so no row on time before the conversion becomes late because of it. The
``seen`` / ``late`` counters (statistics) are copied into every key group too.

The whole old state passes through memory once (one old partition restored at a
time, the new partitions being built at once): a one-time conversion sized like
the old repartitioning.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ioservice import (CheckpointManager, CheckpointPolicy, IOService, Manifest, StorageRoot,
                       restore)
from ioservice.errors import StorageNotFoundError
from mmm import PageManager
from mmm import jit
from mmm.page import HEADER_BYTES, decode_meta
from mmm.schema import dtype_from_text
from mmm.structures.hashmap import HashMap
from mmm.structures.ordered_map import OrderedMap
from mmm.structures.sequence import PagedDeque, PagedList
from sguard.keygroups import MAX_KEY_GROUPS, key_group_range
from sguard.keygroups import default_key_groups as _default_key_groups
from sguard.partitioning import PartitioningError, murmur3_hash
from sguard.rescale import (KILL_ENV, MARKER_FILE, RescaleError, _delete_generation,
                            _generation_haunits, _kill_point, _newest_manifest, _open,
                            _read_marker)
from sguard.statelayout import (LAYOUT_FILE, LAYOUT_HISTORY_DIR, PSID_SHIFT, LayoutError,
                                OperatorLayout, haunit_name, write_layout)

logger = logging.getLogger(__name__)

__all__ = ["ConvertError", "ConvertResult", "DEFAULT_ROUTING", "KILL_ENV", "convert",
           "default_key_groups"]

_KINDS: Final = ("hash_map", "ordered_map", "list", "deque")
_MiB: Final = 1 << 20


class ConvertError(ValueError):
    """The state cannot be converted as asked (nothing was written)."""


def default_key_groups(num_partitions: int) -> int:
    """K for a conversion: `sguard.keygroups.default_key_groups` (8 x P), which is a multiple
    of P, or P itself where that is capped below a multiple.

    Examples
    --------
    >>> default_key_groups(2), default_key_groups(3), default_key_groups(5000)
    (16, 24, 5000)
    """
    P = int(num_partitions)
    k = _default_key_groups(P)
    return k if k % P == 0 else P


def _check_k(key_groups: Any, P: int) -> int:
    if key_groups is None:
        return default_key_groups(P)
    if not isinstance(key_groups, (int, np.integer)) or isinstance(key_groups, bool):
        raise ConvertError(f"--key-groups must be an integer, got {key_groups!r}")
    k = int(key_groups)
    if not P <= k <= MAX_KEY_GROUPS or k % P:
        raise ConvertError(
            f"--key-groups {k}: must be a multiple of the state's {P} partition(s) in "
            f"[{P}, {MAX_KEY_GROUPS}], so that each key group's keys lie in one old partition "
            f"(default {default_key_groups(P)})")
    return k


@dataclass(frozen=True, slots=True)
class ConvertResult:
    """What `convert` did."""

    from_generation: int
    generation: int
    num_partitions: int
    key_groups: int
    haunits: tuple[str, ...]
    rows: int
    bytes_read: int
    bytes_written: int
    seconds: float
    changed: bool = True


# -- the version-1 layout document (statelayout refuses it publicly) ----------------------------
@dataclass(frozen=True, slots=True)
class _V1:
    operator: str
    name: str
    schema: dict[str, Any]
    num_partitions: int
    key: str | list[str]
    generation: int
    schema_version: int
    partitioner: str
    extra: dict[str, Any]

    def haunit(self, p: int) -> str:
        return haunit_name(self.name, self.generation, p)

    def upgraded(self, key_groups: int) -> OperatorLayout:
        """The version-2 document of the converted state (generation + 1)."""
        return OperatorLayout(operator=self.operator, name=self.name, schema=self.schema,
                              num_partitions=self.num_partitions, key=self.key,
                              generation=self.generation + 1,
                              schema_version=self.schema_version, partitioner=self.partitioner,
                              extra=self.extra, key_groups=key_groups)


def _read_doc(root: StorageRoot) -> tuple[dict[str, Any], str] | None:
    """The layout document as JSON (`LAYOUT_FILE`, else the newest generation copy, as
    `sguard.statelayout.read_layout` reads it), or None."""
    import re
    try:
        data, where = root.read_bytes(LAYOUT_FILE), LAYOUT_FILE
    except StorageNotFoundError:
        pat = re.compile(r"^g(\d{8,})\.json$")
        gens = [int(m[1]) for e in root.list_dir(LAYOUT_HISTORY_DIR, allow_not_found=True)
                if (m := pat.match(e.relpath.rpartition("/")[2])) is not None]
        if not gens:
            return None
        where = f"{LAYOUT_HISTORY_DIR}/g{max(gens):08d}.json"
        data = root.read_bytes(where)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise ConvertError(f"{root.full_path(where)}: not valid JSON") from None
    if not isinstance(doc, dict):
        raise ConvertError(f"{root.full_path(where)}: expected a JSON object")
    return doc, root.full_path(where)


def _v1(doc: Mapping[str, Any], where: str) -> _V1:
    missing = {"operator", "name", "schema", "num_partitions", "key"} - set(doc)
    if missing:
        raise ConvertError(f"{where}: missing field(s) {sorted(missing)}")
    P, g = doc["num_partitions"], doc.get("generation", 0)
    key = doc["key"]
    ok = (isinstance(doc["operator"], str) and isinstance(doc["name"], str)
          and isinstance(doc["schema"], dict) and isinstance(doc.get("extra", {}), dict)
          and isinstance(P, int) and not isinstance(P, bool) and P >= 1
          and isinstance(g, int) and not isinstance(g, bool) and g >= 0
          and (isinstance(key, str) or (isinstance(key, list) and key
                                        and all(isinstance(c, str) for c in key))))
    if not ok:
        raise ConvertError(f"{where}: a damaged layout_version 1 document")
    return _V1(doc["operator"], doc["name"], doc["schema"], P, key, g,
               int(doc.get("schema_version", 1)), str(doc.get("partitioner", "spark-murmur3")),
               dict(doc.get("extra", {})))


# -- how each structure's rows are routed (the previous repartitioning's rules) ------------------
_WATERMARK: Final = {"replicate": True}
DEFAULT_ROUTING: Final[dict[str, dict[str, dict[str, Any]]]] = {
    "window_aggregate": {"meta": _WATERMARK},
    "window_join": {"buf.*": {"key": "k"}, "meta": _WATERMARK},
    "running_aggregate": {"ttl.meta": {"replicate": True}},  # event-time TTL clock
}
"""Routing rules of the `sguard.spark` operators' version-1 state, used when the layout
gives none (``extra["routing"]``, by exact name or glob): ``{"key": <field>}`` routes a
structure's rows by that field, ``{"replicate": ...}`` copies a per-partition map into
every key group of its partition. Without a rule a map with a scalar key routes by its
key, and a structured key, value or record by its field named like the layout's key."""


@dataclass(frozen=True, slots=True)
class _Structure:
    name: str
    kind: str
    schema: dict[str, str]
    page_slots: int
    route: str | None
    """Field of the key / value / record holding the routing key (None: the whole part)."""
    route_in: str
    """"key", "value", "record", or "replicate" (copied into every key group)."""


def _rules_for(layout: _V1, name: str) -> dict[str, Any]:
    table = layout.extra.get("routing")
    if not isinstance(table, dict):
        table = DEFAULT_ROUTING.get(layout.operator, {})
    if name in table:
        return dict(table[name])
    for pattern, rules in table.items():
        if fnmatch.fnmatchcase(name, pattern):
            return dict(rules)
    return {}


def _resolve(layout: _V1, name: str, meta: Mapping[str, Any], where: str) -> _Structure:
    kind = meta.get("kind")
    if kind not in _KINDS:
        raise ConvertError(f"{where}: structure {name!r} is a {kind!r}; conversion knows "
                           f"{', '.join(_KINDS)}")
    schema = dict(meta.get("schema", {}))
    slots = int(meta.get("params", {}).get("page_slots", 0))
    rules = _rules_for(layout, name)
    parts = {p: dtype_from_text(schema[p]) for p in ("key", "value", "record") if p in schema}
    if "replicate" in rules:
        if kind not in ("hash_map", "ordered_map"):
            raise ConvertError(f"{where}: structure {name!r}: only maps can be replicated")
        return _Structure(name, str(kind), schema, slots, None, "replicate")
    want = rules.get("key", layout.key if isinstance(layout.key, str) else None)
    route: str | None = None
    route_in = ""
    if "key" in parts and parts["key"].fields is None and "key" not in rules:
        route_in = "key"
    else:
        for part in ("key", "value", "record"):
            dt = parts.get(part)
            if dt is not None and dt.fields is not None and want in dt.fields:
                route, route_in = want, part
                break
    if not route_in:
        raise ConvertError(f"{where}: structure {name!r} ({kind}) has no column {want!r} to "
                           f"route its rows by (schema {schema}); name one in the layout's "
                           f"extra.routing")
    dt_route = parts[route_in] if route is None else parts[route_in].fields[route][0]  # type: ignore[index]
    try:
        from sguard.partitioning import spark_type_of
        spark_type_of(dt_route)
    except PartitioningError as exc:
        raise ConvertError(f"{where}: structure {name!r}: routing column: {exc}") from None
    return _Structure(name, str(kind), schema, slots, route, route_in)


# -- validation (reads only) ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Source:
    partition: int
    haunit: str
    manifest: Manifest | None
    batch_id: int


def _super_pages(root: StorageRoot, man: Manifest) -> dict[str, dict[str, Any]]:
    """``name -> metadata`` of every page set, read from the super pages alone."""
    out: dict[str, dict[str, Any]] = {}
    pid = man.pages.page_id
    for name, psid in man.structures.items():
        row = np.flatnonzero(pid == np.uint64(psid) << np.uint64(32))
        if not len(row):
            raise ConvertError(f"checkpoint {man.name}: structure {name!r} has no super page")
        r = int(row[0])
        data = root.read_bytes(man.files[int(man.pages.file[r])].path,
                               offset=int(man.pages.offset[r]), length=man.page_bytes)
        out[name] = decode_meta(np.frombuffer(data, np.uint8)[HEADER_BYTES:])
    return out


def _batch_of(man: Manifest) -> int:
    """The one batch an old checkpoint's keys are all at (refused when they differ: a
    repartitioned checkpoint not yet replayed)."""
    um = man.user_meta
    batches = {int(e.get("batch_id", -1)) for e in um.get("sources") or [] if isinstance(e, dict)}
    batches.add(int(um.get("batch_id", -1)))
    if len(batches) > 1:
        raise ConvertError(
            f"checkpoint {man.name}: its keys are at different batches {sorted(batches)} (a "
            f"repartitioning not yet replayed); run the query one more batch with the previous "
            f"sguard so that it checkpoints, then convert")
    return batches.pop()


def _validate(root: StorageRoot, layout: _V1) -> tuple[list[_Source], list[_Structure], int]:
    sources: list[_Source] = []
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    page_bytes = 0
    for s in range(layout.num_partitions):
        hu = layout.haunit(s)
        man = _newest_manifest(root, hu)
        if man is None:
            sources.append(_Source(s, hu, None, -1))
            continue
        um = dict(man.user_meta)
        expect = {"operator": layout.operator, "name": layout.name,
                  "generation": layout.generation, "partition": s,
                  "num_partitions": layout.num_partitions}
        for k, v in expect.items():
            if um.get(k) != v:
                raise ConvertError(f"checkpoint {man.name}: user_meta {k}={um.get(k)!r}, but the "
                                   f"layout says {v!r} (mixed operators or generations)")
        if "key_groups" in um:
            raise ConvertError(f"checkpoint {man.name} is already in the key-group layout")
        if page_bytes and man.page_bytes != page_bytes:
            raise ConvertError(f"checkpoint {man.name}: {man.page_bytes}-byte pages, other "
                               f"partitions use {page_bytes}")
        page_bytes = man.page_bytes
        for name, meta in _super_pages(root, man).items():
            sig = json.dumps([meta.get("kind"), meta.get("schema")], sort_keys=True)
            if name in found and found[name][0] != sig:
                raise ConvertError(f"checkpoint {man.name}: structure {name!r} is "
                                   f"{meta.get('kind')} {meta.get('schema')}, in another "
                                   f"partition {found[name][0]} (mixed schema versions)")
            found.setdefault(name, (sig, meta))
        sources.append(_Source(s, hu, man, _batch_of(man)))
    structs = [_resolve(layout, n, found[n][1], f"operator {layout.name!r}")
               for n in sorted(found) if not _is_keydict(n)]
    return sources, structs, page_bytes or 65536


def _is_keydict(name: str) -> bool:
    from sguard.spark.keys import KEYDICT
    return name == KEYDICT or name.startswith(KEYDICT + ".")


def _key_spec(layout: _V1) -> Any:
    """The `sguard.spark.keys.KeySpec` of a state keyed by dictionary ids (None: keyed by
    the key values themselves)."""
    keys = layout.extra.get("keys")
    if not isinstance(keys, dict) or keys.get("encoding") != "dictionary":
        return None
    import base64

    import pyarrow as pa
    import pyarrow.ipc as ipc

    from sguard.spark.keys import key_spec
    try:
        schema = ipc.read_schema(pa.py_buffer(base64.b64decode(layout.extra["arrow_schema"])))
        return key_spec(schema, layout.key)
    except (KeyError, ValueError, TypeError) as exc:
        raise ConvertError(f"operator {layout.name!r}: the layout's key columns "
                           f"{layout.key!r} cannot be read back ({exc})") from None


# -- splitting one old partition by key group ---------------------------------------------------
@jit
def _route(h: Any, modulus: Any, index: Any, n_out: Any) -> Any:
    """Counting sort of rows by output ``index[pmod(h, modulus)]`` (-1: none).

    Returns ``(order, bounds)``: output ``i`` is ``order[bounds[i]:bounds[i + 1]]``, rows in
    input order; rows of no output are left out.
    """
    n = h.shape[0]
    dest = np.empty(n, np.int64)
    bounds = np.zeros(n_out + 1, np.int64)
    for i in range(n):
        r = np.int64(h[i]) % modulus
        if r < 0:
            r += modulus
        d = index[r]
        dest[i] = d
        if d >= 0:
            bounds[d + 1] += 1
    for j in range(n_out):
        bounds[j + 1] += bounds[j]
    fill = bounds[:n_out].copy()
    order = np.empty(bounds[n_out], np.int64)
    for i in range(n):
        d = dest[i]
        if d >= 0:
            order[fill[d]] = i
            fill[d] += 1
    return order, bounds


def _take(rows: npt.NDArray[Any], sel: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
    """``rows[sel]``, gathering whole records as machine words."""
    size = rows.dtype.itemsize
    if rows.dtype.fields is None or not rows.flags.c_contiguous:
        return rows[sel]
    word = np.dtype(np.uint64) if size % 8 == 0 else np.dtype(np.uint8)
    flat = rows.view(word).reshape(len(rows), size // word.itemsize)
    out: npt.NDArray[Any] = np.take(flat, sel, axis=0).view(rows.dtype).reshape(len(sel))
    return out


def _read_structure(pm: PageManager, st: _Structure
                    ) -> tuple[npt.NDArray[Any] | None, npt.NDArray[Any]]:
    sch = st.schema
    if st.kind in ("hash_map", "ordered_map"):
        cls = HashMap if st.kind == "hash_map" else OrderedMap
        m = cls.create(pm, st.name, key=dtype_from_text(sch["key"]),
                       value=dtype_from_text(sch["value"]))
        return m.items()
    seq_cls = PagedList if st.kind == "list" else PagedDeque
    return None, seq_cls.create(pm, st.name, dtype_from_text(sch["record"])).to_numpy()


def _route_column(st: _Structure, keys: Any, values: Any) -> Any:
    if st.route_in == "key":
        return keys if st.route is None else keys[st.route]
    if st.route_in == "value":
        return values[st.route]
    return values if st.route is None else values[st.route]


_KEYS: Final = "\0keys"
"""A key group's entry for the key dictionary's keys it receives."""


def _split(pm: PageManager, layout: _V1, structs: Sequence[_Structure], kspec: Any,
           index: npt.NDArray[np.int64], K: int, n_out: int
           ) -> list[dict[str, Any]]:
    """Every structure's rows of one restored old partition, by key group: output ``i``
    is key group ``kg`` with ``index[kg] == i``. Replicated structures go to every output."""
    import pyarrow as pa
    out: list[dict[str, Any]] = [{} for _ in range(n_out)]
    id_hash = None
    if kspec is not None:
        from mmm.structures.keydict import KeyDict
        from sguard.spark.keys import KEYDICT, decode
        kd = KeyDict.create(pm, KEYDICT)
        ids, data, offs, valid = kd.items()
        ids, offs = np.asarray(ids, np.int64), np.asarray(offs, np.int64)
        valid = np.ones(len(ids), bool) if valid is None else np.asarray(valid, bool)
        h = (murmur3_hash(pa.Table.from_arrays(decode(kspec, data, offs, valid),
                                               names=list(kspec.columns)))
             if len(ids) else np.zeros(0, np.int32))
        id_hash = np.zeros(int(ids.max()) + 1 if len(ids) else 0, np.int32)
        id_hash[ids] = h
        order, bounds = _route(h, K, index, n_out)
        _check_routed(len(order), len(ids), "the key dictionary")
        for i in range(n_out):
            sel = order[bounds[i]:bounds[i + 1]]
            if not len(sel):
                continue
            lens = offs[sel + 1] - offs[sel]
            o = np.zeros(len(sel) + 1, np.int64)
            np.cumsum(lens, out=o[1:])
            gather = np.repeat(offs[sel] - o[:-1], lens) + np.arange(o[-1])
            out[i][_KEYS] = (ids[sel], (np.asarray(data)[gather], o), valid[sel])
    for st in structs:
        if not pm.exists(st.name):  # e.g. a window another partition has open
            continue
        keys, vals = _read_structure(pm, st)
        if st.route_in == "replicate":
            for i in range(n_out):
                out[i][st.name] = (keys, vals)
            continue
        col = _route_column(st, keys, vals)
        h = murmur3_hash(col) if id_hash is None else id_hash[col]
        order, bounds = _route(h, K, index, n_out)
        _check_routed(len(order), len(vals), f"structure {st.name!r}")
        for i in range(n_out):
            sel = order[bounds[i]:bounds[i + 1]]
            if len(sel):
                out[i][st.name] = (None if keys is None else _take(keys, sel), _take(vals, sel))
    return out


def _check_routed(routed: int, total: int, what: str) -> None:
    if routed != total:
        raise ConvertError(f"{what}: {total - routed} row(s) whose key Spark's partitioner "
                           f"sends to another partition (damaged state, or not partitioned "
                           f"by pmod(murmur3(key), P))")


def _write_group(ns: Any, structs: Sequence[_Structure], piece: Mapping[str, Any]) -> int:
    """Build one key group's structures in its namespace from its rows; returns the rows."""
    remap = None
    if _KEYS in piece:  # intern the group's keys into its own dictionary
        from mmm.structures.keydict import KeyDict
        from sguard.spark.keys import KEYDICT
        old, (data, offs), valid = piece[_KEYS]
        new = np.asarray(KeyDict.create(ns, KEYDICT).intern(data, offs, valid), np.int64)
        remap = np.full(int(old.max()) + 1, -1, np.int64)
        remap[old] = new
    rows = 0
    for st in structs:
        got = piece.get(st.name)
        if got is None:
            continue
        keys, vals = got
        if remap is not None and st.route_in != "replicate":
            keys, vals = _remapped(st, keys, vals, remap)
        rows += len(vals)
        sch = st.schema
        if st.kind in ("hash_map", "ordered_map"):
            cls = HashMap if st.kind == "hash_map" else OrderedMap
            m = cls.create(ns, st.name, key=dtype_from_text(sch["key"]),
                           value=dtype_from_text(sch["value"]), page_slots=st.page_slots or None)
            if not len(vals):
                continue
            if isinstance(m, HashMap):
                try:
                    m.load_distinct(keys, vals)
                except ValueError as exc:  # a key twice in one map: damaged source
                    raise ConvertError(f"structure {st.name!r}: {exc}") from None
            else:
                m.put(keys, vals)
        else:
            seq_cls = PagedList if st.kind == "list" else PagedDeque
            s = seq_cls.create(ns, st.name, dtype_from_text(sch["record"]),
                               page_slots=st.page_slots or None)
            if len(vals):
                s.extend(vals)
    return rows


def _remapped(st: _Structure, keys: Any, vals: Any, m: npt.NDArray[np.int64]
              ) -> tuple[Any, Any]:
    """Rows with their routing column's dictionary ids replaced through `m`."""
    if st.route_in == "key" and st.route is None:
        return m[keys].astype(keys.dtype), vals
    if st.route_in == "key":
        keys = keys.copy()
        keys[st.route] = m[keys[st.route]]
        return keys, vals
    vals = vals.copy()
    if st.route is None:
        return keys, m[vals].astype(vals.dtype)
    vals[st.route] = m[vals[st.route]]
    return keys, vals


# -- the old partitions brought to one batch, with the old code's semantics -------------------
def _fence(root: StorageRoot, src: _Source) -> Any:
    from sguard.spark import fencing
    return fencing.read_claims(root, src.haunit)


def _common_batch(root: StorageRoot, layout: _V1, sources: Sequence[_Source]) -> int:
    """The last batch every old partition has logged (contiguously from its checkpoint):
    the batch the converted state is at. For a query that stopped after committing its last
    batch, every partition logged it."""
    from sguard.spark.inputlog import valid_batches
    reach = []
    for src in sources:
        have = valid_batches(root, layout.generation, src.partition, _fence(root, src))
        r = src.batch_id
        while r + 1 in have:
            r += 1
        reach.append(r)
    upto = min(reach)
    behind = [s for s in sources if s.batch_id > upto]
    if behind:
        raise ConvertError(
            f"partition {behind[0].partition}'s checkpoint holds batch {behind[0].batch_id}, "
            f"but the input log of another partition ends at batch {upto}: the old state's "
            f"partitions cannot be brought to one batch")
    return upto


def _replay_old(root: StorageRoot, layout: _V1, src: _Source, pm: PageManager, at: int,
                upto: int, K: int) -> int:
    """Apply the partition's logged batches ``at + 1 .. upto`` to its old state, with the
    operator opened on the whole page manager as the previous sguard did (one watermark per
    partition): the outputs the old query delivered for them stay the state's history.
    Returns the rows applied."""
    if upto <= at:
        return 0
    import base64

    import pyarrow as pa
    import pyarrow.ipc as ipc

    from sguard.spark import inputlog
    from sguard.spark.columns import KG_COLUMN
    from sguard.spark.operators import operator_from_params
    try:
        op = operator_from_params(layout.operator, layout.schema["params"])
        schema = ipc.read_schema(pa.py_buffer(base64.b64decode(layout.extra["arrow_schema"])))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConvertError(f"operator {layout.name!r}: cannot rebuild it from the layout to "
                           f"replay the input log ({exc})") from None
    state = op.open(pm, schema, layout.key)
    fence = _fence(root, src)
    n = 0
    for x in range(at + 1, upto + 1):
        t = inputlog.read_input(root, x, layout.generation, src.partition,
                                layout.num_partitions, layout.key, fence, key_groups=K)
        t = t.drop_columns([KG_COLUMN])
        state.apply(t, x)
        n += t.num_rows
    pm.flush_structures()
    return n


# -- public API ----------------------------------------------------------------------------------
def convert(root: StorageRoot | str, key_groups: int | None = None, *, io_workers: int = 4,
            on_progress: Callable[[str], None] | None = None) -> ConvertResult:
    """Convert the version-1 state under `root` into the key-group layout (module docstring).

    Parameters
    ----------
    root : StorageRoot or str
        The state URI.
    key_groups : int, optional
        ``K``: a multiple of the state's partition count ``P``, at most 32768
        (default `default_key_groups`). Fixed for the state's life: it bounds how far
        the state can later be scaled out.
    on_progress : callable, optional
        Called with a short message per phase.

    Returns
    -------
    ConvertResult
        ``changed=False`` when the state is already in the key-group layout (then
        nothing is done).

    Raises
    ------
    ConvertError
        No state there, a damaged document, a bad `key_groups`, old checkpoints that
        do not fit, HA units of the new generation that no conversion made. Nothing
        was written.
    ioservice.IOServiceError
        Storage failures mid-way: the old state is still in force; a rerun completes.
    """
    t0 = time.perf_counter()
    say = on_progress or (lambda msg: None)
    try:
        sroot = _open(root)
        if isinstance(root, str) and not sroot.exists(""):
            raise ConvertError(f"state URI {root}: does not exist")
        got = _read_doc(sroot)
    except RescaleError as exc:
        raise ConvertError(str(exc)) from None
    if got is None:
        raise ConvertError(f"state URI {sroot.uri}: no sguard operator state there "
                           f"(no {LAYOUT_FILE})")
    doc, where = got
    version = doc.get("layout_version")
    if version == 2:
        try:
            lay = OperatorLayout.from_json(json.dumps(doc).encode(), where=where)
        except LayoutError as exc:
            raise ConvertError(str(exc)) from None
        if key_groups is not None and key_groups != lay.key_groups:
            raise ConvertError(f"state URI {sroot.uri} is already in the key-group layout "
                               f"with {lay.key_groups} key groups; --key-groups {key_groups} "
                               f"cannot change them")
        marker = _read_marker(sroot)
        if marker is not None and marker.get("to_generation", -1) <= lay.generation:
            sroot.delete_file(MARKER_FILE, missing_ok=True)  # a committed run's leftover
        return ConvertResult(lay.generation, lay.generation, lay.num_partitions,
                             lay.key_groups, tuple(lay.haunit(p)
                                                   for p in range(lay.num_partitions)),
                             0, 0, 0, time.perf_counter() - t0, changed=False)
    if version != 1:
        raise ConvertError(f"{where}: unsupported layout_version {version!r}")
    old = _v1(doc, where)
    P, g = old.num_partitions, old.generation
    K = _check_k(key_groups, P)
    new = old.upgraded(K)
    sources, structs, page_bytes = _validate(sroot, old)
    kspec = _key_spec(old)
    upto = _common_batch(sroot, old, sources)
    marker = _read_marker(sroot)
    leftovers = _generation_haunits(sroot, old.name, g + 1)
    if leftovers and marker is None:
        raise ConvertError(f"state URI {sroot.uri}: HA units of generation {g + 1} exist "
                           f"({', '.join(leftovers[:3])}{'...' if len(leftovers) > 3 else ''}) "
                           f"but no conversion made them ({MARKER_FILE} missing); refusing to "
                           f"touch them")
    _kill_point("validated")
    say(f"converting {P} partition(s) of generation {g} into {K} key groups")
    sroot.write_atomic(MARKER_FILE, json.dumps(
        {"convert": True, "from_generation": g, "to_generation": g + 1, "num_partitions": P,
         "key_groups": K, "created_unix_s": time.time()}).encode())
    _kill_point("marked")
    if leftovers:  # an interrupted run's
        n = _delete_generation(sroot, old.name, g + 1)
        say(f"removed {n} checkpoint(s) of an interrupted conversion")
    from sguard.spark.groupstate import namespace

    io = IOService(io_workers)
    try:
        state_bytes = sum(s.manifest.state_bytes for s in sources if s.manifest is not None)
        # the new partitions, built at once (a key group comes from one old partition, a new
        # partition's key groups from several); capacity is virtual (pages touched only)
        cap = max(64 * _MiB, 4 * state_bytes // P + 16 * (K // P) * (len(structs) + 1)
                  * page_bytes)
        targets = [PageManager(page_bytes, capacity_bytes=cap) for _ in range(P)]
        rows = read = 0
        n_out = K // P
        for src in sources:
            kgs = np.arange(src.partition, K, P, dtype=np.int64)  # kg mod P == partition
            pm = PageManager(page_bytes, capacity_bytes=max(256 * _MiB, 4 * state_bytes // P))
            at = -1
            if src.manifest is not None:
                man = restore(pm, sroot, src.haunit, io=io, before_seq=src.manifest.seq + 1)
                if man.name != src.manifest.name:  # the newest was damaged: an older one
                    logger.warning("convert: %s unreadable, using %s", src.manifest.name,
                                   man.name)
                read += man.state_bytes
                at = _batch_of(man)
            rows_replayed = _replay_old(sroot, old, src, pm, at, upto, K)
            # the structures this partition holds now (a replay may have opened windows)
            present = [_resolve(old, n, pm.read_meta(pm.recover(n)), f"operator {old.name!r}")
                       for n in sorted(pm.names()) if not _is_keydict(n)]
            index = np.full(K, -1, np.int64)
            index[kgs] = np.arange(n_out)
            pieces = _split(pm, old, present, kspec, index, K, n_out)
            del pm
            for i, kg in enumerate(kgs.tolist()):
                q = kg * P // K
                rows += _write_group(namespace(targets[q], kg), present, pieces[i])
                pieces[i] = {}
            say(f"converted partition {src.partition} (replayed {rows_replayed} logged rows "
                f"of batches {at + 1}..{upto})")
            _kill_point("source_converted")
        written = 0
        inflight: list[tuple[CheckpointManager, Any]] = []
        try:
            for q, pm in enumerate(targets):
                lo, hi = key_group_range(q, P, K)
                meta: dict[str, Any] = {
                    "operator": old.operator, "name": old.name, "generation": g + 1,
                    "partition": q, "num_partitions": P, "key_groups": [lo, hi],
                    "psid_shift": PSID_SHIFT, "batch_id": upto,
                    "converted_from": {"layout_version": 1, "generation": g}}
                mgr = CheckpointManager(pm, sroot, new.haunit(q), io=io, check_root=False,
                                        policy=CheckpointPolicy(keep=None, full_every=1))
                inflight.append((mgr, None))
                pending = mgr.checkpoint(meta, full=True)
                assert pending is not None
                inflight[-1] = (mgr, pending)
            for q, (mgr, pending) in enumerate(inflight):
                written += pending.result().written_bytes
                _kill_point("target_written")
        finally:
            for mgr, _ in inflight:
                mgr.close()
        del targets
        say(f"checkpointed {P} partition(s) of generation {g + 1}")
    finally:
        io.shutdown()
    _kill_point("before_commit")
    write_layout(sroot, new)
    _kill_point("committed")
    sroot.delete_file(MARKER_FILE, missing_ok=True)
    logger.info("converted %s to key groups: %d partitions, %d key groups (generation %d)",
                sroot.uri, P, K, g + 1)
    return ConvertResult(g, g + 1, P, K, tuple(new.haunit(q) for q in range(P)), rows, read,
                         written, time.perf_counter() - t0)
