"""The coordinator thread's decisions (``Coordinator.tick``) on a mirror and a clock the test owns, no etcd."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from elastic.rendezvous.api import EtcdRendezvousConfig, RendezvousConnectionError
from elastic.rendezvous.coordinator import Coordinator, CoordinatorDuty
from elastic.rendezvous.health import EtcdHealth
from elastic.rendezvous.mirror import LOSS_LINES_PER_ROUND, Mirror, MirrorUpdater
from elastic.rendezvous.state import Reform, RoundRecord

pytestmark = pytest.mark.timeout(10)


class _NoWaitCondition(threading.Condition):
    """The handler's condition, whose waits return at once: the test moves the clock itself."""

    def wait(self, timeout: float | None = None) -> bool:
        return False


class _NoWaitEvent(threading.Event):
    """The stop event, whose waits (the pause after a failed write) return at once."""

    def wait(self, timeout: float | None = None) -> bool:
        return self.is_set()


class _Writes:
    """``RoundWriter`` as the coordinator uses it: posts land in the mirror; ``busy`` makes the next post fail."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror
        self.busy = 0
        self.proposals: list[tuple[int, tuple[str, ...]]] = []

    def post_reform(self, reform: Reform) -> None:
        if self.busy:
            self.busy -= 1
            raise RendezvousConnectionError("etcd answered 'too many requests' (post a reform notice)")
        self.mirror.reform = reform

    def propose(self, target: int, participants: tuple[str, ...], *_args: Any) -> None:
        self.proposals.append((target, participants))

    def elect(self, lease: int) -> None:
        raise AssertionError("the test's node coordinates already")


def _coordinator(mirror: Mirror, now: list[float], rejoin_timeout: float) -> tuple[Coordinator, _Writes, MirrorUpdater]:
    config = EtcdRendezvousConfig(run_id="job", endpoints=(("127.0.0.1", 2379),), min_nodes=1, max_nodes=4,
                                  rejoin_timeout=rejoin_timeout)
    cond = _NoWaitCondition()
    writes = _Writes(mirror)
    updater = MirrorUpdater("P/ctl/", lambda: "", lambda exc: None)
    coordinator = Coordinator(
        config, writes, updater, EtcdHealth(config, cond, lambda: now[0], lambda: ""),  # type: ignore[arg-type]
        cond, _NoWaitEvent(), node_id="a", mirror=lambda: mirror, lease=lambda: 7, renewing=lambda: False,
        released=lambda: False, clock=lambda: now[0], ctx=lambda: "")
    return coordinator, writes, updater


def test_a_failed_post_does_not_restart_the_deadline_for_registered_nodes_that_have_not_joined() -> None:
    """Issue 18: under a mass lease expiry each new loss is a reform post, and an overloaded etcd refuses some of
    them; each refusal restarted the recovery round's deadline for stragglers (registered, not joined), so a
    round waiting for one that never joins was put off for as long as posts kept failing."""
    mirror = Mirror(nodes={"a": 1, "b": 2, "d": 4}, joins={2: {"a": 1, "b": 2}},
                    committed=RoundRecord(1, ("a", "b", "c")), committed_mod=10, loaded=True, full=True,
                    coordinator=("a", 7))
    now = [100.0]
    coordinator, writes, updater = _coordinator(mirror, now, rejoin_timeout=5.0)
    updater.lost[1] = {"c"}
    duty = CoordinatorDuty()

    coordinator.tick(duty)  # c is lost: the notice
    assert mirror.reform == Reform(1, 3, ("c",))
    coordinator.tick(duty)  # a and b joined, d (registered) not yet: wait for it until 105
    assert (duty.rejoin, writes.proposals) == (105.0, [])

    now[0] = 104.0  # b is lost too; etcd refuses the first post of it
    del mirror.nodes["b"], mirror.joins[2]["b"]
    updater.lost[1].add("b")
    writes.busy = 1
    coordinator.tick(duty)
    assert mirror.reform == Reform(1, 3, ("c",))
    coordinator.tick(duty)  # posted again
    assert mirror.reform == Reform(1, 3, ("b", "c"))
    coordinator.tick(duty)
    assert (duty.rejoin, writes.proposals) == (105.0, [])

    now[0] = 105.5  # d never joined: the deadline set at 100 still closes the round
    coordinator.tick(duty)
    assert writes.proposals == [(2, ("a",))]


def test_a_round_with_every_registered_node_joined_is_proposed_at_once() -> None:
    """The fast path the first test's deadline backs up: no straggler, no wait."""
    mirror = Mirror(nodes={"a": 1, "b": 2}, joins={2: {"a": 1, "b": 2}}, committed=RoundRecord(1, ("a", "b", "c")),
                    committed_mod=10, loaded=True, full=True, coordinator=("a", 7))
    now = [100.0]
    coordinator, writes, updater = _coordinator(mirror, now, rejoin_timeout=600.0)
    updater.lost[1] = {"c"}
    duty = CoordinatorDuty()
    for _ in range(3):  # notice, last call, proposal
        coordinator.tick(duty)
    assert writes.proposals == [(2, ("a", "b"))]


def test_a_mass_loss_logs_a_few_lines_per_agent_not_one_per_participant(caplog: pytest.LogCaptureFixture) -> None:
    """Every agent logs the departures it sees: at 1,000 agents a mass loss was 988,000 "lost its lease" lines
    (214 MB). The first LOSS_LINES_PER_ROUND of a round are logged each, then one line says the rest go to
    DEBUG; every loss still counts (``lost``, what the round re-forms for)."""
    participants = tuple(f"n{i}" for i in range(20))
    mirror = Mirror(nodes={n: i for i, n in enumerate(participants)}, committed=RoundRecord(1, participants),
                    committed_mod=10, loaded=True, full=True)
    updater = MirrorUpdater("P/ctl/", lambda: "", lambda exc: None)
    with caplog.at_level(logging.DEBUG, logger="elastic.rendezvous.etcd_v3"):
        for node in participants[1:]:
            updater.delete(mirror, f"P/ctl/nodes/{node}")
    assert updater.lost[1] == set(participants[1:])
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(loud) == LOSS_LINES_PER_ROUND + 1, loud
    assert loud[:-1] == [f"participant n{i} of round 1 lost its lease" for i in range(1, LOSS_LINES_PER_ROUND + 1)]
    assert "the others are logged at DEBUG level" in loud[-1]
    quiet = [r for r in caplog.records if r.levelno == logging.DEBUG and "lost its lease" in r.getMessage()]
    assert len(quiet) == len(participants) - 1 - LOSS_LINES_PER_ROUND
