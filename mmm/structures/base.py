"""Common machinery of the paged data structures.

A structure is created by name with a schema; calling ``create`` again with
the same name (in the same process, after a `PageManager.rollback`, after a
load from a checkpoint or after a re-attach) returns the structure with its
contents. In-memory indexes are redundant with the pages and are rebuilt
lazily whenever the page manager's ``generation`` changes.
"""
from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from mmm.errors import SchemaMismatchError, StructureNotFoundError
from mmm.manager import PageManager
from mmm.namespace import Namespace
from mmm.page import HEADER_BYTES

__all__ = ["Structure", "pad8"]


def pad8(n: int) -> int:
    """Round ``n`` up to a multiple of 8."""
    return (n + 7) & ~7


class Structure:
    """Base class: a named page set with a fixed schema.

    ``pm`` is a `PageManager` or a `Namespace` of one: ``name`` is the name in
    it (unqualified in a namespace). ``_pm`` is always the page manager itself
    (the page-level calls), ``_catalog`` what names are looked up in.
    """

    KIND: ClassVar[str] = "structure"

    def __init__(self, pm: PageManager | Namespace, name: str, schema: dict[str, str],
                 params: dict[str, Any]) -> None:
        self._catalog = pm
        self._pm = pm.manager if isinstance(pm, Namespace) else pm
        self.name = name
        self._schema_text = schema
        psid, created = pm.open_structure(name, self.KIND, schema, params)
        self.psid = psid
        self._params = pm.read_meta(psid).get("params", params)
        self._gen = -1
        pm._register(name, self)
        self._sync()

    @classmethod
    def _existing(cls, pm: PageManager | Namespace, name: str, schema: dict[str, str]) -> Any:
        obj = pm._lookup_object(name)
        if obj is None:
            return None
        if not isinstance(obj, cls):
            raise SchemaMismatchError(
                f"structure {name!r} is open as a {obj.KIND}, not a {cls.KIND}")
        if obj._schema_text != schema:
            pm.open_structure(name, cls.KIND, schema, {})  # raises with the difference
        return obj

    def _sync(self) -> None:
        """Rebuild in-memory indexes if the pages changed underneath (rollback, load)."""
        if self._gen == self._pm.generation:
            return
        pm = self._pm
        if self._gen == -2:
            raise StructureNotFoundError(f"structure {self.name!r} was destroyed")
        if self._gen >= 0:
            try:
                self.psid = self._catalog.recover(self.name)
            except StructureNotFoundError:
                raise StructureNotFoundError(
                    f"structure {self.name!r} no longer exists (destroyed, or removed by a "
                    f"rollback or load)") from None
            meta = pm.read_meta(self.psid)
            if meta.get("kind") != self.KIND or meta.get("schema") != self._schema_text:
                raise SchemaMismatchError(
                    f"structure {self.name!r} was replaced by a {meta.get('kind')} with schema "
                    f"{meta.get('schema')}")
        self._ps = pm.page_set(self.psid)
        self._rebuild()
        self._gen = pm.generation

    def _rebuild(self) -> None:
        raise NotImplementedError

    def destroy(self) -> None:
        """Destroy the structure and free its pages."""
        self._sync()
        self._pm.destroy(self.psid)
        self._gen = -2

    @property
    def page_count(self) -> int:
        """Pages the structure uses (super page included)."""
        self._sync()
        return self._ps.n_pages

    def _frames_u8(self, offset: int, nbytes: int) -> np.ndarray:
        """2-D ``(n_frames, nbytes)`` view of a byte range of every frame."""
        out: np.ndarray = self._pm.pool.frames[:, offset:offset + nbytes]
        return out

    @staticmethod
    def _room(page_bytes: int) -> int:
        return page_bytes - HEADER_BYTES
