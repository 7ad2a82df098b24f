"""tests/harness/astparse.py: CPython 3.11's AST race is retried, any other error is not."""

from __future__ import annotations

import ast

import pytest

from tests.harness import astparse


def _flaky(failures: list[str]):  # a stand-in for ast.parse
    real = ast.parse

    def parse(source: str, filename: str = "<unknown>") -> ast.Module:
        if failures:
            raise SystemError(failures.pop(0))
        return real(source, filename=filename)

    return parse


def test_the_race_is_retried_and_the_tree_is_the_real_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(astparse.ast, "parse", _flaky([astparse.AST_RACE + " (before=1, after=2)"] * 2))
    tree = astparse.parse("x = 1\n")
    assert isinstance(tree.body[0], ast.Assign)


def test_another_system_error_and_a_race_that_persists_are_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(astparse.ast, "parse", _flaky(["something else"]))
    with pytest.raises(SystemError, match="something else"):
        astparse.parse("x = 1\n")
    monkeypatch.setattr(astparse.ast, "parse", _flaky([astparse.AST_RACE] * astparse.TRIES))
    with pytest.raises(SystemError, match="recursion depth"):
        astparse.parse("x = 1\n")
