"""The packages' layering, read from the source: ``checkpoint`` never imports ``elastic``, no two of our modules
import each other (directly or around a circle), the layer under both imports only the standard library, and
the warm forkserver's preloads leave the name ``checkpoint`` free for a training script's own module.

Every import statement counts, wherever it stands: at the top, inside a function, under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness.imports import MODULES, REPO, all_imports, circles, import_edges

pytestmark = pytest.mark.timeout(120)

LOWER = "checkpoint._sys"
"""The layer under both packages (checkpoint/_sys/__init__.py says what it holds)."""

ALL_IMPORTS = all_imports()


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


def test_circles_are_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_our_modules() -> None:
    """Each module stands above what it imports: no circle, however long, whatever hides it."""
    edges = import_edges(ALL_IMPORTS)
    seen: dict[tuple[str, str], str] = {}
    for i in ALL_IMPORTS:
        seen.setdefault((i.source, i.target), i.where)
    found = circles(edges)
    described = [", ".join(c) + "\n    " + "\n    ".join(
        f"{seen[(a, b)]}: {a} -> {b}" for a in c for b in sorted(edges[a]) if b in c) for c in found]
    assert not found, "import circles:\n" + "\n".join(described)


def test_the_warm_forkserver_preloads_leave_the_name_checkpoint_free() -> None:
    """A training script's own ``checkpoint`` module must be what it imports in a warm worker, as under
    torchrun: nothing the forkserver preloads may import spotrun's ``checkpoint`` package."""
    code = ("import json, sys\nfrom elastic.warm import DEFAULT_PRELOAD\nfor name in DEFAULT_PRELOAD:\n"
            "    __import__(name)\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'checkpoint')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=100,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
