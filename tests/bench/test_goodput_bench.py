"""bench/goodput_bench.py's pure parts: the seeded schedule and the goodput arithmetic on progress lines."""

from __future__ import annotations

import pytest

from tests.harness.scripts import load_script

gb = load_script("bench/goodput_bench.py")


def _line(pid: int, step: int, t: float, rank: int = 0) -> dict:
    return {"rank": rank, "world_size": 2, "step": step, "pid": pid, "t_wall": t, "loss": 1.0}


def test_schedule_is_seeded_and_each_fault_is_followed_by_a_rejoin() -> None:
    a = gb.make_schedule(7, 600, 120, 40)
    assert a == gb.make_schedule(7, 600, 120, 40)
    assert a != gb.make_schedule(8, 600, 120, 40) or all(f.kind == "rejoin" for f in a)
    faults = [f for f in a if f.kind != "rejoin"]
    assert len(faults) == 4 and {f.kind for f in faults} <= {"notice", "kill"}
    for f in faults:
        assert f.at % 120 >= 96 or f.at % 120 <= 24  # within +-20 % of a multiple of --fault-every
        assert any(r.kind == "rejoin" and abs(r.at - f.at - 40) < 1e-9 for r in a)
    assert [f.at for f in a] == sorted(f.at for f in a)


def test_schedule_rejects_a_rejoin_after_the_next_fault() -> None:
    with pytest.raises(ValueError, match="--rejoin-after 100"):
        gb.make_schedule(0, 600, 120, 100)


def test_productive_time_counts_the_last_execution_of_each_step_only() -> None:
    # pid 1 trains steps 1..6 (1 s each), crashes; pid 2 resumes from the checkpoint at 4: steps 5, 6 again.
    lines = [_line(1, s, float(s)) for s in range(1, 7)] + [_line(2, s, 20.0 + s - 4) for s in range(5, 9)]
    lines.append(_line(1, 3, 3.0, rank=1))  # other ranks do not count
    seconds, steps, redone = gb.productive_time(lines, 0.0, 30.0)
    assert (steps, redone) == (8, 2)
    # steps 1-4 of pid 1: the first has no predecessor (median 1 s), then 1 s each; pid 2's 5..8 likewise.
    assert seconds == pytest.approx(8.0)
    assert gb.lost_per_fault(lines, [(10.0, "kill")]) == {"kill": [2]}


def test_a_planned_stop_loses_nothing() -> None:
    lines = [_line(1, s, float(s)) for s in range(1, 7)] + [_line(2, s, 20.0 + s) for s in range(7, 10)]
    assert gb.lost_per_fault(lines, [(10.0, "notice")]) == {"notice": [0]}
    assert gb.productive_time(lines, 0.0, 40.0)[1:] == (9, 0)


def test_a_fault_the_job_did_not_recover_from_in_the_window_is_marked() -> None:
    lines = [_line(1, s, float(s)) for s in range(1, 7)] + [_line(2, s, 100.0 + s) for s in range(1, 3)]
    assert gb.lost_per_fault(lines, [(7.0, "notice")], t1=50.0) == {"notice": [None]}
    assert gb.lost_per_fault(lines, [(7.0, "notice")]) == {"notice": [6]}  # restarted from nothing


def _event(name: str, t: float, **fields: object) -> dict:
    return {"event": name, "t_wall": t, **fields}


def test_agreed_step_to_first_step_starts_at_the_commit_of_the_agreed_step() -> None:
    # notice at 10: the old group (pid 1) stops at step 6, committed at 11.0; the survivor's new worker (pid 2)
    # steps at 11.8. The leaver's event (later) and a kill without planned events do not count.
    lines = [_line(1, s, float(s)) for s in range(1, 7)] + [_line(2, s, 11.8 + (s - 7) * 0.1) for s in range(7, 12)]
    lines += [_line(3, s, 31.0 + s - 12) for s in range(12, 15)]
    events = [_event("planned_stop_posted", 10.1),
              _event("planned_restart", 11.2, step=6, committed_at=11.0),
              _event("planned_leave", 11.3, step=6, committed_at=11.05),
              _event("failure_detected", 25.0)]
    faults = [(10.0, "notice"), (20.0, "kill")]
    got = gb.agreed_step_to_first_step(events, lines, faults)
    assert got.keys() == {"notice"} and got["notice"] == [pytest.approx(0.8)]
    # without committed_at (an older events file) the earliest planned event is the moment
    old = [{k: v for k, v in e.items() if k != "committed_at"} for e in events]
    assert gb.agreed_step_to_first_step(old, lines, faults)["notice"] == [pytest.approx(0.6)]
    # a leave that saved nothing is no agreed step; a window closing before the first step drops the fault
    unsaved = [_event("planned_leave", 11.3, step=None)]
    assert gb.agreed_step_to_first_step(unsaved, lines, faults) == {}
    assert gb.agreed_step_to_first_step(events, lines, faults, t1=11.5) == {}
    # a resume that comes after the next fault (a rejoin injected meanwhile) still counts for the notice
    assert gb.agreed_step_to_first_step(events, lines, [(10.0, "notice"), (11.5, "rejoin")]) == {"notice": [pytest.approx(0.8)]}


def test_the_report_shows_median_worst_and_the_target() -> None:
    assert gb.median_worst([]) == "-"
    assert gb.median_worst([0.5, 0.7, 1.4]) == "0.70 / 1.40 s (n=3, missed)"
    assert gb.median_worst([0.4, 0.6]) == "0.50 / 0.60 s (n=2, met)"


def test_unplanned_schedules_have_no_rejoin_after_a_worker_crash() -> None:
    s = gb.make_schedule(5, 1200, 60, 20, ("kill", "crash"))
    kinds = [f.kind for f in s]
    assert {"kill", "crash"} <= set(kinds) and "notice" not in kinds
    for fault, after in zip(s, s[1:]):
        if fault.kind == "crash":
            assert after.kind != "rejoin"
    with pytest.raises(ValueError, match="crash"):
        gb.make_schedule(5, 600, 60, 20, ("reboot",))


def test_an_in_place_group_is_new_by_its_world_size_or_its_workers_started_event() -> None:
    # pid 1 (rank 0) and pid 2 (rank 1) at world 3; a kill at 6.5; the survivors re-form in place (same pids) at
    # world 2 and step 7 at 7.0; the old code looked for a new pid and found none
    lines = [_line(1, s, float(s)) | {"world_size": 3} for s in range(1, 7)]
    lines += [_line(2, s, float(s), rank=1) | {"world_size": 3} for s in range(1, 7)]
    lines += [_line(1, s, 7.0 + (s - 7) * 0.1) for s in range(7, 12)]
    faults = [(6.5, "kill")]
    assert gb.new_group_step(lines, 6.5, 6.5)["t_wall"] == 7.0
    assert gb.stage_times([], lines, faults)["kill"]["first_step_of_new_group"] == [pytest.approx(0.5)]
    assert gb.lost_per_fault(lines, faults) == {"kill": [0]}
    # the size kept (a crash on another node re-formed in place): the workers_started event tells the group
    same = [x | {"world_size": 3} for x in lines]
    assert gb.new_group_step(same, 6.5, 6.5) is None
    started = [_event("workers_started", 6.9, in_place=True)]
    assert gb.new_group_step(same, 6.5, 6.5, events=started)["t_wall"] == 7.0
    # a notice in place: the agreed step is committed at 6.8, after the fault; the first step at world 2 follows
    events = [_event("planned_restart", 6.85, step=6, committed_at=6.8)]
    assert gb.agreed_step_to_first_step(events, lines, [(6.5, "notice")]) == {"notice": [pytest.approx(0.2)]}


def test_productive_time_does_not_count_an_in_place_re_form_as_a_step() -> None:
    # 1 s steps; the survivor (same pid) re-forms at world 1 and its first step comes 5 s after its last one: that
    # gap is the recovery, not a step (counted as the median step, as a restarted worker's first step is)
    lines = [_line(1, s, float(s)) for s in range(1, 6)] + [_line(1, s, 10.0 + s - 6) | {"world_size": 1}
                                                           for s in range(6, 9)]
    seconds, steps, redone = gb.productive_time(lines, 0.0, 20.0)
    assert (steps, redone) == (8, 0) and seconds == pytest.approx(8.0)
    assert [len(seg) for seg in gb.rank0_segments(lines)] == [5, 3]
