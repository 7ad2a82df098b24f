"""Structured recovery events: one JSON object per line, appended by every agent to a shared file.

Each line carries ``event``, ``run_id``, ``node`` (``host:agent_pid``), ``round`` (rendezvous rounds this
agent completed), ``t_mono`` (``time.monotonic()``, comparable across processes of one machine) and
``t_wall`` (Unix time, comparable across machines with synced clocks) plus event-specific fields, so a
recovery can be broken down stage by stage: failure_detected -> workers_stopped -> rendezvous_started ->
rendezvous_completed -> workers_started.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic.api import RecoveryEvent

logger = logging.getLogger(__name__)


def node_id() -> str:
    """Identity of this agent in events: host name and agent PID (several agents may share a host)."""
    return f"{socket.gethostname()}:{os.getpid()}"


class JsonlEventLog:
    """Appends events to a JSON-lines file; each line is written with one ``O_APPEND`` write so agents that
    share the file (several agents on one host) never interleave within a line."""

    def __init__(
        self,
        path: str,
        *,
        run_id: str,
        node: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self._run_id = run_id
        self._node = node or node_id()
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def emit(self, event: RecoveryEvent, **fields: Any) -> None:
        record = {
            "event": event.value,
            "run_id": self._run_id,
            "node": self._node,
            "t_mono": self._clock(),
            "t_wall": self._wall_clock(),
            **fields,
        }
        line = (json.dumps(record, default=str, sort_keys=False) + "\n").encode()
        with self._lock:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
            except OSError:
                # Losing an event must never take the job down; say so once per failure.
                logger.warning("[%s] could not append %s to %s", self._node, event.value, self.path, exc_info=True)


def read_events(path: str) -> list[dict[str, Any]]:
    """All complete events in ``path``, in file order (a line still being appended, or one that is not valid
    JSON, is skipped).

    Public: ``events.jsonl`` is an interface (event names and fields are only ever added to), and this is
    its reader for reports and tools; missing file -> no events.

    Args:
        path: an ``events.jsonl`` file (or a ``spotrun-chaos`` journal: same format).

    Returns:
        One dict per complete line, in file order; ``[]`` when the file does not exist.

    Raises:
        OSError: the file exists but cannot be read.
    """
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return []
    out = []
    # A damaged line (a byte that is not UTF-8, JSON nested past the parser's depth, a torn write) costs that
    # line only: bytes are split first, and each line decoded on its own.
    for line in data.splitlines():
        try:
            out.append(json.loads(line.decode("utf-8", errors="replace")))
        except (ValueError, RecursionError):
            continue
    return out
