"""Every import arrow runs one way: no cycles between modules, and the house direction.

The graph is drawn from the source with ``ast`` (nothing is imported): every
``import`` and ``from ... import`` anywhere in a module -- at the top, inside a
function, under ``if TYPE_CHECKING:`` -- is an arrow from that module to the
module it names (relative imports resolved; ``from pkg import name`` points at
``pkg.name`` when that is a module, else at ``pkg``). The house direction:
``sguard`` may import ``ioservice``, ``mmm`` and ``peace``; ``ioservice`` only
``mmm``; ``mmm`` and ``peace`` none of the others.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import networkx as nx

PACKAGES = ("mmm", "ioservice", "peace", "sguard")
ALLOWED: dict[str, frozenset[str]] = {
    "sguard": frozenset({"ioservice", "mmm", "peace"}),
    "ioservice": frozenset({"mmm"}),
    "mmm": frozenset(),
    "peace": frozenset(),
}
ROOT = Path(os.environ.get("SGUARD_REPO") or Path(__file__).resolve().parent.parent)


def _module_name(path: Path) -> tuple[str, bool]:
    """Dotted name of a source file under ROOT, and whether it is a package ``__init__``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _known(name: str, modules: set[str]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (None: outside the packages)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _targets(node: ast.Import | ast.ImportFrom, me: str, is_pkg: bool,
             modules: set[str]) -> list[str]:
    """The modules of our packages one import statement names."""
    if isinstance(node, ast.Import):
        return [t for a in node.names if (t := _known(a.name, modules)) is not None]
    if node.level:
        base = me.split(".") if is_pkg else me.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{module}.{alias.name}"
        target = sub if sub in modules else _known(module, modules)
        if target is not None:
            out.append(target)
    return out


def import_graph() -> nx.DiGraph:
    """Module -> imported module, for every module of the four packages."""
    files = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            files[path] = _module_name(path)
    modules = {name for name, _ in files.values()}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for path, (me, is_pkg) in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, me, is_pkg, modules):
                    if target != me:
                        g.add_edge(me, target, line=f"{path.relative_to(ROOT)}:{node.lineno}")
    return g


def test_the_graph_sees_known_arrows() -> None:
    """The walker finds top-level, relative-free and function-level imports it must see."""
    g = import_graph()
    assert len(g) > 60
    assert g.has_edge("sguard.scheduling", "peace.service")       # top level
    assert g.has_edge("peace.coordinator", "peace.model")          # from-import
    assert g.has_edge("sguard.spark.rescaling", "sguard.rescale")  # inside a function


def test_no_import_cycles() -> None:
    """No module imports one that (directly or through others) imports it back."""
    g = import_graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    described = []
    for comp in cycles:
        sub = g.subgraph(comp)
        cycle = nx.find_cycle(sub)
        described.append(" -> ".join(f"{u} ({sub.edges[u, v]['line']})" for u, v in cycle))
    assert not cycles, "import cycles:\n" + "\n".join(described)


def test_arrows_follow_the_house_direction() -> None:
    """sguard -> ioservice -> mmm; peace imports none of them; nothing imports sguard."""
    g = import_graph()
    bad = [f"{u} -> {v} ({d['line']})" for u, v, d in g.edges(data=True)
           if u.split(".")[0] != v.split(".")[0]
           and v.split(".")[0] not in ALLOWED[u.split(".")[0]]]
    assert not bad, "imports against the house direction:\n" + "\n".join(bad)
