"""bench/chaos_soak.py's pure parts: every fault kind is in the schedule, and the targets are checked."""

from __future__ import annotations

from bench.chaos_soak import HANG_TIMEOUT, KINDS, check_targets, readme_table, soak_schedule
from bench.mttr_report import NO_RECOVERY, Fault, Recovery
from elastic.chaos.api import FaultKind


def test_a_short_schedule_still_has_every_kind_and_the_same_seed_the_same_faults() -> None:
    short = soak_schedule(1, duration=10, gap=8)
    assert {f.kind for f in short.faults} == set(KINDS)
    assert {f.kind for f in short.faults} >= {FaultKind.STOP_WORKER, FaultKind.KILL_AGENT, FaultKind.TERM_AGENT,
                                              FaultKind.KILL_WORKER, FaultKind.KILL_ETCD_LEADER}
    times = [f.at_s for f in short.faults]
    assert all(b - a >= 8 * 0.75 for a, b in zip(times, times[1:]))  # type: ignore[operator]
    assert soak_schedule(1, duration=300, gap=12) == soak_schedule(1, duration=300, gap=12)
    assert len(soak_schedule(1, duration=300, gap=12).faults) == 25


def _rec(kind: str, cause: str, detection: float | None = 1.0) -> Recovery:
    rec = Recovery(cause, Fault(kind, 100.0), 100.0)
    if cause != NO_RECOVERY:
        rec.stages = {"detection": detection, "first_step": 4.0}
        rec.steps_lost = 3
    return rec


def test_targets() -> None:
    good = [_rec("stop_worker", "hang", HANG_TIMEOUT + 0.5), _rec("kill_agent", "peer_lost", 2.5),
            _rec("term_agent", "planned_leave"), _rec("kill_etcd_leader", NO_RECOVERY)]
    injected = [{"kind": r.kind} for r in good]
    ok = {"identical": True, "final_ok": True, "corrupt": [], "alive": [], "codes_ok": True}
    assert check_targets(injected, good, **ok) == []  # type: ignore[arg-type]
    bad = [_rec("stop_worker", "hang", HANG_TIMEOUT + 1.5), _rec("kill_agent", "peer_lost", 3.5),
           _rec("term_agent", NO_RECOVERY), _rec("kill_etcd_leader", "failure")]
    missed = check_targets(injected, bad, **{**ok, "corrupt": [50]})  # type: ignore[arg-type]
    assert len(missed) == 5 and "corrupt checkpoints at steps [50]" in missed, missed
    assert any("hang found" in m for m in missed) and any("node loss found" in m for m in missed)
    table = readme_table(injected, good, {"stop_worker": 1})
    assert "| stop_worker | 1 | 1 | 1 | 3 / 3 |" in table and "| kill_etcd_leader | 1 | 0 | 0 | 0 |" in table


def test_overlap_pairs_each_recovering_fault_with_a_seeded_follower_inside_its_window() -> None:
    from bench.chaos_soak import FOLLOW_AFTER_S, FOLLOWERS, RESTARTING

    schedule = soak_schedule(2, duration=1800, gap=12, overlap=True)
    assert schedule == soak_schedule(2, duration=1800, gap=12, overlap=True)
    followers = [(i, f) for i, f in enumerate(schedule.faults) if f.after is not None]
    primaries = [f for f in schedule.faults if f.after is None]
    assert len(followers) == sum(1 for f in primaries if f.kind.value in RESTARTING)
    assert len(schedule.faults) >= 100
    for i, f in followers:
        assert f.after == i - 1 and schedule.faults[i - 1].kind.value in RESTARTING
        assert f.kind in FOLLOWERS and FOLLOW_AFTER_S[0] <= f.after_s <= FOLLOW_AFTER_S[1]


def test_overlap_targets_let_a_pair_share_one_recovery() -> None:
    first, second = _rec("kill_agent", "peer_lost", 6.0), Recovery(NO_RECOVERY, Fault("kill_worker", 101.0), 101.0)
    lone = Recovery(NO_RECOVERY, Fault("kill_agent", 500.0), 500.0)
    injected = [{"kind": "kill_agent"}, {"kind": "kill_worker"}]
    ok = {"identical": True, "final_ok": True, "corrupt": [], "alive": [], "codes_ok": True}
    assert check_targets(injected, [first, second], overlap=True, **ok) == []  # type: ignore[arg-type]
    assert check_targets(injected, [first, second], **ok)  # type: ignore[arg-type]  # not without --overlap
    missed = check_targets(injected, [first, second, lone], overlap=True, **ok)  # type: ignore[arg-type]
    assert len(missed) == 1 and "no recovery" in missed[0], missed
    leaked = check_targets(injected, [first, second], overlap=True, leaked=["/spotrun/rdzv/soak/x"], **ok)  # type: ignore[arg-type]
    assert leaked == ["etcd keys left: ['/spotrun/rdzv/soak/x']"]
