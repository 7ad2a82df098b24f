"""Make a collective that blocks the main thread raise, from another thread: the worker side of an abortable group.

When a peer is gone, a collective does not always fail by itself: NCCL hangs until its watchdog's timeout (or
the watchdog ends the process), and gloo waits as long as the peer's connections stay open, which they do when
the peer is paused (SIGSTOP) or cut off rather than killed. The main thread is then stuck inside C++ and runs no
signal handler, so no just-in-time snapshot can be taken. :func:`abort_process_group`, called from a watcher
thread, ends that wait:

* NCCL (and any backend with a real abort): ``ProcessGroup.abort()`` aborts the group's communicators, as
  torch's ``_abort_process_group`` and torchft do; the blocked CUDA wait returns with an error.
* gloo: torch's gloo backend accepts ``abort()`` but does not wake a collective already waiting (torch 2.13),
  so the group's TCP connections are shut down (``shutdown(2)``, the descriptors stay gloo's to close): gloo's
  event loop then sees the connection end, exactly as when the peer dies, and the collective raises
  ``RuntimeError`` on every thread waiting on the group.

gloo does not say which of the process's sockets are its own, so every established TCP connection of this
process is shut except those of the rendezvous store (``MASTER_PORT``, and any port in ``keep_ports``). In effect
every gloo group of the process is aborted with it (the helpers' gloo subgroups too): a worker aborts its group
when it is about to leave it (snapshot and exit, or rebuild its groups), and other clients it holds (an S3
connection pool) reconnect on their next request. The decision is :func:`connections_to_shut`, a
pure function of the socket table; the reading of ``/proc`` and the ``shutdown`` calls are the thin edges.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import torch.distributed as dist

from checkpoint.collective import mark_groups_aborted

logger = logging.getLogger(__name__)

TCP_ESTABLISHED = 0x01
TCP_CLOSE_WAIT = 0x08
"""Connection states (``/proc/net/tcp``'s ``st`` column) whose ``shutdown`` wakes a reader: a pair gloo
still reads from, or one whose peer already closed its side."""
_OPEN_STATES = frozenset({TCP_ESTABLISHED, TCP_CLOSE_WAIT})
_PROC_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")


class GroupAbortError(RuntimeError):
    """The process group could not be aborted (its connections could not be listed or shut)."""


@dataclass(frozen=True, slots=True)
class TcpConnection:
    """One TCP socket of this process, as the kernel's socket table lists it."""

    fd: int
    local_port: int
    remote_port: int
    state: int


@dataclass(frozen=True, slots=True)
class AbortReport:
    """What :func:`abort_process_group` did."""

    backend: str
    """The group's backend as ``torch.distributed.get_backend`` names it (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``)."""
    aborted: bool
    """``ProcessGroup.abort()`` was called (the NCCL communicators, where there are any, are aborted)."""
    connections_shut: int
    """TCP connections shut down for the gloo part of the group."""
    seconds: float


def parse_socket_table(text: str) -> dict[int, tuple[int, int, int]]:
    """``/proc/net/tcp`` (or ``tcp6``) as ``{inode: (local_port, remote_port, state)}``.

    Raises:
        GroupAbortError: a line does not have the kernel's layout.
    """
    table: dict[int, tuple[int, int, int]] = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if not fields:
            continue
        try:
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            table[int(inode)] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), int(state, 16))
        except (IndexError, ValueError) as exc:
            raise GroupAbortError(f"unexpected line in the kernel's TCP socket table: {line.strip()!r}") from exc
    return table


def socket_inodes(fd_targets: Mapping[int, str]) -> dict[int, int]:
    """``{inode: fd}`` of the sockets among ``fd_targets`` (``{fd: readlink(/proc/self/fd/fd)}``)."""
    inodes: dict[int, int] = {}
    for fd, target in fd_targets.items():
        if target.startswith("socket:[") and target.endswith("]"):
            inodes[int(target[len("socket:[") : -1])] = fd
    return inodes


def tcp_connections(fd_targets: Mapping[int, str], tables: Iterable[str]) -> list[TcpConnection]:
    """This process's TCP sockets: its socket descriptors joined with the kernel's tables by inode."""
    inodes = socket_inodes(fd_targets)
    found: list[TcpConnection] = []
    for text in tables:
        for inode, (local_port, remote_port, state) in parse_socket_table(text).items():
            fd = inodes.get(inode)
            if fd is not None:
                found.append(TcpConnection(fd, local_port, remote_port, state))
    return sorted(found, key=lambda c: c.fd)


def connections_to_shut(connections: Iterable[TcpConnection], keep_ports: Collection[int]) -> list[int]:
    """The descriptors to shut down so that gloo's waits end: every open connection (listening sockets and
    half-open ones are left) whose ends are both off ``keep_ports`` (the rendezvous store's, as client or host)."""
    return [
        c.fd for c in connections
        if c.state in _OPEN_STATES and c.local_port not in keep_ports and c.remote_port not in keep_ports
    ]


def store_ports(environ: Mapping[str, str], keep_ports: Iterable[int] = ()) -> set[int]:
    """The ports whose connections stay up: torch's ``MASTER_PORT`` (the store every group of the job uses)
    and ``keep_ports``."""
    ports = set(keep_ports)
    master = environ.get("MASTER_PORT", "")
    if master.isdigit():
        ports.add(int(master))
    return ports


def _read_connections() -> list[TcpConnection]:
    targets: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError as exc:
        raise GroupAbortError(f"cannot list this process's descriptors to abort a gloo group: {exc}") from exc
    for name in names:
        try:
            targets[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except (OSError, ValueError):  # closed meanwhile, or the listing's own descriptor
            continue
    tables: list[str] = []
    for path in _PROC_TABLES:
        try:
            with open(path, encoding="ascii") as f:
                tables.append(f.read())
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        except OSError as exc:
            raise GroupAbortError(f"cannot read {path} to abort a gloo group: {exc}") from exc
    return tcp_connections(targets, tables)


def shut_down(fds: Iterable[int]) -> int:
    """``shutdown(SHUT_RDWR)`` each descriptor, leaving it open (its owner closes it); returns how many were
    shut. A descriptor closed or reused for something else meanwhile is skipped."""
    count = 0
    for fd in fds:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:  # no longer connected
            pass
        finally:
            sock.detach()  # the descriptor is gloo's: never closed here
    return count


def abort_process_group(
    group: dist.ProcessGroup | None = None, *, keep_ports: Iterable[int] = (), environ: Mapping[str, str] | None = None
) -> AbortReport:
    """Make every collective of ``group`` (default: the default group) that is waiting, in any thread, raise,
    and every later one fail. Safe to call from a thread other than the one blocked; the group is unusable
    afterwards: destroy it and build a new one.

    Args:
        group: the group to abort; None for the default group.
        keep_ports: ports (besides ``MASTER_PORT``) whose TCP connections a gloo abort must leave up.
        environ: the environment to read ``MASTER_PORT`` from (default: ``os.environ``).

    Returns:
        What was done, and how long it took.

    Raises:
        GroupAbortError: there is no such group, or a gloo group's connections could not be listed.
    """
    began = time.perf_counter()
    pg = group if group is not None else dist.group.WORLD
    if pg is None or not isinstance(pg, dist.ProcessGroup):
        raise GroupAbortError("no process group to abort (the default group is not initialised)")
    backend = str(dist.get_backend(pg))
    # First: the checkpointer's and the memory tier's own groups start nothing more (a send issued on a gloo
    # pair already shut waits forever); what is in flight now fails on the shut connections below.
    mark_groups_aborted(dist.group.WORLD)
    shut = 0
    if "gloo" in backend:
        fds = connections_to_shut(_read_connections(), store_ports(os.environ if environ is None else environ, keep_ports))
        shut = shut_down(fds)
    # Also for gloo: later collectives then fail at once instead of on a shut connection.
    pg.abort()
    report = AbortReport(backend=backend, aborted=True, connections_shut=shut, seconds=time.perf_counter() - began)
    logger.warning("process group aborted (backend %s, %d connection(s) shut) in %.3f s", backend, shut, report.seconds)
    return report
