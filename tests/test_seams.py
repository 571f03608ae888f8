"""Packages meet at public names only.

A static (ast) scan of every module of sguard/, ioservice/ and bench/: none may
import from a private module (``mmm._kernels``) of another project package, nor
read a private attribute (``obj._name``, ``getattr(obj, "_name")``), import a
private name, pass a private keyword or override a private method that belongs
to *another* project package (mmm, ioservice, peace, sguard). A name counts as
another package's when that package defines it privately (a ``def _name``, a
``self._name = ...``, a class-level ``_name``, a module-level ``_NAME``, a
``_param``) and the scanned module's own package does not: private names of
the module's own package, of ``self``/``cls``/``super()`` and of third-party
libraries are not the subject here. What remains must be listed in `ALLOWED`
with the reason it cannot be a public seam yet; a listed entry that no longer
occurs fails too, so the list only shrinks.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

# the source tree: $SGUARD_REPO when the suite runs on a copy of tests/ against the installed
# wheel (scripts/test.sh), else this file's checkout
ROOT = Path(os.environ.get("SGUARD_REPO") or Path(__file__).resolve().parent.parent)
PROJECT = ("mmm", "ioservice", "peace", "sguard")
SCANNED = ("sguard", "ioservice", "bench")

#: (module path, what) -> why it is not a public seam
ALLOWED: dict[tuple[str, str], str] = {}


def _modules(pkg: str) -> list[Path]:
    return sorted(p for p in (ROOT / pkg).rglob("*.py") if ".venv" not in p.parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_defs(pkg: str) -> set[str]:
    """Private names `pkg` defines: methods, functions, classes, attributes, parameters,
    module- and class-level names."""
    names: set[str] = set()
    for path in _modules(pkg):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, (ast.Module, ast.ClassDef)):
                pass
        for node in list(tree.body) + [n for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                                       for n in c.body]:
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if _private(n)}


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


def _scan(path: Path, own: str, foreign: set[str], own_defs: set[str]) -> set[str]:
    """What `path` (a module of package `own`) uses of other project packages' private
    names `foreign`; `own_defs` are the private names of its own package."""
    tree = ast.parse(path.read_text(), str(path))
    imported: dict[str, str] = {}  # local name -> the project package it came from
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.split(".")[0]
            if top in PROJECT and top != own:
                imported.update((a.asname or a.name, top) for a in node.names)
    ambiguous = foreign - own_defs
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _is_self(node.value):
            from_other = isinstance(node.value, ast.Name) and node.value.id in imported
            if node.attr in ambiguous or (from_other and node.attr in foreign):
                found.add(f"read {ast.unparse(node)}")
        elif isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id in ("getattr", "hasattr", "setattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str) and node.args[1].value in ambiguous
                    and not _is_self(node.args[0])):
                found.add(f"read {ast.unparse(node)}")
            for kw in node.keywords:
                if kw.arg is not None and kw.arg in ambiguous:
                    found.add(f"keyword {kw.arg}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.split(".")[0]
            if top in PROJECT and top != own:
                found.update(f"import {node.module}.{a.name}" for a in node.names
                             if _private(a.name))
                if any(_private(part) for part in node.module.split(".")):
                    found.add(f"import from {node.module}")
        elif isinstance(node, ast.Import):
            found.update(f"import {a.name}" for a in node.names
                         if a.name.split(".")[0] in PROJECT and a.name.split(".")[0] != own
                         and any(_private(part) for part in a.name.split(".")))
        elif isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id in imported for b in node.bases):
            for item in node.body:  # a subclass of another package's class
                if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and _private(item.name) and item.name in foreign):
                    found.add(f"override {item.name}")
    return found


def _violations() -> dict[tuple[str, str], None]:
    defs = {pkg: _private_defs(pkg) for pkg in PROJECT}
    out: dict[tuple[str, str], None] = {}
    for pkg in SCANNED:
        foreign = set().union(*(d for p, d in defs.items() if p != pkg))
        own = defs[pkg] if pkg in defs else _private_defs(pkg)
        for path in _modules(pkg):
            for what in _scan(path, pkg, foreign, own):
                out[(path.relative_to(ROOT).as_posix(), what)] = None
    return out


def test_no_module_uses_another_packages_private_names() -> None:
    found = _violations()
    unexpected = sorted(k for k in found if k not in ALLOWED)
    assert not unexpected, ("private names of another package; add a public method to the "
                            f"owning package instead: {unexpected}")


def test_every_allowed_exception_still_occurs() -> None:
    found = _violations()
    stale = sorted(k for k in ALLOWED if k not in found)
    assert not stale, f"no longer needed, remove from ALLOWED: {stale}"


def test_the_scan_catches_each_kind_of_use(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from mmm.pool import _POOL_MAGIC\n"
        "from mmm._kernels import jit\n"
        "import ioservice._checksum\n"
        "from mmm import PagePool\n"
        "class P(PagePool):\n"
        "    def _open_file(self, path): return super()._open_file(path)\n"
        "def f(pm, snap, pool):\n"
        "    pm._flush_structures(); self_ok = snap.frames\n"
        "    getattr(pool, '_raw'); PagePool(1, 2, _attach=True)\n"
        "    return self_ok\n")
    foreign = {"_POOL_MAGIC", "_open_file", "_flush_structures", "_raw", "_attach"}
    assert _scan(src, "sguard", foreign, {"_open_file"}) == {
        "import mmm.pool._POOL_MAGIC", "import from mmm._kernels", "import ioservice._checksum",
        "override _open_file", "read pm._flush_structures",
        "read getattr(pool, '_raw')", "keyword _attach"}
