"""One load factor for every wait of the suite: a deadline written for an idle machine, stretched on a busy one.

The suite's waits are deadlines on events in other processes (an agent's exit, a line in a log, a file); their
budgets were measured on an idle 2-core machine. When the machine runs other work beside the suite (two pytest
workers, another session's tests, ``yes > /dev/null``), every process gets a share of the cores and the same
event comes later. A verdict must not depend on that, so each budget is multiplied by :func:`slowdown`:
``SPOTRUN_TEST_SLOWDOWN`` when set (CI on a known-slow runner), else the run queue per core over the last minute,
never below 1 and at most :data:`MAX_SLOWDOWN` (a hang still ends in bounded time). Used by ``wait_for``,
``reap``, ``Launcher.wait`` and ``run_cli`` (tests/harness/procs.py) and by pytest-timeout's per-test limit
(tests/conftest.py).
"""

from __future__ import annotations

import os

SLOWDOWN_ENV = "SPOTRUN_TEST_SLOWDOWN"
"""A fixed load factor (a number >= 1) instead of the one measured from the load average."""
MAX_SLOWDOWN = 4.0
"""The most a budget is stretched by the measured load (an env setting may go beyond)."""


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux: the machine's count
        return max(1, os.cpu_count() or 1)


def slowdown() -> float:
    """How much slower than an idle machine this one runs now (>= 1).

    Raises:
        ValueError: ``SPOTRUN_TEST_SLOWDOWN`` is set to something that is not a number >= 1.
    """
    fixed = os.environ.get(SLOWDOWN_ENV, "").strip()
    if fixed:
        try:
            factor = float(fixed)
        except ValueError:
            raise ValueError(f"{SLOWDOWN_ENV}={fixed!r} is not a number (give a factor >= 1, e.g. 2)") from None
        if not factor >= 1.0:  # also rejects nan
            raise ValueError(f"{SLOWDOWN_ENV}={fixed!r} must be >= 1 (1 is an idle machine)")
        return factor
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 1.0
    return min(MAX_SLOWDOWN, max(1.0, load / _cores()))


def scaled(seconds: float) -> float:
    """``seconds`` (a budget for an idle machine) stretched by the load now."""
    return seconds * slowdown()
