"""The load fallback's decisions, called directly (no storage, no process group)."""

from __future__ import annotations

import pytest

from checkpoint.api import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from checkpoint.fallback import Action, LoadOutcome, classify, decide, load_with_fallback

pytestmark = pytest.mark.timeout(30)


def test_classify_damage_versus_failure() -> None:
    assert classify(None) == LoadOutcome.OK
    assert classify(CorruptCheckpointError("bad block")) == LoadOutcome.DAMAGED
    assert classify(CheckpointNotFoundError("deleted meanwhile")) == LoadOutcome.DAMAGED
    for error in (IncompatibleCheckpointError("dtype"), CheckpointStorageError("unreachable"), ValueError("x")):
        assert classify(error) == LoadOutcome.FAILED
    assert max(LoadOutcome.OK, LoadOutcome.DAMAGED, LoadOutcome.FAILED) == LoadOutcome.FAILED


@pytest.mark.parametrize(
    ("worst", "named", "action"),
    [
        (LoadOutcome.OK, False, Action.DONE),
        (LoadOutcome.OK, True, Action.DONE),
        (LoadOutcome.DAMAGED, False, Action.TRY_OLDER),
        (LoadOutcome.DAMAGED, True, Action.RAISE),
        (LoadOutcome.FAILED, False, Action.RAISE),
        (LoadOutcome.FAILED, True, Action.RAISE),
    ],
)
def test_decide(worst: LoadOutcome, named: bool, action: Action) -> None:
    assert decide(worst, step_named=named) is action


def run(errors: dict[int, BaseException], steps: list[int], *, named: bool = False, others: LoadOutcome = LoadOutcome.OK):
    tried: list[int] = []

    def attempt(step: int) -> None:
        tried.append(step)
        if step in errors:
            raise errors[step]

    def older(below: int) -> int | None:
        return max((s for s in steps if s < below), default=None)

    loaded = load_with_fallback(
        steps[-1], step_named=named, attempt=attempt, worst=lambda mine: max(mine, others), older_step=older, where="mem"
    )
    return loaded, tried


def test_damaged_steps_fall_back_to_the_newest_good_one() -> None:
    loaded, tried = run({30: CorruptCheckpointError("x"), 20: CheckpointNotFoundError("gone")}, [10, 20, 30])
    assert (loaded, tried) == (10, [30, 20, 10])


def test_failure_or_named_step_raises_without_fallback() -> None:
    with pytest.raises(IncompatibleCheckpointError):
        run({30: IncompatibleCheckpointError("x")}, [10, 20, 30])
    with pytest.raises(CorruptCheckpointError):
        run({30: CorruptCheckpointError("x")}, [10, 20, 30], named=True)


def test_no_older_step_raises_the_damage() -> None:
    with pytest.raises(CorruptCheckpointError, match="x"):
        run({10: CorruptCheckpointError("x")}, [10])


def test_another_ranks_failure_is_raised_here_too() -> None:
    with pytest.raises(CheckpointError, match="loading step 30 failed on another rank"):
        run({}, [10, 20, 30], others=LoadOutcome.FAILED)
