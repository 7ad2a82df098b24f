"""The coordinator role (``Coordinator``): one node mirrors every key and posts what the others need.

While no node holds ``P/ctl/post/coordinator`` each node tries the election transaction (after a random wait
that grows with ``max_nodes``: ``election_spread``); the winner's key lives on its lease and ends with it. While
this node holds it, it mirrors every registration and join (``MirrorWatch``) and runs the pure
``state.coordinate`` and ``state.reform_of`` on its mirror: it posts the proposal of the next round when one may
close, and the reform notice when the committed round breaks. The writes are ``RoundWriter``'s. Decisions are
taken under the handler's condition, the I/O outside it (the watch thread needs the condition to deliver them).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .api import EtcdRendezvousConfig, RendezvousError
from .health import EtcdHealth, is_lease_not_found
from .mirror import SAFETY_RECHECK_S, Mirror, MirrorUpdater
from .rounds import RoundWriter, snapshot_of, wait_time
from .state import Action, Reform, coordinate, reform_of

log = logging.getLogger("elastic.rendezvous.etcd_v3")
"""The handler's parts log as the handler (the same logger name in every line as before they were parts)."""


ELECT_SPREAD_PER_NODE_S = 0.0005
"""Without a coordinator, a node waits a random delay of up to this many seconds per ``max_nodes`` (at most
``ELECT_SPREAD_MAX_S``) before it tries the election, and only tries when none won meanwhile: at 1,000 agents
that starting together, the first winner's key reaches most of them before their turn, instead of 1,000
election transactions that an overloaded etcd answers with "too many requests". Below 10 ms (max_nodes < 20)
there is no wait."""

ELECT_SPREAD_MAX_S = 1.0


def election_spread(max_nodes: int) -> float:
    """The longest random wait before an election try (0: try at once)."""
    spread = min(ELECT_SPREAD_MAX_S, ELECT_SPREAD_PER_NODE_S * max_nodes)
    return spread if spread >= 0.01 else 0.0


@dataclass(slots=True)
class CoordinatorDuty:
    """What the coordinator thread remembers between its decisions (its own writes not yet mirrored)."""

    target: tuple[int, int] | None = None
    """(round to form, round-key revision) the deadlines below belong to."""
    last_call: float | None = None
    rejoin: float | None = None
    proposed: tuple[int, tuple[str, ...], int, int] | None = None
    """(round, participants, round-key revision, proposal revision) of our last proposal."""
    reform: Reform | None = None
    reason: str = ""
    elect_tried_at: int | None = None
    """Mirror revision when this node last tried to become the coordinator."""
    elect_after: float | None = None
    """When (clock) this node may try the election (``election_spread``); None: not drawn yet."""

    def reset(self) -> None:
        """Forget everything: this node stopped (or started) being the coordinator."""
        self.target = self.proposed = self.reform = self.elect_tried_at = None
        self.last_call = self.rejoin = self.elect_after = None

    def forget_writes(self) -> None:
        """A write failed: forget what it may not have written (post, propose or elect again), but keep the
        deadlines of the round being formed. They bound how long it waits for registered nodes that have not
        joined; restarted by every failed write (etcd's "too many requests" or a timeout on a post, frequent
        under a mass lease expiry, where each new loss is a post), they could be put off for ever."""
        self.proposed = self.reform = self.elect_tried_at = self.elect_after = None


class Coordinator:
    """The coordinator thread of one handler (``run``): elects, then proposes rounds and posts reform notices."""

    def __init__(
        self,
        config: EtcdRendezvousConfig,
        rounds: RoundWriter,
        updater: MirrorUpdater,
        health: EtcdHealth,
        cond: threading.Condition,
        stop: threading.Event,
        *,
        node_id: str,
        mirror: Callable[[], Mirror],
        lease: Callable[[], int | None],
        renewing: Callable[[], bool],
        released: Callable[[], bool],
        clock: Callable[[], float],
        ctx: Callable[[], str],
    ) -> None:
        """Args:
            rounds: the election, proposal and reform writes.
            updater: the participants lost per round (the reform notice names them).
            health: no decision while the handler has a fatal error.
            cond: the handler's condition (guards the mirror; decisions are taken under it).
            stop: set when the handler stops (the thread ends).
            mirror: the mirror the watch keeps now (read under ``cond``).
            lease: this node's lease now (None: not registered yet).
            renewing: a re-registration is replacing the lease (no election on the old one).
            released: the handler left (no more decisions).
            ctx: the handler's log context."""
        self._config = config
        self._rounds = rounds
        self._updater = updater
        self._health = health
        self._cond = cond
        self._stop = stop
        self._node_id = node_id
        self._mirror = mirror
        self._lease = lease
        self._renewing = renewing
        self._released = released
        self._clock = clock
        self._ctx = ctx
        self.thread: threading.Thread | None = None
        """The coordinator thread (``start``)."""

    def start(self) -> None:
        """Start the coordinator thread (``run``)."""
        self.thread = threading.Thread(target=self.run, name=f"rdzv-coord-{self._node_id}", daemon=True)
        self.thread.start()

    def run(self) -> None:
        """While no node coordinates, try to; while this node does, post proposals and reform notices.

        The coordinator mirrors every key (``MirrorWatch``); everything else it learns is posted as one key
        each node watches, so a round costs O(N) watch events instead of every join reaching every node."""
        duty = CoordinatorDuty()
        while not self._stop.is_set():
            self.tick(duty)

    def tick(self, duty: CoordinatorDuty) -> None:
        """One decision and its I/O (or its wait); a failed write is logged and tried again after a pause."""
        try:
            step = self._step(duty)
            if step is not None:
                step()
        except RendezvousError as exc:
            if self._stop.is_set():
                return
            # A lease that just ended (the lease thread re-registers) is no news; anything else is.
            level = logging.INFO if is_lease_not_found(exc.__cause__) else logging.WARNING
            log.log(level, "%scoordinator: %s; trying again", self._ctx(), exc)
            duty.forget_writes()
            self._stop.wait(0.5)
        except Exception:  # a bug: say so, do not die silently; the followers' deadline checks still work
            log.exception("%scoordinator step failed", self._ctx())
            duty.reset()
            self._stop.wait(SAFETY_RECHECK_S)

    def _step(self, duty: CoordinatorDuty) -> Callable[[], None] | None:
        """Decide under the lock what the coordinator role asks for now; return the I/O to do (or wait)."""
        with self._cond:
            if self._stop.is_set():
                return None
            if self._health.fatal is not None:
                self._cond.wait(SAFETY_RECHECK_S)
                return None
            mirror, lease = self._mirror(), self._lease()
            if not mirror.loaded or mirror.closed or lease is None or self._released():
                self._cond.wait(SAFETY_RECHECK_S)
                return None
            if mirror.coordinator is None:
                if duty.elect_tried_at == mirror.revision:  # our try's outcome is not in the mirror yet
                    self._cond.wait(SAFETY_RECHECK_S)
                    if self._mirror().revision == duty.elect_tried_at:
                        duty.elect_tried_at = None  # nothing came: try again
                    return None
                if self._renewing():  # our lease is being replaced: elect on the new one
                    self._cond.wait(SAFETY_RECHECK_S)
                    return None
                now = self._clock()
                if duty.elect_after is None:
                    duty.elect_after = now + random.uniform(0.0, election_spread(self._config.max_nodes))
                if now < duty.elect_after:
                    self._cond.wait(duty.elect_after - now)  # a winner's key wakes us (and we do not try)
                    return None
                duty.elect_after = None
                duty.elect_tried_at = mirror.revision
                return lambda: self._rounds.elect(lease)
            if mirror.coordinator != (self._node_id, lease) or not mirror.full:
                duty.reset()
                self._cond.wait(SAFETY_RECHECK_S)
                return None
            committed = mirror.committed
            reform = reform_of(committed, mirror.nodes, mirror.joins.get(committed.number + 1, {}) if committed else (),
                               self._updater.lost.get(committed.number, ()) if committed else (), self._config.max_nodes,
                               mirror.closed)
            posted = duty.reform if duty.reform is not None else mirror.reform
            if reform is not None and reform.news_after(posted):
                duty.reform = reform
                return lambda: self._rounds.post_reform(reform)
            target = (committed.number if committed else 0) + 1
            if duty.target != (target, mirror.committed_mod):
                duty.target, duty.last_call, duty.rejoin = (target, mirror.committed_mod), None, None
            snap = snapshot_of(mirror, node_id=self._node_id, config=self._config, now=self._clock(), target=target,
                               join_deadline=float("inf"), last_call=duty.last_call, rejoin=duty.rejoin)
            decision = coordinate(snap)
            if decision.reason != duty.reason:
                log.debug("%scoordinator, round %d: %s (%s)", self._ctx(), target, decision.action.value, decision.reason)
                duty.reason = decision.reason
            if decision.action is Action.START_LAST_CALL:
                duty.last_call = snap.now + self._config.last_call_timeout
                duty.rejoin = snap.now + self._config.rejoin_timeout
                return None
            current = mirror.proposal
            seen_mod, proposal_mod = mirror.committed_mod, current.mod_revision if current is not None else 0
            proposal = (target, decision.participants, seen_mod, proposal_mod)
            if decision.action is Action.PROPOSE and duty.proposed != proposal and not (
                current is not None and current.number == target and current.participants == decision.participants
            ):
                duty.proposed = proposal
                ring = {n: [p.addr, p.port, p.lease] for n in decision.participants if (p := mirror.peers.get(n)) is not None}
                return lambda: self._rounds.propose(target, decision.participants, seen_mod, proposal_mod, lease, ring)
            self._cond.wait(wait_time(decision, self._clock))
            return None
