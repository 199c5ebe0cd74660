"""The sharding modules import each other without cycles.

Every import counts, wherever it is written: at module top, under `if TYPE_CHECKING:` and
inside functions. A lazy or type-only import hides a cycle from the interpreter but not from
the reader, who still has to hold both modules in mind to follow either.
"""

from __future__ import annotations

import ast
import itertools
import pathlib

PACKAGE = "sharding"
ROOT = pathlib.Path(__file__).resolve().parents[2] / PACKAGE


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The sharding module that importing `name` runs, or None when it is not ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(path: pathlib.Path, root: pathlib.Path, modules: set[str]) -> set[str]:
    """Modules of `modules` that `path` imports anywhere (top, TYPE_CHECKING, functions)."""
    this = _module_name(path, root)
    # The package a relative import starts from: the module's parent, or itself for __init__.
    anchor = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = anchor.split(".")
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            # `from sharding import _stats` runs the submodule `sharding._stats`; a name that
            # is no module (`from sharding._stats import X`) resolves to the module holding it.
            targets = [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            module = _resolve(target, modules)
            if module is not None and module != this:
                found.add(module)
    return found


def _graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """`{module: modules of the same package it imports}` for the package at `root`."""
    paths = sorted(root.rglob("*.py"))
    modules = {_module_name(p, root) for p in paths}
    return {_module_name(p, root): _imports(p, root, modules) for p in paths}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path `[a, b, ..., a]`, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: fully explored
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_sees_every_kind_of_import(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.top import X\n",
        "top.py": "import os\nimport pkg.sub.deep as d\n",
        "lazy.py": "def f():\n    from pkg import top, typed\n    return top, typed\n",
        "typed.py": "import typing\nif typing.TYPE_CHECKING:\n    from .lazy import f\n",
        "sub/__init__.py": "",
        "sub/deep.py": "from .. import typed\nfrom . import other\n",
        "sub/other.py": "from ..top import X\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert _graph(pkg) == {
        "pkg": {"pkg.top"},
        "pkg.top": {"pkg.sub.deep"},
        "pkg.lazy": {"pkg.top", "pkg.typed"},
        "pkg.typed": {"pkg.lazy"},
        "pkg.sub": set(),
        "pkg.sub.deep": {"pkg.typed", "pkg.sub.other"},
        "pkg.sub.other": {"pkg.top"},
    }
    graph = _graph(pkg)
    cycle = _find_cycle(graph)
    assert cycle is not None
    assert cycle[0] == cycle[-1]
    assert all(b in graph[a] for a, b in itertools.pairwise(cycle))
    # Break the cycles through the type-only import and through the relative imports.
    graph["pkg.typed"].discard("pkg.lazy")
    graph["pkg.sub.other"].discard("pkg.top")
    assert _find_cycle(graph) is None


def test_the_real_graph_is_read() -> None:
    graph = _graph()
    assert "sharding._engine" in graph["sharding._optimizer"]
    assert "sharding._optimizer" in graph["sharding"]


def test_finder_reports_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_sharding_modules_have_no_import_cycle() -> None:
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle among sharding modules: " + " -> ".join(cycle or [])
