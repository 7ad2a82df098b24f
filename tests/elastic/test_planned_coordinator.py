"""The agent's planned-change coordinator (``elastic.planned.PlannedChanges``) on plain data: no agent, no
mailbox, no rendezvous. Each test drives ``tick`` with ``TickView``s and asserts the actions and the state.
What the agent does with the actions (events, the lease, the mailbox) is in test_agent_planned.py."""

from __future__ import annotations

import pytest

from elastic.notice import Notice
from elastic.planned import (
    WHY_BEFORE_HELPERS,
    AbandonStop,
    AfterSuccess,
    HelperOutlook,
    LeaveNow,
    PlannedChanges,
    PlannedDecision,
    PlannedTick,
    PostStop,
    Reform,
    SignalAction,
    Stopped,
    TickView,
    helper_outlook,
)
from elastic.preemption import WorkerNotice

NOW = 1000.0
GRACE = 1.0


def _coordinator() -> PlannedChanges:
    return PlannedChanges(stop_grace=GRACE, resize_timeout=30.0)


def _view(now: float = NOW, **fields: object) -> TickView:
    fields.setdefault("helpers_ready", True)
    return TickView(now=now, **fields)  # type: ignore[arg-type]


def test_nothing_planned_is_nothing_to_do() -> None:
    planned = _coordinator()
    assert planned.tick(_view()) == PlannedDecision(PlannedTick.NONE)
    assert planned.posted is None and planned.helpers_seen, "the helpers were noted"


def test_this_nodes_notice_is_posted_once_with_its_save_by_and_waited_for() -> None:
    planned = _coordinator()
    planned.receive(Notice("aws", NOW + 30, "spot instance-action terminate"))
    decision = planned.tick(_view())
    expected = WorkerNotice("preempt", NOW + 30, "aws", save_by=NOW + 30 - GRACE)
    assert decision == PlannedDecision(PlannedTick.WAITING, (PostStop(expected),))
    assert planned.posted == expected and planned.leaving
    assert planned.tick(_view(NOW + 1)) == PlannedDecision(PlannedTick.WAITING), "posted once, then waited for"


def test_the_earliest_own_notice_binds_and_is_published_once() -> None:
    planned = _coordinator()
    assert planned.to_publish() is None
    planned.receive(Notice("gcp", NOW + 60))
    planned.receive(Notice("sigterm", NOW + 30))
    planned.receive(Notice("azure", NOW + 90))
    assert planned.own == Notice("sigterm", NOW + 30)
    assert planned.to_publish() == Notice("sigterm", NOW + 30)
    assert planned.to_publish() is None, "published once"


def test_a_peer_notice_is_posted_and_its_departure_is_not_a_crash() -> None:
    planned = _coordinator()
    decision = planned.tick(_view(peer_notices={"b": NOW + 60}))
    assert decision.actions == (PostStop(WorkerNotice("peer_preempt", NOW + 60, "node b", save_by=NOW + 59)),)
    # b revoked its lease: its notice key went with it, but its deadline is remembered for this round
    decision = planned.tick(_view(NOW + 5, lost=frozenset({"b"}), membership_changed=True))
    assert decision == PlannedDecision(PlannedTick.WAITING), "keep waiting for the agreed step"
    assert planned.peer_deadlines == {"b": NOW + 60}
    planned.new_group()
    assert planned.peer_deadlines == {} and planned.posted is None, "a new group starts from nothing posted"


def test_the_earliest_peer_deadline_binds_and_a_repeated_notice_keeps_its_first_deadline() -> None:
    planned = _coordinator()
    planned.tick(_view(peer_notices={"b": NOW + 60, "c": NOW + 40}))
    assert planned.posted is not None and planned.posted.deadline == NOW + 40 and planned.posted.source == "node c"
    planned.tick(_view(peer_notices={"c": NOW + 99}))
    assert planned.peer_deadlines == {"b": NOW + 60, "c": NOW + 40}


def test_a_peer_crash_while_posted_abandons_the_stop_and_re_forms() -> None:
    planned = _coordinator()
    planned.tick(_view(peer_notices={"b": NOW + 60}))
    decision = planned.tick(_view(NOW + 1, lost=frozenset({"c"}), membership_changed=True))
    why = "peer(s) ['c'] vanished without notice"
    assert decision == PlannedDecision(PlannedTick.WAITING, (AbandonStop("peer_preempt", why), Reform()))
    assert planned.posted is None


def test_a_deadline_too_short_to_save_abandons_and_this_node_leaves() -> None:
    planned = _coordinator()
    planned.receive(Notice("aws", NOW + 0.5, "spot instance-action terminate"))
    assert planned.tick(_view()).outcome is PlannedTick.WAITING, "posted: the workers may still make it"
    decision = planned.tick(_view(NOW + 0.1))
    why = "the deadline left no time to save"
    assert decision == PlannedDecision(PlannedTick.LEFT, (AbandonStop("preempt", why), LeaveNow(why))), \
        "0.4 s left is less than the stop grace"


def test_a_resize_is_posted_with_the_resize_timeout_but_not_after_a_crash() -> None:
    planned = _coordinator()
    decision = planned.tick(_view(membership_changed=True))
    assert decision.actions == (PostStop(WorkerNotice("resize", NOW + 30, "a node is waiting to join",
                                                      save_by=NOW + 29)),)
    crashed = _coordinator()
    assert crashed.tick(_view(membership_changed=True, lost=frozenset({"b"}))) == PlannedDecision(PlannedTick.NONE)


def test_a_peer_notice_with_an_unplanned_loss_is_left_to_the_restart_path() -> None:
    planned = _coordinator()
    decision = planned.tick(_view(peer_notices={"b": NOW + 60}, lost=frozenset({"c"}), membership_changed=True))
    assert decision == PlannedDecision(PlannedTick.NONE) and planned.posted is None


def test_without_helpers_this_nodes_notice_leaves_at_once_and_says_why() -> None:
    planned = _coordinator()
    planned.receive(Notice("gcp", NOW + 30, "instance/preempted TRUE"))
    decision = planned.tick(_view(helpers_ready=False))
    assert decision == PlannedDecision(PlannedTick.LEFT, (LeaveNow("the workers do not use "
                                                                   "elastic.preemption.Preemption"),))
    assert not planned.helpers_seen


def test_without_helpers_a_peer_notice_is_not_posted() -> None:
    planned = _coordinator()
    assert planned.tick(_view(helpers_ready=False, peer_notices={"b": NOW + 60})) == PlannedDecision(PlannedTick.NONE)


def test_a_notice_during_a_restart_waits_for_helpers_that_were_used_before_while_time_is_left() -> None:
    planned = _coordinator()
    assert planned.tick(_view()).outcome is PlannedTick.NONE  # healthy, nothing planned: the helper is noted
    planned.new_group()  # a restart: the new workers have not constructed their helper yet
    planned.receive(Notice("aws", NOW + 30))
    assert planned.tick(_view(helpers_ready=False)) == PlannedDecision(PlannedTick.NONE), "wait for the helpers"
    late = planned.tick(_view(NOW + 29.5, helpers_ready=False))
    assert late == PlannedDecision(PlannedTick.LEFT, (LeaveNow("the workers did not start their Preemption "
                                                               "helper in time"),))


def test_helpers_that_came_back_get_the_notice() -> None:
    planned = _coordinator()
    planned.tick(_view())
    planned.new_group()
    planned.receive(Notice("aws", NOW + 30))
    planned.tick(_view(helpers_ready=False))
    decision = planned.tick(_view(NOW + 1))
    assert decision.outcome is PlannedTick.WAITING and planned.posted is not None
    assert planned.posted.reason == "preempt"


@pytest.mark.parametrize(
    ("own", "posted", "stopped", "expected"),
    [
        (False, False, None, AfterSuccess.FINISH),
        (False, True, Stopped(8, saved=True), AfterSuccess.REFORM),
        (False, False, Stopped(8, saved=False, why="no time"), AfterSuccess.REFORM),
        (True, True, Stopped(8, saved=True), AfterSuccess.LEAVE),
        (True, True, None, AfterSuccess.LEAVE),
        (True, False, Stopped(8, saved=True), AfterSuccess.LEAVE),
        (True, False, None, AfterSuccess.FINISH),
    ],
)
def test_what_follows_workers_that_all_exited_0(own: bool, posted: bool, stopped: Stopped | None,
                                                expected: AfterSuccess) -> None:
    planned = _coordinator()
    if own:
        planned.receive(Notice("aws", NOW + 30))
    if posted:
        planned.posted = WorkerNotice("preempt" if own else "peer_preempt", NOW + 30)
    assert planned.after_success(stopped) is expected


def test_a_notice_signal_between_rounds_leaves_and_a_second_sigterm_shuts_down() -> None:
    planned = _coordinator()
    assert planned.on_signal(between_rounds=True, sigterm=True, helpers_ready=False) is SignalAction.LEAVE_NOW
    assert planned.on_signal(between_rounds=False, sigterm=True, helpers_ready=False) is SignalAction.SHUT_DOWN, \
        "workers that cannot save: torch's immediate stop"
    assert planned.on_signal(between_rounds=False, sigterm=False, helpers_ready=False) is SignalAction.NOTICE, \
        "--preempt-signal is a notice even without helpers"
    assert planned.on_signal(between_rounds=False, sigterm=True, helpers_ready=True) is SignalAction.NOTICE
    planned.receive(Notice("sigterm", NOW + 30))
    assert planned.on_signal(between_rounds=False, sigterm=True, helpers_ready=True) is SignalAction.SHUT_DOWN, \
        "a second SIGTERM insists"
    assert planned.on_signal(between_rounds=True, sigterm=True, helpers_ready=True) is SignalAction.SHUT_DOWN


# --- a notice while the workers start (issue 27): "not built yet" against "never will be" ------------------------


@pytest.mark.parametrize(("ready", "seen", "announced", "expected"), [
    (True, False, False, HelperOutlook.READY),
    (True, True, True, HelperOutlook.READY),
    (False, True, False, HelperOutlook.RESTARTING),
    (False, True, True, HelperOutlook.RESTARTING),
    (False, False, True, HelperOutlook.COMING),
    (False, False, False, HelperOutlook.NEVER),
])
def test_helper_outlook(ready: bool, seen: bool, announced: bool, expected: HelperOutlook) -> None:
    assert helper_outlook(ready=ready, seen_before=seen, announced=announced) is expected


def test_a_sigterm_before_announced_helpers_exist_leaves_instead_of_shutting_down() -> None:
    planned = _coordinator()
    assert planned.on_signal(between_rounds=False, sigterm=True, helpers_ready=False,
                             announced=True) is SignalAction.LEAVE_NOW, "nothing trained since the restore"
    assert planned.on_signal(between_rounds=False, sigterm=False, helpers_ready=False,
                             announced=True) is SignalAction.LEAVE_NOW
    assert planned.on_signal(between_rounds=False, sigterm=True, helpers_ready=False,
                             announced=False) is SignalAction.SHUT_DOWN, "a plain torchrun script: as before"


def test_a_sigterm_while_known_helpers_restart_is_a_notice_they_save_for() -> None:
    planned = _coordinator()
    planned.tick(TickView(now=NOW, helpers_ready=True))
    assert planned.helpers_seen
    assert planned.on_signal(between_rounds=False, sigterm=True, helpers_ready=False) is SignalAction.NOTICE
    planned.receive(Notice("sigterm", NOW + 30))
    decision = planned.tick(TickView(now=NOW + 1, helpers_ready=False))
    assert decision.outcome is PlannedTick.NONE and not decision.actions, "waits for the helpers to come back"
    decision = planned.tick(TickView(now=NOW + 30 - GRACE, helpers_ready=False))
    assert decision.outcome is PlannedTick.LEFT and isinstance(decision.actions[0], LeaveNow)


def test_a_notice_tick_before_announced_helpers_leaves_at_once() -> None:
    planned = _coordinator()
    planned.receive(Notice("aws", NOW + 120))
    decision = planned.tick(TickView(now=NOW, helpers_ready=False, helpers_announced=True))
    assert decision.outcome is PlannedTick.LEFT
    assert decision.actions == (LeaveNow(WHY_BEFORE_HELPERS),)


def test_a_notice_signal_after_the_run_is_ignored() -> None:
    planned = _coordinator()
    assert planned.on_signal(between_rounds=True, sigterm=True, helpers_ready=False,
                             run_over=True) is SignalAction.IGNORE
    planned.receive(Notice("sigterm", NOW + 30))
    assert planned.on_signal(between_rounds=False, sigterm=True, helpers_ready=True,
                             run_over=True) is SignalAction.IGNORE, "not even a second SIGTERM: nothing runs"
