"""Notice signals that arrive before the agent exists: its own imports, the forkserver's warm-up, the etcd connect.

A scheduler's notice comes whenever it comes (Slurm's ``--signal=TERM@N`` fires up to a minute early, spot
notices at any moment), also while ``spotrun`` is still importing torch. Python's default disposition would end
the process with -15 and the scheduler would count a failure; torch's own handler (installed only when workers
start) would end it with exit 1. Here the notice is *recorded* from the first line of the entry point
(:func:`arm`) and handed to the agent once it can act on it (:func:`take`): a node that has not joined a round
has nothing to save, so it leaves as a planned leave (exit 0, or ``--planned-leave-exit-code``).

A second notice signal before the agent takes over insists: the process ends as the unhandled signal would.

This module must not import torch (nor anything that does): it runs before the agent's imports.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any


@dataclass(frozen=True, slots=True)
class EarlyNotice:
    """A notice signal received before the agent could take it."""

    signum: int
    received_at: float
    """Wall-clock seconds (deadlines are wall-clock)."""


_pending: EarlyNotice | None = None
_previous: dict[int, Any] = {}


def _record(signum: int, frame: FrameType | None) -> None:
    global _pending
    if _pending is not None:
        # A second notice: the sender insists. End as the unhandled signal would (exit -signum).
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _pending = EarlyNotice(signum, time.time())


def arm(signums: Iterable[int] = (signal.SIGTERM,)) -> None:
    """Record the first of ``signums`` from now on (main thread only; a no-op elsewhere)."""
    try:
        for signum in signums:
            if signum not in _previous:
                _previous[signum] = signal.signal(signum, _record)
    except ValueError:  # not the main thread (an in-process caller's worker thread): leave signals alone
        pass


def pending() -> EarlyNotice | None:
    """The recorded notice, if any, left in place."""
    return _pending


def take() -> EarlyNotice | None:
    """The recorded notice, if any, once: the agent's own handlers take over from here."""
    global _pending
    notice, _pending = _pending, None
    return notice


def disarm() -> None:
    """Restore the dispositions :func:`arm` replaced (an in-process ``main()`` leaves none of ours behind)."""
    global _pending
    for signum, previous in list(_previous.items()):
        try:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        except ValueError:
            break
        del _previous[signum]
    _pending = None
