"""The agent's report of the memory tier's restores: one ``restore_completed`` event per node and worker start.

Each local worker leaves a restore record in the keeper directory (``checkpoint.memory.records``, the channel
from the workers); the agent reports them together once every local worker left one, or
:data:`RESTORE_REPORT_WAIT` seconds after the first (a slow rank must not hold the others' report), or when it
stops the workers.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from checkpoint.memory.records import RestoreRecord, collect_restore_records, summarize
from elastic.agent_hooks import PROCEED, AgentFeature, AgentHost, Tick, Verdict, WorkersStopping
from elastic.api import RecoveryEvent

RESTORE_REPORT_WAIT = 5.0
"""Seconds after the first local worker's restore record the agent reports the ones it has (the others late)."""


class RestoreReports(AgentFeature):
    """Collects the local workers' restore records from ``memory_dir`` and emits ``restore_completed``."""

    def __init__(self, memory_dir: str, host: AgentHost, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._memory_dir = memory_dir
        self._host = host
        self._clock = clock
        self._records: list[RestoreRecord] = []
        """Restore records of the local workers not yet reported."""
        self._first_seen: float | None = None

    def on_tick(self, tick: Tick) -> Verdict:
        self.report()
        return PROCEED

    def on_workers_stopping(self, event: WorkersStopping) -> None:
        self.report(flush=True)

    def report(self, *, flush: bool = False) -> None:
        """Emit the records collected so far once complete (or after the wait, or when ``flush``)."""
        self._records.extend(collect_restore_records(self._memory_dir))
        if not self._records:
            return
        now = self._clock()
        if self._first_seen is None:
            self._first_seen = now
        waiting = len({r.rank for r in self._records}) < self._host.worker_group.spec.local_world_size
        if waiting and not flush and now - self._first_seen < RESTORE_REPORT_WAIT:
            return
        self._host.emit(RecoveryEvent.RESTORE_COMPLETED, **summarize(self._records))
        self._records, self._first_seen = [], None
