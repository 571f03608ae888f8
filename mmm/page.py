"""Page format: a fixed 64-byte header followed by a layout-specific record area.

The bytes of a page in memory are exactly its bytes on disk: the header holds
no pointers, only PageIDs. A PageID is ``(psid << 32) | seq`` as one uint64:
``psid`` names the page set (one per data structure) and ``seq`` the page
within it. Sequence number 0 is the set's *super page*, whose record area
holds the structure's name, kind, schema and small metadata as JSON.

Header fields
-------------
magic     ``PAGE_MAGIC`` in a frame that holds or held a page (a freed frame keeps its
          header: the pool's frame state table says which frames are in use)
kind      the page layout (`Layout`)
flags     layout-specific bits
page_id   this page's PageID
version   pool-wide clock value of the page's last allocation or clone; when two
          frames claim the same PageID (a crash during copy-on-write) the higher wins
count     records in the page
start     first used slot (sequence layouts) or slots used + tombstones (hash layout)
prev/next PageIDs of neighbouring pages (``NIL`` when none)
aux0/aux1 layout-specific (bucket number of a hash page, ...)
"""
from __future__ import annotations

import enum
import json
from typing import Any

import numpy as np

__all__ = ["HEADER_DTYPE", "HEADER_BYTES", "PAGE_MAGIC", "NIL", "Layout", "make_page_id",
           "split_page_id", "MIN_PAGE_BYTES", "MAX_PAGE_BYTES", "DEFAULT_PAGE_BYTES"]

HEADER_DTYPE = np.dtype([
    ("magic", "<u4"), ("kind", "<u2"), ("flags", "<u2"),
    ("page_id", "<u8"), ("version", "<u8"),
    ("count", "<u4"), ("start", "<u4"),
    ("prev", "<u8"), ("next", "<u8"),
    ("aux0", "<u8"), ("aux1", "<u8"),
])
HEADER_BYTES = 64
assert HEADER_DTYPE.itemsize == HEADER_BYTES

PAGE_MAGIC = 0x4D504753  # "SGPM" little-endian
NIL = np.uint64(0xFFFFFFFFFFFFFFFF)
NIL_INT = 0xFFFFFFFFFFFFFFFF
MIN_PAGE_BYTES = 4096
MAX_PAGE_BYTES = 1 << 20
DEFAULT_PAGE_BYTES = 1 << 16


class Layout(enum.IntEnum):
    """Page layout kinds stored in the header's ``kind`` field."""

    FREE = 0
    SUPER = 1
    SEQUENCE = 2
    HASH = 3
    BTREE_LEAF = 4
    RAW = 5


def make_page_id(psid: int, seq: int) -> int:
    """PageID of page ``seq`` of page set ``psid``."""
    return (int(psid) << 32) | int(seq)


def split_page_id(page_id: int) -> tuple[int, int]:
    """Inverse of `make_page_id`: ``(psid, seq)``."""
    page_id = int(page_id)
    return page_id >> 32, page_id & 0xFFFFFFFF


def encode_meta(meta: dict[str, Any]) -> bytes:
    """Length-prefixed JSON for a super page's record area."""
    body = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    return len(body).to_bytes(4, "little") + body


def decode_meta(area: np.ndarray) -> dict[str, Any]:
    """Inverse of `encode_meta` on a page's record area."""
    n = int.from_bytes(bytes(area[:4]), "little")
    if n <= 0 or n > len(area) - 4:
        raise ValueError(f"super page metadata length {n} out of range")
    meta: dict[str, Any] = json.loads(bytes(area[4:4 + n]))
    return meta
