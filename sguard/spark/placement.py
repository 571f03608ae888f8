"""Local placement of a partition's state: a directory per (state, partition).

Spark does not keep a partition in one Python worker (it moved in 9-15 of 24
batch transitions here), so a partition's pages live in a *file-backed* mmm
pool that whichever worker runs the partition re-attaches (about 1 ms). Each
partition has its own directory under a local root (``/dev/shm`` when it has
room, else Spark's local dir: `choose_local_dir`; always a disk for a query with a
memory budget, `disk_local_dir`)::

    <local-dir>/sguard-<uid>/<state-id>/p0003/
        pool        the mmm PagePool file (sparse; its blocks are reserved as frames are
                    handed out, so a full file system is `mmm.PoolSpaceError`, not SIGBUS)
        lock        flock()ed by the process that owns the partition
        marker.json the version marker (`Marker`), replaced atomically
        base.npy    the rollback point: page ids and frames of "after b-1"
        ckpt.npz    page versions of the latest durable checkpoint (`record_path`)

``<state-id>`` is derived from the state URI, operator name and generation,
so two queries (or two generations after a repartitioning) never share files.

The lock is an ``flock`` on ``lock``: the kernel drops it when the process
dies, so a killed worker never blocks its successor. A process keeps it while
its asynchronous checkpoint of the partition is in flight (the checkpoint
reads frames of the shared pool file), then lets it go.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from sguard.spark.errors import PartitionLockTimeout

__all__ = ["Marker", "PartitionSlot", "default_local_dir", "disk_local_dir", "choose_local_dir", "LocalDirChoice",
           "spark_local_dirs", "SHM_ROOM_BYTES", "state_id", "root_key", "boot_id",
           "record_path"]

logger = logging.getLogger(__name__)

_SHM = "/dev/shm"
SHM_ROOM_BYTES = 1 << 30
"""Free bytes /dev/shm must have for the live state to go there by default: the
partitions' pages with room to spare (a container's 64 MB /dev/shm does not qualify)."""


@dataclass(frozen=True, slots=True)
class LocalDirChoice:
    """Where `choose_local_dir` put the live state, and why."""

    path: str
    """The local root: ``<candidate>/sguard-<uid>``."""
    free_bytes: int
    """Bytes free on its file system when chosen."""
    reason: str
    """One line naming the directory chosen and the ones passed over."""


def spark_local_dirs() -> list[str]:
    """Spark's own scratch directories: ``SPARK_LOCAL_DIRS``, else ``spark.local.dir`` of
    the active SparkContext (when there is one in this process), else the temp dir."""
    env = os.environ.get("SPARK_LOCAL_DIRS")
    dirs = [d for d in (env or "").split(",") if d]
    if not dirs:
        try:
            from pyspark import SparkContext
            sc = SparkContext._active_spark_context
            conf = sc.getConf().get("spark.local.dir") if sc is not None else None
        except Exception:  # noqa: BLE001 - no Spark here: the temp dir
            conf = None
        dirs = [d for d in (conf or "").split(",") if d]
    return dirs + [tempfile.gettempdir()]


def _free_bytes(d: str) -> int | None:
    """Bytes free in directory ``d``, or None when it is missing or not writable."""
    if not (os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK)):
        return None
    try:
        st = os.statvfs(d)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


_LAST_REASON: str | None = None


def choose_local_dir(need_bytes: int = SHM_ROOM_BYTES,
                     candidates: Sequence[str] | None = None) -> LocalDirChoice:
    """Choose the local root of the partitions' live state by free space.

    The first candidate (/dev/shm) is taken when it is writable and has
    ``need_bytes`` free; otherwise the first of the others (Spark's local
    directories, `spark_local_dirs`) with ``need_bytes`` free, else the one of them
    with the most room. The choice and its reason are logged (at INFO, once per
    distinct reason).

    Parameters
    ----------
    need_bytes : int
        Room a directory must have (default `SHM_ROOM_BYTES`).
    candidates : sequence of str, optional
        Directories in order of preference, memory first (default: /dev/shm, then
        `spark_local_dirs`).

    Raises
    ------
    FileNotFoundError
        If no candidate is a writable directory.
    ValueError
        If ``candidates`` is empty.
    """
    global _LAST_REASON
    cands = list(candidates) if candidates is not None else [_SHM, *spark_local_dirs()]
    if not cands:
        raise ValueError("choose_local_dir: no candidate directory")
    free = {d: _free_bytes(d) for d in cands}
    passed: list[str] = []
    pick: str | None = None
    for d in cands:
        f = free[d]
        if f is None:
            passed.append(f"{d} is not a writable directory")
        elif f < need_bytes:
            passed.append(f"{d} has {f} bytes free, less than {need_bytes}")
        else:
            pick = d
            break
    if pick is None:
        usable = [d for d in cands[1:] if free[d] is not None] or [
            d for d in cands if free[d] is not None]
        if not usable:
            raise FileNotFoundError("no writable directory for the live state among "
                                    + ", ".join(cands))
        pick = max(usable, key=lambda d: free[d] or 0)
        why = f"the most room of {', '.join(usable)}"
    else:
        why = f"{free[pick]} bytes free, at least {need_bytes}"
    reason = f"live state under {pick}: {why}" + (
        f" ({'; '.join(passed)})" if passed else "")
    if reason != _LAST_REASON:
        _LAST_REASON = reason
        logger.info("%s", reason)
    return LocalDirChoice(os.path.join(pick, f"sguard-{os.getuid()}"), free[pick] or 0, reason)


def default_local_dir(need_bytes: int = SHM_ROOM_BYTES,
                      candidates: Sequence[str] | None = None) -> str:
    """``<dir>/sguard-<uid>`` for the directory `choose_local_dir` picks: /dev/shm when it
    has ``need_bytes`` free, else Spark's local directories.

    Raises
    ------
    FileNotFoundError
        If no candidate is a writable directory.
    """
    return choose_local_dir(need_bytes, candidates).path


def disk_local_dir(need_bytes: int = SHM_ROOM_BYTES,
                   candidates: Sequence[str] | None = None) -> str:
    """``<dir>/sguard-<uid>`` on a disk, for a query with a memory budget
    (`sguard.spark.budget`): `choose_local_dir` among Spark's local directories
    (`spark_local_dirs`), memory file systems (tmpfs) left out.

    Raises
    ------
    mmm.pagecache.BudgetError
        If every candidate is on a memory file system.
    FileNotFoundError
        If no candidate on a disk is a writable directory.
    """
    from mmm.pagecache import BudgetError, is_memory_fs
    cands = list(candidates) if candidates is not None else spark_local_dirs()
    disks = [d for d in cands if not is_memory_fs(d)]
    if not disks:
        raise BudgetError("a memory budget needs the live state on a disk, and every local "
                          f"directory ({', '.join(cands)}) is on a memory file system: set "
                          "spark.local.dir (or SPARK_LOCAL_DIRS, or local_dir=) to a disk")
    return choose_local_dir(need_bytes, disks).path


def record_path(pool_path: str) -> str:
    """The checkpoint record beside a partition's pool file (`sguard.spark.checkpointing`)."""
    return os.path.join(os.path.dirname(pool_path), "ckpt.npz")


def root_key(root: Any) -> str:
    """A normalized name of a state root (``file:///a/``, ``/a`` and ``/a/`` are one root)."""
    return f"{root.backend}:{root.base_path}"


def state_id(state_key: str, name: str, generation: int) -> str:
    """A short stable id of (state root, operator name, generation) for directory names."""
    h = hashlib.sha1(f"{state_key}\0{name}\0{generation}".encode()).hexdigest()[:16]
    return f"{name}-g{generation}-{h}"


_BOOT_ID: str | None = None


def boot_id() -> str:
    """This host's boot id: local state from before a reboot is never trusted."""
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _BOOT_ID = f.read().strip()
        except OSError:
            _BOOT_ID = "unknown"
    return _BOOT_ID


@dataclass(frozen=True)
class Marker:
    """The version of a partition's local state.

    Attributes
    ----------
    token
        Unique per write: a process whose cached state carries another token
        knows that some other process wrote the partition since.
    status
        ``"applying"`` while batch `batch` is being applied (a crash leaves the
        pool partly updated), ``"applied"`` once it is complete.
    batch
        The batch being applied or last applied.
    base_batch
        The batch the rollback point ``base.npy`` holds the state after
        (``batch - 1``), or None when there is no rollback point.
    durable_batch
        The last batch covered by a durable DFS checkpoint (-1: none).
    started_batch
        The last batch a checkpoint was started for (>= `durable_batch`; its write may
        still be in flight in the process that wrote the marker). A worker that attaches
        counts the checkpoint policy from here, so a move never adds a checkpoint.
    boot_id
        The host's boot id when written.
    epoch, claim
        The ownership epoch and claim token the writer held (`sguard.spark.fencing`;
        0 and "" in markers written before fencing): the local state is the
        partition's only while that claim owns it.
    """

    token: str
    status: str
    batch: int
    base_batch: int | None
    durable_batch: int
    boot_id: str
    epoch: int = 0
    claim: str = ""
    started_batch: int = -1

    def __post_init__(self) -> None:
        if self.started_batch < self.durable_batch:  # markers written before the field
            object.__setattr__(self, "started_batch", self.durable_batch)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Marker:
        d = json.loads(data)
        return cls(token=str(d["token"]), status=str(d["status"]), batch=int(d["batch"]),
                   base_batch=None if d["base_batch"] is None else int(d["base_batch"]),
                   durable_batch=int(d["durable_batch"]), boot_id=str(d["boot_id"]),
                   epoch=int(d.get("epoch", 0)), claim=str(d.get("claim", "")),
                   started_batch=int(d.get("started_batch", -1)))


def new_token() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


class PartitionSlot:
    """The local directory of one partition: pool file, lock, marker, rollback point."""

    def __init__(self, local_dir: str, sid: str, partition: int) -> None:
        self.partition = partition
        self.dir = os.path.join(local_dir, sid, f"p{partition:04d}")
        self.pool_path = os.path.join(self.dir, "pool")
        self.marker_path = os.path.join(self.dir, "marker.json")
        self.base_path = os.path.join(self.dir, "base.npy")
        self.lock_path = os.path.join(self.dir, "lock")
        self._fd: int | None = None

    # -- the lock ---------------------------------------------------------------------
    @property
    def locked(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout_s: float) -> float:
        """Take the partition's lock (blocking up to `timeout_s`); return seconds waited.

        Raises
        ------
        PartitionLockTimeout
            If another process held it for longer than `timeout_s`.
        """
        if self._fd is not None:
            return 0.0
        os.makedirs(self.dir, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        t0 = time.monotonic()
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
            if time.monotonic() - t0 > timeout_s:
                os.close(fd)
                raise PartitionLockTimeout(
                    f"partition {self.partition}: lock {self.lock_path} held by another "
                    f"process for more than {timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        self._fd = fd
        return time.monotonic() - t0

    def release(self) -> None:
        """Let the lock go (closing the descriptor drops the flock)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    # -- marker and rollback point --------------------------------------------------------
    def read_marker(self) -> Marker | None:
        """The marker, or None when missing or unreadable (then the local state is not trusted)."""
        try:
            with open(self.marker_path, "rb") as f:
                return Marker.from_json(f.read())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write_marker(self, marker: Marker) -> None:
        """Replace the marker atomically (rename)."""
        _write_atomic(self.marker_path, marker.to_json())

    def write_base(self, page_ids: npt.NDArray[np.uint64], frames: npt.NDArray[np.int64]) -> None:
        """Record the rollback point (page ids and the frames holding them), atomically."""
        arr = np.empty((2, len(frames)), dtype=np.int64)
        arr[0] = page_ids.view(np.int64)
        arr[1] = frames
        tmp = f"{self.base_path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, self.base_path)

    def read_base(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]] | None:
        """The rollback point, or None when missing or damaged."""
        try:
            arr = np.load(self.base_path, allow_pickle=False)
        except (OSError, ValueError):
            return None
        if arr.ndim != 2 or arr.shape[0] != 2 or arr.dtype != np.int64:
            return None
        return arr[0].view(np.uint64).copy(), arr[1].copy()

    def has_pool(self) -> bool:
        return os.path.exists(self.pool_path)

    def wipe(self) -> None:
        """Delete the local state files (not the lock): the state is rebuilt from the DFS."""
        for p in (record_path(self.pool_path), self.marker_path, self.base_path,
                  self.pool_path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def describe(self) -> dict[str, Any]:
        m = self.read_marker()
        return {"dir": self.dir, "marker": None if m is None else asdict(m),
                "pool_bytes": os.path.getsize(self.pool_path) if self.has_pool() else None}


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
