"""``OwnRound`` on plain mirrors: the membership a node reports from what its watch delivered (no etcd)."""

from __future__ import annotations

from elastic.rendezvous.api import RendezvousError
from elastic.rendezvous.mirror import Mirror, MirrorUpdater
from elastic.rendezvous.own_round import OwnRound
from elastic.rendezvous.state import Reform, RoundRecord


def _corrupt(exc: RendezvousError) -> None:
    raise AssertionError(f"no key is parsed here: {exc}")


def _own(mirror: Mirror, *, max_nodes: int = 4, node: str = "a") -> tuple[OwnRound, MirrorUpdater]:
    updater = MirrorUpdater("/p/ctl/", lambda: "", _corrupt)
    return OwnRound(updater, node_id=node, max_nodes=max_nodes, mirror=lambda: mirror), updater


def test_before_its_first_round_a_node_reports_the_first_joins_and_no_change() -> None:
    own, _ = _own(Mirror(joins={1: {"a": 1, "b": 2}}))
    assert own.nodes_waiting() == 2
    assert not own.changed()
    assert own.lost_peers() == set() and own.peer_notices() == {}


def test_a_follower_reads_waiting_and_lost_from_the_reform_post_of_its_round_only() -> None:
    record = RoundRecord(2, ("a", "b", "c"))
    mirror = Mirror(committed=record, reform=Reform(round=1, waiting=3, lost=("b",)))
    own, _ = _own(mirror)
    own.record = record
    assert own.nodes_waiting() == 0 and not own.changed(), "a post about round 1 says nothing of round 2"
    mirror.reform = Reform(round=2, waiting=1, lost=("b",))
    assert own.nodes_waiting() == 1 and own.changed()
    assert own.lost_peers() == {"b"}


def test_the_coordinator_counts_from_its_full_mirror() -> None:
    record = RoundRecord(1, ("a", "b"))
    mirror = Mirror(committed=record, full=True, nodes={"a": 1})
    own, updater = _own(mirror)
    own.record = record
    assert own.lost_peers() == {"b"}, "b's registration is gone"
    assert own.changed()
    updater.finished[1] = {"c"}
    assert own.lost_peers() == {"b", "c"}


def test_a_newer_round_without_this_node_leaves_it_behind_and_waiting() -> None:
    mine = RoundRecord(1, ("a", "b"))
    mirror = Mirror(committed=RoundRecord(2, ("b", "c")))
    own, _ = _own(mirror)
    own.record = mine
    assert own.left_behind()
    assert own.nodes_waiting() == 1 and own.changed()
    mirror.committed = RoundRecord(2, ("a", "b", "c"))
    assert not own.left_behind(), "a newer round with this node in it"


def test_peer_notices_are_those_of_the_other_participants() -> None:
    mirror = Mirror(notices={"a": {"deadline": 1.0}, "b": {"deadline": 2.0}, "z": {"deadline": 3.0}})
    own, _ = _own(mirror)
    own.record = RoundRecord(1, ("a", "b"))
    notices = own.peer_notices()
    assert notices == {"b": {"deadline": 2.0}}
    notices["b"]["deadline"] = 9.0
    assert mirror.notices["b"] == {"deadline": 2.0}, "a copy, not the mirror's own dict"
