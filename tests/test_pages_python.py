"""Every ```python block of the README and the guides (docs/*.md) runs without error on the
package under test, one test each (the pages and their blocks as tests/test_readme.py reads
them; that file runs their bash blocks). A file of its own, so that under pytest-xdist's
``--dist loadfile`` these blocks run on another worker than the bash blocks."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import blocks, page_text, python_items

_PYTHON_RAN: set[str] = set()


@pytest.mark.parametrize(("page", "index"), [pytest.param(p, i, id=f"{p}:python{i}")
                                             for p, i in python_items()])
def test_page_python_block(page: str, index: int, tmp_path: Path) -> None:
    """Each ```python block of a page runs without error on the package under test
    (a block identical to one already run is not run again)."""
    body = blocks(page_text(page), "python")[index - 1]
    if body in _PYTHON_RAN:
        return
    out = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"{page}: python block {index} failed:\n{body}\n{out.stderr[-3000:]}"
    _PYTHON_RAN.add(body)
