"""The snapshot votes: one small all-reduce per round, so that every rank acts alike.

A vote carries whether a rank skipped (its items changed, a local failure), is busy, is starved (no room, failed
publishes), the newest step it published (the minimum, ``complete``, is the step a restore may use and whose
slot is never overwritten) and its proposed interval (the largest wins). It runs on the caller's thread when
something changed (``now``), or with ``when_busy="wait"`` behind a round, on the background thread right after
the publish, over the tier's own group (``behind``), so that in steady state the caller blocks for no collective.
A local failure is a vote ("skipped"), never a rank out of step; a vote that *raises* leaves the rank without the
others' outcome, and the tier then joins no further vote.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from checkpoint.collective import Collective

logger = logging.getLogger(__name__)

PUBLISH_FAILURES_TO_STARVE = 3
"""Consecutive failed publishes after which a rank turns the tier off at the next vote (as when it has no room)."""
SKIP_BALLOT = (1, 0, 1, 1, 0)
"""A rank's part of a vote behind a round when it could not build its own: "skipped", so the next snapshot votes
on the caller's thread on every rank, which reads nothing else of this vote."""


@dataclass(frozen=True, slots=True)
class Vote:
    """What a vote agreed, the same on every rank."""

    skipped: bool
    """A rank could not take part (now: its state could not be flattened or the interval chosen; behind: a rank
    skipped the round, so the next round votes first)."""
    starved: bool
    complete: int
    """The newest step every rank had published (its slot is never overwritten)."""
    every: int
    waited: float
    """Seconds this rank's vote waited for slower ranks (not snapshot cost)."""
    changed: bool = False
    """Now only: a rank's items changed since the plan (every rank replans)."""
    busy: bool = False
    """Now only: a rank's last snapshot is still being published (``when_busy="skip"``)."""


class Votes:
    """The tier's two vote groups and what this rank brings to a vote (starved, failed publishes)."""

    def __init__(self, now: Collective, behind: Collective) -> None:
        self.now, self.behind = now, behind
        """``now``: the caller's thread's collectives; ``behind``: the votes that run behind a snapshot."""
        self.starved = False
        """This rank has no room (or its publishes keep failing): its next vote turns the tier off everywhere."""
        self.publish_failures = 0
        """Consecutive failed publishes of this rank (PUBLISH_FAILURES_TO_STARVE starve it)."""
        self.complete = -1
        """The newest step every rank had published at the last vote."""
        self.blocking = 0
        """Votes this rank ran on the caller's thread."""
        self.due = False
        """The last round ran a vote behind its publish: the next snapshot reads it (same on every rank)."""
        self.outcome: Vote | None = None
        """The vote behind's outcome, set by the background thread (None: it raised on this rank)."""
        self.last_us = 0
        """Microseconds this rank's last vote on the caller's thread took (its wait for slower ranks included)."""
        self.behind_us = 0

    def vote_now(self, *, bad: bool, changed: bool, busy: bool, published: int, every: int) -> Vote:
        """A vote on the caller's thread (raises what the collective raises)."""
        started = time.perf_counter()
        any_bad, any_changed, any_busy, starved, neg_complete, chosen, neg_vote_us = self.now.max_each(
            bad, changed, busy, self.starved, -published, every, -self.last_us,
        )
        self.blocking += 1
        self.last_us = int(1e6 * (time.perf_counter() - started))
        # The vote's cost is its own latency (the last rank to arrive waits for nothing: the smallest of the ranks'
        # previous votes), not the wait for a slower rank, which its next gradient all-reduce would wait anyway.
        waited = max(0.0, self.last_us - (-neg_vote_us)) / 1e6
        return Vote(bool(any_bad), bool(starved), -neg_complete, int(chosen), waited, bool(any_changed), bool(any_busy))

    def ballot(self, skipped: bool, error: BaseException | None, every: int | None, published: int) -> tuple[int, ...]:
        """This rank's part of the vote behind a round; "skipped" without an interval to propose."""
        if every is None:
            return SKIP_BALLOT
        failing = error is not None and self.publish_failures + 1 >= PUBLISH_FAILURES_TO_STARVE
        return int(skipped), int(self.starved or failing), -published, every, -self.behind_us

    def vote_behind(self, skipped: bool, error: BaseException | None, every: int | None, published: int) -> None:
        """Background, after a round's publish: the next round's vote. Every rank enters it: a rank that cannot
        build its ballot votes ``SKIP_BALLOT``. A vote that raises leaves ``outcome`` None."""
        try:
            ballot = self.ballot(skipped, error, every, published)
        except Exception as exc:  # noqa: BLE001 - still a vote, or the other ranks would wait for this one
            logger.warning("[rank %d] memory snapshot ballot failed, voting to skip the next round: %s",
                           self.behind.rank, exc)
            ballot = SKIP_BALLOT
        started = time.perf_counter()
        try:
            any_skipped, starved, neg_complete, chosen, neg_vote_us = self.behind.max_each(*ballot)
        except Exception as exc:  # noqa: BLE001 - whether the others got an outcome is unknown
            logger.warning("[rank %d] memory snapshot vote failed: %s", self.behind.rank, exc)
            self.outcome = None
            return
        self.behind_us = int(1e6 * (time.perf_counter() - started))
        waited = max(0.0, self.behind_us - (-neg_vote_us)) / 1e6
        self.outcome = Vote(bool(any_skipped), bool(starved), -neg_complete, int(chosen), waited)

    def take_outcome(self) -> Vote | None:
        """The vote behind the last round (read once)."""
        vote, self.outcome = self.outcome, None
        return vote

    def publish_done(self, failed: bool) -> int:
        """Count consecutive failed publishes; returns the count."""
        self.publish_failures = self.publish_failures + 1 if failed else 0
        return self.publish_failures
