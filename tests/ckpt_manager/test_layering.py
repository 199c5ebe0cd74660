"""The layering of `ckpt_manager`'s sub-packages, read from the source with `ast`.

Every import counts (module level, inside functions, under TYPE_CHECKING) for which parts may
depend on which; only module-level imports count for torch, because those run whenever the
module is imported (a function-level import runs only on the path that needs it).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from tests.support.imports import all_imports, is_package, module_level_imports, parse_package

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "ckpt_manager"

# Which parts each part may import. A part is a sub-package (`_store`, `ctl`, ...) or a root
# module (`errors`, `_manager`, ...). `_format` (what the bytes mean) imports no sibling;
# `_store` (where bytes go) only `_format`; `_load` does not depend on `_save`; nothing but the
# CLI itself imports `ctl`.
_ROOT_BASICS = {"errors", "_types"}
_BYTES = {"_format", "_store"}
ALLOWED: dict[str, set[str]] = {
    "_format": _ROOT_BASICS,
    "_store": _ROOT_BASICS | {"_format"},
    "_retention": _ROOT_BASICS | _BYTES,
    "_load": _ROOT_BASICS | _BYTES | {"_coord"},
    "_save": _ROOT_BASICS | _BYTES | {"_coord", "_config", "_memory"},
    # The memory tier: slot files, metas, the agreement and the local load. No storage.
    "_memory": _ROOT_BASICS | {"_format", "_coord", "_config"},
    "ctl": _ROOT_BASICS | _BYTES | {"_load", "_save", "_retention"},
    "errors": set(),
    "_types": set(),
    "_coord": {"errors"},
    # The config validates against the format and storage limits (the spread of object names,
    # which roots are S3); `_store` imports no sibling, so this adds no cycle.
    "_config": {"_retention", "_format", "_store"},
    "dcp": _ROOT_BASICS | _BYTES | {"_load"},
    # The public face of the retention registry's configuration keys (for trainingd's config).
    "retention": {"_retention"},
    # The public face of the memory tier's slot files (for trainingd's peer replicas).
    "memory_slots": {"_memory"},
    # Opening the durable root (lease, retention record, dead attempts), now or in the background.
    "_root": _ROOT_BASICS | _BYTES | {"_retention", "_config"},
    "_manager": _ROOT_BASICS
    | _BYTES
    | {"_load", "_save", "_memory", "_retention", "_coord", "_config", "_root"},
    "__init__": _ROOT_BASICS | {"_retention", "_config", "_manager", "_store"},
}
SUBPACKAGES = {"_format", "_store", "_retention", "_load", "_save", "_memory", "ctl"}

# Modules of `_format`, `_store` and `ctl` that make tensors and so may import torch when imported.
# Everything else there stays torch-free, so `ckptctl list/show/verify` start fast.
TORCH_ALLOWED = {
    "ckpt_manager._format.dtensor",
    "ckpt_manager._format.shard_file",
    "ckpt_manager._format.tree",
    "ckpt_manager.ctl.export",
    "ckpt_manager.ctl.export_dcp",
    "ckpt_manager.ctl.export_sharded",
    "ckpt_manager.ctl.reshard",
    "ckpt_manager.ctl.restore",
    "ckpt_manager.ctl.stream",
}


def _part(module: str) -> str:
    """The layering unit of a module inside ckpt_manager (`ckpt_manager` itself: `__init__`)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _modules() -> dict[str, ast.Module]:
    return parse_package(PACKAGE)


def _is_package(module: str) -> bool:
    return is_package(module, PACKAGE.parent)


def layering_violations(modules: dict[str, ast.Module]) -> list[str]:
    """Each import that crosses the allowed edges, as `importer -> imported (part)`."""
    problems = []
    for module, tree in modules.items():
        part = _part(module)
        allowed = ALLOWED.get(part)
        if allowed is None:
            problems.append(f"{module}: part {part!r} has no layering rule; add it to ALLOWED")
            continue
        for name in sorted(all_imports(tree, module, is_package=_is_package(module))):
            if not name.startswith("ckpt_manager.") or name not in modules:
                continue
            other = _part(name)
            if other != part and other not in allowed:
                problems.append(f"{module} -> {name} ({part} may not import {other})")
    return problems


def torch_violations(modules: dict[str, ast.Module]) -> list[str]:
    """Torch-free `_format` / `_store` / `ctl` modules whose import (transitively) loads torch."""
    edges = {m: module_level_imports(t, m, is_package=_is_package(m)) for m, t in modules.items()}

    def closure(start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for name in edges[todo.pop()]:
                # Importing a submodule runs its package's __init__ too.
                parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)]
                for dep in parents:
                    if dep in modules and dep not in seen:
                        seen.add(dep)
                        todo.append(dep)
        return seen

    problems = []
    for module in modules:
        if _part(module) not in {"_format", "_store", "ctl"} or module in TORCH_ALLOWED:
            continue
        for dep in sorted(closure(module)):
            if any(n == "torch" or n.startswith("torch.") for n in edges[dep]):
                problems.append(f"{module} loads torch through {dep}")
                break
    return problems


def test_every_part_has_a_rule_and_the_subpackages_exist() -> None:
    modules = _modules()
    parts = {_part(m) for m in modules}
    assert parts <= set(ALLOWED), parts - set(ALLOWED)
    assert parts >= SUBPACKAGES


def test_imports_follow_the_layering() -> None:
    assert layering_violations(_modules()) == []


def test_store_and_cli_import_torch_only_where_they_make_tensors() -> None:
    assert torch_violations(_modules()) == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "ckpt_manager._store.pins",
            "from ckpt_manager._save.commit import x\n",
            "ckpt_manager._store.pins -> ckpt_manager._save.commit (_store may not import _save)",
        ),
        (
            "ckpt_manager._manager",
            "def f():\n    from ckpt_manager.ctl import cli\n",
            "ckpt_manager._manager -> ckpt_manager.ctl.cli (_manager may not import ctl)",
        ),
        (
            "ckpt_manager._format.manifest",
            "from ckpt_manager._store.storage import Storage\n",
            "ckpt_manager._format.manifest -> ckpt_manager._store.storage "
            "(_format may not import _store)",
        ),
        (
            "ckpt_manager._load.restore",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from ckpt_manager._save import request\n",
            "ckpt_manager._load.restore -> ckpt_manager._save.request (_load may not import _save)",
        ),
    ],
)
def test_a_forbidden_import_is_reported(module: str, source: str, expected: str) -> None:
    modules = _modules()
    modules[module] = ast.parse(source)
    assert expected in layering_violations(modules)


def test_a_torch_import_in_a_torch_free_module_is_reported() -> None:
    modules = _modules()
    modules["ckpt_manager._store.pins"] = ast.parse(
        "from ckpt_manager._format.manifest import step_dir\n"
    )
    modules["ckpt_manager._format.manifest"] = ast.parse("import torch.nn\n")
    problems = torch_violations(modules)
    assert "ckpt_manager._store.pins loads torch through ckpt_manager._format.manifest" in problems
    # Function-level imports do not count: they run only on the path that needs tensors.
    modules["ckpt_manager._format.manifest"] = ast.parse("def f():\n    import torch\n")
    assert torch_violations(modules) == []


def _tree_block(text: str) -> list[str]:
    """The `ckpt_manager/` tree: its lines, dedented, up to the first blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "ckpt_manager/")
    indent = len(lines[start]) - len(lines[start].lstrip())
    block = []
    for line in lines[start:]:
        if not line.strip() or line.strip().startswith("```"):
            break
        block.append(line[indent:].rstrip())
    return block


def test_docstring_and_readme_show_the_same_tree_with_every_subpackage() -> None:
    import ckpt_manager

    assert ckpt_manager.__doc__ is not None
    tree = _tree_block(ckpt_manager.__doc__)
    readme = (PACKAGE.parent / "README.md").read_text()
    assert _tree_block(readme) == tree
    listed = {
        line.split()[0].rstrip("/")
        for line in tree[1:]
        if line.startswith("  ") and not line.startswith("   ")
    }
    on_disk = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert on_disk <= listed, f"sub-packages missing from the tree: {on_disk - listed}"
