"""The public packages type-check under ``mypy --strict`` (STYLE.md §3)."""
import os
import subprocess
import sys

import pytest


def test_packages_pass_mypy_strict():
    """mmm, ioservice, peace and sguard have no mypy --strict errors."""
    pytest.importorskip("mypy", reason="mypy is installed by the test extras")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--ignore-missing-imports",
         "--cache-dir", os.path.join(root, ".mypy_cache"), "mmm", "ioservice", "peace", "sguard"],
        cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
