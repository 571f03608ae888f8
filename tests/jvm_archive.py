"""A class-data-sharing archive of the Spark JVM's classes, for the suite's JVMs.

Every Spark driver and executor the suite starts (some hundred: the SparkSession of each test
process, the drivers of the process-killing tests and the pages' commands, the executors
of ``local-cluster``) loads and verifies the same ~10,000 classes from Spark's jars before
it runs anything. A dynamic CDS archive (JDK 13+, ``-XX:ArchiveClassesAtExit``) holds them
parsed and verified; a JVM started with ``-XX:SharedArchiveFile`` maps it instead. Measured
on 2 cores (2026-11-29, quiet): a local SparkSession plus a first stateful streaming query took
12.2-13.5 s without it and 7.0-7.3 s with it.

`ensure` records the archive (scripts/test.sh calls it beside the kernel warm-up; the
suite's conftest only uses one that exists), by running `PROBE` (a local SparkSession and a small
stateful streaming query) in a JVM that writes it at exit, and keeps it under the temp
directory, keyed by Java, Spark's jars and the JVM options, so that later runs on the same
machine reuse it. A JVM whose classpath or JDK does not match the archive (the JVM checks)
runs without it, as when there is none; the options silence the JVM's CDS warnings.

``python -m tests.jvm_archive`` records it and prints its path (nothing on failure).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: What the recording JVM runs: the classes a stateful query loads (SparkSession, file source,
#: Arrow exchange with the Python workers, the stateful operator, the memory sink).
PROBE = """
import sys, tempfile
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
import sguard.spark as ss
work = tempfile.mkdtemp(dir=sys.argv[1])
pq.write_table(pa.table({"k": np.arange(1000) % 50, "v": np.ones(1000, "int64")}),
               f"{work}/in.parquet")
spark = ss.local_session("local[2]", "sguard-jvm-archive")
df = spark.readStream.schema("k long, v long").parquet(work)
out = ss.stateful(df, key="k", operator=ss.RunningAggregate(value="v"),
                  state_uri=f"file://{work}/state", num_partitions=2, local_dir=f"{work}/live")
q = out.writeStream.format("memory").queryName("q").outputMode("append").start()
q.processAllAvailable()
q.stop()
assert spark.sql("select count(*) from q").collect()[0][0] == 50
jvm = spark.sparkContext._gateway.proc
spark.stop()
jvm.stdin.close()   # the gateway JVM exits at EOF on its stdin, writing the archive first
jvm.wait(120)
"""

#: archives kept under the temp directory (the newest)
KEEP = 3

#: JVM options that keep a JVM quiet about the archive (a mismatch only disables it).
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def _key(jvm_options: str) -> str:
    import pyspark
    jars = Path(pyspark.__file__).parent / "jars"
    h = hashlib.sha256(jvm_options.encode())
    h.update(str(jars).encode())   # the archive records the classpath, and holds for it only
    h.update(os.environ.get("JAVA_HOME", "").encode())
    h.update((shutil.which("java") or "").encode())
    for j in sorted(jars.glob("*.jar")):
        st = j.stat()
        h.update(f"{j.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def ensure(jvm_options: str, record: bool = True, timeout_s: float = 180.0) -> Path | None:
    """The archive for JVMs started with `jvm_options`, recorded first if there is none and
    `record`; None when there is none (not recorded, no PySpark, no Java, the probe
    failed)."""
    try:
        key = _key(jvm_options)
    except (ImportError, OSError):
        return None
    root = Path(tempfile.gettempdir()) / f"sguard-test-jvm-{os.getuid()}"
    path = root / f"spark-{key}.jsa"
    if path.exists() or not record:
        return path if path.exists() else None
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=root))
    part = work / "archive.jsa"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_SUBMIT_ARGS=(
        f"--driver-java-options '{jvm_options} -XX:ArchiveClassesAtExit={part} {QUIET}' "
        "pyspark-shell"))
    try:
        subprocess.run([sys.executable, "-c", PROBE, str(work)], env=env, timeout=timeout_s,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        if part.stat().st_size > 0:
            os.replace(part, path)
            _prune(root, keep=KEEP)
    except (OSError, subprocess.SubprocessError):
        pass
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path if path.exists() else None


def _prune(root: Path, keep: int) -> None:
    """Remove all but the `keep` newest archives of `root` (each ~180 MB; one per checkout
    path and Spark install: a machine that tests many clones would gather them)."""
    made = sorted(root.glob("spark-*.jsa"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in made[keep:]:
        old.unlink(missing_ok=True)


def jvm_options_with(archive: Path | None, jvm_options: str) -> str:
    """`jvm_options` plus what maps `archive` (unchanged without one)."""
    return f"{jvm_options} -XX:SharedArchiveFile={archive} {QUIET}" if archive else jvm_options


if __name__ == "__main__":
    from tests.conftest import TEST_JVM_OPTIONS
    made = ensure(TEST_JVM_OPTIONS)
    if made:
        print(made)
