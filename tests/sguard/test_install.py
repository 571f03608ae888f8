"""The packaging: every package directory ships, and the suite tests the installed wheel.

``scripts/test.sh`` (the README's test command and CI's) installs the built
wheel into a fresh venv and runs a copy of ``tests/`` outside the checkout with
``SGUARD_TEST_INSTALLED=1`` and ``SGUARD_REPO`` (the checkout). Under it, the
tests here check that the code under test is the installed one and that the
wheel holds exactly the source modules. A plain ``pytest`` in the checkout runs
the source-tree checks only.
"""
from __future__ import annotations

import importlib
import os
import sysconfig
from pathlib import Path

import pytest

PACKAGES = ("mmm", "ioservice", "peace", "sguard")
INSTALLED = os.environ.get("SGUARD_TEST_INSTALLED") == "1"


def source_root() -> Path:
    """The checkout: ``$SGUARD_REPO``, else the directory above ``tests/``."""
    env = os.environ.get("SGUARD_REPO")
    root = Path(env) if env else Path(__file__).resolve().parents[2]
    assert (root / "pyproject.toml").is_file(), f"no checkout at {root} (set SGUARD_REPO)"
    return root


def _modules(base: Path) -> set[str]:
    return {p.relative_to(base).as_posix() for pkg in PACKAGES for p in (base / pkg).rglob("*.py")
            if "__pycache__" not in p.parts}


def test_every_directory_with_modules_is_a_package() -> None:
    """Each source directory holding .py files has an __init__.py (else a wheel drops it).

    `mmm/structures/` once had none: `pip install .` left it out and `import mmm` failed.
    """
    root = source_root()
    for pkg in PACKAGES:
        for d in {p.parent for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts}:
            assert (d / "__init__.py").is_file(), f"{d.relative_to(root)} has no __init__.py"


@pytest.mark.skipif(not INSTALLED, reason="runs under scripts/test.sh (the installed wheel)")
def test_code_under_test_is_the_installed_wheel_not_the_checkout() -> None:
    """mmm, ioservice, peace and sguard (and subpackages) import from site-packages."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    repo = source_root().resolve()
    for name in (*PACKAGES, "mmm.structures", "sguard.cli"):
        f = Path(importlib.import_module(name).__file__ or "").resolve()
        assert site in f.parents, f"{name} imported from {f}, not from {site}"
        top = name.split(".")[0]
        assert not f.is_relative_to(repo / top), f"{name} imported from the checkout {repo}"


@pytest.mark.skipif(not INSTALLED, reason="runs under scripts/test.sh (the installed wheel)")
def test_wheel_holds_exactly_the_source_modules() -> None:
    """Every source module is installed, and nothing else (no stale build leftovers)."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    source, installed = _modules(source_root()), _modules(site)
    assert source - installed == set(), "missing from the wheel"
    assert installed - source == set(), "in the wheel but not in the source"
