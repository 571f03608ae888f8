"""Namespace: a view of a `PageManager` with its own structure names and PSID block.

Several independent groups of structures (the key groups of a partition, say)
share one page manager, and so one pool, one snapshot, one rollback and one
checkpoint, while each group keeps

* its own names: a structure ``agg`` created through a namespace with prefix
  ``"kg00042/"`` is ``kg00042/agg`` in the page manager's catalog (and in the
  super page, so the catalog rebuilt after a load or re-attach has it too), but
  ``agg`` to the namespace and to the structure object;
* its own PSIDs: its page sets get PSIDs from ``[psid_base, psid_limit)``, so
  its PageIDs are the same in every page manager that ever holds it, and the
  pages of several namespaces saved by different page managers can be loaded
  into one (no two namespaces share a PSID).

Every structure accepts a namespace where it takes a page manager. The page
level (allocate, writable, the pool, snapshots, rollback, generation) is the
page manager's own: the namespace hands its bound methods out unchanged, so it
adds no cost per call. Snapshots of everything, `PageManager.rollback`,
`PageManager.begin_load` and `PageManager.load` belong to the page manager
(`Namespace.manager`); `Namespace.chkpt` freezes this namespace's page sets only.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from mmm.errors import NamespaceFullError, PageSetNotFoundError, StructureNotFoundError
from mmm.manager import PSID_LIMIT, PageManager, PageSet, _check_name
from mmm.snapshot import Snapshot

__all__ = ["Namespace"]


class Namespace:
    """Structures of one group inside a `PageManager`: prefixed names, a PSID block.

    Parameters
    ----------
    pm : PageManager
        The page manager that holds the pages (not another namespace).
    prefix : str
        Prepended to every structure name in ``pm`` (non-empty, e.g. ``"kg00042/"``).
    psid_base, psid_limit : int
        New page sets get the lowest free PSID in ``[psid_base, psid_limit)``;
        ``1 <= psid_base < psid_limit <= 2**32``.

    A namespace holds no state of its own: creating the same namespace again
    (after a load, in another process) sees the same structures. Structure
    names inside it are unqualified: ``ns.names()``, ``ns.exists``,
    ``ns.recover`` and a structure's ``name`` omit the prefix.

    Examples
    --------
    >>> import numpy as np, mmm
    >>> pm = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    >>> kg = 42
    >>> ns = mmm.Namespace(pm, f"kg{kg:05d}/", (kg + 1) << 16, (kg + 2) << 16)
    >>> m = mmm.HashMap.create(ns, "agg", key="<u4", value=[("n", "<i8")])
    >>> m.upsert(np.array([7, 7], "<u4"), combine={"n": "count"})
    >>> m.name, ns.names(), pm.names()
    ('agg', ['agg'], ['kg00042/agg'])
    >>> m.psid == (kg + 1) << 16 and ns.psids() == [m.psid]
    True
    >>> snap = pm.chkpt()                      # the manager's snapshot covers every namespace
    >>> pages = [pm.page(int(i)).copy() for i in snap.page_ids]
    >>> snap.release()
    >>> pm2 = mmm.PageManager(page_bytes=4096, capacity_bytes=1 << 20)
    >>> pm2.load(pages)
    >>> ns2 = mmm.Namespace(pm2, "kg00042/", 43 << 16, 44 << 16)
    >>> int(mmm.HashMap.create(ns2, "agg", key="<u4", value=[("n", "<i8")])[7]["n"])
    2
    """

    def __init__(self, pm: PageManager, prefix: str, psid_base: int, psid_limit: int) -> None:
        if not isinstance(pm, PageManager):
            raise TypeError(f"Namespace needs a PageManager, got {type(pm).__name__}")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"namespace prefix {prefix!r}: must be a non-empty string")
        for what, v in (("psid_base", psid_base), ("psid_limit", psid_limit)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"namespace {prefix!r}: {what} {v!r} is not an int")
        psid_base, psid_limit = int(psid_base), int(psid_limit)
        if not 1 <= psid_base < psid_limit <= PSID_LIMIT:
            raise ValueError(f"namespace {prefix!r}: PSID block [{psid_base}, {psid_limit}) "
                             f"must satisfy 1 <= base < limit <= 2**32")
        self.manager = pm
        self.prefix = prefix
        self.psid_base = psid_base
        self.psid_limit = psid_limit
        # the page level: the manager's own bound methods (no indirection per call)
        self.pool = pm.pool
        self.page_bytes = pm.page_bytes
        self.allocate = pm.allocate
        self.release = pm.release
        self.resolve = pm.resolve
        self.page = pm.page
        self.header = pm.header
        self.writable = pm.writable
        self.writable1 = pm.writable1
        self.clone = pm.clone
        self.write_meta = pm.write_meta
        self.read_meta = pm.read_meta
        self.page_set = pm.page_set
        self.flush = pm.flush
        self.close = pm.close
        self.stats = pm.stats
        self._flush_structures = pm._flush_structures
        self._check = pm._check

    def __repr__(self) -> str:
        return (f"<Namespace {self.prefix!r} psids [{self.psid_base}, {self.psid_limit}) "
                f"structures={len(self.psids())}>")

    # -- the manager's changing attributes ---------------------------------------------------
    @property
    def generation(self) -> int:
        """The page manager's generation (bumped by rollback and load)."""
        return self.manager.generation

    @property
    def epoch(self) -> int:
        """The page manager's snapshot epoch."""
        return self.manager.epoch

    @property
    def _active(self) -> set[int]:
        return self.manager._active

    # -- names ----------------------------------------------------------------------------
    def qualify(self, name: str) -> str:
        """The page manager's name of this namespace's structure ``name``."""
        _check_name(name)
        return self.prefix + name

    def psids(self) -> list[int]:
        """PSIDs of this namespace's page sets, sorted. Runtime: O(log page sets + result)."""
        sets, p = self.manager._sets, self.prefix
        return [q for q in self.manager.psids_between(self.psid_base, self.psid_limit)
                if sets[q].name.startswith(p)]

    def names(self) -> list[str]:
        """Names of this namespace's structures (without the prefix), sorted.
        Runtime: O(log page sets + result)."""
        sets, n = self.manager._sets, len(self.prefix)
        return sorted(sets[q].name[n:] for q in self.psids())

    def _find(self, name: str) -> int | None:
        q = self.manager._names.get(self.prefix + name)
        return q if q is not None and self.psid_base <= q < self.psid_limit else None

    def exists(self, name: str) -> bool:
        """True if this namespace has a structure ``name``."""
        return self._find(name) is not None

    def recover(self, name: str) -> int:
        """PSID of this namespace's structure ``name``.

        Raises
        ------
        StructureNotFoundError
            If the namespace has no structure of that name.
        """
        q = self._find(name)
        if q is None:
            raise StructureNotFoundError(
                f"no structure named {name!r} in namespace {self.prefix!r}; existing: "
                f"{self.names()}")
        return q

    def _own(self, psid: int) -> PageSet:
        ps = self.manager._sets.get(psid)
        if ps is None or not ps.name.startswith(self.prefix) or \
                not self.psid_base <= psid < self.psid_limit:
            raise PageSetNotFoundError(
                f"page set {psid} is not a structure of namespace {self.prefix!r}"
                + (f" (it is {ps.name!r})" if ps is not None else " (no such page set)"))
        return ps

    # -- page sets ----------------------------------------------------------------------------
    def create(self, name: str, meta: dict[str, Any] | None = None, *,
               psid: int | None = None) -> int:
        """Create page set ``prefix + name``; its PSID is ``psid`` (which must lie in
        the block) or the lowest free one of the block. Returns the PSID.

        Raises
        ------
        ValueError
            Bad or existing name, or ``psid`` outside the block.
        PageSetExistsError
            If ``psid`` is in use.
        NamespaceFullError
            If every PSID of the block is in use.
        """
        full = self.qualify(name)
        return self.manager.create(full, meta, psid=self._new_psid(full, psid))

    def _new_psid(self, full: str, psid: int | None) -> int:
        if psid is not None:
            if isinstance(psid, (bool, np.bool_)) or not isinstance(psid, (int, np.integer)) \
                    or not self.psid_base <= psid < self.psid_limit:
                raise ValueError(f"psid {psid!r} for {full!r} is outside namespace "
                                 f"{self.prefix!r}'s block [{self.psid_base}, "
                                 f"{self.psid_limit})")
            return int(psid)
        sets = self.manager._sets
        p = self.psid_base  # O(page sets of the namespace): namespaces hold a few
        while p < self.psid_limit and p in sets:
            p += 1
        if p >= self.psid_limit:
            raise NamespaceFullError(
                f"namespace {self.prefix!r}: every PSID of [{self.psid_base}, "
                f"{self.psid_limit}) is in use; cannot create {full!r}")
        return p

    def destroy(self, psid: int) -> None:
        """Destroy this namespace's page set ``psid``.

        Raises
        ------
        PageSetNotFoundError
            If ``psid`` is not a page set of this namespace (nothing destroyed).
        """
        self._own(psid)
        self.manager.destroy(psid)

    def open_structure(self, name: str, kind: str, schema: dict[str, str],
                       params: dict[str, Any], *, psid: int | None = None
                       ) -> tuple[int, bool]:
        """`PageManager.open_structure` of ``prefix + name`` with a PSID of the block."""
        full = self.qualify(name)
        pm = self.manager
        if full not in pm._names:
            psid = self._new_psid(full, psid)
        return pm.open_structure(full, kind, schema, params, psid=psid)

    def _register(self, name: str, obj: Any) -> None:
        self.manager._register(self.prefix + name, obj)

    def _lookup_object(self, name: str) -> Any:
        return self.manager._lookup_object(self.prefix + name)

    # -- snapshots ------------------------------------------------------------------------------
    def chkpt(self, psids: Iterable[int] | None = None,
              names: Iterable[str] | None = None, *, in_place: bool = False) -> Snapshot:
        """Freeze page sets of this namespace (all of them by default; ``names``
        unqualified). `PageManager.chkpt` of `manager` freezes every namespace.

        The snapshot never covers structures outside the namespace: rolling it
        back (`rollback`, or `PageManager.rollback`) leaves them alone. ``in_place``:
        as `PageManager.chkpt`.

        Raises
        ------
        PageSetNotFoundError, StructureNotFoundError
            For a PSID or name not of this namespace (nothing is frozen).
        """
        if psids is None and names is None:
            chosen = self.psids()
        else:
            chosen = [self._own(int(p)).psid for p in (psids or ())]
            chosen += [self.recover(n) for n in (names or ())]
        snap = self.manager.chkpt(psids=chosen, in_place=in_place)
        snap.covers_all = False  # also when the namespace's page sets are all there are
        if psids is None and names is None:
            setattr(snap, "_namespace", self.prefix)  # see `rollback`
        return snap

    def rollback(self, snap: Snapshot) -> None:
        """`PageManager.rollback`; after a snapshot of this whole namespace (`chkpt`
        without arguments) its structures created since are destroyed too.

        Raises
        ------
        SnapshotStateError
            As `PageManager.rollback` (nothing changed).
        """
        pm = self.manager
        pm.rollback(snap)
        if getattr(snap, "_namespace", None) == self.prefix:
            for p in self.psids():
                if p not in snap.psids:
                    pm.destroy(p)
