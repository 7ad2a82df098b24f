"""Suite-wide guard: no test may leave a process behind; and the whole-suite run leaves the long cases out.

pytest makes itself a child subreaper, so workers orphaned by a killed agent are re-parented to it
instead of to init. At the end of the session every descendant still alive is reported, killed by
PID (only processes this session started) and the session fails.

Tests marked ``long`` (end-to-end cases of 10 s to minutes each: the chaos suite, real Slurm, network partitions) are
left out of a run of the whole suite as configured (``pytest`` or ``bash tests/run.sh`` with no path and no
``-m``), which keeps the README's test command under 15 minutes on 2 cores; the summary says how many and how
to run them. ``-m long`` runs them alone (CI's second step, ``.ci/run``); naming their files, or any ``-m``
expression, runs what was asked as usual.

Each test's pytest-timeout limit is stretched by the machine's load like every wait of the harness
(tests/harness/deadline.py); tests/harness/accounting.py records what was collected and what reported, for
tests/run.sh to name the tests a run never ran.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from tests.harness.accounting import (  # noqa: F401 (hooks: pytest finds them in this module)
    pytest_collection_finish,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_xdist_node_collection_finished,
)
from tests.harness.deadline import slowdown
from tests.harness.procs import descendants

_PR_SET_CHILD_SUBREAPER = 36
_LONG_LEFT_OUT = pytest.StashKey[int]()

try:  # property-based suites (tests/checkpoint/test_fuzz.py): small by default, --hypothesis-profile=thorough
    from hypothesis import settings

    settings.register_profile("ci", max_examples=12, deadline=None, print_blob=True)
    settings.register_profile("thorough", max_examples=1000, deadline=None, print_blob=True)
    settings.load_profile("ci")
except ImportError:  # pragma: no cover - the test extra installs hypothesis
    pass


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def pytest_configure(config: pytest.Config) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def leaves_long_cases_out(config: pytest.Config) -> bool:
    """A whole-suite run: no path on the command line (pytest took ``testpaths``) and no ``-m`` expression."""
    return config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.markexpr


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not leaves_long_cases_out(config):
        return
    long_cases = [item for item in items if item.get_closest_marker("long") is not None]
    if long_cases:
        config.hook.pytest_deselected(items=long_cases)
        items[:] = [item for item in items if item.get_closest_marker("long") is None]
    config.stash[_LONG_LEFT_OUT] = len(long_cases)


@pytest.hookimpl(wrapper=True, tryfirst=True)  # a wrapper: before pytest-timeout's wrapper reads the limit
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """pytest-timeout's limit for this test (its marker, else --timeout or the ini's), stretched by the load now:
    the waits inside the test are (tests/harness/procs.py), and the test's own limit must not end them first."""
    _stretch_timeout(item)
    return (yield)


def _stretch_timeout(item: pytest.Item) -> None:
    factor = slowdown()
    if factor <= 1.0:
        return
    marker = item.get_closest_marker("timeout")
    base = marker.args[0] if marker is not None and marker.args else None
    if marker is not None and base is None:
        base = marker.kwargs.get("timeout")
    if base is None:  # pytest-timeout's own order: --timeout, then PYTEST_TIMEOUT, then the ini's
        option = item.config.getoption("timeout", None)
        base = option or os.environ.get("PYTEST_TIMEOUT") or item.config.getini("timeout")
    try:
        limit = float(base)
    except (TypeError, ValueError):
        return  # no limit, or one pytest-timeout itself rejects
    if limit > 0:
        extra = {key: value for key, value in (marker.kwargs.items() if marker is not None else ()) if key != "timeout"}
        item.add_marker(pytest.mark.timeout(limit * factor, **extra), append=False)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    left_out = config.stash.get(_LONG_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} long tests (marker 'long') left out of this whole-suite run: "
                                    "`bash tests/run.sh -m long` runs them (CI does, as its second step)")


@pytest.fixture(scope="session", autouse=True)
def _dist_forkserver() -> Iterator[None]:
    """One forkserver (torch imported once) for every module that runs ``tests.harness.dist.run_workers``,
    stopped at the end of the session so the leftover check below does not report it."""
    yield
    dist = sys.modules.get("tests.harness.dist")
    if dist is not None:
        dist.shutdown()


@pytest.fixture(scope="session", autouse=True)
def _state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """An agent without --log-dir or --events-file keeps its events under $XDG_STATE_HOME
    (``elastic.events.default_events_path``): the suite's agents keep theirs in its temporary directory, not in
    the home directory of whoever runs the tests."""
    before = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if before is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = before


_WORKER_LEFTOVERS = pytest.StashKey[list[str]]()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist's controller (tests/run.sh runs the whole suite in two workers): what a worker has to say at
    its end, the count of long cases it left out (the controller's summary says it as a one-process run does) and
    the processes it left behind (the controller fails the session for them: a worker's own exit status is
    copied before its ``pytest_sessionfinish`` runs)."""
    output = getattr(node, "workeroutput", {})
    config: pytest.Config = node.config  # type: ignore[attr-defined]
    config.stash[_LONG_LEFT_OUT] = max(config.stash.get(_LONG_LEFT_OUT, 0), output.get("long_left_out", 0))
    config.stash.setdefault(_WORKER_LEFTOVERS, []).extend(output.get("leftovers", []))


def _report_leftovers(session: pytest.Session, lines: list[str]) -> None:
    """Say which processes were left behind, record them for tests/run.sh (``SPOTRUN_LEFTOVER_FILE``: a rerun
    that passes must not hide them) and fail the session."""
    print("\nERROR: the test session left processes behind (killed now):\n" + "\n".join(lines))
    record = os.environ.get("SPOTRUN_LEFTOVER_FILE")
    if record:
        with open(record, "a", encoding="utf-8") as out:
            out.write("\n".join(lines) + "\n")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)  # an xdist worker: tell the controller
    if workeroutput is not None:
        workeroutput["long_left_out"] = session.config.stash.get(_LONG_LEFT_OUT, 0)
    lines = _kill_leftovers()
    if workeroutput is not None:
        workeroutput["leftovers"] = lines
        return
    lines += session.config.stash.get(_WORKER_LEFTOVERS, [])
    if lines:
        _report_leftovers(session, lines)


def _kill_leftovers() -> list[str]:
    """Every descendant of this process still alive 10 s after the session: described, then SIGKILLed."""
    me = os.getpid()
    deadline = time.monotonic() + 10.0
    left = descendants(me)
    while left and time.monotonic() < deadline:
        _reap_zombies()
        time.sleep(0.1)
        left = descendants(me)
    if not left:
        return []
    lines = [f"  pid {pid} [{state}]: {cmd[:200]}" for pid, (state, cmd) in sorted(left.items())]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap_zombies()
    return lines
