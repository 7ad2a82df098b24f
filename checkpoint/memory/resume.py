"""Restore order, in one place: the newest memory snapshot every rank can read, else the durable tier.

    from checkpoint.memory import LocalShmTier, restore
    tier = LocalShmTier()                       # after init_process_group, on every rank (collective)
    report = restore(ckpt, state, memory=tier)  # instead of ckpt.load(state)
    ...
        tier.snapshot(step, state)              # every step; acts every config.every steps

A memory snapshot is used only when it is not older than the newest committed durable step (a planned save
at a notice is newer than the last snapshot). A snapshot that fails its checks on any rank is skipped, like a
corrupt durable step; when none is left the durable tier is loaded (``Checkpointer.load``, with its own
fallback to older steps). The returned :class:`~checkpoint.memory.api.RestoreReport` says which source, step,
bytes and seconds: the examples add it to their progress lines (``restore_source``...).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from checkpoint.memory.api import (
    ENV_MEMORY_DIR,
    DurableTier,
    ExplainsFallback,
    KeeperTier,
    MemoryTier,
    PartialRestoreError,
    RestoreReport,
    RestoreSource,
)
from checkpoint.memory.records import write_restore_record

logger = logging.getLogger(__name__)

FALLBACK_MAX_CHARS = 1000
"""Longest ``restore_fallback`` a report carries (the agent reads restore records of at most 4 KiB)."""


def restore(ckpt: DurableTier | None, state: Mapping[str, Any], *, memory: MemoryTier | None) -> RestoreReport | None:
    """Restore ``state`` from memory, else from ``ckpt``; None (state untouched) when neither has a step.

    Under the spotrun agent the report also reaches the agent (``restore_completed`` in events.jsonl,
    ``checkpoint.memory.records``).

    Collective: every rank calls it with the same arguments' kinds (both tiers present or absent everywhere).
    Raises what ``Checkpointer.load`` raises, and PartialRestoreError when a memory restore failed after
    overwriting part of the state and the durable tier has nothing to restore it with.
    """
    report = _restore(ckpt, state, memory=memory)
    if report is not None:
        _tell_agent(report, memory)
    return report


def _tell_agent(report: RestoreReport, memory: MemoryTier | None) -> None:
    keeper = memory if isinstance(memory, KeeperTier) else None
    directory = (keeper.directory if keeper is not None else None) or os.environ.get(ENV_MEMORY_DIR)
    if not directory or not os.path.isdir(directory):
        return  # not under spotrun: nobody to tell
    if keeper is not None:
        rank, world = keeper.rank, keeper.world_size
    else:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    write_restore_record(directory, rank, world, report)


def _restore(ckpt: DurableTier | None, state: Mapping[str, Any], *, memory: MemoryTier | None) -> RestoreReport | None:
    started = time.perf_counter()
    floor = ckpt.latest() if ckpt is not None else None
    partial: PartialRestoreError | None = None
    fallback: str | None = None
    if memory is not None:
        try:
            report = memory.restore(state, not_older_than=floor)
        except PartialRestoreError as exc:
            partial, report = exc, None
        if report is not None:
            return report
        # Said in the durable report (restore_fallback), so that the agent's event says why memory was not used.
        fallback = (str(partial) if partial is not None
                    else memory.last_fallback_reason if isinstance(memory, ExplainsFallback) else None)
    if ckpt is None:
        if partial is not None:
            raise partial
        return None
    step = ckpt.load_durable(state)
    if step is None:
        if partial is not None:
            raise partial
        return None
    report = RestoreReport(RestoreSource.DURABLE, step, ckpt.last_load_bytes, time.perf_counter() - started,
                           fallback=fallback[:FALLBACK_MAX_CHARS] if fallback else None)
    logger.info("[rank %d] restored step %d from the durable tier (%d bytes, %.3fs)%s", ckpt.rank, step, report.bytes,
                report.seconds, f"; not from memory: {report.fallback}" if report.fallback else "")
    return report
