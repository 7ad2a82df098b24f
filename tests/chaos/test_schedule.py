"""The schedule: validation messages, JSON round trip, seeded generation, and the pure `due` decision."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from elastic.chaos.api import ChaosScheduleError, Fault, FaultKind, Schedule
from elastic.chaos.schedule import (
    due,
    load_schedule,
    next_wake,
    random_schedule,
    schedule_from_json,
)


def test_json_round_trip_and_default_targets(tmp_path: Path) -> None:
    data = {"seed": 7, "faults": [
        {"kind": "kill_worker", "at_step": 10},
        {"kind": "storage_error", "at_s": 2.5, "duration_s": 1, "params": {"rate": 0.5, "ops": "write"}},
        {"kind": "kill_etcd_leader", "at_s": 1},
    ]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    schedule = load_schedule(str(path))
    assert [f.target for f in schedule.faults] == ["worker:any", "storage", "etcd:any"]
    assert schedule_from_json(schedule.to_json()) == schedule


@pytest.mark.parametrize(("fault", "message"), [
    ({"kind": "explode", "at_s": 1}, "unknown fault kind 'explode'; use one of kill_worker"),
    ({"kind": "kill_worker"}, "exactly one trigger"),
    ({"kind": "kill_worker", "at_s": 1, "at_step": 2}, "exactly one trigger"),
    ({"kind": "kill_worker", "at_s": -1}, "at_s must be >= 0"),
    ({"kind": "kill_worker", "at_s": 1, "target": "agent:0"}, "use worker:"),
    ({"kind": "partition", "at_s": 1}, "name the network namespace"),
    ({"kind": "storage_error", "at_s": 1, "params": {"rate": 2}}, "rate must be in (0, 1]"),
    ({"kind": "storage_error", "at_s": 1, "params": {"errno": "EWHAT"}}, "errno must be an errno name"),
    ({"kind": "storage_error", "at_s": 1, "params": {"errno": 13}}, "errno must be an errno name"),
    ({"kind": "storage_error", "at_s": 1, "params": {"path": ""}}, "path must be a non-empty string"),
    ({"kind": "storage_latency", "at_s": 1, "params": {"rate": 1}}, "accepted: ['seconds']"),
    ({"kind": "kill_worker", "at_s": 1, "when": 3}, "unknown keys ['when']"),
    ({"kind": "kill_worker", "at_s": 1, "after": 0}, "exactly one trigger"),
    ({"kind": "kill_worker", "at_s": 1, "after_s": 2}, "after_s needs after"),
    ({"kind": "kill_worker", "after": 0}, "must name an earlier fault"),
    ({"kind": "kill_worker", "after": -1}, "index of an earlier fault"),
    ({"kind": "kill_worker", "at_s": 1, "params": {"hold_connections": "yes"}}, "hold_connections must be true or"),
    ({"kind": "stop_worker", "at_s": 1, "params": {"hold_connections": True}}, "accepted: none"),
])
def test_bad_faults_say_what_is_wrong(fault: dict, message: str) -> None:
    with pytest.raises(ChaosScheduleError, match="faults\\[0\\]") as info:
        schedule_from_json({"faults": [fault]})
    assert message in str(info.value)


def test_storage_error_takes_an_errno_and_a_path() -> None:
    schedule = schedule_from_json({"faults": [{"kind": "storage_error", "at_s": 1,
                                               "params": {"errno": "EACCES", "path": "step-000000020", "ops": "read"}}]})
    assert schedule.faults[0].params == {"errno": "EACCES", "path": "step-000000020", "ops": "read"}


def test_unreadable_schedule_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ChaosScheduleError, match="bad.json is not valid JSON"):
        load_schedule(str(bad))
    with pytest.raises(ChaosScheduleError, match="cannot read schedule"):
        load_schedule(str(tmp_path / "missing.json"))


def test_random_schedule_is_seeded_and_spaced() -> None:
    a = random_schedule(3, duration_s=60, count=5, min_gap_s=8)
    assert a == random_schedule(3, duration_s=60, count=5, min_gap_s=8)
    assert a != random_schedule(4, duration_s=60, count=5, min_gap_s=8)
    times = [f.at_s for f in a.faults]
    assert times == sorted(times) and all(b - a_ >= 8 - 1e-3 for a_, b in itertools.pairwise(times))
    assert all(0 <= t < 60 for t in times)
    with pytest.raises(ChaosScheduleError, match="do not fit"):
        random_schedule(1, duration_s=10, count=5, min_gap_s=8)


def test_due_fires_by_time_and_by_step_once() -> None:
    schedule = Schedule(seed=0, faults=(Fault(kind=FaultKind.KILL_WORKER, at_s=2.0),
                                        Fault(kind=FaultKind.TERM_AGENT, at_step=5)))
    assert due(schedule, [], 1.0, None) == []
    assert due(schedule, [], 2.0, None) == [0]
    assert due(schedule, [0], 3.0, 4) == []
    assert due(schedule, [0], 3.0, 5) == [1]
    assert next_wake(schedule, [], 0.5) == 1.5
    assert next_wake(schedule, [0], 0.5) is None


def test_a_follower_fires_after_its_anchor_inside_its_window() -> None:
    """Overlapping faults: the second fault lands ``after_s`` after the first, whatever triggered the first."""
    schedule = Schedule(seed=0, faults=(Fault(kind=FaultKind.KILL_AGENT, at_step=5),
                                        Fault(kind=FaultKind.TERM_AGENT, after=0, after_s=1.5)))
    assert due(schedule, {}, 10.0, 4) == []
    assert due(schedule, {}, 10.0, 5) == [0]
    assert due(schedule, {0: 10.0}, 11.0, 6) == []  # 1 s after its anchor: not yet
    assert next_wake(schedule, {0: 10.0}, 11.0) == 0.5
    assert due(schedule, {0: 10.0}, 11.5, 6) == [1]
    assert due(schedule, [0], 99.0, 6) == []  # no firing times known: a follower never comes due
    assert schedule_from_json(schedule.to_json()) == schedule
