"""spotrun's option table (``elastic.options``) is the only place its flags are declared: the parser, the boot
pre-parser, the settings' defaults, the environment fallbacks and the generated reference all follow it."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from elastic import boot, options
from elastic.api import LaunchConfigError
from elastic.cli import build_parser
from elastic.config import AgentSettings, from_env, resolve
from elastic.hang import HangPolicy
from elastic.options import OPTIONS, Option
from elastic.straggler import StragglerPolicy
from tests.harness import astparse

REPO = Path(__file__).resolve().parents[2]


def _ids(option: Option[object]) -> str:
    return option.flag


def test_the_table_lists_every_option_the_module_declares() -> None:
    declared = [value for value in vars(options).values() if isinstance(value, Option)]
    assert sorted(o.flag for o in declared) == sorted(o.flag for o in OPTIONS)
    assert len({o.flag for o in OPTIONS}) == len({o.env for o in OPTIONS}) == len(OPTIONS)
    assert all(re.fullmatch(r"SPOTRUN_[A-Z0-9_]+", o.env) for o in OPTIONS)


def test_every_parser_flag_is_torchruns_or_the_tables() -> None:
    torch_strings = {s for action in get_args_parser()._actions for s in action.option_strings}
    table = {o.option_strings: o for o in OPTIONS}
    found = set()
    for action in build_parser()._actions:
        if not action.option_strings or set(action.option_strings) <= torch_strings:
            continue
        option = table.get(tuple(action.option_strings))
        assert option is not None, f"{action.option_strings} is declared by hand: add it to elastic/options.py"
        assert action.dest == option.dest and action.default is None
        assert action.help is not None and action.help.replace("%%", "%") == option.help_text
        if option.is_switch:
            assert isinstance(action, argparse.BooleanOptionalAction)
        else:
            assert action.type is option.kind and action.nargs is None
        found.add(option.flag)
    assert found == {o.flag for o in OPTIONS}, "options of the table missing from the parser"


def test_the_pre_parser_takes_its_spotrun_options_from_the_table() -> None:
    assert options.switch_spellings() == boot.FLAG_OPTIONS - boot.TORCHRUN_FLAG_OPTIONS
    assert options.value_spellings() == boot.VALUE_OPTIONS - boot.TORCHRUN_VALUE_OPTIONS
    ours = options.switch_spellings() | options.value_spellings()
    assert not ours & (boot.TORCHRUN_FLAG_OPTIONS | boot.TORCHRUN_VALUE_OPTIONS)


@pytest.mark.parametrize("option", OPTIONS, ids=_ids)
def test_every_option_is_in_the_reference(option: Option[object]) -> None:
    cli = (REPO / "docs" / "reference" / "cli.md").read_text()
    row = next((line for line in cli.splitlines() if line.startswith(f"| `{option.flag}`")), None)
    assert row is not None, f"{option.flag} missing from docs/reference/cli.md"
    assert all(f"`{s}`" in row for s in option.option_strings) and f"`{option.env}`" in row
    environment = (REPO / "docs" / "reference" / "environment.md").read_text()
    assert f"| `{option.env}` | `{option.flag}` | `elastic.options` |" in environment


def _string_literals(path: Path) -> set[str]:
    tree = astparse.parse(path.read_text())
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}


def test_no_flag_or_variable_is_spelled_outside_the_table() -> None:
    """The modules that parse, pre-parse, resolve and document the options spell none of them by hand
    (``spotrun-chaos`` has an ``--events-file`` of its own, and reads spotrun's through the table)."""
    names = {s for o in OPTIONS for s in o.option_strings} | {o.env for o in OPTIONS}
    modules = ["elastic/cli.py", "elastic/boot.py", "elastic/config.py", "elastic/api.py", "elastic/hang.py",
               "elastic/straggler.py", "docs/gen_reference.py"]
    spelled = {module: sorted(names & _string_literals(REPO / module)) for module in modules}
    assert {m: s for m, s in spelled.items() if s} == {}


def test_the_settings_defaults_are_the_tables() -> None:
    settings, hang, straggler = AgentSettings(), HangPolicy(), StragglerPolicy()
    for option in OPTIONS:
        if hasattr(settings, option.dest):
            assert getattr(settings, option.dest) == option.default, option.flag
    assert (hang.timeout, hang.startup_timeout) == (options.HANG_TIMEOUT.default, options.HANG_STARTUP_TIMEOUT.default)
    assert (straggler.factor, straggler.window) == (options.STRAGGLER_FACTOR.default, options.STRAGGLER_WINDOW.default)
    assert options.HANG_TIMEOUT.default_text == (f"adaptive: {hang.multiplier:g}x the slowest recent step, at least "
                                                 f"{hang.floor:g} s"), "the adaptive budget's words follow HangPolicy"


@pytest.mark.parametrize("option", OPTIONS, ids=_ids)
def test_flag_then_environment_then_default(monkeypatch: pytest.MonkeyPatch, option: Option[object]) -> None:
    monkeypatch.delenv(option.env, raising=False)
    assert from_env(option) == option.default
    samples: dict[type, tuple[str, object, str]] = {float: ("2.5", 2.5, "soon"), int: ("7", 7, "seven"),
                                                    bool: ("off", False, "maybe"), str: ("x", "x", "")}
    text, value, bad = samples[option.kind]
    monkeypatch.setenv(option.env, text)
    assert from_env(option) == value
    assert resolve(option, "given") == "given", "the flag wins over the environment"
    monkeypatch.setenv(option.env, bad)
    if option.kind is str:
        assert from_env(option) == option.default, "an empty variable is unset"
    else:
        with pytest.raises(LaunchConfigError, match=f"environment variable {option.env}="):
            from_env(option)
