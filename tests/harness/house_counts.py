"""Counts of how the house reads, from the source (standard library only): ``python -m tests.harness.house_counts``
prints them as tables; ``tests/test_house.py`` holds each to a ceiling so that none grows.

What is counted, precisely:

- **Largest classes**: every ``class`` of ``elastic/`` and ``checkpoint/``, its lines (``class`` line to its last
  line, docstrings and comments included) and its methods (``def`` / ``async def`` directly in its body).
- **Private accesses in tests**: in ``tests/`` (without ``tests/elastic/torch_launcher/``, torch's own tests
  vendored), each

  - attribute access ``x._name`` (one leading underscore, not a dunder) where ``_name`` is defined in the project's
    code (``elastic/``, ``checkpoint/``, ``examples/``, ``bench/``: a ``def``/``class`` name, a module-level or
    class-level assignment, or an attribute assigned as ``self._name``), except ``self._name``/``cls._name`` and
    ``super()._name`` in a test's own class that defines ``_name`` itself, and except chains rooted at a name
    imported from outside the project (``torch._dynamo``, ``os._exit``);
  - ``getattr``/``setattr``/``hasattr``/``delattr`` (and ``monkeypatch.setattr``/``delattr``) with such a
    ``"_name"`` as a constant string, or a dotted constant string ending in one (``"elastic.agent._x"``);
  - ``from X import _name`` where ``X`` is a module of the project's code.

  Reported per file.
- **Function-local imports**: ``import``/``from ... import`` statements inside a ``def`` or ``lambda`` in
  ``elastic/`` and ``checkpoint/``, per file.
- **Option definitions per flag**: for each ``--flag`` of ``elastic.cli.build_parser()`` (its ``--x_y`` spelling
  counted with ``--x-y``), how many files of ``elastic/`` spell it, and how often.
- **Import circles**: strongly connected components among our modules' imports, as ``tests/test_layering.py`` walks
  them (``tests/harness/imports.py``).
- **Docstring share**: lines inside docstrings (a module's, class's or function's first string, and attribute
  docstrings: any other statement that is a lone string) over all lines, per package.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.harness import astparse
from tests.harness.imports import REPO, all_imports, circles, import_edges

CODE = ("elastic", "checkpoint")
"""The packages whose classes, imports and docstrings are counted."""
PROJECT = ("elastic", "checkpoint", "examples", "bench")
"""The project's code: the privates a test may reach into are defined here."""
VENDORED = Path("tests/elastic/torch_launcher")
"""torch's launcher tests, vendored as they are upstream: not ours to change."""


def _py_files(root: Path, folders: Iterable[str]) -> Iterator[Path]:
    for folder in folders:
        yield from sorted((root / folder).rglob("*.py"))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _rel(path: Path, root: Path) -> str:
    return str(path.relative_to(root))


@dataclass(frozen=True, slots=True)
class ClassSize:
    """One class's size."""

    where: str
    """``path:line`` of the ``class`` statement."""
    name: str
    lines: int
    methods: int


def class_sizes(root: Path = REPO, folders: Iterable[str] = CODE) -> list[ClassSize]:
    """Every class of ``folders``, largest (in lines) first."""
    found = []
    for path in _py_files(root, folders):
        for node in ast.walk(astparse.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) for child in node.body)
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append(ClassSize(f"{_rel(path, root)}:{node.lineno}", node.name, lines, methods))
    return sorted(found, key=lambda c: (-c.lines, c.where))


def _defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module defines: defs, classes, assignments and ``self._x``/``cls._x`` attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
    return {name for name in names if _is_private(name)}


def project_privates(root: Path = REPO) -> set[str]:
    """Every private name the project's code defines."""
    names: set[str] = set()
    for path in _py_files(root, PROJECT):
        names |= _defined_privates(astparse.parse(path.read_text(), filename=str(path)))
    return names


def _project_module(name: str) -> bool:
    return name.split(".")[0] in PROJECT


class _PrivateAccesses(ast.NodeVisitor):
    """Walks one test file, collecting its private accesses (see the module docstring)."""

    def __init__(self, privates: set[str]) -> None:
        self.privates = privates
        self.found: list[tuple[int, str]] = []
        self.foreign: set[str] = set()
        self.own: list[set[str]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if not _project_module(alias.name):
                self.foreign.add(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            if node.level == 0 and not _project_module(module) and not module.startswith("tests"):
                self.foreign.add(alias.asname or alias.name)
            elif node.level == 0 and _project_module(module) and _is_private(alias.name):
                self.found.append((node.lineno, f"from {module} import {alias.name}"))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        own = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                    and isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls")):
                own.add(sub.attr)
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                own.add(sub.id)
        self.own.append(own)
        self.generic_visit(node)
        self.own.pop()

    def _root(self, node: ast.expr) -> str | None:
        while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
            node = node.func if isinstance(node, ast.Call) else node.value
        return node.id if isinstance(node, ast.Name) else None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = node.attr
        if _is_private(name) and name in self.privates and not self._excused(node):
            self.found.append((node.lineno, f".{name}"))
        self.generic_visit(node)

    def _excused(self, node: ast.Attribute) -> bool:
        base = node.value
        own = bool(self.own) and node.attr in self.own[-1]
        if own and isinstance(base, ast.Name) and base.id in ("self", "cls"):
            return True
        if own and isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            return True  # an override calling the one it overrides
        return self._root(node) in self.foreign

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if called in ("getattr", "setattr", "hasattr", "delattr"):
            for arg in node.args[:2]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    last = arg.value.rpartition(".")[2]
                    if _is_private(last) and last in self.privates:
                        self.found.append((node.lineno, f"{called}({arg.value!r})"))
        self.generic_visit(node)


def private_accesses(root: Path = REPO) -> dict[str, list[tuple[int, str]]]:
    """Test file -> its private accesses ``(line, what)``, for files with any."""
    privates = project_privates(root)
    found: dict[str, list[tuple[int, str]]] = {}
    for path in _py_files(root, ["tests"]):
        if (root / VENDORED) in path.parents:
            continue
        visitor = _PrivateAccesses(privates)
        visitor.visit(astparse.parse(path.read_text(), filename=str(path)))
        if visitor.found:
            found[_rel(path, root)] = sorted(visitor.found)
    return found


def function_local_imports(root: Path = REPO, folders: Iterable[str] = CODE) -> dict[str, list[int]]:
    """File -> lines of its imports inside a function, for files with any."""
    found: dict[str, list[int]] = {}
    for path in _py_files(root, folders):
        lines = sorted(_imports_inside_functions(astparse.parse(path.read_text(), filename=str(path)), inside=False))
        if lines:
            found[_rel(path, root)] = lines
    return found


def _imports_inside_functions(node: ast.AST, inside: bool) -> Iterator[int]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom) and inside:
            yield child.lineno
        yield from _imports_inside_functions(
            child, inside or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))


def parser_flags(root: Path = REPO) -> list[str]:
    """The ``--flags`` of ``spotrun``'s parser, read in a child process (``elastic.cli`` imports torch)."""
    code = "from elastic.cli import build_parser\nprint(*build_parser()._option_string_actions)"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         check=True)
    return sorted({flag.replace("_", "-") for flag in out.stdout.split() if flag.startswith("--")} - {"--help"})


def option_spellings(root: Path = REPO, flags: list[str] | None = None) -> dict[str, tuple[int, int]]:
    """``--flag`` -> (files of ``elastic/`` that spell it, times spelled in all), either spelling."""
    texts = {path: path.read_text() for path in _py_files(root, ["elastic"])}
    counts: dict[str, tuple[int, int]] = {}
    for flag in flags if flags is not None else parser_flags(root):
        pattern = re.compile(r"(?<![\w-])" + re.escape(flag).replace("\\-", "[-_]") + r"(?![\w-])")
        per_file = [len(pattern.findall(text)) for text in texts.values()]
        counts[flag] = (sum(n > 0 for n in per_file), sum(per_file))
    return counts


def import_circles(root: Path = REPO) -> list[list[str]]:
    """The import circles among our modules (as ``tests/test_layering.py`` finds them)."""
    return circles(import_edges(all_imports()))


def docstring_lines(path: Path) -> tuple[int, int]:
    """(lines inside docstrings, all lines) of one file."""
    text = path.read_text()
    inside: set[int] = set()
    for node in ast.walk(astparse.parse(text, filename=str(path))):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:
            if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)):
                inside.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return len(inside), len(text.splitlines())


def docstring_share(root: Path = REPO, folders: Iterable[str] = CODE) -> tuple[int, int]:
    """(docstring lines, all lines) over ``folders``."""
    doc = total = 0
    for path in _py_files(root, folders):
        d, t = docstring_lines(path)
        doc, total = doc + d, total + t
    return doc, total


def _table(title: str, rows: list[tuple[object, ...]], header: tuple[str, ...]) -> str:
    cells = [tuple(map(str, header)), *(tuple(map(str, row)) for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [f"## {title}", "  ".join(h.ljust(w) for h, w in zip(cells[0], widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells[1:]]
    return "\n".join(lines)


def report(top: int = 10, with_flags: bool = True, folders: list[str] | None = None) -> str:
    """Every count as plain-text tables; ``folders`` narrows the docstring share to those paths too."""
    out: list[str] = []
    classes = class_sizes()
    out.append(_table(f"Largest classes ({len(classes)} in {', '.join(CODE)})",
                      [(c.name, c.lines, c.methods, c.where) for c in classes[:top]],
                      ("class", "lines", "methods", "where")))
    accesses = private_accesses()
    by_file = sorted(accesses.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    out.append(_table(f"Private accesses in tests: {sum(len(v) for v in accesses.values())}",
                      [(len(v), f) for f, v in by_file], ("count", "file")))
    local = function_local_imports()
    out.append(_table(f"Function-local imports: {sum(len(v) for v in local.values())}",
                      [(len(v), f) for f, v in sorted(local.items(), key=lambda kv: (-len(kv[1]), kv[0]))],
                      ("count", "file")))
    if with_flags:
        try:
            spellings = option_spellings()
        except subprocess.CalledProcessError as exc:  # the parser moved: say so, count the rest
            spellings = {}
            out.append(f"## Option definitions per flag: parser not found ({exc.stderr.strip().splitlines()[-1]})")
        rows = sorted(spellings.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))
        repeated = sum(files > 1 for files, _ in spellings.values())
        if spellings:
            out.append(_table(f"Option definitions per flag: {len(spellings)} flags, {repeated} spelled in more "
                              "than one file of elastic/", [(flag, files, times) for flag, (files, times) in rows],
                              ("flag", "files", "times")))
    found = import_circles()
    out.append(_table(f"Import circles: {len(found)}", [(", ".join(c),) for c in found], ("modules",)))
    rows = []
    for folder in [*CODE, *(folders or [])]:
        doc, total = docstring_share(folders=[folder]) if (REPO / folder).is_dir() else docstring_lines(REPO / folder)
        rows.append((folder, doc, total, f"{100 * doc / max(total, 1):.1f} %"))
    doc, total = docstring_share()
    rows.append(("elastic + checkpoint", doc, total, f"{100 * doc / max(total, 1):.1f} %"))
    out.append(_table("Docstring share", rows, ("where", "docstring lines", "lines", "share")))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--top", type=int, default=10, help="how many of the largest classes to list")
    parser.add_argument("--no-flags", action="store_true", help="skip the flag count (it imports torch)")
    parser.add_argument("--docstrings", nargs="*", default=[], metavar="PATH",
                        help="also print the docstring share of these files or folders")
    parser.add_argument("--privates", action="store_true", help="list every private access, line by line")
    args = parser.parse_args(argv)
    print(report(args.top, not args.no_flags, args.docstrings))
    if args.privates:
        for path, found in sorted(private_accesses().items()):
            for line, what in found:
                print(f"{path}:{line}: {what}")


if __name__ == "__main__":
    main()
