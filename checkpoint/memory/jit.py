"""Just-in-time snapshots: after a collective fails (a peer died mid-step), survivors snapshot the last completed step.

Why: with ``every = k > 1`` a node loss would send the job back up to ``k`` steps (to the last periodic
snapshot). But when a peer dies mid-step, the survivors' collective raises (gloo: ``Connection closed by peer``
within ~0.05 s of a SIGKILL) *before* their optimizer step: their model, optimizer and data cursor are still
those of the last completed step. Snapshotting them then costs one staging copy and loses nothing (Microsoft's
just-in-time checkpointing, Gemini's failure-time dump). ``LocalShmTier.snapshot_on_failure`` does it without a
collective (the group is broken): each rank writes the same pieces as for a periodic snapshot (its share of its
node's copy, ``layout.node_writers``), publishes it, and waits briefly for its node's other ranks, so that the
first worker to exit (which makes the agent stop the rest) leaves a whole node copy behind.

The contract a loop must keep for this to be exact: at the point a collective can fail, the state passed in is
that of ``step`` (the loop increments its step counter only after ``optimizer.step()`` and advancing the data
cursor, with no collective in between). ``examples/train_ddp.py`` is such a loop. Only failures that name a
broken collective are snapshotted (:func:`is_collective_failure`); any other exception (a bug in the loop, a
NaN check) might have left the state half-updated and is re-raised untouched.

Bounds: the agent stops the remaining workers with SIGTERM and, ``--stop-grace`` (3 s) later, SIGKILL. While it
writes, the worker defers SIGTERM/SIGINT (:class:`DeferredSignals`, re-delivered after), so the snapshot is cut
short only by that SIGKILL; an unfinished snapshot is never published (a restore falls back to the previous one).
A silent peer loss (power off, partition: no connection reset) leaves the collective blocked until the agent
stops it: the restore then uses the last periodic snapshot.

Pure helpers here; the tier's side is in ``shm.LocalShmTier.snapshot_on_failure``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType, TracebackType
from typing import Any, Final

from checkpoint.collective import GroupsAbortedError
from checkpoint.memory.api import SnapshotId
from checkpoint.memory.layout import snapshot_name

logger = logging.getLogger(__name__)

FAILURE_WORDS: Final = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "gloo",
    "nccl",
    "timed out",
    "timeout",
)
"""Lower-case words that mark a ``RuntimeError`` as a broken collective (gloo raises plain RuntimeErrors:
``[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:36072``)."""
DEFERRED: Final = (signal.SIGTERM, signal.SIGINT)
"""Signals held back while a just-in-time snapshot is written (the agent's stop signal and Ctrl-C)."""


def is_collective_failure(exc: BaseException | None) -> bool:
    """True when ``exc`` (or an exception it was raised from) is a failed collective: torch's ``DistError``
    family, a collective refused on aborted groups (``GroupsAbortedError``), or a ``RuntimeError`` whose
    message names the transport (gloo, NCCL, a closed or reset connection, a timeout)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _is_dist_error(exc) or isinstance(exc, GroupsAbortedError):
            return True
        if isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in FAILURE_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _is_dist_error(exc: BaseException) -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - the tier always has torch
        return False
    kinds = tuple(k for k in (getattr(dist, "DistError", None),) if isinstance(k, type))
    return bool(kinds) and isinstance(exc, kinds)


def node_group_names(snap: SnapshotId, ranks: Iterable[int], world_size: int) -> list[str]:
    """File names the node's ranks publish for ``snap`` (pure)."""
    return [snapshot_name(snap, rank, world_size) for rank in sorted(ranks)]


def missing_names(directory: str, names: Iterable[str]) -> list[str]:
    """Which of ``names`` are not (yet) in ``directory``."""
    try:
        present = set(os.listdir(directory))
    except OSError:
        return list(names)
    return [n for n in names if n not in present]


def wait_for_names(directory: str, names: list[str], timeout: float, *, poll: float = 0.01,
                   gone: Callable[[str], bool] | None = None) -> list[str]:
    """Poll ``directory`` until every one of ``names`` is there or ``timeout`` seconds pass; returns the missing.

    ``gone(name)``: True when the name's writer is known to be dead (it will never publish), so the wait ends as
    soon as every missing name is gone (still returned as missing): a crashed rank of the node must not hold its
    survivors for the whole ``timeout``."""
    deadline = time.monotonic() + timeout
    missing = missing_names(directory, names)
    while missing and time.monotonic() < deadline:
        if gone is not None and all(gone(n) for n in missing):
            break
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        missing = missing_names(directory, missing)
    return missing


class DeferredSignals:
    """Hold back SIGTERM and SIGINT for the duration of a ``with`` block (main thread only; elsewhere a no-op)
    and deliver what arrived, to the handlers that were installed before, when the block ends.

    Python runs signal handlers in the main thread whatever thread the kernel picked, so replacing the Python-
    level handler is enough: a worker's background threads (gloo, the tier's publisher) keep running."""

    def __init__(self, signals: Iterable[signal.Signals] = DEFERRED) -> None:
        self._signals = tuple(signals)
        self._previous: dict[signal.Signals, Any] = {}
        self.received: list[signal.Signals] = []

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signal.Signals(signum))

    def __enter__(self) -> DeferredSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self._signals:
            try:
                self._previous[sig] = signal.signal(sig, self._hold)
            except (ValueError, OSError):  # pragma: no cover - not settable here
                continue
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        for sig in dict.fromkeys(self.received):  # each once, in arrival order
            logger.info("delivering %s held back during the just-in-time snapshot", sig.name)
            os.kill(os.getpid(), sig)
