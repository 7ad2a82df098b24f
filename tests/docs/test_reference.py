"""The generated reference pages (docs/gen_reference.py) are current and complete.

A flag, environment variable, ``--rdzv-conf`` key, event or exit code added to the code without regenerating
the pages fails here; so does a page that lost a row by hand."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
sys.path.insert(0, str(DOCS))  # docs/ is not a package: import the generator as a module

import gen_reference  # noqa: E402


def _page(name: str) -> str:
    return (DOCS / "reference" / name).read_text()


def test_generated_pages_are_current() -> None:
    """The same check CI runs (.ci/docs.sh): regenerating changes nothing."""
    result = subprocess.run([sys.executable, str(DOCS / "gen_reference.py"), "--check"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_every_spotrun_flag_is_in_the_cli_reference() -> None:
    from elastic.cli import build_parser

    page = _page("cli.md")
    missing = [opt for action in build_parser()._actions for opt in action.option_strings
               if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
               and f"`{opt}" not in page]
    assert not missing, f"flags missing from docs/reference/cli.md: {missing}"


def test_every_tool_flag_is_in_the_cli_reference() -> None:
    from checkpoint.cli import build_parser as ckpt_parser
    from elastic.chaos.cli import build_parser as chaos_parser
    from elastic.etcd_server import build_parser as etcd_parser
    from elastic.report import build_parser as report_parser
    from elastic.status import build_parser as status_parser

    page = _page("cli.md")
    parsers = [chaos_parser(), etcd_parser(), report_parser(), status_parser()]
    ckpt = ckpt_parser()
    sub = next(a for a in ckpt._actions if isinstance(a, argparse._SubParsersAction))
    parsers += list(sub.choices.values())
    missing = [(p.prog, opt) for p in parsers for action in p._actions for opt in action.option_strings
               if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
               and f"`{opt}" not in page]
    assert not missing, f"flags missing from docs/reference/cli.md: {missing}"
    for name in sub.choices:
        assert f"`spotrun-ckpt {name}`" in page


def test_every_spotrun_variable_in_the_code_is_in_the_environment_reference() -> None:
    """Any ``SPOTRUN_*`` name spelled in elastic/ or checkpoint/ (constants or not) is documented."""
    page = _page("environment.md")
    names = set()
    for package in ("elastic", "checkpoint"):
        for path in (REPO / package).rglob("*.py"):
            names |= set(re.findall(r"\bSPOTRUN_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert names, "found no SPOTRUN_* name: the scan is broken"
    missing = sorted(n for n in names if f"`{n}`" not in page)
    assert not missing, f"variables missing from docs/reference/environment.md: {missing}"


def test_every_rdzv_conf_key_and_event_is_documented() -> None:
    from elastic.api import FailureCause, RecoveryCause, RecoveryEvent
    from elastic.rendezvous.api import EtcdRendezvousConfig

    conf = _page("rdzv-conf.md")
    assert [k for k in EtcdRendezvousConfig.accepted_keys() if f"`{k}`" not in conf] == []
    events = _page("events.md")
    for enum_cls in (RecoveryEvent, FailureCause, RecoveryCause):
        assert [m.value for m in enum_cls if f"`{m.value}`" not in events] == [], enum_cls.__name__


def test_a_row_removed_by_hand_is_caught_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith(("PET_", "SPOTRUN_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(name)  # as the generator does: defaults come from the code, not this environment
    page = _page("cli.md")
    row = next(line for line in page.splitlines() if line.startswith("| `--stop-grace"))
    edited = page.replace(row + "\n", "")
    assert edited != page
    assert gen_reference.render(edited, {}) == page


def test_an_unknown_block_name_is_an_error() -> None:
    with pytest.raises(SystemExit, match="unknown generated block 'nope'"):
        gen_reference.render("<!-- generated:nope -->\n<!-- /generated:nope -->\n", {})
