"""One name per agent: the etcd-v3 rendezvous registers under it, ``spotrun status`` lists it, the agent's
``events.jsonl`` lines carry it and ``spotrun report`` shows it. A leaf: the rendezvous and the event log both
import it."""

from __future__ import annotations

import os
import re
import socket
import uuid

__all__ = ["host_name", "node_id", "node_pid"]


def host_name() -> str:
    """This host's short name, reduced to characters safe in a node id, a path and an etcd key."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname().split(".")[0]) or "host"


def node_id() -> str:
    """A new agent identity: host, agent PID (several agents may share a host) and a random suffix (a PID is
    reused across restarts of a container). The etcd-v3 rendezvous registers under it, ``spotrun status`` lists
    it and the agent's events carry it, so one node has one name everywhere."""
    return f"{host_name()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


_NODE_ID = re.compile(r"(?P<host>.+)-(?P<pid>\d+)-(?P<suffix>[0-9a-f]{6})")


def node_pid(node: str) -> int | None:
    """The agent PID in a node id: ``host-pid-suffix`` (:func:`node_id`), or ``host:pid`` in the events of
    spotrun before one name was used everywhere; None for anything else."""
    if (match := _NODE_ID.fullmatch(node)) is not None:
        return int(match.group("pid"))
    host, sep, pid = node.rpartition(":")
    return int(pid) if sep and host and pid.isdigit() else None
