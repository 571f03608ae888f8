"""mmm — the Memory Management Middleware of SGuard (paper §4).

Operator state lives in fixed-size pages whose bytes in memory are exactly
their bytes on disk, so a checkpoint needs no serialization, and copy-on-write
lets the operator run while its pages are written.

Glossary
--------
page        a fixed-size block (power of two, 4 KiB-1 MiB, default 64 KiB): a
            64-byte header and a record area viewed as a numpy array
frame       the slot of the pool's buffer that currently holds a page
page set    the pages of one data structure, named by a PSID (an integer)
namespace   a view of a page manager whose structures have prefixed names and
            PSIDs from a block of their own (`Namespace`)
page_id     ``(psid << 32) | seq``; seq 0 is the set's super page (metadata)
pin         a snapshot's hold on a frame: a pinned frame is never written in place
snapshot    a frozen, consistent set of pages (the paper's checkpoint request)
epoch       the snapshot counter; a page's modification epoch tells whether it
            changed since the last completed snapshot (incremental checkpoints)
persisted   a page whose bytes are durable: its pin is dropped
generation  bumped when pages change underneath structures (rollback, load):
            structures rebuild their in-memory indexes lazily
"""
from mmm.errors import (IdNotFoundError, KeyFormatError, MmmError, NamespaceFullError,
                        PageFormatError, PageNotFoundError, PageSetExistsError,
                        PageSetNotFoundError, PageSizeError, PoolExhaustedError, PoolFileError, PoolSpaceError,
                        RecordTypeError, RollbackPointError,
                        SchemaError, SchemaMismatchError, SnapshotStateError,
                        StructureNotFoundError)
from mmm._kernels import CompileReport as KernelCompileReport
from mmm._kernels import cached_variants as cached_kernel_variants
from mmm._kernels import compile_variants as compile_kernel_variants
from mmm._kernels import jit
from mmm._kernels import loaded_variants as loaded_kernel_variants
from mmm._kernels import preload_cached as preload_kernels
from mmm.manager import PSID_LIMIT, Loader, PageManager, PageSet
from mmm.namespace import Namespace
from mmm.page import Layout, make_page_id, split_page_id
from mmm.pool import PagePool
from mmm.snapshot import Snapshot, SnapshotState
from mmm.structures.hashmap import HashMap
from mmm.structures.keydict import KeyDict
from mmm.structures.ordered_map import OrderedMap
from mmm.structures.sequence import PagedDeque, PagedList

__all__ = [
    "PageManager", "PageSet", "Namespace", "PSID_LIMIT", "HashMap", "KeyDict", "OrderedMap", "PagedList", "PagedDeque", "PagePool", "Loader", "Snapshot", "SnapshotState", "Layout",
    "make_page_id", "split_page_id", "preload_kernels", "loaded_kernel_variants",
    "compile_kernel_variants", "cached_kernel_variants", "KernelCompileReport", "jit",
    "IdNotFoundError", "KeyFormatError", "MmmError", "NamespaceFullError", "PageFormatError",
    "PageSetExistsError", "PageNotFoundError", "PageSetNotFoundError", "PageSizeError",
    "PoolExhaustedError", "PoolFileError", "PoolSpaceError", "RecordTypeError",
    "RollbackPointError", "SchemaError",
    "SchemaMismatchError", "SnapshotStateError", "StructureNotFoundError",
]
