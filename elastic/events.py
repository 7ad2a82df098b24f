"""Structured recovery events: one JSON object per line, appended by every agent to a shared file.

Each line carries ``event``, ``run_id``, ``node`` (the agent's node id, ``host-pid-suffix``: the name
``spotrun status`` lists, ``elastic.nodes``), ``round`` (rendezvous rounds this agent completed), ``t_mono``
(``time.monotonic()``, comparable across processes of one machine) and ``t_wall`` (Unix time, comparable across
machines with synced clocks) plus event-specific fields, so a recovery can be broken down stage by stage:
failure_detected -> workers_stopped -> rendezvous_started -> rendezvous_completed -> workers_started.

Where the file is by default (``default_events_path``), and how ``spotrun report`` finds a run's files again
(``find_events_files``), is decided here too.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic.api import RecoveryEvent
from elastic.nodes import host_name, node_id

logger = logging.getLogger(__name__)

EVENTS_FILE_NAME = "events.jsonl"
RUNS_DIR = os.path.join("spotrun", "runs")
"""Under ``$XDG_STATE_HOME`` (default ``~/.local/state``): one directory per run id, one per host inside it."""


def state_home(environ: Mapping[str, str] = os.environ) -> str:
    """``$XDG_STATE_HOME``, or ``~/.local/state`` when unset or not absolute (the XDG base directory rule)."""
    value = environ.get("XDG_STATE_HOME", "")
    if os.path.isabs(value):
        return value
    return os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".local", "state")


def run_events_dir(run_id: str, environ: Mapping[str, str] = os.environ) -> str:
    """Where the agents of run ``run_id`` keep their events when no ``--log-dir`` or ``--events-file`` is given:
    ``$XDG_STATE_HOME/spotrun/runs/<run id>``. The run id becomes one path component."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id) or "_"
    if safe.startswith("."):  # "." or "..": never a path step up, nor a hidden directory
        safe = "_" + safe
    return os.path.join(state_home(environ), RUNS_DIR, safe)


def default_events_path(run_id: str, log_dir: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The events file of an agent given no ``--events-file``: ``<log-dir>/events.jsonl`` with ``--log-dir``,
    else ``$XDG_STATE_HOME/spotrun/runs/<run id>/<host>/events.jsonl`` (one file per host: agents of one host
    append to it together, agents of different hosts never share a file, even on a shared home directory)."""
    if log_dir:
        return os.path.join(log_dir, EVENTS_FILE_NAME)
    return os.path.join(run_events_dir(run_id, environ), host_name(), EVENTS_FILE_NAME)


def find_events_files(run_id: str | None, log_dir: str | None, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The events files a run's agents wrote by default (``default_events_path``): ``<log-dir>/events.jsonl``
    when ``log_dir`` is given, else every host's file under the run's directory. Existing files only, sorted."""
    if log_dir:
        path = os.path.join(log_dir, EVENTS_FILE_NAME)
        return [path] if os.path.isfile(path) else []
    if not run_id:
        return []
    pattern = os.path.join(glob.escape(run_events_dir(run_id, environ)), "*", EVENTS_FILE_NAME)
    return sorted(path for path in glob.glob(pattern) if os.path.isfile(path))


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
