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


def test_restarted_peers_are_other_participants_that_named_this_round() -> None:
    """``restart/{node}`` says in which round the node's workers failed: only this node's round counts (a key
    left from an older round, or a node outside the round, is not a restart of a peer's workers now)."""
    mirror = Mirror(restarts={"a": 2, "b": 2, "c": 1, "z": 2})
    own, _ = _own(mirror)
    assert own.restarted_peers() == set(), "before its first round a node has no peers"
    own.record = RoundRecord(2, ("a", "b", "c"))
    assert own.restarted_peers() == {"b"}, "not itself, not c's restart of round 1, not z outside the round"


def test_a_restart_key_is_mirrored_and_a_damaged_one_is_a_corrupt_key() -> None:
    errors: list[RendezvousError] = []
    updater = MirrorUpdater("/p/ctl/", lambda: "", errors.append)
    mirror = Mirror()
    updater.put(mirror, "/p/ctl/restart/b", b'{"round": 3, "node": "b", "time": 1.0}', 10)
    assert mirror.restarts == {"b": 3}
    updater.delete(mirror, "/p/ctl/restart/b")
    assert mirror.restarts == {}, "gone with the node's lease"
    for bad in (b'{"round": "3"}', b'{"round": true}', b'{"round": 0}', b"[]", b"{}", b"not json"):
        updater.put(mirror, "/p/ctl/restart/b", bad, 11)
    assert len(errors) == 6 and all("corrupt rendezvous key '/p/ctl/restart/b'" in str(e) for e in errors), errors
    assert mirror.restarts == {}, "nothing guessed from a damaged key"
