"""Test doubles of the elastic contracts (kept out of the shipped package)."""

from __future__ import annotations

from typing import Any

from elastic.api import RecoveryEvent


class MemoryEventLog:
    """An ``EventSink`` that keeps events in a list."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def emit(self, event: RecoveryEvent, **fields: Any) -> None:
        self.records.append({"event": event.value, **fields})
