"""Linux process helpers: die with the parent (``PR_SET_PDEATHSIG``) without the fork/prctl race.

Used by the worker exec shim (``elastic.workers``), the embedded etcd (``elastic.etcd_server``) and the
checkpoint writer process (``checkpoint.writer``). Standard library only: ``elastic/workers.py`` imports
this module while it runs as the exec shim under ``python -S``, where the package may not be importable.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Final

PR_SET_PDEATHSIG: Final = 1
"""``prctl`` option from ``<linux/prctl.h>``: signal this process when the thread that forked it dies."""

ORPHANED_EXIT_CODE: Final = 70
"""Exit code of a child whose parent died before the child could arm its death signal."""


def arm_parent_death_signal(
    expected_parent: int | None = None, *, agent_pid: int | None = None, sig: signal.Signals = signal.SIGKILL
) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies; exit if it is already dead.

    The signal only fires for a parent that dies *after* ``prctl``. If it died between fork and ``prctl``
    this process was already re-parented (to init or a subreaper), so ``getppid()`` is checked *after*
    arming against ``expected_parent`` (the parent's PID, best captured before the fork; default: the
    parent read now, which only catches a death during this call) and, when the parent is an intermediary
    such as a forkserver, ``agent_pid`` must still exist. Either failing exits with
    :data:`ORPHANED_EXIT_CODE`. Off Linux this only runs the checks. Raises ``OSError`` if ``prctl`` fails.
    """
    parent = os.getppid() if expected_parent is None else expected_parent
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    if os.getppid() != parent or (agent_pid is not None and not pid_exists(agent_pid)):
        os._exit(ORPHANED_EXIT_CODE)


def pid_exists(pid: int) -> bool:
    """True if a process ``pid`` exists (possibly owned by another user, possibly a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
