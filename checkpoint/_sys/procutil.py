"""Linux process helpers: die with the parent (``PR_SET_PDEATHSIG``) without the fork/prctl race; whether a
process has exited (``exited``, ``process_identity``/``process_gone``: PID reuse and zombies told apart).

Used by the worker exec shim (``elastic.workers``), the embedded etcd (``elastic.etcd_server``), the
checkpoint writer process (``checkpoint.writer``), the memory tier's just-in-time snapshots
(``checkpoint.memory``), the memory tier's keeper and the chaos injector. Standard library only:
``elastic/workers.py`` (the exec shim, ``python -S``) and the keeper (``python -I -S``) load this file by its
path, where the package may not be importable.
"""

from __future__ import annotations

import ctypes
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


def exited(pid: int) -> bool:
    """True when process ``pid`` has exited: no such process, or a zombie not reaped yet (False where ``/proc``
    cannot tell)."""
    try:
        stat = _proc_stat(pid, missing_ok=False)
    except OSError:
        return True
    return stat is not None and stat[0] in ("Z", "X")


def process_identity(pid: int) -> str | None:
    """``"{pid}:{start time}:{pid namespace}"`` of a live process from ``/proc`` (the start time tells a reused PID
    apart, the namespace a PID of another container), or None where ``/proc`` cannot tell (then
    :func:`process_gone` never says gone)."""
    stat, namespace = _proc_stat(pid), _pid_namespace()
    return None if stat is None or namespace is None else f"{pid}:{stat[19]}:{namespace}"


def process_gone(identity: object) -> bool:
    """Whether the process of ``identity`` (:func:`process_identity`) has exited: no such PID, a zombie (exited,
    not reaped yet) or a PID reused by another process. False when unsure: an identity taken in another PID
    namespace (another container sharing a directory), and one that is not an identity at all (it may come from
    another process: a damaged one must neither raise nor say gone)."""
    if not isinstance(identity, str):
        return False
    parts = identity.split(":")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts) or int(parts[0]) <= 0:
        return False
    pid, start, namespace = parts
    if namespace != _pid_namespace():
        return False
    try:
        stat = _proc_stat(int(pid), missing_ok=False)
    except OSError:
        return True  # no such process
    return stat is not None and (stat[0] in ("Z", "X") or stat[19] != start)


def _pid_namespace() -> str | None:
    """This process's PID namespace (the inode number of ``/proc/self/ns/pid``), None where it cannot be read."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return None
    number = link.rpartition("[")[2].rstrip("]")
    return number if number.isascii() and number.isdigit() else None


def _proc_stat(pid: int, *, missing_ok: bool = True) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), None where it cannot be read (and,
    with ``missing_ok=False``, OSError when the process does not exist on a host whose ``/proc`` works)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        if missing_ok or not os.path.isdir("/proc/self"):
            return None
        raise
    except IndexError:
        return None
    return [x.decode("ascii", "replace") for x in fields] if len(fields) > 19 else None
