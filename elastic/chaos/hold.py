"""A crash as NCCL's peers see it, on CPU: gloo fails at once when a peer dies (its sockets close), NCCL hangs.

:func:`hold_sockets` copies a process's sockets into the caller (Linux ``pidfd_getfd``, 5.6+, ptrace rights: root
or an ancestor) before it is killed: its peers' connections stay open, silent, until :func:`release`.
"""

from __future__ import annotations

import ctypes
import errno
import os

SYS_PIDFD_GETFD = 438
"""The ``pidfd_getfd`` syscall's number: the same on every Linux architecture (the unified syscall table)."""


def hold_sockets(pid: int) -> list[int]:
    """Copies (file descriptors in this process) of every socket ``pid`` has open. Raises ``OSError``: the
    process is gone, or this kernel or these rights do not allow it (``EPERM``, ``ENOSYS``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    held: list[int] = []
    try:
        for fd in _socket_fds(pid):
            copy = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
            if copy < 0:
                code = ctypes.get_errno()
                if code == errno.EBADF:
                    continue  # closed since it was listed
                raise OSError(code, f"pidfd_getfd of fd {fd} of process {pid}: {os.strerror(code)} (needs Linux "
                                    "5.6+ and ptrace rights over the process: root, or its ancestor)")
            held.append(copy)
    except BaseException:
        release(held)
        raise
    finally:
        os.close(pidfd)
    return held


def release(fds: list[int]) -> dict[str, int]:
    """Close the copies: the dead process's peers now see its connections end."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    return {"released": len(fds)}


def _socket_fds(pid: int) -> list[int]:
    fds = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                fds.append(int(name))
        except (OSError, ValueError):
            continue
    return fds
