"""Shared pytest configuration: Hypothesis profiles and the one SparkSession."""
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", deadline=None, max_examples=500, stateful_step_count=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

#: JVM options of every Spark driver and executor the suite starts (this process's and, through
#: the environment, its subprocesses' and the pages' commands'): the tests' Spark jobs are short
#: and small, so the JIT's optimizing tier (C2) and G1's concurrent threads cost more CPU than
#: they return (measured: the README's first query took ~25% less wall and CPU time with them
#: off, on 2 cores). A PYSPARK_SUBMIT_ARGS already set wins.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def _submit_args(jvm_options: str) -> str:
    return (f"--driver-java-options '{jvm_options}' "
            f"--conf 'spark.executor.extraJavaOptions={jvm_options}' pyspark-shell")


_OWN_SUBMIT_ARGS = "PYSPARK_SUBMIT_ARGS" not in os.environ
os.environ.setdefault("PYSPARK_SUBMIT_ARGS", _submit_args(TEST_JVM_OPTIONS))


def _use_jvm_archive() -> None:
    """Give the suite's JVMs the class-data-sharing archive of `tests.jvm_archive` when one
    was recorded for these options (scripts/test.sh records it beside the kernel warm-up;
    it saves ~5 s of every JVM's start). Runs before pytest-xdist starts its workers, which
    inherit the environment. ``SGUARD_TEST_JVM_ARCHIVE=0`` turns it off; a
    PYSPARK_SUBMIT_ARGS of the caller's is left alone."""
    if not _OWN_SUBMIT_ARGS or os.environ.get("SGUARD_TEST_JVM_ARCHIVE") == "0":
        return
    from tests.jvm_archive import ensure, jvm_options_with
    archive = ensure(TEST_JVM_OPTIONS, record=False)
    os.environ["PYSPARK_SUBMIT_ARGS"] = _submit_args(jvm_options_with(archive,
                                                                      TEST_JVM_OPTIONS))


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local SparkSession per test process (``local[2,4]``: two cores, a failed task is
    retried up to 4 times), shared by every test that needs one. Tests never stop it: under
    pytest-xdist a worker runs files of several directories, and ``getOrCreate`` anywhere
    returns this very session."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from sguard.spark import local_session
    s = local_session("local[2,4]", "sguard-tests", shuffle_partitions=2)
    try:
        yield s
    finally:
        s.stop()


#: The files that take longest (summed test times of a full run, 2026-11-28), longest first.
#: scripts/test.sh hands whole files to the pytest-xdist workers in collection order
#: (``--dist loadfile --no-loadscope-reorder``); starting with these keeps a long file from
#: starting last and running alone while the other worker idles (xdist's own order, by
#: number of tests per file, left the few-test process-killing files for the end). The other
#: files follow in their usual order; a file missing from this list only runs later.
LONGEST_FIRST: tuple[str, ...] = (
    "tests/test_readme.py",
    "tests/spark/test_rescale_spark.py",
    "tests/test_pages_python.py",
    "tests/spark/test_processes.py",
    "tests/spark/test_keys.py",
    "tests/spark/test_processors.py",
    "tests/sguard/test_convert.py",
    "tests/spark/test_keygroups_spark.py",
    "tests/peace/test_notebook_cli.py",
    "tests/spark/test_fencing.py",
    "tests/ioservice/test_kill.py",
    "tests/test_types.py",
    "tests/spark/test_processors_failures.py",
    "tests/spark/test_speculation.py",
    "tests/ioservice/test_background_io.py",
    "tests/spark/test_keys_spark.py",
    "tests/spark/test_exactly_once.py",
    "tests/sguard/test_demo.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move the tests of `LONGEST_FIRST`'s files to the front, in its order (a stable sort:
    the tests of a file, and the other files, keep their order)."""
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


#: Where partitions keep their live state when a query names no ``local_dir``
#: (`sguard.spark.placement.default_local_dir`): the pages' examples and some tests leave it
#: there, as a user's stopped query does (its next start re-attaches it).
def _live_state_roots() -> list[str]:
    import tempfile
    uid = os.getuid()
    return [f"/dev/shm/sguard-{uid}", os.path.join(tempfile.gettempdir(), f"sguard-{uid}")]


_LIVE_BEFORE = pytest.StashKey[dict[str, set[str] | None]]()


def _entries(root: str) -> set[str]:
    try:
        return set(os.listdir(root))
    except OSError:
        return set()


def _is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")  # pytest-xdist's workers have it


def pytest_configure(config: pytest.Config) -> None:
    if _is_controller(config):
        _use_jvm_archive()
        config.stash[_LIVE_BEFORE] = {r: _entries(r) if os.path.isdir(r) else None
                                      for r in _live_state_roots()}


def pytest_unconfigure(config: pytest.Config) -> None:
    """Once every worker is done, remove the live state the run left under the default
    roots (the entries that were not there when it started; /dev/shm is memory, and a
    machine that runs the suite again and again would fill it). Nothing else is touched."""
    before = config.stash.get(_LIVE_BEFORE, None) if _is_controller(config) else None
    if before is None:
        return
    import shutil
    for root, had in before.items():
        for name in sorted(_entries(root) - (had or set())):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        if had is None and not _entries(root):
            try:
                os.rmdir(root)
            except OSError:
                pass

