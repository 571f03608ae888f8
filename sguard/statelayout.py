"""The layout of one stateful operator's state under a state URI.

This is the contract shared by the Spark runtime (`sguard.spark`), which writes
and restores the state, and the repartitioning tool (`sguard.rescale`), which
splits and merges it. Everything an operator keeps durable lives under one
`ioservice.StorageRoot`::

    <state-uri>/
        sguard-operator.json              the layout document (this module), written
                                          atomically; its `generation` is the commit
                                          point of a repartitioning
        layout/g<generation>.json         a copy of each generation's document, written
                                          before it (see `write_layout`)
        checkpoint/<haunit>-<seq>/...     ordinary ioservice checkpoints, one HA unit
                                          per partition of the current generation
        inputlog/...                      the runtime's input log (see sguard.spark)

The HA unit of partition ``p`` in generation ``g`` of operator ``name`` is
``f"{name}.g{g}.p{p:04d}"`` (`haunit_name`). A repartitioning writes the HA
units of generation ``g + 1`` next to those of ``g`` and then replaces the
layout document; until that replacement the old generation is the state, after
it the new one is, so a crash in between leaves the source untouched and the
target simply ignored (and overwritten by a rerun).

Manifests of the runtime's checkpoints carry in ``user_meta``:
``{"operator": <kind>, "name": <name>, "generation": g, "partition": p,
"num_partitions": P, "batch_id": b}`` where ``b`` is the last Spark batch the
state includes (``-1`` for the empty state).
"""
from __future__ import annotations

import base64
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np
import pyarrow as pa

from ioservice import StorageRoot, validate_name
from ioservice.errors import StorageNotFoundError
from sguard.keygroups import DEFAULT_KEY_GROUPS, check_key_groups, key_group_range

__all__ = ["LAYOUT_FILE", "PSID_SHIFT", "CONVERT_COMMAND", "key_group_psids", "key_group_of_psid", "LAYOUT_HISTORY_DIR", "LAYOUT_VERSION", "LayoutError", "OperatorLayout", "haunit_name",
           "parse_haunit_name", "read_layout", "schema_from_layout", "schema_to_json", "write_layout"]

LAYOUT_FILE: Final = "sguard-operator.json"
LAYOUT_HISTORY_DIR: Final = "layout"
LAYOUT_VERSION: Final = 2
PSID_SHIFT: Final = 16
"""Key group ``kg``'s page sets have PSIDs in ``[(kg + 1) << PSID_SHIFT, (kg + 2) << PSID_SHIFT)``
(`sguard.spark.groupstate`), so a page id names its key group: ``(psid >> 16) - 1``."""
#: The command that converts a state URI written before key groups (layout version 1).
CONVERT_COMMAND: Final = "sguard state convert"
_HISTORY_RE: Final = re.compile(r"^g(?P<gen>\d{8,})\.json$")
_HAUNIT_RE: Final = re.compile(r"^(?P<name>.+)\.g(?P<gen>\d+)\.p(?P<part>\d{4,})$")


class LayoutError(ValueError):
    """The layout document is missing a field, damaged, or does not match the caller."""


@dataclass(frozen=True)
class OperatorLayout:
    """What is under a state URI: which operator, its schema, and how it is partitioned.

    Attributes
    ----------
    operator
        The operator kind (e.g. ``"running_aggregate"``); a different kind on an
        existing state URI is refused by the runtime.
    name
        The operator's name (a valid HA unit name prefix).
    schema
        A JSON object describing the state's structures (key dtype, value fields...);
        a change between restarts is refused by the runtime.
    schema_version
        Bumped by the runtime when the meaning of `schema` changes.
    num_partitions
        P: the number of partitions of the current generation.
    generation
        Bumped by every repartitioning.
    partitioner
        How keys map to partitions; ``"spark-murmur3"`` is
        ``pmod(murmur3_hash(key, seed=42), P)``, what ``repartition(P, key)`` does.
    key
        The name of the key column, or the list of names of a composite key
        (``extra["keys"]`` records their types and how the state stores them,
        `sguard.spark.keys.KeySpec.describe`).
    key_groups
        K, fixed when the state URI is created: keys hash into K key groups
        (``pmod(murmur3(key), K)``), partition ``p`` owns the contiguous range
        `key_group_range` of them, and each key group's state lives in its own page
        sets (`sguard.spark.groupstate`), so a repartitioning moves whole key groups.
    """

    operator: str
    name: str
    schema: dict[str, Any]
    num_partitions: int
    key: str | list[str]
    generation: int = 0
    schema_version: int = 1
    partitioner: str = "spark-murmur3"
    extra: dict[str, Any] = field(default_factory=dict)
    key_groups: int = DEFAULT_KEY_GROUPS

    def __post_init__(self) -> None:
        validate_name(self.name, what="operator name")
        if not isinstance(self.num_partitions, int) or isinstance(self.num_partitions, bool) \
                or self.num_partitions < 1:
            raise LayoutError(f"num_partitions must be an integer >= 1, got {self.num_partitions!r}")
        if not isinstance(self.generation, int) or isinstance(self.generation, bool) \
                or self.generation < 0:
            raise LayoutError(f"generation must be an integer >= 0, got {self.generation!r}")
        try:
            check_key_groups(self.key_groups, self.num_partitions)
        except (TypeError, ValueError) as exc:
            raise LayoutError(str(exc)) from None
        if not isinstance(self.schema, dict):
            raise LayoutError(f"schema must be a JSON object, got {type(self.schema).__name__}")

    def haunit(self, partition: int) -> str:
        """The HA unit name of `partition` in this generation."""
        if not 0 <= partition < self.num_partitions:
            raise LayoutError(f"partition {partition} out of range for {self.num_partitions} partitions")
        return haunit_name(self.name, self.generation, partition)

    def key_group_range(self, partition: int) -> tuple[int, int]:
        """``(lo, hi)``: the key groups partition `partition` owns in this generation."""
        if not 0 <= partition < self.num_partitions:
            raise LayoutError(f"partition {partition} out of range for {self.num_partitions} partitions")
        return key_group_range(partition, self.num_partitions, self.key_groups)

    def to_json(self) -> bytes:
        doc = {"layout_version": LAYOUT_VERSION, **asdict(self)}
        return json.dumps(doc, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str = LAYOUT_FILE) -> OperatorLayout:
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise LayoutError(f"{where}: not valid JSON ({type(exc).__name__})") from None
        if not isinstance(doc, dict):
            raise LayoutError(f"{where}: expected a JSON object")
        if doc.get("layout_version") == 1:
            raise LayoutError(
                f"{where}: this state was written before key groups (layout_version 1), and "
                f"this sguard keeps state by key group; convert it once with "
                f"`{CONVERT_COMMAND} <state-uri>` (it keeps the state and its partition count)")
        if doc.get("layout_version") != LAYOUT_VERSION:
            raise LayoutError(f"{where}: unsupported layout_version {doc.get('layout_version')!r}")
        kwargs = {k: doc[k] for k in ("operator", "name", "schema", "num_partitions", "key",
                                      "generation", "schema_version", "partitioner", "extra",
                                      "key_groups")
                  if k in doc}
        missing = {"operator", "name", "schema", "num_partitions", "key", "key_groups"} - set(kwargs)
        if missing:
            raise LayoutError(f"{where}: missing field(s) {sorted(missing)}")
        for k in ("operator", "name", "partitioner"):
            if k in kwargs and not isinstance(kwargs[k], str):
                raise LayoutError(f"{where}: field {k!r} must be a string")
        key = kwargs.get("key")
        if not isinstance(key, str) and not (
                isinstance(key, list) and key and all(isinstance(c, str) for c in key)):
            raise LayoutError(f"{where}: field 'key' must be a column name or a non-empty "
                              f"list of column names")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise LayoutError(f"{where}: {exc}") from None


def key_group_psids(lo: int, hi: int) -> tuple[int, int]:
    """The PSIDs of key groups ``[lo, hi)``: ``[(lo + 1) << 16, (hi + 1) << 16)``."""
    return (lo + 1) << PSID_SHIFT, (hi + 1) << PSID_SHIFT


def key_group_of_psid(psid: Any) -> Any:
    """The key group of a page set's PSID (``-1`` for one outside every key group)."""
    return (np.asarray(psid, np.int64) >> PSID_SHIFT) - 1


def haunit_name(name: str, generation: int, partition: int) -> str:
    """``f"{name}.g{generation}.p{partition:04d}"``, validated as an HA unit name."""
    return validate_name(f"{name}.g{generation}.p{partition:04d}")


def parse_haunit_name(haunit: str) -> tuple[str, int, int] | None:
    """``(name, generation, partition)`` of a runtime HA unit name, or None."""
    m = _HAUNIT_RE.match(haunit)
    if m is None:
        return None
    return m["name"], int(m["gen"]), int(m["part"])


def _history_path(generation: int) -> str:
    return f"{LAYOUT_HISTORY_DIR}/g{generation:08d}.json"


def read_layout(root: StorageRoot) -> OperatorLayout | None:
    """The layout document under `root`, or None when there is none yet.

    When `LAYOUT_FILE` is absent but generation copies exist (an S3 PUT that
    failed while replacing it leaves it absent, see `write_layout`), the copy of
    the highest generation is the layout.
    """
    try:
        data = root.read_bytes(LAYOUT_FILE)
    except StorageNotFoundError:
        pass
    else:
        return OperatorLayout.from_json(data, where=f"{root.full_path(LAYOUT_FILE)}")
    gens = [int(m["gen"]) for e in root.list_dir(LAYOUT_HISTORY_DIR, allow_not_found=True)
            if (m := _HISTORY_RE.match(e.relpath.rpartition("/")[2])) is not None]
    if not gens:
        return None
    path = _history_path(max(gens))
    return OperatorLayout.from_json(root.read_bytes(path), where=root.full_path(path))


def write_layout(root: StorageRoot, layout: OperatorLayout) -> None:
    """Write the layout document atomically (the commit point of a repartitioning).

    The generation's copy ``layout/g<generation>.json`` is written first, then
    `LAYOUT_FILE` is replaced. On filesystems with an atomic rename a failure
    leaves `LAYOUT_FILE` as it was. On S3 a failed replacement leaves it absent
    (`StorageRoot.write_atomic`), and `read_layout` then reads the copy, which
    was complete before the replacement began; the state is never mistaken for
    a new, empty one.
    """
    data = layout.to_json()
    root.write_atomic(_history_path(layout.generation), data)
    root.write_atomic(LAYOUT_FILE, data)


def schema_to_json(schema: pa.Schema) -> str:
    """An Arrow schema as base64 IPC, for a layout's ``extra["arrow_schema"]`` (no pickle)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def schema_from_layout(layout: OperatorLayout) -> pa.Schema:
    """The Arrow input schema recorded in a layout document (see `schema_to_json`).

    Raises
    ------
    LayoutError
        If the document records no ``arrow_schema``.
    """
    import pyarrow.ipc as ipc
    text = layout.extra.get("arrow_schema")
    if not isinstance(text, str):
        raise LayoutError(f"the layout of operator {layout.name!r} records no arrow_schema")
    return ipc.read_schema(pa.py_buffer(base64.b64decode(text)))
