"""A planned save that cannot commit before the deadline is not started, and the agent records why.

Pure decisions first, then the mailbox format (old files still read), then the worker's helper with a real
Checkpointer on local disk and the agent's planned-change paths sharing one mailbox, in process (no
launcher, no etcd: a few hundred milliseconds).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import CheckpointConfig, Checkpointer
from elastic.notice import Notice
from elastic.planned import PlannedStep, Stopped, all_stopped, while_posted, with_save_by
from elastic.preemption import (
    DEFAULT_SAVE_MARGIN,
    SAVE_SLACK_SECONDS,
    Mailbox,
    Preemption,
    SaveDecision,
    WorkerNotice,
    decide_planned_save,
)
from tests.elastic.test_agent_planned import NoticeHandler, _agent

pytestmark = pytest.mark.timeout(60)
NOW = 1000.0


# --- pure decisions ------------------------------------------------------------------------------------------


def test_a_save_that_fits_is_started_and_one_that_does_not_is_skipped_with_the_numbers() -> None:
    assert decide_planned_save(8, [[2.0, 10.0]], margin=1.5) == SaveDecision(True), "3.5 s needed, 10 s left"
    skipped = decide_planned_save(8, [[2.0, 3.0]], margin=1.5)
    assert not skipped.save
    assert skipped.why.startswith("save of step 8 needs ~3.5 s") and "3.0 s left before the deadline" in skipped.why


def test_without_an_estimate_or_a_deadline_the_save_is_tried() -> None:
    assert decide_planned_save(8, [[None, 0.1], [None, 0.1]]) == SaveDecision(True), "no save timed yet"
    assert decide_planned_save(8, [[100.0, None]]) == SaveDecision(True), "stock torchrun: no save_by"
    assert decide_planned_save(8, []) == SaveDecision(True)


def test_the_margin_and_the_slack_are_applied() -> None:
    estimate = 2.0
    needed = estimate * DEFAULT_SAVE_MARGIN + SAVE_SLACK_SECONDS
    assert decide_planned_save(1, [[estimate, needed]]).save, "exactly enough time"
    assert not decide_planned_save(1, [[estimate, needed - 0.01]]).save
    assert decide_planned_save(1, [[estimate, estimate + SAVE_SLACK_SECONDS]], margin=1.0).save
    assert not decide_planned_save(1, [[estimate, estimate]], margin=1.0).save, "the slack is always added"


def test_the_slowest_rank_and_the_least_time_left_decide_for_every_rank() -> None:
    reports: list[list[float | None]] = [[0.5, 30.0], [4.0, None], [None, 5.0]]  # rank 1: slow storage, rank 2: the preempted node
    decision = decide_planned_save(3, reports, margin=1.5)
    assert not decision.save and "needs ~6.5 s" in decision.why and "5.0 s left" in decision.why
    assert decide_planned_save(3, list(reversed(reports)), margin=1.5) == decision, "order does not matter"
    late = decide_planned_save(3, [[1.0, -2.0]])
    assert not late.save and "0.0 s left" in late.why, "past save_by: no negative seconds in the message"


def test_save_by_is_when_the_agent_stops_waiting() -> None:
    posted = with_save_by(WorkerNotice("peer_preempt", NOW + 10, "node b"), stop_grace=3)
    assert posted == WorkerNotice("peer_preempt", NOW + 10, "node b", save_by=NOW + 7)
    from elastic.planned import GroupView

    assert while_posted(GroupView(now=NOW + 6.9), posted, stop_grace=3) is PlannedStep.WAIT
    assert while_posted(GroupView(now=NOW + 7), posted, stop_grace=3) is PlannedStep.ABANDON, "the same bound"
    assert with_save_by(WorkerNotice("preempt", None, "SIGTERM"), stop_grace=3).save_by is None


def test_an_unsaved_step_is_never_reported_as_committed() -> None:
    why = "save of step 8 needs ~9.0 s, 2.0 s left before the deadline"
    assert all_stopped({0: 8, 1: 8}, {}, 2) == Stopped(8, saved=True)
    assert all_stopped({}, {0: (8, why), 1: (8, why)}, 2) == Stopped(8, saved=False, why=why)
    assert Stopped(8, saved=False, why=why).committed is None and Stopped(8, saved=True).committed == 8
    assert all_stopped({0: 8}, {1: (8, why)}, 2) == Stopped(8, saved=False, why=why), "one unsaved: not committed"
    assert all_stopped({}, {0: (8, why)}, 2) is None, "rank 1 has not acknowledged yet"
    assert all_stopped({0: 8}, {1: (12, why)}, 2) is None, "disagreeing steps"


# --- the mailbox ---------------------------------------------------------------------------------------------


def test_save_by_round_trips_and_old_notices_still_read(tmp_path: Path) -> None:
    box = Mailbox(str(tmp_path))
    box.post(WorkerNotice("preempt", NOW + 30, "aws", save_by=NOW + 20))
    assert box.read_notice() == WorkerNotice("preempt", NOW + 30, "aws", save_by=NOW + 20)
    (tmp_path / "notice.json").write_text(json.dumps({"reason": "preempt", "deadline": NOW, "source": "old"}))
    assert box.read_notice() == WorkerNotice("preempt", NOW, "old", save_by=None), "an older agent's notice"
    for bad in ("soon", True, float("inf"), [1]):
        (tmp_path / "notice.json").write_text(json.dumps({"reason": "preempt", "deadline": NOW, "save_by": bad}))
        notice = box.read_notice()
        assert notice is not None and notice.save_by is None, f"{bad!r}: no bound, the save is tried"


def test_an_unsaved_acknowledgement_round_trips_and_old_ones_count_as_committed(tmp_path: Path) -> None:
    box = Mailbox(str(tmp_path))
    box.acknowledge(0, 8, saved=False, why="no time")
    assert box.acks() == {} and box.unsaved() == {0: (8, "no time")}
    assert box.committed_at() is None, "nothing was committed"
    (tmp_path / "ack-1.json").write_text(json.dumps({"step": 8, "time": NOW}))  # an older helper's record
    assert box.acks() == {1: 8} and box.unsaved() == {0: (8, "no time")} and box.committed_at() == NOW
    box.acknowledge(1, 8)
    assert json.loads((tmp_path / "ack-1.json").read_text()).keys() == {"step", "time"}, "unchanged format"


def test_save_margin_is_validated(tmp_path: Path) -> None:
    for bad in (0.5, float("nan"), "2", True):
        with pytest.raises(ValueError, match="save_margin must be a number >= 1"):
            Preemption(mailbox_dir=str(tmp_path), save_margin=bad)  # type: ignore[arg-type]


# --- the worker's helper and the agent, one mailbox ----------------------------------------------------------


def _agent_and_worker(tmp_path: Path) -> tuple[NoticeHandler, Any, Mailbox, Any, Preemption, dict[str, Any]]:
    """An agent (1 s stop grace) and its one worker's helper sharing a mailbox, and the worker's state."""
    handler = NoticeHandler()
    agent, box, events = _agent(tmp_path, handler, stop_grace=1.0)
    helper = Preemption(sync_every=2, mailbox_dir=box.path)
    return handler, agent, box, events, helper, {"w": torch.zeros(1024)}


def _train_and_save_once(ckpt: Checkpointer, state: dict[str, Any]) -> None:
    state["w"] += 1
    ckpt.save(1, state)
    ckpt.wait()
    assert ckpt.save_seconds_estimate is not None


def _stop_at_step_2(helper: Preemption, ckpt: Checkpointer, state: dict[str, Any]) -> bool:
    assert not helper.save_and_stop(ckpt, 1, state), "not a sync step"
    state["w"] += 1
    return helper.save_and_stop(ckpt, 2, state)


def test_a_save_that_cannot_fit_is_skipped_and_the_leave_says_why(tmp_path: Path) -> None:
    handler, agent, box, events, helper, state = _agent_and_worker(tmp_path)
    with Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig()) as ckpt:
        _train_and_save_once(ckpt, state)
        # save_by 0.2 s away: less than any estimate (SAVE_SLACK_SECONDS alone is 0.5 s)
        agent.receive_notice(Notice("aws", time.time() + 1.2, "spot instance-action terminate"))
        assert agent.planned.tick().name == "WAITING"
        notice = box.read_notice()
        assert notice is not None and notice.deadline is not None
        assert notice.save_by == pytest.approx(notice.deadline - 1.0), "when the agent stops waiting"
        began = time.monotonic()
        assert _stop_at_step_2(helper, ckpt, state), "the loop is left at the agreed step all the same"
        assert time.monotonic() - began < 1.0, "at once: no save was started"
        assert ckpt.latest() == 1, "step 2 was not saved: the next group resumes from step 1"
        assert helper.skipped is not None and not helper.skipped.save
    stopped = agent.planned.acknowledged_stop()
    assert stopped is not None and stopped.step == 2 and not stopped.saved
    agent.planned.leave_for_notice(stopped)
    (leave,) = [e for e in events.records if e["event"] == "planned_leave"]
    assert leave["event"] == "planned_leave" and leave["saved"] is False and leave["step"] is None
    assert leave["agreed_step"] == 2 and leave["why"].startswith("save of step 2 needs ~")
    assert "left before the deadline" in leave["why"] and leave["committed_at"] is None
    assert handler.left == 1 and not leave["late"], "gone before the deadline"


def test_a_save_that_fits_is_committed_and_recorded_as_saved(tmp_path: Path) -> None:
    handler, agent, box, events, helper, state = _agent_and_worker(tmp_path)
    with Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig()) as ckpt:
        _train_and_save_once(ckpt, state)
        agent.receive_notice(Notice("aws", time.time() + 60, "spot instance-action terminate"))
        agent.planned.tick()
        assert _stop_at_step_2(helper, ckpt, state) and helper.skipped is None
        assert ckpt.latest() == 2
    agent.planned.leave_for_notice(agent.planned.acknowledged_stop())
    (leave,) = [e for e in events.records if e["event"] == "planned_leave"]
    assert leave["saved"] is True and leave["step"] == 2 and leave["agreed_step"] == 2 and leave["why"] is None


def test_without_a_timed_save_the_planned_save_is_tried_even_with_little_time(tmp_path: Path) -> None:
    box = Mailbox(str(tmp_path))
    helper = Preemption(sync_every=2, mailbox_dir=str(tmp_path))
    box.post(WorkerNotice("preempt", time.time() + 1.1, "aws", save_by=time.time() + 0.1))
    state = {"w": torch.zeros(4)}
    with Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig()) as ckpt:  # a fresh process: no estimate
        assert _stop_at_step_2(helper, ckpt, state) and ckpt.latest() == 2 and helper.skipped is None
    assert box.acks() == {0: 2}


def test_a_peer_notice_too_close_re_forms_without_claiming_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler, agent, box, events, helper, state = _agent_and_worker(tmp_path)
    restarts: list[object] = []
    monkeypatch.setattr(agent, "restart_workers", lambda: restarts.append(None))  # the rendezvous is not under test
    with Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig()) as ckpt:
        _train_and_save_once(ckpt, state)
        handler.peers = {"b": {"deadline": time.time() + 1.2, "source": "aws"}}
        agent.planned.tick()
        assert _stop_at_step_2(helper, ckpt, state) and ckpt.latest() == 1
    stopped = agent.planned.acknowledged_stop()
    assert stopped is not None
    agent.planned.restart_for_planned_change(stopped)
    restart = events.records[-1]
    assert restart["event"] == "planned_restart" and restart["reason"] == "peer_preempt"
    assert restart["saved"] is False and restart["step"] is None and restart["committed_at"] is None
    assert restart["agreed_step"] == 2 and restart["why"].startswith("save of step 2 needs ~")
    assert len(restarts) == 1


def test_the_agent_counts_only_saved_acknowledgements_as_a_committed_step(tmp_path: Path) -> None:
    _, agent, box, _, _, _ = _agent_and_worker(tmp_path)
    box.acknowledge(0, 8, saved=False, why="no time")
    assert agent.planned.acknowledged_stop().committed is None, "an unsaved step is not a committed one"
    assert agent.planned.acknowledged_stop() == Stopped(8, saved=False, why="no time")
    box.acknowledge(0, 8)
    assert agent.planned.acknowledged_stop() == Stopped(8, saved=True)
