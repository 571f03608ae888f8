"""`mmm.preload_kernels`: every compiled variant numba cached for the current code is loaded
up front, from the cache only (nothing compiled), in a process that never called the kernel.

Each check runs in fresh interpreters sharing one numba cache directory: the first calls a
kernel (writing its cache entry), the second only preloads and reports what it holds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_WRITE = textwrap.dedent("""
    import numpy as np
    from mmm._kernels import pages
    frames = np.zeros((4, 64), np.uint8)
    pages.copy_frames(frames, np.array([0, 1], np.int64), np.array([2, 3], np.int64))
""")

_PRELOAD = textwrap.dedent("""
    import json, os
    import mmm
    from mmm._kernels import pages
    from mmm._kernels import cached_kernels, cached_signatures
    before = len(pages.copy_frames.signatures)
    listed = [str(t) for t in cached_signatures(pages.copy_frames)]
    in_all = sum(1 for k, _ in cached_kernels() if k is pages.copy_frames)
    loaded, kernels = mmm.preload_kernels()
    d = pages.copy_frames
    print(json.dumps({"listed": listed, "in_all": in_all, "before": before, "after": len(d.signatures), "loaded": loaded,
                      "kernels": kernels, "hits": sum(d.stats.cache_hits.values()),
                      "misses": sum(d.stats.cache_misses.values()),
                      "threads": len(os.listdir("/proc/self/task"))}))
""")


def _run(code: str, cache: Path) -> str:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    return out.stdout


def test_preload_loads_cached_variants_without_compiling(tmp_path: Path) -> None:
    cache = tmp_path / "numba-cache"
    cold = json.loads(_run(_PRELOAD, cache))
    assert cold["before"] == 0 and cold["after"] == 0  # nothing cached yet: nothing loaded
    assert cold["misses"] == 0  # ... and nothing compiled
    _run(_WRITE, cache)
    assert any(p.name.startswith("pages.copy_frames") for p in cache.rglob("*.nbi"))
    got = json.loads(_run(_PRELOAD, cache))
    assert got["before"] == 0  # importing mmm loads nothing by itself
    assert got["after"] >= 1  # the variant the other process compiled is in memory
    assert got["hits"] >= 1 and got["misses"] == 0  # from the cache, nothing compiled
    assert got["loaded"] >= got["after"] and got["kernels"] > 20
    assert got["loaded"] > cold["loaded"]
    assert cold["listed"] == [] and cold["in_all"] == 0
    assert len(got["listed"]) == 1 and got["listed"][0].startswith("(Array(uint8, 2")  # the variant written
    assert got["in_all"] == 1
    assert got["before"] == 0  # listing the cache loaded nothing


_WRITE_INT32 = textwrap.dedent("""
    import numpy as np
    from mmm._kernels import pages
    frames = np.zeros((4, 64), np.uint8)
    pages.copy_frames(frames, np.array([0, 1], np.int32), np.array([2, 3], np.int32))
""")

_PRELOAD_ONE = textwrap.dedent("""
    import json
    import mmm
    from mmm._kernels import cached_signatures, pages
    listed = [str(t) for t in cached_signatures(pages.copy_frames)]
    mmm.preload_kernels(max_per_kernel=1)
    print(json.dumps({"listed": listed,
                      "loaded": [str(t) for t in pages.copy_frames.signatures]}))
""")


def test_preload_with_a_bound_loads_each_kernels_newest_variants(tmp_path: Path) -> None:
    cache = tmp_path / "numba-cache"
    _run(_WRITE, cache)
    _run(_WRITE_INT32, cache)  # written later: the newer variant
    got = json.loads(_run(_PRELOAD_ONE, cache))
    assert len(got["listed"]) == 2 and "int32" in got["listed"][0]  # newest first
    assert "int32" not in got["listed"][1]
    assert got["loaded"] == got["listed"][:1]  # only the newest one is in memory


def test_preload_bound_must_not_be_negative() -> None:
    import pytest

    from mmm._kernels import cached_kernels
    with pytest.raises(ValueError, match="max_per_kernel"):
        cached_kernels(-1)
