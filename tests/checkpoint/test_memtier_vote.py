"""The memory tier's vote behind a snapshot (``vote.Votes.vote_behind``): with ``when_busy="wait"`` a round's
vote runs on the background thread after its publish, and the next snapshot reads it instead of voting on the
caller's thread. These tests check that this changes when the caller blocks, not what a restore may use: only a
step every rank published, never one a rank skipped or failed to publish.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from checkpoint.memory.config import MemoryTierConfig
from checkpoint.memory.layout import parse_snapshot_name
from checkpoint.memory.shm import LocalShmTier
from tests.checkpoint.test_memtier import _assert_equal, _state, _tensors, _train, shm_dir  # noqa: F401 - fixture
from tests.harness.dist import run_workers


def _published(directory: str) -> dict[int, set[int]]:
    """Step -> the ranks whose snapshot of it is published in ``directory``."""
    out: dict[int, set[int]] = {}
    for name in os.listdir(directory):
        parsed = parse_snapshot_name(name)
        if parsed is not None:
            out.setdefault(parsed[0].step, set()).add(parsed[1])
    return out


def _reference(step: int) -> dict[str, torch.Tensor]:
    state = _state(0)
    for s in range(1, step + 1):
        _train(state, s)
    return _tensors(state)


def _restored(directory: str) -> tuple[int | None, dict[str, Any]]:
    fresh = _state(1)
    tier = LocalShmTier(directory)
    try:
        report = tier.restore(fresh, not_older_than=None)
    finally:
        tier.close()
    return (None if report is None else report.step), fresh


# --------------------------------------------------------------------------- steady rounds
def _snapshot_steps(tier: LocalShmTier, state: dict[str, Any], last: int = 6) -> list[bool]:
    """Train and snapshot steps 1..``last``, then wait for the last publish; what each ``snapshot`` returned."""
    taken = []
    for step in range(1, last + 1):
        _train(state, step)
        taken.append(tier.snapshot(step, state))
    tier.wait()
    return taken


def _steady(rank: int, world: int, directory: str) -> dict[str, Any]:
    state = _state(0)
    tier = LocalShmTier(directory, MemoryTierConfig(every=1))
    try:
        return {"taken": _snapshot_steps(tier, state), "votes": tier.votes_blocking}
    finally:
        tier.close()


def test_steady_snapshots_vote_on_the_callers_thread_only_once(shm_dir: str, tmp_path: Path) -> None:  # noqa: F811
    out = run_workers(_steady, 2, (shm_dir,), tmpdir=str(tmp_path), timeout=120)
    assert [o["taken"] for o in out] == [[True] * 6] * 2
    assert [o["votes"] for o in out] == [1, 1]  # the first snapshot plans; the others read the vote behind
    steps = _published(shm_dir)
    assert steps == {5: {0, 1}, 6: {0, 1}}  # two slots per rank: the complete step and the newest
    step, fresh = _restored(shm_dir)
    assert step == 6
    _assert_equal(_tensors(fresh), _reference(6))


# --------------------------------------------------------------------------- a publish fails on one rank
def _one_rank_fails(rank: int, world: int, directory: str) -> dict[str, Any]:
    state = _state(0)
    tier = LocalShmTier(directory, MemoryTierConfig(every=1))
    publish = tier.publisher.publish

    def failing(slot: Any, step: int, *args: Any) -> int:
        if rank == 1 and step >= 3:  # rank 1 dies inside its publish of step 3 (and never publishes again)
            raise OSError(5, "I/O error (injected)")
        return publish(slot, step, *args)

    tier.publisher.publish = failing  # type: ignore[method-assign]
    try:
        for step in range(1, 5):
            _train(state, step)
            tier.snapshot(step, state)
        tier.wait()
        return {"complete": tier.votes.complete, "votes": tier.votes_blocking}
    finally:
        tier.close()


def test_a_publish_failing_on_one_rank_leaves_the_last_common_step_restorable(shm_dir: str, tmp_path: Path  # noqa: F811
                                                                              ) -> None:
    out = run_workers(_one_rank_fails, 2, (shm_dir,), tmpdir=str(tmp_path), timeout=120)
    assert [o["complete"] for o in out] == [2, 2]  # the vote behind step 3 saw rank 1 stuck at step 2
    assert [o["votes"] for o in out] == [1, 1]
    steps = _published(shm_dir)
    # rank 0 kept step 2 (every rank's newest) and wrote 3 and 4 into its other slot; rank 1 published nothing more
    assert steps == {2: {0, 1}, 4: {0}}
    step, fresh = _restored(shm_dir)
    assert step == 2  # never rank 0's step 4 alone, never a step rank 1 was writing
    _assert_equal(_tensors(fresh), _reference(2))


# --------------------------------------------------------------------------- items change between rounds
def _items_change(rank: int, world: int, directory: str) -> dict[str, Any]:
    state = _state(0)
    tier = LocalShmTier(directory, MemoryTierConfig(every=1))
    taken = []
    at_4: dict[int, set[int]] = {}
    try:
        for step in range(1, 7):
            _train(state, step)
            if step == 5 - rank:  # a new entry, on rank 1 one step before rank 0: its items no longer match the plan
                state["extra"] = torch.arange(5.0)
            taken.append(tier.snapshot(step, state))
            if step == 4:
                tier.wait()
                dist.barrier()
                at_4 = _published(directory)
                dist.barrier()
        tier.wait()
        return {"taken": taken, "votes": tier.votes_blocking, "at_4": at_4}
    finally:
        tier.close()


def test_a_rank_whose_items_changed_skips_the_round_and_the_next_one_replans(shm_dir: str, tmp_path: Path  # noqa: F811
                                                                             ) -> None:
    out = run_workers(_items_change, 2, (shm_dir,), tmpdir=str(tmp_path), timeout=120)
    # step 4: rank 1 skips on its own (rank 0 still publishes its part of the plan); step 5 votes on the caller's
    # thread, where both ranks' items changed, and replans
    assert out[0]["taken"] == [True] * 6
    assert out[1]["taken"] == [True, True, True, False, True, True]
    assert [o["votes"] for o in out] == [2, 2]
    assert out[0]["at_4"][3] == {0, 1} and out[0]["at_4"][4] == {0}  # never a whole group for step 4
    assert _published(shm_dir) == {5: {0, 1}, 6: {0, 1}}
    fresh = _state(1)
    fresh["extra"] = torch.zeros(5)
    tier = LocalShmTier(shm_dir)
    try:
        report = tier.restore(fresh, not_older_than=None)
    finally:
        tier.close()
    assert report is not None and report.step == 6
    _assert_equal(_tensors(fresh), _reference(6))
    assert torch.equal(fresh["extra"], torch.arange(5.0))


# --------------------------------------------------------------------------- a vote fails on one rank only
VOTE_TIMEOUT = timedelta(seconds=2)
"""The tier's collective timeout in these tests: a rank waiting for a vote another rank never joins gives up
after this long (the default, 30 minutes, would be the hang these tests guard against)."""


def _vote_fails_on_one_rank(rank: int, world: int, directory: str, when: str) -> dict[str, Any]:
    state = _state(0)
    tier = LocalShmTier(directory, MemoryTierConfig(every=1, collective_timeout=VOTE_TIMEOUT))
    vote = tier.votes.behind.max_each
    fired = []

    def failing(*values: int) -> tuple[int, ...]:
        # Rank 1's vote behind step 3 raises: "before" without entering the all-reduce (rank 0 then waits for it
        # in vain), "after" once the all-reduce completed on both ranks (rank 0 got an outcome, rank 1 did not:
        # what a timeout on one rank only looks like)
        if rank == 1 and tier.publisher.published == 3 and not fired:
            fired.append(tier.publisher.published)
            if when == "after":
                vote(*values)
            raise RuntimeError("vote failed on rank 1 (injected)")
        return vote(*values)

    tier.votes.behind.max_each = failing  # type: ignore[method-assign]
    taken, blocked = [], []
    try:
        for step in range(1, 7):
            _train(state, step)
            started = time.perf_counter()
            taken.append(tier.snapshot(step, state))
            blocked.append(time.perf_counter() - started)
        tier.wait()
        dist.barrier()  # rank 1 goes on living: rank 0's vote that rank 1 never joins ends by its timeout
        return {"taken": taken, "blocked": blocked, "stopped": tier.stopped is not None, "fired": fired}
    finally:
        tier.close()


def _restore_step(rank: int, world: int, directory: str) -> int | None:
    step, fresh = _restored(directory)
    if step is not None:
        _assert_equal(_tensors(fresh), _reference(step))
    return step


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_vote_failing_on_one_rank_stops_snapshots_on_every_rank_without_a_mismatch(
    shm_dir: str, tmp_path: Path, when: str  # noqa: F811
) -> None:
    out = run_workers(_vote_fails_on_one_rank, 2, (shm_dir, when), tmpdir=str(tmp_path), timeout=60)
    assert out[1]["fired"] == [3] and out[0]["fired"] == []
    # Rank 1 cannot know what rank 0 agreed, so it joins no further vote of the tier: its snapshots stop from
    # the next snapshot on. Rank 0 gives up on its next vote (the one rank 1 never joins) and stops too; no rank
    # votes on the caller's thread against a vote behind, and no snapshot raises.
    assert [o["stopped"] for o in out] == [True, True]
    assert out[1]["taken"] == [True, True, True, False, False, False]
    if when == "before":  # rank 0's vote behind step 3 failed too: both ranks stop at the same round
        assert out[0]["taken"] == [True, True, True, False, False, False]
    else:  # rank 0 got step 3's outcome: it snapshots step 4 (rank 1 does not), then its vote behind it fails
        assert out[0]["taken"] == [True, True, True, True, False, False]
    # Rank 0 blocks once, for about the collective timeout (the vote rank 1 never joins), and never longer.
    timeout = VOTE_TIMEOUT.total_seconds()
    assert timeout / 2 < max(out[0]["blocked"]) < timeout + 10, out[0]["blocked"]
    assert max(out[1]["blocked"]) < timeout / 2, out[1]["blocked"]
    assert run_workers(_restore_step, 2, (shm_dir,), tmpdir=str(tmp_path), timeout=60) == [3, 3]


def _ballot_fails_on_one_rank(rank: int, world: int, directory: str) -> dict[str, Any]:
    state = _state(0)
    tier = LocalShmTier(directory, MemoryTierConfig(every=1, collective_timeout=VOTE_TIMEOUT))
    ballot = tier.votes.ballot

    def failing(*args: Any) -> tuple[int, ...]:
        if rank == 1 and tier.publisher.published == 3:  # rank 1 cannot say what it votes behind step 3
            raise ValueError("ballot failed on rank 1 (injected)")
        return ballot(*args)

    tier.votes.ballot = failing  # type: ignore[method-assign]
    try:
        return {"taken": _snapshot_steps(tier, state), "votes": tier.votes_blocking, "stopped": tier.stopped}
    finally:
        tier.close()


def test_a_ballot_failing_on_one_rank_is_a_skip_inside_the_vote(shm_dir: str, tmp_path: Path) -> None:  # noqa: F811
    out = run_workers(_ballot_fails_on_one_rank, 2, (shm_dir,), tmpdir=str(tmp_path), timeout=60)
    # Rank 1 still joins the vote behind step 3, saying "skipped": step 4 votes on the caller's thread on every rank
    assert [o["taken"] for o in out] == [[True] * 6] * 2
    assert [o["votes"] for o in out] == [2, 2]
    assert [o["stopped"] for o in out] == [None, None]
    assert run_workers(_restore_step, 2, (shm_dir,), tmpdir=str(tmp_path), timeout=60) == [6, 6]


# --------------------------------------------------------------------------- a rank of the node dies mid-step
def _one_rank_dies_mid_step(rank: int, world: int, directory: str) -> dict[str, Any]:
    state = _state(0)
    tier = LocalShmTier(directory, MemoryTierConfig(every=3, jit_peer_wait=60.0))
    try:
        for step in range(1, 5):
            _train(state, step)
            tier.snapshot(step, state)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a crashed worker: it never publishes step 4
        try:
            dist.all_reduce(torch.ones(1))  # step 5's collective breaks (rank 1 is gone)
        except Exception as exc:  # noqa: BLE001 - the broken collective the loop would catch
            started = time.monotonic()
            complete = tier.snapshot_on_failure(4, state, exc)
            return {"complete": complete, "seconds": time.monotonic() - started}
        raise AssertionError("the collective with a dead rank did not fail")
    finally:
        tier.close()


def test_a_just_in_time_snapshot_does_not_wait_for_a_node_rank_that_died(shm_dir: str, tmp_path: Path) -> None:  # noqa: F811
    out = run_workers(_one_rank_dies_mid_step, 2, (shm_dir,), tmpdir=str(tmp_path), timeout=120, may_die=frozenset({1}))
    assert out[1] is None
    assert out[0]["complete"] is False  # rank 1's file of step 4 is missing: the node copy is incomplete
    assert out[0]["seconds"] < 30, out[0]  # ended by rank 1's exit, not by jit_peer_wait (60 s)
    assert 4 in _published(shm_dir) and _published(shm_dir)[4] == {0}
