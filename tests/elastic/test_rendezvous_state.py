"""The pure round state machine: decisions from plain snapshots, no etcd."""

from __future__ import annotations

import pytest

from elastic.rendezvous.state import (
    Action,
    FollowerView,
    Proposal,
    Reform,
    RoundRecord,
    Snapshot,
    coordinate,
    decide,
    follow,
    membership,
    order_nodes,
    reform_of,
)

pytestmark = pytest.mark.timeout(10)


def snap(
    node: str = "a",
    *,
    target: int = 1,
    committed: RoundRecord | None = None,
    live: set[str] | None = None,
    joined: dict[str, int] | None = None,
    closed: bool = False,
    min_nodes: int = 2,
    max_nodes: int = 3,
    now: float = 100.0,
    join_deadline: float = 700.0,
    last_call: float | None = None,
    rejoin: float | None = None,
) -> Snapshot:
    joined = {"a": 1} if joined is None else joined
    return Snapshot(
        node_id=node,
        target=target,
        committed=committed,
        live=frozenset(joined if live is None else live),
        joined=joined,
        closed=closed,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        now=now,
        join_deadline=join_deadline,
        last_call_deadline=last_call,
        rejoin_deadline=last_call if rejoin is None else rejoin,
    )


def round_(number: int, *participants: str) -> RoundRecord:
    return RoundRecord(number=number, participants=tuple(participants), master_addr="h", master_port=1)


# ------------------------------------------------------------------ first round
def test_missing_join_key_asks_to_join() -> None:
    assert decide(snap(joined={})).action is Action.JOIN


def test_below_min_waits_until_join_deadline_then_times_out() -> None:
    d = decide(snap(joined={"a": 1}, min_nodes=2))
    assert d.action is Action.WAIT and d.wake_at == 700.0
    assert decide(snap(joined={"a": 1}, now=700.0)).action is Action.TIMEOUT


def test_first_round_at_min_starts_last_call_then_rank0_commits_after_it() -> None:
    joined = {"a": 1, "b": 2}
    assert decide(snap(joined=joined)).action is Action.START_LAST_CALL
    waiting = decide(snap(joined=joined, last_call=101.0))
    assert waiting.action is Action.WAIT and waiting.wake_at == 101.0
    d = decide(snap(joined=joined, last_call=101.0, now=101.0))
    assert d.action is Action.COMMIT and d.participants == ("a", "b")
    # Not rank 0: waits for "a" to commit.
    assert decide(snap("b", joined=joined, last_call=101.0, now=101.0)).action is Action.WAIT


def test_full_round_commits_without_last_call() -> None:
    d = decide(snap(joined={"a": 1, "b": 2, "c": 3}, max_nodes=3))
    assert d.action is Action.COMMIT and d.participants == ("a", "b", "c")


def test_ranks_follow_registration_order_not_names() -> None:
    joined = {"zed": 5, "amy": 9, "bob": 7}
    assert order_nodes(joined) == ("zed", "bob", "amy")
    d = decide(snap("zed", joined=joined, max_nodes=3))
    assert d.participants == ("zed", "bob", "amy")


def test_beyond_max_only_the_first_max_are_taken() -> None:
    joined = {"a": 1, "b": 2, "c": 3, "d": 4}
    d = decide(snap(joined=joined, max_nodes=3))
    assert d.action is Action.COMMIT and d.participants == ("a", "b", "c")


# ------------------------------------------------------------------ committed rounds
def test_done_when_committed_round_includes_node() -> None:
    assert decide(snap(committed=round_(1, "a", "b"), target=1)).action is Action.DONE


def test_rejoin_when_round_committed_without_node() -> None:
    assert decide(snap("d", committed=round_(1, "a", "b", "c"), target=1, joined={})).action is Action.REJOIN


def test_stale_target_never_commits() -> None:
    """A node still aiming at round 2 while round 3 exists must not commit anything."""
    d = decide(snap("a", target=2, committed=round_(3, "b", "c"), joined={"a": 1}, live={"a", "b", "c"}))
    assert d.action is Action.REJOIN


def test_spare_waits_without_deadline_while_full_round_is_healthy() -> None:
    committed = round_(1, "a", "b", "c")
    s = snap("d", target=2, committed=committed, live={"a", "b", "c", "d"}, joined={"d": 4}, now=999.0, join_deadline=10.0)
    d = decide(s)
    assert d.action is Action.SPARE and d.wake_at is None


def test_newcomer_below_max_waits_for_running_agents_to_rejoin() -> None:
    committed = round_(1, "a", "b")
    s = snap("c", target=2, committed=committed, live={"a", "b", "c"}, joined={"c": 3})
    assert decide(s).action is Action.WAIT
    m = membership(committed, {"a", "b", "c"}, {"c"}, max_nodes=3)
    assert m.nodes_waiting == 1 and not m.broken


def test_full_round_does_not_report_spares_as_waiting() -> None:
    committed = round_(1, "a", "b", "c")
    m = membership(committed, {"a", "b", "c", "d"}, {"d"}, max_nodes=3)
    assert m.nodes_waiting == 0


def test_lost_participant_breaks_round_and_counts_as_waiting() -> None:
    committed = round_(1, "a", "b", "c")
    m = membership(committed, {"a", "b"}, set(), max_nodes=3)
    assert m.broken and m.lost == {"c"} and m.nodes_waiting >= 1


def test_recovery_commits_as_soon_as_all_survivors_joined() -> None:
    """No last call on recovery: survivors a, b of round 1 (c died) both joined."""
    committed = round_(1, "a", "b", "c")
    kw = dict(target=2, committed=committed, live={"a", "b"}, joined={"a": 1, "b": 2}, max_nodes=3)
    # The executor sets the deadlines on START_LAST_CALL and decides again at once (same instant):
    d = decide(snap("a", **kw, last_call=101.0, rejoin=130.0, now=100.0))
    assert d.action is Action.COMMIT and d.participants == ("a", "b")


def test_recovery_with_spare_fills_the_slot() -> None:
    committed = round_(1, "a", "b", "c")
    joined = {"a": 1, "b": 2, "d": 4}
    d = decide(snap("a", target=2, committed=committed, live={"a", "b", "d"}, joined=joined, max_nodes=3))
    assert d.action is Action.COMMIT and d.participants == ("a", "b", "d")


def test_live_straggler_is_waited_for_until_rejoin_deadline() -> None:
    """b is alive but has not re-joined (its agent is still stopping workers): wait for it, not churn."""
    committed = round_(1, "a", "b", "c")
    kw = dict(target=2, committed=committed, live={"a", "b"}, joined={"a": 1}, min_nodes=1, max_nodes=3)
    assert decide(snap("a", **kw)).action is Action.START_LAST_CALL
    d = decide(snap("a", **kw, last_call=1.0, rejoin=30.0, now=5.0))
    assert d.action is Action.WAIT and d.wake_at == 30.0 and "1 registered" in d.reason
    late = decide(snap("a", **kw, last_call=1.0, rejoin=30.0, now=30.0))
    assert late.action is Action.COMMIT and late.participants == ("a",)


def test_first_round_waits_for_registered_stragglers_then_last_call() -> None:
    kw = dict(live={"a", "b", "c"}, joined={"a": 1, "b": 2}, min_nodes=1, max_nodes=4)
    assert decide(snap(**kw, last_call=2.0, rejoin=30.0, now=3.0)).action is Action.WAIT  # c registered
    all_in = dict(kw, joined={"a": 1, "b": 2, "c": 3})
    d = decide(snap(**all_in, last_call=5.0, rejoin=30.0, now=3.0))
    assert d.action is Action.WAIT and d.wake_at == 5.0  # first round: last call for unknown nodes
    assert decide(snap(**all_in, last_call=5.0, rejoin=30.0, now=5.0)).action is Action.COMMIT


def test_rejoining_participant_opens_next_round_for_newcomer() -> None:
    committed = round_(1, "a", "b")
    joined = {"a": 1, "b": 2, "c": 3}
    d = decide(snap("a", target=2, committed=committed, live={"a", "b", "c"}, joined=joined, max_nodes=3))
    assert d.action is Action.COMMIT and d.participants == ("a", "b", "c")


def test_survivors_below_min_time_out() -> None:
    committed = round_(1, "a", "b")
    s = snap("a", target=2, committed=committed, live={"a"}, joined={"a": 1}, min_nodes=2, now=800.0)
    assert decide(s).action is Action.TIMEOUT


def test_closed_wins_over_everything() -> None:
    assert decide(snap(closed=True, committed=round_(1, "a", "b"))).action is Action.CLOSED


def test_round_record_validates() -> None:
    with pytest.raises(ValueError, match="distinct"):
        RoundRecord(number=1, participants=("a", "a"))
    with pytest.raises(ValueError, match=">= 1"):
        RoundRecord(number=0, participants=("a",))


# ------------------------------------------------------------------ the coordinator (O(N) rounds)
def test_coordinator_proposes_what_rank_0_would_commit() -> None:
    """``coordinate`` forms the same round as ``decide`` would for its rank 0, whoever coordinates."""
    for kw in (
        dict(joined={"a": 1, "b": 2, "c": 3}, max_nodes=3),
        dict(joined={"zed": 5, "amy": 9, "bob": 7}, max_nodes=3),
        dict(joined={"a": 1, "b": 2, "c": 3, "d": 4}, max_nodes=3),
        dict(target=2, committed=round_(1, "a", "b", "c"), live={"a", "b", "d"}, joined={"a": 1, "b": 2, "d": 4}),
    ):
        rank0 = decide(snap(order_nodes(kw["joined"])[0], **kw))  # type: ignore[arg-type]
        proposed = coordinate(snap("outsider", **kw))  # type: ignore[arg-type]
        assert rank0.action is Action.COMMIT and proposed.action is Action.PROPOSE
        assert proposed.participants == rank0.participants


def test_coordinator_waits_for_min_last_call_and_stragglers() -> None:
    assert coordinate(snap(joined={"a": 1}, min_nodes=2)).action is Action.WAIT
    joined = {"a": 1, "b": 2}
    assert coordinate(snap(joined=joined)).action is Action.START_LAST_CALL
    waiting = coordinate(snap(joined=joined, last_call=101.0))
    assert waiting.action is Action.WAIT and waiting.wake_at == 101.0
    assert coordinate(snap(joined=joined, last_call=101.0, now=101.0)).participants == ("a", "b")
    committed = round_(1, "a", "b", "c")
    kw = dict(target=2, committed=committed, live={"a", "b"}, joined={"a": 1}, min_nodes=1, max_nodes=3)
    assert coordinate(snap("z", **kw, last_call=1.0, rejoin=30.0, now=5.0)).action is Action.WAIT  # b is stopping
    assert coordinate(snap("z", **kw, last_call=1.0, rejoin=30.0, now=30.0)).participants == ("a",)


def test_coordinator_never_proposes_over_a_healthy_round_a_closed_job_or_a_newer_round() -> None:
    """Spares, a closed job and a stale target: nothing to propose, and never a timeout (nodes check theirs)."""
    committed = round_(1, "a", "b", "c")
    spare = snap("a", target=2, committed=committed, live={"a", "b", "c", "d"}, joined={"d": 4}, now=999.0,
                 join_deadline=10.0)
    assert coordinate(spare).action is Action.WAIT
    assert coordinate(snap(joined={"a": 1, "b": 2, "c": 3}, closed=True)).action is Action.WAIT
    assert coordinate(snap(target=1, committed=round_(1, "a"), joined={"b": 2})).action is Action.WAIT
    assert coordinate(snap(joined={"a": 1}, now=9999.0)).action is Action.WAIT


def view(node: str = "b", **kw: object) -> FollowerView:
    base: dict[str, object] = dict(node_id=node, target=1, committed=None, closed=False, joined=True, proposal=None,
                                   now=100.0, join_deadline=700.0)
    base.update(kw)
    return FollowerView(**base)  # type: ignore[arg-type]


def test_follower_joins_then_waits_for_the_proposal_and_commits_only_as_its_rank_0() -> None:
    assert follow(view(joined=False)).action is Action.JOIN
    waiting = follow(view())
    assert waiting.action is Action.WAIT and waiting.wake_at == 700.0
    mine = Proposal(1, ("b", "a"), mod_revision=7)
    d = follow(view(proposal=mine))
    assert d.action is Action.COMMIT and d.participants == ("b", "a")
    assert follow(view("a", proposal=mine)).action is Action.WAIT, "only rank 0 commits (it hosts the store)"
    assert follow(view(proposal=Proposal(2, ("b",)))).action is Action.WAIT, "a proposal for another round"


def test_follower_done_rejoin_and_closed_come_first() -> None:
    assert follow(view(committed=round_(1, "a", "b"))).action is Action.DONE
    assert follow(view("c", committed=round_(1, "a", "b"))).action is Action.REJOIN
    assert follow(view(closed=True, proposal=Proposal(1, ("b",)))).action is Action.CLOSED
    # A stale target never commits a proposal for it.
    assert follow(view(target=1, committed=round_(2, "x"), proposal=Proposal(1, ("b",)))).action is Action.REJOIN


def test_follower_checks_the_full_state_at_its_join_deadline_then_every_recheck() -> None:
    assert follow(view(now=700.0)).action is Action.CHECK
    after = follow(view(now=701.0, checked_at=700.0, recheck_s=2.0))
    assert after.action is Action.WAIT and after.wake_at == 702.0
    assert follow(view(now=702.0, checked_at=700.0, recheck_s=2.0)).action is Action.CHECK


def test_reform_tells_followers_of_losses_rejoins_and_newcomers_once() -> None:
    committed = round_(1, "a", "b", "c")
    assert reform_of(committed, {"a", "b", "c"}, (), (), 3, closed=False) is None
    assert reform_of(committed, {"a", "b", "c", "d"}, {"d"}, (), 3, closed=False) is None, "a spare is no news"
    lost = reform_of(committed, {"a", "b"}, (), (), 3, closed=False)
    assert lost == Reform(round=1, waiting=1, lost=("c",))
    assert reform_of(committed, {"a", "b"}, (), (), 3, closed=True) is None, "after the end a leaver finished"
    rejoin = reform_of(committed, {"a", "b", "c"}, {"b"}, (), 3, closed=False)
    assert rejoin is not None and rejoin.waiting == 1 and rejoin.lost == ()
    newcomer = reform_of(round_(1, "a", "b"), {"a", "b", "c"}, {"c"}, (), 3, closed=False)
    assert newcomer is not None and newcomer.waiting == 1
    # Sticky losses: a participant that re-registered since still counts as lost for its round.
    assert reform_of(committed, {"a", "b", "c"}, (), {"c"}, 3, closed=False) == Reform(1, 1, ("c",))
    # Only new losses or a new round are news (a growing count alone would cost one post per re-joiner).
    assert lost.news_after(None) and not lost.news_after(lost)
    assert not Reform(1, 2, ("c",)).news_after(lost)
    assert Reform(1, 2, ("b", "c")).news_after(lost) and Reform(2, 1).news_after(lost)
