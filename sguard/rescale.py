"""Repartition an operator's checkpointed state to a new number of partitions (SEEP §3.2, §4).

The state of a stateful operator lives under a state URI (`sguard.statelayout`):
one HA unit per partition of the current generation ``g``, each checkpointed by
`ioservice.CheckpointManager`. `repartition` turns the P partitions of
generation ``g`` into P' partitions of generation ``g + 1``, so that every key
sits in the partition Spark's ``repartition(P', key)`` sends its rows to
(`sguard.partitioning.partition_of`):

1. *validate* (nothing written): the layout document exists, ``P' >= 1``, every
   source checkpoint belongs to this operator, name, generation and partition,
   and all sources hold the same structures (kind and schema, read from their
   super pages only) and page size;
2. *mark*: ``rescale-pending.json`` records the generation being built. A rerun
   that finds it deletes the HA units of that generation (its own leftovers)
   and starts over; HA units of generation ``g + 1`` without the marker were not
   made by a repartition and are refused, never deleted;
3. *split*: each source checkpoint is restored (`ioservice.restore`) into a
   private `mmm.PageManager`; every structure's rows are read in bulk
   (``items()`` / ``to_numpy()``), routed by their key column with one
   compiled hash (`sguard.partitioning.partition_of`) and a counting sort,
   and bulk-built into the same-named structure of the target partition (a
   hash map in one compiled pass, `mmm.HashMap.load_distinct`; an ordered map
   by one sorted ``put``; sequences by ``extend``); each target is
   checkpointed in full under its generation-``g + 1`` HA unit name;
4. *commit*: `sguard.statelayout.write_layout` with ``generation + 1`` and P'.
   Before it the old generation is the state, after it the new one is; the
   sources are only ever read.

Independent groups
------------------
A key with hash ``h`` is in old partition ``h mod P`` and new partition
``h mod P'`` (floor modulo), so old partition ``s`` feeds new partition ``t``
only if ``s = t (mod gcd(P, P'))``. The work therefore splits into
``gcd(P, P')`` independent groups (2 -> 4: two groups of one source and two
targets; 4 -> 2: two groups of two sources and one target), which run in
parallel worker threads (the compiled kernels release the GIL) or processes;
no rows cross between groups.

Which column routes a structure's rows
--------------------------------------
The layout names the key column (``layout.key``). ``layout.extra["routing"]``
may hold rules per structure, by exact name or glob pattern (``"buf.*"``):
``{"key": <field>, "order": <field>}`` or ``{"replicate": {<field>: <op>}}``.
For each structure, in order: a ``replicate`` rule copies a (per-partition)
map to every target, combining the rows of one key from several sources with
the per-field op (min, max, sum, first, last; e.g. a watermark's ``max_ts``
with max); a ``key`` rule names the field to route by; a map whose key is a
scalar routes by its key; a structured key, value or record with a field named
``layout.key`` routes by that field. Anything else is refused (naming the
structure). Beware: a per-partition map with a scalar key (say ``meta`` keyed by
``uint8 0``) routes by that key unless a ``replicate`` rule says otherwise.
``order`` names a field by which a list or deque is kept sorted when several
sources merge into one target (a join's time-ordered window buffer); without
it, records keep their source order, sources one after another. A structure
that only some partitions hold (an open window) is carried to the targets
those partitions feed.

Replay positions move with the keys (the contract with the runtime)
--------------------------------------------------------------------
Source partitions may have been checkpointed after different batches. Each
target checkpoint's ``user_meta`` therefore records, besides the usual
``operator, name, generation, partition, num_partitions`` and ``batch_id``
(the *smallest* batch any of its keys is at), the list::

    "sources": [{"num_partitions": M, "partition": r, "batch_id": b}, ...]

meaning "the keys with ``pmod(murmur3(key), M) == r`` include every batch up
to ``b``". Every key of the target matches exactly one entry. After restoring
such a checkpoint the runtime replays, for each logged batch ``b' >
batch_id``, exactly the rows with ``partition_of(key, P') == partition`` and
``batch_of(key) < b'`` (`ReplayPositions.needs`; `replay_mask` does both), then
checkpoints as usual, which drops ``sources``. The input log must therefore be
kept back to the smallest ``batch_id`` over all partitions. When every source
was at the same batch, ``sources`` has one entry and the checkpoint is an
ordinary one. A repartition of a not-yet-replayed target composes the entries
(moduli become least common multiples).

Parallel recovery (SEEP §4.2): `restore_piece` restores piece ``j`` of ``k`` of
one partition -- the keys of old partition ``s`` with ``pmod(h, P * k) == s +
P * j`` -- into a worker's page manager, so ``k`` workers each rebuild and replay
a ``1/k`` share of a failed partition. Each piece reads and checksums the whole
checkpoint (a page holds keys of every piece), so the pieces together read it
``k`` times and route every row ``k`` times: as pieces, recovery wins only when
the replay of the input log (which the pieces share out) outweighs that, and
never by ``k`` on fewer than ``k`` cores (`bench.rescale` measures it).
"""
from __future__ import annotations

import fnmatch
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Final

import multiprocessing as mp
import numpy as np
import numpy.typing as npt

from ioservice import (CheckpointManager, CheckpointPolicy, IOService, Manifest, StorageRoot,
                       list_checkpoints, list_haunits, open_root, read_manifest, restore)
from ioservice.errors import IOServiceError, StorageNotFoundError
from mmm import PageManager
from mmm._kernels import jit
from mmm.page import HEADER_BYTES, decode_meta
from mmm.schema import dtype_from_text
from mmm.structures.hashmap import HashMap
from mmm.structures.ordered_map import OrderedMap
from mmm.structures.sequence import PagedDeque, PagedList
from sguard.partitioning import PartitioningError, partition_of, pmod, murmur3_hash
from sguard.statelayout import (LAYOUT_FILE, LayoutError, OperatorLayout, haunit_name,
                                parse_haunit_name, read_layout, write_layout)

logger = logging.getLogger(__name__)

__all__ = ["MARKER_FILE", "KILL_ENV", "DEFAULT_ROUTING", "RescaleError", "RescaleResult", "KeyClass",
           "ReplayPositions", "repartition", "restore_piece", "replay_mask", "source_groups"]

MARKER_FILE: Final = "rescale-pending.json"
KILL_ENV: Final = "SGUARD_RESCALE_KILL_AT"
"""Test hook: ``<point>[:<n>]`` SIGKILLs the process the n-th time it passes `point`."""

_STANDARD_META: Final = ("operator", "name", "generation", "partition", "num_partitions",
                         "batch_id", "sources", "rescaled_from", "dropped_meta")
_KINDS: Final = ("hash_map", "ordered_map", "list", "deque")
_MiB: Final = 1 << 20


class RescaleError(ValueError):
    """A repartitioning refused: bad argument or inconsistent state (nothing was written)."""


# -- replay positions ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KeyClass:
    """The keys with ``pmod(murmur3(key), num_partitions) == partition`` are at `batch_id`."""

    num_partitions: int
    partition: int
    batch_id: int

    def to_json(self) -> dict[str, int]:
        return {"num_partitions": self.num_partitions, "partition": self.partition,
                "batch_id": self.batch_id}

    def intersect(self, num_partitions: int, partition: int) -> KeyClass | None:
        """This class restricted to the keys of `partition` of `num_partitions`, or None."""
        m, r, p, t = self.num_partitions, self.partition, num_partitions, partition
        g = math.gcd(m, p)
        if (r - t) % g:
            return None
        lcm = m // g * p
        x = next(x for x in range(r, lcm, m) if x % p == t)
        return KeyClass(lcm, x, self.batch_id)


@dataclass(frozen=True, slots=True)
class ReplayPositions:
    """Per key class, the last batch a partition's state includes (see the module docstring).

    Build one from a checkpoint's ``user_meta`` with `from_user_meta`.
    """

    classes: tuple[KeyClass, ...]

    @classmethod
    def from_user_meta(cls, meta: Mapping[str, Any]) -> ReplayPositions:
        """Read ``sources`` (or, for an ordinary checkpoint, its partition and batch_id).

        Raises
        ------
        RescaleError
            If fields are missing or malformed.
        """
        try:
            if meta.get("sources"):
                return cls(tuple(KeyClass(int(e["num_partitions"]), int(e["partition"]),
                                          int(e["batch_id"])) for e in meta["sources"]))
            return cls((KeyClass(int(meta["num_partitions"]), int(meta["partition"]),
                                 int(meta.get("batch_id", -1))),))
        except (KeyError, TypeError, ValueError) as exc:
            raise RescaleError(f"checkpoint user_meta has no valid replay position: {exc!r}") \
                from None

    @property
    def min_batch_id(self) -> int:
        """The oldest batch any key is at: replay starts after it."""
        return min(c.batch_id for c in self.classes)

    @property
    def max_batch_id(self) -> int:
        return max(c.batch_id for c in self.classes)

    def restrict(self, num_partitions: int, partition: int) -> ReplayPositions:
        """The positions of the keys that also lie in `partition` of `num_partitions`.

        When these positions cover every key of that partition and all share one
        batch, the result is the single class ``(num_partitions, partition, b)``.
        """
        out = [k for c in self.classes if (k := c.intersect(num_partitions, partition))]
        return ReplayPositions(tuple(out))

    def simplified(self, num_partitions: int, partition: int) -> ReplayPositions:
        """One class ``(num_partitions, partition, b)`` when every class is at batch ``b``.

        Only valid for the complete positions of that partition.
        """
        if self.classes and len({c.batch_id for c in self.classes}) == 1:
            return ReplayPositions((KeyClass(num_partitions, partition,
                                             self.classes[0].batch_id),))
        return self

    def batch_of(self, keys: Any) -> npt.NDArray[np.int64]:
        """The batch each key's state is at (-1 for keys of no class: they have no state)."""
        h = murmur3_hash(keys)
        out = np.full(len(h), -1, np.int64)
        for c in self.classes:
            out[pmod(h, c.num_partitions) == c.partition] = c.batch_id
        return out

    def needs(self, keys: Any, batch_id: int) -> npt.NDArray[np.bool_]:
        """Which rows of batch `batch_id` the state has not seen yet."""
        return self.batch_of(keys) < batch_id

    def to_json(self) -> list[dict[str, int]]:
        return [c.to_json() for c in self.classes]


def replay_mask(user_meta: Mapping[str, Any], keys: Any, batch_id: int) -> npt.NDArray[np.bool_]:
    """Rows of logged batch `batch_id` that the partition restored with `user_meta` must apply.

    ``partition_of(key, num_partitions) == partition`` and the key's state is
    older than the batch (`ReplayPositions.needs`).
    """
    mine: npt.NDArray[np.bool_] = partition_of(keys, int(user_meta["num_partitions"])) \
        == int(user_meta["partition"])
    out: npt.NDArray[np.bool_] = mine & ReplayPositions.from_user_meta(user_meta).needs(keys,
                                                                                       batch_id)
    return out


# -- plans and results -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Structure:
    """One structure to carry over: how to read, route and rebuild it."""

    name: str
    kind: str
    schema: dict[str, str]
    page_slots: int
    route: str | None
    """Field of the key (maps), value or record holding the routing key; None: the map key itself."""
    route_in: str
    """"key", "value" or "record"; "replicate": every target gets every row (combined)."""
    order: str | None
    combine: dict[str, str] | None = None
    """For a replicated map: how rows of one key from several sources combine, per field."""


@dataclass(frozen=True, slots=True)
class _Source:
    partition: int
    haunit: str
    checkpoint: str | None
    state_bytes: int
    user_meta: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Group:
    """Sources and targets that exchange keys only with each other."""

    sources: tuple[_Source, ...]
    targets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RescaleResult:
    """What `repartition` did."""

    from_generation: int
    generation: int
    from_partitions: int
    num_partitions: int
    haunits: tuple[str, ...]
    bytes_read: int
    bytes_written: int
    rows: int
    seconds: float
    phases_s: dict[str, float] = field(default_factory=dict)
    """Seconds: ``validate_s``, ``split_s`` (wall clock of the parallel part) and, summed
    over the workers, ``read_s`` (pages read and checksummed), ``extract_s`` (rows out of
    the pages), ``route_s`` (partition ids, counting sort, gathers), ``build_s`` (target
    structures built) and ``write_s`` (target checkpoints written); ``restore_route_s``,
    ``insert_s`` and ``checkpoint_s`` group them as earlier versions did."""
    changed: bool = True


# -- kill points (tests) --------------------------------------------------------------------------
_passes: dict[str, int] = {}


def _kill_point(point: str) -> None:
    """SIGKILL this process when `KILL_ENV` names `point` (optionally its n-th pass)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    name, _, nth = spec.partition(":")
    if name != point:
        return
    _passes[point] = _passes.get(point, 0) + 1
    if _passes[point] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


# -- validation (reads only) --------------------------------------------------------------------------
def _open(root: StorageRoot | str) -> StorageRoot:
    if isinstance(root, StorageRoot):
        return root
    try:
        return open_root(root, create=False)
    except IOServiceError as exc:
        raise RescaleError(f"state URI {root}: {exc}") from None


def _layout(root: StorageRoot) -> OperatorLayout:
    try:
        layout = read_layout(root)
    except LayoutError as exc:
        raise RescaleError(str(exc)) from None
    except IOServiceError as exc:
        raise RescaleError(f"state URI {root.uri}: {exc}") from None
    if layout is None:
        raise RescaleError(f"state URI {root.uri}: no sguard operator state there "
                           f"(no {LAYOUT_FILE})")
    return layout


def _newest_manifest(root: StorageRoot, haunit: str) -> Manifest | None:
    """The newest checkpoint of `haunit` whose manifest parses, or None."""
    for c in reversed([c for c in list_checkpoints(root, haunit) if c.has_manifest]):
        try:
            return read_manifest(root, c.name)
        except (IOServiceError, ValueError) as exc:
            logger.warning("skipping checkpoint %s: %s", c.name, exc)
    return None


def _super_pages(root: StorageRoot, man: Manifest) -> dict[str, dict[str, Any]]:
    """``name -> metadata`` of every page set, read from the super pages alone."""
    out: dict[str, dict[str, Any]] = {}
    pid = man.pages.page_id
    for name, psid in man.structures.items():
        row = np.flatnonzero(pid == np.uint64(psid) << np.uint64(32))
        if not len(row):
            raise RescaleError(f"checkpoint {man.name}: structure {name!r} has no super page")
        r = int(row[0])
        data = root.read_bytes(man.files[int(man.pages.file[r])].path,
                               offset=int(man.pages.offset[r]), length=man.page_bytes)
        out[name] = decode_meta(np.frombuffer(data, np.uint8)[HEADER_BYTES:])
    return out


_WATERMARK: Final = {"replicate": {"max_ts": "max", "seen": "sum", "late": "sum"}}
DEFAULT_ROUTING: Final[dict[str, dict[str, dict[str, Any]]]] = {
    "window_aggregate": {"meta": _WATERMARK},
    "window_join": {"buf.*": {"key": "k", "order": "t"}, "meta": _WATERMARK},
}
"""Routing rules of the `sguard.spark` operators, used when the layout gives none.

Their ``meta`` map (one row: the watermark's ``max_ts`` and the ``seen`` /
``late`` row counters) is replicated: ``max_ts`` takes the max over the merged
sources; the counters are summed, so after a scale-out every new partition
starts from its sources' totals (they are statistics, not results)."""


def _rules_for(layout: OperatorLayout, name: str) -> dict[str, Any]:
    """The routing rules of `name`: ``layout.extra["routing"]`` (exact name, else the first
    matching glob pattern such as ``"buf.*"``), else `DEFAULT_ROUTING` of the operator kind."""
    table = layout.extra.get("routing")
    if not isinstance(table, dict):
        table = DEFAULT_ROUTING.get(layout.operator, {})
    if name in table:
        return dict(table[name])
    for pattern, rules in table.items():
        if fnmatch.fnmatchcase(name, pattern):
            return dict(rules)
    return {}


def _resolve(layout: OperatorLayout, name: str, meta: Mapping[str, Any], where: str) -> _Structure:
    """How structure `name` (its super-page metadata) is read, routed and rebuilt."""
    kind = meta.get("kind")
    if kind not in _KINDS:
        raise RescaleError(f"{where}: structure {name!r} is a {kind!r}; repartitioning knows "
                           f"{', '.join(_KINDS)}")
    schema = dict(meta.get("schema", {}))
    slots = int(meta.get("params", {}).get("page_slots", 0))
    rules = _rules_for(layout, name)
    want = rules.get("key", layout.key)
    order = rules.get("order")
    parts = {p: dtype_from_text(schema[p]) for p in ("key", "value", "record") if p in schema}
    route: str | None = None
    route_in = ""
    if "replicate" in rules:
        vdt = parts.get("value")
        if kind not in ("hash_map", "ordered_map") or vdt is None or vdt.names is None:
            raise RescaleError(f"{where}: structure {name!r}: only maps with structured values "
                               f"can be replicated")
        op = rules["replicate"]
        ops = {f: op for f in vdt.names} if isinstance(op, str) else dict(op)
        bad = {f: o for f, o in ops.items() if f not in vdt.names
               or o not in ("min", "max", "sum", "first", "last")}
        if bad or set(ops) != set(vdt.names):
            raise RescaleError(f"{where}: structure {name!r}: replicate needs an op "
                               f"(min/max/sum/first/last) for each of the fields {vdt.names}, "
                               f"got {rules['replicate']!r}")
        return _Structure(name, str(kind), schema, slots, None, "replicate", None, ops)
    if "key" in parts and parts["key"].fields is None and "key" not in rules:
        route_in = "key"
    else:
        for part in ("key", "value", "record"):
            dt = parts.get(part)
            if dt is not None and dt.fields is not None and want in dt.fields:
                route, route_in = want, part
                break
    if not route_in:
        raise RescaleError(f"{where}: structure {name!r} ({kind}) has no column {want!r} to "
                           f"route its rows by (schema {schema}); name one in the layout's "
                           f"extra.routing")
    if order is not None and (kind not in ("list", "deque") or parts["record"].fields is None
                              or order not in parts["record"].fields):
        raise RescaleError(f"{where}: routing order field {order!r} of structure {name!r} is "
                           f"not a field of its records")
    dt_route = parts[route_in] if route is None else parts[route_in].fields[route][0]  # type: ignore[index]
    try:
        from sguard.partitioning import spark_type_of
        spark_type_of(dt_route)
    except PartitioningError as exc:
        raise RescaleError(f"{where}: structure {name!r}: routing column: {exc}") from None
    return _Structure(name, str(kind), schema, slots, route, route_in, order)


def _validate(root: StorageRoot, layout: OperatorLayout
              ) -> tuple[list[_Source], list[_Structure], int]:
    """Sources of the current generation, the structures to carry, the page size."""
    sources: list[_Source] = []
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    page_bytes = 0
    for s in range(layout.num_partitions):
        hu = layout.haunit(s)
        man = _newest_manifest(root, hu)
        if man is None:
            sources.append(_Source(s, hu, None, 0, {}))
            continue
        um = dict(man.user_meta)
        expect = {"operator": layout.operator, "name": layout.name,
                  "generation": layout.generation, "partition": s,
                  "num_partitions": layout.num_partitions}
        for k, v in expect.items():
            if um.get(k) != v:
                raise RescaleError(f"checkpoint {man.name}: user_meta {k}={um.get(k)!r}, but the "
                                   f"layout says {v!r} (mixed operators or generations)")
        if "schema_version" in um and um["schema_version"] != layout.schema_version:
            raise RescaleError(f"checkpoint {man.name}: schema_version {um['schema_version']!r}, "
                               f"the layout's is {layout.schema_version!r} (mixed schema "
                               f"versions)")
        if page_bytes and man.page_bytes != page_bytes:
            raise RescaleError(f"checkpoint {man.name}: {man.page_bytes}-byte pages, other "
                               f"partitions use {page_bytes}")
        page_bytes = man.page_bytes
        metas = _super_pages(root, man)
        for name, meta in metas.items():
            sig = json.dumps([meta.get("kind"), meta.get("schema")], sort_keys=True)
            if name in found and found[name][0] != sig:
                raise RescaleError(f"checkpoint {man.name}: structure {name!r} is "
                                   f"{meta.get('kind')} {meta.get('schema')}, in another "
                                   f"partition {found[name][0]} (mixed schema versions)")
            found.setdefault(name, (sig, meta))
        sources.append(_Source(s, hu, man.name, man.state_bytes, um))
    structs = [_resolve(layout, n, found[n][1], f"operator {layout.name!r}")
               for n in sorted(found) if not _is_keydict(n)]
    return sources, structs, page_bytes or 65536


def _is_keydict(name: str) -> bool:
    from sguard.spark.keys import KEYDICT
    return name == KEYDICT or name.startswith(KEYDICT + ".")


def _key_spec(layout: OperatorLayout) -> Any:
    """The `sguard.spark.keys.KeySpec` of a layout whose state keys are dictionary ids
    (None: the state is keyed by the key values themselves)."""
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
        raise RescaleError(f"operator {layout.name!r}: the layout's key columns "
                           f"{layout.key!r} cannot be read back ({exc})") from None


_KEYS: Final = "\0keys"
"""A source piece's entry for the key dictionary's keys routed to an output."""


def _key_routes(pm: PageManager, keys: Any, modulus: int, index: npt.NDArray[np.int64],
                n_out: int) -> tuple[npt.NDArray[np.int32], list[Any]]:
    """Route a source's key dictionary: the Spark hash of every id's decoded key (dense by
    id) and, per output, ``(ids, (data, offsets), valid)`` of the keys it receives."""
    import pyarrow as pa
    from mmm.structures.keydict import KeyDict
    from sguard.spark.keys import KEYDICT, decode
    kd = KeyDict.create(pm, KEYDICT)
    ids, data, offs, valid = kd.items()
    ids = np.asarray(ids, np.int64)
    offs = np.asarray(offs, np.int64)
    valid = np.ones(len(ids), bool) if valid is None else np.asarray(valid, bool)
    if len(ids):
        cols = decode(keys, data, offs, valid)
        h = murmur3_hash(pa.Table.from_arrays(cols, names=list(keys.columns)))
    else:
        h = np.zeros(0, np.int32)
    dense = np.zeros(int(ids.max()) + 1 if len(ids) else 0, np.int32)
    dense[ids] = h
    order, bounds = _route(h, modulus, index, n_out)
    parts = []
    for i in range(n_out):
        sel = order[bounds[i]:bounds[i + 1]]
        lens = offs[sel + 1] - offs[sel]
        o = np.zeros(len(sel) + 1, np.int64)
        np.cumsum(lens, out=o[1:])
        gather = np.repeat(offs[sel] - o[:-1], lens) + np.arange(o[-1])
        parts.append((ids[sel], (np.asarray(data)[gather], o), valid[sel]))
    return dense, parts


def _intern_keys(pm: PageManager, pieces: Sequence[Mapping[str, Any]]
                 ) -> list[npt.NDArray[np.int64] | None]:
    """Intern each source piece's keys into `pm`'s key dictionary; per piece, the
    old id -> new id map (None: a piece without keys)."""
    from mmm.structures.keydict import KeyDict
    from sguard.spark.keys import KEYDICT
    kd = KeyDict.create(pm, KEYDICT)
    maps: list[npt.NDArray[np.int64] | None] = []
    for p in pieces:
        if _KEYS not in p:
            maps.append(None)
            continue
        old, (data, offs), valid = p[_KEYS]
        new = np.asarray(kd.intern(data, offs, valid), np.int64) if len(old) else old
        m = np.full(int(old.max()) + 1 if len(old) else 0, -1, np.int64)
        m[old] = new
        maps.append(m)
    return maps


def _remap(st: _Structure, rows: tuple[Any, Any], m: npt.NDArray[np.int64] | None
           ) -> tuple[Any, Any]:
    """A piece's rows with their routing column's ids replaced through `m`."""
    keys, vals = rows
    if m is None or st.route_in == "replicate":
        return rows
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


def source_groups(from_partitions: int, to_partitions: int) -> list[tuple[list[int], list[int]]]:
    """``(sources, targets)`` groups that exchange keys only among themselves.

    Examples
    --------
    >>> source_groups(2, 4)
    [([0], [0, 2]), ([1], [1, 3])]
    >>> source_groups(3, 2)
    [([0, 1, 2], [0, 1])]
    """
    g = math.gcd(from_partitions, to_partitions)
    return [([s for s in range(from_partitions) if s % g == c],
             [t for t in range(to_partitions) if t % g == c]) for c in range(g)]


# -- the work of one group (in a worker process or in-process) ---------------------------------------
def _route_column(st: _Structure, keys: npt.NDArray[Any] | None,
                  values: npt.NDArray[Any]) -> npt.NDArray[Any]:
    if st.route_in == "key":
        assert keys is not None
        return keys if st.route is None else keys[st.route]
    if st.route_in == "value":
        return values[st.route]
    return values if st.route is None else values[st.route]


def _read_structure(pm: PageManager, st: _Structure
                    ) -> tuple[npt.NDArray[Any] | None, npt.NDArray[Any]]:
    """All rows of a structure: ``(keys, values)`` of a map, ``(None, records)`` of a sequence."""
    sch = st.schema
    if st.kind in ("hash_map", "ordered_map"):
        cls = HashMap if st.kind == "hash_map" else OrderedMap
        m = cls.create(pm, st.name, key=dtype_from_text(sch["key"]),
                       value=dtype_from_text(sch["value"]))
        return m.items()
    seq_cls = PagedList if st.kind == "list" else PagedDeque
    return None, seq_cls.create(pm, st.name, dtype_from_text(sch["record"])).to_numpy()


def _write_structure(pm: PageManager, st: _Structure, keys: npt.NDArray[Any] | None,
                     values: npt.NDArray[Any]) -> None:
    """Create `st` in `pm` and insert the rows in one batch.

    A routed hash map's keys are distinct (each key lives in one source
    partition), so it is built in one compiled pass (`HashMap.load_distinct`:
    pages written bucket by bucket under the final geometry, no splits). An
    ordered map takes one ``put`` (its sorted rows fill leaves in one pass); a
    replicated map combines the sources' rows of a key with ``upsert``.
    """
    sch = st.schema
    if st.kind in ("hash_map", "ordered_map"):
        cls = HashMap if st.kind == "hash_map" else OrderedMap
        m = cls.create(pm, st.name, key=dtype_from_text(sch["key"]),
                       value=dtype_from_text(sch["value"]), page_slots=st.page_slots or None)
        assert keys is not None
        if len(values) and st.combine is not None:  # replicated: combine the sources' rows
            m.upsert(keys, values, dict(st.combine))
        elif len(values) and isinstance(m, HashMap):
            try:
                m.load_distinct(keys, values)
            except ValueError as exc:  # a key in two source partitions: damaged sources
                raise RescaleError(f"structure {st.name!r}: {exc}") from None
        elif len(values):
            m.put(keys, values)
        return
    seq_cls = PagedList if st.kind == "list" else PagedDeque
    s = seq_cls.create(pm, st.name, dtype_from_text(sch["record"]),
                       page_slots=st.page_slots or None)
    if st.order is not None and len(values):  # one time order over all sources
        values = values[np.argsort(values[st.order], kind="stable")]
    if len(values):
        s.extend(values)


_PROCESS_MIN_BYTES: Final = 256 * _MiB
"""Below this much state, worker processes cost more to start than they save. With fewer
than 4 CPUs the default is threads: the kernels release the GIL, and on 2 shared cores two
processes lost to one (bench.rescale, 2 -> 4 of 136 MB: 4.6 s against 1.6 s)."""


@jit
def _route(h: Any, modulus: Any, index: Any, n_out: Any) -> Any:
    """Counting sort of rows by output: ``index[pmod(h, modulus)]`` (-1: dropped).

    Returns ``(order, bounds)``: output ``i`` is ``order[bounds[i]:bounds[i + 1]]``,
    rows in input order (dropped rows are left out).
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
    """``rows[sel]``, gathering whole records as machine words (numpy's fancy indexing of a
    structured dtype goes field by field: several times slower)."""
    size = rows.dtype.itemsize
    if rows.dtype.fields is None or not rows.flags.c_contiguous:
        return rows[sel]
    word = np.dtype(np.uint64) if size % 8 == 0 else np.dtype(np.uint8)
    flat = rows.view(word).reshape(len(rows), size // word.itemsize)
    out: npt.NDArray[Any] = np.take(flat, sel, axis=0).view(rows.dtype).reshape(len(sel))
    return out


def _split_source(root: StorageRoot, src: _Source, structs: Sequence[_Structure],
                  page_bytes: int, io: IOService, modulus: int, index: npt.NDArray[np.int64],
                  n_out: int, clock: dict[str, float], keys: Any = None
                  ) -> tuple[list[dict[str, tuple[Any, Any]]], Manifest | None]:
    """Restore one source and split every structure's rows into `n_out` outputs.

    A row whose routing key has Spark partition ``r`` of `modulus`
    (`sguard.partitioning.murmur3_hash`, then ``pmod``) goes to output
    ``index[r]`` (-1: dropped). Adds the seconds spent to `clock` (``read_s``:
    reading and checksumming the pages into a private pool; ``extract_s``: rows
    out of the pages; ``route_s``: hashes, counting sort, gathers).

    With `keys` (a `sguard.spark.keys.KeySpec`: the state is keyed by dictionary ids),
    a routing column holds ids: each routes by the Spark hash of its decoded key, and
    each output also gets the keys it receives (entry ``_KEYS``) for `_intern_keys`.
    """
    out: list[dict[str, tuple[Any, Any]]] = [{} for _ in range(n_out)]
    if src.checkpoint is None:
        return out, None
    tick = time.perf_counter()
    pm = PageManager(page_bytes, capacity_bytes=int(src.state_bytes * 1.1) + 64 * page_bytes)
    man = restore(pm, root, src.haunit, io=io)
    _kill_point("source_restored")
    clock["read_s"] += time.perf_counter() - tick
    id_hash = None
    if keys is not None:
        tick = time.perf_counter()
        id_hash, kparts = _key_routes(pm, keys, modulus, index, n_out)
        for i in range(n_out):
            out[i][_KEYS] = kparts[i]
        clock["route_s"] += time.perf_counter() - tick
    for st in structs:
        if not pm.exists(st.name):  # e.g. a window another partition has open
            continue
        tick = time.perf_counter()
        keys, vals = _read_structure(pm, st)
        now = time.perf_counter()
        clock["extract_s"] += now - tick
        tick = now
        if st.route_in == "replicate":
            for i in range(n_out):
                out[i][st.name] = (keys, vals)
            continue
        if n_out == 1 and (index >= 0).all():  # a merge: every row goes to the one target
            out[0][st.name] = (keys, vals)
            continue
        col = _route_column(st, keys, vals)
        h = murmur3_hash(col) if id_hash is None else id_hash[col]
        order, bounds = _route(h, modulus, index, n_out)
        for i in range(n_out):
            sel = order[bounds[i]:bounds[i + 1]]
            if len(sel) == len(vals):  # every row goes to this output
                out[i][st.name] = (keys, vals)
            else:
                out[i][st.name] = (None if keys is None else _take(keys, sel), _take(vals, sel))
        clock["route_s"] += time.perf_counter() - tick
    del pm
    return out, man


def _concat(parts: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    if len(parts) == 1:
        return parts[0]
    keys = None if parts[0][0] is None else np.concatenate([p[0] for p in parts])
    return keys, np.concatenate([p[1] for p in parts])


def _positions(src: _Source, man: Manifest | None, from_parts: int) -> ReplayPositions:
    if man is None:
        return ReplayPositions((KeyClass(from_parts, src.partition, -1),))
    return ReplayPositions.from_user_meta(man.user_meta)


def _carried_meta(metas: list[Mapping[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """Non-standard user_meta fields equal in every source (kept) and the others (dropped)."""
    keys = {k for m in metas for k in m if k not in _STANDARD_META}
    kept = {k: metas[0][k] for k in keys
            if all(k in m and m[k] == metas[0][k] for m in metas)}
    return kept, sorted(keys - set(kept))


_PHASES: Final = ("read_s", "extract_s", "route_s", "build_s", "write_s")


def _run_group(root: StorageRoot, layout: OperatorLayout, group: _Group,
               structs: Sequence[_Structure], page_bytes: int, to_parts: int,
               io_workers: int) -> tuple[int, int, int, dict[str, float]]:
    """Split a group's sources into its targets and checkpoint them.

    Every source is read once; its rows are routed to the group's targets; each
    target is built in a fresh page manager and checkpointed in full.

    Returns ``(bytes read, bytes written, rows, seconds per phase)``.
    """
    io = IOService(io_workers)
    clock = dict.fromkeys(_PHASES, 0.0)
    try:
        targets = list(group.targets)
        index = np.full(to_parts, -1, np.int64)
        index[targets] = np.arange(len(targets))
        if len(targets) == 1:  # P' divides P: the group's sources hold only its target's keys
            index[:] = 0
        pieces: list[list[dict[str, tuple[Any, Any]]]] = []
        positions: list[ReplayPositions] = []
        metas: list[Mapping[str, Any]] = []
        read = rows = 0
        kspec = _key_spec(layout)
        for src in group.sources:
            out, man = _split_source(root, src, structs, page_bytes, io, to_parts, index,
                                     len(targets), clock, kspec)
            pieces.append(out)
            positions.append(_positions(src, man, layout.num_partitions))
            if man is not None:
                metas.append(man.user_meta)
                read += man.state_bytes
        capacity = max(64 * _MiB, 4 * sum(s.state_bytes for s in group.sources)
                       // max(len(targets), 1))
        kept, dropped = _carried_meta(metas)
        written = 0
        inflight: list[tuple[CheckpointManager, Any, float]] = []
        for i, t in enumerate(targets):
            tick = time.perf_counter()
            pm = PageManager(page_bytes, capacity_bytes=capacity)
            remaps = (_intern_keys(pm, [p[i] for p in pieces]) if kspec is not None
                      else [None] * len(pieces))
            for st in structs:
                parts = [_remap(st, p[i][st.name], m) for p, m in zip(pieces, remaps)
                         if st.name in p[i]]
                if not parts:
                    continue  # no source of this group holds it
                keys, vals = _concat(parts)
                rows += len(vals)
                _write_structure(pm, st, keys, vals)
            for p in pieces:  # the rows are in pages now
                p[i] = {}
            classes = [c for pos in positions for c in pos.restrict(to_parts, t).classes]
            pos_t = ReplayPositions(tuple(classes)).simplified(to_parts, t)
            meta = dict(kept, operator=layout.operator, name=layout.name,
                        generation=layout.generation + 1, partition=t, num_partitions=to_parts,
                        batch_id=pos_t.min_batch_id, sources=pos_t.to_json(),
                        rescaled_from={"generation": layout.generation,
                                       "num_partitions": layout.num_partitions})
            if dropped:
                meta["dropped_meta"] = dropped
            hu = haunit_name(layout.name, layout.generation + 1, t)
            clock["build_s"] += time.perf_counter() - tick
            # the checkpoint snapshots the pages (copy-on-write) and writes them on the I/O
            # threads while the next target is built; waited for below, in target order
            tick = time.perf_counter()
            mgr = CheckpointManager(pm, root, hu, io=io, check_root=False,
                                    policy=CheckpointPolicy(keep=None, full_every=1))
            try:
                pending = mgr.checkpoint(meta, full=True)
            except BaseException:
                mgr.close()
                raise
            assert pending is not None
            inflight.append((mgr, pending, time.perf_counter() - tick))
            del pm
        try:
            for mgr, pending, spent in inflight:
                tick = time.perf_counter()
                written += pending.result().written_bytes
                clock["write_s"] += spent + time.perf_counter() - tick
                _kill_point("target_written")
        finally:
            for mgr, _, _ in inflight:
                mgr.close()
        return read, written, rows, clock
    finally:
        io.shutdown()


# -- marker and cleanup ---------------------------------------------------------------------------
def _generation_haunits(root: StorageRoot, name: str, generation: int) -> list[str]:
    out = []
    for hu in list_haunits(root):
        parsed = parse_haunit_name(hu)
        if parsed is not None and parsed[0] == name and parsed[1] == generation:
            out.append(hu)
    return out


def _read_marker(root: StorageRoot) -> dict[str, Any] | None:
    try:
        doc = json.loads(root.read_bytes(MARKER_FILE))
    except StorageNotFoundError:
        return None
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _delete_generation(root: StorageRoot, name: str, generation: int) -> int:
    n = 0
    for hu in _generation_haunits(root, name, generation):
        for c in list_checkpoints(root, hu):
            root.delete_dir(c.directory, missing_ok=True)
            n += 1
    return n


# -- public API ----------------------------------------------------------------------------------
def repartition(root: StorageRoot | str, num_partitions: int, *, workers: int | None = None,
                io_workers: int = 4, force: bool = False, executor: str = "thread",
                on_progress: Callable[[str], None] | None = None) -> RescaleResult:
    """Repartition the operator state under `root` into `num_partitions` partitions.

    See the module docstring for the steps, the crash guarantees and the
    replay contract.

    Parameters
    ----------
    root : StorageRoot or str
        The state URI (see `sguard.statelayout`).
    num_partitions : int
        P' >= 1.
    workers : int, optional
        Parallel workers (default: one per independent group, at most the CPU
        count); 1 runs everything in the calling thread.
    io_workers : int
        I/O threads per worker for restores and checkpoints.
    executor : {"thread", "process"}
        Run the groups in threads of this process (default: the compiled
        kernels, checksums and I/O release the GIL, and nothing is pickled or
        re-imported) or in worker processes (a script calling this with
        ``workers > 1`` then needs the ``if __name__ == "__main__":`` guard:
        processes start by forkserver).
    force : bool
        Rewrite the state as a new generation even when P' equals P.
    on_progress : callable, optional
        Called with a short message per phase.

    Returns
    -------
    RescaleResult

    Raises
    ------
    RescaleError
        Unknown state URI or no layout there, P' < 1, sources of another
        operator, generation or schema, structures that cannot be routed,
        leftovers of generation ``g + 1`` not made by a repartition. Nothing
        was written.
    ioservice.IOServiceError
        Storage failures during the work; the old generation is still the
        state and a rerun completes.
    """
    t0 = time.perf_counter()
    if not isinstance(num_partitions, (int, np.integer)) or isinstance(num_partitions, bool) \
            or num_partitions < 1:
        raise RescaleError(f"--partitions must be an integer >= 1, got {num_partitions!r}")
    num_partitions = int(num_partitions)
    if executor not in ("process", "thread"):
        raise RescaleError(f"executor must be 'process' or 'thread', got {executor!r}")
    sroot = _open(root)
    if isinstance(root, str) and not sroot.exists(""):
        raise RescaleError(f"state URI {root}: does not exist")
    layout = _layout(sroot)
    say = on_progress or (lambda msg: None)
    g, P = layout.generation, layout.num_partitions
    marker = _read_marker(sroot)
    if marker is not None and marker.get("to_generation", -1) <= g:
        sroot.delete_file(MARKER_FILE, missing_ok=True)  # a committed run's leftover
        marker = None
    if num_partitions == P and not force:
        return RescaleResult(g, g, P, P, tuple(layout.haunit(p) for p in range(P)), 0, 0, 0,
                             time.perf_counter() - t0, changed=False)
    leftovers = _generation_haunits(sroot, layout.name, g + 1)
    if leftovers and marker is None:
        raise RescaleError(f"state URI {sroot.uri}: HA units of generation {g + 1} exist "
                           f"({', '.join(leftovers[:3])}{'...' if len(leftovers) > 3 else ''}) "
                           f"but no repartition made them ({MARKER_FILE} missing); "
                           f"refusing to touch them")
    sources, structs, page_bytes = _validate(sroot, layout)
    phases = {"validate_s": time.perf_counter() - t0}
    _kill_point("validated")
    say(f"validated {P} source partition(s), {len(structs)} structure(s)")
    doc = {"from_generation": g, "to_generation": g + 1, "num_partitions": num_partitions,
           "created_unix_s": time.time()}
    sroot.write_atomic(MARKER_FILE, json.dumps(doc).encode())
    _kill_point("marked")
    if leftovers:
        n = _delete_generation(sroot, layout.name, g + 1)
        say(f"removed {n} checkpoint(s) of an interrupted repartition")
    _kill_point("cleaned")
    t1 = time.perf_counter()
    groups = [_Group(tuple(sources[s] for s in srcs), tuple(tgts))
              for srcs, tgts in source_groups(P, num_partitions)]
    total = sum(src.state_bytes for src in sources)
    cpus = os.cpu_count() or 1
    n_workers = workers if workers is not None else (
        min(len(groups), cpus) if executor == "thread" or total >= _PROCESS_MIN_BYTES else 1)
    n_workers = max(1, min(n_workers, len(groups)))
    args = [(sroot, layout, grp, structs, page_bytes, num_partitions, io_workers)
            for grp in groups]
    if n_workers == 1:
        results = [_run_group(*a) for a in args]
    elif executor == "thread":
        with ThreadPoolExecutor(n_workers) as tex:
            results = list(tex.map(_run_group_star, args))
    else:
        ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods()
                             else "spawn")
        with ProcessPoolExecutor(n_workers, mp_context=ctx) as ex:
            results = list(ex.map(_run_group_star, args))
    phases["split_s"] = time.perf_counter() - t1
    for r in results:  # worker seconds, summed over groups
        for k, v in r[3].items():
            phases[k] = phases.get(k, 0.0) + v
    # the coarser phases of earlier versions: read+route, build, write
    phases["restore_route_s"] = sum(phases.get(k, 0.0) for k in ("read_s", "extract_s",
                                                                  "route_s"))
    phases["insert_s"] = phases.get("build_s", 0.0)
    phases["checkpoint_s"] = phases.get("write_s", 0.0)
    say(f"wrote {num_partitions} partition(s) of generation {g + 1}")
    _kill_point("before_commit")
    write_layout(sroot, replace(layout, generation=g + 1, num_partitions=num_partitions))
    _kill_point("committed")
    sroot.delete_file(MARKER_FILE, missing_ok=True)
    logger.info("repartitioned %s: %d -> %d partitions (generation %d)", sroot.uri, P,
                num_partitions, g + 1)
    return RescaleResult(g, g + 1, P, num_partitions,
                         tuple(haunit_name(layout.name, g + 1, t) for t in range(num_partitions)),
                         sum(r[0] for r in results), sum(r[1] for r in results),
                         sum(r[2] for r in results), time.perf_counter() - t0, phases)


def _run_group_star(a: tuple[Any, ...]) -> tuple[int, int, int, dict[str, float]]:
    return _run_group(*a)


def restore_piece(root: StorageRoot | str, partition: int, pieces: int, piece: int,
                  pm: PageManager, *, io: IOService | None = None,
                  phases: dict[str, float] | None = None) -> ReplayPositions:
    """Restore piece `piece` of `pieces` of one partition into `pm` (parallel recovery).

    The piece holds the keys of `partition` (of the current generation's P)
    with ``pmod(h, P * pieces) == partition + P * piece``: the partition's share
    of a ``P * pieces``-partition layout. ``pieces`` workers, each calling this
    with its own `piece`, together restore the whole partition; each then
    replays the logged rows for which `ReplayPositions.needs` is true among
    the keys of its piece (``partition_of(key, P * pieces) == partition + P *
    piece``).

    Every piece reads (and checksums) the whole partition's checkpoint once,
    takes its rows out of the pages, routes them with one compiled pass and
    bulk-builds its share (`HashMap.load_distinct`). `phases`, if given,
    receives the seconds per pass (``read_s``, ``extract_s``, ``route_s``,
    ``build_s``).

    Returns
    -------
    ReplayPositions
        Where each key class of the piece is (from the source checkpoint).

    Raises
    ------
    RescaleError
        As `repartition` for bad state or arguments.
    """
    sroot = _open(root)
    layout = _layout(sroot)
    P = layout.num_partitions
    if not 0 <= partition < P:
        raise RescaleError(f"partition {partition} out of range for {P} partitions")
    if not (isinstance(pieces, int) and pieces >= 1 and 0 <= piece < pieces):
        raise RescaleError(f"piece {piece!r} of {pieces!r}: need pieces >= 1 and "
                           f"0 <= piece < pieces")
    sources, structs, page_bytes = _validate(sroot, layout)
    src = sources[partition]
    M, want = P * pieces, partition + P * piece
    own = io is None
    io = io or IOService(4)
    try:
        index = np.full(M, -1, np.int64)
        index[want] = 0
        clock = dict.fromkeys(_PHASES, 0.0)
        kspec = _key_spec(layout)
        out, man = _split_source(sroot, src, structs, page_bytes, io, M, index, 1, clock,
                                 kspec)
    finally:
        if own:
            io.shutdown()
    tick = time.perf_counter()
    pm.begin_load().finish()  # drop whatever the worker held
    remap = _intern_keys(pm, out)[0] if kspec is not None else None
    for st in structs:
        if st.name in out[0]:
            keys, vals = _remap(st, out[0][st.name], remap)
            _write_structure(pm, st, keys, vals)
    clock["build_s"] += time.perf_counter() - tick
    if phases is not None:
        phases.update((k, v) for k, v in clock.items() if k != "write_s")
    return _positions(src, man, P).restrict(M, want).simplified(M, want)
