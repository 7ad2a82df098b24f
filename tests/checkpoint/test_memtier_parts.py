"""The memory tier's parts on plain data, without a tier: the interval (``cadence.Cadence``) and the votes
(``vote.Votes``) over a local ``Collective``."""

from __future__ import annotations

import pytest

from checkpoint.collective import Collective
from checkpoint.memory.cadence import Cadence
from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.slots import SLOTS
from checkpoint.memory.vote import PUBLISH_FAILURES_TO_STARVE, SKIP_BALLOT, Vote, Votes


def test_cadence_times_steps_without_the_staging_they_blocked_for() -> None:
    cadence = Cadence(MemoryTierConfig(every="auto"))
    cadence.clock_step(10.0)
    cadence.staged(0.25, 10.3)  # a snapshot blocked this step 0.25 s
    cadence.clock_step(11.0)
    cadence.clock_step(11.5)  # no snapshot in this step
    assert cadence.intervals == [0.75, 0.5]


def test_a_synchronous_snapshots_wait_counts_as_staging_for_the_interval_and_the_step_time() -> None:
    """``synchronous``: the wait for the publish and copies blocks the step like the staging, so ``every="auto"``
    must see it (else it stays at every step whatever the round costs) and the step time must not include it."""
    cadence = Cadence(MemoryTierConfig(every="auto", synchronous=True, overhead_target=0.02, max_every=100))
    for i in range(SLOTS):  # the first snapshots of a plan map their slots: not sampled, but still not step time
        cadence.staged(0.001, 10.0 * i + 0.2)
        cadence.blocked_more(0.5, 10.0 * i + 0.7)
    assert cadence.stages == [] and cadence.last_stage_seconds == pytest.approx(0.501)
    cadence.clock_step(100.0)
    cadence.staged(0.001, 100.2)
    cadence.blocked_more(0.05, 100.25)
    cadence.clock_step(100.4)
    assert cadence.stages == [pytest.approx(0.051)]
    assert cadence.intervals[-1] == pytest.approx(0.349), "the step without what the snapshot blocked"
    cadence.clock_step(100.5)
    assert cadence.propose() > 1, "0.051 s per snapshot is far over 2 % of a 0.1-0.35 s step"


def test_cadence_leaves_out_the_first_snapshots_of_a_plan() -> None:
    cadence = Cadence(MemoryTierConfig(every="auto"))
    for now in range(SLOTS + 1):
        cadence.staged(1.0 + now, float(now))
    assert cadence.stages == [1.0 + SLOTS]  # the first SLOTS mapped their slots
    cadence.replanned()
    cadence.staged(9.0, 9.0)
    assert cadence.stages == [] and cadence.last_stage_seconds == 9.0


def test_cadence_proposes_the_configured_interval_or_measures_first() -> None:
    assert Cadence(MemoryTierConfig(every=5)).propose() == 5
    auto = Cadence(MemoryTierConfig(every="auto", overhead_target=0.02, max_every=100))
    assert auto.propose() == 1  # nothing measured yet: keep snapshotting to measure
    auto.intervals, auto.stages = [0.1] * 8, [0.001, 0.5, 0.5]
    assert auto.propose() == 100  # 0.5 s per snapshot / (2 % of 0.1 s): capped at max_every
    auto.adopt(100, rank=0, step=7)
    assert auto.every == 100


def test_a_ballot_says_skipped_without_an_interval_and_starved_at_the_last_failed_publish() -> None:
    votes = Votes(Collective(), Collective())
    assert votes.ballot(False, None, None, 4) == SKIP_BALLOT
    assert votes.ballot(False, None, 3, 4) == (0, 0, -4, 3, 0)
    votes.publish_failures = PUBLISH_FAILURES_TO_STARVE - 1
    assert votes.ballot(False, OSError("injected"), 3, 4)[1] == 1  # this failure is the last one allowed
    assert votes.publish_done(failed=False) == 0


def test_a_ballot_that_raises_is_a_skip_inside_the_vote_behind() -> None:
    votes = Votes(Collective(), Collective())

    def broken(*_: object) -> tuple[int, ...]:
        raise ValueError("injected")

    votes.ballot = broken  # type: ignore[method-assign]
    votes.vote_behind(False, None, 3, 4)
    outcome = votes.take_outcome()
    assert outcome is not None and outcome.skipped and outcome.every == SKIP_BALLOT[3]
    assert votes.take_outcome() is None  # read once


def test_a_vote_behind_that_raises_leaves_no_outcome() -> None:
    behind = Collective()

    def broken(*_: int) -> tuple[int, ...]:
        raise RuntimeError("injected")

    behind.max_each = broken  # type: ignore[method-assign]
    votes = Votes(Collective(), behind)
    votes.outcome = Vote(False, False, 1, 1, 0.0)
    votes.vote_behind(False, None, 3, 4)
    assert votes.take_outcome() is None


@pytest.mark.parametrize("published", [-1, 6])
def test_a_vote_now_carries_what_this_rank_brings(published: int) -> None:
    votes = Votes(Collective(), Collective())
    votes.starved = True
    vote = votes.vote_now(bad=False, changed=True, busy=False, published=published, every=2)
    assert (vote.skipped, vote.changed, vote.busy, vote.starved, vote.complete, vote.every) == (
        False, True, False, True, published, 2)
    assert votes.blocking == 1
