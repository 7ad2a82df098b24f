"""Test doubles of the elastic contracts (kept out of the shipped package)."""

from __future__ import annotations

from typing import Any

import grpc

from elastic.api import RecoveryEvent


class FakeRpcError(grpc.RpcError):
    """A grpc failure as a call or a stream raises it (the etcd client classifies it by code and details)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class MemoryEventLog:
    """An ``EventSink`` that keeps events in a list."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def emit(self, event: RecoveryEvent, **fields: Any) -> None:
        self.records.append({"event": event.value, **fields})
