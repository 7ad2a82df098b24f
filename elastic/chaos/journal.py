"""The chaos journal: one JSON line per injected (or skipped) fault, with monotonic and wall time."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any


class Journal:
    """Appends records to a JSON-lines file, one ``O_APPEND`` write per line (same rule as events.jsonl, so
    :func:`elastic.events.read_events` reads it back)."""

    def __init__(self, path: str, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, record: str, **fields: Any) -> dict[str, Any]:
        """Append ``{"record": record, "t_mono", "t_wall", **fields}``; returns it."""
        line = {"record": record, "t_mono": self._clock(), "t_wall": self._wall_clock(), **fields}
        data = (json.dumps(line, default=str) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        return line
