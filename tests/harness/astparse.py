"""``ast.parse`` for the suite's source scans, proof against CPython 3.11's AST race (python/cpython#106905).

On 3.11 the AST constructor keeps one recursion counter per interpreter: when another thread of the test process
compiles at the same moment (a daemon thread left by an earlier test importing a module), ``ast.parse`` may raise
``SystemError: AST constructor recursion depth mismatch``. Parsing is a pure function of its input, so a retry is
exact.
"""

from __future__ import annotations

import ast

AST_RACE = "AST constructor recursion depth mismatch"
TRIES = 5


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)``, retried when CPython's AST race (and nothing else) made it fail."""
    for _ in range(TRIES - 1):
        try:
            return ast.parse(source, filename=filename)
        except SystemError as exc:
            if AST_RACE not in str(exc):
                raise
    return ast.parse(source, filename=filename)
