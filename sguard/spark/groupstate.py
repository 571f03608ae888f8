"""A partition's operator state, kept by key group (Flink's key groups; SEEP's state partitioning).

Keys hash into ``K`` key groups (``kg = pmod(murmur3(key), K)``, computed on the JVM
side into the column `KG_COLUMN`; `sguard.spark.keygroups`), and partition ``p`` owns
a contiguous range of them (`sguard.statelayout.OperatorLayout.key_group_range`).
Each key group's state is an operator instance of its own, opened on an
`mmm.Namespace` of the partition's page manager: its structures are named
``kg00042/<name>`` and their PSIDs come from the key group's own block
``[(kg + 1) << PSID_SHIFT, (kg + 2) << PSID_SHIFT)``. So

* a key group's pages carry the same page ids in whichever partition holds it: a
  repartitioning re-references whole key groups' pages (`sguard.rescale`), it never
  touches a row;
* a checkpoint's page table names each key group's pages (``(psid >> 16) - 1``), so a
  reader fetches one key group's pages alone;
* custom operators need nothing new: `Operator.open` receives a namespace where it
  used to receive the page manager.

One page manager per partition remains: one snapshot, one rollback, one checkpoint
cover every key group of the partition.

Event time is per key group: an event-time operator's watermark is the largest
event time *its key group* has seen (minus the lateness), so what a query emits
does not depend on the number of partitions, and a rescale changes nothing in it.
"""
from __future__ import annotations

import re
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from mmm import Namespace, PageManager
from sguard.spark import ttl as _ttl
from sguard.spark.columns import KG_COLUMN
from sguard.spark.errors import SchemaChangedError
from sguard.spark.operators import Key, Operator, OperatorState
from sguard.keygroups import key_group_of, owner_of
from sguard.statelayout import key_group_psids

__all__ = ["KG_COLUMN", "KeyGroupedState", "GroupPager", "KeyGroupRoutingError", "namespace", "open_state",
           "stored_key_groups", "split_by_partition", "add_key_groups"]

_NS_RE: Final = re.compile(r"^kg(?P<kg>\d{5})/")


class KeyGroupRoutingError(ValueError):
    """A row reached a partition that does not own its key group (or carries none)."""


def namespace(pm: PageManager, kg: int) -> Namespace:
    """Key group `kg`'s namespace of `pm` (names ``kg00042/...``, its PSID block)."""
    lo, hi = key_group_psids(kg, kg + 1)
    return Namespace(pm, f"kg{kg:05d}/", lo, hi)


def stored_key_groups(pm: PageManager) -> list[int]:
    """The key groups that have structures in `pm`, ascending."""
    return sorted({int(m["kg"]) for n in pm.names() if (m := _NS_RE.match(n)) is not None})


class GroupPager(Protocol):
    """What `KeyGroupedState.apply` tells between key groups (a memory budget's page
    cache, `sguard.spark.runtime`)."""

    def before_group(self, frames: npt.NDArray[np.int64] | None) -> None:
        """The next key group's operator is about to run and reads ``frames`` (None:
        unknown)."""


class KeyGroupedState(OperatorState):
    """The operator state of key groups ``[lo, hi)`` of one partition (module docstring).

    Key groups' instances are opened on first use (a key group without rows has no
    structures); `apply` splits the batch by `KG_COLUMN` with one stable sort and hands
    each key group its rows; outputs come in key-group order, each sorted by its
    operator, so the whole is deterministic in the set of input rows.
    """

    def __init__(self, operator: Operator, pm: PageManager, schema: pa.Schema, key: Key,
                 kg_range: tuple[int, int]) -> None:
        self.operator, self.pm, self.schema, self.key = operator, pm, schema, key
        self.lo, self.hi = kg_range
        self.out_schema = operator.output_schema(schema, key)
        # a processing-time TTL evicts keys of every key group each batch, rows or not
        self.every_batch = (_ttl.needs_batch_time(operator)
                            and getattr(operator, "visits_every_key_group", True))
        self._states: dict[int, OperatorState] = {}
        for kg in stored_key_groups(pm):
            self._check(kg)

    def _check(self, kg: int) -> None:
        if not self.lo <= kg < self.hi:
            raise KeyGroupRoutingError(
                f"key group {kg} is not one of this partition's [{self.lo}, {self.hi})")

    def state(self, kg: int) -> OperatorState:
        """Key group `kg`'s operator instance (opened, or recovered by name, on first use)."""
        st = self._states.get(kg)
        if st is None:
            self._check(kg)
            st = self._states[kg] = self.operator.open(namespace(self.pm, kg), self.schema,
                                                       self.key)
        return st

    def key_groups(self) -> list[int]:
        """The key groups with state, ascending."""
        return sorted(set(stored_key_groups(self.pm)) | set(self._states))

    def split(self, table: pa.Table) -> list[tuple[int, pa.Table]]:
        """``(kg, rows)`` for each key group with rows in `table`, ascending; the rows
        without `KG_COLUMN`, in their original order within each key group."""
        if KG_COLUMN not in table.column_names:
            raise SchemaChangedError(
                f"the rows carry no {KG_COLUMN!r} column: stateful input must be routed by "
                f"key group (sguard.spark.keygroups.with_key_groups)")
        kg = table.column(KG_COLUMN).to_numpy(zero_copy_only=False)
        data = table.drop_columns([KG_COLUMN])
        if not len(kg):
            return []
        bad = (kg < self.lo) | (kg >= self.hi)
        if bad.any():
            raise KeyGroupRoutingError(
                f"{int(bad.sum())} row(s) of key group(s) "
                f"{sorted(set(kg[bad].tolist()))[:5]} reached the partition that owns key "
                f"groups [{self.lo}, {self.hi})")
        # key groups are < MAX_KEY_GROUPS = 2**15 (checked above against the range): as
        # int16, numpy's stable argsort is a radix sort, 5x faster than on int32
        k16 = kg.astype(np.int16)
        order = np.argsort(k16, kind="stable")
        skg = k16[order]
        if not np.array_equal(order, np.arange(len(kg))):
            data = data.take(pa.array(order))
        cuts = np.flatnonzero(np.diff(skg)) + 1
        starts = np.concatenate([[0], cuts]).tolist()
        ends = np.concatenate([cuts, [len(skg)]]).tolist()
        return [(int(skg[s]), data.slice(s, e - s)) for s, e in zip(starts, ends)]

    def apply(self, table: pa.Table, batch_id: int,
              pager: GroupPager | None = None) -> pa.Table:
        """Each key group's rows to its operator, in key-group order (class docstring).
        With a `pager`, it hears before each key group which frames that group's
        operator says it reads (`OperatorState.frames_for`; None for a key group without
        state yet or an operator that cannot tell): a memory budget's page cache can
        then evict and read ahead between key groups, so that a batch needs only one key
        group's pages at a time within its budget, not all of its pages at once."""
        # an operator with partition-level hooks (a processor: init/close once per
        # partition and batch, `sguard.spark.processors`)
        begin = getattr(self.operator, "begin_partition_batch", None)
        if begin is None:
            return self._apply(table, batch_id, pager)
        begin(batch_id, table, (self.lo, self.hi))
        try:
            return self._apply(table, batch_id, pager)
        finally:
            self.operator.end_partition_batch()  # type: ignore[attr-defined]

    def _apply(self, table: pa.Table, batch_id: int, pager: GroupPager | None) -> pa.Table:
        parts = dict(self.split(table))
        todo = sorted(set(parts) | set(self.key_groups())) if self.every_batch else sorted(parts)
        extra = getattr(self.operator, "extra_key_groups", None)
        if extra is not None:
            todo = sorted(set(todo) | set(extra()))
        empty = None
        outs = []
        stored = set(self.key_groups()) if pager is not None else set()
        for kg in todo:
            rows = parts.get(kg)
            if rows is None:
                if empty is None:
                    empty = table.drop_columns([KG_COLUMN]).slice(0, 0)
                rows = empty
            if pager is not None:
                pager.before_group(self.state(kg).frames_for(rows) if kg in stored else None)
            out = self.state(kg).apply(rows, batch_id)
            if out.num_rows:
                outs.append(out)
        if not outs:
            return self.out_schema.empty_table()
        return pa.concat_tables(outs) if len(outs) > 1 else outs[0]

    def dump(self) -> pa.Table:
        outs = [self.state(kg).dump() for kg in self.key_groups()]
        outs = [o for o in outs if o.num_rows]
        if not outs:
            return self.out_schema.empty_table()
        return pa.concat_tables(outs)

    def dump_each(self, fn: Any) -> pa.Table:
        """``fn(state)`` of every key group's operator state, concatenated in key-group
        order (a processor's `dump_var`, say)."""
        outs = [fn(self.state(kg)) for kg in self.key_groups()]
        if not outs:  # the empty table of that schema, from a throwaway page manager
            pm = PageManager(1 << 12, 1 << 24)
            try:
                return fn(self.operator.open(pm, self.schema, self.key))
            finally:
                pm.close()
        return pa.concat_tables(outs)

    def n_keys(self) -> int:
        return sum(self.state(kg).n_keys() for kg in self.key_groups())


def open_state(operator: Operator, pm: PageManager, schema: pa.Schema, key: Key,
               kg_range: tuple[int, int]) -> KeyGroupedState:
    """The partition's operator state over key groups `kg_range` (`KeyGroupedState`)."""
    return KeyGroupedState(operator, pm, schema, key, kg_range)


def key_group_column(table: pa.Table) -> npt.NDArray[np.int32]:
    """The `KG_COLUMN` of `table` as numpy."""
    return np.asarray(table.column(KG_COLUMN).to_numpy(zero_copy_only=False), np.int32)


def add_key_groups(table: pa.Table, key: Key, key_groups: int) -> pa.Table:
    """`table` with its `KG_COLUMN` computed here (numpy; the same function Spark computes on
    the JVM side, `sguard.spark.keygroups`): for callers without Spark (tests, tools)."""
    cols = [key] if isinstance(key, str) else list(key)
    kg = key_group_of(table.select(cols), key_groups)
    return table.append_column(pa.field(KG_COLUMN, pa.int32(), nullable=False), pa.array(kg))


def split_by_partition(table: pa.Table, key: Key, num_partitions: int,
                       key_groups: int) -> list[pa.Table]:
    """The rows of `table` (with `KG_COLUMN` added) each partition receives."""
    t = table if KG_COLUMN in table.column_names else add_key_groups(table, key, key_groups)
    owner = owner_of(key_group_column(t).astype(np.int64), num_partitions, key_groups)
    return [t.filter(pa.array(owner == p)) for p in range(num_partitions)]
