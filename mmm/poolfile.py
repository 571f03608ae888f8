"""A pool file's mapping seen from outside `PagePool`: its header, and pre-faulting frames.

A process that keeps the shared mapping of a pool file across attaches (a worker
that gets a partition back) must check that the mapping still holds a pool of the
expected page size, and may map the header page of every used frame up front
instead of taking a page fault on each. Both read the pool's raw mapping, whose
layout belongs to `mmm.pool`; these functions are that layout's public face.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from mmm.pool import _MADV_POPULATE_WRITE, _POOL_HEADER, _POOL_MAGIC, PagePool, _populate_headers

__all__ = ["mapped_n_frames", "file_page_bytes", "populate_frame_headers", "MADV_POPULATE_WRITE"]

MADV_POPULATE_WRITE = _MADV_POPULATE_WRITE
"""Linux >= 5.14; not in Python's `mmap` module before 3.13."""


def mapped_n_frames(raw: Any, page_bytes: int) -> int | None:
    """Frames of the pool whose file `raw` maps (a `PagePool` mapping: a 1-D uint8 array
    over the whole file), or None when it is not a pool of `page_bytes` pages.

    Runtime complexity: O(1).
    """
    if len(raw) < _POOL_HEADER.itemsize:
        return None
    hdr = np.asarray(raw[:_POOL_HEADER.itemsize]).view(_POOL_HEADER)[0]
    if bytes(hdr["magic"]) != _POOL_MAGIC or int(hdr["page_bytes"]) != page_bytes:
        return None
    return int(hdr["n_frames"])


def file_page_bytes(path: str) -> int | None:
    """The page size of the pool file at `path` (from its header), or None when the file
    is not a pool file (too short, another magic). Reads the header only.

    Raises
    ------
    OSError
        If the file cannot be opened or read.
    """
    with open(path, "rb") as f:
        head = f.read(_POOL_HEADER.itemsize)
    if len(head) < _POOL_HEADER.itemsize:
        return None
    hdr = np.frombuffer(head, _POOL_HEADER)[0]
    if bytes(hdr["magic"]) != _POOL_MAGIC:
        return None
    return int(hdr["page_bytes"])


def populate_frame_headers(pool: PagePool, frames: npt.NDArray[np.int64]) -> int:
    """Map the first 4 KiB (the header) of each of `frames` of a file-backed pool up front,
    one ``MADV_POPULATE_WRITE`` each: about 3x cheaper than the page fault a later access
    would take. Returns the frames populated: 0 for an in-memory pool, on a kernel
    without that advice, or after any refusal (the advice is only ever a hint, so a
    failure changes nothing). Populating whole frames instead costs more than the faults
    it saves.

    Runtime complexity: O(len(frames)) system calls.
    """
    return _populate_headers(pool, frames)
