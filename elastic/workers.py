"""Tie each worker's life to its agent, even when the agent is SIGKILLed.

torch starts workers with ``start_new_session=True`` so that the agent can signal a worker's whole process
group; the side effect is that a SIGKILLed agent leaves its workers running (orphans holding GPUs, ports and
half-finished collectives). spotrun therefore starts every worker through a tiny exec shim (this file run as a
script, stdlib only) that:

1. sets ``PR_SET_PDEATHSIG = SIGKILL`` (Linux), so the kernel kills the worker when its parent dies;
2. checks ``getppid()`` against the agent PID *after* setting it (belt and braces: if the agent died between
   fork and prctl, the signal would never fire, so the shim exits instead);
3. ``execvp``\\ s the real command, keeping the PID, environment, stdio and session torch set up, so torch's
   monitoring, error files and exit codes are untouched.

PDEATHSIG fires on the death of the parent *thread* that forked, not the process: workers must be spawned
from a thread that lives as long as the agent. ``LocalElasticAgent._start_workers`` runs in the agent's main
thread, which is exactly that.

Function entrypoints (``--run-path``) are started by multiprocessing; :class:`PdeathsigEntrypoint` applies the
same two steps at the top of the child.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1
#: Exit code of a worker whose agent died before the worker could arm its death signal.
ORPHANED_EXIT_CODE = 70


def arm_parent_death_signal(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies; exit if it is already dead."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    if os.getppid() != expected_parent:
        # The agent died before the signal was armed (the worker was re-parented to init or a subreaper).
        os._exit(ORPHANED_EXIT_CODE)


def shim_command(entrypoint: str, args: tuple[Any, ...], agent_pid: int | None = None) -> tuple[str, tuple[Any, ...]]:
    """Rewrite ``entrypoint args...`` into ``python -S workers.py AGENT_PID entrypoint args...``.

    ``-S`` skips ``site`` so the shim costs a few milliseconds; it imports only the standard library.
    """
    pid = os.getpid() if agent_pid is None else agent_pid
    return sys.executable, ("-S", os.path.abspath(__file__), str(pid), entrypoint, *args)


class PdeathsigEntrypoint:
    """Picklable wrapper of a function entrypoint that arms the parent-death signal first (``--run-path``)."""

    def __init__(self, fn: Callable[..., Any], agent_pid: int | None = None) -> None:
        self.fn = fn
        self.agent_pid = os.getpid() if agent_pid is None else agent_pid
        # torch names the entrypoint after ``__name__`` in its events and failure summary.
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> Any:
        arm_parent_death_signal(self.agent_pid)
        return self.fn(*args)


def _shim_main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.stderr.write("usage: python -S workers.py AGENT_PID COMMAND [ARGS...]\n")
        os._exit(2)
    arm_parent_death_signal(int(argv[0]))
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    _shim_main(sys.argv[1:])
