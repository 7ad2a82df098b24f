"""bench/reform_bench.py's pure parts: the survivor's events and the new group's first step, steps redone and
kept pids, read from events.jsonl and progress lines."""

from __future__ import annotations

import pytest

from tests.harness.scripts import load_script

rb = load_script("bench/reform_bench.py")


def _line(pid: int, rank: int, world: int, step: int, t: float) -> dict:
    return {"rank": rank, "world_size": world, "step": step, "pid": pid, "t_wall": t}


def _event(pid: int, name: str, t: float, **fields: object) -> dict:
    return {"node": f"host-{pid}-abc", "event": name, "t_wall": t, **fields}


def _old_group(steps: range, world: int = 3) -> list[dict]:
    """pids 10, 11, 12 train at ranks 0..2, one step a second."""
    return [_line(10 + r, r, world, s, float(s)) for s in steps for r in range(world)]


def test_node_events_reads_one_agent_after_the_fault_with_the_commit_and_in_place() -> None:
    events = [_event(7, "rendezvous_completed", 1.0),  # before the fault
              _event(8, "rendezvous_completed", 5.1),  # another agent
              _event(7, "planned_restart", 5.0, committed_at=4.9),
              _event(7, "rendezvous_completed", 5.2),
              _event(7, "workers_started", 5.3, in_place=True),
              _event(7, "workers_started", 9.0)]
    got = rb.node_events(events, 7, after=4.0)
    assert got == {"planned_restart": 5.0, "committed_at": 4.9, "rendezvous_completed": 5.2,
                   "workers_started": 5.3, "in_place": 1.0}
    assert rb.node_events(events[:2] + [_event(7, "workers_started", 5.3)], 7, 4.0)["in_place"] == 0.0


def test_a_kill_in_place_keeps_the_survivors_pids_and_redoes_nothing() -> None:
    # pid 12 (rank 2) is killed at 6.5 after step 6; survivors 10 and 11 re-form at world 2 and step 7 at 7.2
    progress = _old_group(range(1, 7)) + [_line(10, 0, 2, 7, 7.2), _line(11, 1, 2, 7, 7.25)]
    events = {"rendezvous_completed": 6.6, "workers_started": 6.7, "in_place": 1.0}
    row = rb.recovery_row(progress, events, "kill", 6.5, 2, {12, 99})
    assert row == pytest.approx({"rendezvous_completed": 0.1, "workers_started": 0.2, "first_step": 0.7,
                                 "fault_to_origin": 0.0, "redone": 0.0, "survivors": 2.0, "kept": 2.0,
                                 "in_place": 1.0})


def test_a_restart_that_restores_an_older_step_counts_the_steps_redone_and_new_pids() -> None:
    # the notice's agreed step 6 is committed at 6.2; new workers 20, 21 start from step 5 (2 steps redone)
    progress = _old_group(range(1, 7)) + [_line(20, 0, 2, 5, 7.0), _line(21, 1, 2, 5, 7.1)]
    events = {"planned_restart": 6.3, "committed_at": 6.2, "rendezvous_completed": 6.5}
    row = rb.recovery_row(progress, events, "notice", 6.0, 2, {12})
    assert row["first_step"] == pytest.approx(0.8) and row["fault_to_origin"] == pytest.approx(0.2)
    assert (row["redone"], row["kept"], row["survivors"]) == (2.0, 0.0, 2.0)
    assert "in_place" not in row


def test_a_crash_keeps_the_size_so_only_lines_after_the_survivors_round_count() -> None:
    # the size stays 3: old-group lines after the fault (step 7 at 6.6) are not the new group's
    progress = _old_group(range(1, 7)) + [_line(10, 0, 3, 7, 6.6)]
    assert rb.recovery_row(progress, {}, "crash", 6.5, 3, {12}) is None  # no round yet: nothing to measure
    events = {"rendezvous_completed": 7.0}
    assert rb.recovery_row(progress, events, "crash", 6.5, 3, {12}) is None  # no step of the new group yet
    progress += [_line(10, 0, 3, 8, 7.4), _line(11, 1, 3, 8, 7.4), _line(30, 2, 3, 8, 7.45)]
    row = rb.recovery_row(progress, events, "crash", 6.5, 3, {12})
    assert row["first_step"] == pytest.approx(0.9)
    assert (row["redone"], row["kept"], row["survivors"]) == (0.0, 2.0, 2.0)
