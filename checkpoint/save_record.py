"""Save records: how a worker's checkpointer tells its agent what it saved (``spotrun_checkpoint_*`` metrics).

Each rank's :class:`~checkpoint.checkpointer.Checkpointer` keeps one small JSON file in its node's keeper
directory (``SPOTRUN_MEMORY_DIR``, set by the spotrun agent; ``.saves-{rank}.json``), replaced whole (written to
a temporary name and renamed) after every save outcome: the last committed durable step and when it committed,
and cumulative counts of committed and failed saves, their seconds and bytes. The agent reads the files each
metrics tick (never deletes them: they are cumulative, so a missed read loses nothing) and turns them into
metrics (``elastic.vitals``). Without ``SPOTRUN_MEMORY_DIR`` (torchrun, a single process) nothing is written.

The keeper directory is the channel because the agent already owns it, reads the restore records there
(``checkpoint.memory.records``) and removes it at exit: no environment variable, port or file is added to the
worker's world.

The agent trusts nothing it reads here: names are matched exactly, files are read up to :data:`MAX_BYTES`,
fields are type- and range-checked (:func:`parse_save_record`), and a bad file is skipped with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Final

from checkpoint.memory.api import ENV_MEMORY_DIR
from checkpoint.recordfiles import read_record, record_names

logger = logging.getLogger(__name__)

MAX_BYTES: Final = 2048
"""A record is about 300 bytes; anything larger is not one of ours."""
MAX_FILES: Final = 4096
"""Most records one collection reads (a node has one per local rank)."""
_NAME = re.compile(r"\.saves-(\d{1,7})\.json")


@dataclass(frozen=True, slots=True)
class SaveRecord:
    """What one rank's checkpointer saved so far (cumulative over its process's life)."""

    rank: int
    pid: int
    """The writing process: a new pid means the counts started again from 0 (a restarted worker)."""
    durable_step: int | None = None
    """The last step this rank learned was committed to the durable tier (None: none yet in this process)."""
    durable_unix: float | None = None
    """Wall-clock time (Unix s) at which this rank learned that commit."""
    saves_committed: int = 0
    saves_failed: int = 0
    save_seconds_total: float = 0.0
    """Seconds from ``save()`` to the commit, summed over the committed saves."""
    save_bytes_total: int = 0
    """Bytes this rank wrote for its committed saves (its shards and per-rank objects)."""
    last_save_seconds: float | None = None


def record_name(rank: int) -> str:
    return f".saves-{rank:05d}.json"


def parse_save_record(raw: bytes) -> SaveRecord:
    """A record from a file's bytes; ValueError naming the problem otherwise (pure)."""
    if len(raw) > MAX_BYTES:
        raise ValueError(f"{len(raw)} bytes (at most {MAX_BYTES})")
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")

    def integer(key: str, *, optional: bool = False) -> Any:
        v = d.get(key)
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**62:
            raise ValueError(f"{key}={v!r} is not an integer >= 0")
        return v

    def number(key: str, *, optional: bool = False) -> Any:
        v = d.get(key)
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 1e12:
            raise ValueError(f"{key}={v!r} is not a finite number >= 0")
        return float(v)

    return SaveRecord(
        rank=integer("rank"), pid=integer("pid"), durable_step=integer("durable_step", optional=True),
        durable_unix=number("durable_unix", optional=True), saves_committed=integer("saves_committed"),
        saves_failed=integer("saves_failed"), save_seconds_total=number("save_seconds_total"),
        save_bytes_total=integer("save_bytes_total"), last_save_seconds=number("last_save_seconds", optional=True),
    )


def read_save_records(directory: str) -> list[SaveRecord]:
    """Agent side: every valid record in ``directory`` (a bad one is skipped with a warning, left in place)."""
    out: list[SaveRecord] = []
    for path in record_names(directory, _NAME, MAX_FILES):
        try:
            out.append(parse_save_record(read_record(path, MAX_BYTES)))
        except FileNotFoundError:
            continue  # its worker's directory went away between the listing and the read
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the save record %s: %s", path, exc)
    return out


class SaveRecorder:
    """Worker side: folds save outcomes into a :class:`SaveRecord` and leaves it for the agent.

    Called from the checkpointer's writer thread (one save in flight at a time) and, for a failure seen on
    the training thread, from there: a lock keeps the two apart. Never raises: a record that cannot be
    written is logged once and training goes on."""

    def __init__(self, rank: int, directory: str | None = None, *,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.directory = directory if directory is not None else os.environ.get(ENV_MEMORY_DIR)
        self.record = SaveRecord(rank=rank, pid=os.getpid())
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._warned = False

    def committed(self, step: int, seconds: float, nbytes: int) -> None:
        with self._lock:
            r = self.record
            self.record = replace(r, durable_step=step, durable_unix=self._wall_clock(),
                                  saves_committed=r.saves_committed + 1,
                                  save_seconds_total=r.save_seconds_total + max(0.0, seconds),
                                  save_bytes_total=r.save_bytes_total + max(0, nbytes),
                                  last_save_seconds=max(0.0, seconds))
            self._write()

    def failed(self) -> None:
        with self._lock:
            self.record = replace(self.record, saves_failed=self.record.saves_failed + 1)
            self._write()

    def _write(self) -> None:
        if self.directory is None:
            return
        r = self.record
        body = json.dumps(asdict(r)).encode()
        tmp = os.path.join(self.directory, f".saves-{r.rank:05d}-{secrets.token_hex(4)}.part")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
            os.rename(tmp, os.path.join(self.directory, record_name(r.rank)))
        except OSError as exc:
            if not self._warned:
                logger.warning("[rank %d] cannot leave the save record for the agent in %s: %s (said once)",
                               r.rank, self.directory, exc)
                self._warned = True
            with contextlib.suppress(OSError):
                os.unlink(tmp)
