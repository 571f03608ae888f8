"""Tests of ioservice.fs: backend conformance, fault injection, bad input, replication."""

from __future__ import annotations

import doctest
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pyarrow.fs as pafs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ioservice import (
    BackendUnavailableError,
    InvalidNameError,
    InvalidPathError,
    InvalidURIError,
    IOServiceError,
    RootNotWritableError,
    StorageIOError,
    StorageNotFoundError,
    StorageRoot,
    StorageUnreachableError,
    UnsupportedURIError,
    open_root,
    validate_name,
)
import ioservice.errors
import ioservice.fs
import ioservice.testing
from ioservice.testing import FaultyFS, SeaweedCluster, find_weed_binary

MIB = 1 << 20


def _pattern(nbytes: int, seed: int = 0) -> bytes:
    """Deterministic non-repeating-looking bytes (a counter pattern) of length `nbytes`."""
    block = bytes((i * 131 + seed * 17 + (i >> 8)) & 0xFF for i in range(65536))
    reps, rest = divmod(nbytes, len(block))
    return block * reps + block[:rest]


# ------------------------------------------------------------------- conformance


class BackendTests:
    """Behaviour every backend must share; subclasses provide the `root` fixture."""

    @pytest.fixture
    def root(self) -> StorageRoot:  # pragma: no cover - overridden
        raise NotImplementedError

    def test_write_then_read_round_trips(self, root: StorageRoot) -> None:
        """Bytes written through an output stream read back identically."""
        path = root.join("checkpoint", "agg-1", "w0.pages")
        with root.open_output_stream(path) as out:
            out.write(b"hello ")
            out.write(b"pages")
        root.sync(path)
        assert root.read_bytes(path) == b"hello pages"
        assert root.exists(path)
        assert root.size_bytes(path) == 11

    def test_range_reads_return_the_requested_slice(self, root: StorageRoot) -> None:
        """Range reads return the slice, clip at end of file, reject negative arguments."""
        data = _pattern(10_000)
        root.write_atomic("f.bin", data)
        assert root.read_bytes("f.bin", offset=100, length=50) == data[100:150]
        assert root.read_bytes("f.bin", offset=9_990) == data[9_990:]
        assert root.read_bytes("f.bin", offset=9_990, length=100) == data[9_990:]
        assert root.read_bytes("f.bin", offset=20_000, length=10) == b""
        with root.open_input_file("f.bin") as f:
            assert f.size() == 10_000
            assert f.read_at(4, 5_000) == data[5_000:5_004]
        with pytest.raises(ValueError):
            root.read_bytes("f.bin", offset=-1)

    def test_list_dir_returns_sorted_entries_with_sizes(self, root: StorageRoot) -> None:
        """Listings are sorted, relative to the root, and carry file sizes."""
        for name, size in [("b", 3), ("a", 1), ("c", 2)]:
            root.write_atomic(f"checkpoint/u-1/{name}", b"x" * size)
        root.write_atomic("checkpoint/u-2/manifest.json", b"{}")
        entries = root.list_dir("checkpoint/u-1")
        assert [(e.relpath, e.name, e.is_dir, e.size_bytes) for e in entries] == [
            ("checkpoint/u-1/a", "a", False, 1),
            ("checkpoint/u-1/b", "b", False, 3),
            ("checkpoint/u-1/c", "c", False, 2),
        ]
        top = root.list_dir("checkpoint")
        assert [(e.name, e.is_dir) for e in top] == [("u-1", True), ("u-2", True)]
        deep = root.list_dir("checkpoint", recursive=True)
        assert "checkpoint/u-2/manifest.json" in [e.relpath for e in deep]

    def test_list_missing_dir_is_empty_or_not_found(self, root: StorageRoot) -> None:
        """A missing directory lists as [] with allow_not_found, else StorageNotFoundError."""
        assert root.list_dir("nothing/here", allow_not_found=True) == []
        with pytest.raises(StorageNotFoundError):
            root.list_dir("nothing/here")

    def test_write_atomic_replaces_target_and_leaves_no_temp_file(self, root: StorageRoot) -> None:
        """write_atomic overwrites an existing object and leaves only the target behind."""
        root.write_atomic("checkpoint/u-1/manifest.json", b'{"v": 1}')
        root.write_atomic("checkpoint/u-1/manifest.json", b'{"v": 2}')
        assert root.read_bytes("checkpoint/u-1/manifest.json") == b'{"v": 2}'
        assert [e.name for e in root.list_dir("checkpoint/u-1")] == ["manifest.json"]

    def test_delete_dir_removes_the_whole_tree(self, root: StorageRoot) -> None:
        """delete_dir removes a directory and everything below it, and nothing else."""
        root.write_atomic("checkpoint/u-1/a", b"1")
        root.write_atomic("checkpoint/u-1/sub/b", b"2")
        root.write_atomic("checkpoint/u-2/a", b"3")
        root.delete_dir("checkpoint/u-1")
        assert not root.exists("checkpoint/u-1/a")
        assert [e.relpath for e in root.list_dir("checkpoint", recursive=True) if not e.is_dir] == [
            "checkpoint/u-2/a"
        ]
        root.delete_dir("checkpoint/u-1")  # missing_ok by default
        with pytest.raises(StorageNotFoundError):
            root.delete_dir("checkpoint/u-1", missing_ok=False)

    def test_delete_file_and_missing_file_errors(self, root: StorageRoot) -> None:
        """Deleting or reading a missing file raises StorageNotFoundError (a FileNotFoundError)."""
        root.write_atomic("x/f", b"1")
        root.delete_file("x/f")
        assert not root.exists("x/f")
        with pytest.raises(StorageNotFoundError):
            root.delete_file("x/f")
        root.delete_file("x/f", missing_ok=True)
        with pytest.raises(FileNotFoundError):
            root.read_bytes("x/f")
        with pytest.raises(StorageNotFoundError):
            root.size_bytes("x/f")

    def test_large_streamed_write_reads_back_exactly(self, root: StorageRoot) -> None:
        """A 20 MiB file written in 4 MiB pieces reads back bit-exact, whole and by ranges."""
        data = _pattern(20 * MIB + 123, seed=3)
        with root.open_output_stream("big/w0.pages") as out:
            for start in range(0, len(data), 4 * MIB):
                out.write(data[start:start + 4 * MIB])
        assert root.size_bytes("big/w0.pages") == len(data)
        assert root.read_bytes("big/w0.pages") == data
        assert root.read_bytes("big/w0.pages", offset=7 * MIB + 5, length=MIB) == data[7 * MIB + 5:8 * MIB + 5]

    def test_parallel_writers_do_not_interfere(self, root: StorageRoot) -> None:
        """Four threads writing four files at once each produce their own bytes."""
        payloads = {f"par/w{i}.pages": _pattern(MIB + i, seed=i) for i in range(4)}

        def write(path: str, data: bytes) -> None:
            with root.open_output_stream(path) as out:
                out.write(data)

        threads = [threading.Thread(target=write, args=item) for item in payloads.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for path, data in payloads.items():
            assert root.read_bytes(path) == data

    def test_check_writable_passes_and_leaves_nothing(self, root: StorageRoot) -> None:
        """check_writable succeeds on a healthy root and removes its probe."""
        root.check_writable()
        assert not [e for e in root.list_dir("", allow_not_found=True) if e.name.startswith(".sguard-probe")]

    def test_paths_cannot_escape_the_root(self, root: StorageRoot) -> None:
        """Relative paths with '..', empty components or a leading '/' are refused."""
        for bad in ["../x", "a/../b", "/etc/passwd", "a//b", "a/", ".", "a\\b", "a\x00b"]:
            with pytest.raises(InvalidPathError):
                root.full_path(bad)
        with pytest.raises(InvalidPathError):
            root.delete_dir("")
        with pytest.raises(InvalidPathError):
            root.join("checkpoint", "..", "x")


class TestLocal(BackendTests):
    """Conformance on the local filesystem (the embedded default)."""

    @pytest.fixture
    def root(self, tmp_path: os.PathLike[str]) -> StorageRoot:
        return open_root(os.path.join(tmp_path, "root"))

    def test_file_uri_and_plain_path_name_the_same_root(self, tmp_path: os.PathLike[str]) -> None:
        """file:///abs and /abs open the same directory; the root is created."""
        path = os.path.join(tmp_path, "r")
        a = open_root(f"file://{path}")
        b = open_root(path)
        a.write_atomic("m", b"1")
        assert b.read_bytes("m") == b"1"
        assert a.backend == "local" and a.atomic_rename

    def test_relative_path_resolves_against_cwd(self, tmp_path: os.PathLike[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
        """A relative plain path is resolved against the working directory."""
        monkeypatch.chdir(tmp_path)
        root = open_root("ckpt")
        assert root.base_path == os.path.join(tmp_path, "ckpt")
        assert os.path.isdir(root.base_path)


class TestFaultyPassthrough(BackendTests):
    """Conformance through FaultyFS with no fault armed (the handler is complete)."""

    @pytest.fixture
    def root(self, tmp_path: os.PathLike[str]) -> StorageRoot:
        base = os.path.join(tmp_path, "root")
        os.makedirs(base)
        return StorageRoot(pafs.PyFileSystem(FaultyFS(pafs.LocalFileSystem())), base)


@pytest.mark.seaweedfs
class TestSeaweedFS(BackendTests):
    """Conformance on a real SeaweedFS cluster through its S3 gateway."""

    @pytest.fixture
    def root(self, seaweed: SeaweedCluster, seaweed_uri: str) -> StorageRoot:
        return open_root(seaweed_uri, s3_endpoint=seaweed.s3_endpoint,
                         s3_access_key=seaweed.access_key, s3_secret_key=seaweed.secret_key)

    def test_env_vars_configure_the_endpoint(self, seaweed: SeaweedCluster, seaweed_uri: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
        """SGUARD_S3_ENDPOINT and AWS_* variables are enough to open an s3:// root."""
        for key, value in seaweed.env().items():
            monkeypatch.setenv(key, value)
        root = open_root(seaweed_uri)
        root.write_atomic("m", b"env")
        assert root.read_bytes("m") == b"env"
        assert root.backend == "s3" and not root.atomic_rename

    def test_missing_bucket_is_reported(self, seaweed: SeaweedCluster) -> None:
        """Opening a root in a bucket that does not exist raises StorageNotFoundError naming it."""
        with pytest.raises(StorageNotFoundError, match="no-such-bucket"):
            open_root("s3://no-such-bucket/x", s3_endpoint=seaweed.s3_endpoint,
                      s3_access_key=seaweed.access_key, s3_secret_key=seaweed.secret_key)


@pytest.mark.hdfs
class TestHdfs(BackendTests):
    """Conformance on HDFS, when SGUARD_TEST_HDFS_URI names a cluster."""

    @pytest.fixture
    def root(self, hdfs_uri: str) -> Iterator[StorageRoot]:
        root = open_root(hdfs_uri)
        yield root
        root.filesystem.delete_dir(root.base_path)


# ---------------------------------------------------------------- fault injection


def _faulty_root(tmp_path: os.PathLike[str], **faults: object) -> tuple[StorageRoot, FaultyFS]:
    """A StorageRoot over FaultyFS(LocalFileSystem) with `faults` armed."""
    handler = FaultyFS(pafs.LocalFileSystem(), **faults)  # type: ignore[arg-type]
    base = os.path.join(tmp_path, "root")
    os.makedirs(base, exist_ok=True)
    return StorageRoot(pafs.PyFileSystem(handler), base), handler


def test_faulty_nth_write_raises_oserror_once(tmp_path: os.PathLike[str]) -> None:
    """The n-th write call raises OSError; the writes before and after succeed."""
    root, faulty = _faulty_root(tmp_path, fail_on_nth_write=3)
    with root.open_output_stream("w0") as out:
        out.write(b"a")
        out.write(b"b")
        with pytest.raises(OSError, match="injected failure on write #3"):
            out.write(b"c")
        out.write(b"d")
    assert root.read_bytes("w0") == b"abd"
    stats = faulty.stats()
    assert stats["write"] == 4 and stats["injected_failures"] == 1 and stats["written_bytes"] == 4


def test_faulty_failed_atomic_write_leaves_previous_manifest(tmp_path: os.PathLike[str]) -> None:
    """A failed write_atomic leaves the previous manifest intact and no temp file."""
    root, faulty = _faulty_root(tmp_path)
    root.write_atomic("ck/manifest.json", b"old")
    faulty.reset_counters()
    faulty.fail_on_nth_write = 1
    with pytest.raises(StorageIOError, match="manifest.json"):
        root.write_atomic("ck/manifest.json", b"new")
    assert root.read_bytes("ck/manifest.json") == b"old"
    assert [e.name for e in root.list_dir("ck")] == ["manifest.json"]


def test_faulty_glob_selects_which_writes_count(tmp_path: os.PathLike[str]) -> None:
    """fail_path_glob restricts the failing write to matching paths."""
    root, _ = _faulty_root(tmp_path, fail_on_nth_write=1, fail_path_glob="*/manifest*")
    with root.open_output_stream("ck/w0.pages") as out:
        out.write(b"page")
    with pytest.raises(OSError):
        with root.open_output_stream("ck/manifest.json") as out:
            out.write(b"{}")


def test_faulty_truncation_is_silent(tmp_path: os.PathLike[str]) -> None:
    """With truncate_after, writes report success but the file keeps only the prefix."""
    root, faulty = _faulty_root(tmp_path, truncate_after=10)
    with root.open_output_stream("w0") as out:
        assert out.write(b"0123456") == 7
        assert out.write(b"789abcdef") == 9
    assert root.read_bytes("w0") == b"0123456789"
    assert faulty.stats()["truncated_bytes"] == 6


def test_faulty_latency_slows_every_operation(tmp_path: os.PathLike[str]) -> None:
    """latency_s is slept per operation: open, write, close, reads."""
    root, faulty = _faulty_root(tmp_path, latency_s=0.05)
    t0 = time.perf_counter()
    with root.open_output_stream("w0") as out:  # create_dir? no parent; open
        out.write(b"x")
    assert root.read_bytes("w0", offset=0, length=1) == b"x"
    elapsed = time.perf_counter() - t0
    assert elapsed >= 0.05 * 4
    assert faulty.stats()["open_output_stream"] == 1


def test_faulty_rejects_bad_settings() -> None:
    """Nonsensical fault settings raise ValueError."""
    with pytest.raises(ValueError):
        FaultyFS(pafs.LocalFileSystem(), fail_on_nth_write=0)
    with pytest.raises(ValueError):
        FaultyFS(pafs.LocalFileSystem(), latency_s=-1)


# -------------------------------------------------------------------- bad input


@pytest.mark.parametrize("uri", ["ftp://host/x", "gs://bucket/x", "mock://x", "abfs://c/x", "gcs:bucket/x"])
def test_unknown_uri_scheme_is_rejected(uri: str) -> None:
    """Unsupported schemes raise UnsupportedURIError, also a ValueError, naming the URI."""
    with pytest.raises(UnsupportedURIError, match="unsupported scheme|expected scheme") as info:
        open_root(uri)
    assert isinstance(info.value, ValueError)
    assert uri in str(info.value)


@pytest.mark.parametrize("uri", ["s3://", "s3:///prefix", "hdfs:///path", "file://otherhost/x",
                                 "s3://bucket/a/../b", "file:///tmp/x?y=1", ""])
def test_malformed_uri_is_rejected(uri: str) -> None:
    """Malformed URIs raise InvalidURIError."""
    with pytest.raises(InvalidURIError):
        open_root(uri)


def _refused_port() -> int:
    """A loopback port with nothing listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _within(hang_s: float, fn: Any) -> Any:
    """Run `fn` in a thread; fail if it has not returned after `hang_s` (a hang, not slowness:
    the bound is far above any load, so the verdict does not depend on the machine's speed)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(hang_s)
    assert not t.is_alive(), f"hung for more than {hang_s} s"
    if "error" in box:
        raise box["error"]
    return box.get("result")


def test_unreachable_s3_endpoint_fails_fast() -> None:
    """A refused S3 endpoint raises StorageUnreachableError (a ConnectionError); it never hangs."""
    endpoint = f"http://127.0.0.1:{_refused_port()}"
    with pytest.raises(StorageUnreachableError, match=endpoint.split("//")[1]) as info:
        _within(60, lambda: open_root("s3://bucket/prefix", s3_endpoint=endpoint,
                                      s3_access_key="a", s3_secret_key="b"))
    assert isinstance(info.value, ConnectionError)


def test_silent_s3_endpoint_times_out_fast() -> None:
    """An endpoint that accepts connections but never answers times out, not hangs."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(StorageUnreachableError):
            _within(60, lambda: open_root("s3://bucket/p", s3_endpoint=endpoint, s3_access_key="a",
                                          s3_secret_key="b", timeout_s=0.5, max_attempts=1))


def test_hdfs_without_client_or_namenode_fails_clearly() -> None:
    """hdfs:// with no libhdfs/JVM, or no namenode, raises a specific IOServiceError."""
    with pytest.raises((BackendUnavailableError, StorageUnreachableError)):
        open_root(f"hdfs://127.0.0.1:{_refused_port()}/sguard")


def test_root_under_a_regular_file_is_not_writable(tmp_path: os.PathLike[str]) -> None:
    """A root whose parent is a file cannot be created, even by root: RootNotWritableError."""
    blocker = os.path.join(tmp_path, "file")
    with open(blocker, "wb") as f:
        f.write(b"x")
    with pytest.raises(RootNotWritableError, match="file") as info:
        open_root(os.path.join(blocker, "root"))
    assert isinstance(info.value, PermissionError)
    with pytest.raises(RootNotWritableError):
        open_root(blocker)  # the root itself is a file
    root = open_root(os.path.join(blocker, "root"), create=False)
    with pytest.raises(RootNotWritableError, match="not writable"):
        root.check_writable()


def test_read_only_filesystem_root_is_not_writable() -> None:
    """A root in a read-only filesystem (/proc) fails check_writable with RootNotWritableError."""
    root = StorageRoot(pafs.LocalFileSystem(), "/proc/sys/sguard-test")
    with pytest.raises(RootNotWritableError):
        root.check_writable()


@pytest.mark.parametrize("name", ["", "a/b", "..", ".", "../up", "a\x00b", "a\nb", "a\\b",
                                  " lead", "tab\t", "x" * 201, ".hidden", "-dash", "a:b", "ü"])
def test_bad_ha_unit_names_are_rejected(name: str) -> None:
    """HA unit names with '/', '..', control or non-portable characters raise InvalidNameError."""
    with pytest.raises(InvalidNameError) as info:
        validate_name(name)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", ["agg", "agg.p3", "win_join-2", "op=sum", "A" * 200, "0"])
def test_good_ha_unit_names_are_accepted(name: str) -> None:
    """Portable names pass validate_name unchanged."""
    assert validate_name(name) == name


def test_non_str_name_is_rejected() -> None:
    """A non-str HA unit name raises InvalidNameError."""
    with pytest.raises(InvalidNameError, match="str"):
        validate_name(3)  # type: ignore[arg-type]


def test_errors_share_one_base() -> None:
    """Every ioservice error is an IOServiceError."""
    for cls in (UnsupportedURIError, StorageUnreachableError, RootNotWritableError, InvalidNameError,
                StorageNotFoundError, StorageIOError, BackendUnavailableError, InvalidPathError):
        assert issubclass(cls, IOServiceError)


# ------------------------------------------------------------------ replication


@pytest.mark.seaweedfs
def test_file_survives_killing_a_volume_server() -> None:
    """With replication 010, killing the only rack2 volume server keeps a written file readable."""
    with SeaweedCluster() as cluster:
        cluster.create_bucket("ckpt")
        root = open_root("s3://ckpt/repl", s3_endpoint=cluster.s3_endpoint,
                         s3_access_key=cluster.access_key, s3_secret_key=cluster.secret_key)
        data = _pattern(3 * MIB, seed=9)
        with root.open_output_stream("u-1/w0.pages") as out:
            out.write(data)
        root.write_atomic("u-1/manifest.json", b'{"format_version": 1}')
        cluster.kill_volume(2)  # rack2 holds one copy of every volume under 010
        assert not cluster.volumes[2].alive()
        assert root.read_bytes("u-1/w0.pages") == data
        assert root.read_bytes("u-1/manifest.json") == b'{"format_version": 1}'
        cluster.restart_volume(2)
        root.write_atomic("u-2/manifest.json", b"after restart")
        assert root.read_bytes("u-2/manifest.json") == b"after restart"
        procs = cluster.processes
    assert all(not p.alive() for p in procs)
    assert not cluster.workdir.exists()


def test_cluster_start_failure_reports_the_log_tail(tmp_path: os.PathLike[str]) -> None:
    """A server that dies at startup raises RuntimeError with its log, and nothing is left running."""
    fake = os.path.join(tmp_path, "weed")
    with open(fake, "w") as f:
        f.write("#!/bin/sh\necho 'fake weed: boom' >&2\nexit 3\n")
    os.chmod(fake, 0o755)
    cluster = SeaweedCluster(weed_binary=fake, start_timeout_s=600.0)
    with pytest.raises(RuntimeError, match="(?s)master exited during startup.*fake weed: boom"):
        cluster.start()
    assert all(not p.alive() for p in cluster.processes)
    assert not cluster.workdir.exists()


def test_missing_weed_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: os.PathLike[str]) -> None:
    """A bad SGUARD_WEED_BINARY raises FileNotFoundError naming it."""
    bad = os.path.join(tmp_path, "nope")
    monkeypatch.setenv("SGUARD_WEED_BINARY", bad)
    with pytest.raises(FileNotFoundError, match="nope"):
        find_weed_binary()


@pytest.mark.parametrize("module", [ioservice.errors, ioservice.fs, ioservice.testing])
def test_docstring_examples_run(module: object) -> None:
    """The Examples sections of the public modules are correct doctests."""
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert result.failed == 0


@settings(max_examples=200)
@given(st.lists(st.text(min_size=0, max_size=6), min_size=1, max_size=4))
def test_accepted_relpaths_never_escape_the_root(parts: list[str]) -> None:
    """Any relpath full_path accepts resolves to a path strictly inside the root."""
    root = StorageRoot(pafs.LocalFileSystem(), "/base/root")
    relpath = "/".join(parts)
    try:
        full = root.full_path(relpath)
    except InvalidPathError:
        return
    if relpath:
        assert os.path.normpath(full).startswith("/base/root/")
        assert os.path.normpath(full) == full


@pytest.mark.seaweedfs
def test_faulty_fs_wraps_s3_too(seaweed: SeaweedCluster, seaweed_uri: str) -> None:
    """Through FaultyFS over SeaweedFS, a failed manifest write leaves the manifest absent, not partial."""
    faulty = FaultyFS(seaweed.filesystem(), fail_on_nth_write=2)
    base = seaweed_uri.removeprefix("s3://")
    root = StorageRoot(pafs.PyFileSystem(faulty), base)
    assert not root.atomic_rename
    root.write_atomic("ck/manifest.json", b"one")
    with pytest.raises(StorageIOError):
        root.write_atomic("ck/manifest.json", b"two")
    # pyarrow cannot abort an S3 upload, so the failed manifest is removed: absent, never partial
    assert not root.exists("ck/manifest.json")


@pytest.mark.seaweedfs
def test_cluster_start_retries_after_losing_a_port_race(monkeypatch: pytest.MonkeyPatch) -> None:
    """If a chosen port is taken before the server binds it, start retries with new ports."""
    real_free_port = ioservice.testing._free_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        busy = [int(squatter.getsockname()[1])]
        monkeypatch.setattr(ioservice.testing, "_free_port",
                            lambda: busy.pop() if busy else real_free_port())
        with SeaweedCluster() as cluster:
            assert cluster.master is not None and cluster.master.port != squatter.getsockname()[1]
            cluster.create_bucket("race")


def test_listing_a_directory_that_appears_meanwhile_never_fails(tmp_path: Any) -> None:
    """pyarrow's local listing with ``allow_not_found`` raises ENOENT when the directory is
    created between its failed listing and its existence check (a concurrent fencing
    claimer creating the claims' directory hit this in a loaded CI run; about 3 in 1000
    raw listings fail under this churn): `list_dir` lists again."""
    root = open_root(str(tmp_path))
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            os.mkdir(tmp_path / "d")
            os.rmdir(tmp_path / "d")

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        for _ in range(5000):
            assert root.list_dir("d", allow_not_found=True) == []
    finally:
        stop.set()
        t.join()
