"""Suite-wide guard: no test may leave a process behind.

pytest makes itself a child subreaper, so workers orphaned by a killed agent are re-parented to it
instead of to init. At the end of the session every descendant still alive is reported, killed by
PID (only processes this session started) and the session fails.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from tests.harness.procs import descendants

_PR_SET_CHILD_SUBREAPER = 36

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


@pytest.fixture(scope="session", autouse=True)
def _dist_forkserver() -> Iterator[None]:
    """One forkserver (torch imported once) for every module that runs ``tests.harness.dist.run_workers``,
    stopped at the end of the session so the leftover check below does not report it."""
    yield
    dist = sys.modules.get("tests.harness.dist")
    if dist is not None:
        dist.shutdown()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    me = os.getpid()
    deadline = time.monotonic() + 10.0
    left = descendants(me)
    while left and time.monotonic() < deadline:
        _reap_zombies()
        time.sleep(0.1)
        left = descendants(me)
    if not left:
        return
    lines = [f"  pid {pid} [{state}]: {cmd[:200]}" for pid, (state, cmd) in sorted(left.items())]
    print("\nERROR: the test session left processes behind (killed now):\n" + "\n".join(lines))
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap_zombies()
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
