"""The packages' layering, read from the source: ``checkpoint`` never imports ``elastic``, no two of our modules
import each other (directly or around a circle), the layer under both imports only the standard library, and
the warm forkserver's preloads leave the name ``checkpoint`` free for a training script's own module.

Every import statement counts, wherever it stands: at the top, inside a function, under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.procs import REPO

pytestmark = pytest.mark.timeout(120)

PACKAGES = ("checkpoint", "elastic")
LOWER = "checkpoint._sys"
"""The layer under both packages (checkpoint/_sys/__init__.py says what it holds)."""


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target among our modules."""

    source: str
    """The importing module (dotted)."""
    target: str
    """The imported module of ours, or the first name of a module outside our packages."""
    where: str
    """``path:line`` of the statement."""


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of our packages (a package is its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _ours(name: str) -> str | None:
    """The module of ours that ``import name`` loads last (its longest prefix that is one), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> Iterator[Import]:
    """Every import in ``path``, resolved: ``from package import name`` names the submodule when it is one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, _ours(alias.name) or alias.name.split(".")[0], where)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in MODULES else _ours(base) or base.split(".")[0]
                yield Import(module, target, where)
        elif isinstance(node, ast.Call) and _dynamic_import(node) is not None:
            name = _dynamic_import(node)
            assert name is not None
            yield Import(module, _ours(name) or name.split(".")[0], where)


def _dynamic_import(node: ast.Call) -> str | None:
    """The constant module name of ``importlib.import_module("...")`` or ``__import__("...")``, else None."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if called not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


ALL_IMPORTS = [imp for module, path in MODULES.items() for imp in _imports(module, path)]


def test_the_walk_sees_every_kind_of_import() -> None:
    """The checks below are only as good as the walk: it must see imports inside functions and under
    TYPE_CHECKING, and resolve relative and ``from package import module`` forms."""
    targets = {(i.source, i.target) for i in ALL_IMPORTS}
    assert ("elastic.memory_keeper", "elastic.worker.runfiles") in targets  # inside ``if __package__:``
    assert ("checkpoint.state", "checkpoint._sys.torch_internals") in targets  # relative
    assert ("elastic.cli", "elastic.launcher") in targets  # inside a function
    assert ("elastic.workers", "checkpoint._sys.procutil") in targets  # under TYPE_CHECKING
    assert len(MODULES) > 100


def test_checkpoint_imports_nothing_of_elastic() -> None:
    """``checkpoint`` is a library usable without the launcher: what both need sits in checkpoint/_sys."""
    upward = [f"{i.where}: {i.source} imports {i.target}" for i in ALL_IMPORTS
              if i.source.split(".")[0] == "checkpoint" and i.target.split(".")[0] == "elastic"]
    assert not upward, "checkpoint/ must not import elastic/:\n" + "\n".join(upward)


def test_the_layer_under_both_packages_imports_only_the_standard_library() -> None:
    """checkpoint/_sys stands under both packages, and its files are also loaded by path where neither is
    importable (the worker exec shim, the memory tier's keeper)."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = [f"{i.where}: {i.target}" for i in ALL_IMPORTS if i.source.startswith(LOWER)
           and not i.target.startswith(f"{LOWER}.") and i.target not in stdlib]
    assert not bad, "checkpoint/_sys imports beyond the standard library:\n" + "\n".join(bad)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_circles_are_found() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_our_modules() -> None:
    """Each module stands above what it imports: no circle, however long, whatever hides it."""
    edges: dict[str, set[str]] = {module: set() for module in MODULES}
    seen: dict[tuple[str, str], str] = {}
    for i in ALL_IMPORTS:
        if i.target in MODULES and i.target != i.source:
            edges[i.source].add(i.target)
            seen.setdefault((i.source, i.target), i.where)
    circles = _circles(edges)
    described = [", ".join(c) + "\n    " + "\n    ".join(
        f"{seen[(a, b)]}: {a} -> {b}" for a in c for b in sorted(edges[a]) if b in c) for c in circles]
    assert not circles, "import circles:\n" + "\n".join(described)


def test_the_warm_forkserver_preloads_leave_the_name_checkpoint_free() -> None:
    """A training script's own ``checkpoint`` module must be what it imports in a warm worker, as under
    torchrun: nothing the forkserver preloads may import spotrun's ``checkpoint`` package."""
    code = ("import json, sys\nfrom elastic.warm import DEFAULT_PRELOAD\nfor name in DEFAULT_PRELOAD:\n"
            "    __import__(name)\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'checkpoint')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=100,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
