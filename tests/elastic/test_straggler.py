"""Straggler detection (elastic.straggler): the pure policy on plain data, and the agent's watch over it
(elastic.vitals) driven with an injected clock: events, metrics and the event's fields."""

from __future__ import annotations

import json
from typing import Any

import pytest

from elastic.api import LaunchConfigError, RecoveryEvent
from elastic.config import straggler_policy
from elastic.metrics import AgentMetrics
from elastic.straggler import StragglerPolicy, find_stragglers, new_pace, note, step_time
from elastic.vitals import Vitals, WorkerProgress


def test_a_rank_slower_than_its_peers_median_by_the_factor_is_named_with_its_ratio() -> None:
    assert find_stragglers({0: 0.10, 1: 0.11, 2: 0.10, 3: 0.20}, 1.5) == {3: pytest.approx(2.0)}
    assert find_stragglers({0: 0.10, 1: 0.11, 2: 0.10, 3: 0.14}, 1.5) == {}  # 1.4x: within the factor
    assert find_stragglers({0: 0.10, 1: 0.25}, 1.5) == {1: pytest.approx(2.5)}  # two ranks: the slower one only
    assert find_stragglers({0: 0.10}, 1.5) == {}  # no peer to compare with
    assert find_stragglers({0: 0.0, 1: 0.0}, 1.5) == {}


def test_step_time_is_the_mean_over_the_last_window_steps_and_unknown_before() -> None:
    pace = new_pace(4)
    for i, beats in enumerate([1, 2, 3]):
        note(pace, float(i), beats)
    assert step_time(pace, 4) is None
    note(pace, 3.0, 3)  # no beat since: nothing added
    note(pace, 5.0, 6)  # three beats in one sample (several steps per tick)
    assert step_time(pace, 4) == pytest.approx((5.0 - 0.0) / (6 - 1))
    note(pace, 5.5, 7)
    assert step_time(pace, 4) == pytest.approx((5.5 - 2.0) / (7 - 3))  # the newest sample 4+ steps back


@pytest.mark.parametrize(("factor", "window", "needle"), [
    (1.0, 20, "--straggler-factor"), (float("nan"), 20, "--straggler-factor"), (1.5, 1, "--straggler-window"),
    (1.5, 2.5, "--straggler-window"),
])
def test_a_bad_policy_is_refused_naming_the_flag(factor: float, window: Any, needle: str) -> None:
    with pytest.raises(LaunchConfigError, match=needle):
        StragglerPolicy(factor=factor, window=window)


def test_the_policy_comes_from_flags_then_environment_and_factor_0_turns_it_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert straggler_policy(factor=None, window=None) == StragglerPolicy()
    monkeypatch.setenv("SPOTRUN_STRAGGLER_FACTOR", "2")
    monkeypatch.setenv("SPOTRUN_STRAGGLER_WINDOW", "8")
    assert straggler_policy(factor=None, window=None) == StragglerPolicy(factor=2.0, window=8)
    assert straggler_policy(factor=3.0, window=5) == StragglerPolicy(factor=3.0, window=5)
    assert straggler_policy(factor=0, window=None) is None
    monkeypatch.setenv("SPOTRUN_STRAGGLER_WINDOW", "many")
    with pytest.raises(LaunchConfigError, match="SPOTRUN_STRAGGLER_WINDOW"):
        straggler_policy(factor=None, window=None)


class _Events:
    def __init__(self) -> None:
        self.events: list[tuple[RecoveryEvent, dict[str, Any]]] = []

    def emit(self, event: RecoveryEvent, **fields: Any) -> None:
        self.events.append((event, fields))


def _drive(step_seconds: dict[int, float], seconds: float, vitals: Vitals, now: list[float], tick: float = 0.1
           ) -> None:
    """Advance the clock by ``seconds`` in ticks, each rank beating at its own pace."""
    end = now[0] + seconds
    while now[0] < end - 1e-9:
        now[0] += tick
        vitals.tick({r: WorkerProgress(int(now[0] / s), None) for r, s in step_seconds.items()})


def test_a_slowed_rank_is_named_once_within_the_window_and_cleared_when_it_catches_up() -> None:
    now = [0.0]
    events, metrics = _Events(), AgentMetrics()
    vitals = Vitals(metrics=metrics, emit=events.emit, straggler=StragglerPolicy(factor=1.5, window=10),
                    memory_dir=None, clock=lambda: now[0], interval=0.0)
    vitals.started({0: 4, 1: 5, 2: 6, 3: 7})
    _drive({0: 0.1, 1: 0.1, 2: 0.1, 3: 0.2}, 2.0, vitals, now)  # rank 3 completed 10 steps by t=2.0
    detected = [f for e, f in events.events if e is RecoveryEvent.STRAGGLER_DETECTED]
    assert len(detected) == 1, events.events
    (d,) = detected
    assert (d["rank"], d["local_rank"], d["window"], d["factor"]) == (7, 3, 10, 1.5)
    assert d["ratio"] == pytest.approx(2.0, rel=0.15) and d["step_time"] == pytest.approx(0.2, rel=0.15)
    assert vitals.stragglers.keys() == {7}
    assert metrics.stragglers._value.get() == 1 and metrics.stragglers_detected._value.get() == 1
    _drive({0: 0.1, 1: 0.1, 2: 0.1, 3: 0.2}, 3.0, vitals, now)
    assert len([e for e, _ in events.events if e is RecoveryEvent.STRAGGLER_DETECTED]) == 1  # once, not per tick
    vitals.started({0: 0, 1: 1, 2: 2, 3: 3})  # a restart judges afresh
    assert metrics.stragglers._value.get() == 0


def test_an_even_run_names_nobody_and_a_rank_back_in_pace_is_cleared() -> None:
    now = [0.0]
    events = _Events()
    vitals = Vitals(metrics=None, emit=events.emit, straggler=StragglerPolicy(factor=1.5, window=10),
                    memory_dir=None, clock=lambda: now[0], interval=0.0)
    vitals.started({0: 0, 1: 1})
    _drive({0: 0.1, 1: 0.11}, 30.0, vitals, now)
    assert events.events == []
    vitals.started({0: 0, 1: 1})
    beats = {0: 0, 1: 0}
    for i in range(400):  # rank 1 at a third of the pace for 100 ticks, then even again
        now[0] += 0.1
        beats[0] += 1
        beats[1] += 1 if i >= 100 or i % 3 == 0 else 0
        vitals.tick({r: WorkerProgress(b, None) for r, b in beats.items()})
    kinds = [(e, f["rank"]) for e, f in events.events]
    assert kinds == [(RecoveryEvent.STRAGGLER_DETECTED, 1), (RecoveryEvent.STRAGGLER_CLEARED, 1)]


def test_the_report_names_each_straggler_its_node_how_much_slower_and_when_it_was_cleared(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from elastic.report import main, straggler_lines

    base = {"run_id": "r", "round": 1}
    events = [
        {**base, "event": "workers_started", "node": "h1:10", "t_wall": 100.0},
        {**base, "event": "straggler_detected", "node": "h1:10", "t_wall": 112.5, "rank": 3, "local_rank": 1,
         "ratio": 2.5, "step_time": 0.25, "peers_step_time": 0.1, "factor": 1.5, "window": 20},
        {**base, "event": "straggler_detected", "node": "h2:11", "t_wall": 113.0, "rank": 5, "local_rank": 1,
         "ratio": "NaN", "step_time": None},
        {**base, "event": "straggler_cleared", "node": "h1:10", "t_wall": 130.0, "rank": 3, "local_rank": 1},
    ]
    assert straggler_lines(events, 100.0) == [
        "rank 3 (local rank 1) on h1:10: 2.50x its local peers' median (0.250 s vs 0.100 s per step over 20 steps); "
        "from +12.5 s, cleared at +30.0 s",
        "rank 5 (local rank 1) on h2:11; from +13.0 s, not cleared",  # bad numbers: left out, not a traceback
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "== stragglers" in out and "straggler: rank 3" in out


def test_the_flags_reach_the_agent_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic.cli import build_parser, settings_from_args

    for name in ("SPOTRUN_STRAGGLER_FACTOR", "SPOTRUN_STRAGGLER_WINDOW"):
        monkeypatch.delenv(name, raising=False)

    def settings(*flags: str) -> Any:
        return settings_from_args(build_parser().parse_args([*flags, "train.py"])).straggler

    assert settings() == StragglerPolicy()
    assert settings("--straggler-factor", "2", "--straggler-window", "5") == StragglerPolicy(factor=2.0, window=5)
    assert settings("--straggler-factor", "0") is None
    with pytest.raises(LaunchConfigError, match="--straggler-factor must be a finite number > 1"):
        settings("--straggler-factor", "0.5")
