"""Load fallback: when loading the chosen step fails on some rank, decide whether to fall back to an older
step (pure decisions), and the retry loop that applies them (I/O injected, so tests call it directly).

Rules: a step whose *data* is damaged (CorruptCheckpointError, or CheckpointNotFoundError when retention
deleted it meanwhile) makes every rank fall back to the next older good step, so a job that keeps
restarting is not stuck on one bad checkpoint. Anything else (wrong state, unsupported format or dtype,
storage unreachable) fails the load: an older step would not help, or would silently lose progress. A
step the caller named is loaded or raises. All ranks take the same branch: each classifies its own error,
the worst over ranks (``Collective.max``) decides.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

from checkpoint.api import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError

logger = logging.getLogger(__name__)


class LoadOutcome(enum.IntEnum):
    """A load attempt's outcome on one rank, ordered so the max over ranks is the worst."""

    OK = 0
    DAMAGED = 1
    """The step's data is damaged or gone: an older step may do."""
    FAILED = 2
    """Anything else: an older step would not help."""


class Action(enum.Enum):
    """What every rank does after a load attempt."""

    DONE = "done"
    RAISE = "raise"
    TRY_OLDER = "try_older"


def classify(error: BaseException | None) -> LoadOutcome:
    """This rank's outcome of one load attempt."""
    if error is None:
        return LoadOutcome.OK
    if isinstance(error, (CorruptCheckpointError, CheckpointNotFoundError)):  # NotFound: deleted meanwhile
        return LoadOutcome.DAMAGED
    return LoadOutcome.FAILED


def decide(worst: LoadOutcome, *, step_named: bool) -> Action:
    """The action for the worst outcome over ranks; a step the caller named never falls back."""
    if worst == LoadOutcome.OK:
        return Action.DONE
    if worst == LoadOutcome.FAILED or step_named:
        return Action.RAISE
    return Action.TRY_OLDER


def load_with_fallback(
    first: int,
    *,
    step_named: bool,
    attempt: Callable[[int], None],
    worst: Callable[[LoadOutcome], LoadOutcome],
    older_step: Callable[[int], int | None],
    where: str,
    rank: int = 0,
) -> int:
    """Load ``first`` with ``attempt(step)``; on damage found anywhere fall back to older steps. Returns the
    step loaded; raises this rank's error (or a CheckpointError naming the other rank's failure).

    ``worst(mine)`` is the worst outcome over ranks and ``older_step(below)`` rank 0's choice of the newest
    good step below ``below`` on every rank (both collective).
    """
    chosen = first
    while True:
        error: BaseException | None = None
        try:
            attempt(chosen)
        except Exception as exc:  # noqa: BLE001 - voted on below, then re-raised or recovered from
            error = exc
        action = decide(worst(classify(error)), step_named=step_named)
        if action == Action.DONE:
            return chosen
        if action == Action.RAISE:
            if error is not None:
                raise error
            raise CheckpointError(f"rank {rank}: loading step {chosen} failed on another rank (see its error)")
        older = older_step(chosen)
        if older is None:
            if error is not None:
                raise error
            raise CorruptCheckpointError(
                f"step {chosen} at {where} is damaged (see the failing rank's error) and no older good step exists"
            )
        logger.warning(
            "[rank %d] step %d at %s is damaged (%s); falling back to step %d",
            rank,
            chosen,
            where,
            error if error is not None else "found by another rank",
            older,
        )
        chosen = older
