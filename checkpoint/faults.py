"""Crash points: named places in the save and commit protocol where a process can be made to stop.

The kill-at-named-points tests (tests/checkpoint/test_crash.py) use them to prove that
a crash anywhere leaves every committed step loadable. Off by default and cheap: ``crash_point`` is one
environment lookup when ``SPOTRUN_CKPT_CRASH_AT`` is unset. The environment is read at every call (not once
at import), so a writer process inherits the setting of the training process that started it.
"""

from __future__ import annotations

import os
import threading

CRASH_AT_ENV = "SPOTRUN_CKPT_CRASH_AT"
"""``<point>:<n>``: at the n-th (1-based) time the named point is reached in this process, announce it and
block forever (the test then kills the process by PID). Points are listed in ``CRASH_POINTS``."""
CRASH_NOTIFY_FD_ENV = "SPOTRUN_CKPT_CRASH_NOTIFY_FD"
"""File descriptor that receives ``reached <point> <pid>\\n`` when the crash point triggers (default 2)."""

CRASH_POINTS = (
    "stage.begin",
    "stage.end",
    "shard.open",
    "shard.header",
    "shard.block",
    "shard.before_commit",
    "shard.after_commit",
    "rank_objects.after",
    "records.gathered",
    "objects.after",
    "index.after",
    "manifest.before",
    "manifest.after",
    "commit.before",
    "commit.after",
    "latest.before",
    "latest.after",
    "retention.before",
    "retention.delete",
)

_counts: dict[str, int] = {}
"""How often each point was reached in this process (while a crash point is set)."""


def reset() -> None:
    """Forget how often each point was reached (a test that sets a new ``CRASH_AT_ENV`` in-process)."""
    _counts.clear()


def crash_point(name: str) -> None:
    """A no-op unless ``SPOTRUN_CKPT_CRASH_AT`` names this point; then block at its n-th arrival."""
    spec = os.environ.get(CRASH_AT_ENV)
    if not spec:
        return
    point, _, nth = spec.rpartition(":")
    if point != name:
        return
    count = _counts.get(name, 0) + 1
    _counts[name] = count
    if count != int(nth):
        return
    fd = int(os.environ.get(CRASH_NOTIFY_FD_ENV, "2"))
    os.write(fd, f"reached {name} {os.getpid()}\n".encode())
    threading.Event().wait()  # block until the test kills us
