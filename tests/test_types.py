"""The public packages type-check under ``mypy --strict`` (STYLE.md §3)."""
import os
import subprocess
import sys

import pytest


def test_packages_pass_mypy_strict():
    """mmm, ioservice, peace and sguard have no mypy --strict errors."""
    pytest.importorskip("mypy", reason="mypy is installed by the test extras")
    # the source tree: $SGUARD_REPO when the suite runs on a copy of tests/ against the
    # installed wheel (scripts/test.sh), else this file's checkout
    root = os.environ.get("SGUARD_REPO") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--ignore-missing-imports",
         "--cache-dir", os.path.join(root, ".mypy_cache"), "mmm", "ioservice", "peace", "sguard"],
        cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
