"""Running a kernel module as a file never poisons numba's on-disk cache for its import."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import sguard.partitioning


def test_doctest_as_file_then_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkgx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    shutil.copy(sguard.partitioning.__file__, pkg / "partitioning.py")
    run = subprocess.run([sys.executable, "-m", "doctest", "pkgx/partitioning.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    code = ("import numpy as np, pyarrow as pa, pkgx.partitioning as p, sguard.partitioning as s;"
            "k = pa.array(np.arange(-50, 50, dtype=np.int64));"
            "assert (p.partition_of(k, 7) == s.partition_of(k, 7)).all();"
            "print(len(p.partition_of(k, 7)))")
    for _ in range(2):  # a second import loads whatever the first one cached
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0 and run.stdout.strip() == "100", run.stdout + run.stderr
