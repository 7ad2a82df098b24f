"""Warnings said once per key: a broken ``/dev/shm`` or a failing publish would otherwise warn at every step."""

from __future__ import annotations

import logging
from typing import Any


class WarnOnce:
    """The keys already warned about, shared by the tier's parts."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.said: set[str] = set()

    def first(self, key: str) -> bool:
        """True the first time ``key`` is seen (and marks it said)."""
        if key in self.said:
            return False
        self.said.add(key)
        return True

    def warn(self, key: str, message: str, *args: Any) -> None:
        if self.first(key):
            self.logger.warning(message, *args)
