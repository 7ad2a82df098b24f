"""Two guards for a run that must not end without saying what it did (hooks re-exported by tests/conftest.py).

Tests that never ran: pytest can stop before the end (an ``INTERNALERROR``, a crashed xdist worker, ``-x``) and
its summary then counts only what ran. With ``SPOTRUN_TEST_ACCOUNT`` set to a directory (tests/run.sh sets it),
the process that reports (the one pytest, or pytest-xdist's controller) writes there the node ids it collected
(``collected``, written when collection ends) and appends each one whose last report came (``reported``: the
teardown, or a failure in any phase, as it arrives, so a crash of the reporting process keeps what came before);
:func:`never_ran` compares the two and tests/run.sh names the difference.

A failure whose formatting fails: CPython 3.11 builds ``ast.parse``'s result with one recursion counter per
interpreter, so two threads parsing at once (pytest formatting a traceback while a test's thread logs an
exception, whose caret line parses source too) can raise ``SystemError: AST constructor recursion depth
mismatch`` (python/cpython#106905). Raised while pytest builds a report, it was an ``INTERNALERROR`` that ended
the whole run with no failure text. :func:`pytest_runtest_makereport` turns it into the test's failure, with
the traceback formatted again (the counter race is transient) or, failing that, the exception alone.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Generator, Iterable
from pathlib import Path

import pytest

ACCOUNT_ENV = "SPOTRUN_TEST_ACCOUNT"
"""A directory: where the reporting process records the node ids it collected and those that reported."""
COLLECTED, REPORTED = "collected", "reported"
_AST_RACE = "AST constructor recursion depth mismatch"
_FORMAT_TRIES = 3


def _account_dir(config: pytest.Config) -> Path | None:
    if hasattr(config, "workerinput"):  # an xdist worker: its controller reports
        return None
    folder = os.environ.get(ACCOUNT_ENV)
    return Path(folder) if folder else None


def _write_collected(config: pytest.Config, nodeids: Iterable[str]) -> None:
    folder = _account_dir(config)
    if folder is None:
        return
    ids = list(nodeids)
    if not ids:  # xdist's controller collects nothing itself; its workers' lists come through the hook below
        return
    tmp = folder / f".{COLLECTED}.tmp"
    tmp.write_text("".join(f"{nodeid}\n" for nodeid in ids), encoding="utf-8")
    tmp.replace(folder / COLLECTED)


def pytest_collection_finish(session: pytest.Session) -> None:
    _write_collected(session.config, (item.nodeid for item in session.items))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """Every xdist worker collects the whole suite (the same list); the first one to finish is recorded."""
    config: pytest.Config = node.config  # type: ignore[attr-defined]
    folder = _account_dir(config)
    if folder is not None and not (folder / COLLECTED).exists():
        _write_collected(config, ids)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "teardown" and not report.failed:
        return
    folder = os.environ.get(ACCOUNT_ENV)
    if not folder or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(Path(folder) / REPORTED, "a", encoding="utf-8") as out:
        out.write(f"{report.nodeid}\n")


def never_ran(folder: Path) -> tuple[int, list[str]]:
    """(how many were collected, those collected that never reported, in collection order)."""
    try:
        collected = (folder / COLLECTED).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return 0, []
    try:
        reported = set((folder / REPORTED).read_text(encoding="utf-8").splitlines())
    except FileNotFoundError:
        reported = set()
    return len(collected), [nodeid for nodeid in collected if nodeid not in reported]


def _plain_traceback(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    for _ in range(_FORMAT_TRIES):
        try:
            return "".join(traceback.format_exception(excinfo.value))
        except SystemError as exc:
            if _AST_RACE not in str(exc):
                raise
    return f"{excinfo.typename}: {excinfo.value}"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    try:
        return (yield)
    except SystemError as exc:
        if _AST_RACE not in str(exc):
            raise
        failure = _plain_traceback(call.excinfo) if call.excinfo is not None else "(no exception)"
        sections = [(f"Captured {key} {when}", content) for when, key, content in item._report_sections]
        longrepr = (f"{failure}\n[tests] pytest's own formatting of this failure hit CPython's AST race "
                    f"({exc}): the traceback above is Python's plain one")
        return pytest.TestReport(
            nodeid=item.nodeid, location=item.location, keywords=dict.fromkeys(item.keywords, 1),
            outcome="failed", longrepr=longrepr, when=call.when, sections=sections,
            duration=call.duration, start=call.start, stop=call.stop, user_properties=item.user_properties,
        )


SHOWN = 40
"""Most never-run node ids printed (all of them are in the account directory's files)."""


def main(argv: list[str]) -> int:
    """``python -m tests.harness.accounting DIR PYTEST_EXIT_STATUS``: name the tests collected in DIR that never
    reported; exit 1 if there are any."""
    folder, status = Path(argv[0]), argv[1]
    collected, missing = never_ran(folder)
    if not missing:
        return 0
    print(f"[tests] FAILED: {len(missing)} of the {collected} tests collected never ran (pytest exit status {status}: "
          "an internal error or a crash stopped it, see above; -x or --maxfail stop early by design):")
    for nodeid in missing[:SHOWN]:
        print(f"[tests]   {nodeid}")
    if len(missing) > SHOWN:
        print(f"[tests]   ... and {len(missing) - SHOWN} more")
    return 1


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
