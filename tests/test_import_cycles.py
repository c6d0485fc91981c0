"""Neither package has an import cycle, counting every import statement.

Each module of ``proxyproto`` and ``tlsedge`` is parsed with `ast`; every
``import`` and ``from ... import`` anywhere in it is an edge of the module
graph: at the top, under ``if TYPE_CHECKING:``, inside a function (a late
import is still a dependency, only a hidden one). A ``from package import
name`` counts as an import of ``package.name`` when that is a module, else of
``package``. Imports of other packages are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("proxyproto", "tlsedge")


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of *packages*."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _imported(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool
) -> list[str]:
    """The dotted names *node* (in *module*) imports, module or not."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        if not is_package:
            anchor = anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base]) if base else ".".join(anchor)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """``{module: the modules of *modules* it imports}``."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = _imported(node, name, is_package)
            if isinstance(node, ast.ImportFrom):
                # "from pkg import x": the submodule pkg.x if there is one.
                submodules = [t for t in targets[1:] if t in modules]
                names_only = len(submodules) < len(targets) - 1
                targets = submodules + ([targets[0]] if names_only else [])
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of *graph* as ``[a, b, ..., a]``, or None if it has none."""
    on_path, done = 1, 2
    state: dict[str, int] = {}
    for start in sorted(graph):
        if start in state:
            continue
        # Depth-first, without recursion: *path* is the chain being explored.
        path = [start]
        state[start] = on_path
        pending = [iter(sorted(graph[start]))]
        while pending:
            successor = next(pending[-1], None)
            if successor is None:
                pending.pop()
                state[path.pop()] = done
                continue
            mark = state.get(successor)
            if mark == on_path:
                return [*path[path.index(successor) :], successor]
            if mark is None:
                state[successor] = on_path
                path.append(successor)
                pending.append(iter(sorted(graph.get(successor, ()))))
    return None


def test_the_packages_have_no_import_cycle() -> None:
    graph = import_graph(module_files(ROOT, PACKAGES))
    assert "tlsedge._control.edge" in graph["tlsedge"]  # the graph is the real one
    assert "proxyproto._tlv" in graph["proxyproto._v2"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


#: tlsedge's layers, bottom first (docs/architecture.md): a module imports
#: from its own layer or the ones below, never from one above.
LAYERS = ("_core", "_http", "_tls", "_reactor", "_backends", "_pipeline", "_control")


def layer_of(module: str) -> int | None:
    """The rank of *module*'s layer in `LAYERS`, None outside them."""
    parts = module.split(".")
    if parts[0] != "tlsedge" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def upward_imports(graph: Mapping[str, set[str]]) -> list[str]:
    """Every import of *graph* that goes from a layer to one above it."""
    found = []
    for module, imported in sorted(graph.items()):
        rank = layer_of(module)
        for target in sorted(imported):
            target_rank = layer_of(target)
            if rank is not None and target_rank is not None and target_rank > rank:
                found.append(f"{module} -> {target}")
    return found


def test_tlsedge_imports_only_go_downward() -> None:
    graph = import_graph(module_files(ROOT, ["tlsedge"]))
    assert {layer_of(m) for m in graph} >= set(range(len(LAYERS)))
    assert upward_imports(graph) == []


def test_an_upward_import_is_found() -> None:
    graph = {
        "tlsedge._core.config": {"tlsedge._control.cli"},
        "tlsedge._control.cli": {"tlsedge._core.config"},
        "tlsedge._version": {"tlsedge._control.cli"},
    }
    assert upward_imports(graph) == ["tlsedge._core.config -> tlsedge._control.cli"]


def test_every_kind_of_import_is_an_edge(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import A\n",
        "a.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n"
        ),
        "b.py": "def f():\n    from pkg import c\n",
        "c.py": "from . import d\nfrom .sub import e\n",
        "d.py": "import pkg.sub.e\nimport os\n",
        "sub/__init__.py": "",
        "sub/e.py": "from .. import a\nfrom pkg import A\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = import_graph(module_files(tmp_path, ["pkg"]))
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.d", "pkg.sub.e"},
        "pkg.d": {"pkg.sub.e"},
        "pkg.sub": set(),
        "pkg.sub.e": {"pkg.a", "pkg"},
    }
    assert find_cycle(graph) == [
        "pkg",
        "pkg.a",
        "pkg.b",
        "pkg.c",
        "pkg.d",
        "pkg.sub.e",
        "pkg",
    ]
    assert find_cycle({**graph, "pkg.sub.e": set()}) is None
