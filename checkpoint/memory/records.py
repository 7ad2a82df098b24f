"""Restore records: how a worker tells its agent where its restore came from (``restore_completed`` events).

A worker that restored through ``checkpoint.memory.restore`` writes one small JSON file into its node's keeper
directory (``.restore-{rank}.json``, written to a temporary name and renamed); the agent, which owns the
directory, collects them every monitor tick, deletes them and emits one ``restore_completed`` event for its
local workers (:func:`summarize`). The keeper directory is the channel because the agent already owns it and
removes it at exit: no environment variable, port or file is added to the worker's world.

The agent trusts nothing it reads here: names are matched exactly, files are read up to :data:`MAX_BYTES`,
fields are type- and range-checked, and a bad file is deleted with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from checkpoint.memory.api import RestoreReport, RestoreSource
from checkpoint.recordfiles import read_record, record_names

logger = logging.getLogger(__name__)

MAX_BYTES: Final = 4096
MAX_FILES: Final = 4096
"""Most records one collection reads (a node has one per local rank)."""
_NAME = re.compile(r"\.restore-(\d{1,7})\.json")


@dataclass(frozen=True, slots=True)
class RestoreRecord:
    """One worker's restore, as its agent reads it back."""

    rank: int
    world_size: int
    source: RestoreSource
    step: int
    bytes: int
    seconds: float
    fallback: str | None = None
    """Why not from memory (a durable restore with the tier on), as the worker said it."""


def record_name(rank: int) -> str:
    return f".restore-{rank:05d}.json"


def write_restore_record(directory: str, rank: int, world_size: int, report: RestoreReport) -> None:
    """Worker side: leave ``report`` for the agent in ``directory`` (atomic; errors are logged, never raised)."""
    body = json.dumps({"rank": rank, "world_size": world_size, **report.to_json()}).encode()
    tmp = os.path.join(directory, f".restore-{rank:05d}-{secrets.token_hex(4)}.part")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(directory, record_name(rank)))
    except OSError as exc:
        logger.warning("[rank %d] cannot leave the restore record for the agent in %s: %s", rank, directory, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def parse_record(raw: bytes) -> RestoreRecord:
    """A record from a file's bytes; ValueError naming the problem otherwise (pure)."""
    if len(raw) > MAX_BYTES:
        raise ValueError(f"{len(raw)} bytes (at most {MAX_BYTES})")
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")

    def integer(key: str, low: int) -> int:
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{key}={v!r} is not an integer >= {low}")
        return v

    seconds = d.get("restore_seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < 1e7:
        raise ValueError(f"restore_seconds={seconds!r} is not a duration")
    try:
        source = RestoreSource(d.get("restore_source"))
    except ValueError:
        raise ValueError(f"restore_source={d.get('restore_source')!r} is unknown") from None
    world = integer("world_size", 1)
    rank = integer("rank", 0)
    if rank >= world:
        raise ValueError(f"rank {rank} of a world of {world}")
    fallback = d.get("restore_fallback")
    if fallback is not None and not isinstance(fallback, str):
        raise ValueError(f"restore_fallback={fallback!r} is not a string")
    return RestoreRecord(rank, world, source, integer("restore_step", 0), integer("restore_bytes", 0), float(seconds),
                         fallback)


def collect_restore_records(directory: str) -> list[RestoreRecord]:
    """Agent side: read and delete the records in ``directory`` (bad ones are deleted with a warning)."""
    out: list[RestoreRecord] = []
    for path in record_names(directory, _NAME, MAX_FILES):
        try:
            out.append(parse_record(read_record(path, MAX_BYTES)))
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the restore record %s: %s", path, exc)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
    return out


def snapshots_in(directory: str) -> bool:
    """True when ``directory`` (a keeper directory) holds a published snapshot: its workers use the tier."""
    from checkpoint.memory.layout import parse_snapshot_name

    try:
        with os.scandir(directory) as it:
            return any(parse_snapshot_name(e.name) is not None for e in it)
    except OSError:
        return False


def summarize(records: Sequence[RestoreRecord]) -> dict[str, object]:
    """The ``restore_completed`` event's fields for a node's records (pure): the source when all agree (else
    ``mixed`` with ``restore_sources``), the newest step, bytes summed, the slowest rank's seconds, and why
    memory was not used (``restore_fallback``) when a rank said so."""
    if not records:
        raise ValueError("no records")
    sources = sorted({r.source.value for r in records})
    fields: dict[str, object] = {
        "restore_source": sources[0] if len(sources) == 1 else "mixed",
        "restore_step": max(r.step for r in records),
        "restore_bytes": sum(r.bytes for r in records),
        "restore_seconds": round(max(r.seconds for r in records), 6),
        "ranks": sorted(r.rank for r in records),
    }
    if len(sources) > 1:
        fields["restore_sources"] = {str(r.rank): r.source.value for r in records}
    reasons = [r.fallback for r in sorted(records, key=lambda r: r.rank) if r.fallback]
    if reasons:
        fields["restore_fallback"] = reasons[0]  # the same sentence on every rank (one collective decided it)
    return fields
