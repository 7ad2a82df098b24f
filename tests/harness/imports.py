"""Our packages' import statements, read from the source (standard library only).

Every import statement counts, wherever it stands: at the top, inside a function, under ``TYPE_CHECKING``, and
``importlib.import_module("...")`` / ``__import__("...")`` with a constant name. ``tests/test_layering.py``
checks the layering with it and ``tests/harness/house_counts.py`` counts circles with it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.harness import astparse

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("checkpoint", "elastic")


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target among our modules."""

    source: str
    """The importing module (dotted)."""
    target: str
    """The imported module of ours, or the first name of a module outside our packages."""
    where: str
    """``path:line`` of the statement."""


def package_modules(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted name -> file of every module of ``packages`` (a package is its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = package_modules()


def ours(name: str, modules: dict[str, Path] = MODULES) -> str | None:
    """The module of ours that ``import name`` loads last (its longest prefix that is one), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path] = MODULES, root: Path = REPO) -> Iterator[Import]:
    """Every import in ``path``, resolved: ``from package import name`` names the submodule when it is one."""
    tree = astparse.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, ours(alias.name, modules) or alias.name.split(".")[0], where)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in modules else ours(base, modules) or base.split(".")[0]
                yield Import(module, target, where)
        elif isinstance(node, ast.Call) and (name := dynamic_import(node)) is not None:
            yield Import(module, ours(name, modules) or name.split(".")[0], where)


def dynamic_import(node: ast.Call) -> str | None:
    """The constant module name of ``importlib.import_module("...")`` or ``__import__("...")``, else None."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if called not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def all_imports(modules: dict[str, Path] = MODULES, root: Path = REPO) -> list[Import]:
    """Every import statement of every module in ``modules``."""
    return [imp for module, path in modules.items() for imp in imports_of(module, path, modules, root)]


def import_edges(imports: list[Import], modules: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    """Module -> the other modules of ours it imports."""
    edges: dict[str, set[str]] = {module: set() for module in modules}
    for i in imports:
        if i.target in modules and i.target != i.source:
            edges[i.source].add(i.target)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
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
