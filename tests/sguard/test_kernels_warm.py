"""``sguard kernels warm``: the packaged variants resolve, a warm-up compiles into numba's disk
cache what a later process then only loads, and bad input is refused before any work."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmm import compile_kernel_variants
from mmm._kernels import find_kernel, parse_variant, variant_text
from sguard.kernels import VARIANTS_FILE, read_variants

KERNEL = "sguard.partitioning._mix_k1"   # small: compiles in well under a second
VARIANT = "(uint64,)"


def _sguard(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sguard", "kernels", "warm", *args],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, NUMBA_CACHE_DIR=str(cache)))


def _variants_file(tmp_path: Path, kernels: dict[str, list[str]]) -> Path:
    f = tmp_path / "variants.json"
    f.write_text(json.dumps({"format": 1, "kernels": kernels}))
    return f


def test_the_packaged_variants_name_existing_kernels_and_parse() -> None:
    """Every kernel the packaged file names exists, and every variant parses back to the
    text it was written as (a stale file fails here, not in a deployment's warm-up)."""
    variants = read_variants(VARIANTS_FILE)
    assert sum(map(len, variants.values())) >= 50
    for name, texts in variants.items():
        kernel = find_kernel(name)
        assert kernel.py_func.__name__ == name.rsplit(".", 1)[1]
        for text in texts:
            assert variant_text(parse_variant(text)) == text


def test_a_warm_up_compiles_what_a_later_process_only_loads(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    f = _variants_file(tmp_path, {KERNEL: [VARIANT]})
    first = _sguard("--variants", str(f), "--jobs", "1", cache=cache)
    assert first.returncode == 0, first.stderr
    assert "1 of 1 variants of 1 kernels ready (1 compiled, 0 already cached)" in first.stdout
    assert first.stdout.count("\n") == 1 and first.stderr == ""
    again = _sguard("--variants", str(f), "--jobs", "2", cache=cache)
    assert again.returncode == 0 and "(0 compiled, 1 already cached)" in again.stdout
    # a fresh process calling the kernel loads it from the cache: no compilation
    code = ("import numpy as np, sguard.partitioning as p;"
            "p._mix_k1(np.uint64(7));"
            "s = p._mix_k1.stats; print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, NUMBA_CACHE_DIR=str(cache)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0"]


def test_a_failed_variant_is_named_and_the_others_still_compile(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    f = _variants_file(tmp_path, {KERNEL: [VARIANT, "(unicode_type,)"],
                                  "mmm._kernels.pages.no_such_kernel": [VARIANT]})
    out = _sguard("--variants", str(f), cache=cache)
    assert out.returncode == 1
    assert "1 of 3 variants of 2 kernels ready (1 compiled" in out.stdout
    err = out.stderr.strip().splitlines()
    assert len(err) == 2
    assert any("no_such_kernel" in line and "no kernel named" in line for line in err)
    assert any(line.startswith(f"sguard kernels warm: {KERNEL} (unicode_type,): TypingError") for line in err)


@pytest.mark.parametrize(("args", "says"), [
    (["--jobs", "0"], "--jobs"),
    (["--variants", "/nonexistent/variants.json"], "cannot read kernel variants file"),
    (["--variants", "{bad}"], "is not"),
])
def test_bad_arguments_are_one_line_and_compile_nothing(tmp_path: Path, args: list[str],
                                                       says: str) -> None:
    if "{bad}" in args:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"format": 2, "kernels": {}}))
        args = [str(bad) if a == "{bad}" else a for a in args]
    cache = tmp_path / "cache"
    out = _sguard(*args, cache=cache)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and says in out.stderr, out.stderr
    assert not cache.exists() or not any(cache.rglob("*.nbc"))


@pytest.mark.parametrize("text", ["__import__('os').system('true')", "(int64, foo)",
                                  "(Literal[int]('x'),)", "int64", "(numba.int64,)",
                                  "(Array(*x),)", "(open('f'),)", "(int64,"])
def test_a_variant_text_is_read_without_evaluating_code(text: str) -> None:
    with pytest.raises(ValueError, match="kernel variant"):
        parse_variant(text)


def test_literal_and_array_variants_round_trip() -> None:
    text = ("(Array(float32, 2, 'A', False, aligned=True), int64, Literal[int](0), "
            "Literal[bool](False), UniTuple(int64, 5), bool)")
    assert variant_text(parse_variant(text)) == text


def test_compile_report_counts_each_outcome() -> None:
    r = compile_kernel_variants({KERNEL: [VARIANT, "(int64, foo)"]})
    assert r.compiled + r.cached == 1
    assert [(n, t) for n, t, _ in r.failed] == [(KERNEL, "(int64, foo)")]
